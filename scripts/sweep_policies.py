"""Sweep every policy (and Belady) over capacities on the shared trace.

    .venv/bin/python scripts/sweep_policies.py [--trace PATH] [--capacity 2000,...]
        [--policy lru,arc,...] [--json] [--plot docs/policy_sweep.png]
"""

from __future__ import annotations

import argparse
import json
import sys

from kvd.cli.simulate import _names, plot, table
from kvd.core.policies.base import DEFAULT_POLICY
from kvd.sim import BELADY, load_trace, replay

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
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
    pols = _names(args.policy)
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
        frac = {(r.policy, r.capacity): r.hit_fraction for r in results}
        online = [p for p in pols if p not in (BELADY, DEFAULT_POLICY)]
        if DEFAULT_POLICY in pols and online:
            print(f"\n{DEFAULT_POLICY} minus best other online policy; share of the ARC..Belady gap closed:")
            for c in caps:
                best = max(frac[p, c] for p in online)
                gap = ""
                if "arc" in pols and BELADY in pols and frac[BELADY, c] > frac["arc", c]:
                    closed = (frac[DEFAULT_POLICY, c] - frac["arc", c]) / (frac[BELADY, c] - frac["arc", c])
                    gap = f"  gap closed {closed:6.1%}"
                print(f"  {c:>6}: {frac[DEFAULT_POLICY, c] - best:+.4f}{gap}")
    if args.plot:
        plot(results, args.plot, title="mooncake synthetic trace")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
