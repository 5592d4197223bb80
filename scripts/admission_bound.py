"""How much of the ARC..Belady gap admission alone could close, given oracles.

    python scripts/admission_bound.py [--trace PATH ...] [--capacity 2000,5000,10000] [--json]

Most stored blocks are never used again, so declining them at Allocate looks like the
way to Belady. This bounds it: LRU under the prefix protocol (as ``kvd.sim.replay``
drives the daemon's policies) that declines the blocks an oracle rejects, with oracles
of two strengths, beside kvd's ``lru``, ``arc``, the default and Belady:

- "class oracle": blocks fall in classes an online predictor could know at Allocate
  (log2 of the request's length, distance from the end of its chain capped at 4,
  whether the request hit a cached prefix); the oracle knows each class's true reuse
  rate over the whole trace (reused within 1, 3 or unlimited times the capacity of
  references) and admits the classes above a threshold: the best of those 3 windows
  and thresholds 0.05..0.60 is reported. No online learner of those classes can do
  better than the rates it would have to estimate.
- "block oracle": admits exactly the blocks referenced again (anywhere later, or
  within 3 capacities of references): what only knowledge of the future gives.

The share of the ARC..Belady gap each closes is printed beside it.
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice

from sweep_policies import TRACE

from kvd.core.policies.base import DEFAULT_POLICY
from kvd.sim import BELADY, NEVER, Trace, load_trace, next_uses, replay

WINDOWS = (1, 3, 0)  # times the capacity; 0: unlimited
THRESHOLDS = [t / 100 for t in range(5, 61, 5)]


def lru_admit(trace: Trace, capacity: int, admit: Callable[[int], bool]) -> float:
    """Prefix-protocol LRU, as the daemon's index drives ``lru``: a request's leading
    cached run is its hits (touched, tail first); of its other blocks, those not cached and
    admitted (``admit(flat position)``) are stored, room for all of them evicted first
    (never the request's own cached blocks: those that find no room are not stored);
    a cached block after the first miss is left as it is."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = refs = pos = 0
    for req in trace.hash_ids:
        n = 0
        for h in req:
            if h not in cache:
                break
            n += 1
        for h in reversed(req[:n]):  # as vLLM and kvd's lru: the head ends most recent
            cache.move_to_end(h)
        hits += n
        refs += len(req)
        new = list(dict.fromkeys(
            h for j, h in enumerate(req[n:], pos + n) if h not in cache and admit(j)))
        excess = len(cache) + len(new) - capacity
        if excess > 0:  # never the request's own cached blocks (kvd's Allocate keeps them)
            held = {h for h in req[n:] if h in cache}
            for h in list(islice((h for h in cache if h not in held), excess)):
                del cache[h]
        cache.update(dict.fromkeys(new[:max(0, capacity - len(cache))]))
        pos += len(req)
    return hits / refs if refs else 0.0


def classes(trace: Trace) -> list[tuple[int, int, bool]]:
    """Each reference's class, from what is known when its request is allocated."""
    out: list[tuple[int, int, bool]] = []
    seen: set[int] = set()
    for req in trace.hash_ids:
        length = len(req)
        hit = bool(req) and req[0] in seen
        out.extend((length.bit_length(), min(length - 1 - j, 4), hit) for j in range(length))
        seen.update(req)
    return out


def class_oracle(trace: Trace, capacity: int, nxt: Sequence[int],
                 cls: Sequence[tuple[int, int, bool]]) -> float:
    best = 0.0
    for w in WINDOWS:
        window = w * capacity if w else NEVER
        seen: dict[tuple[int, int, bool], list[int]] = {}
        for i, c in enumerate(cls):
            s = seen.setdefault(c, [0, 0])
            s[0] += 1
            s[1] += nxt[i] - i < window if nxt[i] != NEVER else 0
        rate = {c: b / a for c, (a, b) in seen.items()}
        for t in THRESHOLDS:
            good = {c for c, r in rate.items() if r > t}
            admitted = [c in good for c in cls]
            best = max(best, lru_admit(trace, capacity, admitted.__getitem__))
    return best


def bound(trace: Trace, capacity: int) -> dict[str, float]:
    nxt = next_uses(trace)
    row = {p: replay(trace, capacity, p).hit_fraction
           for p in ("lru", "arc", DEFAULT_POLICY, BELADY)}
    row["lru + class oracle"] = class_oracle(trace, capacity, nxt, classes(trace))
    row["lru + block oracle (3 capacities)"] = lru_admit(
        trace, capacity, lambda i: nxt[i] - i < 3 * capacity)
    row["lru + block oracle (ever)"] = lru_admit(trace, capacity, lambda i: nxt[i] != NEVER)
    return {k: round(v, 4) for k, v in row.items()}


def closed(row: dict[str, float], key: str) -> float | None:
    gap = row[BELADY] - row["arc"]
    return (row[key] - row["arc"]) / gap if gap > 0.01 else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append")
    ap.add_argument("--capacity", default="2000,5000,10000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity.split(",")]
    out = {}
    for path in args.trace or [TRACE]:
        trace = load_trace(path)
        out[path] = {c: bound(trace, c) for c in caps}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for path, rows in out.items():
        print(f"\n{path}\n")
        keys = list(next(iter(rows.values())))
        print("| | " + " | ".join(f"{c:,}" for c in caps) + " |")
        print("| --- " * (len(caps) + 1) + "|")
        for k in keys:
            cells = []
            for c in caps:
                share = closed(rows[c], k)
                cells.append(f"{rows[c][k]:.3f}" + (
                    f" ({share:+.0%})" if share is not None and k not in ("arc", BELADY)
                    else ""))
            print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
