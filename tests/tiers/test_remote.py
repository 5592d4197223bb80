"""The remote tier against a real 3-master Redis cluster (and one standalone server):
batches spread over every master, only verified bytes ever reach a buffer, and a
stopped or hung cluster costs a bounded time, then nothing, until it is back."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np
import pytest
import redis

from kvd.errors import BreakerOpen, ConfigError, TierError
from kvd.tiers.base import HEADER_BYTES, TierBlock, make_tier
from kvd.tiers.remote import RedisTier, parse_urls
from tests.waiting import wait_for

SIZE = 4096
SENTINEL = 0xAA


def _ns() -> bytes:
    return uuid.uuid4().hex.encode()  # a fresh tenant per test: the cluster is shared


def _blocks(n: int, seed: int = 0, prefix: str = "k") -> list[TierBlock]:
    rng = np.random.default_rng(seed)
    return [TierBlock(f"{prefix}{i}".encode(), i, rng.integers(0, 256, SIZE, np.uint8))
            for i in range(n)]


def _outs(n: int, size: int = SIZE) -> list[np.ndarray]:
    return [np.full(size, SENTINEL, np.uint8) for _ in range(n)]


def _key(ns: bytes, key: bytes) -> bytes:
    return b"kvd:" + ns + b":" + key


@pytest.fixture
def tier(redis_cluster):
    t = RedisTier(redis_cluster.url, timeout_ms=500)
    yield t
    t.close()


@pytest.fixture
def raw(redis_cluster):
    """A plain redis-py cluster client, to look at and tamper with what the tier wrote."""
    c = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    yield c
    c.close()


# ------------------------------------------------------------ configuration
def test_urls_are_validated_and_nothing_connects_at_construction():
    assert parse_urls("redis://10.0.0.5:6379,10.0.0.6:6380") == [("10.0.0.5", 6379),
                                                                 ("10.0.0.6", 6380)]
    assert parse_urls("redis://a:1, redis://b.example:2") == [("a", 1), ("b.example", 2)]
    assert parse_urls("redis://[::1]:7000") == [("::1", 7000)]
    for bad in ("10.0.0.5:6379", "redis://host", "redis://h:99999", "redis://h:1,",
                "http://h:1", "redis://h:1,b:x", "redis://u:p@h:1"):
        with pytest.raises(ConfigError, match="remote"):
            RedisTier(bad)
    # Nothing listens there: the daemon still starts, the first call fails.
    t = make_tier("redis", urls="redis://127.0.0.1:1", timeout_ms=100)
    assert isinstance(t, RedisTier) and t.local is False
    assert t.status()["state"] == "unconnected" and t.status()["cluster"] is None
    with pytest.raises(TierError, match="127.0.0.1:1"):
        t.contains(b"ns", [b"k"])


# ------------------------------------------------------------ data
def test_round_trip_spreads_over_all_masters(tier, redis_cluster):
    ns, blocks = _ns(), _blocks(200)
    keys = [b.key for b in blocks]
    assert tier.put(ns, blocks) == 200
    per_node = [int(redis_cluster.node_cli(i, "EVAL",
                                           f"return #redis.call('KEYS','kvd:{ns.decode()}:*')",
                                           "0")) for i in range(3)]
    assert sum(per_node) == 200 and min(per_node) > 30, per_node  # no hash tag
    assert all(int(redis_cluster.node_cli(i, "DBSIZE")) > 0 for i in range(3))

    assert tier.contains(ns, keys) == 200
    assert tier.contains(ns, keys[:50] + [b"absent"] + keys[50:]) == 50  # the leading run
    outs = _outs(200)
    assert tier.get_into(ns, keys, outs) == 200
    assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))
    st = tier.status()
    assert (st["state"], st["cluster"], st["written_blocks"], st["read_blocks"]) == \
        ("closed", True, 200, 200)

    other, outs = _ns(), _outs(3)
    assert tier.contains(other, keys) == 0
    assert tier.get_into(other, keys[:3], outs) == 0
    assert all((o == SENTINEL).all() for o in outs)


def test_a_block_its_header_cannot_hold_is_declined_and_the_batch_kept(tier):
    """A key too long for the 128-byte header, or a depth beyond 32 bits: that block is
    declined (before, the whole batch failed with it)."""
    ns, blocks = _ns(), _blocks(4)
    odd = [TierBlock(b"x" * 200, 0, blocks[0].data), TierBlock(b"deep", 1 << 32, blocks[0].data),
           TierBlock(b"neg", -1, blocks[0].data)]
    assert tier.put(ns, blocks[:2] + odd + blocks[2:]) == 4
    outs = _outs(4)
    assert tier.get_into(ns, [b.key for b in blocks], outs) == 4
    assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))
    assert tier.contains(ns, [b"deep"]) == 0 and tier.errors == 0


def test_a_ttl_is_set_unless_zero(redis_cluster, raw):
    ns = _ns()
    with closing(RedisTier(redis_cluster.url, ttl_s=60)) as t:
        t.put(ns, _blocks(3, prefix="ttl"))
    assert 0 < raw.pttl(_key(ns, b"ttl0")) <= 60_000
    with closing(RedisTier(redis_cluster.url, ttl_s=0)) as t:
        t.put(ns, _blocks(3, prefix="forever"))
    assert raw.pttl(_key(ns, b"forever0")) == -1  # exists, no TTL


def test_a_block_read_has_its_ttl_renewed(redis_cluster, raw):
    """Blocks promoted from the cluster are not written back, so a read renews the TTL:
    a block the fleet keeps reading does not expire a day after it was written."""
    ns, blocks = _ns(), _blocks(6, prefix="read")
    keys = [b.key for b in blocks]
    with closing(RedisTier(redis_cluster.url, ttl_s=60, max_batch=4)) as t:
        assert t.put(ns, blocks) == 6
        for k in keys:  # as if written long ago
            raw.pexpire(_key(ns, k), 5_000)
        outs = _outs(6)
        assert t.get_into(ns, keys[:5], outs) == 5  # two batches
        assert all(np.array_equal(o, b.data) for o, b in zip(outs[:5], blocks))
        assert all(raw.pttl(_key(ns, k)) > 50_000 for k in keys[:5])
        assert 0 < raw.pttl(_key(ns, keys[5])) <= 5_000  # not read: not renewed
    with closing(RedisTier(redis_cluster.url, ttl_s=0)) as t:
        assert t.put(ns, _blocks(2, prefix="forever")) == 2
        assert t.get_into(ns, [b"forever0", b"forever1"], _outs(2)) == 2
        assert raw.pttl(_key(ns, b"forever0")) == -1  # still no TTL


def test_a_corrupt_value_ends_the_run_and_is_forgotten(tier, redis_cluster, raw):
    ns = _ns()
    blocks = [TierBlock(f"c{i}".encode(), i, np.full(SIZE, ord("A") + i, np.uint8))
              for i in range(10)]
    keys = [b.key for b in blocks]
    assert tier.put(ns, blocks) == 10
    name = _key(ns, b"c5")
    at = HEADER_BYTES + 100
    assert raw.getrange(name, at, at) == b"F"
    redis_cluster.cli("SETRANGE", name.decode(), str(at), "G")  # one payload byte flipped
    outs = _outs(10)
    assert tier.get_into(ns, keys, outs) == 5
    assert all(np.array_equal(o, b.data) for o, b in zip(outs[:5], blocks))
    assert all((o == SENTINEL).all() for o in outs[5:])  # no wrong byte copied
    assert raw.exists(name) == 0
    assert tier.status()["corrupt_blocks"] == 1
    assert tier.contains(ns, keys) == 5  # forgotten


def test_foreign_and_wrong_sized_values_are_misses(tier, raw):
    ns, blocks = _ns(), _blocks(4)
    keys = [b.key for b in blocks]
    assert tier.put(ns, blocks) == 4
    raw.set(_key(ns, b"k1"), os.urandom(SIZE + HEADER_BYTES))  # arbitrary bytes
    raw.set(_key(ns, b"k2"), raw.get(_key(ns, b"k3")))  # a valid block, of another key
    outs = _outs(4)
    assert tier.get_into(ns, keys, outs) == 1
    assert (outs[1] == SENTINEL).all()
    assert tier.get_into(ns, keys[2:], _outs(2)) == 0  # the header names k3, not k2
    short = _outs(1, SIZE - 1)
    assert tier.get_into(ns, keys[3:], short) == 0  # the right block, the wrong buffer
    assert (short[0] == SENTINEL).all()
    assert tier.status()["corrupt_blocks"] == 3


def test_a_value_of_another_size_ends_the_probed_run(tier, raw):
    """The daemon makes room for a probed run before it reads it: a truncated value
    promised as a block cost good blocks in RAM, then failed its read. Told the size,
    the probe ends the run there and forgets the value; untold, it cannot tell."""
    ns, blocks = _ns(), _blocks(4)
    keys = [b.key for b in blocks]
    assert tier.put(ns, blocks) == 4
    name = _key(ns, b"k2")
    raw.set(name, raw.get(name)[:-1])  # one byte short
    assert tier.contains(ns, keys) == 4
    assert tier.contains(ns, keys, SIZE) == 2
    assert raw.exists(name) == 0  # forgotten
    assert tier.contains(ns, keys[:2], SIZE) == 2


def test_a_slot_moved_after_connecting_is_followed(tier, redis_cluster, raw):
    """The tier's slot map says A, the cluster now says B: MOVED, re-sent to B."""
    ns, blocks = _ns(), _blocks(40, prefix="m")
    assert tier.put(ns, blocks[:1]) == 1  # connected: the slot map is cached
    ids = [redis_cluster.node_cli(i, "CLUSTER", "MYID") for i in range(3)]
    ports = redis_cluster.ports
    for block in blocks[1:]:  # a key in a slot no other test wrote to
        name = _key(ns, block.key)
        slot = raw.keyslot(name)
        owner = ports.index(raw.get_node_from_key(name).port)
        if raw.cluster_countkeysinslot(slot) == 0:
            break
    else:
        pytest.skip("no empty slot among 39 keys")
    to = (owner + 1) % 3

    def owns(view: str, node: int) -> bool:
        """Whether ``CLUSTER NODES`` output ``view`` gives ``slot`` to ``node``."""
        line = next(x.split() for x in view.splitlines() if x.startswith(ids[node]))
        return any(int(r.split("-")[0]) <= slot <= int(r.split("-")[-1])
                   for r in line[8:] if not r.startswith("["))

    def highest(node: int) -> bool:
        """Whether every node sees ``node``'s config epoch above all others'."""
        for i in range(3):
            view = [x.split() for x in redis_cluster.node_cli(i, "CLUSTER",
                                                             "NODES").splitlines()]
            mine = next(int(x[6]) for x in view if x[0] == ids[node])
            if any(int(x[6]) >= mine for x in view if x[0] != ids[node]):
                if i == node:  # (a bump made before it heard of a later one, or equal)
                    redis_cluster.node_cli(node, "CLUSTER", "BUMPEPOCH")
                return False
        return True

    def assign(node: int) -> None:
        # The new owner's config epoch the highest everywhere first: the old owner's
        # claim of the slot still in gossip, at a higher epoch, would win over the
        # assignment in a node it reached after, and for good (no node claims the slot
        # any more to correct it).
        redis_cluster.node_cli(node, "CLUSTER", "BUMPEPOCH")
        assert wait_for(lambda: highest(node), 10)
        for i in (node, *(j for j in range(3) if j != node)):
            redis_cluster.node_cli(i, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[node])
        # Every node agrees before the test goes on: a redirect is followed once (a
        # second one, while nodes still disagree, is a miss).
        assert wait_for(lambda: all(owns(redis_cluster.node_cli(i, "CLUSTER", "NODES"), node)
                                    for i in range(3)), 10)

    assign(to)
    try:
        assert tier.put(ns, [block]) == 1
        assert redis_cluster.node_cli(to, "EXISTS", name.decode()) == "1"
        outs = _outs(1)
        assert tier.get_into(ns, [block.key], outs) == 1
        assert np.array_equal(outs[0], block.data)
        assert tier.status()["errors"] == 0
        # Moved again, and now a list under the name: the re-sent STRLEN's WRONGTYPE is
        # that key's (forgotten), not a failure of the cluster (the breaker's).
        redis_cluster.node_cli(to, "DEL", name.decode())
        third = (to + 1) % 3
        assign(third)
        to = third
        redis_cluster.node_cli(third, "RPUSH", name.decode(), "x")
        assert tier.contains(ns, [block.key]) == 0
        assert tier.status()["errors"] == 0 and tier.status()["corrupt_blocks"] == 1
        assert redis_cluster.node_cli(third, "EXISTS", name.decode()) == "0"
    finally:
        redis_cluster.node_cli(to, "DEL", name.decode())
        assign(owner)


