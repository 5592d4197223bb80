"""The default policy: follow whichever expert policy scores best on this traffic.

No single policy wins on every workload: LRU is hard to beat on multi-turn chat, where
the next turn extends the last one; ``chain`` wins where long prompts are reused and
short ones are not; ARC in between. Rather than fixing a choice (or constants) on one
trace, this policy keeps every expert's order of the blocks it holds and evicts in the
order of the current leader. The leader is the expert whose miniature simulation
(``shadow.Shadow``: the same policy class replayed on a spatial sample of the keys, at
the same fraction of the capacity) scored the most prefix hits recently. When the
traffic changes, the scores change, and so does the leader; the experts' orders are
kept up to date all along, so a new leader takes over from a consistent state.

Two checks keep the choice honest:
- The shadows replay the same calls, so their hits are compared in pairs, call by
  call: the lead changes hands when a challenger is ahead by more than ``Z`` standard
  deviations of the summed per-call differences (``challenger``). Shadows that hit the
  same keys never trade places on their own account, and a steady edge shows after a
  few calls, where a test on the hit totals would wait for it to outgrow their noise.
- A miniature does not scale exactly for every policy (SHARDS is exact for stack
  algorithms like LRU, not for ARC's or ``chain``'s learned state), and the live
  cache, whose content earlier leaders chose, may not reach what a fresh shadow does.
  So each expert's score is weighed by the live cache's hits on the sampled keys over
  its shadow's hits while it led, counted once ``SETTLE`` capacities of stores went
  by under it, and forgotten as slowly as the scores.

A new leader takes over what it learned in its shadow where the others' choices
distorted its own copy (``lead_from``: ARC's split between T1 and T2 adapts on returns
of its ghosts, which held the previous leader's victims).

The first leader is ARC: a late switch costs least towards LRU, whose order is the
held keys' recency whoever chose them, while ARC's edge (reused blocks kept apart from
one-off ones) is history that a late start lacks.

Cost: each expert's own per-operation cost (O(1) or O(log n)), plus the sampled
replays, which see about ``1024 / capacity`` of the keys (all of them below 2,048
blocks). Deterministic: the sample is a fixed hash of the key, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import compress
from zlib import crc32

from kvd.core.policies.base import EvictionPolicy, Key, make_policy
from kvd.core.policies.shadow import Shadow, key_hash, sample_shift

EXPERTS = ("arc", "lru", "chain")  # the first leads until the shadows say otherwise
WINDOW = 4  # scores halve every WINDOW miniature capacities of sampled references
Z = 1.0  # a challenger leads when ahead by this many standard deviations
PRIOR = 32.0  # sampled hits of evidence a calibration starts from (ratio 1)
SETTLE = 4  # miniature capacities of stores under a new leader before it is measured


def challenger(scores: Sequence[float], weights: Sequence[float],
               products: Sequence[Sequence[float]], lead: int, z: float = Z) -> int:
    """The expert that should lead: the best weighed score, if it is ahead of ``lead``'s
    by more than ``z`` standard deviations of the summed per-call differences, else
    ``lead``. ``products[i][j]`` sums, over calls, expert i's hits times expert j's, so
    the differences' sum of squares is a quadratic form in the weights."""
    weighed = [w * s for w, s in zip(weights, scores)]
    best = max(range(len(weighed)), key=weighed.__getitem__)
    gap = weighed[best] - weighed[lead]
    if gap <= 0:
        return lead
    wb, wl = weights[best], weights[lead]
    var = (wb * wb * products[best][best] + wl * wl * products[lead][lead]
           - 2 * wb * wl * products[best][lead])
    return best if gap * gap > z * z * var else lead


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"
    experts: tuple[str, ...] = EXPERTS

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._build()

    def _build(self) -> None:
        self._live = [make_policy(n, self.capacity) for n in self.experts]
        self._shift = sample_shift(self.capacity)
        mini = max(1, self.capacity >> self._shift)
        self._shadows = [Shadow(make_policy(n, mini)) for n in self.experts]
        self._limit = (1 << 32) >> self._shift  # sampled: key_hash(key) < _limit
        # The sampled keys held (when sampling), stored since the last build: a hit's
        # sample is a set lookup per key, not a hash, as each key was sampled at insert.
        self._held_sample: set[Key] = set()
        self._window = WINDOW * mini
        self._seen = 0
        self.lead = 0  # index of the leading expert
        n = len(self.experts)
        # Per call, the shadows' hits h: decayed sums of h_i * h_j (the paired test's
        # variance), and of the live hits and the leader's shadow hits, per expert, while
        # it led (its calibration), counted once ``_settle`` sampled stores went by.
        self._products = [[0.0] * n for _ in range(n)]
        self._live_hits = [0.0] * n
        self._shadow_hits = [0.0] * n
        self._misses_sq = [0.0] * n  # per call (live - shadow hits) squared: its noise
        self._mini = mini
        self._settle = SETTLE * mini
        # Stores not yet replayed in the shadows: [keys, depth, length]. Consecutive
        # inserts of one run merge, so ``insert`` one key at a time and ``insert_many``
        # leave the same trace in the shadows; any other call replays them first.
        self._stores: list = []

    @property
    def leader(self) -> str:
        return self.experts[self.lead]

    # ------------------------------------------------------------ the sample
    def _sample(self, keys: Sequence[Key], depth: int, length: int,
                stored: bool = True) -> None:
        """Replay the sampled keys of one call (stored ones, else hits) through every
        shadow, then maybe let another expert lead."""
        n = len(keys)
        if self._shift == 0:
            got, depths = list(keys), list(range(depth, depth + n))
        else:
            if stored:
                hashes = map(crc32 if isinstance(keys[0], bytes) else key_hash, keys)
                sampled = map(self._limit.__gt__, hashes)
            else:
                sampled = map(self._held_sample.__contains__, keys)
            idx = list(compress(range(n), sampled))  # C iterators: no bytecode per key
            got, depths = [keys[i] for i in idx], [depth + i for i in idx]
            if stored:
                self._held_sample.update(got)
        hits = [s.reference(got, depths, depth, depth + n, length) for s in self._shadows]
        if not got:
            return
        self._seen += len(got)
        if stored:
            self._settle -= len(got)
        lead = self.lead
        if self._settle <= 0:  # the cache turned over under this leader: measure it
            live = 0 if stored else len(got)
            self._live_hits[lead] += live
            self._shadow_hits[lead] += hits[lead]
            self._misses_sq[lead] += (live - hits[lead]) ** 2
        if any(hits):
            for i, row in enumerate(self._products):
                if hits[i]:
                    for j, h in enumerate(hits):
                        row[j] += hits[i] * h
        self._choose()

    def weights(self) -> list[float]:
        """Each expert's calibration: live hits per shadow hit while it led, where they
        differ by more than ``Z`` standard deviations (paired, as in ``challenger``)."""
        return [(live + PRIOR) / (shadow + PRIOR)
                if (live - shadow) ** 2 > Z * Z * sq else 1.0
                for live, shadow, sq in zip(self._live_hits, self._shadow_hits,
                                            self._misses_sq)]

    def _choose(self) -> None:
        lead = self.lead
        self.lead = challenger([s.score for s in self._shadows], self.weights(),
                               self._products, lead, Z)
        if self.lead != lead:
            self._settle = SETTLE * self._mini
            self._live[self.lead].lead_from(self._shadows[self.lead].policy)
        if self._seen >= self._window:  # forget slowly, so the choice can follow
            self._seen = 0
            for s in self._shadows:
                s.score *= 0.5
            # The products halve with the scores, which overstates the variance of a
            # halved sum (a test at about 1.2 standard deviations in steady state; the
            # exact 1.0 scored a little lower on average on every trace set).
            for row in self._products:
                row[:] = [x * 0.5 for x in row]
            # Every expert's calibration too: one measured in a bad spell (or while
            # the cache still held its predecessor's choice) does not bar it for good.
            # Its squares by the square of the factor, so halving leaves whether a
            # calibration counts as it was (it fades through PRIOR, not at once).
            for counts in (self._live_hits, self._shadow_hits):
                counts[:] = [x * 0.5 for x in counts]
            self._misses_sq = [x * 0.25 for x in self._misses_sq]

    # ------------------------------------------------------------ updates
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self.insert_many((key,), depth, length)

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        if not keys:
            return
        for p in self._live:
            p.insert_many(keys, depth, length)
        last = self._stores
        if last and last[1] + len(last[0]) == depth and last[2] == length:
            last[0].extend(keys)
        else:
            self._replay()
            self._stores = [list(keys), depth, length]

    def _replay(self) -> None:
        if self._stores:
            keys, depth, length = self._stores
            self._stores = []
            self._sample(keys, depth, length)

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        if not keys:
            return
        self._replay()
        for p in self._live:
            p.touch(keys, depth)
        self._sample(keys, depth, 0, stored=False)

    def remove(self, key: Key) -> None:
        self._replay()
        for p in self._live:
            p.remove(key)
        self._held_sample.discard(key)

    def remove_many(self, keys: Sequence[Key]) -> None:
        if not keys:  # as no ``remove`` at all: a replay now would split a run of stores
            return
        self._replay()
        for p in self._live:
            p.remove_many(keys)
        self._held_sample.difference_update(keys)

    def evicted(self, key: Key) -> None:
        self.evicted_many((key,))

    def evicted_many(self, keys: Sequence[Key]) -> None:
        self._replay()
        for i, p in enumerate(self._live):
            if i == self.lead:
                p.evicted_many(keys)
            else:
                p.outvoted(keys)
        self._held_sample.difference_update(keys)

    def evict(self, n: int) -> list[Key]:
        self._replay()
        keys = self._live[self.lead].evict(n)
        for i, p in enumerate(self._live):
            if i != self.lead:
                p.outvoted(keys)
        self._held_sample.difference_update(keys)
        return keys

    def set_capacity(self, capacity: int) -> None:
        """Experts follow; the shadows start afresh at the new sampling rate, and so
        does their sample of the held keys (stores from now on; rebuilding it would
        walk every held key on the loop, and the fresh shadows hold none of them)."""
        self._replay()
        super().set_capacity(capacity)
        for p in self._live:
            p.set_capacity(self.capacity)
        lead = self.lead
        live = self._live
        self._build()
        self._live, self.lead = live, lead

    # ------------------------------------------------------------ queries
    def victims(self) -> Iterator[Key]:
        """The leader's order. Replays pending stores in the shadows first (which may
        hand the lead over): work ``insert`` deferred, not a change of what is cached."""
        self._replay()
        return self._live[self.lead].victims()

    def __len__(self) -> int:
        return len(self._live[self.lead])

    def describe(self) -> dict[str, object]:
        return {"leader": self.leader, "sample_rate": 1 / (1 << self._shift),
                "weights": dict(zip(self.experts, (round(w, 3) for w in self.weights())))}
