"""The block index: key -> slot, block states, pins and leases.

A block is PENDING from Allocate until every tensor-parallel rank of its tenant stored
its share, then READY. Only READY blocks are visible to lookups and offered to the
eviction policy. A pin (from a lease or an in-flight transfer) keeps a block from being
evicted or freed; a slot is returned to the allocator only when its pins reach zero.
Time is passed in (``now``, seconds); the index never reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.policies.base import EvictionPolicy
from kvd.core.tenants import Tenant

FREE, PENDING, READY = 0, 1, 2
NO_SLOT = 0xFFFFFFFF


@dataclass
class Lease:
    id: int
    owner: int
    slots: np.ndarray
    deadline: float


@dataclass
class AllocateResult:
    slots: list[int]  # one per key answered; NO_SLOT where already stored
    evicted: list[bytes]  # the caller tenant's keys evicted to make room (unscoped)
    allocated: int  # keys[:allocated] were answered; the rest found no room
    evicted_total: int = 0  # blocks of any tenant evicted


@dataclass
class _Pending:
    owner: int
    deadline: float
    depth: int
    tenant: Tenant


@dataclass
class IndexCounters:
    lookups: int = 0
    lookup_keys: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    failed_stores: int = 0
    expired_leases: int = 0
    expired_pending: int = 0
    no_space: int = 0


@dataclass
class Index:
    allocator: Allocator
    policy: EvictionPolicy
    entries: dict[bytes, int] = field(default_factory=dict)  # scoped key -> slot
    counters: IndexCounters = field(default_factory=IndexCounters)

    def __post_init__(self) -> None:
        n = self.allocator.max_slots
        self.state = np.zeros(n, dtype=np.uint8)
        self.pins = np.zeros(n, dtype=np.int32)
        self.tenant_of = np.zeros(n, dtype=np.uint32)
        self.rank_mask = np.zeros(n, dtype=np.uint64)
        self._slot_key: dict[int, bytes] = {}
        self._slot_tenant: dict[int, Tenant] = {}
        self._pending: dict[int, _Pending] = {}
        self._doomed: set[int] = set()  # PENDING slots to free once unpinned
        self._leases: dict[int, Lease] = {}
        self._next_lease = 1

    # ------------------------------------------------------------ queries
    @property
    def ready_blocks(self) -> int:
        return len(self.policy)

    @property
    def pending_blocks(self) -> int:
        return len(self._pending)

    @property
    def pinned_blocks(self) -> int:
        return int(np.count_nonzero(self.pins))

    @property
    def leases(self) -> int:
        return len(self._leases)

    def lookup(
        self,
        tenant: Tenant,
        keys: Sequence[bytes],
        *,
        owner: int = 0,
        depth: int = 0,
        now: float = 0.0,
        lease_s: float | None = None,
    ) -> tuple[int, np.ndarray, int, int]:
        """(hits, hit slots, lease id, pending after the hits) for the leading run."""
        self.counters.lookups += 1
        self.counters.lookup_keys += len(keys)
        pfx = tenant.prefix
        scoped = [pfx + k for k in keys]
        found = list(map(self.entries.get, scoped))
        try:
            present = found.index(None)
        except ValueError:
            present = len(found)
        slots = np.array(found[:present], dtype=np.int64)
        states = self.state[slots]
        not_ready = np.flatnonzero(states != READY)
        hits = int(not_ready[0]) if not_ready.size else present
        rest = states[hits:]
        not_pending = np.flatnonzero(rest != PENDING)
        pending = int(not_pending[0]) if not_pending.size else len(rest)
        hit_slots = slots[:hits]
        lease = 0
        if hits:
            self.counters.hit_blocks += hits
            self.policy.touch(scoped[:hits], depth)
            if lease_s is not None:
                np.add.at(self.pins, hit_slots, 1)
                lease = self._next_lease
                self._next_lease += 1
                self._leases[lease] = Lease(lease, owner, hit_slots, now + lease_s)
        return hits, hit_slots, lease, pending

    def contains(self, tenant: Tenant, key: bytes) -> int:
        """State of one key (FREE when absent)."""
        slot = self.entries.get(tenant.prefix + key)
        return FREE if slot is None else int(self.state[slot])

    # ------------------------------------------------------------ leases
    def release(self, lease_id: int, owner: int | None = None) -> bool:
        lease = self._leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            return False
        del self._leases[lease_id]
        self.unpin(lease.slots)
        return True

    def lease_owner(self, lease_id: int) -> int | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else lease.owner

    def pin(self, slots: np.ndarray) -> None:
        np.add.at(self.pins, slots, 1)

    def unpin(self, slots: np.ndarray) -> None:
        np.subtract.at(self.pins, slots, 1)
        if self._doomed:
            for s in [int(s) for s in slots if int(s) in self._doomed]:
                if self.pins[s] == 0:
                    self._doomed.discard(s)
                    self._free(s)

    # ------------------------------------------------------------ stores
    def allocate(
        self,
        tenant: Tenant,
        keys: Sequence[bytes],
        *,
        owner: int = 0,
        depth: int = 0,
        now: float = 0.0,
        pending_s: float = 60.0,
    ) -> AllocateResult:
        """Slots for the keys not stored yet, evicting READY unpinned blocks if needed.

        Keys already present (PENDING or READY) get NO_SLOT. Allocation stops at the
        first key that finds no room; ``allocated`` says how many keys were answered.
        """
        pfx = tenant.prefix
        scoped = [pfx + k for k in keys]
        new = [i for i, k in enumerate(scoped) if k not in self.entries]
        need = len(new) - self.allocator.free_slots(tenant.slot_bytes)
        evicted: list[bytes] = []
        total = 0
        if need > 0:
            total = self._evict_for(tenant, need, len(new), evicted)
        slots = [NO_SLOT] * len(keys)
        answered = len(keys)
        deadline = now + pending_s
        for i in new:
            slot = self.allocator.alloc(tenant.slot_bytes)
            if slot is None:
                answered = i
                self.counters.no_space += 1
                break
            key = scoped[i]
            self.entries[key] = slot
            self._slot_key[slot] = key
            self._slot_tenant[slot] = tenant
            self.state[slot] = PENDING
            self.tenant_of[slot] = tenant.id
            self.rank_mask[slot] = 0
            self._pending[slot] = _Pending(owner, deadline, depth + i, tenant)
            slots[i] = slot
        return AllocateResult(slots[:answered], evicted, answered, total)

    def store_done(self, slots: np.ndarray, rank: int) -> int:
        """One rank finished copying into these PENDING slots; returns blocks now READY."""
        bit = np.uint64(1 << rank)
        s = slots.astype(np.int64, copy=False)
        s = s[self.state[s] == PENDING]
        self.rank_mask[s] |= bit
        ready = 0
        for slot in s.tolist():
            p = self._pending.get(slot)
            if p is None or slot in self._doomed:
                continue
            if int(self.rank_mask[slot]) == p.tenant.full_mask:
                del self._pending[slot]
                self.state[slot] = READY
                p.tenant.blocks += 1
                self.policy.insert(self._slot_key[slot], p.depth)
                ready += 1
        self.counters.stored_blocks += ready
        return ready

    def abort(self, slots: np.ndarray) -> int:
        """Drop PENDING slots (a failed or abandoned store); freed once unpinned."""
        n = 0
        for slot in slots.tolist():
            if slot < len(self.state) and self.state[slot] == PENDING and slot in self._pending:
                del self._pending[slot]
                self._drop_entry(slot)
                n += 1
        self.counters.failed_stores += n
        return n

    # ------------------------------------------------------------ housekeeping
    def expire(self, now: float) -> tuple[int, int]:
        """Release leases and PENDING stores past their deadlines."""
        old = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in old:
            self.release(lid)
        stale = [s for s, p in self._pending.items() if p.deadline <= now]
        self.abort(np.array(stale, dtype=np.int64))
        self.counters.expired_leases += len(old)
        self.counters.expired_pending += len(stale)
        return len(old), len(stale)

    def next_deadline(self) -> float | None:
        ds = [lease.deadline for lease in self._leases.values()]
        ds += [p.deadline for p in self._pending.values()]
        return min(ds) if ds else None

    def drop_owner(self, owner: int) -> tuple[int, int]:
        """A client went away: release its leases and its PENDING stores."""
        leases = [lid for lid, lease in self._leases.items() if lease.owner == owner]
        for lid in leases:
            self.release(lid)
        stale = [s for s, p in self._pending.items() if p.owner == owner]
        self.abort(np.array(stale, dtype=np.int64))
        return len(leases), len(stale)

    def evict_tenant(self, tenant: Tenant | None) -> int:
        """Admin eviction of READY unpinned blocks (one tenant, or all when None)."""
        victims = [
            key
            for key in self.policy.victims()
            if (slot := self.entries[key]) is not None
            and self.pins[slot] == 0
            and (tenant is None or self.tenant_of[slot] == tenant.id)
        ]
        for key in victims:
            self.policy.remove(key)
            self._drop_entry(self.entries[key])
        self.counters.evicted_blocks += len(victims)
        return len(victims)

    # ------------------------------------------------------------ internals
    def _evict_for(self, tenant: Tenant, need: int, n_new: int, out: list[bytes]) -> int:
        """Evict up to ``need`` blocks so ``tenant`` can allocate; same size class first."""
        want = tenant.slot_bytes
        chosen: list[bytes] = []
        for key in self.policy.victims():
            slot = self.entries[key]
            if self.pins[slot] == 0 and self.allocator.slot_bytes_of(slot) == want:
                chosen.append(key)
                if len(chosen) == need:
                    break
        n = self._evict_keys(chosen, tenant, out)
        # Still short: empty whole extents of other size classes, in policy order.
        while self.allocator.free_slots(want) < n_new and len(self.policy):
            before = len(self.policy)
            extra = []
            for key in self.policy.victims():
                slot = self.entries[key]
                if self.pins[slot] == 0:
                    extra.append(key)
                    if len(extra) >= 64:
                        break
            n += self._evict_keys(extra, tenant, out)
            if len(self.policy) == before:
                break
        return n

    def _evict_keys(self, keys: list[bytes], tenant: Tenant, out: list[bytes]) -> int:
        pfx = tenant.prefix
        for key in keys:
            slot = self.entries[key]
            self.policy.evicted(key)
            if key[:4] == pfx:
                out.append(key[4:])
            self._drop_entry(slot)
        self.counters.evicted_blocks += len(keys)
        return len(keys)

    def _drop_entry(self, slot: int) -> None:
        key = self._slot_key.pop(slot)
        del self.entries[key]
        t = self._slot_tenant.pop(slot)
        if self.state[slot] == READY:
            t.blocks -= 1
        self.state[slot] = FREE
        if self.pins[slot] > 0:
            self._doomed.add(slot)  # an in-flight copy still uses it
        else:
            self._free(slot)

    def _free(self, slot: int) -> None:
        self.rank_mask[slot] = 0
        self.tenant_of[slot] = 0
        self.allocator.free(slot)
