"""Tickets: slots kept for the ranks' stores, and Transfers that came before them."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kvd.core.states import NO_SLOT
from kvd.core.tickets import TicketError, Tickets


def test_each_rank_takes_the_slots_once_and_tenants_are_apart():
    t: Tickets[str] = Tickets()
    assert t.add(1, 5, np.array([3, 4]), ranks=2, deadline=10.0) == []
    assert t.take(2, 5) is None  # another tenant's ticket 5 does not exist
    assert t.take(1, 5).tolist() == [3, 4]
    assert t.take(1, 5).tolist() == [3, 4]
    assert t.take(1, 5) is None and len(t) == 0  # both ranks stored: retired
    with pytest.raises(TicketError):
        t.add(1, 6, np.array([1]), 1, 10.0)
        t.add(1, 6, np.array([2]), 1, 10.0)


def test_early_transfers_wait_for_their_allocate_or_their_deadline():
    t: Tickets[str] = Tickets()
    t.park(1, 7, "first", deadline=5.0)
    t.park(1, 7, "second", deadline=9.0)
    t.park(1, 8, "orphan", deadline=5.0)
    assert t.parked == 3
    assert t.expire(now=6.0) == ["first", "orphan"]
    assert t.add(1, 7, np.array([1]), 1, deadline=20.0) == ["second"]
    assert t.parked == 0
    assert t.expire(now=21.0) == [] and len(t) == 0  # the ticket itself lapsed


def test_tickets_with_nothing_to_store_keep_no_per_key_arrays():
    """A client asking again and again at a full pool (every key NO_SLOT) must not grow
    the daemon by 8 bytes per key and ticket until the tickets' deadline."""
    t: Tickets[str] = Tickets()
    n = 65_536
    tracemalloc.start()
    try:
        for i in range(100):
            t.add(1, i + 1, np.full(n, NO_SLOT, np.uint32), 2, 10.0, np.zeros(n, np.uint32))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1 << 20  # kept as arrays: 100 x 512 KiB
    slots, gens = t.claim(1, 5)
    assert len(slots) == n and (slots == NO_SLOT).all() and gens is None
    mixed = np.full(4, NO_SLOT, np.uint32)
    mixed[1] = 7
    t.add(1, 999, mixed, 1, 10.0, np.arange(4, dtype=np.uint32))
    slots, gens = t.claim(1, 999)
    assert slots.tolist() == mixed.tolist() and gens.tolist() == [0, 1, 2, 3]


def test_a_rank_claims_once_and_cannot_use_up_another_ranks_turn():
    """With TP=2, rank 0 sending a second store under the ticket is refused; rank 1's
    turn is still there (before, the repeat used it up and rank 1's store was parked
    until it failed)."""
    t: Tickets[str] = Tickets()
    t.add(1, 5, np.array([3, 4]), ranks=2, deadline=10.0)
    assert t.claim(1, 5, rank=0)[0].tolist() == [3, 4]
    with pytest.raises(TicketError, match="rank 0"):
        t.claim(1, 5, rank=0)
    assert len(t) == 1
    assert t.claim(1, 5, rank=1)[0].tolist() == [3, 4]
    assert len(t) == 0  # both ranks stored: retired


def test_a_ticket_no_rank_stored_with_is_given_up_at_its_claim_time():
    """Workers that skip their stores (copying for themselves, running without
    offloading) left the slots PENDING until the pending deadline, holding the blocks
    from every other engine. A ticket some rank used gets ``claim_s`` from then."""
    t: Tickets[str] = Tickets()
    gens = np.array([7, 0, 9], np.uint32)
    t.add(1, 1, np.array([3, NO_SLOT, 5], np.uint32), 2, 60.0, gens, claim_by=10.0,
          claim_s=10.0)
    t.add(1, 2, np.array([6], np.uint32), 2, 60.0, np.array([1], np.uint32), claim_by=10.0,
          claim_s=10.0)
    t.add(1, 3, np.full(2, NO_SLOT, np.uint32), 1, 60.0, claim_by=10.0, claim_s=10.0)
    t.claim(1, 2, rank=0, now=8.0)  # one of two ranks stored with ticket 2
    assert t.unclaimed(9.9) == []
    (slots, g), = t.unclaimed(10.0)  # ticket 3 had nothing to store: nothing to give back
    assert slots.tolist() == [3, NO_SLOT, 5] and g.tolist() == [7, 0, 9]
    assert not t.holds(1, 1) and t.holds(1, 2) and not t.holds(1, 3)
    assert t.take(1, 1) is None  # a store arriving after it waits, then ends refused
    assert t.unclaimed(17.9) == [] and t.holds(1, 2)


def test_a_ticket_a_rank_never_stored_with_is_given_up_after_the_first_ones_store():
    """Two engines of one tp=2 tenant, the second without its rank 1 (refused): the
    first engine's rank 1 made the tenant look whole, the second's rank 0 stored by
    ticket, and rank 1's half never came. The blocks stayed PENDING until the pending
    deadline, a minute by default, holding them from the first engine."""
    t: Tickets[str] = Tickets()
    t.add(1, 2, np.array([6, 8], np.uint32), 2, 60.0, np.array([1, 4], np.uint32),
          claim_by=10.0, claim_s=10.0)
    t.claim(1, 2, rank=0, now=8.0)
    assert t.unclaimed(17.9) == [] and t.holds(1, 2)
    (slots, g), = t.unclaimed(18.0)
    assert slots.tolist() == [6, 8] and g.tolist() == [1, 4] and not t.holds(1, 2)
    # Every rank in time: retired whole, nothing given up. The window ends at the
    # pending deadline at the latest (the slots are dropped then anyway).
    t.add(1, 3, np.array([9], np.uint32), 2, 60.0, np.array([2], np.uint32),
          claim_by=10.0, claim_s=10.0)
    t.claim(1, 3, rank=1, now=9.0)
    t.claim(1, 3, rank=0, now=18.5)
    assert t.unclaimed(100.0) == [] and len(t) == 0
    t.add(1, 4, np.array([5], np.uint32), 2, 12.0, np.array([3], np.uint32),
          claim_by=10.0, claim_s=10.0)
    t.claim(1, 4, rank=0, now=9.0)
    assert [s.tolist() for s, _ in t.unclaimed(12.0)] == [[5]]
