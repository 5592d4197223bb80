"""Simulator replay speed in block references per second, per policy.

    .venv/bin/python scripts/bench_sim.py [--trace PATH] [--capacity 5000,...] [--repeat 3] [--json]

Best of ``--repeat`` runs (the machine is noisy); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json

from kvd.cli.simulate import parse_policies
from kvd.sim import load_trace, replay

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


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
            best = min(replay(trace, c, p).seconds for _ in range(args.repeat))
            rows.append({"policy": p, "capacity": c, "block_refs": trace.block_refs,
                         "seconds": best, "refs_per_s": round(trace.block_refs / best)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'policy':<10}" + "".join(f"{c:>10}" for c in caps) + "   (block refs/s, best of "
          f"{args.repeat})")
    for p in dict.fromkeys(r["policy"] for r in rows):
        cells = "".join(f"{r['refs_per_s']:>10,}" for r in rows if r["policy"] == p)
        print(f"{p:<10}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
