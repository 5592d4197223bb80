"""Tickets: slots kept for the ranks' stores, and Transfers that came before them."""

from __future__ import annotations

import numpy as np
import pytest

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
