"""Tiers with real daemons: evicted blocks go to disk and come back after a kill -9 with
the RAM pool gone; two daemons share blocks through a real Redis cluster; a cluster
that stops or holds a corrupt value never costs a wrong byte or a stuck lookup."""

from __future__ import annotations

import os
import signal
import time

from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for

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



def test_evicted_blocks_go_to_disk_and_survive_kill9_without_the_pool(daemon_factory,
                                                                      tmp_path):
    disk = tmp_path / "disk"
    d = daemon_factory(*SMALL_POOL, "--disk-path", str(disk), "--disk-size", "8M")
    rounds = [store_round(d, f"r{i}-", seed=i + 1) for i in range(4)]  # 256 > 170 blocks
    st = d.wait_counter("demoted_blocks", N)
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


def test_blocks_an_overtaking_store_evicts_go_down_with_their_own_bytes(daemon_factory,
                                                                         tmp_path):
    """A worker's ticketed store that overtook its Allocate starts copying into the
    slots as soon as the Allocate hands them out: what that Allocate evicted must be
    copied down to disk before, or the disk holds the new bytes, verified, under the old
    keys."""
    d = daemon_factory(*SMALL_POOL, "--policy", "lru", "--disk-path", str(tmp_path / "disk"),
                       "--disk-size", "8M")
    rounds = [store_round(d, f"r{i}-", seed=i + 1) for i in range(3)]  # 192 > 170 blocks
    spec = Spec(d.socket, pages=PAGES, seed=99)
    sched, w = scheduler(d, spec), Worker(spec)
    try:
        for t in range(3):  # each evicts N more READY blocks, oldest (round 0) first
            assert w.send_store(10 + t, range(N), ticket=70 + t)
            time.sleep(0.2)  # parked in the daemon, waiting for its Allocate
            r = sched.request(m.Allocate(sched.next_req(), keys(N, f"x{t}-"), ticket=70 + t))
            assert isinstance(r, m.Allocated) and r.allocated == N
            assert w.wait(10 + t)[1] == 0
    finally:
        w.close()
        sched.close()
    st = d.status()["counters"]
    d.wait_counter("demoted_blocks", st["evicted_blocks"])
    for ks, digest in rounds:  # all evicted by now: each comes back from disk, intact
        assert load_when_ready(d, ks, want=N)[:2] == (N, digest)
    assert d.status()["counters"]["promote_failed"] == 0


