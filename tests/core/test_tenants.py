"""Tenants at their limit: who makes room for a new fingerprint (hypothesis properties)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvd.core.tenants import Tenants

# Per tenant: (has a client, blocks held, blocks an eviction cannot free, idle since)
TENANT = st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 2), st.floats(0, 100))


@given(st.lists(TENANT, min_size=1, max_size=12), st.integers(1, 12))
def test_make_room_drops_only_idle_tenants_it_could_empty(specs, limit):
    tenants = Tenants(max_tenants=64)
    made = []
    for i, (busy, blocks, held, since) in enumerate(specs):
        t = tenants.create(f"d{i}", model=f"m{i}", tp_size=1, rank_page_bytes=(4096,))
        t.blocks, t.idle_since = blocks, since
        if busy:
            t.clients.add(i)
        made.append((t, min(held, blocks)))
    pinned = {t.id: held for t, held in made}
    evicted_from: list[int] = []

    def evict(t):
        evicted_from.append(t.id)
        freed = t.blocks - pinned[t.id]
        t.blocks = pinned[t.id]
        return freed

    tenants.max_tenants = limit
    before = {t.id: t for t, _ in made}
    had = {t.id: t.blocks for t, _ in made}
    dropped = tenants.make_room(evict)
    gone = {t.id for t, _ in dropped}
    left = {t.id for t in tenants}
    assert gone | left == set(before) and not gone & left
    for tid in gone:  # idle, and empty once evicted
        assert not before[tid].clients and before[tid].blocks == 0
        assert tenants.find(before[tid].digest) is None
    assert all(before[tid].blocks == 0 or tid in evicted_from for tid in gone)
    if len(before) >= limit:
        # Room was made, or every tenant left has a client or a block it cannot free.
        assert len(left) < limit or all(
            before[tid].clients or pinned[tid] for tid in left)
        # Nothing was dropped beyond what made room.
        assert not gone or len(left) == limit - 1 or len(left) >= limit
    else:
        assert not gone and not evicted_from
    # Idle tenants holding nothing go before any whose blocks are evicted.
    if evicted_from:
        assert all(tid in gone for tid in before
                   if not before[tid].clients and had[tid] == 0)
