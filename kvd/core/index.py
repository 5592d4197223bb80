"""The block index: key -> slot, block states and pins, and the moves between states.

A block is PENDING from Allocate until every tensor-parallel rank of its tenant stored
its share, then READY. Only READY blocks are visible to lookups and offered to the
eviction policy. A pin (from a lease or an in-flight transfer) keeps a block from being
evicted or freed; a slot is returned to the allocator only when its pins reach zero.
Time is passed in (``now``, seconds); the index never reads a clock.

The index owns ``LeaseTable`` (kvd/core/lease_table.py) and ``PendingStores``
(kvd/core/pending.py), each with its own tables, and the ``Evictor`` (kvd/core/
eviction.py), which reads and updates the block table itself, as kvd/core/snapshot.py
does for a restart.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.eviction import Evictor
from kvd.core.lease_table import LeaseTable
from kvd.core.pending import PendingCall, PendingStores
from kvd.core.states import FREE, NO_SLOT, PENDING, READY
from kvd.core.policies.base import EvictionPolicy, first_places
from kvd.core.tenants import Tenant, unscoped

_NO_SLOTS = np.zeros(0, dtype=np.int64)
_FEW_PINS = 8  # up to this many slots, pin one by one (see Index.pin)


@dataclass
class AllocateResult:
    slots: list[int]  # one per key answered; NO_SLOT where already stored
    evicted: list[bytes]  # the caller tenant's keys evicted to make room (unscoped)
    allocated: int  # keys[:allocated] were answered; the rest found no room
    evicted_total: int = 0  # blocks of any tenant evicted


@dataclass
class IndexCounters:
    hit_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    failed_stores: int = 0
    expired_leases: int = 0
    expired_pending: int = 0
    no_space: int = 0


@dataclass
class Index:
    allocator: Allocator
    policy: EvictionPolicy
    # Two maps on purpose: lookups hit the per-tenant map with the keys exactly as they
    # came off the wire (no per-key concatenation on the hot path); the policy and
    # eviction use tenant-scoped keys (tenant id bytes + key) through ``entries``.
    entries: dict[bytes, int] = field(default_factory=dict)  # scoped key -> slot
    counters: IndexCounters = field(default_factory=IndexCounters)
    # When on, commits and drops of READY blocks are queued in ``events`` (plain
    # tuples; the shell writes them to the journal and publishes them as KV events).
    record: bool = False
    first_lease: int = 1  # see LeaseTable

    def __post_init__(self) -> None:
        n = self.allocator.max_slots
        self.state = np.zeros(n, dtype=np.uint8)
        self.pins = np.zeros(n, dtype=np.int32)
        self.tenant_of = np.zeros(n, dtype=np.uint32)
        self.rank_mask = np.zeros(n, dtype=np.uint64)
        self.gen = np.zeros(n, dtype=np.uint32)  # bumped each time a slot is handed out
        self._depth = np.zeros(n, dtype=np.int64)  # of PENDING and READY blocks
        self._slot_key: dict[int, bytes] = {}
        self._slot_tenant: dict[int, Tenant] = {}
        self.pending = PendingStores()
        self._doomed: set[int] = set()  # PENDING slots to free once unpinned
        self._pin_calls = 0  # pin calls not yet unpinned: at zero no slot is pinned
        self.leases = LeaseTable(self.first_lease)
        self._spaces: dict[int, dict[bytes, int]] = {}  # tenant id -> key -> slot
        # READY blocks only: a lookup's leading run is then just "found in this map",
        # with no per-key state check (the 1,000-key lookup is the hot path).
        self._ready: dict[int, dict[bytes, int]] = {}
        self._touches: list[tuple[list[int], int]] = []  # hits not yet told to the policy
        self.checksums: dict[int, list[int]] = {}  # READY slot -> per-rank xxh3
        # While recording: READY slot -> the key before it in its chain, when known (for
        # the journal and the blocks re-announced after a flush or a warm restart).
        self.parents: dict[int, bytes | None] = {}
        # ("commit", tenant, key, slot, depth, sums, parent key | None)
        # | ("drop", slot, tenant, key)
        self.events: list[tuple] = []
        # For the tiers (None: off). ``fresh``: runs of blocks that became READY, as
        # (tenant, keys, slots, depth of keys[0]); ``demoted``: READY blocks evicted for
        # room, as (tenants, keys, slots, depths, checksums or None), whose bytes stay in
        # their slots until the caller hands the slots out again.
        self.fresh: list[tuple[Tenant, list[bytes], list[int], int]] | None = None
        self.demoted: list[tuple[list[Tenant], list[bytes], list[int], list[int],
                                 list[list[int] | None]]] | None = None
        self.evictor = Evictor(self)  # what leaves the cache, and when a slot is free
        self._capacity_bound = self.policy.capacity  # see Allocator.fit

    # ------------------------------------------------------------ queries
    def holds(self, tenant_id: int, key: bytes) -> bool:
        """Whether the tenant has a READY block under ``key``."""
        return key in self._ready.get(tenant_id, ())

    def known(self, tenant_id: int, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` the tenant has a block for, READY or being stored."""
        return sum(map(self._spaces.get(tenant_id, {}).__contains__, keys))

    @property
    def ready_blocks(self) -> int:
        return len(self.policy)

    @property
    def pending_blocks(self) -> int:
        return len(self.pending)

    @property
    def pinned_blocks(self) -> int:
        return int(np.count_nonzero(self.pins))

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
        """(hits, hit slots, lease id, pending after the hits) for the leading run.

        The policy hears about the hits at the next ``flush`` (every mutating call
        flushes first), so the caller can answer before paying for it.
        """
        found = list(map(self._ready.get(tenant.id, {}).get, keys))
        try:
            hits = found.index(None)
        except ValueError:
            hits = len(found)
        pending = 0
        if hits < len(keys):  # how many keys right after the run are being stored
            ns = self._spaces.get(tenant.id, {})
            for key in keys[hits:]:
                slot = ns.get(key)
                if slot is None or self.state[slot] != PENDING:
                    break
                pending += 1
        if not hits:
            return 0, _NO_SLOTS[:0], 0, pending
        del found[hits:]
        hit_slots = np.frombuffer(array("I", found), dtype=np.uint32)
        lease = 0
        if hits:
            self.counters.hit_blocks += hits
            self._touches.append((found, depth))
            if lease_s is not None:
                self.pin(hit_slots)
                lease = self.leases.open(owner, hit_slots, now + lease_s)
        return hits, hit_slots, lease, pending

    def contains(self, tenant: Tenant, key: bytes) -> int:
        """State of one key (FREE when absent)."""
        slot = self._spaces.get(tenant.id, {}).get(key)
        return FREE if slot is None else int(self.state[slot])

    def flush(self) -> None:
        """Tell the policy about the hits of past lookups, in order."""
        if not self._touches:
            return
        touches, self._touches = self._touches, []
        slot_key, touch = self._slot_key.__getitem__, self.policy.touch
        for slots, depth in touches:
            touch(list(map(slot_key, slots)), depth)

    # ------------------------------------------------------------ leases and pins
    def release(self, lease_id: int, owner: int | None = None,
                slots: np.ndarray | None = None) -> bool:
        """Drop the lease, or only its ``slots`` (the rest stays leased)."""
        lease = self.leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            return False
        if slots is not None:
            gone = self.leases.shrink(lease, slots)
            if gone is not None:
                self.unpin(gone, calls=0)  # the lease's one pin call stays open
                return True
        self.unpin(self.leases.close(lease_id).slots)
        return True

    # pin/unpin count a slot once per call even if it repeats (fancy indexing, ~15x
    # faster than np.add.at); both sides do the same, so counts stay balanced. A few
    # slots (a 1-key lookup's lease) go one by one: fancy indexing costs ~3 us at any size.
    def pin(self, slots: np.ndarray) -> None:
        self._add_pins(slots, 1)
        self._pin_calls += 1

    def unpin(self, slots: np.ndarray, calls: int = 1) -> None:
        self._add_pins(slots, -1)
        self._pin_calls -= calls
        if self._doomed:  # a set: a slot repeated in ``slots`` is freed once
            for s in {s for s in slots.tolist() if s in self._doomed}:
                if self.pins[s] == 0:
                    self._doomed.discard(s)
                    self.evictor.free(s)

    def _add_pins(self, slots: np.ndarray, n: int) -> None:
        if len(slots) > _FEW_PINS:
            self.pins[slots] += n
            return
        pins = self.pins
        for s in set(slots.tolist()):
            pins[s] += n

    # ------------------------------------------------------------ stores
    def allocate(
        self,
        tenant: Tenant,
        keys: Sequence[bytes],
        *,
        owner: int = 0,
        depth: int = 0,
        length: int = 0,
        now: float = 0.0,
        pending_s: float = 60.0,
        parent: bytes | None = None,
        chained: bool = True,
    ) -> AllocateResult:
        """Slots for the keys not stored yet, evicting READY unpinned blocks if needed.
        ``parent``: the key before ``keys[0]`` in its chain (for the KV events);
        ``chained``: whether each key's parent is the key before it.

        Keys already present (PENDING or READY) get NO_SLOT. Allocation stops at the
        first key that finds no room; ``allocated`` says how many keys were answered.
        """
        self.flush()
        pfx = tenant.prefix
        ns = self._spaces.setdefault(tenant.id, {})
        if True in map(ns.__contains__, keys):
            new = [i for i, k in enumerate(keys) if k not in ns]
        else:  # the usual case: nothing stored yet (checked in C)
            new = list(range(len(keys)))
        new = first_places(keys, new)  # a repeated key gets one slot, at its first place
        need = len(new) - self.allocator.free_slots(tenant.slot_bytes)
        self.allocator.fit(self.policy, self._capacity_bound, keep=tenant.slot_bytes)
        evicted: list[bytes] = []
        total = 0
        if need > 0:
            # The keys of this call already held belong to the chain it stores: making
            # room must not evict them (it did, in a full pool: the new blocks then
            # followed blocks that were gone, and the call answered them present).
            held = (np.array([ns[k] for k in keys if k in ns], dtype=np.int64)
                    if len(new) < len(keys) else None)
            if held is not None:
                self.pin(held)
            try:
                total = self.evictor.make_room(tenant, need, len(new), evicted)
            finally:
                if held is not None:
                    self.unpin(held)
        slots = [NO_SLOT] * len(keys)
        answered = len(keys)
        deadline = now + pending_s
        length = max(length, depth + len(keys))
        got = self.allocator.alloc_many(tenant.slot_bytes, len(new))
        if len(got) < len(new):
            answered = new[len(got)]
            self.counters.no_space += 1
            del new[len(got):]
        if got:  # dict updates and one numpy call per array, not a loop per slot
            fresh = len(new) == len(keys)  # the usual case: nothing stored, no repeats
            plain = list(keys[:len(got)]) if fresh else [keys[i] for i in new]
            scoped = list(map(pfx.__add__, plain))
            ns.update(zip(plain, got))
            self.entries.update(zip(scoped, got))
            self._slot_key.update(zip(got, scoped))
            self._slot_tenant.update(dict.fromkeys(got, tenant))
            self.pending.add(got, PendingCall.of(
                owner, deadline, tenant, length, keys, range(len(got)) if fresh else new,
                depth, parent, chained))
            if fresh:
                slots = got + slots[len(got):]
            else:
                for i, slot in zip(new, got):
                    slots[i] = slot
            arr = np.array(got, dtype=np.int64)
            self.state[arr] = PENDING
            self.tenant_of[arr] = tenant.id
            self.rank_mask[arr] = 0
            self.gen[arr] += 1
            self._depth[arr] = (np.arange(depth, depth + len(got)) if fresh
                                else np.array(new, dtype=np.int64) + depth)
        return AllocateResult(slots[:answered], evicted, answered, total)

    def store_done(self, slots: np.ndarray, rank: int,
                   checksums: Sequence[int] | None = None) -> int:
        """One rank finished copying into these PENDING slots; returns blocks now READY.

        ``checksums`` (one per slot, of this rank's share) are kept for verification
        and the journal."""
        self.flush()
        bit = np.uint64(1 << rank)
        s = slots.astype(np.int64, copy=False)
        live = self.state[s] == PENDING  # so never doomed: those are FREE
        if not live.all():
            s = s[live]
        self.rank_mask[s] |= bit
        order = s.tolist()
        if checksums is not None:
            self.pending.add_sums(order, [c for c, ok in zip(checksums, live.tolist()) if ok],
                                  rank)
        ready, owners = self.pending.finished(order, s, self.rank_mask, rank)
        if ready:
            arr = s if ready is order else np.array(ready, dtype=np.int64)
            self.state[arr] = READY
            self._commit(ready, owners, self._depth[arr].tolist())
        self.counters.stored_blocks += len(ready)
        return len(ready)

    def _commit(self, slots: list[int], owners: list[PendingCall],
                depths: list[int]) -> None:
        """Hand newly READY blocks to the policy, a run (one allocate call, consecutive
        depths) per ``insert_many``: one call per request, not one per block."""
        keys = list(map(self._slot_key.__getitem__, slots))
        n, start = len(slots), 0
        while start < n:
            p, d0 = owners[start], depths[start]
            end = start + 1
            if start == 0 and owners.count(p) == n and depths == list(range(d0, d0 + n)):
                end = n  # the usual case, one run: checked at C speed
            else:
                while end < n and owners[end] is p and depths[end] == d0 + end - start:
                    end += 1
            self.policy.insert_many(keys[start:end], d0, p.length)
            ready = self._ready.setdefault(p.tenant.id, {})
            plain = list(map(unscoped, keys[start:end]))
            ready.update(zip(plain, slots[start:end]))
            if self.fresh is not None:
                self.fresh.append((p.tenant, plain, slots[start:end], d0))
            p.tenant.blocks += end - start
            self.pending.by_owner.add(p.owner, start - end)
            start = end
        self.pending.move_sums(slots, self.checksums)
        if self.record:  # the parent: the key before in the same Allocate, else the one
            sums_of = self.checksums.get  # its sender named before its first key
            parents = list(map(PendingCall.parent_at, owners, depths))
            self.parents.update(zip(slots, parents))
            self.events.extend(("commit", p.tenant.id, key[4:], slot, d, sums_of(slot, []),
                                parent)
                               for p, key, slot, d, parent in zip(owners, keys, slots, depths,
                                                                  parents))

    def abort(self, slots: np.ndarray) -> int:
        """Drop PENDING slots (a failed or abandoned store); freed once unpinned. In one
        batch: an engine leaving with 786k blocks pending held the loop 5-10 s."""
        self.flush()
        slots = np.unique(slots[(slots >= 0) & (slots < len(self.state))])
        ours = self.pending.drop(slots[self.state[slots] == PENDING].tolist())
        self.evictor.drop_many(ours)
        self.counters.failed_stores += len(ours)
        return len(ours)

    def discard(self, slots: Sequence[int]) -> int:
        """Remove READY blocks now (e.g. they failed verification); a slot still pinned
        by a lease or a copy is freed when its pins reach zero."""
        self.flush()
        n = 0
        for slot in slots:
            if self.state[slot] == READY:
                self.policy.remove(self._slot_key[slot])
                self.evictor.drop(slot)
                n += 1
        return n

    # ------------------------------------------------------------ housekeeping
    def evict_tenant(self, tenant: Tenant | None) -> int:
        """Admin eviction of READY unpinned blocks (one tenant, or all when None)."""
        return self.evictor.evict_tenant(tenant)

    def evictable(self, tenant: Tenant | None) -> np.ndarray:
        """The slots an admin eviction takes, for ``evict_slots`` to take in parts."""
        return self.evictor.evictable(tenant)

    def evict_slots(self, slots: np.ndarray, tenant: Tenant | None) -> int:
        """Admin eviction of those of ``slots`` still READY, unpinned and ``tenant``'s."""
        return self.evictor.evict_slots(slots, tenant)

    def forget(self, tenant: Tenant) -> None:
        """A tenant dropped (the tenant limit): its key tables go, now if empty, else
        with its last block (``Evictor``). Each new fingerprint (engines restarted with
        a random root hash) left two for good."""
        self.evictor.forget_empty(tenant)

    def expire(self, now: float) -> tuple[int, int]:
        """Release leases and PENDING stores past their deadlines."""
        self.flush()
        old = self.leases.expired(now)
        for lid in old:
            self.release(lid)
        stale = self.pending.expired(now)
        self.abort(np.array(stale, dtype=np.int64))
        self.counters.expired_leases += len(old)
        self.counters.expired_pending += len(stale)
        return len(old), len(stale)

    def drop_owner(self, owner: int) -> tuple[int, int]:
        """A client went away: release its leases and its PENDING stores."""
        self.flush()
        leases = self.leases.of_owner(owner)
        for lid in leases:
            self.release(lid)
        stale = self.pending.of_owner(owner)
        self.abort(np.array(stale, dtype=np.int64))
        return len(leases), len(stale)