def test_a_standalone_server_works_too(redis_server):
    ns, blocks = _ns(), _blocks(20)
    with closing(RedisTier(redis_server.url, max_batch=8)) as t:
        assert t.put(ns, blocks) == 20
        outs = _outs(20)
        assert t.get_into(ns, [b.key for b in blocks], outs) == 20
        assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))
        assert t.status()["cluster"] is False and t.status()["state"] == "closed"
    assert int(redis_server.cli("DBSIZE")) == 20


def test_one_thread_puts_while_another_reads(tier):
    ns, done, stop = _ns(), [], threading.Event()
    reads = [0]

    def writer() -> None:
        i = 0
        while not stop.is_set():
            batch = _blocks(16, seed=i, prefix=f"w{i}-")
            assert tier.put(ns, batch) == 16
            done.append(batch)
            assert tier.put(ns, done[i // 2]) == 16  # rewrites what the reader may read
            i += 1

    def reader() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            if not done:
                time.sleep(0.001)
                continue
            batch = done[int(rng.integers(len(done)))]
            outs = _outs(len(batch))
            assert tier.get_into(ns, [b.key for b in batch], outs) == len(batch)
            assert all(np.array_equal(o, b.data) for o, b in zip(outs, batch))
            reads[0] += len(batch)

    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(writer), pool.submit(reader)]
        time.sleep(1.0)
        stop.set()
        for job in jobs:
            job.result(10)  # re-raises a failed assertion of either thread
    assert len(done) > 5 and reads[0] > 50
    st = tier.status()
    assert st["errors"] == 0 and st["corrupt_blocks"] == 0


# ------------------------------------------------------------ failures
def test_a_stopped_cluster_fails_fast_then_not_at_all_then_recovers(redis_cluster):
    now = [1000.0]
    t = RedisTier(redis_cluster.url, timeout_ms=200, breaker_failures=3,
                  breaker_cooldown_s=5.0, clock=lambda: now[0])
    ns, blocks = _ns(), _blocks(8)
    keys = [b.key for b in blocks]
    assert t.put(ns, blocks) == 8
    redis_cluster.stop()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(TierError, match="redis"):
                t.get_into(ns, keys, _outs(8))
            assert time.monotonic() - t0 < 3.0
        st = t.status()
        assert st["state"] == "open" and st["errors"] == 3 and st["last_error"]
        for call in (lambda: t.contains(ns, keys), lambda: t.put(ns, blocks)):
            t0 = time.monotonic()
            with pytest.raises(BreakerOpen, match="breaker open"):
                call()
            assert time.monotonic() - t0 < 0.05
        assert t.status()["errors"] == 3  # no network was tried
        now[0] += 5.0  # half open: one call goes out, fails, and opens it again
        assert t.status()["state"] == "half_open"
        with pytest.raises(TierError):
            t.contains(ns, keys)
        assert t.status()["state"] == "open" and t.status()["errors"] == 4
    finally:
        redis_cluster.start()
    with pytest.raises(TierError, match="breaker open"):  # back, but the cooldown runs
        t.contains(ns, keys)
    now[0] += 5.0
    assert t.put(ns, blocks) == 8  # the trial call: it closes the breaker
    assert t.status()["state"] == "closed"
    assert t.contains(ns, keys) == 8
    t.close()


def test_a_read_that_fails_midway_keeps_the_batches_read_before(redis_cluster, monkeypatch):
    """A node lost between two batches of one read: the blocks of the first batch were
    read and verified, so they are the run (the daemon promotes them, not nothing)."""
    t = RedisTier(redis_cluster.url, max_batch=4)
    ns, blocks = _ns(), _blocks(8)
    assert t.put(ns, blocks) == 8
    real, calls = t._call, []

    def node_lost_midway(what, cmds, nbytes=0):
        calls.append(what)
        if calls.count("get_into") == 2:
            raise TierError("redis get_into: node lost")
        return real(what, cmds, nbytes)

    monkeypatch.setattr(t, "_call", node_lost_midway)
    outs = _outs(8)
    assert t.get_into(ns, [b.key for b in blocks], outs) == 4
    assert all(np.array_equal(o, b.data) for o, b in zip(outs[:4], blocks))
    assert all((o == SENTINEL).all() for o in outs[4:])
    t.close()


def _gauges(status: dict) -> dict[str, float]:
    from kvd.metrics import StatusCollector

    return {f.name: f.samples[0].value for f in StatusCollector._tiers({"remote": status})
            if f.name in ("kvd_tier_up", "kvd_tier_masters_down")}


def _later_master(raw: redis.RedisCluster, cluster, ns: bytes, keys: list[bytes]):
    """A master that does not own ``keys[0]``, and the index of its first key."""
    owners = [raw.get_node_from_key(_key(ns, k)).port for k in keys]
    node = next(n for n in cluster.nodes if n.port != owners[0] and n.port in owners)
    return node, owners.index(node.port)


def test_a_hung_master_costs_one_timeout_and_ends_the_run_at_its_first_key(redis_cluster,
                                                                            raw):
    ns, blocks = _ns(), _blocks(64)
    keys = [b.key for b in blocks]
    node, first = _later_master(raw, redis_cluster, ns, keys)
    with closing(RedisTier(redis_cluster.url, timeout_ms=200)) as t:
        assert t.put(ns, blocks) == 64
        os.kill(node.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            t0 = time.monotonic()
            outs = _outs(64)
            assert t.get_into(ns, keys, outs) == first  # the other masters' run
            assert time.monotonic() - t0 < 1.0  # one timeout, not one per key
            assert all(np.array_equal(o, b.data) for o, b in zip(outs[:first], blocks))
            assert all((o == SENTINEL).all() for o in outs[first:])
            st = t.status()
            assert str(node.port) in st["last_error"] and st["errors"] == 1
            # The cluster answered: its breaker stays shut.
            assert (st["consecutive_failures"], st["state"]) == (0, "closed")
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        redis_cluster.wait_ok()
        assert t.contains(ns, keys) == 64
        assert t.status()["state"] == "closed" and t.status()["masters_down"] == []


@contextlib.contextmanager
def _down(cluster, node):
    """``node`` (a master of the shared cluster) stopped, the others serving their slots
    (full coverage off, a cache's usual setting); back and as before afterwards."""
    for i in range(3):
        cluster.node_cli(i, "CONFIG", "SET", "cluster-require-full-coverage", "no")
    node.stop()
    try:
        yield
    finally:
        node.start()
        assert node.wait_up()
        # Its peers may have flagged it failed: they clear that a while after it is back,
        # and with full coverage on again the cluster would refuse every key meanwhile.
        assert wait_for(lambda: not any("fail" in cluster.node_cli(i, "CLUSTER", "NODES")
                                        for i in range(3)), 60)
        for i in range(3):
            cluster.node_cli(i, "CONFIG", "SET", "cluster-require-full-coverage", "yes")
        cluster.wait_ok()


def test_a_tier_connects_while_the_first_master_is_down(redis_cluster, raw):
    """A new cluster client sends COMMAND to its default node, the first master CLUSTER
    SLOTS names. With redis-py's retries off, a tier started (or reconnecting) while that
    master was down never connected, and its breaker shut the other masters off too."""
    ns, blocks = _ns(), _blocks(64)
    keys = [b.key for b in blocks]
    with closing(RedisTier(redis_cluster.url)) as t:
        assert t.put(ns, blocks) == 64
    port = raw.nodes_manager.slots_cache[0][0].port  # owns slot 0: named first
    node = next(n for n in redis_cluster.nodes if n.port == port)
    owners = [raw.get_node_from_key(_key(ns, k)).port for k in keys]
    with _down(redis_cluster, node):
        for _ in range(3):
            with closing(RedisTier(redis_cluster.url, timeout_ms=200)) as fresh:
                assert fresh.contains(ns, keys) == owners.index(port)
                assert fresh.status()["state"] == "closed"


def test_one_master_down_leaves_the_others_serving(redis_cluster, raw):
    """A cluster that serves the slots it still covers (full coverage off: a cache's
    usual setting) serves kvd too. Before, any batch with one key on the dead master
    failed whole, and the tier's breaker shut the whole cluster off."""
    now = [1000.0]
    t = RedisTier(redis_cluster.url, timeout_ms=200, breaker_failures=3,
                  breaker_cooldown_s=5.0, clock=lambda: now[0])
    ns, blocks = _ns(), _blocks(64)
    keys = [b.key for b in blocks]
    node, first = _later_master(raw, redis_cluster, ns, keys)
    name = f"127.0.0.1:{node.port}"
    assert t.put(ns, blocks) == 64
    with _down(redis_cluster, node):
        for call in range(3):  # three failures open the master's own breaker
            outs = _outs(64)
            assert t.get_into(ns, keys, outs) == first
            assert all(np.array_equal(o, b.data) for o, b in zip(outs[:first], blocks))
            assert t.status()["masters_down"] == ([name] if call == 2 else [])
        assert t.contains(ns, keys) == first
        st = t.status()
        assert (st["state"], st["errors"], st["corrupt_blocks"]) == ("closed", 3, 0)
        assert name in st["last_error"]
        assert _gauges(st) == {"kvd_tier_up": 1, "kvd_tier_masters_down": 1}
        from kvd.cli.render import tiers_lines

        line = "\n".join(tiers_lines({"tiers": {"remote": st}, "counters": {}}))
        assert f"remote   up  masters down: {name}  " in line
        assert f"last error: {st['last_error']}" in line
        # Skipped now: no more failures, and its keys are misses, never errors.
        fresh = _blocks(32, seed=1, prefix="f")
        live = [b for b in fresh
                if raw.get_node_from_key(_key(ns, b.key)).port != node.port]
        dead = [b for b in fresh if b not in live]
        assert live and dead
        assert t.put(ns, fresh) == len(live)
        assert t.contains(ns, [b.key for b in live]) == len(live)
        assert t.contains(ns, [dead[0].key]) == 0
        assert t.get_into(ns, [dead[0].key], _outs(1)) == 0
        st = t.status()
        assert (st["state"], st["errors"], st["rejected_blocks"]) == ("closed", 3, 0)
        assert t.get_into(ns, [b.key for b in live], _outs(len(live))) == len(live)
    assert t.contains(ns, keys) == first  # skipped until its cooldown has run
    now[0] += 5.0
    assert t.contains(ns, keys) == first  # called again: back, but empty
    assert t.status()["masters_down"] == []
    assert _gauges(t.status())["kvd_tier_masters_down"] == 0
    assert t.put(ns, blocks) == 64 and t.contains(ns, keys) == 64
    t.close()


def _replicated_tier(cluster, breaker_cooldown_s: float):
    """Replication up (the replicas hold what is written), and a tier that wrote 64
    blocks: the tier, their tenant and the blocks."""
    for n in cluster.nodes:
        assert wait_for(lambda n=n: "role:master" in (info := n.cli("INFO", "replication"))
                        or "master_link_status:up" in info, 30)
    t = RedisTier(cluster.url, timeout_ms=200, breaker_failures=3,
                  breaker_cooldown_s=breaker_cooldown_s)
    ns, blocks = _ns(), _blocks(64)
    assert t.put(ns, blocks) == 64
    return t, ns, blocks


def test_a_replica_that_takes_over_a_dead_master_is_used(redis_cluster_with_replicas):
    """A master dies, its replica is promoted: the blocks it replicated are served again
    from the new master, found by looking the slot map up again while the old master is
    skipped (no failure needed to find it), with no new client and no breaker of the
    tier's own opening."""
    cluster = redis_cluster_with_replicas
    t, ns, blocks = _replicated_tier(cluster, breaker_cooldown_s=600)
    keys = [b.key for b in blocks]
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        for name in {raw.get_node_from_key(_key(ns, k)).name for k in keys}:
            assert raw.get_redis_connection(raw.get_node(node_name=name)).execute_command(
                "WAIT", 1, 5000) == 1  # its replica has the blocks
        dead, first = _later_master(raw, cluster, ns, keys)
    finally:
        raw.close()
    dead.stop()
    live = [n for n in cluster.nodes if n is not dead]
    for _ in range(3):  # before the failover: a run up to it; then it is skipped
        assert t.get_into(ns, keys, _outs(64)) == first
    assert t.status()["masters_down"] == [f"127.0.0.1:{dead.port}"]
    # The replica is promoted once the others agree the master failed (node timeout 3 s).
    assert wait_for(lambda: all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False)
                                for n in live)
                    and sum("role:master" in n.cli("INFO", "replication") for n in live) == 3,
                    30), [n.cli("CLUSTER", "NODES", check=False) for n in live[:1]]
    # Calls with keys of the dead master's slots only (as a short Lookup makes) find
    # the new master too: nothing else answers them, yet they look the slots up again.
    assert wait_for(lambda: t.get_into(ns, [keys[first]], _outs(1)) == 1, 10)
    assert t.status()["masters_down"] == []  # the old master is no master any more
    outs = _outs(64)
    assert t.get_into(ns, keys, outs) == 64
    assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))
    st = t.status()
    assert (st["state"], st["errors"], st["corrupt_blocks"]) == ("closed", 3, 0)
    t.close()


