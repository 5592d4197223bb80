"""kvd with a real vLLM engine: stores, loads, restarts, two engines, both engine modes.

Every load is checked against a run without kvd: the greedy tokens of single-request
runs must be identical, and vLLM must report the loaded prefix (num_cached_tokens).
"""

from __future__ import annotations

import shutil
import time

import pytest
from _model import long_prompt
from conftest import kvd_transfer_config

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128
PROMPT = long_prompt(800)  # ~1000 tokens: 7 full blocks
GEN = {"op": "generate", "prompt": PROMPT, "max_tokens": 16}


@pytest.fixture(scope="module")
def expected(tiny_model, run_engine) -> dict:
    """The plain engine's answer (no connector)."""
    return run_engine({"model": str(tiny_model), "steps": [GEN]}).generations[0]


def full_blocks(gen: dict) -> int:
    return gen["prompt_len"] // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "multiprocess"])
def test_store_reset_load_restart_and_second_engine(multiprocessing, tiny_model, expected,
                                                      daemon, start_engine, run_engine,
                                                      tmp_path):
    """1: store, reset vLLM's cache, load (same engine). 3: a second engine running beside
    the first loads what the first stored. 2: a new engine process hits at once."""
    ktc = kvd_transfer_config(daemon.socket)
    stored, second_done = tmp_path / "stored", tmp_path / "second-done"
    base = {"model": str(tiny_model), "kv_transfer_config": ktc,
            "multiprocessing": multiprocessing}
    first = start_engine({**base, "steps": [
        GEN, {"op": "touch", "path": str(stored)},
        {"op": "wait_file", "path": str(second_done)},
        {"op": "reset_prefix_cache"}, GEN]})
    second = start_engine({**base, "steps": [
        {"op": "wait_file", "path": str(stored)}, GEN,
        {"op": "touch", "path": str(second_done)}]})
    a, b = first.wait(), second.wait()
    a_cold, a_loaded = a.generations
    (b_loaded,) = b.generations
    assert a_cold["num_cached_tokens"] == 0
    for gen in (a_cold, a_loaded, b_loaded):
        assert gen["token_ids"] == expected["token_ids"]
        assert gen["finish_reason"] == "length"
    assert a_loaded["num_cached_tokens"] == full_blocks(expected), a.kvd_log()  # loaded
    assert b_loaded["num_cached_tokens"] == full_blocks(expected), b.kvd_log()
    status = daemon.status()
    assert status["counters"]["loaded_blocks"] >= 2 * full_blocks(expected) // BLOCK_TOKENS

    # A restart: a new engine process, whose very first request hits kvd.
    (restarted,) = run_engine({**base, "steps": [GEN]}).generations
    assert restarted["num_cached_tokens"] == full_blocks(expected)
    assert restarted["token_ids"] == expected["token_ids"]
    # Both engines were one tenant.
    assert len(daemon.status()["tenants"]) == 1


def test_other_model_gets_no_hits(tiny_model, other_model, daemon, run_engine):
    """5: blocks of one model are never served to another (a different fingerprint)."""
    ktc = kvd_transfer_config(daemon.socket)
    run_engine({"model": str(tiny_model), "kv_transfer_config": ktc, "steps": [GEN]})
    plain = run_engine({"model": str(other_model), "steps": [GEN]}).generations[0]
    hits_before = daemon.status()["counters"]["hit_blocks"]
    (other,) = run_engine({"model": str(other_model), "kv_transfer_config": ktc,
                           "steps": [GEN]}).generations
    assert other["num_cached_tokens"] == 0
    assert other["token_ids"] == plain["token_ids"]
    status = daemon.status()
    assert status["counters"]["hit_blocks"] == hits_before
    assert len(status["tenants"]) == 2


def test_new_weights_at_the_same_path_get_no_hits(tiny_model, other_model, daemon,
                                                   run_engine, tmp_path):
    """A model updated in place (other weights at the same path, e.g. a new revision
    copied over the old one) is another tenant: its first run after the update never
    loads the old weights' KV."""
    served = tmp_path / "served-model"
    shutil.copytree(tiny_model, served)
    ktc = kvd_transfer_config(daemon.socket)
    run_engine({"model": str(served), "kv_transfer_config": ktc, "steps": [GEN]})
    shutil.rmtree(served)
    shutil.copytree(other_model, served)  # the update
    plain = run_engine({"model": str(other_model), "steps": [GEN]}).generations[0]
    hits_before = daemon.status()["counters"]["hit_blocks"]
    (updated,) = run_engine({"model": str(served), "kv_transfer_config": ktc,
                             "steps": [GEN]}).generations
    assert updated["num_cached_tokens"] == 0
    assert updated["token_ids"] == plain["token_ids"]
    assert daemon.status()["counters"]["hit_blocks"] == hits_before
    assert len(daemon.status()["tenants"]) == 2


def test_standard_offloading_connector_path(tiny_model, expected, daemon, run_engine):
    """The spec loads the standard way too: vLLM's OffloadingConnector + spec_name."""
    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"spec_name": "KvdOffloadingSpec",
                                         "spec_module_path": "kvd_client.vllm",
                                         "socket": daemon.socket}}
    cold, loaded = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                               "steps": [GEN, {"op": "reset_prefix_cache"}, GEN]}).generations
    assert loaded["num_cached_tokens"] == full_blocks(expected)
    assert cold["token_ids"] == loaded["token_ids"] == expected["token_ids"]


