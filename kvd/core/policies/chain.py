"""The default policy: prefix-chain-aware GreedyDual with reuse and length signals.

KV blocks are prefix-chained and reused in bursts: a block that was hit once is
likely hit again soon (the next turn or question on the same context), while most
blocks are never hit at all, and those of short prompts least of all. Each block gets
a GreedyDual priority ``H = L + value``; the lowest goes first and ``L`` rises to the
priority of each victim, so a value buys survival time rather than immortality.

- A reused block (hit since it was stored, or stored again soon after an eviction,
  which a ghost list of recently evicted keys remembers) is worth ``REUSED``.
- A block never hit is worth ``length / (LONG * mean length)`` capped at 1: blocks
  of long prompts (documents, agent contexts) are reused far more often than those
  of short chats. The mean adapts, so the scale does not depend on the block size.
- Ties go to the deepest block first, so a chain loses its tail before its head
  (a hit needs every earlier block, so a lost head wastes the whole chain).

O(log n) per insert, touch and victim (a lazily invalidated heap); no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvd.core.policies.base import EvictionPolicy, Key
from kvd.core.policies.heap import KeyHeap

REUSED = 10.0  # value of a reused block; a never-hit block is worth at most 1
LONG = 2.0  # never-hit blocks of chains this many times the mean length are worth 1
MEAN_WINDOW = 4096  # inserts over which the mean chain length adapts


class ChainPolicy(EvictionPolicy):
    name = "chain"
    reused = REUSED
    long = LONG

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._heap = KeyHeap()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._clock = 0.0  # L: priority of the last victim
        self._mean_len = 0.0
        self._seen = 0

    def _cold_value(self, length: int) -> float:
        if length <= 0:
            return 1.0
        self._seen = min(self._seen + 1, MEAN_WINDOW)
        self._mean_len += (length - self._mean_len) / self._seen
        return min(1.0, length / (self.long * self._mean_len))

    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        value = self._cold_value(length)
        if key in self._ghost:
            del self._ghost[key]
            value = self.reused
        self._heap.push(key, self._clock + value, -depth)

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        prio = self._clock + self.reused
        push = self._heap.push
        for i in range(len(keys) - 1, -1, -1):
            push(keys[i], prio, -depth - i)

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def evicted(self, key: Key) -> None:
        prio = self._heap.discard(key)
        if prio is None:
            return
        self._clock = max(self._clock, prio)
        self._ghost[key] = None
        if len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    def victims(self) -> Iterator[Key]:
        return self._heap.ordered()

    def __len__(self) -> int:
        return len(self._heap)
