from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core import eviction
from kvd.core.allocator import Allocator
from kvd.core.index import NO_SLOT, PENDING, READY, Index
from kvd.core.states import FREE
from kvd.core.policies import make_policy, policy_names
from kvd.core.snapshot import copy_live_blocks, live_blocks
from kvd.core.tenants import Tenants

BLOCK = 4096


def make_index(blocks: int = 16, policy: str = "lru", tp: int = 1):
    a = Allocator(blocks * BLOCK * tp, 4 * BLOCK * tp, 1024)
    ix = Index(a, make_policy(policy, blocks))
    tenants = Tenants()
    t = tenants.get_or_create("t", model="m", tp_size=tp, rank_page_bytes=(BLOCK,))
    return ix, t, tenants


def store(ix, t, keys, rank=0):
    r = ix.allocate(t, keys)
    slots = np.array([s for s in r.slots if s != NO_SLOT], dtype=np.int64)
    ix.store_done(slots, rank)
    return r


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_lookup_counts_the_leading_ready_run_and_leases_it():
    ix, t, _ = make_index()
    store(ix, t, [k(i) for i in range(4)])
    ix.allocate(t, [k(4)])  # PENDING
    hits, slots, lease, pending = ix.lookup(t, [k(0), k(1), k(2), k(3), k(4), k(5)],
                                            lease_s=10.0)
    assert (hits, pending, len(slots)) == (4, 1, 4)
    assert ix.pins[slots].tolist() == [1] * 4
    assert ix.release(lease)
    assert ix.pinned_blocks == 0
    assert ix.lookup(t, [k(9), k(0)])[0] == 0  # a hole ends the run


def test_a_lease_can_be_released_in_part():
    ix, t, _ = make_index()
    store(ix, t, [k(i) for i in range(4)])
    _, slots, lease, _ = ix.lookup(t, [k(i) for i in range(4)], lease_s=10.0, owner=3)
    assert ix.release(lease, slots=slots[:2])
    assert ix.pins[slots].tolist() == [0, 0, 1, 1] and ix.leases.by_owner[3] == 2
    assert not ix.leases.holds(lease, slots[:1]) and ix.leases.holds(lease, slots[2:])
    assert ix.release(lease, slots=slots[2:])  # the rest: the lease is gone
    assert ix.pinned_blocks == 0 and len(ix.leases) == 0 and not ix.leases.by_owner.get(3)


def test_tenants_do_not_share_keys():
    ix, t, tenants = make_index()
    other = tenants.get_or_create("o", model="m2", tp_size=1, rank_page_bytes=(BLOCK,))
    store(ix, t, [k(1)])
    assert ix.lookup(other, [k(1)])[0] == 0
    assert ix.lookup(t, [k(1)])[0] == 1


def test_ready_only_after_every_rank():
    ix, t, _ = make_index(tp=2)
    r = ix.allocate(t, [k(1), k(2)])
    slots = np.array(r.slots)
    assert ix.store_done(slots, 0) == 0
    assert ix.lookup(t, [k(1)])[3] == 1  # pending
    assert ix.store_done(slots, 0) == 0  # the same rank again does not count
    assert ix.store_done(slots, 1) == 2
    assert ix.lookup(t, [k(1), k(2)])[0] == 2


def test_pinned_blocks_survive_eviction_and_full_pool_says_so():
    ix, t, _ = make_index(blocks=4)
    store(ix, t, [k(i) for i in range(4)])
    _, _, lease, _ = ix.lookup(t, [k(0), k(1)], lease_s=5.0)
    r = ix.allocate(t, [k(10), k(11), k(12)])
    assert r.allocated == 2 and sorted(r.evicted) == [k(2), k(3)]
    assert ix.counters.no_space == 1
    assert ix.counters.evicted_bytes == 2 * BLOCK
    assert ix.lookup(t, [k(0), k(1)])[0] == 2
    ix.release(lease)