def test_a_layout_kvd_refuses_leaves_the_engine_serving(tiny_model, expected, daemon,
                                                       run_engine):
    """Two engine blocks per offloaded key (never stored; pipeline or prefill context
    parallel and hybrid models are refused the same way): kvd turns itself off for the
    engine, which serves as without it, instead of failing to start."""
    ktc = kvd_transfer_config(daemon.socket, block_size=2 * BLOCK_TOKENS)
    run = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                      "steps": [GEN, {"op": "reset_prefix_cache"}, GEN]})
    for gen in run.generations:
        assert gen["token_ids"] == expected["token_ids"]
        assert gen["num_cached_tokens"] == 0
    assert "kvd is off for this engine" in run.log_tail(400)
    assert daemon.status()["tenants"] == []


def test_a_hit_computes_in_the_step_that_loads_it(tiny_model, expected, daemon, run_engine):
    """vLLM on CPU: kvd loads a hit before the forward pass of the step that computes the
    request (vLLM's async loads make it wait for steps). Control: with ``sync_loads`` off
    the same load costs the request extra steps, so the count tells the two apart."""
    reset = {"op": "reset_prefix_cache"}
    # Also a request that loads the 7 blocks and computes 2 more full blocks in the same
    # step: vLLM stores those while the load's job is still open.
    longer = {**GEN, "prompt": PROMPT + " " + long_prompt(300, variant=1)}
    plain_longer = run_engine({"model": str(tiny_model), "steps": [longer]}).generations[0]
    runs = {}
    for mode in ("auto", "off"):
        # The first scheduling pass waits for the Lookup's reply (not 2 ms, then RETRY
        # in the next pass), so that passes count loads and nothing else.
        ktc = kvd_transfer_config(daemon.socket, sync_loads=mode, lookup_wait_ms=2000)
        runs[mode] = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                                 "steps": [GEN, reset, GEN, reset, longer]}).generations
    (cold, loaded, extended), (_, loaded_async, _) = runs["auto"], runs["off"]
    for gen in (loaded, loaded_async):
        assert gen["num_cached_tokens"] == full_blocks(expected)
        assert gen["token_ids"] == expected["token_ids"]
    assert extended["num_cached_tokens"] >= full_blocks(expected)
    assert extended["token_ids"] == plain_longer["token_ids"]
    assert extended["prompt_len"] - full_blocks(expected) >= 2 * BLOCK_TOKENS
    assert loaded["steps_to_first_token"] == cold["steps_to_first_token"] == 1, runs
    # Async: the load goes out after its step's forward pass, is reported at the end of
    # a later step, and the request computes in the step after that.
    assert loaded_async["steps_to_first_token"] >= 3, runs


def test_an_engines_last_step_reaches_kvd_before_it_exits(tiny_model, daemon, run_engine):
    """vLLM sends a step's stores at the start of the next step and dropped those of
    the last step at shutdown: an engine restarted in its place recomputed them."""
    prompts = [long_prompt(800, variant=v) for v in range(3)]
    batch = {"op": "generate", "prompts": prompts, "max_tokens": 1}  # one step, the last
    ktc = kvd_transfer_config(daemon.socket)
    (first,) = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                           "steps": [batch]}).generations
    assert daemon.status()["counters"]["failed_stores"] == 0
    (again,) = run_engine({"model": str(tiny_model), "kv_transfer_config": ktc,
                           "steps": [batch]}).generations
    for cold, loaded in zip(first["outputs"], again["outputs"]):
        assert cold["num_cached_tokens"] == 0
        assert loaded["num_cached_tokens"] == full_blocks(loaded)
        assert loaded["token_ids"] == cold["token_ids"]


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "multiprocess"])
def test_an_idle_engines_last_step_reaches_kvd(multiprocessing, tiny_model, daemon_factory,
                                               start_engine, tmp_path):
    """The stores vLLM deferred from an engine's last step go out while it idles: were
    they held until its next request, the daemon would give their slots back after
    ``store_claim_ms`` and they would never be stored. An engine in its own process (as
    ``vllm serve`` runs it) keeps stepping while stores are pending; an in-process one
    steps only inside ``generate``, and the connector submits them itself."""
    daemon = daemon_factory(env={"KVD_STORE_CLAIM_MS": "1000"})
    prompts = [long_prompt(800, variant=v) for v in range(3)]
    idle, checked = tmp_path / "idle", tmp_path / "checked"
    engine = start_engine({
        "model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(daemon.socket),
        "multiprocessing": multiprocessing, "steps": [
            {"op": "generate", "prompts": prompts, "max_tokens": 1},  # one step, the last
            {"op": "sleep", "seconds": 3}, {"op": "touch", "path": str(idle)},
            {"op": "wait_file", "path": str(checked)}]})
    deadline = time.monotonic() + 300
    while not idle.exists():
        assert engine.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    counters = daemon.status()["counters"]  # the engine is alive and has been idle 3 s
    checked.touch()
    (batch,) = engine.wait().generations
    assert counters["stored_blocks"] == sum(
        full_blocks(out) // BLOCK_TOKENS for out in batch["outputs"]) > 0, counters
    assert counters["unclaimed_blocks"] == counters["failed_stores"] == 0, counters