def test_a_round_trip_carries_at_most_max_batch_bytes(redis_server, monkeypatch):
    """Large blocks go in several round trips, so one timeout bounds a known size."""
    from kvd.tiers import pipelines

    sent: list[int] = []
    execute = pipelines.execute

    def counting(node, cmds, where, budget_s=0.0):
        sent.append(len(cmds))
        return execute(node, cmds, where, budget_s)

    monkeypatch.setattr(pipelines, "execute", counting)
    ns, blocks = _ns(), _blocks(10)
    with closing(RedisTier(redis_server.url, max_batch_bytes=3 * SIZE)) as t:
        assert t.put(ns, blocks) == 10
        assert sent == [3, 3, 3, 1]
        sent.clear()
        outs = _outs(10)
        assert t.get_into(ns, [b.key for b in blocks], outs) == 10
        assert sent == [6, 6, 6, 2]  # a GET and an EXPIRE per block, in the same trips
        assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))


class _TricklingProxy:
    """A TCP proxy whose replies trickle (``chunk`` bytes, then a pause): every read
    gets bytes well inside a socket timeout, yet a large reply takes seconds."""

    def __init__(self, port: int, chunk: int = 1024, gap: float = 0.1) -> None:
        self.upstream, self.chunk, self.gap = port, chunk, gap
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for src, dst, slow in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pipe, args=(src, dst, slow), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(self.chunk if slow else 1 << 16):
                dst.sendall(data)
                if slow:
                    time.sleep(self.gap)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_link_that_trickles_bytes_is_cut_at_its_round_trip_budget(redis_server):
    """Each socket read got bytes inside the timeout, so a 64 KiB value at 10 KiB/s took
    6 s (a promotion's Lookups said "pending" all along, the breaker never heard of it).
    A round trip now ends within the timeout plus its bytes at MIN_BYTES_PER_S."""
    ns, blocks = _ns(), [TierBlock(b"big", 0, np.full(64 << 10, 7, np.uint8))]
    with closing(RedisTier(redis_server.url)) as direct:
        assert direct.put(ns, blocks) == 1
    proxy = _TricklingProxy(redis_server.port)
    try:
        with closing(RedisTier(f"redis://127.0.0.1:{proxy.port}", timeout_ms=300)) as t:
            assert t.contains(ns, [b"big"]) == 1  # small replies pass
            t0 = time.monotonic()
            with pytest.raises(TierError, match="slow link"):
                t.get_into(ns, [b"big"], [np.zeros(64 << 10, np.uint8)])
            assert time.monotonic() - t0 < 3.0
            assert t.status()["errors"] == 1  # the breaker heard of it
    finally:
        proxy.close()


