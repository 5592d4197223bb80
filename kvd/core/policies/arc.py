"""Adaptive Replacement Cache with vLLM's ARC semantics.

T1 holds blocks seen once, T2 blocks reused by a later request; B1/B2 remember keys
recently evicted from each. A store of a key found in B1 grows T1's target, one found
in B2 shrinks it, so the split between recency and frequency follows the workload.
As in vLLM, hits are applied tail to head, so a prefix's head ends most recent.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import repeat

from kvd.core.policies.base import EvictionPolicy, Key

_END = object()


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1 = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        # vLLM adapts on the store miss, then the insert clears the ghost entry.
        if key in self.b1:
            delta = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1 = min(self.target_t1 + delta, float(self.capacity))
            del self.b1[key]
        elif key in self.b2:
            delta = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1 = max(self.target_t1 - delta, 0.0)
            del self.b2[key]
        self.t1[key] = None

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        b1, b2 = self.b1, self.b2
        if (b1 and any(map(b1.__contains__, keys))) or (b2 and any(map(b2.__contains__,
                                                                       keys))):
            for key in keys:
                self.insert(key)
        else:  # no ghost among them, the usual case: one C call
            self.t1.update(dict.fromkeys(keys))

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def remove_many(self, keys: Sequence[Key]) -> None:
        t1, t2 = self.t1, self.t2
        deque(map(t2.pop, [k for k in keys if t1.pop(k, _END) is _END], repeat(None)),
              maxlen=0)

    def victims(self) -> Iterator[Key]:
        # vLLM's evict(): take from T1 while it is at or above its target, else T2;
        # the T1 size it compares is the one left after the victims already offered.
        t1_size = len(self.t1)
        target = int(self.target_t1)
        it1, it2 = iter(self.t1), iter(self.t2)
        while True:
            key: object = _END
            if t1_size >= target:
                key = next(it1, _END)
                if key is not _END:
                    t1_size -= 1
            if key is _END:
                key = next(it2, _END)
            if key is _END:
                key = next(it1, _END)
                if key is _END:
                    return
                t1_size -= 1
            yield key

    def evicted(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            ghost = self.b1
        else:
            del self.t2[key]
            ghost = self.b2
        ghost[key] = None
        if len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def evicted_many(self, keys: Sequence[Key]) -> None:
        # Each ghost FIFO gets its keys in order and keeps its newest ``capacity``, so
        # trimming once at the end leaves what trimming after each key would.
        t1 = self.t1
        if all(map(t1.__contains__, keys)):
            one, two = keys, ()
        else:
            one = [k for k in keys if k in t1]
            two = [k for k in keys if k not in t1]
        for src, ghost, ks in ((t1, self.b1, one), (self.t2, self.b2, two)):
            if ks:
                deque(map(src.__delitem__, ks), maxlen=0)
                ghost.update(dict.fromkeys(ks))
                over = len(ghost) - self.capacity
                if over > 0:
                    deque(map(ghost.popitem, repeat(False, over)), maxlen=0)

    def lead_from(self, miniature: EvictionPolicy) -> None:
        """T1's target, as the miniature learned it from its own victims: while another
        policy led, B1 and B2 held that one's victims, and their returns (e.g. reused
        blocks another policy dropped from T2's side) drove this target towards the
        whole capacity, where ARC would purge T2, the reused blocks that are its edge."""
        if isinstance(miniature, ARCPolicy):
            self.target_t1 = min(float(self.capacity),
                                 miniature.target_t1 * self.capacity / miniature.capacity)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self.target_t1 = min(self.target_t1, float(self.capacity))
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
