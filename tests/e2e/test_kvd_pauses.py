"""The daemon paused again and again (SIGSTOP, 0.2-2 s, longer than the connector's
400 ms transfer deadline, and once longer than call_timeout_ms) under a real vLLM
engine whose small KV cache reuses freed blocks at once: every output equals vLLM's
without kvd, the daemon stays healthy, and a fresh engine loads what kvd kept.

A short run of ``scripts/chaos_pause.py`` (run it with ``--rounds 50`` for the long one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import chaos_pause  # noqa: E402

pytestmark = pytest.mark.e2e


def test_pauses_never_change_an_output(tiny_model):
    out = chaos_pause.run(rounds=5, prompts=4, seed=1, model=tiny_model, long_every=2)
    assert out["long_pauses"] >= 1 and out["pauses"] >= 3, out
    assert out["differing_outputs"] == 0 and out["outputs"] == 20, out
    assert out["fresh_differing_outputs"] == 0 and out["daemon_healthy"], out
    assert out["loaded_blocks_fresh"] > 0, out  # the engine reconnected; kvd kept its stores
