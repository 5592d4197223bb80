"""Taking blocks out of the index: eviction for room, admin eviction, and freeing slots.

``Index`` (kvd/core/index.py) owns one ``Evictor`` and delegates to it, to keep each file
about one thing: the index decides what is in the cache; this decides what leaves and
when a slot is free again (never while a copy or a lease still pins it).
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import chain, compress, islice, repeat
from typing import Any, Protocol

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.policies.base import EvictionPolicy
from kvd.core.states import FREE, PENDING, READY
from kvd.core.tenants import Tenant, unscoped

SCAN = 4096  # victims read for a block size before an extent of another size is emptied


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
        """Admin eviction of READY unpinned blocks (one tenant, or all when None). From
        the tenants' own maps, in one batch: it walked the policy's whole order, every
        tenant's blocks for one tenant's evict (the tenant limit's drop of a 100-block
        tenant took a second at a million blocks held), and dropped block by block."""
        return self.evict_slots(self.evictable(tenant), tenant)

    def evictable(self, tenant: Tenant | None) -> np.ndarray:
        """The slots of the READY blocks of ``tenant`` (of all when None), read in one
        pass, for ``evict_slots`` to take in parts: a million blocks dropped at once held
        the event loop two seconds."""
        ix = self.ix
        ix.flush()
        maps = ix._ready.values() if tenant is None else [ix._ready.get(tenant.id, {})]
        return np.fromiter(chain.from_iterable(m.values() for m in maps), dtype=np.int64)

    def evict_slots(self, slots: np.ndarray, tenant: Tenant | None) -> int:
        """Admin eviction of those of ``slots`` (from ``evictable``) still READY,
        unpinned and ``tenant``'s (any tenant's when None): between two parts, requests
        may have leased, evicted or reused some (a tenant's id is never reused)."""
        ix = self.ix
        ix.flush()
        ok = (ix.state[slots] == READY) & (ix.pins[slots] == 0)
        if tenant is not None:
            ok &= ix.tenant_of[slots] == tenant.id
        taken = slots[ok].tolist()
        ix.policy.remove_many(list(map(ix._slot_key.__getitem__, taken)))
        self.drop_many(taken, victims=True)
        ix.counters.evicted_blocks += len(taken)
        return len(taken)

    def make_room(self, tenant: Tenant, need: int, n_new: int, out: list[bytes]) -> int:
        """Evict up to ``need`` blocks so ``tenant`` can allocate ``n_new``; same size
        class first. The caller's keys among the victims go to ``out``."""
        ix = self.ix
        policy, allocator = ix.policy, ix.allocator
        if allocator.size_classes == 1 and not ix._pin_calls:  # any will do
            return self._evict_keys(policy.evict(need), tenant, out, told=True)
        want = tenant.slot_bytes
        n = 0
        if allocator.size_classes == 1:  # every READY block has this size
            chosen, cut = self._victims(None, need, None)
        else:
            colder: list[np.ndarray] = []
            chosen, cut = self._victims(want, need, SCAN + 4 * need, colder)
            if colder:  # whole extents of other sizes colder than these: they go first
                n = self._empty_extents(tenant, n_new, out, np.concatenate(colder))
                chosen = chosen[:max(0, n_new - allocator.free_slots(want))]
        n += self._evict_keys(chosen, tenant, out)
        if allocator.free_slots(want) < n_new:  # still short
            n += self._empty_extents(tenant, n_new, out)
            short = n_new - allocator.free_slots(want)
            if cut and short > 0:  # too few extents can empty: look further down the order
                more, _ = self._victims(want, short, None)
                n += self._evict_keys(more, tenant, out)
        return n

    def _victims(self, size: int | None, need: int, limit: int | None,
                 colder: list[np.ndarray] | None = None) -> tuple[list[bytes], bool]:
        """The policy's first ``need`` unpinned victims (of slot size ``size``, when
        given), looking at most ``limit`` deep (None: all the way); and whether it
        stopped at ``limit``. Read in growing chunks, checked with numpy per chunk.
        ``colder`` gets the slots of the unpinned blocks of other sizes met before the
        last victim returned (arrays, in order).

        Why the limit: with two block sizes, the caller's own blocks may sit behind
        every block of the other size, and reading the whole order on every short
        Allocate cost O(pool) (about 0.1 s for the 32k blocks of a 64 GiB pool of 2 MiB
        blocks, measured; more with the pool). Past the limit an extent of
        the other size is emptied instead, the colder cache giving way."""
        ix = self.ix
        entries, pins, alloc = ix.entries, ix.pins, ix.allocator
        it = ix.policy.victims()
        chosen: list[bytes] = []
        ahead: list[np.ndarray] = []
        seen, chunk = 0, max(64, 2 * need)
        while len(chosen) < need:
            if limit is not None and seen >= limit:
                return chosen, True
            keys = list(islice(it, chunk if limit is None else min(chunk, limit - seen)))
            if not keys:
                break
            seen += len(keys)
            slots = np.fromiter(map(entries.__getitem__, keys), np.int64, len(keys))
            ok = pins[slots] == 0
            if size is not None:
                other = ok & (alloc.slot_bytes_array(slots) != size)
                ok &= ~other
                if colder is not None:  # (ahead: other sizes' blocks since the last
                    mine = np.flatnonzero(ok)  # own victim, colder once another comes)
                    if len(mine):
                        end = int(mine[min(need - len(chosen), len(mine)) - 1])
                        colder += ahead
                        colder.append(slots[:end][other[:end]])
                        ahead = [slots[end:][other[end:]]]
                    else:
                        ahead.append(slots[other])
            chosen.extend(compress(keys, ok.tolist()))
            chunk *= 2
        return chosen[:need], False

    def _empty_extents(self, tenant: Tenant, n_new: int, out: list[bytes],
                       colder: np.ndarray | None = None) -> int:
        """Room for ``n_new`` slots of ``tenant``'s size by emptying whole extents of
        other sizes. Only an extent whose every block is READY and unpinned can empty: a
        lease or a store in one keeps it (evicting its other blocks freed nothing, and
        evicting in policy order until the policy ran dry emptied another tenant's whole
        cache for no slot). Fewest blocks first: the least lost per extent freed. Rows
        are checked one extent at a time until enough can empty, so a large pool is not
        scanned whole on every short Allocate.

        With ``colder`` (the other sizes' blocks before the caller's own victims in the
        policy's order, coldest first): only extents all of whose blocks are among them,
        coldest first. The policy would evict all of those before the caller's victims,
        so they go instead; without this, a size's own blocks went first whenever the
        scan found enough of them, and in a pool of fewer blocks than the scan reads the
        split between sizes never changed (a tenant that left kept its extents)."""
        ix = self.ix
        alloc = ix.allocator
        want = tenant.slot_bytes
        short = n_new - alloc.free_slots(want)
        if short <= 0:
            return 0
        spm = alloc.slots_per_extent_max
        state, pins = ix.state, ix.pins
        need = -(-short // alloc.per_extent(want))
        extents: list[int] = []
        if colder is not None:
            extents = sorted(alloc.whole_extents(colder, need))
        else:
            for e in alloc.other_extents(want):  # a row per extent, until enough can empty
                row = slice(e * spm, (e + 1) * spm)
                if pins[row].any() or (state[row] == PENDING).any():
                    continue
                extents.append(e)
                if len(extents) == need:
                    break
        if not extents:
            return 0
        ext = np.array(extents, dtype=np.int64)
        state = state.reshape(alloc.n_extents, spm)
        rows, cols = np.nonzero(state[ext] == READY)
        slots = (ext[rows] * spm + cols).tolist()
        keys = list(map(ix._slot_key.__getitem__, slots))
        ix.policy.remove_many(keys)  # not its victims: its own order
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
        # One tenant, the usual case. By identity: ``count`` compared the dataclasses
        # field by field, a million times for a flush once a second model held blocks.
        one = all(map(operator.is_, tenants, repeat(tenants[0])))
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
            self.forget_empty(tenants[0], only_dropped=True)
        else:
            for t, key, r in zip(tenants, plain, is_ready):
                del ix._spaces[t.id][key]
                ix._ready.get(t.id, {}).pop(key, None)
                t.blocks -= r
            for t in {id(t): t for t in tenants}.values():
                self.forget_empty(t, only_dropped=True)
        if ix.checksums or ix.record:
            gone = list(compress(slots, is_ready))
            deque(map(ix.checksums.pop, gone, repeat(None)), maxlen=0)
            deque(map(ix.parents.pop, gone, repeat(None)), maxlen=0)
            if ix.record:
                ix.events.extend(("drop", slot, t.id, key) for slot, r, t, key
                                 in zip(slots, is_ready, tenants, plain) if r)
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
        self.forget_empty(t, only_dropped=True)
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

    def forget_empty(self, tenant: Tenant, only_dropped: bool = False) -> None:
        """The key tables of ``tenant`` (dropped, when ``only_dropped``) once it holds no
        key: nothing else removes a tenant's entries."""
        if only_dropped and not tenant.dropped:
            return
        ix = self.ix
        if not ix._spaces.get(tenant.id, True):
            del ix._spaces[tenant.id]
            ix._ready.pop(tenant.id, None)

    def free(self, slot: int) -> None:
        """Return an unpinned, dropped slot to the allocator."""
        ix = self.ix
        ix.rank_mask[slot] = 0
        ix.tenant_of[slot] = 0
        ix.allocator.free(slot)