@pytest.mark.parametrize("policy", policy_names())
def test_an_allocate_never_evicts_the_keys_it_answers_present(policy):
    """The next turn of a conversation: its first blocks are held, the rest new, the
    pool full. Making room evicted the held ones (answered "present" in the same
    reply): the new blocks would have followed a prefix that was gone."""
    ix, t, _ = make_index(blocks=8, policy=policy)
    turn = [k(i) for i in range(6)]
    store(ix, t, turn[:4])
    store(ix, t, [k(100), k(101), k(102), k(103)])  # older than nothing: the pool is full
    r = ix.allocate(t, turn)
    assert r.slots[:4] == [NO_SLOT] * 4 and not set(turn[:4]) & set(r.evicted)
    assert ix.lookup(t, turn[:4])[0] == 4
    ix2, t2, _ = make_index(blocks=4, policy=policy)
    store(ix2, t2, turn[:4])
    r2 = ix2.allocate(t2, turn)  # no room without the prefix: the new keys get none
    assert r2.allocated == 4 and r2.evicted == [] and ix2.lookup(t2, turn[:4])[0] == 4


def test_expiry_releases_leases_and_pending():
    ix, t, _ = make_index()
    store(ix, t, [k(0)])
    ix.lookup(t, [k(0)], now=0.0, lease_s=1.0)
    ix.allocate(t, [k(1)], now=0.0, pending_s=2.0)
    assert ix.expire(0.5) == (0, 0)
    assert ix.expire(1.5) == (1, 0)
    assert ix.expire(2.5) == (0, 1)
    assert ix.pinned_blocks == 0 and ix.pending_blocks == 0
    assert ix.allocator.used_slots == 1


def test_a_slot_in_use_by_a_copy_is_freed_only_after_it():
    ix, t, _ = make_index()
    r = ix.allocate(t, [k(0)])
    slots = np.array(r.slots)
    ix.pin(slots)  # a store copy is running
    ix.abort(slots)  # ...and the request went away
    assert ix.allocator.used_slots == 1  # not reusable while the copy writes into it
    ix.unpin(slots)
    assert ix.allocator.used_slots == 0


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(policy_names()),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "done", "lookup", "release", "part", "abort",
                                   "expire"]),
                  st.lists(st.integers(0, 40), min_size=1, max_size=6)),
        max_size=80),
)
def test_invariants_under_random_operations(policy, ops):
    """Capacity never exceeded; PENDING and pinned blocks are never evicted; everything
    released brings the accounting back to zero."""
    ix, t, _ = make_index(blocks=8, policy=policy)
    leases: list[int] = []
    pending: list[int] = []
    now = 0.0
    for op, ids in ops:
        now += 0.1
        keys = [k(i) for i in dict.fromkeys(ids)]
        if op == "alloc":
            protected = {s for s in range(ix.allocator.max_slots)
                         if ix.state[s] == PENDING or ix.pins[s] > 0}
            before = {s: ix.state[s] for s in protected}
            r = ix.allocate(t, keys, now=now, pending_s=100)
            pending += [s for s in r.slots if s != NO_SLOT]
            # Protected blocks stay where they were (PENDING or READY, never evicted).
            assert all(ix.state[s] == st_ for s, st_ in before.items())
        elif op == "done" and pending:
            ix.store_done(np.array(pending[:3]), 0)
            pending = pending[3:]
        elif op == "lookup":
            hits, _, lease, _ = ix.lookup(t, keys, now=now, lease_s=100)
            if lease:
                leases.append(lease)
        elif op == "release" and leases:
            ix.release(leases.pop())
        elif op == "part" and leases and leases[-1] in ix.leases:
            held = ix.leases.get(leases[-1]).slots
            ix.release(leases[-1], slots=held[:len(ids) % (len(held) + 1)])
        elif op == "abort" and pending:
            ix.abort(np.array(pending[:1]))
            pending = pending[1:]
        elif op == "expire":
            ix.expire(now)
        assert ix.allocator.used_slots <= 8
        assert ix.ready_blocks + ix.pending_blocks == ix.allocator.used_slots
        assert ix.ready_blocks == int((ix.state == READY).sum()) == t.blocks
    for lease in leases:
        ix.release(lease)
    ix.expire(1e9)
    ix.evict_tenant(None)
    assert ix.pinned_blocks == 0 and ix.pending_blocks == 0
    assert ix.allocator.used_slots == 0 and ix.allocator.used_bytes == 0
    assert not ix.entries and len(ix.policy) == 0 and ix._pin_calls == 0


