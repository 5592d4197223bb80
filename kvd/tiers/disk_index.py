"""The disk tier's index of held blocks, and the making of room in its file by size class.

``DiskTier`` owns the files, the locks, the faults and the journal; what it holds is
bookkeeping with no I/O, kept here: which block each slot holds (in recency order, for
the journal's snapshots), the ``Allocator`` that carves the file into extents of one
slot size each, and the eviction policy. Room for a put is made as the RAM evictor
makes it: victims of the put's own size first, then whole extents of other sizes, so
that blocks of several tenants' sizes can share one file. Used under the tier's
``_lock`` only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.eviction import SCAN
from kvd.core.policies.base import EvictionPolicy
from kvd.tiers.base import HEADER_BYTES
from kvd.tiers.disk_journal import DiskPut
from kvd.tiers.vectored import PAGE


# A file too small for extents of eight pool extents still gets this many, where each
# holds a largest block: several block sizes (tenants) then share it.
MIN_EXTENTS = 4


def extent_for(pool_extent: int, size: int) -> int:
    """The disk tier's extent under a pool of ``pool_extent``: a block as large as a pool
    extent fits with its header; slots of header and payload leave at most about an
    eighth of an extent unused (extents of the pool's size could leave half); and the
    extents tile the file. A file of fewer than eight pool extents gets up to
    ``MIN_EXTENTS`` smaller ones (down to a pool extent and a header), at the cost of
    more rounding for blocks near a pool extent's size: an extent holds one block size,
    and a file of one extent held one tenant's block size at a time, each put of the
    other size wiping it."""
    n = max(1, size // (8 * pool_extent + PAGE),
            min(MIN_EXTENTS, size // (pool_extent + PAGE)))
    return size // n // PAGE * PAGE


def scoped(ns: bytes, key: bytes) -> bytes:
    """The index's key: length-prefixed, so no (ns, key) pair aliases another."""
    return len(ns).to_bytes(2, "little") + ns + key


class DiskIndex:
    """The blocks the disk tier holds, their slots, and the policy that orders them."""

    def __init__(self, allocator: Allocator, policy: EvictionPolicy) -> None:
        self.allocator, self.policy = allocator, policy
        self.bound = policy.capacity  # see Allocator.fit
        self.entries: dict[bytes, DiskPut] = {}  # scoped key -> block; order: recency
        self.slot_key: dict[int, bytes] = {}  # slot -> scoped key, of every held block

    def slot_bytes(self, length: int) -> int:
        need = max(HEADER_BYTES + length, self.allocator.min_slot_bytes)
        return -(-need // PAGE) * PAGE

    def offsets(self, slots: list[int], sizes: np.ndarray) -> np.ndarray:
        """Byte offsets of slots of any size classes (one numpy call per class)."""
        out = np.array(slots, dtype=np.int64)
        for slot_bytes in set(sizes.tolist()):
            mask = sizes == slot_bytes
            out[mask] = self.allocator.offsets(out[mask], slot_bytes)
        return out

    def restore(self, live: dict[int, DiskPut]) -> None:
        """Hold the blocks a journal names (``replay``'s ``live``) whose slots this
        geometry can claim as they were; the others are left out. In journal order, as
        claims one by one would: a key is held at its first slot that can be claimed,
        an extent serves the size of the first block placed in it. The claims go in one
        batch per size: a claim apiece searched its extent's free list (500k blocks took
        5.5 s)."""
        alloc = self.allocator
        spm = alloc.slots_per_extent_max
        owner: dict[int, int] = {}  # extent -> slot size of the first block put in it
        held: dict[bytes, DiskPut] = {}
        by_size: dict[int, list[int]] = {}
        for rec in live.values():  # in journal order
            key = scoped(rec.ns, rec.key)
            if (key in held or key in self.entries or rec.slot_bytes != self.slot_bytes(
                    rec.length) or not alloc.fits(rec.slot, rec.slot_bytes)
                    or owner.setdefault(rec.slot // spm, rec.slot_bytes) != rec.slot_bytes):
                continue
            held[key] = rec
            by_size.setdefault(rec.slot_bytes, []).append(rec.slot)
        claimed: set[int] = set()
        for slot_bytes, slots in by_size.items():
            got = alloc.claim_many(slots, slot_bytes)
            claimed.update(s for s, ok in zip(slots, got) if ok)
        alloc.fit(self.policy, self.bound)
        run: list[bytes] = []  # keys at consecutive depths: one ``insert_many`` each
        depth = 0
        for key, rec in held.items():
            if rec.slot not in claimed:  # none: into a fresh allocator
                continue
            self.entries[key] = rec
            self.slot_key[rec.slot] = key
            if run and rec.depth != depth + len(run):
                self.policy.insert_many(run, depth)
                run = []
            if not run:
                depth = rec.depth
            run.append(key)
        if run:
            self.policy.insert_many(run, depth)

    def drop(self, keys: Sequence[bytes]) -> list[int]:
        """Take keys the policy already let go of out of the index; their slots."""
        slots = [self.entries.pop(k).slot for k in keys]
        deque(map(self.slot_key.pop, slots), maxlen=0)
        self.allocator.free_many(slots)
        return slots

    def hold(self, key: bytes, put: DiskPut) -> None:
        self.entries[key] = put
        self.slot_key[put.slot] = key
        self.policy.insert(key, put.depth)

    def touch(self, keys: list[bytes]) -> None:
        """A use of held ``keys`` (under ``_lock``)."""
        entries = self.entries
        self.policy.touch(keys, entries[keys[0]].depth)
        for k in keys:  # most recent last: a compaction keeps the order
            entries[k] = entries.pop(k)

    def _empty_extents(self, slot_bytes: int, n: int,
                       colder: list[int] | None = None) -> list[int]:
        """Room for ``n`` slots of ``slot_bytes`` by emptying whole extents of other
        sizes, fewest blocks first (the least lost per extent freed), as the RAM
        evictor does: evicting in policy order until an extent happened to empty took,
        where each extent held one recent block, nearly the whole tier. An extent with
        a slot set aside (a bad sector) never empties and is passed over. With
        ``colder`` (other sizes' blocks before the caller's own victims): only extents
        all of whose blocks are among them, coldest first (``Evictor._empty_extents``)."""
        alloc, slot_key = self.allocator, self.slot_key
        short = n - alloc.free_slots(slot_bytes)
        if short <= 0:
            return []
        need = -(-short // alloc.per_extent(slot_bytes))
        spm = alloc.slots_per_extent_max
        keys: list[bytes] = []
        for e in (alloc.other_extents(slot_bytes) if colder is None
                  else sorted(alloc.whole_extents(colder, need))):
            per = alloc.per_extent(alloc.slot_bytes_of(e * spm) or slot_bytes)
            held = list(filter(None, map(slot_key.get, range(e * spm, e * spm + per))))
            if len(held) != alloc.used_in(e):
                continue
            keys += held
            need -= 1
            if not need:
                break
        self.policy.remove_many(keys)  # not its victims: its own order
        return self.drop(keys)

    def _own_victims(self, slot_bytes: int, n: int, limit: int | None,
                     colder: list[int] | None = None) -> list[bytes]:
        """The policy's first ``n`` victims of ``slot_bytes``, among its first ``limit``
        (None: all). ``colder`` gets the slots of the other sizes' blocks met before the
        last of them (as the RAM evictor's ``_victims``)."""
        entries = self.entries
        keys: list[bytes] = []
        ahead: list[int] = []
        for k in islice(self.policy.victims(), limit if n > 0 else 0):
            entry = entries[k]
            if entry.slot_bytes != slot_bytes:
                ahead.append(entry.slot)
                continue
            keys.append(k)
            if colder is not None:
                colder += ahead
                ahead.clear()
            if len(keys) == n:
                break
        return keys

    def _evict_own(self, slot_bytes: int, n: int, limit: int | None) -> list[int]:
        keys = self._own_victims(slot_bytes, n, limit)
        self.policy.evicted_many(keys)
        return self.drop(keys)

    def make_room(self, slot_bytes: int, n: int) -> list[int]:
        """Evict until ``n`` slots of ``slot_bytes`` are free: blocks of that size first,
        then whole extents of other sizes, then any in policy order (a last resort).
        Returns the slots freed."""
        alloc, policy = self.allocator, self.policy
        short = n - alloc.free_slots(slot_bytes)
        if short <= 0:
            return []
        if alloc.size_classes == 1:  # every block has this size
            freed = self.drop(policy.evict(short))
        else:  # as the RAM evictor does: whole extents of other sizes colder than its
            # own first victims, then those victims (looking only so deep), then other
            # sizes' emptiest extents
            colder: list[int] = []
            own = self._own_victims(slot_bytes, short, SCAN + 4 * short, colder)
            freed = self._empty_extents(slot_bytes, n, colder) if colder else []
            own = own[:max(0, n - alloc.free_slots(slot_bytes))]
            policy.evicted_many(own)
            freed += self.drop(own)
            freed += self._empty_extents(slot_bytes, n)
            if (short := n - alloc.free_slots(slot_bytes)) > 0:  # too few emptied
                freed += self._evict_own(slot_bytes, short, None)
        while alloc.free_slots(slot_bytes) < n and (keys := list(islice(policy.victims(),
                                                                        64))):
            policy.evicted_many(keys)
            freed += self.drop(keys)
        return freed
