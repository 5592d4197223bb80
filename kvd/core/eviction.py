"""Taking blocks out of the index: eviction for room, admin eviction, and freeing slots.

A mix-in of ``Index`` (kvd/core/index.py), split out to keep each file about one thing:
the index decides what is in the cache; this decides what leaves and when a slot is
free again (never while a copy or a lease still pins it).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvd.core.states import FREE, READY
from kvd.core.tenants import Tenant, unscoped

if TYPE_CHECKING:
    from kvd.core.allocator import Allocator
    from kvd.core.index import IndexCounters
    from kvd.core.policies.base import EvictionPolicy


class Eviction:
    """State it reads is owned by ``Index``; declared here for type checkers."""

    if TYPE_CHECKING:
        allocator: Allocator
        policy: EvictionPolicy
        entries: dict[bytes, int]
        counters: IndexCounters
        record: bool
        state: np.ndarray
        pins: np.ndarray
        tenant_of: np.ndarray
        rank_mask: np.ndarray
        checksums: dict[int, list[int]]
        events: list[tuple]
        _slot_key: dict[int, bytes]
        _slot_tenant: dict[int, Tenant]
        _spaces: dict[int, dict[bytes, int]]
        _ready: dict[int, dict[bytes, int]]
        _doomed: set[int]
        _pin_calls: int

        def flush(self) -> None: ...

    def evict_tenant(self, tenant: Tenant | None) -> int:
        """Admin eviction of READY unpinned blocks (one tenant, or all when None)."""
        self.flush()
        victims = [
            key
            for key in self.policy.victims()
            if (slot := self.entries[key]) is not None
            and self.pins[slot] == 0
            and (tenant is None or self.tenant_of[slot] == tenant.id)
        ]
        for key in victims:
            self.policy.remove(key)
            slot = self.entries[key]
            self.counters.evicted_bytes += self._slot_tenant[slot].slot_bytes
            self._drop_entry(slot)
        self.counters.evicted_blocks += len(victims)
        return len(victims)

    # ------------------------------------------------------------ internals
    def _evict_for(self, tenant: Tenant, need: int, n_new: int, out: list[bytes]) -> int:
        """Evict up to ``need`` blocks so ``tenant`` can allocate; same size class first."""
        want = tenant.slot_bytes
        chosen: list[bytes] = []
        entries, pin_of, bytes_of = self.entries, self.pins.item, self.allocator.slot_bytes_of
        if self.allocator.size_classes == 1 and not self._pin_calls:  # any will do
            return self._evict_keys(self.policy.evict(need), tenant, out, told=True)
        if self.allocator.size_classes == 1:  # every READY block has this size
            for key in self.policy.victims():
                if pin_of(entries[key]) == 0:
                    chosen.append(key)
                    if len(chosen) == need:
                        break
        else:
            for key in self.policy.victims():
                slot = entries[key]
                if pin_of(slot) == 0 and bytes_of(slot) == want:
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

    def _evict_keys(self, keys: list[bytes], tenant: Tenant, out: list[bytes],
                    told: bool = False) -> int:
        """Evict ``keys`` (offered by the policy; ``told``: it already evicted them)."""
        slots = list(map(self.entries.__getitem__, keys))
        if not told:
            self.policy.evicted_many(keys)
        self._drop_entries(slots, victims=True, caller=tenant, out=out)
        self.counters.evicted_blocks += len(keys)
        return len(keys)

    def _drop_entries(self, slots: list[int], victims: bool = False,
                      caller: Tenant | None = None, out: list[bytes] | None = None) -> None:
        """``_drop_entry`` for many slots, with one numpy call per array. ``victims``:
        the slots are READY and unpinned (eviction checked), so no need to look; the
        keys of ``caller`` among them are appended to ``out``."""
        if not slots:
            return
        arr = np.array(slots, dtype=np.int64)
        if victims:
            ready = pinned = None
        else:
            ready = self.state[arr] == READY
            pinned = self.pins[arr] > 0
        keys = list(map(self._slot_key.pop, slots))
        deque(map(self.entries.__delitem__, keys), maxlen=0)
        tenants = list(map(self._slot_tenant.pop, slots))
        plain = list(map(unscoped, keys))
        is_ready = [True] * len(slots) if ready is None else ready.tolist()
        one = tenants.count(tenants[0]) == len(tenants)  # one tenant, the usual case
        if out is not None and caller is not None:
            cid = caller.id
            out.extend(plain if one and tenants[0].id == cid
                       else [k for k, t in zip(plain, tenants) if t.id == cid])
        if one:
            tid = tenants[0].id
            deque(map(self._spaces[tid].__delitem__, plain), maxlen=0)
            ready_map = self._ready.get(tid, {})
            deque(map(ready_map.pop, plain, repeat(None)), maxlen=0)
            tenants[0].blocks -= is_ready.count(True)
        else:
            for t, key, r in zip(tenants, plain, is_ready):
                del self._spaces[t.id][key]
                self._ready.get(t.id, {}).pop(key, None)
                t.blocks -= r
        if self.checksums or self.record:
            for slot, r in zip(slots, is_ready):
                if r:
                    self.checksums.pop(slot, None)
                    if self.record:
                        self.events.append(("drop", slot))
        if victims:
            self.counters.evicted_bytes += (tenants[0].slot_bytes * len(slots) if one
                                            else sum(t.slot_bytes for t in tenants))
        self.state[arr] = FREE
        free = slots
        if pinned is not None and pinned.any():  # copies in flight: freed once unpinned
            self._doomed.update(arr[pinned].tolist())
            arr = arr[~pinned]
            free = arr.tolist()
        self.rank_mask[arr] = 0
        self.tenant_of[arr] = 0
        self.allocator.free_many(free)

    def _drop_entry(self, slot: int) -> None:
        key = self._slot_key.pop(slot)
        del self.entries[key]
        t = self._slot_tenant.pop(slot)
        del self._spaces[t.id][key[4:]]
        self._ready.get(t.id, {}).pop(key[4:], None)
        if self.state[slot] == READY:
            t.blocks -= 1
            self.checksums.pop(slot, None)
            if self.record:
                self.events.append(("drop", slot))
        self.state[slot] = FREE
        if self.pins[slot] > 0:
            self._doomed.add(slot)  # an in-flight copy still uses it
        else:
            self._free(slot)

    def _free(self, slot: int) -> None:
        self.rank_mask[slot] = 0
        self.tenant_of[slot] = 0
        self.allocator.free(slot)
