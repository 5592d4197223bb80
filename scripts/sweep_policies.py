"""Sweep every policy (and Belady) over capacities on one or more traces.

    .venv/bin/python scripts/sweep_policies.py [--trace PATH ...] [--capacity 1000,...]
        [--policy lru,arc,...] [--second-half] [--chunk N] [--jobs N] [--json | --markdown]
        [--plot docs/policy_sweep.png]

Per trace: hit fraction and stored blocks (write traffic) of each policy at each
capacity, then the default against the best of LRU and ARC (the issue's bar: never more
than 0.01 of references behind) and the share of the ARC..Belady gap it closes.
``--second-half`` warms each cache on the first half of the trace by time and counts
only the second (tune on the first half, report on the second).
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import Pool
from pathlib import Path

from kvd.cli.simulate import parse_policies, table
from kvd.core.policies.base import DEFAULT_POLICY
from kvd.sim import BELADY, SimResult, load_trace, replay

# The project's shared trace sits beside the repository (../shared/traces/).
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")
CAPACITIES = "1000,2000,5000,10000,20000,40000,80000"
_traces: dict[str, object] = {}


def _one(job: tuple[str, str, int, bool, int]) -> tuple[str, SimResult]:
    path, policy, capacity, second, chunk = job
    if path not in _traces:  # one load per worker process
        _traces[path] = load_trace(path)
    trace = _traces[path]
    return path, replay(trace, capacity, policy,  # type: ignore[arg-type]
                        count_from=trace.split() if second else 0,  # type: ignore[attr-defined]
                        chunk=chunk)


def name(path: str) -> str:
    return Path(path).name.removesuffix(".jsonl")


def verdict(results: list[SimResult], caps: list[int]) -> list[str]:
    """The default against max(LRU, ARC), and the share of the ARC..Belady gap closed."""
    by = {(r.policy, r.capacity): r for r in results}
    d = DEFAULT_POLICY
    out = []
    for c in caps:
        if (d, c) not in by or ("lru", c) not in by or ("arc", c) not in by:
            continue
        best = max(by["lru", c].hit_fraction, by["arc", c].hit_fraction)
        line = f"  {c:>6}: {d} - max(lru, arc) = {by[d, c].hit_fraction - best:+.4f}"
        if (BELADY, c) in by:
            gap = by[BELADY, c].hit_fraction - by["arc", c].hit_fraction
            if gap > 0.01:
                closed = (by[d, c].hit_fraction - by["arc", c].hit_fraction) / gap
                line += f"; ARC..Belady gap {gap:.3f}, closed {closed:6.1%}"
        out.append(line)
    return out


def markdown(results: list[SimResult], caps: list[int]) -> str:
    by = {(r.policy, r.capacity): r for r in results}
    pols = list(dict.fromkeys(r.policy for r in results))
    head = "| policy | " + " | ".join(f"{c:,}" for c in caps) + " |"
    lines = [head, "| --- " * (len(caps) + 1) + "|"]
    for p in pols:
        label = f"**{p}** (default)" if p == DEFAULT_POLICY else (
            "belady (offline)" if p == BELADY else p)
        cells = [f"{by[p, c].hit_fraction:.3f} / {by[p, c].stored_blocks / 1000:.1f}k"
                 if (p, c) in by else "-" for c in caps]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_grid(groups: dict[str, list[SimResult]], path: str) -> None:
    """One panel per trace: hit fraction against capacity (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(groups)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, results) in zip(axes.flat, groups.items()):
        for p in dict.fromkeys(r.policy for r in results):
            pts = sorted((r.capacity, r.hit_fraction) for r in results if r.policy == p)
            style = "--" if p == BELADY else "-"
            width = 2.2 if p == DEFAULT_POLICY else 1.0
            ax.plot([c for c, _ in pts], [h for _, h in pts], style, marker="o", ms=2.5,
                    lw=width, label=p)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.supxlabel("capacity (blocks)")
    fig.supylabel("prefix-hit fraction of block references")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append")
    ap.add_argument("--capacity", default=CAPACITIES)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--second-half", action="store_true")
    ap.add_argument("--chunk", type=int, default=0,
                    help="store each request in parts of this many blocks, as vLLM's "
                         "chunked prefill does (default: at once)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="README tables")
    ap.add_argument("--plot", metavar="PNG")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity.split(",")]
    pols = parse_policies(args.policy)
    paths = args.trace or [TRACE]
    jobs = [(t, p, c, args.second_half, args.chunk) for t in paths for p in pols for c in caps]
    groups: dict[str, list[SimResult]] = {name(t): [] for t in paths}
    with Pool(max(1, args.jobs)) as pool:
        for path, r in pool.imap(_one, jobs):
            groups[name(path)].append(r)
            print(f"  {name(path)}: {r.policy} @ {r.capacity}: {r.hit_fraction:.4f}",
                  file=sys.stderr, flush=True)
    half = " (second half by time)" if args.second_half else ""
    if args.json:
        print(json.dumps({t: [r.as_dict() for r in rs] for t, rs in groups.items()},
                         indent=1))
    for t, results in groups.items():
        if args.json:
            break
        r0 = results[0]
        print(f"\n### {t}{half}: {r0.requests:,} requests, {r0.block_refs:,} block "
              f"references counted\n")
        print(markdown(results, caps) if args.markdown else table(results, stored=True))
        print()
        print("\n".join(verdict(results, caps)))
    if args.plot:
        plot_grid({f"{t}{half}": rs for t, rs in groups.items()}, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
