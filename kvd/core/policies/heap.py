"""A min-heap of keys by priority with lazy invalidation, for priority policies.

Updating a key pushes a new entry and leaves the old one behind; an entry is live
only while it is the key's current one. ``ordered()`` yields live keys lowest first
without changing what the heap holds: it pops what it yields and puts it back before
the next push or scan (keys discarded meanwhile, the usual fate of a victim, are
simply dropped), so offering k victims costs O(k log n).
"""

from __future__ import annotations

import heapq
from heapq import heappush
from collections.abc import Iterator, Sequence

from kvd.core.policies.base import Key

Entry = tuple[float, int, int, Key]  # (priority, tie-break, sequence, key)


class KeyHeap:
    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._live: dict[Key, Entry] = {}
        self._seq = 0
        self._held: list[Entry] = []  # popped by ordered(), not yet put back

    def _restore(self) -> None:
        heap, live = self._heap, self._live
        for entry in self._held:
            if live.get(entry[3]) is entry:
                heapq.heappush(heap, entry)
        self._held = []

    def push(self, key: Key, priority: float, tie: int = 0) -> None:
        if self._held:
            self._restore()
        self._seq += 1
        entry = (priority, tie, self._seq, key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def push_run(self, keys: Sequence[Key], priority: float, first_tie: int) -> None:
        """Push ``keys[i]`` with tie-break ``first_tie - i``, all at one priority."""
        if self._held:
            self._restore()
        live, heap, seq = self._live, self._heap, self._seq
        for i, key in enumerate(keys):
            entry = (priority, first_tie - i, seq + i, key)
            live[key] = entry
            heappush(heap, entry)
        self._seq = seq + len(keys)
        if len(heap) > 2 * len(live) + 64:
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    def discard(self, key: Key) -> float | None:
        """Forget ``key``; returns its priority (None when absent)."""
        entry = self._live.pop(key, None)
        return None if entry is None else entry[0]

    def priority(self, key: Key) -> float:
        return self._live[key][0]

    def __contains__(self, key: Key) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def ordered(self) -> Iterator[Key]:
        if self._held:
            self._restore()
        heap, live, held = self._heap, self._live, self._held
        pop = heapq.heappop
        while heap:
            entry = pop(heap)
            if live.get(entry[3]) is entry:  # else superseded or gone: drop it
                held.append(entry)
                yield entry[3]
