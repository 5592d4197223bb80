"""Pool allocator: slots of each size class carved from fixed-size extents.

The pool is cut into extents of ``extent_bytes``. An extent serves one size class (one
slot size) at a time; when its last slot is freed it returns to the free list and can
serve another class. A slot id is ``extent * slots_per_extent_max + index`` so ids are
dense and byte offsets are computed with numpy for whole batches.

Each size class counts the free slots of its extents, so ``free_slots`` is O(1) on the
allocate path; ``alloc_many`` / ``free_many`` serve a whole request in one call (the
index allocates and evicts in runs, and a call per slot was most of its cost).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvd.core.policies.base import EvictionPolicy


# A size that held no block while the pool turned over this many times is forgotten.
IDLE_TURNOVERS = 4


class AllocatorError(ValueError):
    """A size class the pool cannot serve (slot larger than an extent, or too small)."""


@dataclass
class _SizeClass:
    slot_bytes: int
    per_extent: int
    partial: set[int] = field(default_factory=set)  # extents with a free slot
    extents: set[int] = field(default_factory=set)
    free: int = 0  # free slots in ``extents`` (those of ``partial``)


class Allocator:
    def __init__(self, pool_bytes: int, extent_bytes: int, min_slot_bytes: int = 4096):
        if extent_bytes <= 0 or pool_bytes < extent_bytes:
            raise AllocatorError(
                f"pool of {pool_bytes} bytes holds no extent of {extent_bytes} bytes"
            )
        self.extent_bytes = extent_bytes
        self.min_slot_bytes = min_slot_bytes
        self.n_extents = pool_bytes // extent_bytes
        self.capacity_bytes = self.n_extents * extent_bytes
        self.slots_per_extent_max = max(1, extent_bytes // min_slot_bytes)
        self.max_slots = self.n_extents * self.slots_per_extent_max
        self._free_extents: list[int] = list(range(self.n_extents - 1, -1, -1))
        self._extent_class: list[_SizeClass | None] = [None] * self.n_extents
        self._extent_free: list[list[int]] = [[] for _ in range(self.n_extents)]
        self._extent_used = [0] * self.n_extents
        self._extent_slot_bytes = np.zeros(self.n_extents, dtype=np.int64)  # slot size; 0: free
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0
        self.used_slots = 0
        self._changes = 0  # size classes made or forgotten so far
        self._fitted = 0  # ``_changes`` when ``fit`` last ran
        self._handed = 0  # slots handed out so far: the pool's turnovers, as a clock
        self._idle: dict[int, int] = {}  # sizes holding no extent -> ``_handed`` since

    # ------------------------------------------------------------ classes
    def check_slot_bytes(self, slot_bytes: int) -> None:
        if slot_bytes > self.extent_bytes:
            raise AllocatorError(
                f"a block of {slot_bytes} bytes does not fit an extent of "
                f"{self.extent_bytes} bytes; raise extent_size"
            )
        if slot_bytes < self.min_slot_bytes:
            raise AllocatorError(
                f"a block of {slot_bytes} bytes is below min_slot_bytes "
                f"({self.min_slot_bytes})"
            )

    def _class(self, slot_bytes: int) -> _SizeClass:
        sc = self._classes.get(slot_bytes)
        if sc is None:
            self.check_slot_bytes(slot_bytes)
            per = min(self.extent_bytes // slot_bytes, self.slots_per_extent_max)
            sc = self._classes[slot_bytes] = _SizeClass(slot_bytes, per)
            self._changes += 1
            self._idle[slot_bytes] = self._handed
        return sc

    def free_slots(self, slot_bytes: int) -> int:
        """Slots of this size that can be allocated without evicting anything."""
        sc = self._class(slot_bytes)
        return sc.free + len(self._free_extents) * sc.per_extent

    @property
    def size_classes(self) -> int:
        """Size classes asked for and not forgotten since (``forget_idle``): with one,
        every slot has its size."""
        return len(self._classes)

    def forget_idle(self, keep: int = 0) -> None:
        """Forget the sizes that held no extent for ``IDLE_TURNOVERS`` times the blocks
        the pool holds (a model replaced by another on the node), but ``keep``, the size
        being allocated. Kept for good, a gone size left the policy sized for a mix
        that no longer was, and eviction on the several-sizes path; forgotten at once,
        a size whose few blocks come and go re-sized the policy each time (the default
        policy's learning lost with it)."""
        if not self._idle:
            return
        horizon = self._handed - IDLE_TURNOVERS * self.blocks_when_full()
        for size in [b for b, since in self._idle.items() if since <= horizon and b != keep]:
            del self._idle[size], self._classes[size]
            self._changes += 1

    def per_extent(self, slot_bytes: int) -> int:
        return self._class(slot_bytes).per_extent

    def other_extents(self, slot_bytes: int) -> list[int]:
        """Extents serving other slot sizes, fewest slots in use first: those cost the
        least to empty for ``slot_bytes``. One entry per extent, not per slot."""
        used = self._extent_used
        out = [e for sc in self._classes.values() if sc.slot_bytes != slot_bytes
               for e in sc.extents]
        out.sort(key=used.__getitem__)
        return out

    def used_in(self, extent: int) -> int:
        """Slots of ``extent`` in use (allocated or claimed, not freed)."""
        return self._extent_used[extent]

    def whole_extents(self, slots: Sequence[int] | np.ndarray, at_most: int) -> set[int]:
        """Up to ``at_most`` extents each of whose slots in use is one of ``slots`` (a
        policy's victims in order, coldest first), those whose last slot in ``slots``
        comes earliest first: emptying one loses only blocks that order would drop
        first anyway."""
        ids = np.asarray(slots, dtype=np.int64) // self.slots_per_extent_max
        counts = np.bincount(ids, minlength=self.n_extents)
        whole = np.flatnonzero(counts)
        whole = whole[counts[whole] == np.array(self._extent_used)[whole]]
        if not len(whole) or at_most <= 0:
            return set()
        last = np.full(self.n_extents, -1, dtype=np.int64)
        np.maximum.at(last, ids, np.arange(len(ids)))
        return set(whole[np.argsort(last[whole], kind="stable")][:at_most].tolist())

    def slot_bytes_array(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's size (0: its extent serves no size class), for whole batches."""
        return self._extent_slot_bytes[slots // self.slots_per_extent_max]

    def total_slots(self, slot_bytes: int) -> int:
        return self.n_extents * self._class(slot_bytes).per_extent

    def blocks_when_full(self) -> int:
        """How many blocks the pool holds when full, for a policy's capacity (its queue,
        ghost and clock sizes): exact with one size class; with several, as if they
        shared the extents equally. ``max_slots`` (counted in ``min_slot_bytes``) until a
        size class is known."""
        if not self._classes:
            return self.max_slots
        per = sum(sc.per_extent for sc in self._classes.values()) / len(self._classes)
        return max(1, int(self.n_extents * per))

    def fit(self, policy: EvictionPolicy, bound: int, keep: int = 0) -> None:
        """Size ``policy`` to ``blocks_when_full`` (at most ``bound``: the capacity it was
        built with) once the size classes changed. Built before any block size is
        known, with ``max_slots``, a policy would size its ghosts, clocks and miniature
        caches hundreds of times larger than the cache; and sized for a block size no
        block has any more (a model replaced by another), smaller or larger than it.
        ``keep``: a size about to be allocated, never forgotten here."""
        self.forget_idle(keep)
        if self._fitted == self._changes:
            return
        self._fitted = self._changes
        want = min(bound, self.blocks_when_full())
        if want != policy.capacity:
            policy.set_capacity(want)

    # ------------------------------------------------------------ alloc / free
    def alloc(self, slot_bytes: int) -> int | None:
        """One slot of this size, or None when the pool has no room for it."""
        got = self.alloc_many(slot_bytes, 1)
        return got[0] if got else None

    def alloc_many(self, slot_bytes: int, n: int) -> list[int]:
        """Up to ``n`` slots of this size, fewer when the pool runs out of room.

        The same slots, in the same order, as ``n`` calls of ``alloc``."""
        sc = self._class(slot_bytes)
        out: list[int] = []
        spm, used, ext_free = self.slots_per_extent_max, self._extent_used, self._extent_free
        while len(out) < n:
            if sc.partial:
                e = next(iter(sc.partial))
            elif self._free_extents:
                e = self._take_extent(sc)
            else:
                break
            free = ext_free[e]
            take = min(len(free), n - len(out))
            base = e * spm
            out.extend([base + i for i in free[:-take - 1:-1]])  # popped from the end
            del free[-take:]
            if not free:
                sc.partial.discard(e)
            used[e] += take
            sc.free -= take
        self.used_bytes += slot_bytes * len(out)
        self.used_slots += len(out)
        self._handed += len(out)
        return out

    def _take_extent(self, sc: _SizeClass, e: int | None = None, listed: bool = True) -> int:
        """Give a free extent (the next one, or ``e``) to size class ``sc``; ``listed``:
        take ``e`` off the free list too (else the caller does)."""
        if e is None:
            e = self._free_extents.pop()
        elif listed:
            self._free_extents.remove(e)
        self._extent_class[e] = sc
        self._extent_slot_bytes[e] = sc.slot_bytes
        self._extent_free[e] = list(range(sc.per_extent - 1, -1, -1))
        sc.extents.add(e)
        sc.partial.add(e)
        sc.free += sc.per_extent
        self._idle.pop(sc.slot_bytes, None)
        return e

    def fits(self, slot: int, slot_bytes: int) -> bool:
        """Whether ``slot`` is a slot of size ``slot_bytes`` in this geometry (whatever
        holds it now); makes no size class."""
        e, i = divmod(slot, self.slots_per_extent_max)
        return (0 <= e < self.n_extents and self.min_slot_bytes <= slot_bytes
                <= self.extent_bytes and i < self.extent_bytes // slot_bytes)

    def claim(self, slot: int, slot_bytes: int) -> bool:
        """Allocate this exact slot (restoring a pool after a restart); False when the
        slot is taken, out of range, or its extent serves another size class."""
        e, i = divmod(slot, self.slots_per_extent_max)
        if not 0 <= e < self.n_extents:
            return False
        sc = self._class(slot_bytes)
        if i >= sc.per_extent:
            return False
        if self._extent_class[e] is None:
            if e not in self._free_extents:
                return False
            self._take_extent(sc, e)
        elif self._extent_class[e] is not sc:
            return False
        free = self._extent_free[e]
        try:
            free.remove(i)
        except ValueError:
            return False
        if not free:
            sc.partial.discard(e)
        sc.free -= 1
        self._extent_used[e] += 1
        self.used_bytes += slot_bytes
        self.used_slots += 1
        self._handed += 1
        return True

    def claim_many(self, slots: Sequence[int], slot_bytes: int) -> list[bool]:
        """``claim`` for many slots, in order (the first of a repeated slot wins), each
        extent's free list rewritten once: a claim apiece searched its list, and a
        restart restoring 131k blocks into extents of 65,536 slots took 43 s. A size
        none of whose slots lie in the pool is not made a class here."""
        self.check_slot_bytes(slot_bytes)
        spm = self.slots_per_extent_max
        per = min(self.extent_bytes // slot_bytes, spm)
        got = [False] * len(slots)
        wanted: dict[int, dict[int, int]] = {}  # extent -> {index in it: place in slots}
        for place, slot in enumerate(slots):
            e, i = divmod(slot, spm)
            if 0 <= e < self.n_extents and i < per:
                wanted.setdefault(e, {}).setdefault(i, place)
        if not wanted:
            return got
        sc = self._class(slot_bytes)
        free_extents = set(self._free_extents)
        taken_extents: set[int] = set()
        for e, want in wanted.items():
            if self._extent_class[e] is None:
                if e not in free_extents:
                    continue
                self._take_extent(sc, e, listed=False)
                taken_extents.add(e)
            elif self._extent_class[e] is not sc:
                continue
            free = self._extent_free[e]
            taken = [i for i in free if i in want]
            if not taken:
                continue
            gone = set(taken)
            free[:] = [i for i in free if i not in gone]
            for i in taken:
                got[want[i]] = True
            if not free:
                sc.partial.discard(e)
            n = len(taken)
            sc.free -= n
            self._extent_used[e] += n
            self.used_bytes += slot_bytes * n
            self.used_slots += n
            self._handed += n
        if taken_extents:  # off the free list in one pass (a removal apiece searched it)
            self._free_extents = [e for e in self._free_extents if e not in taken_extents]
        return got

    def free(self, slot: int) -> None:
        self.free_many((slot,))

    def free_many(self, slots: Iterable[int]) -> None:
        """Return slots (each allocated, none twice); the same as ``free`` on each."""
        spm, ext_class, used, ext_free = (self.slots_per_extent_max, self._extent_class,
                                          self._extent_used, self._extent_free)
        n = nbytes = 0
        for slot in slots:
            e, i = divmod(slot, spm)
            sc = ext_class[e]
            assert sc is not None and used[e] > 0, f"slot {slot} is not allocated"
            n += 1
            nbytes += sc.slot_bytes
            left = used[e] = used[e] - 1
            if left:
                ext_free[e].append(i)
                sc.partial.add(e)
                sc.free += 1
            else:
                # The extent is empty: give it back so any size class can take it.
                sc.partial.discard(e)
                sc.extents.discard(e)
                sc.free -= sc.per_extent - 1
                ext_class[e] = None
                self._extent_slot_bytes[e] = 0
                ext_free[e] = []
                self._free_extents.append(e)
                if not sc.extents:  # no block of this size left: idle from now
                    self._idle[sc.slot_bytes] = self._handed
        self.used_bytes -= nbytes
        self.used_slots -= n

    # ------------------------------------------------------------ addresses
    def slot_bytes_of(self, slot: int) -> int | None:
        e = slot // self.slots_per_extent_max
        if not 0 <= e < self.n_extents:
            return None
        sc = self._extent_class[e]
        return sc.slot_bytes if sc else None

    def offsets(self, slots: np.ndarray, slot_bytes: int) -> np.ndarray:
        """Byte offsets of slots of one size class in the pool (int64)."""
        s = slots.astype(np.int64, copy=False)
        e, i = np.divmod(s, self.slots_per_extent_max)
        return e * self.extent_bytes + i * slot_bytes
