"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO, a ghost.

New keys enter the small FIFO (10% of capacity); most one-hit wonders leave from
there without disturbing the main FIFO. A key reused while in the small FIFO moves
to the main FIFO when it reaches the small FIFO's end; the main FIFO is a 2-bit
CLOCK (a reused key goes round again with its counter decremented). Keys evicted
from the small FIFO are remembered in a ghost FIFO; a ghost key that is stored again
goes straight to the main FIFO.

The index evicts a request's worth of blocks before their keys come in (they are
inserted when their stores end), where the paper evicts one object before each insert.
So ``victims()`` counts the free room and the victims already offered as keys of the
small FIFO (that is where new keys go): a batch evicts what one eviction per insert
would, and the small FIFO keeps doing the filtering. Counted without them, a batch took
one victim from the small FIFO and the rest from the main one (on the shared trace at
5,000 blocks: 0.264 of references hit instead of 0.289). Keys coming back from the ghost
go to the main FIFO, which a batch cannot know in advance: for them the choice may
differ. As in libCacheSim, until the first eviction the small FIFO takes only its share
of new keys and the rest go to the main FIFO (else the whole first fill sits in the small
FIFO, which then never shrinks: an eviction and an insert per store keep its size).

``victims()`` must not change state, yet the promotions and CLOCK rotations are what
makes each eviction O(1) amortized. So every mutating call ends by ``_settle``, doing
that bookkeeping for real until the next victim sits at the end of its queue;
``victims()`` replays the same rules on a scratch copy only past that first victim.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from kvd.core.policies.base import EvictionPolicy, Key

SMALL_RATIO = 0.10
GHOST_RATIO = 0.90
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}
        self._evicted = False  # until the first eviction new keys past its share go to main
        self._sizes()

    def _sizes(self) -> None:
        self.small_cap = max(1, int(self.capacity * SMALL_RATIO))
        self.ghost_cap = max(1, int(self.capacity * GHOST_RATIO))

    # ------------------------------------------------------------ updates
    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self.insert_many((key,))

    def insert_many(self, keys: Sequence[Key], depth: int = 0, length: int = 0) -> None:
        # One loop for both calls; _settle is a no-op below capacity, so skip the call.
        freq, ghost, main, small, cap = self.freq, self.ghost, self.main, self.small, \
            self.capacity
        for key in keys:
            freq[key] = 0
            if key in ghost:
                del ghost[key]
                main[key] = None
            elif not self._evicted and len(small) >= self.small_cap:
                main[key] = None  # the first fill: the small FIFO takes only its share
            else:
                small[key] = None
            if len(freq) >= cap:
                self._settle()

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        freq = self.freq
        for key in keys:
            f = freq[key]
            if f < MAX_FREQ:
                freq[key] = f + 1
        self._settle()

    def remove(self, key: Key) -> None:
        if self.freq.pop(key, None) is None:
            return
        if key in self.small:
            del self.small[key]
        else:
            del self.main[key]
        self._settle()

    def evicted(self, key: Key) -> None:
        self.evicted_many((key,))

    def evicted_many(self, keys: Sequence[Key]) -> None:
        # A key evicted from the small FIFO is remembered in the ghost FIFO.
        freq, ghost, main, small, cap = self.freq, self.ghost, self.main, self.small, \
            self.capacity
        for key in keys:
            if freq.pop(key, None) is None:
                continue
            self._evicted = True
            if key in small:
                del small[key]
                ghost[key] = None
                if len(ghost) > self.ghost_cap:
                    ghost.popitem(last=False)
            else:
                del main[key]
            if len(freq) >= cap:
                self._settle()

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self._sizes()
        while len(self.ghost) > self.ghost_cap:
            self.ghost.popitem(last=False)
        self._settle()

    def _from_small(self, small_len: int, main_len: int) -> bool:
        return small_len > 0 and (small_len >= self.small_cap or main_len == 0)

    def _settle(self) -> None:
        """Promote and rotate for real until the next victim is at a queue's end."""
        if len(self.freq) < self.capacity:
            return  # no eviction is due; S3-FIFO only reorganizes when evicting
        small, main, freq = self.small, self.main, self.freq
        while small or main:
            if self._from_small(len(small), len(main)):
                key = next(iter(small))
                if freq[key] < 1:
                    return
                del small[key]
                freq[key] = 0
                main[key] = None
            else:
                key = next(iter(main))
                f = freq[key]
                if f == 0:
                    return
                freq[key] = f - 1
                main.move_to_end(key)

    # ------------------------------------------------------------ queries
    def victims(self) -> Iterator[Key]:
        freq, small_cap = self.freq, self.small_cap
        next_small, next_main = iter(self.small).__next__, iter(self.main).__next__
        small_len, main_len = len(self.small), len(self.main)
        requeued: deque[tuple[Key, int]] = deque()  # scratch tail of the main FIFO
        push, pop = requeued.append, requeued.popleft
        main_orig = main_len
        # As one eviction before each insert: the keys that will fill the free room and
        # the victims' places enter the small FIFO first, so they count as in it.
        taken = max(0, self.capacity - len(freq))
        if not self._evicted:  # the first fill: past its share, keys go to main
            taken = min(taken, max(0, small_cap - small_len))
        while small_len or main_len:
            # _from_small, inlined: this loop is the policy's hot path
            if small_len and (small_len + taken >= small_cap or not main_len):
                key = next_small()
                small_len -= 1
                if freq[key] >= 1:
                    push((key, 0))
                    main_len += 1
                    continue
            else:
                main_len -= 1
                if main_orig:
                    main_orig -= 1
                    key = next_main()
                    f = freq[key]
                else:
                    key, f = pop()
                if f:
                    push((key, f - 1))
                    main_len += 1
                    continue
            taken += 1
            yield key

    def __len__(self) -> int:
        return len(self.freq)
