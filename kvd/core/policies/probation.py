"""LRU with a learned admission: blocks predicted cold enter on probation.

Most stored blocks are never used again (58% on the shared synthetic trace), and on
some traffic whole classes of them: the private tail of one-shot requests behind a
shared system prompt. This policy learns, online, how often the blocks of each class
were reused. A class is what the index knows when it stores a run: did the storing
request hit a cached prefix (``depth > 0``), and the length of its chain (log2). A
block of a class reused at under half the overall rate enters a probation queue that
is evicted before the main LRU order; a hit promotes it to the main order.

Reuse is counted from hits on blocks not yet reused, and from blocks stored again after
their eviction (a ghost list as long as the cache). Counts halve every ``capacity``
stored blocks, so the classes follow the traffic; a class with little evidence leans
on the overall rate. Nothing is declined: while the cache holds everything, probation
changes no decision, so it costs hits only where its prediction is wrong, which the
``adaptive`` policy's miniature simulations catch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import chain, repeat

from kvd.core.policies.base import EvictionPolicy, Key

CLASSES = 64  # (hit a prefix: 0/1) x log2 of the chain length, up to 2**31 blocks
PRIOR = 8.0  # stores' worth of the overall rate every class starts with
_ABSENT = object()


def class_of(depth: int, length: int) -> int:
    return (32 if depth > 0 else 0) + min(length.bit_length(), 31)


class ProbationPolicy(EvictionPolicy):
    name = "probation"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._probe: OrderedDict[Key, None] = OrderedDict()  # evicted first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._fresh: dict[Key, int] = {}  # cached, not reused yet -> class
        self._ghost: OrderedDict[Key, int] = OrderedDict()  # evicted unreused -> class
        self._stored = [0.0] * CLASSES
        self._reused = [0.0] * CLASSES
        self._since = 0.0
        self._total_s = self._total_r = 0.0
        self._run_next, self._run_length, self._run_cls = -1, -1, 0

    # ------------------------------------------------------------ the predictor
    # Running totals of the per-class counts, so that a decision costs O(1).
    def rate(self, cls: int) -> float:
        """The class's reuse rate so far, smoothed toward the overall rate."""
        overall = self._total_r / self._total_s if self._total_s > 0 else 0.0
        return (self._reused[cls] + PRIOR * overall) / (self._stored[cls] + PRIOR)

    def cold(self, cls: int) -> bool:
        """Reused at under half the overall rate."""
        if self._total_s <= 0:
            return False
        return self.rate(cls) < 0.5 * self._total_r / self._total_s

    def _reuse(self, cls: int) -> None:
        self._reused[cls] += 1
        self._total_r += 1

    def _decay(self) -> None:
        self._since += 1
        if self._since >= self.capacity:
            self._since = 0.0
            self._stored = [s * 0.5 for s in self._stored]
            self._reused = [r * 0.5 for r in self._reused]
            self._total_s, self._total_r = sum(self._stored), sum(self._reused)

    # ------------------------------------------------------------ updates
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        # One key at a time (insert_many is the base loop): the counts a decision reads
        # include every key stored before it, so a run decides as its single inserts do.
        # A key right after the last one (next depth, same chain) continues its run and
        # takes the run's class: the class is the storing request's, not the block's.
        cls = self._ghost.pop(key, None)
        if cls is not None:
            self._reuse(cls)  # stored again after its eviction: it was needed
        if depth > 0 and depth == self._run_next and length == self._run_length:
            cls = self._run_cls
        else:
            cls = class_of(depth, length)
        self._run_next, self._run_length, self._run_cls = depth + 1, length, cls
        self._stored[cls] += 1
        self._total_s += 1
        (self._probe if self.cold(cls) else self._main)[key] = None
        self._fresh[key] = cls
        self._decay()

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        fresh, reused, probe, main = self._fresh, self._reused, self._probe, self._main
        for cls in map(fresh.pop, filter(fresh.__contains__, keys)):
            reused[cls] += 1
            self._total_r += 1
        # As LRU (and vLLM): the head of the prefix ends most recent.
        promoted = list(dict.fromkeys(k for k in keys if k in probe))  # a key may repeat
        if promoted:
            deque(map(probe.pop, promoted), maxlen=0)
            main.update(dict.fromkeys(promoted))
        deque(map(main.move_to_end, reversed(keys)), maxlen=0)

    def remove(self, key: Key) -> None:
        self._probe.pop(key, None)
        self._main.pop(key, None)
        self._fresh.pop(key, None)

    def evicted_many(self, keys: Sequence[Key]) -> None:
        probe, main, fresh, ghost = self._probe, self._main, self._fresh, self._ghost
        for key in keys:
            if probe.pop(key, _ABSENT) is _ABSENT:
                main.pop(key, None)
            cls = fresh.pop(key, None)
            if cls is not None:
                ghost[key] = cls
        extra = len(ghost) - self.capacity
        if extra > 0:
            deque(map(ghost.popitem, repeat(False, extra)), maxlen=0)

    def evicted(self, key: Key) -> None:
        self.evicted_many((key,))

    # ------------------------------------------------------------ queries
    def victims(self) -> Iterator[Key]:
        return chain(iter(self._probe), iter(self._main))

    def __len__(self) -> int:
        return len(self._probe) + len(self._main)
