"""kvd failing under a real vLLM engine: the engine keeps serving identical tokens.

4: the daemon is killed while the engine serves, then restarted: no request fails, and
   hits resume once the connector has reconnected and re-registered by itself.
6: a load that fails inside the daemon (a corrupted slot caught by its checksum), and
   a load whose bytes are garbled (a test-only spec, _garbling.py): vLLM recomputes,
   tokens identical;
   a Lookup that is never answered (daemon stopped): served after the deadline.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _model import long_prompt
from conftest import kvd_transfer_config, wait_for

pytestmark = pytest.mark.e2e

PROMPT = long_prompt(800)
GEN = {"op": "generate", "prompt": PROMPT, "max_tokens": 16}
RESET = {"op": "reset_prefix_cache"}
FULL_BLOCK_TOKENS = 896  # 7 full blocks of 128 tokens


@pytest.fixture(scope="module")
def expected(tiny_model, run_engine) -> list[int]:
    return run_engine({"model": str(tiny_model), "steps": [GEN]}).generations[0]["token_ids"]


def touch(path) -> dict:
    return {"op": "touch", "path": str(path)}


def wait_file(path) -> dict:
    return {"op": "wait_file", "path": str(path)}


def wait_registered(daemon, clients: int = 2, timeout: float = 30) -> None:
    """Until the engine's scheduler and worker connections re-registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(c["tenant"] is not None for c in daemon.status()["clients"]) >= clients:
            return
        time.sleep(0.1)
    raise AssertionError("the engine did not re-register with the restarted daemon")


def test_daemon_killed_and_restarted_while_serving(tiny_model, expected, daemon,
                                                   start_engine, tmp_path):
    stored, down, back = tmp_path / "stored", tmp_path / "down", tmp_path / "back"
    engine = start_engine({
        "model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(daemon.socket),
        "steps": [GEN, touch(stored),
                  RESET, GEN, RESET, GEN,  # the daemon is killed during these
                  touch(down), wait_file(back),
                  RESET, GEN,  # stores into the restarted daemon
                  RESET, GEN]})  # and loads from it
    wait_for(stored, engine)
    daemon.kill()
    wait_for(down, engine)
    daemon.start()
    wait_registered(daemon)
    back.touch()
    run = engine.wait()
    gens = run.generations
    assert [g["finish_reason"] for g in gens] == ["length"] * len(gens)
    assert all(g["token_ids"] == expected for g in gens), [g["token_ids"] for g in gens]
    assert gens[-1]["num_cached_tokens"] == FULL_BLOCK_TOKENS  # hits resumed
    assert daemon.status()["counters"]["loaded_blocks"] > 0


def test_corrupt_slot_is_recomputed(tiny_model, expected, daemon_factory, start_engine,
                                    tmp_path):
    """A slot whose bytes no longer match their checksum fails its load in the daemon."""
    daemon = daemon_factory(env={"KVD_VERIFY_ON_LOAD": "1"})
    stored, corrupted = tmp_path / "stored", tmp_path / "corrupted"
    engine = start_engine({
        "model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(daemon.socket),
        "steps": [GEN, touch(stored), wait_file(corrupted), RESET, GEN, RESET, GEN]})
    wait_for(stored, engine)
    # The engine's generate returns before the daemon copied its last blocks.
    daemon.wait_counter("stored_blocks", FULL_BLOCK_TOKENS // 128)
    size = os.path.getsize(daemon.pool_path)
    with open(daemon.pool_path, "r+b") as f:  # the daemon maps it shared: it sees this
        for off in range(0, size, 1 << 20):
            f.seek(off)
            f.write(os.urandom(1 << 20))
    corrupted.touch()
    gens = engine.wait().generations
    assert all(g["token_ids"] == expected for g in gens), [g["token_ids"] for g in gens]
    assert all(g["finish_reason"] == "length" for g in gens)
    counters = daemon.status()["counters"]
    assert counters["corrupt_blocks"] > 0 and counters["failed_transfers"] > 0


GARBLING = {"spec_name": "GarblingSpec", "spec_module_path": "_garbling"}


def test_failed_load_is_recomputed_not_used(tiny_model, expected, daemon, run_engine):
    """A test-only spec: every load's blocks are overwritten with garbage and reported as
    failed. Identical tokens prove vLLM recomputed them instead of using them, and the
    request is not retried forever (it loads from kvd at most once)."""
    ktc = kvd_transfer_config(daemon.socket, **GARBLING)
    gens = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                       "steps": [GEN, RESET, GEN, RESET, GEN]}).generations
    assert all(g["token_ids"] == expected for g in gens), [g["token_ids"] for g in gens]
    assert all(g["finish_reason"] == "length" for g in gens)
    assert daemon.status()["counters"]["loaded_blocks"] >= 7  # the loads really happened


