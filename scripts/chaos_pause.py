"""The daemon paused again and again under a real vLLM engine: no output may change.

A real vLLM (CPU) engine with a tiny KV cache (so blocks freed by a failed transfer are
reused at once) serves several distinct prompts over ``--rounds`` rounds, resetting its
own prefix cache between rounds, so every round stores into kvd and loads from it. Meanwhile
the daemon is stopped with SIGSTOP for random pauses (default 0.2-2 s, longer than the
connector's 400 ms ``transfer_timeout_ms``), now and then for longer than
``call_timeout_ms`` (the client declares the connection lost and reconnects). The last
round runs without pauses (the engine must have reconnected by itself). Then a fresh
engine loads every prompt from what kvd kept. Every output must equal vLLM's
without kvd, the daemon must stay healthy, and the fresh engine must load from kvd.

    python scripts/chaos_pause.py --rounds 50 [--json FILE]

Exit status 0 only when nothing differs. ``run()`` is the scenario (the e2e suite runs a
short one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "scripts"))

from _bench import DaemonProc, finish_engine, start_engine  # noqa: E402
from _model import build_tiny_model, long_prompt  # noqa: E402

ENGINE_BLOCKS = 10  # vLLM's own KV cache, in blocks of 128 tokens: freed blocks are reused
OPTIONS = {"transfer_timeout_ms": 400, "call_timeout_ms": 1000, "lookup_timeout_ms": 300}


def generations(found: list[dict]) -> list[dict]:
    return [r for r in found if r.get("op") == "generate"]


class Pauser(threading.Thread):
    """SIGSTOP / SIGCONT the daemon at random until told to stop; the daemon is never
    left stopped. Every ``long_every``-th pause outlasts ``call_timeout_ms``."""

    def __init__(self, pid: int, rng: random.Random, pause: tuple[float, float],
                 long_pause: float, long_every: int = 5,
                 calm: Callable[[], bool] = lambda: False,
                 then: Callable[[], None] = lambda: None) -> None:
        super().__init__(name="pauser", daemon=True)
        self.pid, self.rng, self.pause = pid, rng, pause
        self.long_pause, self.long_every = long_pause, long_every
        self.calm = calm  # true once pausing should stop (the engine's last round)
        self.then = then  # called once pausing stopped, the daemon running
        self.done = threading.Event()
        self.pauses: list[float] = []

    def run(self) -> None:
        while not self.done.wait(self.rng.uniform(0.1, 1.0)) and not self.calm():
            n = len(self.pauses) + 1
            seconds = (self.long_pause if n % self.long_every == 0
                       else self.rng.uniform(*self.pause))
            os.kill(self.pid, signal.SIGSTOP)
            try:
                self.done.wait(seconds)
            finally:
                os.kill(self.pid, signal.SIGCONT)
            self.pauses.append(seconds)
        self.then()


def run(rounds: int, prompts: int = 6, seed: int = 0, pause: tuple[float, float] = (0.2, 2.0),
        words: int = 600, model: Path | None = None, long_every: int = 5,
        progress=lambda text: None) -> dict:
    """The scenario; ``model`` defaults to the e2e suite's tiny model (built if missing)."""
    if model is None:
        cache = Path(os.environ.get("KVD_E2E_CACHE") or REPO / ".e2e-cache")
        model = build_tiny_model(cache / "tiny-llama")  # the e2e suite's own
    texts = [long_prompt(words, variant=v) for v in range(prompts)]
    gen = [{"op": "generate", "prompt": t, "max_tokens": 8} for t in texts]
    reset = {"op": "reset_prefix_cache"}
    llm = {"num_gpu_blocks_override": ENGINE_BLOCKS, "max_model_len": 1024}
    with tempfile.TemporaryDirectory(prefix="kvd-pause-") as tmp:
        tmpdir = Path(tmp)
        progress("reference outputs (no kvd)")
        ref = finish_engine(start_engine({"model": str(model), "llm": llm, "steps": gen},
                                         tmpdir / "ref.log"), tmpdir / "ref.log", 600)
        expected = [g["token_ids"] for g in generations(ref)]

        daemon = DaemonProc("--pool-size", "256M", "--extent-size", "1M").start()
        try:
            ktc = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd_client.vllm",
                   "kv_role": "kv_both",
                   "kv_connector_extra_config": {"socket": daemon.socket, **OPTIONS}}
            calm_file = tmpdir / "calm"
            # The last round waits until the pauses are over and the daemon runs, then
            # gives the client time to reconnect: it must store again by itself.
            steps = [s for _ in range(rounds - 1) for s in [*gen, reset]]
            steps += [{"op": "wait_file", "path": str(calm_file), "timeout": 600},
                      {"op": "sleep", "seconds": 2.0}, *gen, reset]
            progress(f"{rounds} rounds x {prompts} prompts with the daemon paused at random")
            proc = start_engine({"model": str(model), "llm": llm, "kv_transfer_config": ktc,
                           "steps": steps}, tmpdir / "paused.log")
            long_pause = OPTIONS["call_timeout_ms"] / 1000 * 2.5
            # The last round runs without pauses: the engine must have reconnected by
            # itself and store again, so a fresh engine finds what it kept.
            log = tmpdir / "paused.log"
            calm = (lambda: log.read_text().count('"op": "generate"')
                    >= (rounds - 1) * prompts)
            pauser = Pauser(daemon.pid, random.Random(seed), pause, long_pause, long_every,
                            calm, calm_file.touch)
            pauser.start()
            try:
                paused = finish_engine(proc, tmpdir / "paused.log", 300 + 60 * rounds)
            finally:
                pauser.done.set()
                pauser.join()
            got = [g["token_ids"] for g in generations(paused)]
            differ = sum(g != expected[i % prompts] for i, g in enumerate(got))
            healthy = daemon.proc is not None and daemon.proc.poll() is None
            status = daemon.status() if healthy else {}

            progress("a fresh engine loads what kvd kept")
            fresh_steps = [s for g in gen for s in (reset, g)]
            fresh = finish_engine(start_engine({"model": str(model), "llm": llm,
                                                "kv_transfer_config": ktc,
                                                "steps": fresh_steps}, tmpdir / "fresh.log"),
                                  tmpdir / "fresh.log", 600)
            fresh_got = [g["token_ids"] for g in generations(fresh)]
            after = daemon.status()
        finally:
            daemon.cleanup()
    counters = after.get("counters", {})
    return {
        "rounds": rounds, "prompts": prompts, "outputs": len(got),
        "differing_outputs": differ,
        "fresh_outputs": len(fresh_got),
        "fresh_differing_outputs": sum(g != e for g, e in zip(fresh_got, expected)),
        "fresh_cached_tokens": [g["num_cached_tokens"] for g in generations(fresh)],
        "pauses": len(pauser.pauses), "paused_s": round(sum(pauser.pauses), 2),
        "long_pauses": sum(p == long_pause for p in pauser.pauses),
        "daemon_healthy": healthy,
        "expired_transfers": status.get("counters", {}).get("expired_transfers", 0),
        "failed_transfers": status.get("counters", {}).get("failed_transfers", 0),
        "stored_blocks": status.get("counters", {}).get("stored_blocks", 0),
        "loaded_blocks_fresh": counters.get("loaded_blocks", 0)
        - status.get("counters", {}).get("loaded_blocks", 0),
        "loaded_blocks": counters.get("loaded_blocks", 0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-pause", type=float, default=0.2)
    ap.add_argument("--max-pause", type=float, default=2.0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out = run(args.rounds, args.prompts, args.seed, (args.min_pause, args.max_pause),
              progress=lambda text: print(f"... {text}", flush=True))
    for key, value in out.items():
        print(f"{key:>22}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    ok = (out["differing_outputs"] == 0 and out["fresh_differing_outputs"] == 0
          and out["daemon_healthy"] and out["loaded_blocks_fresh"] > 0)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
