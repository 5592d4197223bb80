from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.allocator import IDLE_TURNOVERS, Allocator, AllocatorError
from kvd.core.policies import make_policy

EXTENT = 64 * 1024


def test_slots_are_disjoint_and_inside_the_pool():
    a = Allocator(8 * EXTENT, EXTENT, 1024)
    slots = [a.alloc(4096) for _ in range(8 * 16)]
    assert None not in slots and a.alloc(4096) is None
    offs = a.offsets(np.array(slots), 4096)
    assert len(set(offs.tolist())) == len(slots)
    assert offs.min() >= 0 and offs.max() + 4096 <= a.capacity_bytes
    assert a.used_bytes == a.capacity_bytes


def test_an_emptied_extent_serves_another_size_class():
    a = Allocator(2 * EXTENT, EXTENT, 1024)
    small = [a.alloc(1024) for _ in range(2 * 64)]
    assert a.alloc(8192) is None
    for s in small[:64]:  # empties the first extent
        a.free(s)
    big = [a.alloc(8192) for _ in range(8)]
    assert None not in big and a.alloc(8192) is None
    assert a.used_bytes == 64 * 1024 + 8 * 8192


def test_oversized_and_undersized_slots_are_refused():
    a = Allocator(2 * EXTENT, EXTENT, 1024)
    with pytest.raises(AllocatorError, match="extent"):
        a.alloc(EXTENT + 1)
    with pytest.raises(AllocatorError, match="min_slot_bytes"):
        a.alloc(512)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1024, 3000, 4096, 20000]), st.booleans()),
                max_size=300))
def test_accounting_is_exact(ops):
    """Random alloc/free of mixed sizes: used bytes match, no overlap, back to zero."""
    a = Allocator(6 * EXTENT, EXTENT, 1024)
    live: dict[int, int] = {}
    for size, free_one in ops:
        if free_one and live:
            slot = next(iter(live))
            a.free(slot)
            del live[slot]
        else:
            slot = a.alloc(size)
            if slot is not None:
                assert slot not in live
                live[slot] = size
        assert a.used_bytes == sum(live.values())
        assert a.used_slots == len(live)
        spans = sorted((int(a.offsets(np.array([s]), z)[0]), z) for s, z in live.items())
        for (o1, z1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + z1 <= o2
        assert all(o + z <= a.capacity_bytes for o, z in spans)
    for slot in list(live):
        a.free(slot)
    assert a.used_bytes == 0 and a.free_slots(4096) == a.total_slots(4096)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1024, 4096]), st.integers(1, 40), st.booleans()),
                max_size=40))
def test_alloc_many_and_free_many_equal_the_single_calls(ops):
    """The batch calls hand out the same slots as one call per slot."""
    a, b = Allocator(6 * EXTENT, EXTENT, 1024), Allocator(6 * EXTENT, EXTENT, 1024)
    live: list[int] = []
    for size, n, free in ops:
        if free and live:
            gone, live = live[:n], live[n:]
            a.free_many(gone)
            for s in gone:
                b.free(s)
        else:
            got = a.alloc_many(size, n)
            one = [b.alloc(size) for _ in range(n)]
            assert got == [s for s in one if s is not None]
            live += got
        assert (a.used_bytes, a.used_slots) == (b.used_bytes, b.used_slots)
        assert a.free_slots(size) == b.free_slots(size)
        assert a.free_slots(4096) + a.used_bytes // 4096 <= a.total_slots(4096)


def test_blocks_when_full_counts_the_block_sizes_in_use() -> None:
    a = Allocator(8 << 20, 1 << 20, 4096)
    assert a.blocks_when_full() == 8 * 256  # no block size known: 4 KiB slots
    a.alloc_many(64 << 10, 1)
    assert a.blocks_when_full() == 8 * 16  # exact with one size
    a.free_slots(256 << 10)  # a second size: as if the extents were shared equally
    assert a.blocks_when_full() == 8 * (16 + 4) // 2