def test_a_value_of_another_type_is_no_block_and_is_forgotten(redis_server):
    """A list under a block's name: EXISTS said yes, so every Lookup promised a run that
    the GET (WRONGTYPE) never brought up, again and again."""
    ns, blocks = _ns(), _blocks(3)
    keys = [b.key for b in blocks]
    r = redis.Redis(port=redis_server.port)
    with closing(RedisTier(redis_server.url)) as t, closing(r):
        assert t.put(ns, blocks) == 3
        r.delete(_key(ns, keys[1]))
        r.rpush(_key(ns, keys[1]), b"x")
        assert t.contains(ns, keys) == 1  # the run ends there, and the value is dropped
        assert not r.exists(_key(ns, keys[1]))
        r.rpush(_key(ns, keys[1]), b"x")  # and a read that meets one
        outs = _outs(3)
        assert t.get_into(ns, keys, outs) == 1
        assert (outs[1] == SENTINEL).all() and not r.exists(_key(ns, keys[1]))
        st = t.status()
        assert st["corrupt_blocks"] == 2 and st["errors"] == 0


def test_writes_the_cluster_refuses_are_counted_and_named(redis_server):
    """A full server (maxmemory, noeviction) answers each SET with OOM: nothing failed
    as a call, so the breaker stays closed, but the operator sees why nothing is kept."""
    r = redis.Redis(port=redis_server.port)
    with closing(RedisTier(redis_server.url)) as t, closing(r):
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + (64 << 10))
        r.config_set("maxmemory-policy", "noeviction")
        kept = t.put(_ns(), _blocks(64))
        st = t.status()
        assert kept < 64 and st["written_blocks"] == kept
        assert st["rejected_blocks"] == 64 - kept and "maxmemory" in st["last_error"]
        assert st["errors"] == 0 and st["state"] == "closed"


