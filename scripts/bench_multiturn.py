"""Multi-turn conversations on real vLLM engines (CPU), with kvd and without.

Workload (scripts/multiturn.py): N conversations x T turns; each turn resends the whole
history (a shared system prompt, the earlier user messages and the model's earlier
answers) plus a new user message of a few hundred tokens. Closed loop (``--concurrency``
conversations in flight) or open loop (``--rate`` new conversations per second). The
engines get a deliberately small KV cache (``--engine-blocks`` blocks of 128 tokens), so
the conversations' contexts do not all fit and must be recomputed, or loaded from kvd.

Configurations, each on fresh engines (and, with kvd, a fresh daemon):
  single-off, single-off-b  one engine without offloading (the second: the A/A control)
  single-kvd                one engine with kvd
  pair-off, pair-kvd        two engines behind a round-robin router (a turn often lands on
                            the engine that did not serve the previous one)
  restart-off, restart-kvd  one engine, restarted after half of every conversation's turns
Per configuration: total tokens/s, requests/s, TTFT mean/p50/p99, tokens loaded from kvd.
Ratios are kvd / without, per repeat (``--repeat``; the configurations' order rotates).

    .venv/bin/python scripts/bench_multiturn.py [--conversations 16 --turns 4]
        [--concurrency 4 | --rate R] [--engine-blocks 48] [--repeat 1] [--json FILE]

The engines are vLLM's own AsyncLLM (multiprocess: an engine-core process each) in this
process, fed token ids; the model is the random-weight Llama of bench_vllm.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "scripts"))

from _bench import DaemonProc, pct  # noqa: E402
from _engine import DEFAULT_ENV, _enable_amx  # noqa: E402
from bench_vllm import FIXED_MALLOC, MODEL, kvd_config  # noqa: E402
from multiturn import RoundRobin, Shape, arrivals, conversations  # noqa: E402

if __name__ in ("__main__", "__mp_main__"):  # the engine-core processes re-import us
    _enable_amx()

CONFIGS = ("single-off", "single-kvd", "single-off-b", "pair-off", "pair-kvd",
           "restart-off", "restart-kvd")
BLOCK_TOKENS = 128


def set_env(malloc: bool) -> None:
    """vLLM reads its environment at import: set it first."""
    for k, v in DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if malloc:
        os.environ["GLIBC_TUNABLES"] = FIXED_MALLOC


def max_len(blocks: int) -> int:
    """The longest prompt an engine of ``blocks`` blocks serves (vLLM wants it to fit)."""
    return min(8192, (blocks - 1) * BLOCK_TOKENS)


def make_engine(model: Path, blocks: int, ktc: dict | None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model), tokenizer=str(model), enable_prefix_caching=True,
        max_model_len=max_len(blocks), dtype="bfloat16", enforce_eager=True, seed=0,
        num_gpu_blocks_override=blocks, disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(**ktc) if ktc else None)
    return AsyncLLM.from_engine_args(args)


class Progress:
    """One line on stderr, redrawn, when it is a terminal."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.tty = sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.tty:
            width = 30
            fill = width * self.done // max(1, self.total)
            sys.stderr.write(f"\r{self.label:>13} [{'#' * fill}{'.' * (width - fill)}] "
                             f"{self.done}/{self.total}")
            sys.stderr.flush()
            if self.done == self.total:
                sys.stderr.write("\n")