def test_a_block_size_no_block_has_any_more_is_forgotten() -> None:
    """A model replaced by another on the node: the policy was sized as if the two
    shared the pool for good, and eviction took the several-sizes path for good. Not
    at once: a size whose few blocks come and go re-sized the policy each time."""
    a = Allocator(8 << 20, 1 << 20, 4096)
    policy = make_policy("arc", a.max_slots)
    old = a.alloc_many(256 << 10, 5)  # two extents
    new = a.alloc_many(64 << 10, 3)
    a.free_slots(1 << 20)  # asked about, never given an extent
    a.fit(policy, a.max_slots)
    assert a.size_classes == 3 and policy.capacity == 8 * (4 + 16 + 1) // 3
    a.free_many(old)
    turnover = IDLE_TURNOVERS * a.blocks_when_full()

    def churn(n: int) -> None:  # the pool's other blocks come and go
        for _ in range(n):
            a.free_many(a.alloc_many(64 << 10, 8))
            a.fit(policy, a.max_slots, keep=64 << 10)

    churn(turnover // 8 - 2)
    assert a.size_classes == 3  # idle, not long enough
    a.free_many(a.alloc_many(256 << 10, 1))  # back meanwhile: idle from now again
    churn(turnover // 8 - 2)
    assert a.size_classes == 2 and policy.capacity == 8 * (4 + 16) // 2  # 1 MiB went
    churn(IDLE_TURNOVERS * a.blocks_when_full() // 8)  # the turnover of the pool as it is
    assert a.size_classes == 1 and policy.capacity == a.blocks_when_full() == 8 * 16
    a.free_many(new)  # the last size gone too: kept while asked for
    a.fit(policy, a.max_slots, keep=64 << 10)
    assert a.size_classes == 1 and a.free_slots(64 << 10) == 8 * 16


def test_fit_sizes_a_policy_once_per_new_block_size_never_above_its_bound() -> None:
    a = Allocator(8 << 20, 1 << 20, 4096)
    policy = make_policy("arc", a.max_slots)
    a.fit(policy, a.max_slots)
    assert policy.capacity == a.max_slots
    a.free_slots(64 << 10)
    a.fit(policy, a.max_slots)
    assert policy.capacity == 8 * 16
    policy.set_capacity(7)
    a.fit(policy, a.max_slots)  # no new size: left alone
    assert policy.capacity == 7
    small = make_policy("lru", 50)  # built smaller than the pool (the simulator)
    b = Allocator(8 << 20, 1 << 20, 4096)
    b.free_slots(64 << 10)
    b.fit(small, 50)
    assert small.capacity == 50


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1024, 4096]), st.integers(1, 12)), max_size=6),
       st.lists(st.integers(-2, 6 * 64 + 2), max_size=60), st.sampled_from([1024, 4096]))
def test_claim_many_equals_one_claim_per_slot(before, slots, size):
    """The restart's batch claim: the same answers and the same accounting as one claim
    per slot in order (repeats, slots of other sizes' extents, out of range), and the
    same slots left (their order may differ: each extent's list is rewritten once)."""
    a, b = Allocator(6 * EXTENT, EXTENT, 1024), Allocator(6 * EXTENT, EXTENT, 1024)
    for z, n in before:  # some extents already serving a size
        assert a.alloc_many(z, n) == b.alloc_many(z, n)
    assert a.claim_many(slots, size) == [b.claim(s, size) for s in slots]
    assert (a.used_bytes, a.used_slots) == (b.used_bytes, b.used_slots)
    for z in (1024, 4096):
        assert a.free_slots(z) == b.free_slots(z)
        assert sorted(a.alloc_many(z, 5000)) == sorted(b.alloc_many(z, 5000))
    classes = a.size_classes  # a size none of whose slots is in the pool: no class made
    assert a.claim_many([-1, 10**9], 2048) == [False, False] and a.size_classes == classes
