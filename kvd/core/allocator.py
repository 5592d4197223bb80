"""Pool allocator: slots of each size class carved from fixed-size extents.

The pool is cut into extents of ``extent_bytes``. An extent serves one size class (one
slot size) at a time; when its last slot is freed it returns to the free list and can
serve another class. A slot id is ``extent * slots_per_extent_max + index`` so ids are
dense and byte offsets are computed with numpy for whole batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class AllocatorError(ValueError):
    """A size class the pool cannot serve (slot larger than an extent, or too small)."""


@dataclass
class _SizeClass:
    slot_bytes: int
    per_extent: int
    partial: set[int] = field(default_factory=set)  # extents with a free slot
    extents: set[int] = field(default_factory=set)


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
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0
        self.used_slots = 0

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
        return sc

    def free_slots(self, slot_bytes: int) -> int:
        """Slots of this size that can be allocated without evicting anything."""
        sc = self._class(slot_bytes)
        partial = sum(len(self._extent_free[e]) for e in sc.partial)
        return partial + len(self._free_extents) * sc.per_extent

    def total_slots(self, slot_bytes: int) -> int:
        return self.n_extents * self._class(slot_bytes).per_extent

    # ------------------------------------------------------------ alloc / free
    def alloc(self, slot_bytes: int) -> int | None:
        """One slot of this size, or None when the pool has no room for it."""
        sc = self._class(slot_bytes)
        if sc.partial:
            e = next(iter(sc.partial))
        elif self._free_extents:
            e = self._free_extents.pop()
            self._extent_class[e] = sc
            self._extent_free[e] = list(range(sc.per_extent - 1, -1, -1))
            sc.extents.add(e)
            sc.partial.add(e)
        else:
            return None
        free = self._extent_free[e]
        i = free.pop()
        if not free:
            sc.partial.discard(e)
        self._extent_used[e] += 1
        self.used_bytes += slot_bytes
        self.used_slots += 1
        return e * self.slots_per_extent_max + i

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
            self._free_extents.remove(e)
            self._extent_class[e] = sc
            self._extent_free[e] = list(range(sc.per_extent - 1, -1, -1))
            sc.extents.add(e)
            sc.partial.add(e)
        elif self._extent_class[e] is not sc:
            return False
        free = self._extent_free[e]
        try:
            free.remove(i)
        except ValueError:
            return False
        if not free:
            sc.partial.discard(e)
        self._extent_used[e] += 1
        self.used_bytes += slot_bytes
        self.used_slots += 1
        return True

    def free(self, slot: int) -> None:
        e, i = divmod(slot, self.slots_per_extent_max)
        sc = self._extent_class[e]
        assert sc is not None and self._extent_used[e] > 0, f"slot {slot} is not allocated"
        self._extent_used[e] -= 1
        self.used_bytes -= sc.slot_bytes
        self.used_slots -= 1
        if self._extent_used[e] == 0:
            # The extent is empty: give it back so any size class can take it.
            sc.partial.discard(e)
            sc.extents.discard(e)
            self._extent_class[e] = None
            self._extent_free[e] = []
            self._free_extents.append(e)
            return
        self._extent_free[e].append(i)
        sc.partial.add(e)

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

    def extent_of(self, slot: int) -> int:
        return slot // self.slots_per_extent_max

    def extent_class_bytes(self, extent: int) -> int | None:
        sc = self._extent_class[extent]
        return sc.slot_bytes if sc else None
