"""Tiering's bounds, against a real Index, a disk tier in a temporary directory and the
real Redis cluster; the event loop is played by the test (worker results are queued by
``post`` and run when the test pumps them)."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvd.config import Config
from kvd.core.tenants import Tenant
from kvd.engines.base import checksums
from kvd.service import new_index
from kvd.tiers.base import TierBlock
from kvd.tiers.tiering import MAX_PROBES, Tiering
from kvd_proto import messages as m

BLOCK = 64 << 10


class Loop:
    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, fn: Callable[..., None], *args: object) -> None:
        self.q.put((fn, args))

    def pump(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < end, "the tier's workers did not report in time"
            try:
                fn, args = self.q.get(timeout=0.05)
            except queue.Empty:
                continue
            fn(*args)


@pytest.fixture
def rig():
    made: list[Tiering] = []

    def build(**cfg: object) -> tuple[Tiering, Loop]:
        config = Config(pool_size=8 << 20, extent_size=1 << 20, **cfg)  # 128 blocks
        loop = Loop()
        t = Tiering(config, new_index(config), np.zeros(config.pool_size, np.uint8),
                    loop.post, lambda s, fn: None, time.monotonic)
        made.append(t)
        return t, loop

    yield build
    for t in made:
        t.close(timeout=2)


def _tenant() -> Tenant:
    return Tenant(1, "0123456789abcdef", "m", 1, (BLOCK,))


def _store(t: Tiering, tenant: Tenant, keys: list[bytes]) -> None:
    """Allocate, write and finish a store, as the daemon would (READY blocks)."""
    ix = t.index
    res = ix.allocate(tenant, keys, owner=1, now=time.monotonic())
    t.after_changes()  # what this evicted is copied out before its slots are written
    slots = np.array(res.slots, dtype=np.int64)
    offs = ix.allocator.offsets(slots, tenant.slot_bytes)
    for i, o in enumerate(offs.tolist()):
        t.pool[o:o + BLOCK] = i % 251
    ix.store_done(slots, 0, checksums(t.pool, offs, tenant.rank_bytes))
    t.after_changes()


def test_an_eviction_larger_than_the_queue_still_demotes_what_fits(rig, tmp_path):
    """Before, a batch over ``tier_queue_bytes`` was dropped whole, queue empty or not:
    with blocks of MiBs, a long prompt's eviction never reached the disk."""
    t, loop = rig(disk_path=str(tmp_path), disk_size=16 << 20, tier_queue_bytes=1 << 20)
    tenant, c = _tenant(), t.counters
    _store(t, tenant, [b"a%d" % i for i in range(128)])  # the pool is full
    _store(t, tenant, [b"b%d" % i for i in range(32)])  # evicts 32 blocks: 2 MiB
    loop.pump(lambda: c.demoted_blocks + c.demote_dropped == 32)
    assert (c.demoted_blocks, c.demote_dropped) == (16, 16)  # 1 MiB of 64 KiB blocks
    disk = t.tiers["disk"]
    ns = tenant.digest.encode()
    # the last victims went down (the least valuable come first)
    assert disk.contains(ns, [b"a%d" % i for i in range(16, 32)]) == 16
    assert disk.contains(ns, [b"a0"]) == 0


def test_a_block_larger_than_the_queue_goes_down_when_it_is_empty(rig, tmp_path):
    t, loop = rig(disk_path=str(tmp_path), disk_size=16 << 20, tier_queue_bytes=4096)
    tenant, c = _tenant(), t.counters
    _store(t, tenant, [b"a%d" % i for i in range(128)])
    _store(t, tenant, [b"b0", b"b1"])
    loop.pump(lambda: c.demoted_blocks + c.demote_dropped == 2)
    assert (c.demoted_blocks, c.demote_dropped) == (1, 1)


