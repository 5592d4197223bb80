"""Taking blocks out of the index: eviction for room, admin eviction, and freeing slots.

``Index`` (kvd/core/index.py) owns one ``Evictor`` and delegates to it, to keep each file
about one thing: the index decides what is in the cache; this decides what leaves and
when a slot is free again (never while a copy or a lease still pins it).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Any, Protocol

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.policies.base import EvictionPolicy
from kvd.core.states import FREE, PENDING, READY
from kvd.core.tenants import Tenant, unscoped


class Table(Protocol):
    """What the evictor reads and updates of its ``Index`` (kvd/core/index.py): its block
    table. A protocol, so that this module does not import the index back."""

    policy: EvictionPolicy
    allocator: Allocator
    counters: Any  # IndexCounters
    entries: dict[bytes, int]
    state: np.ndarray
    pins: np.ndarray
    tenant_of: np.ndarray
    rank_mask: np.ndarray
    checksums: dict[int, list[int]]
    record: bool
    events: list[tuple]
    demoted: list[tuple] | None
    _depth: np.ndarray
    _slot_key: dict[int, bytes]
    _slot_tenant: dict[int, Tenant]
    _ready: dict[int, dict[bytes, int]]
    _spaces: dict[int, dict[bytes, int]]
    _doomed: set[int]
    _pin_calls: int

    def flush(self) -> None: ...


class Evictor:
    """Takes blocks out of one ``Index``: it reads and updates the index's block table
    (the index owns it; the evictor holds no state of its own), so the two always agree."""

    def __init__(self, index: Table) -> None:
        self.ix = index

    def evict_tenant(self, tenant: Tenant | None) -> int:
        """Admin eviction of READY unpinned blocks (one tenant, or all when None)."""
        ix = self.ix
        ix.flush()
        policy, entries, pins = ix.policy, ix.entries, ix.pins
        victims = [
            key
            for key in policy.victims()
            if (slot := entries[key]) is not None
            and pins[slot] == 0
            and (tenant is None or ix.tenant_of[slot] == tenant.id)
        ]
        for key in victims:
            policy.remove(key)
            slot = entries[key]
            ix.counters.evicted_bytes += ix._slot_tenant[slot].slot_bytes
            self.drop(slot)
        ix.counters.evicted_blocks += len(victims)
        return len(victims)

    def make_room(self, tenant: Tenant, need: int, n_new: int, out: list[bytes]) -> int:
        """Evict up to ``need`` blocks so ``tenant`` can allocate ``n_new``; same size
        class first. The caller's keys among the victims go to ``out``."""
        ix = self.ix
        policy, allocator = ix.policy, ix.allocator
        want = tenant.slot_bytes
        chosen: list[bytes] = []
        entries, pin_of, bytes_of = ix.entries, ix.pins.item, allocator.slot_bytes_of
        if allocator.size_classes == 1 and not ix._pin_calls:  # any will do
            return self._evict_keys(policy.evict(need), tenant, out, told=True)
        if allocator.size_classes == 1:  # every READY block has this size
            for key in policy.victims():
                if pin_of(entries[key]) == 0:
                    chosen.append(key)
                    if len(chosen) == need:
                        break
        else:
            for key in policy.victims():
                slot = entries[key]
                if pin_of(slot) == 0 and bytes_of(slot) == want:
                    chosen.append(key)
                    if len(chosen) == need:
                        break
        n = self._evict_keys(chosen, tenant, out)
        if allocator.free_slots(want) < n_new:  # still short
            n += self._empty_extents(tenant, n_new, out)
        return n

    def _empty_extents(self, tenant: Tenant, n_new: int, out: list[bytes]) -> int:
        """Room for ``n_new`` slots of ``tenant``'s size by emptying whole extents of
        other sizes. Only an extent whose every block is READY and unpinned can empty: a
        lease or a store in one keeps it (evicting its other blocks freed nothing, and
        evicting in policy order until the policy ran dry emptied another tenant's whole
        cache for no slot). Fewest blocks first: the least lost per extent freed."""
        ix = self.ix
        alloc = ix.allocator
        want = tenant.slot_bytes
        short = n_new - alloc.free_slots(want)
        spm = alloc.slots_per_extent_max
        state = ix.state.reshape(alloc.n_extents, spm)
        stuck = ((state == PENDING) | (ix.pins.reshape(alloc.n_extents, spm) > 0)).any(axis=1)
        sizes = alloc.extent_slot_bytes()
        ready = (state == READY).sum(axis=1)
        free_able = np.flatnonzero(~stuck & (sizes != want) & (sizes != 0))
        if not len(free_able) or short <= 0:
            return 0
        extents = free_able[np.argsort(ready[free_able], kind="stable")]
        extents = extents[:-(-short // alloc.per_extent(want))]
        rows, cols = np.nonzero(state[extents] == READY)
        slots = (extents[rows] * spm + cols).tolist()
        keys = list(map(ix._slot_key.__getitem__, slots))
        deque(map(ix.policy.remove, keys), maxlen=0)  # not its victims: its own order
        return self._evict_keys(keys, tenant, out, told=True)

    def _evict_keys(self, keys: list[bytes], tenant: Tenant, out: list[bytes],
                    told: bool = False) -> int:
        """Evict ``keys`` (offered by the policy; ``told``: it already evicted them)."""
        ix = self.ix
        slots = list(map(ix.entries.__getitem__, keys))
        if not told:
            ix.policy.evicted_many(keys)
        if ix.demoted is not None and slots:  # READY victims may go down a tier
            ix.demoted.append((list(map(ix._slot_tenant.__getitem__, slots)),
                               list(map(unscoped, keys)), slots, ix._depth[slots].tolist(),
                               list(map(ix.checksums.get, slots))))
        self.drop_many(slots, victims=True, caller=tenant, out=out)
        ix.counters.evicted_blocks += len(keys)
        return len(keys)

    def drop_many(self, slots: list[int], victims: bool = False,
                  caller: Tenant | None = None, out: list[bytes] | None = None) -> None:
        """``drop`` for many slots, with one numpy call per array. ``victims``: the
        slots are READY and unpinned (eviction checked), so no need to look; the keys
        of ``caller`` among them are appended to ``out``."""
        if not slots:
            return
        ix = self.ix
        arr = np.array(slots, dtype=np.int64)
        if victims:
            ready = pinned = None
        else:
            ready = ix.state[arr] == READY
            pinned = ix.pins[arr] > 0
        keys = list(map(ix._slot_key.pop, slots))
        deque(map(ix.entries.__delitem__, keys), maxlen=0)
        tenants = list(map(ix._slot_tenant.pop, slots))
        plain = list(map(unscoped, keys))
        is_ready = [True] * len(slots) if ready is None else ready.tolist()
        one = tenants.count(tenants[0]) == len(tenants)  # one tenant, the usual case
        if out is not None and caller is not None:
            cid = caller.id
            out.extend(plain if one and tenants[0].id == cid
                       else [k for k, t in zip(plain, tenants) if t.id == cid])
        if one:
            tid = tenants[0].id
            deque(map(ix._spaces[tid].__delitem__, plain), maxlen=0)
            ready_map = ix._ready.get(tid, {})
            deque(map(ready_map.pop, plain, repeat(None)), maxlen=0)
            tenants[0].blocks -= is_ready.count(True)
        else:
            for t, key, r in zip(tenants, plain, is_ready):
                del ix._spaces[t.id][key]
                ix._ready.get(t.id, {}).pop(key, None)
                t.blocks -= r
        if ix.checksums or ix.record:
            for slot, r, t, key in zip(slots, is_ready, tenants, plain):
                if r:
                    ix.checksums.pop(slot, None)
                    ix.parents.pop(slot, None)
                    if ix.record:
                        ix.events.append(("drop", slot, t.id, key))
        if victims:
            ix.counters.evicted_bytes += (tenants[0].slot_bytes * len(slots) if one
                                          else sum(t.slot_bytes for t in tenants))
        ix.state[arr] = FREE
        free = slots
        if pinned is not None and pinned.any():  # copies in flight: freed once unpinned
            ix._doomed.update(arr[pinned].tolist())
            arr = arr[~pinned]
            free = arr.tolist()
        ix.rank_mask[arr] = 0
        ix.tenant_of[arr] = 0
        ix.allocator.free_many(free)

    def drop(self, slot: int) -> None:
        """Take one block (PENDING or READY) out of the index; its slot is freed now,
        or once the copies or leases pinning it let go."""
        ix = self.ix
        key = ix._slot_key.pop(slot)
        del ix.entries[key]
        t = ix._slot_tenant.pop(slot)
        del ix._spaces[t.id][key[4:]]
        ix._ready.get(t.id, {}).pop(key[4:], None)
        if ix.state[slot] == READY:
            t.blocks -= 1
            ix.checksums.pop(slot, None)
            ix.parents.pop(slot, None)
            if ix.record:
                ix.events.append(("drop", slot, t.id, key[4:]))
        ix.state[slot] = FREE
        if ix.pins[slot] > 0:
            ix._doomed.add(slot)  # an in-flight copy still uses it
        else:
            self.free(slot)

    def free(self, slot: int) -> None:
        """Return an unpinned, dropped slot to the allocator."""
        ix = self.ix
        ix.rank_mask[slot] = 0
        ix.tenant_of[slot] = 0
        ix.allocator.free(slot)