def test_a_block_corrupted_in_the_pool_does_not_go_down_under_a_fresh_checksum(
        daemon_factory, tmp_path):
    """With checksums on, a block's bytes are checked against those recorded at its
    store before they go down: a corruption in RAM is held back, not laundered into a
    tier value with a valid header (which every later load would trust)."""
    d = daemon_factory(*SMALL_POOL, "--policy", "lru", "--verify-on-load",
                       "--disk-path", str(tmp_path / "disk"), "--disk-size", "8M")
    ks, _ = store_round(d, "r0-", seed=1)
    sched = scheduler(d, Spec(d.socket, pages=PAGES))
    try:
        hit = lookup(sched, ks[:1])
        slot = int(unpack_u32(hit.slots)[0])
        sched.request(m.Release(sched.next_req(), hit.lease))
    finally:
        sched.close()
    # The pool's geometry: 1 MiB extents of 12 KiB slots, ids extent * 256 + index.
    e, i = divmod(slot, (1 << 20) // 4096)
    with open(d.pool_path, "r+b") as f:
        f.seek(e * (1 << 20) + i * sum(PAGES) + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for r in range(1, 4):  # 256 > 170 blocks: round 0 goes down
        store_round(d, f"r{r}-", seed=r + 1)
    st = d.wait_counter("corrupt_held_back", 1)
    d.wait_counter("demoted_blocks", st["counters"]["evicted_blocks"] - 1)
    assert d.status()["counters"]["corrupt_held_back"] == 1
    hits, _, _ = load_when_ready(d, ks)
    assert hits == 0  # the first block is nowhere: the run ends before it
    assert load_when_ready(d, ks[1:], want=N - 1)[0] == N - 1  # the rest went down


def test_a_corrupt_disk_block_ends_the_run_and_is_never_served(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = daemon_factory(*SMALL_POOL, "--disk-path", str(disk), "--disk-size", "8M")
    rounds = [store_round(d, f"r{i}-", seed=i + 1) for i in range(4)]
    d.wait_counter("demoted_blocks", N)
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
    a.wait_counter("written_behind_blocks", N)
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
    st = a.wait_counter("written_behind_blocks", N)
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


def test_a_hung_cluster_fills_the_bounded_queue_and_the_rest_is_dropped(daemon_factory,
                                                                        redis_cluster,
                                                                        tmp_path):
    """Write-behind never waits: with every master stopped (accepting, never answering),
    what fits sits in the queue, the rest is dropped and counted, and
    the engine's stores and loads go on from RAM."""
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('tier_queue_bytes = "1M"\nremote_timeout_ms = 3000\n')  # 768 KiB a round
    d = daemon_factory("--config", str(cfg), "--remote", redis_cluster.url)
    store_round(d, "warm-", seed=1)
    d.wait_counter("written_behind_blocks", N)
    pids = [node.proc.pid for node in redis_cluster.nodes]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        rounds = [store_round(d, f"hung{i}-", seed=i + 2) for i in range(3)]
        st = d.status()
        # the queue holds 1 MiB: the first round's 768 KiB and 256 KiB of the second
        # (the head of its run); the rest is dropped
        block = (768 << 10) // N
        assert st["counters"]["write_behind_dropped"] >= 3 * N - (1 << 20) // block
        assert st["tiers"]["remote"]["queued_bytes"] <= 1 << 20
        for ks, digest in rounds:  # RAM serves all of it meanwhile
            hits, got, _ = load_when_ready(d, ks)
            assert (hits, got) == (N, digest)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        redis_cluster.wait_ok()
    st = d.wait_counter("tier_errors", 1)  # the queued batch timed out, counted
    assert st["counters"]["written_behind_blocks"] + st["counters"][
        "write_behind_dropped"] == 4 * N


def test_tiers_in_status_metrics_and_kvdctl(daemon_factory, redis_cluster, tmp_path, capsys):
    from kvd.cli import ctl
    from tests.ops.test_metrics import free_port, scrape, status_json

    port = free_port()
    d = daemon_factory(*SMALL_POOL, "--metrics-port", str(port), "--disk-path",
                       str(tmp_path / "disk"), "--disk-size", "8M", "--remote",
                       redis_cluster.url)
    rounds = [store_round(d, f"m{i}-", seed=i + 1) for i in range(4)]
    d.wait_counter("demoted_blocks", N)
    d.wait_counter("written_behind_blocks", 4 * N)
    d.kill()
    os.unlink(d.pool_path)
    d.start()
    load_when_ready(d, rounds[0][0], want=N)

    st = status_json(d, capsys)
    disk, remote, c = st["tiers"]["disk"], st["tiers"]["remote"], st["counters"]
    assert disk["capacity_bytes"] == 8 << 20 and 0 < disk["bytes"] <= disk["capacity_bytes"]
    assert remote["state"] == "closed"  # connected at start
    assert c["promoted_blocks"] == c["disk_hit_blocks"] + c["remote_hit_blocks"] == N
    got = scrape(port)
    for name, key in (("kvd_disk_hit_blocks_total", "disk_hit_blocks"),
                      ("kvd_remote_hit_blocks_total", "remote_hit_blocks"),
                      ("kvd_promoted_blocks_total", "promoted_blocks"),
                      ("kvd_demoted_blocks_total", "demoted_blocks")):
        assert got[(name, ())] == c[key], name
    assert got[("kvd_tier_capacity_bytes", (("tier", "disk"),))] == 8 << 20
    assert got[("kvd_tier_blocks", (("tier", "disk"),))] == disk["blocks"]
    assert got[("kvd_tier_up", (("tier", "remote"),))] == 1

    assert ctl.main(["--socket", d.socket, "status"]) == 0
    text = capsys.readouterr().out
    assert "disk     up  " in text and "remote   up  " in text
    assert f"promoted disk {c['disk_hit_blocks']} remote {c['remote_hit_blocks']}" in text


def test_a_lookup_that_does_not_wait_still_brings_the_run_up_for_the_next(daemon_factory,
                                                                         redis_cluster,
                                                                         tmp_path):
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("remote_lookup_ms = 0\n")  # never wait for the cluster
    a = daemon_factory("--remote", redis_cluster.url)
    b = daemon_factory("--config", str(cfg), "--remote", redis_cluster.url)
    ks, digest = store_round(a, "nowait-", seed=11)
    a.wait_counter("written_behind_blocks", N)
    hits, got, info = load_when_ready(b, ks, want=N)
    assert (info["first_hits"], info["first_pending"]) == (0, 0)  # answered at once
    assert (hits, got) == (N, digest)  # and the next Lookup found the run in RAM
    assert b.status()["counters"]["remote_hit_blocks"] == N


def test_a_cluster_down_at_start_is_counted_and_ram_serves(daemon_factory):
    from tests.redis_servers import free_ports

    (port,) = free_ports(1, bus=False)  # nothing listens there
    d = daemon_factory("--remote", f"redis://127.0.0.1:{port}")
    st = d.wait_counter("tier_errors", 1)  # the connect at start failed, and was counted
    assert st["counters"]["tier_errors"] >= 1
    ks, digest = store_round(d, "down-", seed=5)
    hits, got, _ = load_when_ready(d, ks)
    assert (hits, got) == (N, digest)
    st = d.wait_counter("write_behind_dropped", N)  # the write-behind failed, counted
    assert st["counters"]["written_behind_blocks"] == 0


def test_a_tenant_dropped_while_the_cluster_is_asked_gets_no_blocks(daemon_factory,
                                                                   redis_server, tmp_path):
    """At the tenant limit an idle tenant was dropped while a remote probe for it was in
    flight; the answer then promoted its blocks anyway: READY blocks of no tenant, which
    no engine could ever hit, announced on a topic with no model."""
    a = daemon_factory("--remote", redis_server.url)
    ks, _ = store_round(a, "p-", seed=3)
    a.wait_counter("written_behind_blocks", N)
    a.stop()
    cfg = tmp_path / "b.toml"
    cfg.write_text("remote_timeout_ms = 8000\nmax_tenants = 1\n")
    b = daemon_factory("--config", str(cfg), "--remote", redis_server.url)
    first = scheduler(b, Spec(b.socket, pages=PAGES))
    pid = redis_server.node.proc.pid
    os.kill(pid, signal.SIGSTOP)  # the probe waits for the cluster
    try:
        r = first.request(m.Lookup(first.next_req(), ks))
        assert (r.hits, r.pending) == (0, 0)  # answered without it (remote_lookup_ms)
        first.close()
        second = scheduler(b, Spec(b.socket, model="other", pages=PAGES))  # drops "tiny"
        assert wait_for(lambda: "dropped with 0 blocks" in b.logs(), 10)
    finally:
        os.kill(pid, signal.SIGCONT)
    st = b.wait_counter("promote_failed", N, timeout=15)
    assert st["counters"]["remote_hit_blocks"] == 0
    assert st["blocks"]["ready"] == sum(t["blocks"] for t in st["tenants"]) == 0
    assert (st["blocks"]["pending"], st["blocks"]["pinned"]) == (0, 0)
    second.close()


def test_a_stop_while_the_cluster_hangs_ends_clean(daemon_factory, redis_server, tmp_path):
    """SIGTERM while a write-behind hangs on a stopped server: the stop is bounded, exits
    0, and nothing runs after "kvd stopped" (before, a housekeeping tick due during the
    wait ran after the journal closed, on its descriptor, and the hung job's late result
    logged errors from the tier's closed client)."""
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("remote_timeout_ms = 30000\n")
    d = daemon_factory("--config", str(cfg), "--persist", "--remote", redis_server.url)
    store_round(d, "warm-", seed=1)
    d.wait_counter("written_behind_blocks", N)
    pid = redis_server.node.proc.pid
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        store_round(d, "hung-", seed=2)  # its write-behind waits on the server
        time.sleep(0.5)
        t0 = time.monotonic()
        assert d.stop(timeout=40) == 0
        assert time.monotonic() - t0 < 30  # the tiers' close waits 10 s at most
    finally:
        os.kill(pid, signal.SIGCONT)
    after = d.logs().split("kvd stopped", 1)[1]
    assert "ERROR" not in after and "closed file" not in after, after
