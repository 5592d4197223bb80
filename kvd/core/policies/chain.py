"""The default policy: prefix-chain-aware GreedyDual with learned reuse odds.

KV blocks are prefix-chained and reused in bursts: a block hit once is likely hit
again soon (the next question or turn on the same context), while many blocks are
never hit at all. Each block gets a priority ``clock + value`` and the lowest goes
first. The clock is GreedyDual's (it rises to the priority of each victim, net of
age) plus a slow time term (one unit per ``HORIZON`` capacities of stores and hits),
so value buys survival time, never immortality, even when evictions are rare.

Value is ``REUSED`` for a block that was hit (or stored again soon after its
eviction, which a ghost list remembers). A block never hit is worth ``REUSED`` times
the odds, learned online, that a block of its kind is reused, relative to a hit
block, times a length factor. Its kind says whether it was stored right after a hit
on its own chain (a conversation's next turn extends the last one, so these often
matter) or not; the length factor ``length / (LONG * mean length)`` (at most 1)
favours long prompts (documents, agent contexts), reused far more often than short
chats. Both adapt, so neither the workload mix nor the block size is baked in.

Ties go to the deepest block, so a chain loses its tail before its head (a hit needs
every earlier block: a lost head wastes the whole chain).

O(log n) per insert, hit and victim (a lazily invalidated heap); reads no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvd.core.policies.base import EvictionPolicy, Key
from kvd.core.policies.heap import KeyHeap

REUSED = 10.0  # value of a block that was hit
LONG = 2.0  # never-hit blocks of chains this many times the mean length get full odds
HORIZON = 1.0  # capacities of stores and hits that age a block by one unit of value
WINDOW = 20_000  # blocks per kind over which the reuse odds adapt
MEAN_WINDOW = 4096  # stores over which the mean chain length adapts
FRESH, NEXT, HIT = 0, 1, 2  # kinds: new chain, stored right after a hit on it, hit


class ChainPolicy(EvictionPolicy):
    name = "chain"
    reused = REUSED
    long = LONG
    horizon = HORIZON

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._heap = KeyHeap()
        self._kind: dict[Key, int] = {}
        self._ghost: OrderedDict[Key, int] = OrderedDict()  # evicted key -> its kind
        self._floor = 0.0  # GreedyDual's L, net of age
        self._age = 0.0  # the time term, in units of value
        self._tick = 1.0 / (self.horizon * self.capacity)  # age added per store or hit
        self._entered = [1.0, 1.0, 1.0]  # blocks that became each kind (decayed)
        self._again = [0.5, 0.5, 0.5]  # ... and were then hit or stored again
        self._mean_len = 0.0
        self._seen = 0
        self._hit_end = -1  # depth just past the last hit run
        self._last_depth = -2  # of the last store, to see where a run of stores ends
        self._run_len = -1
        self._run_kind = FRESH
        self._run_base = self._run_prio = 0.0

    # ------------------------------------------------------------ learning
    def _enter(self, key: Key, kind: int) -> None:
        self._kind[key] = kind
        self._count(kind, 1)

    def _count(self, kind: int, n: int) -> None:
        entered = self._entered
        entered[kind] += n
        if entered[kind] > WINDOW:  # forget slowly, so the odds follow the workload
            entered[kind] *= 0.5
            self._again[kind] *= 0.5

    def _odds(self, kind: int) -> float:
        p = self._again[kind] / self._entered[kind]
        return min(1.0, p * self._entered[HIT] / self._again[HIT])

    # ------------------------------------------------------------ updates
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self._age += self._tick
        if length > 0:
            if self._seen < MEAN_WINDOW:
                self._seen += 1
            self._mean_len += (length - self._mean_len) / self._seen
        if depth != self._last_depth + 1 or length != self._run_len:
            self._start_run(depth, length)
        self._last_depth = depth
        was = self._ghost.pop(key, None)
        if was is None:
            self._enter(key, self._run_kind)
            prio = self._run_prio
        else:
            self._again[was] += 1.0
            self._enter(key, HIT)
            prio = self._run_base + self.reused
        self._heap.push(key, prio, -depth)

    def _start_run(self, depth: int, length: int) -> None:
        """A run of stores shares one priority, so its blocks leave deepest first."""
        # A run that starts where the last hit run ended continues that chain.
        self._run_kind = NEXT if depth == self._hit_end and depth > 0 else FRESH
        self._run_len = length
        factor = 1.0 if length <= 0 else min(1.0, length / (self.long * self._mean_len))
        self._run_base = self._floor + self._age
        self._run_prio = self._run_base + self.reused * self._odds(self._run_kind) * factor

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        n = len(keys)
        if not n:
            return
        self._age += n * self._tick
        kind, again = self._kind, self._again
        for key in keys:
            again[kind[key]] += 1.0
        kind.update(dict.fromkeys(keys, HIT))
        self._count(HIT, n)
        self._hit_end = depth + n
        # One priority for the run; ties go deepest first, so the head goes last.
        self._heap.push_run(keys, self._floor + self._age + self.reused, -depth)

    def remove(self, key: Key) -> None:
        self._heap.discard(key)
        self._kind.pop(key, None)

    def evicted(self, key: Key) -> None:
        prio = self._heap.discard(key)
        if prio is None:
            return
        self._floor = max(self._floor, prio - self._age)
        self._ghost[key] = self._kind.pop(key)
        if len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self._tick = 1.0 / (self.horizon * self.capacity)
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    # ------------------------------------------------------------ queries
    def victims(self) -> Iterator[Key]:
        return self._heap.ordered()

    def __len__(self) -> int:
        return len(self._heap)
