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

How much the length factor counts adapts too, as ARC adapts its split, from the ghost
list: the factor is raised to a power ``strength`` in [0, 1]. A never-hit block stored
again soon after its eviction says the factor cost it time it needed (lower the
power, towards recency: multi-turn chat, where the next turn of a short conversation
matters as much as a long document); a hit block stored again says value deserved
more (raise it). A hit-block return counts ``never-hit evictions / hit evictions``
steps, so the power settles where both kinds of victims come back at the same rate.

A run of blocks (one request's stores, or its hit blocks) shares one priority, and
ties go to the deepest block, so a chain loses its tail before its head (a hit needs
every earlier block: a lost head wastes the whole chain). A request stored in parts
(vLLM's chunked prefill stores each step's blocks; every part names the request's
length) is one run, also when other requests' stores come between its parts. The heap
holds one entry per run (``RunHeap``): O(log n) per request plus O(1) per block; reads
no clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import compress, repeat

from kvd.core.policies.base import EvictionPolicy, Key
from kvd.core.policies.runheap import RunHeap

REUSED = 10.0  # value of a block that was hit
LONG = 2.0  # never-hit blocks of chains this many times the mean length get full odds
HORIZON = 1.0  # capacities of stores and hits that age a block by one unit of value
GHOST = 1.0  # evicted keys remembered, in capacities
WINDOW = 20_000  # blocks per kind over which the reuse odds adapt
MEAN_WINDOW = 4096  # blocks stored over which the mean chain length adapts
STEP = 4.0  # a ghost return moves the length factor's power by STEP / capacity
FRESH, NEXT, HIT = 0, 1, 2  # kinds: new chain, stored right after a hit on it, hit
PARTS = 4096  # requests partly stored whose next part is remembered (a bound, not a knob)


class ChainPolicy(EvictionPolicy):
    name = "chain"
    reused = REUSED
    long = LONG
    horizon = HORIZON
    ghost = GHOST
    step = STEP

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._heap = RunHeap()
        self._kind: dict[Key, int] = {}
        self._ghost: OrderedDict[Key, int] = OrderedDict()  # evicted key -> its kind
        self._floor = 0.0  # GreedyDual's L, net of age
        # The time term, in units of value: ``_aged`` up to the last change of the tick,
        # then ``_ticks`` stores and hits of ``_tick`` each (counted, not summed: a run
        # stored at once and key by key must age alike, to the last bit).
        self._aged = 0.0
        self._ticks = 0
        self._tick = 1.0 / (self.horizon * self.capacity)  # age added per store or hit
        self._entered = [1.0, 1.0, 1.0]  # blocks that became each kind (decayed)
        self._again = [0.5, 0.5, 0.5]  # ... and were then hit or stored again
        self._mean_len = 0.0
        self._strength = 1.0  # power of the length factor, learned from the ghosts
        self._evicted = [1.0, 1.0]  # never-hit and hit blocks evicted (decayed)
        self._seen = 0
        self._hit_end = -1  # depth just past the last hit run
        self._next_depth = -1  # where the current run of stores would continue
        self._run_len = -1
        self._run_kind = FRESH
        self._run_base = self._run_prio = 0.0
        # Requests stored in parts (vLLM's chunked prefill stores each step's blocks):
        # (depth the next part starts at, length) -> the run's kind, base and priority,
        # so a part stored after other requests' stores continues its own run.
        self._parts: OrderedDict[tuple[int, int], tuple[int, float, float, int]] = \
            OrderedDict()
        # Equal priorities: the older run leaves first, and in a run the deepest block;
        # a tie is (run number << 32) - depth, so a run stored key by key or in parts
        # sorts among other runs as it does stored at once.
        self._runs = 0
        self._run_tie = 0

    @property
    def _age(self) -> float:
        return self._aged + self._ticks * self._tick

    # ------------------------------------------------------------ learning
    def _count(self, kind: int, n: int) -> None:
        entered = self._entered
        entered[kind] += n
        if entered[kind] > WINDOW:  # forget slowly, so the odds follow the workload
            entered[kind] *= 0.5
            self._again[kind] *= 0.5

    def _returned(self, kinds: Sequence[int]) -> None:
        """Ghosts of these kinds were stored again: move the length factor's power."""
        step = self.step / self.capacity
        up, s = step * self._evicted[0] / self._evicted[1], self._strength
        for kind in kinds:  # clamped at each step, as one key at a time would be
            s = min(1.0, s + up) if kind == HIT else max(0.0, s - step)
        self._strength = s

    def _odds(self, kind: int) -> float:
        p = self._again[kind] / self._entered[kind]
        return min(1.0, p * self._entered[HIT] / self._again[HIT])

    # ------------------------------------------------------------ updates
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self.insert_many((key,), depth, length)

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        """One run of stores; ``insert`` of each key in turn does exactly the same."""
        n = len(keys)
        if not n:
            return
        parts = self._parts
        if depth != self._next_depth or length != self._run_len:
            resumed = parts.pop((depth, length), None)
            if resumed is None:
                self._start_run(depth, length)
            else:  # the next part of a request stored in parts, others' in between
                self._run_kind, self._run_base, self._run_prio, self._run_tie = resumed
                self._run_len = length
        else:
            parts.pop((depth, length), None)
        self._next_depth = depth + n
        if depth + n < length:  # more of this request to come (chunked prefill)
            parts[depth + n, length] = (self._run_kind, self._run_base, self._run_prio,
                                        self._run_tie)
            if len(parts) > PARTS:
                parts.popitem(last=False)
        self._ticks += n
        ghost, kind = self._ghost, self._kind
        if not ghost or not any(map(ghost.__contains__, keys)):
            self._count(self._run_kind, n)
            kind.update(dict.fromkeys(keys, self._run_kind))
            self._heap.push_run(keys, self._run_prio, self._run_tie - depth - n, new=True)
            return
        # Stored again soon after its eviction: it was reused, as a hit is.
        returned = list(map(ghost.__contains__, keys))
        back = list(compress(keys, returned))
        rest = list(compress(keys, [not r for r in returned]))
        again, kinds = self._again, list(map(ghost.pop, back))
        for k in kinds:
            again[k] += 1.0
        self._returned(kinds)
        self._count(HIT, len(back))
        kind.update(dict.fromkeys(back, HIT))
        self._count(self._run_kind, len(rest))
        kind.update(dict.fromkeys(rest, self._run_kind))
        # Ties are -(depth + 1) of an entry's deepest key, so entries of one priority
        # leave deepest first, as keys stored one by one would; equal priorities share
        # one entry for the same reason.
        prio = self._run_base + self.reused
        if prio == self._run_prio:
            self._heap.push_run(keys, prio, self._run_tie - depth - n, new=True)
            return
        deepest = n - 1 - returned[::-1].index(True)
        self._heap.push_run(back, prio, self._run_tie - depth - deepest - 1, new=True)
        if rest:
            deepest = n - 1 - returned[::-1].index(False)
            self._heap.push_run(rest, self._run_prio, self._run_tie - depth - deepest - 1,
                                new=True)

    def _start_run(self, depth: int, length: int) -> None:
        """A run of stores shares one priority, so its blocks leave deepest first; all
        of it is decided here, so a run stored one key at a time gets the same."""
        if length > depth:  # the mean over blocks: this run stores length - depth
            w = min(length - depth, MEAN_WINDOW)  # w <= seen: a convex step, never < 0
            self._seen = min(self._seen + w, MEAN_WINDOW)
            self._mean_len += (length - self._mean_len) * w / self._seen
        # A run that starts where the last hit run ended continues that chain.
        self._run_kind = NEXT if depth == self._hit_end and depth > 0 else FRESH
        self._run_len = length
        self._runs += 1
        self._run_tie = self._runs << 32
        factor = 1.0 if length <= 0 else min(1.0, length / (self.long * max(self._mean_len,
                                                                          1.0)))
        factor **= self._strength
        self._run_base = self._floor + self._age + self._tick
        self._run_prio = self._run_base + self.reused * self._odds(self._run_kind) * factor

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        n = len(keys)
        if not n:
            return
        self._ticks += n
        kind, again = self._kind, self._again
        kinds = list(map(kind.__getitem__, keys))
        hit = kinds.count(HIT)  # counted in C; kinds are the three small ints
        again[HIT] += hit
        if hit != n:  # keys hit before need no update: the common case on reuse
            fresh = kinds.count(FRESH)
            again[FRESH] += fresh
            again[NEXT] += n - hit - fresh
            kind.update(dict.fromkeys(keys, HIT))
        self._count(HIT, n)
        self._hit_end = depth + n
        self._next_depth = -1
        # One priority for the run; ties go deepest first, so the head goes last.
        self._runs += 1
        self._heap.push_run(keys, self._floor + self._age + self.reused,
                            (self._runs << 32) - depth - n)

    def remove(self, key: Key) -> None:
        self._heap.discard(key)
        self._kind.pop(key, None)

    def remove_many(self, keys: Sequence[Key]) -> None:
        deque(map(self._heap.discard, keys), maxlen=0)
        deque(map(self._kind.pop, keys, repeat(None)), maxlen=0)

    def evicted(self, key: Key) -> None:
        if key in self._kind:
            self.evicted_many((key,))

    def evicted_many(self, keys: Sequence[Key]) -> None:
        self._forget(keys, self._heap.discard_many(keys))  # present, once each

    def evict(self, n: int) -> list[Key]:
        keys, top = self._heap.pop_many(n)
        self._forget(keys, top)
        return keys

    def outvoted(self, keys: Sequence[Key]) -> None:
        """Remembered as ghosts, but the clock stays: GreedyDual's floor rises to the
        priority of its own victims, and another policy's victim may be one this one
        values most, which would age everything else at once."""
        if keys:
            self._heap.discard_many(keys)
            self._forget(keys, float("-inf"))

    def _forget(self, keys: Sequence[Key], top: float | None) -> None:
        """Evicted ``keys``, the highest of whose priorities was ``top``."""
        if top is None:
            return
        self._floor = max(self._floor, top - self._age)
        ghost, evicted = self._ghost, self._evicted
        kinds = list(map(self._kind.pop, keys))
        ghost.update(zip(keys, kinds))
        hit = kinds.count(HIT)
        evicted[0] += len(kinds) - hit
        evicted[1] += hit
        if evicted[0] + evicted[1] > WINDOW:
            evicted[0] *= 0.5
            evicted[1] *= 0.5
        over = len(ghost) - int(self.ghost * self.capacity)
        if over > 0:  # oldest first, in C
            deque(map(ghost.popitem, repeat(False, over)), maxlen=0)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self._aged, self._ticks = self._age, 0
        self._tick = 1.0 / (self.horizon * self.capacity)
        while len(self._ghost) > self.ghost * self.capacity:
            self._ghost.popitem(last=False)

    # ------------------------------------------------------------ queries
    def victims(self) -> Iterator[Key]:
        return self._heap.ordered()

    def __len__(self) -> int:
        return len(self._heap)
