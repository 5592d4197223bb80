"""The daemon's policy decides as the simulator's does at the same number of blocks.

The daemon builds its policy before any block size is known, for the pool's count of
``min_slot_bytes`` slots; a model's blocks are far larger. A policy left at that size
keeps ghosts, clocks and miniature caches for a cache hundreds of times larger than the
one it orders, and the simulator's tables would say nothing about the daemon.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.config import Config
from kvd.core import allocator
from kvd.core.index import NO_SLOT
from kvd.core.tenants import Tenants
from kvd.service import new_index
from kvd.sim import make_trace, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_trace import SHAPES

EXTENT = 1 << 20
BLOCK = 64 << 10  # 16 per extent: 64 extents hold 1,024 blocks (16,384 of 4 KiB)


def _request(index, tenant, keys) -> None:
    """One request, as kvd.sim.replay drives its index: the hit run, the rest stored."""
    hits = index.lookup(tenant, keys)[0]
    if hits < len(keys):
        slots = [s for s in index.allocate(tenant, keys[hits:], depth=hits).slots
                 if s != NO_SLOT]
        if slots:
            index.store_done(np.array(slots, dtype=np.int64), 0)


@pytest.mark.parametrize("policy", ["adaptive", "chain", "arc", "s3fifo"])
@pytest.mark.parametrize("replaced", [False, True])
def test_daemon_index_decides_as_the_simulator(policy: str, replaced: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``replaced``: a model with other blocks used the pool first, and is gone (its
    blocks flushed): the policy was left sized for the two sharing the pool. (Forgotten
    at once here: by default only once the pool turned over a few times without it.)"""
    monkeypatch.setattr(allocator, "IDLE_TURNOVERS", 0)
    rows = SHAPES["docqa"](700, random.Random(5))
    trace = make_trace(rows[0] if isinstance(rows, tuple) else rows)
    index = new_index(Config(pool_size=64 * EXTENT, extent_size=EXTENT, policy=policy))
    assert index.policy.capacity == 64 * EXTENT // 4096  # no block size known yet
    tenants = Tenants()
    if replaced:
        gone = tenants.get_or_create("old", model="o", tp_size=1, rank_page_bytes=(4 * BLOCK,))
        slots = index.allocate(gone, [b"old%d" % i for i in range(4)]).slots
        index.store_done(np.array(slots, dtype=np.int64), 0)
        assert index.evict_tenant(gone) == 4
    tenant = tenants.get_or_create("t", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    for keys in trace.requests:
        _request(index, tenant, keys)
    assert index.policy.capacity == 64 * (EXTENT // BLOCK)
    sim = replay(trace, 64 * (EXTENT // BLOCK), policy)
    assert index.counters.evicted_blocks > 0
    assert index.counters.hit_blocks == sim.hit_blocks


def test_a_block_size_whose_few_blocks_come_and_go_sizes_the_policy_once() -> None:
    """A second tenant of 4x larger blocks storing one now and then, each evicted before
    the next: forgetting its size each time its block went re-sized the policy each
    time it came back (19 times on this trace), and the default policy lost what it had
    learned with each (42,367 hit blocks against 44,014)."""
    rows = SHAPES["docqa"](700, random.Random(5))
    trace = make_trace(rows[0] if isinstance(rows, tuple) else rows)
    index = new_index(Config(pool_size=64 * EXTENT, extent_size=EXTENT, policy="adaptive"))
    resized = []
    set_capacity = index.policy.set_capacity
    index.policy.set_capacity = lambda c: (resized.append(c), set_capacity(c))[1]
    tenants = Tenants()
    tenant = tenants.get_or_create("t", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    other = tenants.get_or_create("o", model="o", tp_size=1, rank_page_bytes=(4 * BLOCK,))
    for n, keys in enumerate(trace.requests):
        if n % 50 == 25:
            _request(index, other, [b"o%d" % n])
        _request(index, tenant, keys)
    assert len(resized) <= 2, resized
    assert index.counters.evicted_blocks > 0
