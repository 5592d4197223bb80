"""Simulator replay speed in block references per second, per policy.

    .venv/bin/python scripts/bench_sim.py [--trace PATH] [--capacity 5000,...] [--repeat 3] [--json]

Best of ``--repeat`` runs (the machine is noisy and shared); a benchmark, not a test.
Two figures per cell: refs/s by this process's CPU time (``time.process_time``, the
one to compare: other processes' load barely moves it) and by wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvd.cli.simulate import parse_policies
from kvd.sim import load_trace, replay

# The project's shared trace sits beside the repository (../shared/traces/).
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--capacity", default="2000,5000,10000,20000,40000")
    ap.add_argument("--policy", action="append")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity.split(",")]
    trace = load_trace(args.trace)
    rows = []
    for p in parse_policies(args.policy):
        for c in caps:
            cpu, wall = [], []
            for _ in range(args.repeat):
                t0 = time.process_time()
                wall.append(replay(trace, c, p).seconds)
                cpu.append(time.process_time() - t0)
            rows.append({"policy": p, "capacity": c, "block_refs": trace.block_refs,
                         "cpu_seconds": round(min(cpu), 4), "wall_seconds": min(wall),
                         "refs_per_cpu_s": round(trace.block_refs / min(cpu)),
                         "refs_per_wall_s": round(trace.block_refs / min(wall))})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for what in ("cpu", "wall"):
        print(f"{'policy':<10}" + "".join(f"{c:>10}" for c in caps)
              + f"   (block refs per {what} second, best of {args.repeat})")
        for p in dict.fromkeys(r["policy"] for r in rows):
            cells = "".join(f"{r[f'refs_per_{what}_s']:>10,}" for r in rows if r["policy"] == p)
            print(f"{p:<10}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
