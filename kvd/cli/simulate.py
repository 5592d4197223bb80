"""``kvdctl simulate``: replay a trace through the daemon's index and policies."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from kvd.core.policies.base import DEFAULT_POLICY, policy_names
from kvd.sim import BELADY, SimResult, TraceError, load_trace, replay

LONG_REFS = 200_000  # block references from which a replay earns a progress bar
MAX_CAPACITY = 1 << 40  # blocks; more than any pool (a float of it stays exact)


def _items(values: Sequence[str]) -> list[str]:
    """Comma-separated or repeated values (argparse hands ``--x=--`` over as a list)."""
    if not all(isinstance(item, str) for item in values):
        raise ValueError("not a value")
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def parse_capacities(values: Sequence[str]) -> list[int]:
    return [int(v) for v in _items(values)]


def parse_policies(values: Sequence[str] | None, sweep: bool = True) -> list[str]:
    """The policies asked for; by default all and Belady (a sweep) or the default."""
    if not values:
        return [*policy_names(), BELADY] if sweep else [DEFAULT_POLICY]
    return _items(values)


def plot_refusal(path: str) -> str:
    """Why ``path`` cannot take the plot (checked before a long replay), or ""."""
    if os.path.isdir(path):
        return "it is a directory"
    if not os.path.isdir(os.path.dirname(path) or "."):
        return f"no directory {os.path.dirname(path)}"
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "plots need matplotlib"
    formats = Figure().canvas.get_supported_filetypes()
    if os.path.splitext(path)[1].lower().lstrip(".") not in formats:
        return f"name a file of one of matplotlib's formats ({', '.join(sorted(formats))})"
    return ""


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the eviction policies",
        description="Replay TRACE (one JSON object per line with hash_ids) through the "
        "daemon's own index and policy code and report the prefix-hit fraction. "
        "Several capacities or policies give a sweep table.",
    )
    p.add_argument("trace", metavar="TRACE",
                   help="JSON lines, plain or gzip-compressed; - reads standard input")
    p.add_argument(
        "--capacity", action="append", required=True, metavar="BLOCKS",
        help="cache size in blocks; comma-separated or repeated for a sweep",
    )
    p.add_argument(
        "--policy", action="append", metavar="NAME",
        help=f"policy name(s), comma-separated or repeated (default: {DEFAULT_POLICY}; "
        f"with several capacities, all + {BELADY})",
    )
    p.add_argument(
        "--second-half", action="store_true",
        help="warm the cache on the first half of the trace by time and count only the "
        "second half (tune on the first half, report on the second)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PNG", help="write hit fraction vs capacity (sweep)")
    p.set_defaults(func=run)


def table(results: Sequence[SimResult], stored: bool = False) -> str:
    """Hit fractions, one row per policy, one column per capacity; ``stored`` adds a
    row of stored blocks (write traffic, thousands) under each policy's."""
    caps = sorted({r.capacity for r in results})
    pols = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.capacity): r for r in results}
    lines = ["policy    " + "".join(f"{c:>9}" for c in caps)]
    for p in pols:
        cells = "".join(f"{by[p, c].hit_fraction:>9.3f}" if (p, c) in by else f"{'-':>9}"
                        for c in caps)
        lines.append(f"{p:<10}{cells}")
        if stored:
            cells = "".join(f"{by[p, c].stored_blocks / 1000:>8.1f}k" if (p, c) in by
                            else f"{'-':>9}" for c in caps)
            lines.append(f"{'  stored':<10}{cells}")
    return "\n".join(lines)


class Progress:
    """A one-line bar on a terminal (stderr) for long replays; silent otherwise."""

    def __init__(self, runs: int, out: TextIO = sys.stderr) -> None:
        self.runs, self.run, self.out = runs, 0, out
        self._last = 0.0

    def for_run(self, label: str) -> Callable[[int, int], None]:
        self.run += 1
        run = self.run

        def show(done: int, total: int) -> None:
            now = time.monotonic()
            if done < total and now - self._last < 0.1:
                return
            self._last = now
            frac = done / total if total else 1.0
            bar = "#" * int(frac * 30)
            self.out.write(f"\r  [{bar:<30}] {frac:6.1%}  run {run}/{self.runs} {label}\x1b[K")
            if done >= total and run == self.runs:
                self.out.write("\r\x1b[K")
            self.out.flush()

        return show


def plot(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """Hit fraction against capacity, one line per policy (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.capacity, r.hit_fraction) for r in results if r.policy == p)
        style = "--" if p == BELADY else "-"
        ax.plot([c for c, _ in pts], [h for _, h in pts], style, marker="o", ms=3, label=p)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix-hit fraction of block references")
    ax.set_title(title or "eviction policies")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        caps = parse_capacities(args.capacity)
    except ValueError:
        print(f"kvdctl simulate: capacities must be whole numbers of blocks, "
              f"not {', '.join(map(str, args.capacity))!r}", file=sys.stderr)
        return 2
    known = {*policy_names(), BELADY}
    try:
        pols = parse_policies(args.policy, sweep=len(caps) > 1)
    except ValueError:
        pols = [repr(args.policy)]
    unknown = [p for p in pols if p not in known]
    if unknown or not pols or not caps or not 1 <= min(caps) <= max(caps) <= MAX_CAPACITY:
        what = (f"unknown policy {unknown[0]!r}" if unknown else "no policy given"
                if not pols else f"capacities must be 1 to {MAX_CAPACITY} blocks")
        print(f"kvdctl simulate: {what}; policies: {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    if args.plot and (why := plot_refusal(args.plot)):
        print(f"kvdctl simulate: cannot write the plot {args.plot}: {why}", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace)
    except TraceError as e:
        print(f"kvdctl simulate: {e}", file=sys.stderr)
        return 2
    start = trace.split() if args.second_half else 0
    if not any(map(len, trace.requests[start:])):  # 0 of 0 is not a hit fraction of 0
        where = (f"from request {start + 1} of {len(trace.requests)}"
                 if start < len(trace.requests) else f"none of its {len(trace.requests)} "
                 "requests: it has no second half")
        print(f"kvdctl simulate: {args.trace}: the second half of the trace ({where}) "
              "has no block references to count", file=sys.stderr)
        return 2
    bar = None
    if sys.stderr.isatty() and trace.block_refs * len(pols) * len(caps) >= LONG_REFS:
        bar = Progress(len(pols) * len(caps))
    results = [replay(trace, c, p, count_from=start,
                      progress=bar.for_run(f"{p} @ {c}") if bar else None)
               for p in pols for c in caps]
    if args.json:
        out: object = results[0].as_dict() if len(results) == 1 else [r.as_dict() for r in results]
        print(json.dumps(out, indent=None if len(results) == 1 else 1))
    elif len(results) == 1:
        r = results[0]
        print(f"{r.policy} capacity={r.capacity} requests={r.requests} "
              f"block_refs={r.block_refs} hit_blocks={r.hit_blocks} "
              f"hit_fraction={r.hit_fraction:.4f} stored_blocks={r.stored_blocks}")
    else:
        print(table(results, stored=True))
    if args.plot:
        try:
            plot(results, args.plot, title=args.trace.rsplit("/", 1)[-1])
        except Exception as e:  # noqa: BLE001 - a backend's own failure (pgf: no LaTeX)
            # is a plot not written, not a traceback after the replay
            print(f"kvdctl simulate: cannot write the plot {args.plot}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvdctl")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
