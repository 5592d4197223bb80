"""Least recently used: vLLM's LRU semantics (a hit moves the block to the MRU end)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import repeat

from kvd.core.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self._order[key] = None

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        self._order.update(dict.fromkeys(keys))  # in order, in C

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        # As vLLM: the head of the prefix ends most recent, so tails go first.
        # deque(maxlen=0) runs the moves in C: no Python loop per key.
        deque(map(self._order.move_to_end, reversed(keys)), maxlen=0)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evicted_many(self, keys: Sequence[Key]) -> None:
        deque(map(self._order.pop, keys, repeat(None)), maxlen=0)

    remove_many = evicted_many

    def victims(self) -> Iterator[Key]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