def test_a_put_that_fails_midway_keeps_what_was_written(redis_server, monkeypatch):
    """The server stops answering after the first batch: the caller hears of the block
    written (the tier counted it), not of an error that says nothing was kept."""
    t = RedisTier(redis_server.url, timeout_ms=200, max_batch=1)
    real, pid = t._call, redis_server.node.proc.pid

    def stop_after_one(what, cmds, nbytes=0):
        if t.written_blocks:
            os.kill(pid, signal.SIGSTOP)
        return real(what, cmds, nbytes)

    monkeypatch.setattr(t, "_call", stop_after_one)
    try:
        assert t.put(_ns(), _blocks(4)) == 1
        assert t.status()["written_blocks"] == 1 and t.status()["errors"] == 1
    finally:
        os.kill(pid, signal.SIGCONT)
        t.close()


def test_one_threads_failure_does_not_break_another_threads_call(redis_server):
    """A failure dropped the client by closing it, under another thread's call: that
    call failed with ``ValueError`` (a closed file), which the breaker never counted."""
    t = RedisTier(redis_server.url, timeout_ms=500)
    ns = _ns()
    assert t.put(ns, _blocks(1)) == 1
    pid = redis_server.node.proc.pid
    errors: dict[str, BaseException] = {}

    def run(tag: str, call: Callable[[], object], delay: float) -> None:
        time.sleep(delay)
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - what it raised is the test
            errors[tag] = e

    threads = [threading.Thread(target=run, args=("reader", lambda: t.contains(ns, [b"k0"]), 0)),
               threading.Thread(target=run, args=("writer", lambda: t.put(ns, _blocks(1, 1)),
                                                  0.2))]
    os.kill(pid, signal.SIGSTOP)
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert set(errors) == {"reader", "writer"}
    assert all(isinstance(e, TierError) for e in errors.values()), errors
    assert t.status()["errors"] == 2
    t.close()


