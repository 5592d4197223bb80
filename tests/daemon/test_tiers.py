"""Tiers with real daemons: evicted blocks go to disk and come back after a kill -9 with
the RAM pool gone; two daemons share blocks through a real Redis cluster; a cluster
that stops or holds a corrupt value never costs a wrong byte or a stuck lookup."""

from __future__ import annotations

import os
import time

from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker

PAGES = (8192, 4096)  # a 12 KiB block
N = 64  # blocks per round (a worker's memory)
SMALL_POOL = ("--pool-size", "2M", "--extent-size", "1M")  # 170 blocks


def store_round(d, tag: str, seed: int, prefix: int = N) -> tuple[list[bytes], str]:
    """Store N blocks under keys ``tag``* from a worker whose memory is seeded ``seed``;
    the keys and the digest of the first ``prefix`` blocks."""
    spec = Spec(d.socket, pages=PAGES, seed=seed)
    sched, w = scheduler(d, spec), Worker(spec)
    try:
        ks = keys(N, tag)
        slots = allocate(sched, ks)
        assert w.store(1, range(N), slots)[1] == 0
        return ks, w.digest(range(prefix))
    finally:
        w.close()
        sched.close()


def load_when_ready(d, ks: list[bytes], want: int = 0,
                    timeout: float = 20.0) -> tuple[int, str | None, dict]:
    """Look ``ks`` up until no block is pending any more (promotions finished) and at
    least ``want`` hit, then load the hits into a zeroed worker: (hits, digest of the
    loaded blocks, what the first and last replies said)."""
    spec = Spec(d.socket, pages=PAGES)
    sched = scheduler(d, spec)
    try:
        deadline = time.monotonic() + timeout
        first = None
        while True:
            hit = lookup(sched, ks)
            first = first or hit
            if (not hit.pending and hit.hits >= want) or time.monotonic() > deadline:
                break
            sched.request(m.Release(sched.next_req(), hit.lease))
            time.sleep(0.05)
        info = {"first_hits": first.hits, "first_pending": first.pending,
                "pending": hit.pending}
        if not hit.hits:
            return 0, None, info
        r = Worker(Spec(d.socket, pages=PAGES, seed=None))
        try:
            assert r.load(2, range(hit.hits), unpack_u32(hit.slots))[1] == 0
            return hit.hits, r.digest(range(hit.hits)), info
        finally:
            r.close()
    finally:
        sched.close()