async def turn(engine, ids: list[int], rid: str, answer: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    first = None
    out = None
    async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
    assert out is not None and first is not None
    return {"ttft": first - t0, "prompt": len(ids), "answer": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0}


async def drive(engines: list, convs: list, shape: Shape, args, progress: Progress,
                upto: int, samples: list[dict]) -> None:
    """Run every conversation's turns up to ``upto`` on ``engines`` (round robin)."""
    router = RoundRobin(len(engines))

    slots = asyncio.Semaphore(args.concurrency if not args.rate else 1 << 30)

    async def conversation(c) -> None:
        while c.turn < upto:
            async with slots:
                r = await turn(engines[router.pick()], c.prompt(),
                               f"c{c.index}-t{c.turn}-{time.monotonic_ns()}",
                               shape.answer_tokens)
            r["turn"] = c.turn
            c.answered(r["answer"])
            samples.append(r)
            progress.step()

    if args.rate:  # open loop: conversations start at Poisson times
        t0 = time.perf_counter()

        async def at(c, start: float) -> None:
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
            await conversation(c)

        await asyncio.gather(*(at(c, s) for c, s in
                               zip(convs, arrivals(len(convs), args.rate, shape.seed))))
    else:  # closed loop: every conversation is open, ``concurrency`` requests in flight
        # (their turns interleave, so a conversation's context may leave the engine's
        # cache between its turns, as with many users thinking between messages)
        await asyncio.gather(*(conversation(c) for c in convs))


async def run_config(name: str, model: Path, shape: Shape, args) -> dict:
    kvd = name.endswith("-kvd")
    n_engines = 2 if name.startswith("pair") else 1
    restart = name.startswith("restart")
    daemon = DaemonProc("--pool-size", args.pool_size, "--extent-size", "8M").start() \
        if kvd else None
    try:
        ktc = kvd_config(daemon.socket) if daemon else None
        engines = [make_engine(model, args.engine_blocks, ktc) for _ in range(n_engines)]
        convs = conversations(shape)
        progress = Progress(name, shape.conversations * shape.turns)
        samples: list[dict] = []
        after_restart: list[dict] = []
        t0 = time.perf_counter()
        if restart:
            half = shape.turns // 2
            await drive(engines, convs, shape, args, progress, half, samples)
            for e in engines:
                e.shutdown()
            t_restart = time.perf_counter()
            engines = [make_engine(model, args.engine_blocks, ktc) for _ in range(n_engines)]
            t0 += time.perf_counter() - t_restart  # the restart itself is not serving time
            before = len(samples)
            await drive(engines, convs, shape, args, progress, shape.turns, samples)
            after_restart = [s for s in samples[before:] if s["turn"] == half]
        else:
            await drive(engines, convs, shape, args, progress, shape.turns, samples)
        wall = time.perf_counter() - t0
        for e in engines:
            e.shutdown()
        engines.clear()
        gc.collect()  # the engines' own __del__ would shut them down again at exit
        counters = daemon.status()["counters"] if daemon else {}
    finally:
        if daemon is not None:
            daemon.cleanup()
    ttft = [s["ttft"] for s in samples]
    tokens = sum(s["prompt"] + len(s["answer"]) for s in samples)
    out = {
        "config": name, "requests": len(samples), "wall_s": wall,
        "tokens_per_s": tokens / wall, "requests_per_s": len(samples) / wall,
        "ttft_mean_ms": statistics.mean(ttft) * 1e3,
        "ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "engine_cached_tokens": sum(s["cached"] for s in samples),
        "kvd_loaded_tokens": counters.get("loaded_blocks", 0) * BLOCK_TOKENS,
        "kvd_stored_blocks": counters.get("stored_blocks", 0),
    }
    if restart:
        first = [s["ttft"] for s in after_restart]
        out["ttft_p50_after_restart_ms"] = statistics.median(first) * 1e3
        out["cached_after_restart_tokens"] = sum(s["cached"] for s in after_restart)
    return out


# group -> (with kvd, its baseline, {ratio name: the configs' field})
RATIOS = {
    "single": ("single-kvd", "single-off", {
        "throughput_ratio": "tokens_per_s", "request_rate_ratio": "requests_per_s",
        "ttft_p50_ratio": "ttft_p50_ms", "ttft_mean_ratio": "ttft_mean_ms"}),
    "aa_control": ("single-off-b", "single-off", {
        "throughput_ratio": "tokens_per_s", "ttft_p50_ratio": "ttft_p50_ms"}),
    "pair": ("pair-kvd", "pair-off", {
        "throughput_ratio": "tokens_per_s", "request_rate_ratio": "requests_per_s",
        "ttft_p50_ratio": "ttft_p50_ms", "ttft_mean_ratio": "ttft_mean_ms"}),
    "restart": ("restart-kvd", "restart-off", {
        "throughput_ratio": "tokens_per_s",
        "ttft_p50_after_restart_ratio": "ttft_p50_after_restart_ms"}),
}


def ratios(by: dict[str, dict]) -> dict[str, dict]:
    """Each group whose two configurations ran (``--configs`` may run a few)."""
    return {group: {name: by[a][key] / by[b][key] for name, key in keys.items()}
            for group, (a, b, keys) in RATIOS.items() if a in by and b in by}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4, help="closed loop (default)")
    ap.add_argument("--rate", type=float, default=0.0, help="open loop: conversations/s")
    ap.add_argument("--engine-blocks", type=int, default=48,
                    help="each engine's own KV cache, in blocks of 128 tokens")
    ap.add_argument("--pool-size", default="1G")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--glibc-malloc", choices=("fixed", "default"), default="fixed")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    set_env(args.glibc_malloc == "fixed")
    from _model import build_tiny_model

    cache = Path(os.environ.get("KVD_E2E_CACHE") or REPO / ".e2e-cache")
    model = build_tiny_model(cache / "bench-llama", **MODEL)
    shape = Shape(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                  args.answer_tokens, MODEL["vocab"], args.seed)
    longest = shape.system_tokens + shape.turns * (
        round(shape.user_tokens * 1.3) + shape.answer_tokens)
    if longest > max_len(args.engine_blocks):
        ap.error(f"the last turn's prompt (up to {longest} tokens) does not fit an engine of "
                 f"{args.engine_blocks} blocks ({max_len(args.engine_blocks)} tokens)")
    names = [c for c in args.configs.split(",") if c]
    runs: list[dict[str, dict]] = []
    for rep in range(args.repeat):
        order = names[rep % len(names):] + names[:rep % len(names)]
        by = {}
        for name in order:
            by[name] = asyncio.run(run_config(name, model, shape, args))
        runs.append(by)
    cols = ("tokens_per_s", "requests_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
            "kvd_loaded_tokens")
    print(f"{'config':>13} " + " ".join(f"{c:>17}" for c in cols) + "  (median of runs)")
    for name in names:
        vals = [statistics.median(r[name][c] for r in runs) for c in cols]
        print(f"{name:>13} " + " ".join(f"{v:17.1f}" for v in vals))
    result: dict = {"runs": runs, "shape": vars(shape),
                    "mode": {"rate": args.rate} if args.rate else
                    {"concurrency": args.concurrency}}
    per_run = [ratios(r) for r in runs]
    if per_run:
        for group in per_run[0]:
            result[group] = {k: statistics.median(p[group][k] for p in per_run)
                             for k in per_run[0][group]}
            result[group]["runs"] = [p[group] for p in per_run]
            print(f"{group:>13}: " + ", ".join(f"{k} {v:.3f}" for k, v in result[group].items()
                                              if k != "runs"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