def test_write_behind_takes_a_runs_head_and_probes_are_bounded(rig, redis_cluster):
    t, loop = rig(remote=redis_cluster.url, tier_queue_bytes=1 << 20, remote_lookup_ms=0)
    tenant, c = _tenant(), t.counters
    remote, ns = t.tiers["remote"], tenant.digest.encode()
    keys = [f"w{time.time_ns()}-{i}".encode() for i in range(32)]
    _store(t, tenant, keys)  # a run of 2 MiB, twice the bound
    loop.pump(lambda: c.written_behind_blocks + c.write_behind_dropped == 32)
    assert (c.written_behind_blocks, c.write_behind_dropped) == (16, 16)
    assert remote.contains(ns, keys) == 16  # the head: what a prefix match needs
    assert not t.index.pins.any()  # the written blocks' slots are unpinned again

    # Lookups that miss in RAM probe the cluster; at most MAX_PROBES wait at once.
    sent: list[m.LookupOk] = []
    for i in range(MAX_PROBES + 6):
        miss = m.LookupOk(i, 0, b"", 0)
        got = t.lookup(tenant, [b"absent-%d" % i], 0, miss, sent.append)
        assert got is miss  # remote_lookup_ms 0: answered at once, never waiting
    assert (t.probes, c.probes_skipped) == (MAX_PROBES, 6)
    loop.pump(lambda: t.probes == 0)
    t.lookup(tenant, [b"absent"], 0, m.LookupOk(0, 0, b"", 0), sent.append)
    assert (t.probes, c.probes_skipped) == (1, 6)


def test_a_promotion_read_after_its_slots_expired_counts_no_hit(rig, tmp_path):
    """A read that ends after its promotion was given up brings nothing up: counted as
    failed, not as tier hits (before, the blocks read were counted as hits)."""
    t, loop = rig(disk_path=str(tmp_path), disk_size=16 << 20)
    tenant, c = _tenant(), t.counters
    keys = [b"p%d" % i for i in range(8)]
    t.tiers["disk"].put(tenant.digest.encode(), [
        TierBlock(k, i, np.full(BLOCK, i, np.uint8)) for i, k in enumerate(keys)])
    reply = t.lookup(tenant, keys, 0, m.LookupOk(1, 0, b"", 0), lambda r: None)
    assert reply is not None and reply.pending == 8  # coming up from disk
    t.index.expire(time.monotonic() + 3600)  # the promotion's deadline passes first
    loop.pump(lambda: c.promote_failed + c.disk_hit_blocks > 0)
    assert (c.disk_hit_blocks, c.promote_failed) == (0, 8)
    assert t.index.lookup(tenant, keys)[0] == 0


def test_closing_is_bounded_in_all_by_its_timeout_with_a_disk_write_stuck(
        rig, tmp_path, monkeypatch):
    """A write stuck on a stalled disk: the writer's join took the timeout, then the disk
    tier's own close waited as long again (20 s where a stop has 30 in all)."""
    import os
    import threading

    t, _ = rig(disk_path=str(tmp_path), disk_size=16 << 20)
    stuck, release = threading.Event(), threading.Event()

    def pwritev(fd, bufs, off):
        stuck.set()
        release.wait(30)
        raise OSError(5, "device gone")

    monkeypatch.setattr(os, "pwritev", pwritev)
    disk = t.tiers["disk"]
    t.writers["disk"].submit(lambda: disk.put(b"ns", [TierBlock(b"k", 0, np.zeros(
        BLOCK, np.uint8))]), lambda res, err: None)
    try:
        assert stuck.wait(10)
        closer = threading.Thread(target=t.close, kwargs={"timeout": 1.0})
        t0 = time.monotonic()
        closer.start()
        closer.join(20)
        assert not closer.is_alive() and time.monotonic() - t0 < 5
    finally:
        release.set()


