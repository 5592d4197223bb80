"""PENDING stores: what an ``allocate`` call's blocks wait on until every rank stored.

The ``Index`` moves blocks between states; this keeps, per PENDING slot, the record of
the call that made it (owner, deadline, tenant, its chain for the blocks' parents), the
per-rank checksums received so far, and each owner's PENDING blocks (its quota).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from kvd.core.owners import OwnerCounts
from kvd.core.tenants import Tenant


@dataclass(eq=False)  # compared by identity
class PendingCall:
    """One ``allocate`` call's PENDING blocks share this (one object per call, not per
    block); each block's depth is in ``Index._depth``, its checksums in ``sums``."""

    owner: int
    deadline: float
    tenant: Tenant
    length: int = 0  # depth of the end of the allocating request's chain
    keys: Sequence[bytes] = ()  # the call's keys, in chain order (parents, for events)
    depth: int = 0  # the depth of keys[0]
    parent: bytes | None = None  # the key before keys[0] in its chain, when known
    chained: bool = True  # each key is the parent of the next
    # Instead of ``keys``, when the call's new keys were few among many known ones:
    # each new block's parent by depth (the call's keys are not kept for them).
    parents: dict[int, bytes | None] | None = None

    @classmethod
    def of(cls, owner: int, deadline: float, tenant: Tenant, length: int,
           keys: Sequence[bytes], new: Sequence[int], depth: int,
           parent: bytes | None, chained: bool) -> PendingCall:
        """The record for the call's ``new`` keys. It keeps the call's keys from the one
        before its first new key to its last (what their parents need), or, when those
        are mostly keys already known, just the new blocks' parents: one new key among
        thousands of known ones must not keep them all for the pending time."""
        lo, hi = new[0], new[-1] + 1
        if chained:
            before = keys[lo - 1] if lo else parent
        else:  # only the call's first key has a parent (the one its sender named)
            before = parent if lo == 0 else None
        if hi - lo <= 2 * len(new):
            return cls(owner, deadline, tenant, length, keys[lo:hi], depth + lo, before,
                       chained)
        parents = ({depth + i: keys[i - 1] if i else parent for i in new} if chained
                   else {depth + lo: before})
        return cls(owner, deadline, tenant, length, (), depth + lo, before, chained,
                   parents)

    def parent_at(self, depth: int) -> bytes | None:
        if self.parents is not None:
            return self.parents.get(depth)
        if depth == self.depth:
            return self.parent
        return self.keys[depth - self.depth - 1] if self.chained else None


class PendingStores:
    def __init__(self) -> None:
        self.calls: dict[int, PendingCall] = {}  # PENDING slot -> the call that made it
        self.sums: dict[int, list[int]] = {}  # PENDING slot -> per-rank checksums so far
        self.by_owner = OwnerCounts()  # owner -> its PENDING blocks (quotas)

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, slots: list[int], call: PendingCall) -> None:
        self.calls.update(dict.fromkeys(slots, call))
        self.by_owner.add(call.owner, len(slots))

    def add_sums(self, slots: list[int], checksums: Sequence[int], rank: int) -> None:
        """One rank's checksums, one per slot (python ints: 64-bit hashes overflow
        int64)."""
        sums, calls = self.sums, self.calls
        for slot, c in zip(slots, checksums):
            if slot not in sums:
                sums[slot] = [0] * calls[slot].tenant.tp_size
            sums[slot][rank] = c

    def finished(self, slots: list[int], s: np.ndarray, masks: np.ndarray,
                 rank: int) -> tuple[list[int], list[PendingCall]]:
        """Of ``slots`` (``s`` as an array), those every rank has now stored, taken out
        of the table, with their calls. ``masks``: the index's per-slot rank bits, this
        rank's set. Returns ``slots`` itself when all of them are done."""
        calls = self.calls
        ready: list[int] = []
        owners: list[PendingCall] = []
        ps = list(map(calls.get, slots))
        if ps and ps[0] is not None and ps.count(ps[0]) == len(ps) \
                and len(set(slots)) == len(slots):
            # The usual case: the slots of one Allocate, no repeats: decide in numpy.
            p = ps[0]
            if p.tenant.full_mask == 1 << rank:  # one rank (no TP): all are done
                ready = slots
            else:
                full = masks[s] == np.uint64(p.tenant.full_mask)
                ready = slots if full.all() else s[full].tolist()
            deque(map(calls.pop, ready), maxlen=0)
            owners = [p] * len(ready)
        else:
            for slot, mask, p in zip(slots, masks[s].tolist(), ps):
                # p is None when the slot repeats in ``slots``
                if p is not None and mask == p.tenant.full_mask and slot in calls:
                    del calls[slot]
                    ready.append(slot)
                    owners.append(p)
        return ready, owners

    def move_sums(self, slots: list[int], into: dict[int, list[int]]) -> None:
        """The checksums of slots now READY go to ``into``."""
        if self.sums:
            for slot in slots:
                sums = self.sums.pop(slot, None)
                if sums is not None:
                    into[slot] = sums

    def drop(self, slots: list[int]) -> list[int]:
        """Forget these slots' stores (aborted); returns those that were PENDING."""
        calls = self.calls
        ours = [s for s in slots if s in calls]
        for owner, n in Counter(p.owner for p in map(calls.pop, ours)).items():
            self.by_owner.add(owner, -n)
        deque(map(self.sums.pop, ours, repeat(None)), maxlen=0)
        return ours

    def allocated_by(self, slots: np.ndarray, owner: int) -> bool:
        """Whether ``owner``'s Allocates made every one of these PENDING slots."""
        calls = self.calls
        return all(calls[s].owner == owner for s in slots.tolist() if s in calls)

    def expired(self, now: float) -> list[int]:
        return [s for s, p in self.calls.items() if p.deadline <= now]

    def of_owner(self, owner: int) -> list[int]:
        return [s for s, p in self.calls.items() if p.owner == owner]