def test_tier_up_is_0_while_the_cluster_is_down_even_when_idle():
    """``kvd_tier_up`` read 1 once the breaker's cooldown had passed (``half_open``) and
    while the first connect was failing, with nothing having succeeded."""
    from kvd.metrics import StatusCollector
    from tests.redis_servers import free_ports

    def up(tier: RedisTier) -> float:
        fam = next(f for f in StatusCollector._tiers({"remote": tier.status()})
                   if f.name == "kvd_tier_up")
        return fam.samples[0].value

    (port,) = free_ports(1, bus=False)
    now = [0.0]
    with closing(RedisTier(f"redis://127.0.0.1:{port}", timeout_ms=100,
                           clock=lambda: now[0])) as t:
        assert up(t) == 1  # nothing tried yet
        with pytest.raises(TierError):
            t.connect()
        assert t.status()["state"] == "unconnected" and up(t) == 0
        for _ in range(2):
            with pytest.raises(TierError):
                t.connect()
        now[0] += 60  # idle past the cooldown: half open, still down
        assert t.status()["state"] == "half_open" and up(t) == 0


def test_the_round_trip_watchdog_never_cuts_a_connection_another_call_took(
        redis_server, monkeypatch):
    """The watchdog judged the connection "given back" by the pipeline's reference, which
    redis-py clears only after releasing the connection to the pool: a timer firing in
    between shut down the socket of the next call that took it (here: a thread switch
    right after the release, longer than the round trip's budget)."""
    t = RedisTier(redis_server.url, timeout_ms=300)
    t.connect()
    client = t._connected()
    pool = client.connection_pool
    real_release = type(pool).release
    go, widen = threading.Event(), {"on": False}

    def release(self, conn):
        real_release(self, conn)
        if widen["on"] and threading.current_thread().name == "tier-call":
            widen["on"] = False
            go.set()
            time.sleep(0.6)  # past the watchdog's deadline, the connection in the pool

    monkeypatch.setattr(type(pool), "release", release)
    errors: list[Exception] = []

    def other_call() -> None:
        go.wait(5)
        try:  # takes the connection; ends by its own socket timeout, unless cut first
            client.execute_command("BLPOP", "kvd:nothing", 1)
        except redis.exceptions.ConnectionError as e:  # shut down under it
            errors.append(e)
        except redis.exceptions.TimeoutError:
            pass

    other = threading.Thread(target=other_call)
    other.start()
    widen["on"] = True
    call = threading.Thread(target=lambda: t.contains(b"ns", [b"k"]), name="tier-call")
    call.start()
    call.join()
    other.join()
    t.close()
    assert go.is_set() and not errors, errors


