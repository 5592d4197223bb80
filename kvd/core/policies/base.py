"""The eviction-policy interface and its registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from itertools import islice
from typing import ClassVar

Key = Hashable


def first_places(keys: Sequence[Key], positions: list[int]) -> list[int]:
    """``positions`` without those whose key came earlier in ``keys``: a key repeated in
    one call is stored once, at its first place (the index and the miniature caches
    alike; a policy never sees one key inserted twice)."""
    if len(set(keys)) == len(keys):
        return positions
    first: dict[Key, int] = {}
    return [i for i in positions if first.setdefault(keys[i], i) == i]


class EvictionPolicy(ABC):
    """Orders READY blocks for eviction.

    Contract (the index is the only caller, single-threaded):
    - ``insert(key, depth, length=...)`` when a block becomes READY; ``depth`` is its
      position in its request's prefix chain (0 = first block), ``length`` the length
      of the chain that stored it (0 when unknown). A key is never inserted twice
      without a ``remove``/``evicted`` in between.
    - ``insert_many(keys, depth, length)`` is ``insert(keys[i], depth + i, length)`` for
      each key in order (the index hands a request's run over in one call); policies
      override it only to do the same work faster.
    - ``touch(keys, depth)`` on a hit, keys in prefix order, ``keys[0]`` at ``depth``.
      Only keys currently inserted are passed.
    - ``victims()`` yields inserted keys, best victim first, without changing state.
      The caller may skip keys it cannot evict (pinned) and stops early; it must not
      call other methods while iterating.
    - ``evicted(key)`` (or ``evicted_many(keys)``, the same for each in order) after
      the caller evicted a key that ``victims()`` offered; ``remove(key)`` (or
      ``remove_many(keys)``, the same for each) when a key leaves for another reason
      (flush, failed checksum).
    - ``evict(n)`` is ``evicted_many`` of the first ``n`` keys of ``victims()``, which
      it returns: the caller's path when it may evict any key (none is pinned).
    - ``capacity`` is the cache size in blocks; ``set_capacity`` may change it.
    - No I/O, no clock: the same calls give the same decisions (the simulator relies
      on it).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)

    @abstractmethod
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None: ...

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        insert = self.insert
        for i, key in enumerate(keys):
            insert(key, depth + i, length)

    @abstractmethod
    def touch(self, keys: Sequence[Key], depth: int = 0) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    def remove_many(self, keys: Sequence[Key]) -> None:
        """``remove`` on each key (an admin flush takes a million at once); policies
        override it only to do the same work faster."""
        deque(map(self.remove, keys), maxlen=0)

    @abstractmethod
    def victims(self) -> Iterator[Key]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def evicted(self, key: Key) -> None:
        self.remove(key)

    def evicted_many(self, keys: Sequence[Key]) -> None:
        """``evicted`` on each key in order (the index evicts a request's worth at once);
        policies override it only to do the same work faster."""
        deque(map(self.evicted, keys), maxlen=0)

    def outvoted(self, keys: Sequence[Key]) -> None:
        """``keys`` were evicted by another policy's choice (``adaptive`` keeps several
        policies in step and lets one choose): forget them as ``evicted_many`` does,
        but a policy whose state keys off its own victims may do otherwise."""
        self.evicted_many(keys)

    def lead_from(self, miniature: EvictionPolicy) -> None:
        """This policy starts choosing the victims (``adaptive`` hands it the lead);
        ``miniature``, the same class at a smaller capacity, replayed a sample of the
        keys under its own choices all along. A policy whose learned state its
        ``outvoted`` calls distorted may take that state from the miniature, scaled."""

    def evict(self, n: int) -> list[Key]:
        """The ``n`` best victims, evicted; policies override it only to be faster."""
        keys = list(islice(self.victims(), n))
        self.evicted_many(keys)
        return keys

    def set_capacity(self, capacity: int) -> None:
        self.capacity = max(1, capacity)

    def describe(self) -> dict[str, object]:
        """What an operator may want to see of the policy's state (the daemon's status,
        ``policy_state``): plain JSON values; nothing by default."""
        return {}


# name -> "module:Class", imported lazily so the registry never drags code in.
_REGISTRY: dict[str, str] = {
    "lru": "kvd.core.policies.lru:LRUPolicy",
    "arc": "kvd.core.policies.arc:ARCPolicy",
    "s3fifo": "kvd.core.policies.s3fifo:S3FIFOPolicy",
    "chain": "kvd.core.policies.chain:ChainPolicy",
    "probation": "kvd.core.policies.probation:ProbationPolicy",
    "adaptive": "kvd.core.policies.adaptive:AdaptivePolicy",
}
DEFAULT_POLICY = "adaptive"


def register_policy(name: str, target: str) -> None:
    _REGISTRY[name] = target


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build a policy by registry name; ValueError names the known ones."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(policy_names())}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(capacity)
