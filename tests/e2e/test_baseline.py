"""Baseline without kvd: the tiny model on real vLLM is deterministic.

Every kvd end-to-end test compares the tokens of a run that loaded KV blocks from kvd
with those of a run that computed them; that comparison means something only if plain
runs of the same prompt agree token for token. These tests establish it: across
processes, across vLLM's own prefix-cache hit and recompute, and between the in-process
and the multiprocess engine.
"""

from __future__ import annotations

import pytest
from _model import long_prompt

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128  # vLLM's block size on the CPU platform
MAX_TOKENS = 16
PROMPT = long_prompt(800)  # ~1000 tokens: 7 full blocks and a partial one


def _generate(prompt: str = PROMPT) -> dict:
    return {"op": "generate", "prompt": prompt, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def in_process_run(tiny_model, run_engine):
    """One in-process engine: compute, hit vLLM's prefix cache, reset it, recompute."""
    return run_engine(
        {
            "model": str(tiny_model),
            "steps": [
                _generate(),
                _generate(),
                {"op": "reset_prefix_cache"},
                _generate(),
            ],
        }
    )


def test_prompt_spans_several_blocks(in_process_run):
    first = in_process_run.generations[0]
    assert first["prompt_len"] >= 6 * BLOCK_TOKENS, first["prompt_len"]
    assert len(first["token_ids"]) == MAX_TOKENS


def test_prefix_cache_hit_and_recompute_agree(in_process_run):
    cold, hit, recomputed = in_process_run.generations
    full_blocks = cold["prompt_len"] // BLOCK_TOKENS * BLOCK_TOKENS
    assert cold["num_cached_tokens"] == 0
    # The second request reuses every full block of the first one ...
    assert hit["num_cached_tokens"] == full_blocks
    # ... and after reset_prefix_cache nothing is cached any more.
    assert recomputed["num_cached_tokens"] == 0
    assert hit["token_ids"] == cold["token_ids"]
    assert recomputed["token_ids"] == cold["token_ids"]


def test_separate_processes_agree(tiny_model, run_engine, in_process_run):
    again = run_engine({"model": str(tiny_model), "steps": [_generate()]})
    assert again.generations[0]["token_ids"] == in_process_run.generations[0]["token_ids"]


def test_multiprocess_agrees_with_in_process(tiny_model, run_engine, in_process_run):
    mp = run_engine(
        {"model": str(tiny_model), "multiprocessing": True, "steps": [_generate()]}
    )
    assert mp.ready["multiprocessing"] is True
    assert mp.generations[0]["token_ids"] == in_process_run.generations[0]["token_ids"]


def test_other_model_differs(other_model, run_engine, in_process_run):
    """The seed-1 model is really another model: its greedy tokens differ."""
    other = run_engine({"model": str(other_model), "steps": [_generate()]})
    assert other.generations[0]["prompt_len"] == in_process_run.generations[0]["prompt_len"]
    assert other.generations[0]["token_ids"] != in_process_run.generations[0]["token_ids"]