def test_round_trips_share_one_deadline_thread(redis_server, monkeypatch):
    """Each round trip started a timer thread for its watchdog; one thread serves them
    all now, and still cuts a round trip that overruns (the trickling link's test)."""
    ns, blocks = _ns(), _blocks(4)
    with closing(RedisTier(redis_server.url)) as t:
        assert t.put(ns, blocks) == 4  # the deadline thread exists from here on
        started: list[str] = []
        real_start = threading.Thread.start

        def counting(self):
            started.append(self.name)
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", counting)
        for _ in range(50):
            assert t.get_into(ns, [b.key for b in blocks], _outs(4)) == 4
        assert started == []
        assert [th.name for th in threading.enumerate()].count("kvd-remote-deadlines") == 1


def test_a_per_key_error_that_is_not_wrongtype_is_a_miss_not_a_forgetting(redis_server):
    """Only a value of another type is no block. Any other error of one key (a failed
    redirect, TRYAGAIN; here an ACL that denies the reads) says nothing about the
    value: before, the probe and the read deleted it."""
    ns, blocks = _ns(), _blocks(2)
    keys = [b.key for b in blocks]
    r = redis.Redis(port=redis_server.port)
    with closing(r), closing(RedisTier(redis_server.url)) as t:
        assert t.put(ns, blocks) == 2
        r.execute_command("ACL", "SETUSER", "default", "-strlen", "-get")  # (this server's)
        assert t.contains(ns, keys) == 0
        assert t.get_into(ns, keys, _outs(2)) == 0
        assert r.exists(*[_key(ns, k) for k in keys]) == 2  # both still there
        r.execute_command("ACL", "SETUSER", "default", "+@all")
        assert t.contains(ns, keys, SIZE) == 2


@pytest.fixture
def own_cluster(tmp_path):
    """Three masters for one test, which changes its topology for good."""
    from tests.conftest import _need_redis
    from tests.redis_servers import RedisCluster

    _need_redis()
    cluster = RedisCluster(tmp_path / "redis-own")
    try:
        yield cluster
    finally:
        cluster.close()


def _one_slot_keys(raw: redis.RedisCluster, ns: bytes, n: int) -> tuple[int, list[bytes]]:
    """``n`` keys whose names share one hash slot, and the slot."""
    keys: list[bytes] = []
    slot = raw.keyslot(_key(ns, b"s0"))
    i = 0
    while len(keys) < n:
        k = f"s{i}".encode()
        if raw.keyslot(_key(ns, k)) == slot:
            keys.append(k)
        i += 1
    return slot, keys


