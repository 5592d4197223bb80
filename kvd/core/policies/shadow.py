"""Miniature simulations: a policy replayed on a spatial sample of the keys.

As in SHARDS / "Cache Modeling and Optimization using Miniature Simulations" (Waldspurger
et al.): keys whose hash falls under a threshold (rate ``1 / 2**shift``) are replayed
through a cache of ``capacity * rate`` blocks. Its hit count estimates, at a small cost,
what the same policy would score on the whole stream at the full capacity, so the live
cache can follow whichever policy is doing best on the traffic it actually sees.

The stream is what the live policy hears: a request's hit run (``touch``) then its
stored run (``insert``). A sampled key counts as a hit only while every earlier sampled
key of its request was present (a prefix hit needs its whole prefix); at rate 1 that is
exactly the simulator's prefix-hit fraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from zlib import crc32

from kvd.core.policies.base import EvictionPolicy, Key, first_places

MINI = 1024  # blocks a miniature cache is given at least (smaller: all keys are sampled)


def sample_shift(capacity: int, mini: int = MINI) -> int:
    """log2 of the sampling divisor: the largest that leaves ``mini`` blocks or more."""
    shift = 0
    while capacity >> (shift + 1) >= mini:
        shift += 1
    return shift


def key_hash(key: Key) -> int:
    """A hash that is the same in every process (``hash(bytes)`` is salted per process,
    so the sample, and the simulator's figures, would change from run to run)."""
    return crc32(key) if isinstance(key, bytes) else hash(key) & 0xFFFFFFFF


class Shadow:
    """One policy's miniature cache and its (decayed) hit count."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.capacity = policy.capacity
        self.score = 0.0  # hits, decayed by the owner
        self.hits = 0  # all hits scored
        self._keys: set[Key] = set()  # what the miniature cache holds
        self._end = -1  # depth just past the last call, while its prefix run holds

    def reference(self, keys: Sequence[Key], depths: Sequence[int], start: int, stop: int,
                  length: int) -> int:
        """Replay the sampled keys (prefix order, at ``depths``) of a live call that
        covered depths ``start`` to ``stop``; returns the hits scored."""
        if not keys:  # none sampled (most calls at low rates): only the run goes on
            self._end = stop if start == 0 or start == self._end else -1
            return 0
        policy, held = self.policy, self._keys
        present = list(map(held.__contains__, keys))
        hits = 0
        unbroken = start == 0 or start == self._end  # continues its request's prefix
        if unbroken:
            hits = present.index(False) if False in present else len(keys)
        self._end = stop if unbroken and hits == len(keys) else -1
        if hits:
            policy.touch(keys[:hits], depths[0])
        # Present after a miss: the live index tells its policy nothing of those either.
        new = first_places(keys, [i for i in range(hits, len(keys)) if not present[i]])
        if new:
            add = [keys[i] for i in new]
            # Room first, as the index makes room before it stores a request's blocks.
            over = min(len(held), len(held) + len(add) - self.capacity)
            if over > 0:
                held.difference_update(policy.evict(over))
            held.update(add)
            # A present key between new ones splits the stored blocks into runs, as the
            # index commits them (one ``insert_many`` per run).
            start = 0
            for i in range(1, len(new) + 1):
                if i == len(new) or new[i] != new[i - 1] + 1:
                    policy.insert_many(add[start:i], depths[new[start]], length)
                    start = i
            over = len(held) - self.capacity
            if over > 0:  # more new keys than the whole miniature cache
                held.difference_update(policy.evict(over))
        self.score += hits
        self.hits += hits
        return hits