def test_a_stalled_cluster_pins_at_most_a_quarter_of_the_pool(rig, redis_server):
    """Write-behind keeps a block pinned until it is written. Bounded only by
    ``tier_queue_bytes`` (256 MiB by default), a stalled cluster let it pin every slot
    of a smaller pool, and Allocates found no room; now a quarter of the pool at most."""
    t, loop = rig(remote=redis_server.url, remote_timeout_ms=30_000)
    tenant, c, ix = _tenant(), t.counters, t.index
    pid = redis_server.node.proc.pid
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        for r in range(8):  # 128 blocks, the whole pool
            _store(t, tenant, [b"r%d-%d" % (r, i) for i in range(16)])
        assert 0 < ix.pinned_blocks <= 32  # 2 MiB of 8
        res = ix.allocate(tenant, [b"new%d" % i for i in range(64)], owner=2,
                          now=time.monotonic())
        assert res.allocated == 64  # room, by evicting blocks not waiting on the cluster
    finally:
        os.kill(pid, signal.SIGCONT)
    loop.pump(lambda: c.written_behind_blocks + c.write_behind_dropped == 128, timeout=60)
    assert c.written_behind_blocks > 0 and not ix.pins.any()  # written, then unpinned


def test_a_promotion_is_committed_when_it_lands_not_at_the_next_tick(tmp_path):
    """Promoted blocks became READY without the service's commit: the journal and the
    KV events (BlockStored) heard of them at the next housekeeping tick, up to 0.25 s
    later, meanwhile routers sent the conversation's next turn elsewhere."""
    config = Config(pool_size=8 << 20, extent_size=1 << 20, disk_path=str(tmp_path),
                    disk_size=16 << 20)
    loop = Loop()
    ready_at_commit: list[int] = []
    index = new_index(config)
    t = Tiering(config, index, np.zeros(config.pool_size, np.uint8), loop.post,
                lambda s, fn: None, time.monotonic,
                committed=lambda: ready_at_commit.append(index.ready_blocks))
    try:
        tenant = _tenant()
        keys = [b"q%d" % i for i in range(4)]
        t.tiers["disk"].put(tenant.digest.encode(), [
            TierBlock(k, i, np.full(BLOCK, i, np.uint8)) for i, k in enumerate(keys)])
        t.lookup(tenant, keys, 0, m.LookupOk(1, 0, b"", 0), lambda r: None)
        loop.pump(lambda: t.counters.disk_hit_blocks == 4)
        assert ready_at_commit and ready_at_commit[-1] == 4
    finally:
        t.close(timeout=2)


@pytest.mark.parametrize("disk_policy", ["lru", ""])
def test_a_promotion_does_not_evict_the_run_it_promotes(rig, tmp_path, monkeypatch,
                                                        disk_policy):
    """A run promoted from a full disk makes room in RAM; what that evicts goes down
    and needs room on the disk. The run being read was the disk's oldest, so it was
    evicted for the demotion before its read: the Lookup promised blocks that never
    came (promote_failed). Asked for, the run is the disk's most recent now."""
    t, loop = rig(disk_path=str(tmp_path), disk_size=8 << 20, disk_policy=disk_policy)
    tenant, c, disk = _tenant(), t.counters, t.tiers["disk"]
    ns = tenant.digest.encode()
    _store(t, tenant, [b"a%d" % i for i in range(128)])  # RAM is full
    promoted = [b"p%d" % i for i in range(8)]
    disk.put(ns, [TierBlock(k, i, np.full(BLOCK, i, np.uint8)) for i, k in enumerate(promoted)])
    room = disk.allocator.total_slots(disk.index.slot_bytes(BLOCK)) - 8
    for start in range(0, room, 16):  # then other blocks fill the disk
        disk.put(ns, [TierBlock(b"f%d" % i, 0, np.zeros(BLOCK, np.uint8))
                      for i in range(start, min(start + 16, room))])
    assert disk.contains(ns, promoted) == 8
    evicted = disk.counts["evicted_blocks"]
    read = disk.get_into

    def read_after_the_demotion(*args):  # the writer thread gets there first
        deadline = time.monotonic() + 5
        while disk.counts["evicted_blocks"] < evicted + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        return read(*args)

    monkeypatch.setattr(disk, "get_into", read_after_the_demotion)
    reply = t.lookup(tenant, promoted, 0, m.LookupOk(1, 0, b"", 0), lambda r: None)
    assert reply is not None and reply.pending == 8
    loop.pump(lambda: c.disk_hit_blocks + c.promote_failed >= 8 and c.demoted_blocks >= 8)
    assert (c.disk_hit_blocks, c.promote_failed) == (8, 0)
    assert t.index.lookup(tenant, promoted)[0] == 8