def test_a_slot_migrating_to_a_node_the_tier_never_met_is_followed(own_cluster):
    """A node added to the cluster, a slot migrating to it (ASK redirects): each read
    and write reached it through redis-py's own redirect handling, which raised
    AttributeError on a node it had not met (every such call failed whole, with an
    ERROR traceback per tier job); and once it hung, each key redirected to it cost a
    socket timeout, one after another, unseen by its breaker."""
    cluster = own_cluster
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    t = RedisTier(cluster.url, timeout_ms=200, breaker_failures=3, breaker_cooldown_s=600)
    try:
        ns = _ns()
        slot, keys = _one_slot_keys(raw, ns, 16)
        rng = np.random.default_rng(3)
        blocks = [TierBlock(k, i, rng.integers(0, 256, SIZE, np.uint8))
                  for i, k in enumerate(keys)]
        assert t.put(ns, blocks[:12]) == 12  # the tier's slot map: three masters
        src = cluster.nodes[cluster.ports.index(raw.get_node_from_key(_key(ns, keys[0])).port)]
        new = cluster.add_node()
        new.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", src.cli("CLUSTER", "MYID"))
        src.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", new.cli("CLUSTER", "MYID"))
        src.cli("MIGRATE", "127.0.0.1", str(new.port), "", "0", "5000", "KEYS",
                *[_key(ns, k).decode() for k in keys[4:12]])
        outs = _outs(12)
        assert t.get_into(ns, keys[:12], outs) == 12
        assert all(np.array_equal(o, b.data) for o, b in zip(outs, blocks))
        assert t.contains(ns, keys[:12]) == 12
        assert t.put(ns, blocks[12:]) == 4  # new keys of the slot: the new node's
        assert new.cli("DBSIZE") == "12"
        st = t.status()
        assert (st["state"], st["errors"], st["masters_down"]) == ("closed", 0, [])
        os.kill(new.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            for call in range(4):
                t0 = time.monotonic()
                assert t.get_into(ns, keys[:12], _outs(12)) == 4  # up to the redirects
                assert time.monotonic() - t0 < 1.0  # one budget (8 keys cost 8 timeouts)
            st = t.status()
            assert st["masters_down"] == [f"127.0.0.1:{new.port}"] and st["errors"] == 3
            assert st["state"] == "closed"  # the other masters answered
        finally:
            os.kill(new.proc.pid, signal.SIGCONT)
    finally:
        t.close()
        raw.close()


def test_a_master_lost_for_good_leaves_the_others_serving(own_cluster):
    """Full coverage off, a master lost with its slots and forgotten by the others: the
    cluster serves the rest, and so must kvd. redis-py's cluster client refused a slot
    map with holes: the tier failed every call (its breaker open for good, for the
    keys of the live masters too), and a daemon started then never connected."""
    cluster = own_cluster
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    ns, blocks = _ns(), _blocks(64)
    keys = [b.key for b in blocks]
    t = RedisTier(cluster.url, timeout_ms=200, breaker_failures=3, breaker_cooldown_s=0.5)
    try:
        assert t.put(ns, blocks) == 64
        lost, first = _later_master(raw, cluster, ns, keys)
        on_lost = {k for k in keys
                   if raw.get_node_from_key(_key(ns, k)).port == lost.port}
        gone = lost.cli("CLUSTER", "MYID")
        live = [n for n in cluster.nodes if n is not lost]
        for n in cluster.nodes:
            n.cli("CONFIG", "SET", "cluster-require-full-coverage", "no")
        lost.stop()
        for n in live:
            n.cli("CLUSTER", "FORGET", gone)
        assert wait_for(lambda: all("cluster_state:ok" in n.cli("CLUSTER", "INFO")
                                    for n in live), 30)
        served = [b for b in blocks if b.key not in on_lost]
        for tier in (t, RedisTier(cluster.url, timeout_ms=200)):  # (a restarted daemon)
            for _ in range(5):  # calls touching the lost slots, and again past cooldowns
                assert tier.contains(ns, keys) == first
                outs = _outs(len(served))
                assert tier.get_into(ns, [b.key for b in served], outs) == len(served)
                assert all(np.array_equal(o, b.data) for o, b in zip(outs, served))
                assert tier.status()["state"] == "closed"
                time.sleep(0.2)
            fresh = _blocks(16, seed=2, prefix="n")  # its slots' puts declined, the rest kept
            kept = [b for b in fresh
                    if raw.get_node_from_key(_key(ns, b.key)).port != lost.port]
            assert 0 < len(kept) < 16 and tier.put(ns, fresh) == len(kept)
            assert tier.contains(ns, [b.key for b in kept]) == len(kept)
            tier.close()
    finally:
        raw.close()


def test_a_master_replaced_while_the_cluster_was_down_is_not_down_for_good(
        redis_cluster_with_replicas):
    """Calls all through a failover: in the seconds before the replica is promoted the
    whole cluster answers CLUSTERDOWN, the tier drops its client and makes a new one on
    the new topology, which never calls the dead master again: it stayed in
    ``masters_down`` (and the gauge at 1) for good."""
    cluster = redis_cluster_with_replicas
    t, ns, blocks = _replicated_tier(cluster, breaker_cooldown_s=0.3)
    keys = [b.key for b in blocks]
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        dead, _ = _later_master(raw, cluster, ns, keys)
    finally:
        raw.close()
    first = t._client
    dead.stop()
    live = [n for n in cluster.nodes if n is not dead]

    def failed_over() -> bool:
        with contextlib.suppress(TierError, BreakerOpen):
            t.contains(ns, keys)
        return (all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in live)
                and sum("role:master" in n.cli("INFO", "replication") for n in live) == 3)

    def all_served() -> bool:
        with contextlib.suppress(TierError, BreakerOpen):
            return t.contains(ns, keys) == 64
        return False

    assert wait_for(failed_over, 30)
    assert wait_for(all_served, 10)
    assert t.status()["masters_down"] == [] and t.status()["state"] == "closed"
    assert t._client is not first  # (the case: a new client was made meanwhile)
    t.close()