def test_what_a_failed_load_fed_is_never_stored(tiny_model, daemon, run_engine):
    """A request that loads 7 blocks and computes 2 more in the same step (a synchronous
    load): the load fails (garbled), so those 2 were computed on garbage and vLLM
    recomputes them. kvd must get only the recomputed ones: an engine that loads all 9
    afterwards answers as an engine without kvd."""
    longer = {**GEN, "prompt": PROMPT + " " + long_prompt(300, variant=1)}
    plain = run_engine({"model": str(tiny_model), "steps": [longer]}).generations[0]
    garbling = kvd_transfer_config(daemon.socket, **GARBLING)
    gens = run_engine({"model": str(tiny_model), "kv_transfer_config": garbling,
                       "steps": [GEN, RESET, longer, longer]}).generations
    assert [g["token_ids"] for g in gens[1:]] == [plain["token_ids"]] * 2
    (loaded,) = run_engine({"model": str(tiny_model),
                            "kv_transfer_config": kvd_transfer_config(daemon.socket),
                            "steps": [longer]}).generations
    assert loaded["num_cached_tokens"] >= FULL_BLOCK_TOKENS + 2 * 128
    assert loaded["token_ids"] == plain["token_ids"]


def test_failed_load_is_recomputed_on_the_standard_path(tiny_model, expected, daemon,
                                                        run_engine):
    """Loaded as a plain OffloadingConnector spec, failed loads still reach vLLM."""
    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {**GARBLING, "socket": daemon.socket}}
    gens = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                       "steps": [GEN, RESET, GEN]}).generations
    assert all(g["token_ids"] == expected for g in gens), [g["token_ids"] for g in gens]
    assert daemon.status()["counters"]["loaded_blocks"] >= 7


def test_unanswered_lookup_becomes_a_miss(tiny_model, expected, daemon, start_engine,
                                          tmp_path):
    """The daemon is stopped (SIGSTOP): the Lookup is never answered; the request is
    served after the connector's deadline instead of being parked forever."""
    stored, served = tmp_path / "stored", tmp_path / "served"
    engine = start_engine({
        "model": str(tiny_model),
        "kv_transfer_config": kvd_transfer_config(daemon.socket, lookup_timeout_ms=300),
        "steps": [GEN, touch(stored), wait_file(tmp_path / "stopped"), RESET, GEN,
                  touch(served)]})
    wait_for(stored, engine)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        (tmp_path / "stopped").touch()
        wait_for(served, engine, timeout=60)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    run = engine.wait()
    _, stalled = run.generations
    assert stalled["token_ids"] == expected
    assert stalled["num_cached_tokens"] == 0
    assert stalled["elapsed_s"] < 10
    assert "deadline" in run.stdout + run.stderr


def test_daemon_absent_at_start_then_started(tiny_model, expected, daemon_factory,
                                             start_engine, tmp_path):
    """The engine starts before kvd: it serves without it, connects and registers by
    itself once the daemon is up, then stores and loads. With xxhash block hashes and no
    PYTHONHASHSEED the connector warns that hits stay within this engine run."""
    daemon = daemon_factory(start=False)
    served, back = tmp_path / "served", tmp_path / "back"
    engine = start_engine({
        "model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(daemon.socket),
        "llm": {"prefix_caching_hash_algo": "xxhash"},
        "steps": [GEN, touch(served), wait_file(back),
                  RESET, GEN,  # recomputed and stored into the daemon that came up
                  RESET, GEN]})  # loaded from it
    wait_for(served, engine)
    daemon.start()
    wait_registered(daemon)
    back.touch()
    run = engine.wait()
    cold, stored, loaded = run.generations
    assert [g["token_ids"] for g in run.generations] == [expected] * 3
    assert cold["num_cached_tokens"] == stored["num_cached_tokens"] == 0
    assert loaded["num_cached_tokens"] == FULL_BLOCK_TOKENS
    assert daemon.status()["counters"]["loaded_blocks"] == FULL_BLOCK_TOKENS // 128
    if "PYTHONHASHSEED" not in os.environ:  # the engine inherits the test's environment
        assert "will not survive restarts" in run.stdout + run.stderr