def wait_counter(d, key: str, at_least: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        if st["counters"][key] >= at_least or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_evicted_blocks_go_to_disk_and_survive_kill9_without_the_pool(daemon_factory,
                                                                      tmp_path):
    disk = tmp_path / "disk"
    d = daemon_factory(*SMALL_POOL, "--disk-path", str(disk), "--disk-size", "8M")
    rounds = [store_round(d, f"r{i}-", seed=i + 1) for i in range(4)]  # 256 > 170 blocks
    st = wait_counter(d, "demoted_blocks", N)
    assert st["counters"]["evicted_blocks"] >= N
    assert st["counters"]["demoted_blocks"] == st["counters"]["evicted_blocks"]
    assert st["tiers"]["disk"]["blocks"] == st["counters"]["demoted_blocks"]
    assert st["tiers"]["disk"]["bytes"] <= st["tiers"]["disk"]["capacity_bytes"]
    assert os.path.getsize(disk / "kvd-disk.slots") == 8 << 20

    d.kill()
    os.unlink(d.pool_path)  # a reboot: the RAM pool is gone, the disk is not
    d.start()
    ks, digest = rounds[0]  # the first round was evicted first: it is on disk
    hits, got, info = load_when_ready(d, ks)
    assert info["first_hits"] == 0 and info["first_pending"] == N  # promoted, not yet READY
    assert (hits, got) == (N, digest)
    st = d.status()
    assert st["counters"]["disk_hit_blocks"] == N and st["counters"]["promoted_blocks"] == N
    assert st["counters"]["promote_failed"] == 0


def test_a_corrupt_disk_block_ends_the_run_and_is_never_served(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = daemon_factory(*SMALL_POOL, "--disk-path", str(disk), "--disk-size", "8M")
    rounds = [store_round(d, f"r{i}-", seed=i + 1) for i in range(4)]
    wait_counter(d, "demoted_blocks", N)
    d.kill()
    os.unlink(d.pool_path)
    # Flip one payload byte of every slot written: each block's xxh3 catches it.
    data = bytearray((disk / "kvd-disk.slots").read_bytes())
    for off in range(0, len(data), 4096 * 4):  # 16 KiB slots (12 KiB + header, rounded)
        if data[off:off + 4] == b"KVT1":
            data[off + 1000] ^= 0xFF
    (disk / "kvd-disk.slots").write_bytes(bytes(data))
    d.start()
    hits, _, _ = load_when_ready(d, rounds[0][0])
    assert hits == 0
    st = d.status()
    assert st["counters"]["disk_hit_blocks"] == 0 and st["counters"]["promote_failed"] >= 1
    assert st["tiers"]["disk"]["corrupt_blocks"] >= 1


def test_two_daemons_share_blocks_through_the_cluster(daemon_factory, redis_cluster):
    a = daemon_factory("--remote", redis_cluster.url)
    b = daemon_factory("--remote", redis_cluster.url)
    ks, digest = store_round(a, "shared-", seed=7)
    wait_counter(a, "written_behind_blocks", N)
    hits, got, info = load_when_ready(b, ks, want=N)
    assert info["first_hits"] == 0  # node B never stored them: they came from the cluster
    assert (hits, got) == (N, digest)
    st = b.status()
    assert st["counters"]["remote_hit_blocks"] == N
    assert st["tiers"]["remote"]["state"] == "closed"
    # Another model's engine on node B sees none of it.
    other = Spec(b.socket, model="other", pages=PAGES)
    sched = scheduler(b, other)
    try:
        r = lookup(sched, ks)
        assert (r.hits, r.pending) == (0, 0)
    finally:
        sched.close()


def test_a_corrupt_value_in_the_cluster_is_never_served(daemon_factory, redis_cluster):
    a = daemon_factory("--remote", redis_cluster.url)
    b = daemon_factory("--remote", redis_cluster.url)
    import redis

    ks, digest = store_round(a, "corrupt-", seed=9, prefix=9)
    st = wait_counter(a, "written_behind_blocks", N)
    name = b"kvd:" + st["tenants"][0]["digest"].encode() + b":" + ks[9]
    # Flip a payload byte of the 10th block's value, where the cluster keeps it.
    client = redis.RedisCluster.from_url(redis_cluster.url.split(",")[0])
    try:
        byte = client.getrange(name, 1000, 1000)
        client.setrange(name, 1000, bytes([byte[0] ^ 0xFF]))
        hits, got, _ = load_when_ready(b, ks, want=9)
        assert not client.exists(name)  # forgotten where it was found corrupt
    finally:
        client.close()
    assert (hits, got) == (9, digest)  # the run ends before the corrupt block
    st = b.status()
    assert st["tiers"]["remote"]["corrupt_blocks"] == 1
    assert st["counters"]["remote_hit_blocks"] == 9


def test_a_stopped_cluster_costs_no_lookup_more_than_its_deadline(daemon_factory,
                                                                 redis_cluster):
    d = daemon_factory("--remote", redis_cluster.url)
    store_round(d, "before-", seed=3)
    redis_cluster.stop()
    try:
        spec = Spec(d.socket, pages=PAGES)
        sched = scheduler(d, spec)
        try:
            worst = 0.0
            for i in range(10):
                t0 = time.monotonic()
                r = lookup(sched, keys(8, f"absent{i}-"))
                worst = max(worst, time.monotonic() - t0)
                assert (r.hits, r.pending) == (0, 0)
            assert worst < 1.0  # remote_lookup_ms (20 ms) bounds it, not a timeout
        finally:
            sched.close()
        ks, digest = store_round(d, "during-", seed=4)  # RAM keeps serving
        hits, got, _ = load_when_ready(d, ks)
        assert (hits, got) == (N, digest)
        st = d.status()
        assert st["counters"]["tier_errors"] >= 1
    finally:
        redis_cluster.start()
