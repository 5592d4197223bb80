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

EXPERTS = ("lru", "arc", "chain")  # the first leads until the shadows say otherwise
WINDOW = 4  # scores halve every WINDOW miniature capacities of sampled references


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
        for shadow in self._shadows:
            shadow.reference(got, depths, depth, depth + n, length)
        if not got:
            return
        self._seen += len(got)
        self._choose()

    def _choose(self) -> None:
        """Hand the lead over when another expert is ahead by more than chance: hits
        are counts, so a lead of about one standard deviation of their sum."""
        shadows = self._shadows
        scores = [s.score for s in shadows]
        best = max(range(len(scores)), key=scores.__getitem__)
        gap = scores[best] - scores[self.lead]
        if gap > 0 and gap * gap > scores[best] + scores[self.lead]:
            self.lead = best
        if self._seen >= self._window:  # forget slowly, so the choice can follow
            self._seen = 0
            for s in shadows:
                s.score *= 0.5

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