def test_a_repeated_key_in_one_allocate_gets_one_slot():
    ix, t, _ = make_index()
    r = ix.allocate(t, [k(1), k(1), k(2)])
    assert r.slots[1] == NO_SLOT and NO_SLOT not in (r.slots[0], r.slots[2])
    assert ix.allocator.used_slots == 2
    ix.store_done(np.array([r.slots[0], r.slots[2]]), 0)
    assert ix.lookup(t, [k(1), k(2)])[0] == 2
    ix.evict_tenant(None)
    assert ix.allocator.used_slots == 0 and not ix.entries


def test_store_done_with_a_repeated_slot_counts_it_once():
    ix, t, _ = make_index()
    r = ix.allocate(t, [k(1), k(2)])
    assert ix.store_done(np.array([r.slots[0], r.slots[0], r.slots[1]]), 0) == 2
    assert ix.ready_blocks == 2 and t.blocks == 2 and ix.pending_blocks == 0


def test_a_slot_leased_twice_in_one_lookup_and_discarded_is_freed_once():
    """A Lookup that repeats a key leases its slot twice in one call; discarded under
    the lease and then released, it goes back to the allocator once (twice would give
    the extent back while another block still lives in it)."""
    ix, t, _ = make_index()
    store(ix, t, [k(0), k(1)])
    hits, slots, lease, _ = ix.lookup(t, [k(0), k(0)], lease_s=10.0)
    assert hits == 2 and slots[0] == slots[1]
    ix.discard([int(slots[0])])  # e.g. it failed its checksum while leased
    assert ix.release(lease)
    assert ix.allocator.used_slots == 1  # k(1)'s slot only
    got = ix.allocate(t, [k(2), k(3), k(4), k(5)]).slots
    assert len(set(got)) == 4 and ix.entries[t.prefix + k(1)] not in got


def test_slots_count_their_handouts():
    """Each time a slot is handed out its number moves on: a ticket taken from the slot's
    earlier life can tell."""
    ix, t, _ = make_index()
    (s,) = ix.allocate(t, [k(0)]).slots
    first = int(ix.gen[s])
    ix.abort(np.array([s], dtype=np.int64))
    (again,) = ix.allocate(t, [k(1)]).slots
    assert again == s and int(ix.gen[s]) == first + 1


