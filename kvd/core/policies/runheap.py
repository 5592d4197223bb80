"""A min-heap of key runs, for priority policies whose keys arrive in runs.

A request stores, and hits, a run of consecutive blocks of one chain, and a priority
policy gives the whole run one priority. So the heap holds one entry per run, not per
key: a request costs one heap push, and a victim costs a dict lookup, not a pop. Inside
an entry keys leave deepest first (a chain's tail before its head). A key belongs to the
entry it was last pushed with; pushing it again or discarding it leaves it behind in the
old entry as a dead slot that is skipped (lazy invalidation, as in ``heap.KeyHeap``).

``ordered()`` yields live keys lowest priority first without changing what the heap
holds: it pops what it scans and puts it back before the next push or scan, so offering
k victims costs O(k + runs scanned * log runs).
"""

from __future__ import annotations

from collections import Counter, deque

import heapq
from collections.abc import Iterator, Sequence
from itertools import islice

from kvd.core.policies.base import Key

PRIO, TIE, SEQ, KEYS, START, LIVE = range(6)
# An entry: [priority, tie-break, sequence, keys deepest first, first maybe-live index,
# live keys]; lists so START and LIVE can change in place. SEQ is unique, so the heap
# never compares further.
Entry = list


class RunHeap:
    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._where: dict[Key, Entry] = {}  # key -> the entry it lives in
        self._entries = 0  # entries with a live key
        self._seq = 0
        self._held: list[Entry] = []  # popped by ordered(), not yet put back

    def _restore(self) -> None:
        heap, where = self._heap, self._where
        for e in self._held:
            if e[LIVE] > 0:
                keys, i = e[KEYS], e[START]
                while where.get(keys[i]) is not e:  # skip the keys that left meanwhile
                    i += 1
                e[START] = i
                heapq.heappush(heap, e)
        self._held = []

    def push_run(self, keys: Sequence[Key], priority: float, tie: int = 0,
                 new: bool = False) -> None:
        """Put ``keys`` (prefix order) in one new entry; they leave last key first.
        ``new`` promises that none of them is in the heap and none repeats (skips a
        lookup per key)."""
        if self._held:
            self._restore()
        where = self._where
        if new:
            unique = list(keys)
        else:
            unique = list(dict.fromkeys(keys))  # a key offered twice: evicted twice
            # Moved keys leave their old entries (counted per entry, in C).
            olds = list(map(where.get, unique))
            first = olds[0] if olds else None
            if olds.count(first) == len(olds):  # one old entry (or none): a re-hit run
                groups: dict[int, tuple[list, int]] = {id(first): (first, len(olds))}
            else:
                by_id = dict(zip(map(id, olds), olds))
                groups = {eid: (by_id[eid], c) for eid, c in Counter(map(id, olds)).items()}
            for old, moved in groups.values():
                if old is not None:
                    old[LIVE] -= moved
                    if not old[LIVE]:
                        self._entries -= 1
        self._seq += 1
        unique.reverse()
        entry = [priority, tie, self._seq, unique, 0, len(unique)]
        where.update(dict.fromkeys(unique, entry))
        self._entries += 1
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * self._entries + 64:  # drop the dead entries
            self._heap = [e for e in heap if e[LIVE] > 0]
            heapq.heapify(self._heap)

    def discard(self, key: Key) -> float | None:
        """Forget ``key``; returns its priority (None when absent)."""
        entry = self._where.pop(key, None)
        if entry is None:
            return None
        entry[LIVE] -= 1
        if not entry[LIVE]:
            self._entries -= 1
        return entry[PRIO]

    def discard_many(self, keys: Sequence[Key]) -> float | None:
        """Forget keys (each present, none twice); returns their highest priority."""
        if not keys:
            return None
        top, dead, pop = float("-inf"), 0, self._where.pop
        for entry in map(pop, keys):
            entry[LIVE] -= 1
            if not entry[LIVE]:
                dead += 1
            if entry[PRIO] > top:
                top = entry[PRIO]
        self._entries -= dead
        return top

    def pop_many(self, n: int) -> tuple[list[Key], float | None]:
        """The first ``n`` keys of ``ordered()``, discarded, and their highest priority:
        ``discard_many`` of them, taking whole runs at a time."""
        if self._held:
            self._restore()
        heap, where, out, top = self._heap, self._where, [], None
        while len(out) < n and heap:
            e = heap[0]
            if e[LIVE] <= 0:
                heapq.heappop(heap)
                continue
            keys, start, want = e[KEYS], e[START], n - len(out)
            take = keys[start:start + want]
            if list(map(where.get, take)).count(e) == len(take):  # all live: the usual
                end = start + len(take)
            else:  # some keys left this entry: walk it
                take, end = [], start
                while len(take) < want and end < len(keys):
                    if where.get(keys[end]) is e:
                        take.append(keys[end])
                    end += 1
            deque(map(where.pop, take), maxlen=0)
            out.extend(take)
            top = e[PRIO]
            e[LIVE] -= len(take)
            e[START] = end
            if not e[LIVE]:
                heapq.heappop(heap)
                self._entries -= 1
        return out, top

    def priority(self, key: Key) -> float:
        return self._where[key][PRIO]

    def __contains__(self, key: Key) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def ordered(self) -> Iterator[Key]:
        if self._held:
            self._restore()
        heap, where, held = self._heap, self._where, self._held
        pop = heapq.heappop
        while heap:
            e = pop(heap)
            if e[LIVE] <= 0:
                continue  # every key left it: drop it
            held.append(e)
            for key in islice(e[KEYS], e[START], None):
                if where.get(key) is e:
                    yield key
