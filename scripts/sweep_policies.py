"""Sweep every policy (and Belady) over capacities on the shared trace.

    .venv/bin/python scripts/sweep_policies.py [--trace PATH] [--capacity 2000,...]
        [--policy lru,arc,...] [--json] [--plot docs/policy_sweep.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvd.cli.simulate import parse_policies, plot, table
from kvd.core.policies.base import DEFAULT_POLICY
from kvd.sim import BELADY, load_trace, replay

# The project's shared trace sits beside the repository (../shared/traces/).
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")
CAPACITIES = "2000,3000,5000,7500,10000,15000,20000,30000,40000"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--capacity", default=CAPACITIES)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", metavar="PNG")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity.split(",")]
    pols = parse_policies(args.policy)
    trace = load_trace(args.trace)
    results = []
    for p in pols:
        for c in caps:
            results.append(replay(trace, c, p))
            print(f"  {p} @ {c}: {results[-1].hit_fraction:.4f}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(table(results))
        hits = {(r.policy, r.capacity): r.hit_blocks for r in results}
        online = [p for p in pols if p not in (BELADY, DEFAULT_POLICY)]
        if DEFAULT_POLICY in pols and online:
            d = DEFAULT_POLICY
            print(f"\n{d} (default) against the best other online policy, in hit blocks;"
                  " share of the ARC..Belady gap closed:")
            for c in caps:
                best = max(online, key=lambda p: hits[p, c])
                line = f"  {c:>6}: {hits[d, c] - hits[best, c]:+6d} vs {best:<7}"
                if "arc" in pols and BELADY in pols and hits[BELADY, c] > hits["arc", c]:
                    closed = (hits[d, c] - hits["arc", c]) / (hits[BELADY, c] - hits["arc", c])
                    line += f"  gap closed {closed:6.1%}"
                print(line)
    if args.plot:
        plot(results, args.plot, title="mooncake synthetic trace")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