def test_a_dropped_tenant_is_made_again_with_a_new_id_and_never_finds_the_old_blocks():
    ix, t, tenants = make_index()
    tenants.max_tenants = 2
    store(ix, t, [k(1)])
    other = tenants.create("o", model="m2", tp_size=1, rank_page_bytes=(BLOCK,))
    other.clients.add(7)
    assert [x.digest for x in tenants.idle()] == ["t"]  # clients keep a tenant
    assert ix.evict_tenant(t) == 1 and t.blocks == 0
    tenants.drop(t)
    again = tenants.create("t", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    assert again.id not in (t.id, other.id) and tenants.find("t") is again
    store(ix, t, [k(2)])  # a late store of the dropped tenant (a promotion in flight)
    assert ix.lookup(again, [k(2)])[0] == 0
    # A restart restores both from the journal, in any order: the newer one is found.
    for order in ((t, again), (again, t)):
        fresh = Tenants()
        for x in order:
            fresh.restore(x.id, x.digest, model=x.model, tp_size=1, rank_page_bytes=(BLOCK,))
        assert fresh.find("t").id == again.id


def test_idle_tenants_give_way_empty_ones_first_then_the_longest_idle():
    tenants = Tenants()
    made = {}
    for name, blocks, since in (("a", 3, 5.0), ("b", 2, 1.0), ("c", 0, 9.0), ("d", 0, 0.0)):
        t = made[name] = tenants.create(name, model=name, tp_size=1, rank_page_bytes=(BLOCK,))
        t.blocks, t.idle_since = blocks, since
    made["d"].clients.add(1)  # in use: never given up
    assert [t.digest for t in tenants.idle()] == ["c", "b", "a"]


@given(st.lists(st.lists(st.integers(0, 15), max_size=20), max_size=6))
def test_pins_count_a_slot_once_per_call_whatever_the_size(calls):
    """A few slots are pinned one by one, many at once: both count a repeated slot once
    per call, so every pin is undone by the unpin of the same array."""
    ix, _, _ = make_index()
    arrays = [np.array(c, dtype=np.uint32) for c in calls]
    for a in arrays:
        ix.pin(a)
    want = np.zeros(len(ix.pins), dtype=np.int64)
    for c in calls:
        want[sorted(set(c))] += 1
    assert ix.pins.tolist() == want.tolist()
    for a in reversed(arrays):
        ix.unpin(a)
    assert not ix.pins.any() and ix.pinned_blocks == 0


def test_room_for_another_size_empties_only_extents_that_can_empty():
    """Another size's Allocate evicted in policy order until the policy ran dry when one
    lease sat in every extent: a tenant's whole cache went, and no extent came free."""
    a = Allocator(4 * 16 * BLOCK, 16 * BLOCK, 1024)  # 4 extents; 16 small or 4 big slots
    ix = Index(a, make_policy("lru", 64))
    tenants = Tenants()
    small = tenants.get_or_create("s", model="s", tp_size=1, rank_page_bytes=(BLOCK,))
    big = tenants.get_or_create("b", model="b", tp_size=1, rank_page_bytes=(4 * BLOCK,))
    store(ix, small, [k(i) for i in range(64)])  # every extent full of small blocks
    leases = [ix.lookup(small, [k(e * 16 + 15)], lease_s=60.0)[2] for e in range(4)]
    r = ix.allocate(big, [b"big0"])
    assert (r.allocated, r.evicted_total, ix.ready_blocks) == (0, 0, 64)  # nothing lost
    ix.release(leases[2])  # extent 2 can empty now: only its 16 blocks go
    r = ix.allocate(big, [b"big0", b"big1"])
    assert (r.allocated, r.evicted_total, ix.ready_blocks) == (2, 16, 48)
    assert all(ix.contains(small, k(i)) == FREE for i in range(32, 48))
    assert all(ix.contains(small, k(i)) == READY for i in [*range(32), *range(48, 64)])


def test_room_for_another_size_empties_the_emptiest_extent_first():
    """The extent with fewest blocks goes: the least cache lost for one freed extent."""
    a = Allocator(4 * 16 * BLOCK, 16 * BLOCK, 1024)
    ix = Index(a, make_policy("lru", 64))
    tenants = Tenants()
    small = tenants.get_or_create("s", model="s", tp_size=1, rank_page_bytes=(BLOCK,))
    big = tenants.get_or_create("b", model="b", tp_size=1, rank_page_bytes=(4 * BLOCK,))
    slots = store(ix, small, [k(i) for i in range(64)]).slots
    spm = a.slots_per_extent_max
    by_extent = {e: [s for s in slots if s // spm == e] for e in range(4)}
    ix.discard(by_extent[2][:11])  # extent 2 keeps 5 blocks, the others 16
    ix.discard(by_extent[0][:3])  # extent 0 keeps 13
    r = ix.allocate(big, [b"big0"])
    assert (r.allocated, r.evicted_total, ix.ready_blocks) == (1, 5, 64 - 14 - 5)
    assert all(a.slot_bytes_of(s) == BLOCK for e in (0, 1, 3) for s in by_extent[e][-1:])


def _two_sizes(monkeypatch, scan: int):
    """4 extents: small blocks (16 a extent) stored first in two, big ones (4 a extent)
    after them in the other two; LRU order: every small block before any big one."""
    monkeypatch.setattr(eviction, "SCAN", scan)
    a = Allocator(4 * 16 * BLOCK, 16 * BLOCK, 1024)
    ix = Index(a, make_policy("lru", 64))
    tenants = Tenants()
    small = tenants.get_or_create("s", model="s", tp_size=1, rank_page_bytes=(BLOCK,))
    big = tenants.get_or_create("b", model="b", tp_size=1, rank_page_bytes=(4 * BLOCK,))
    store(ix, small, [k(i) for i in range(32)])
    store(ix, big, [k(100 + i) for i in range(8)])
    return ix, small, big


def test_another_size_behind_the_scan_limit_empties_an_extent(monkeypatch):
    """Reading the whole eviction order for blocks of one's own size cost O(pool) on
    every short Allocate. Past the limit, the colder size gives up an extent."""
    ix, small, big = _two_sizes(monkeypatch, scan=8)
    r = ix.allocate(big, [k(200)])
    assert (r.allocated, r.evicted_total, r.evicted) == (1, 16, [])
    assert all(ix.contains(big, k(100 + i)) == READY for i in range(8))
    assert sum(ix.contains(small, k(i)) == READY for i in range(32)) == 16


def test_an_extent_of_another_size_colder_than_its_own_victims_goes_first(monkeypatch):
    """Within the scan, a size's own blocks went even when whole extents of another size
    were colder: in a pool of fewer blocks than the scan reads, the split between sizes
    never changed. Now the colder extent goes, as the policy would have it."""
    ix, small, big = _two_sizes(monkeypatch, scan=4096)
    r = ix.allocate(big, [k(200)])
    assert (r.allocated, r.evicted_total, r.evicted) == (1, 16, [])
    assert all(ix.contains(big, k(100 + i)) == READY for i in range(8))
    assert [ix.contains(small, k(i)) == READY for i in range(32)] == [False] * 16 + [True] * 16


def test_an_extent_with_a_block_hotter_than_its_own_victims_stays(monkeypatch):
    """A small extent holding one block used after the big ones is not all colder: the
    big size evicts its own coldest block, as before."""
    ix, small, big = _two_sizes(monkeypatch, scan=4096)
    for i in (5, 20):  # one in each small extent, now the most recently used
        ix.release(ix.lookup(small, [k(i)], lease_s=60.0)[2])
    r = ix.allocate(big, [k(200)])
    assert (r.allocated, r.evicted_total, r.evicted) == (1, 1, [k(100)])
    assert all(ix.contains(small, k(i)) == READY for i in range(32))


def test_a_tenant_that_left_gives_its_extents_up_to_one_still_storing():
    """Its blocks of another size, never used again, stayed for good: the tenant still
    storing was held to the extents left over (2 of 8), evicting its own new blocks."""
    a = Allocator(8 * 16 * BLOCK, 16 * BLOCK, 1024)  # 8 extents; 16 small or 4 big slots
    ix = Index(a, make_policy("adaptive", 128))
    tenants = Tenants()
    small = tenants.get_or_create("s", model="s", tp_size=1, rank_page_bytes=(BLOCK,))
    big = tenants.get_or_create("b", model="b", tp_size=1, rank_page_bytes=(4 * BLOCK,))
    store(ix, big, [k(1000 + i) for i in range(24)])  # 6 extents, then it leaves
    for step in range(50):
        store(ix, small, [k(step * 4 + i) for i in range(4)])
        ix.release(ix.lookup(small, [k(max(0, step * 4 - 8))], lease_s=60.0)[2])
    assert big.blocks == 0 and small.blocks == 128  # the whole pool, in use


def test_past_the_scan_limit_with_no_extent_to_empty_its_own_go(monkeypatch):
    """Leases in both small extents: none can empty, so the rest of the order is read."""
    ix, small, big = _two_sizes(monkeypatch, scan=8)
    for i in (0, 16):
        ix.lookup(small, [k(i)], lease_s=60.0)
    r = ix.allocate(big, [k(200)])
    assert (r.allocated, r.evicted_total, r.evicted) == (1, 1, [k(100)])
    assert all(ix.contains(small, k(i)) == READY for i in range(32))


def test_past_the_scan_limit_with_too_few_extents_to_empty_its_own_make_up_the_rest(
        monkeypatch):
    """One small extent empties, the other holds a lease: the rest comes from the
    caller's own blocks further down the order (it came back short, with evictable
    blocks of its size left)."""
    ix, small, big = _two_sizes(monkeypatch, scan=0)
    ix.lookup(small, [k(0)], lease_s=60.0)
    r = ix.allocate(big, [k(200 + i) for i in range(8)])
    assert (r.allocated, r.evicted_total) == (8, 16 + 4)
    assert sum(ix.contains(big, k(100 + i)) == READY for i in range(8)) == 4
    assert sum(ix.contains(small, k(i)) == READY for i in range(32)) == 16


@settings(max_examples=200, deadline=None)
@given(stored=st.lists(st.integers(0, 40), max_size=20),
       keys=st.lists(st.integers(0, 40), min_size=1, max_size=60),
       chained=st.booleans(), parent=st.sampled_from([None, b"p"]))
def test_new_blocks_parents_are_kept_and_not_the_calls_known_keys(stored, keys, chained,
                                                                 parent):
    """Each new block's parent (for the KV events) is the key before it in the call,
    or the one its sender named; what the pending record keeps for that is of the size
    of the new blocks, not of the call (one new key among thousands of known ones kept
    them all for the pending time)."""
    ix, t, _ = make_index(blocks=64)
    ix.record = True
    store(ix, t, [k(i) for i in set(stored)])
    names = [k(i) for i in keys]
    r = ix.allocate(t, names, parent=parent, chained=chained)
    new = [i for i, s in enumerate(r.slots) if s != NO_SLOT]
    calls = ix.pending.calls
    for p in {id(calls[r.slots[i]]): calls[r.slots[i]] for i in new}.values():
        assert len(p.keys) <= 2 * len(new)
    ix.store_done(np.array([r.slots[i] for i in new], dtype=np.int64), 0)
    for i in new:
        want = (names[i - 1] if i else parent) if chained else (parent if i == 0 else None)
        assert ix.parents.get(r.slots[i]) == want, (i, names)


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_one_tenants_evict_takes_its_own_unpinned_blocks_and_reads_no_one_elses(policy):
    """It walked the policy's whole order: the tenant limit's drop of a tenant of 100
    blocks read every block of the pool (a second at a million held)."""
    a = Allocator(64 * BLOCK, 4 * BLOCK, 1024)
    ix = Index(a, make_policy(policy, 64))
    tenants = Tenants()
    big = tenants.get_or_create("big", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    small = tenants.get_or_create("small", model="s", tp_size=1, rank_page_bytes=(BLOCK,))
    store(ix, big, [k(i) for i in range(40)])
    store(ix, small, [k(i) for i in range(5)])
    _, held, lease, _ = ix.lookup(small, [k(0), k(1)], lease_s=10)  # pinned: stays
    before = ix.counters.evicted_bytes

    def walked():
        raise AssertionError("the policy's order was walked")
    ix.policy.victims = walked  # type: ignore[method-assign]
    assert ix.evict_tenant(small) == 3 and small.blocks == 2 and big.blocks == 40
    assert ix.counters.evicted_bytes - before == 3 * BLOCK
    assert ix.lookup(small, [k(i) for i in range(5)])[0] == 2
    assert ix.lookup(big, [k(i) for i in range(40)])[0] == 40
    assert len(ix.policy) == 42 and ix.allocator.used_slots == 42
    ix.release(lease)
    assert ix.evict_tenant(None) == 42 and not ix.entries and len(ix.policy) == 0
    assert ix.allocator.used_slots == 0 and big.blocks == small.blocks == 0


def test_abort_takes_each_pending_slot_once_and_nothing_else():
    ix, t, _ = make_index(blocks=16)
    store(ix, t, [k(0)])
    ready = ix.lookup(t, [k(0)])[1].tolist()
    pending = [s for s in ix.allocate(t, [k(i) for i in range(1, 6)]).slots]
    assert ix.pending_blocks == 5 and ix.pending.by_owner == {0: 5}
    slots = np.array(pending[:3] + pending[:3] + ready + [10_000], dtype=np.int64)
    assert ix.abort(slots) == 3
    assert ix.pending_blocks == 2 and ix.pending.by_owner == {0: 2} and t.blocks == 1
    assert ix.counters.failed_stores == 3 and ix.allocator.used_slots == 3
    assert ix.lookup(t, [k(0)])[0] == 1
    assert ix.abort(np.array(pending, dtype=np.int64)) == 2 and not ix.pending.by_owner


def test_a_copy_of_the_live_blocks_made_later_is_the_index_as_it_was():
    """A journal compaction copies the tables on the loop and makes the records on a
    thread, while the loop goes on changing the index: what it makes must be the
    blocks as of the copy (a slot evicted and reused, checksums and parents of both)."""
    a = Allocator(8 * BLOCK, 4 * BLOCK, 1024)
    ix = Index(a, make_policy("lru", 8), record=True)
    t = Tenants().get_or_create("t", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    r = ix.allocate(t, [k(i) for i in range(6)], parent=k(99))
    ix.store_done(np.array(r.slots, dtype=np.int64), 0, checksums=list(range(6)))
    ix.allocate(t, [k(50)])  # PENDING: not a live block
    before = live_blocks(ix)
    assert [b[1] for b in before] == [k(i) for i in range(6)]
    assert before[0][5] == k(99) and before[1][5] == k(0) and before[2][4] == [2]
    later = copy_live_blocks(ix)
    ix.evict_tenant(t)  # every slot freed, then taken by other keys
    r = ix.allocate(t, [k(i) for i in range(10, 16)])
    ix.store_done(np.array(r.slots, dtype=np.int64), 0, checksums=[7] * 6)
    assert [b[1] for b in live_blocks(ix)] == [k(i) for i in range(10, 16)]
    assert list(later()) == before


@pytest.mark.parametrize("n_tenants", [1, 3, 12])  # one tenant (its fast path), several
def test_a_flush_of_several_tenants_drops_each_ones_blocks_and_journals_each(n_tenants):
    a = Allocator(64 * BLOCK, 4 * BLOCK, 1024)
    ix = Index(a, make_policy("adaptive", 64), record=True)
    tenants = Tenants()
    ts = [tenants.get_or_create(f"t{i}", model=f"m{i}", tp_size=1, rank_page_bytes=(BLOCK,))
          for i in range(n_tenants)]
    for i, t in enumerate(ts):  # the same keys in every tenant, interleaved in the policy
        r = ix.allocate(t, [k(j) for j in range(4)])
        ix.store_done(np.array(r.slots, dtype=np.int64), 0, checksums=[i] * 4)
    _, held, lease, _ = ix.lookup(ts[-1], [k(0)], lease_s=10)  # pinned: stays
    ix.events = []
    assert ix.evict_tenant(None) == 4 * n_tenants - 1
    assert [t.blocks for t in ts] == [0] * (n_tenants - 1) + [1]
    assert sorted((e[2], e[3]) for e in ix.events if e[0] == "drop") == sorted(
        (t.id, k(j)) for t in ts for j in range(4) if (t, j) != (ts[-1], 0))
    assert [ix.lookup(t, [k(j) for j in range(4)])[0] for t in ts] == [0] * (
        n_tenants - 1) + [1]
    assert set(ix.checksums) == set(held.tolist())
    ix.release(lease)
    assert ix.evict_tenant(None) == 1 and not ix.entries and ts[-1].blocks == 0


def _restore_one_by_one(ix, tenant, key, slot, depth, sums, parent) -> bool:
    """The rule a restart's batch keeps: each block put back alone, in order."""
    scoped = tenant.prefix + key
    if scoped in ix.entries:
        return False
    ix.entries[scoped] = slot
    ix._spaces.setdefault(tenant.id, {})[key] = slot
    ix._ready.setdefault(tenant.id, {})[key] = slot
    ix._slot_key[slot] = scoped
    ix._slot_tenant[slot] = tenant
    ix.state[slot] = READY
    ix.tenant_of[slot] = tenant.id
    ix.rank_mask[slot] = tenant.full_mask
    ix._depth[slot] = depth
    ix.checksums[slot] = list(sums)
    ix.parents[slot] = parent
    tenant.blocks += 1
    ix.allocator.fit(ix.policy, ix._capacity_bound)
    ix.policy.insert(scoped, depth)
    return True


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), max_size=24),
       st.sampled_from(["lru", "arc", "chain", "adaptive"]))
def test_a_restarts_batch_restore_equals_one_block_at_a_time(blocks, policy):
    """Keys named twice (the first wins), keys held already, runs of consecutive
    depths and breaks: the same tables, answers and policy order as one at a time."""
    from kvd.core.snapshot import restore_blocks

    made = []
    for _ in range(2):
        ix, t, _ = make_index(blocks=32, policy=policy)
        store(ix, t, [k(0), k(1)])  # held already
        made.append((ix, t))
    (batch, tb), (one, to) = made
    free = [s for s in range(32) if batch.state[s] != READY][:len(blocks)]
    keys = [k(key) for key, _ in blocks]
    depths = [d for _, d in blocks]
    sums = [[i] for i in range(len(blocks))]
    parents = [k(99) if i % 2 else None for i in range(len(blocks))]
    took = restore_blocks(batch, tb, keys, free, depths, sums, parents)
    assert took == [_restore_one_by_one(one, to, *row)
                    for row in zip(keys, free, depths, sums, parents)]
    assert batch.entries == one.entries and tb.blocks == to.blocks
    assert batch._ready == one._ready and batch._slot_key == one._slot_key
    assert (batch.state == one.state).all() and (batch._depth == one._depth).all()
    assert batch.checksums == one.checksums and batch.parents == one.parents
    assert list(batch.policy.victims()) == list(one.policy.victims())
