"""The tiers with real vLLM engines: blocks an engine stored come back from disk after
the daemon was killed and its RAM pool removed, and from a Redis cluster on another
"node" (a second daemon with its own socket, pool and disk); a cluster that stops or
holds a corrupt value never stops an engine or changes a token."""

from __future__ import annotations

import os

import pytest
from _model import long_prompt
from conftest import kvd_transfer_config, wait_for

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128
# A request waits for promoted blocks up to this long (the default, 1 s, is plenty for a
# few blocks, but these engines share two cores with the daemons and the cluster).
PATIENT = {"pending_wait_ms": 10_000}
PROMPTS = [long_prompt(800, variant=v) for v in range(8)]  # ~7 full blocks each


def gen(prompt: str) -> dict:
    return {"op": "generate", "prompt": prompt, "max_tokens": 12}


def full_blocks(g: dict) -> int:
    return g["prompt_len"] // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.fixture(scope="module")
def plain(tiny_model, run_engine) -> list[dict]:
    """The plain engine's answers (no connector), one per prompt."""
    return run_engine({"model": str(tiny_model),
                       "steps": [gen(p) for p in PROMPTS]}).generations



def test_disk_tier_serves_after_kill9_and_the_pool_removed(tiny_model, plain, run_engine,
                                                            daemon_factory, tmp_path):
    d = daemon_factory("--pool-size", "2M", "--extent-size", "1M",
                       "--disk-path", str(tmp_path / "disk"), "--disk-size", "64M")
    base = {"model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(d.socket, **PATIENT)}
    run_engine({**base, "steps": [gen(p) for p in PROMPTS]})  # more than the pool holds
    st = d.wait_counter("demoted_blocks", 1)
    assert st["counters"]["evicted_blocks"] > 0, "the pool held every block: no test"
    demoted = st["counters"]["demoted_blocks"]
    assert demoted == st["counters"]["evicted_blocks"]

    d.kill()
    os.unlink(d.pool_path)
    d.start()
    # Whatever the policy evicted is on disk, the rest was in RAM only and is gone: each
    # prompt comes back as far as the leading run of its blocks went down.
    again = run_engine({**base, "steps": [gen(p) for p in PROMPTS]}).generations
    assert [g["token_ids"] for g in again] == [g["token_ids"] for g in plain]
    cached = [g["num_cached_tokens"] for g in again]
    print("cached tokens per prompt after the restart:", cached)
    st = d.status()
    promoted = st["counters"]["disk_hit_blocks"]
    assert promoted > 0 and st["counters"]["promote_failed"] == 0
    assert sum(cached) == promoted * BLOCK_TOKENS  # every block promoted was loaded
    assert st["counters"]["loaded_blocks"] == promoted


def test_two_nodes_share_through_the_cluster_and_outlive_it(tiny_model, plain, start_engine,
                                                            daemon_factory, redis_cluster,
                                                            tmp_path):
    import redis

    from kvd.tiers.base import HEADER_BYTES, BlockHeader

    # Lookups wait for the cluster up to just under the connector's own Lookup timeout
    # (300 ms): on two busy cores a probe can take longer than the default 20 ms, and
    # this test counts every block node B loads.
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("remote_lookup_ms = 250\n")
    a = daemon_factory("--config", str(cfg), "--remote", redis_cluster.url)
    b = daemon_factory("--config", str(cfg), "--remote", redis_cluster.url)
    s0, go1, s1 = tmp_path / "s0", tmp_path / "go1", tmp_path / "s1"
    b_done, stopped = tmp_path / "b-done", tmp_path / "stopped"
    node_a = start_engine({"model": str(tiny_model),
                           "kv_transfer_config": kvd_transfer_config(a.socket, **PATIENT),
                           "steps": [gen(PROMPTS[0]), {"op": "touch", "path": str(s0)},
                                     {"op": "wait_file", "path": str(go1)},
                                     gen(PROMPTS[1]), {"op": "touch", "path": str(s1)},
                                     {"op": "wait_file", "path": str(stopped)},
                                     gen(PROMPTS[2]), gen(PROMPTS[0])]})
    n0, n1 = (full_blocks(plain[i]) // BLOCK_TOKENS for i in (0, 1))
    client = redis.RedisCluster.from_url(redis_cluster.url.split(",")[0])
    try:
        wait_for(s0, node_a)
        st = a.wait_counter("written_behind_blocks", n0)
        pattern = b"kvd:" + st["tenants"][0]["digest"].encode() + b":*"
        first = set(client.keys(pattern, target_nodes=redis.RedisCluster.ALL_NODES))
        assert len(first) == n0
        go1.touch()
        wait_for(s1, node_a)
        a.wait_counter("written_behind_blocks", n0 + n1)
        second = set(client.keys(pattern, target_nodes=redis.RedisCluster.ALL_NODES)) - first
        assert len(second) == n1
        # Corrupt the second prompt's 3rd block (depth 2) where the cluster keeps it.
        (victim,) = [k for k in second
                     if BlockHeader.unpack(client.getrange(k, 0, HEADER_BYTES - 1)).depth == 2]
        byte = client.getrange(victim, 1000, 1000)
        client.setrange(victim, 1000, bytes([byte[0] ^ 0xFF]))
    finally:
        client.close()

    node_b = start_engine({"model": str(tiny_model),
                           "kv_transfer_config": kvd_transfer_config(b.socket, **PATIENT),
                           "steps": [gen(PROMPTS[0]), gen(PROMPTS[1]),
                                     {"op": "touch", "path": str(b_done)},
                                     {"op": "wait_file", "path": str(stopped)},
                                     gen(PROMPTS[3]), gen(PROMPTS[1])]})
    wait_for(b_done, node_b)
    redis_cluster.stop()  # mid-run: both engines have more to do
    try:
        stopped.touch()
        run_a, run_b = node_a.wait(), node_b.wait()
        st_a, st_b = a.status(), b.status()
    finally:
        redis_cluster.start()
    a0, a1, a2, a0_again = run_a.generations
    b0, b1, b3, b1_again = run_b.generations
    for got, want in ((a0, 0), (a1, 1), (a2, 2), (a0_again, 0), (b0, 0), (b1, 1), (b3, 3),
                      (b1_again, 1)):
        assert got["token_ids"] == plain[want]["token_ids"]
    # Node B loaded the first prompt from the cluster, and of the second only the two
    # blocks before the corrupt one; the corrupt one was never served.
    assert b0["num_cached_tokens"] == full_blocks(plain[0])
    assert b1["num_cached_tokens"] == 2 * BLOCK_TOKENS
    assert st_b["tiers"]["remote"]["corrupt_blocks"] == 1
    assert st_b["counters"]["remote_hit_blocks"] == n0 + 2
    # With the cluster down, both kept serving from RAM (the repeats hit there).
    assert a0_again["num_cached_tokens"] == full_blocks(plain[0])
    assert b1_again["num_cached_tokens"] >= 2 * BLOCK_TOKENS
    assert st_a["counters"]["tier_errors"] + st_b["counters"]["tier_errors"] > 0
