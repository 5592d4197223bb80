"""The disk tier's index without files: a restart's restore from the journal's records."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.allocator import Allocator, AllocatorError
from kvd.core.policies.base import make_policy
from kvd.tiers.disk_index import DiskIndex, scoped
from kvd.tiers.disk_journal import DiskPut

EXT = 1 << 16  # 16 slots of 4 KiB, 8 of 8 KiB
SIZE = 6 * EXT


def index() -> DiskIndex:
    alloc = Allocator(SIZE, EXT, 4096)
    return DiskIndex(alloc, make_policy("chain", alloc.max_slots))  # orders by depth too


def restore_one_by_one(ix: DiskIndex, live: dict[int, DiskPut]) -> None:
    """The rule a batch restore must keep: each record claimed in journal order."""
    for rec in live.values():
        key = scoped(rec.ns, rec.key)
        try:
            ok = (key not in ix.entries and rec.slot_bytes == ix.slot_bytes(rec.length)
                  and ix.allocator.claim(rec.slot, rec.slot_bytes))
        except AllocatorError:
            ok = False
        if ok:
            ix.allocator.fit(ix.policy, ix.bound)
            ix.hold(key, rec)


record = st.builds(
    lambda key, slot, length, lie, depth: DiskPut(
        b"ns", bytes([key]), slot, lie or index().slot_bytes(length), length, 0, depth),
    st.integers(0, 12),  # few keys: some named at two slots
    st.integers(-1, SIZE // 4096 + 1),  # slots out of range too
    st.sampled_from([100, 5000, 70000]),  # 4 KiB and 8 KiB slots, and one too large
    st.sampled_from([0, 0, 0, 8192]),  # a slot size the length does not give
    st.integers(0, 3),  # depths: runs of consecutive ones, and breaks
)


@settings(max_examples=150, deadline=None)
@given(st.lists(record, max_size=40))
def test_restore_holds_what_one_claim_per_record_in_journal_order_would(records):
    live: dict[int, DiskPut] = {}
    for rec in records:  # as ``replay`` gives it: one per slot, at its last put
        live.pop(rec.slot, None)
        live[rec.slot] = rec
    batch, one = index(), index()
    batch.restore(live)
    restore_one_by_one(one, live)
    assert list(batch.entries.items()) == list(one.entries.items())  # journal order kept
    assert batch.slot_key == one.slot_key
    a, b = batch.allocator, one.allocator
    assert (a.used_bytes, a.used_slots) == (b.used_bytes, b.used_slots)
    # One by one, a size whose every claim failed was still made a class (sizing the
    # policy for blocks nobody has); the batch makes a class only for sizes it holds.
    assert a.size_classes == len({r.slot_bytes for r in batch.entries.values()})
    assert a.size_classes <= b.size_classes
    assert batch.policy.capacity == min(batch.bound, a.blocks_when_full())
    assert batch.policy.evict(len(batch.entries)) == one.policy.evict(len(one.entries))
    for size in (4096, 8192):  # the same slots left free (their order may differ)
        assert sorted(a.alloc_many(size, SIZE)) == sorted(b.alloc_many(size, SIZE))
