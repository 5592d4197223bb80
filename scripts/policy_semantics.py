"""kvd's ARC and S3-FIFO beside the papers' algorithms, and what the prefix protocol changes.

    python scripts/policy_semantics.py [--trace PATH] [--capacity 2000,5000,10000] [--json]

Each trace is replayed three ways; every figure is the prefix-hit fraction (per request,
the leading run of cached blocks, over all block references):

- "textbook": implementations written here from the papers, independent of kvd's code
  (LRU; ARC, Megiddo & Modha, FAST'03; S3-FIFO, Yang et al., SOSP'23, as libCacheSim
  runs it: promotion from the small FIFO after two reuses, and after one), one block at
  a time: a cached block is a hit and is touched, a missing one evicts one victim and
  goes in;
- "kvd, one at a time": kvd's policy classes driven the same way (their differences
  from the textbook rows are the classes' own);
- "kvd, prefix protocol": kvd's classes as the daemon and ``kvdctl simulate`` drive
  them (``kvd.sim.replay``): only the leading run is a hit; the request's missing blocks
  are allocated at once, evicting their room before any of them is inserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from kvd.core.policies.base import make_policy
from kvd.sim import Trace, load_trace, replay

TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")


class Cache(Protocol):
    def has(self, key: bytes) -> bool: ...
    def hit(self, key: bytes) -> None: ...
    def miss(self, key: bytes) -> None: ...


class TextbookLRU:
    def __init__(self, c: int) -> None:
        self.c, self.order = c, OrderedDict[bytes, None]()

    def has(self, k: bytes) -> bool:
        return k in self.order

    def hit(self, k: bytes) -> None:
        self.order.move_to_end(k)

    def miss(self, k: bytes) -> None:
        if len(self.order) >= self.c:
            self.order.popitem(last=False)
        self.order[k] = None


class TextbookARC:
    """Figure 4 of the FAST'03 paper: T1/T2 resident, B1/B2 ghosts, target p."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1, self.t2 = OrderedDict[bytes, None](), OrderedDict[bytes, None]()
        self.b1, self.b2 = OrderedDict[bytes, None](), OrderedDict[bytes, None]()

    def has(self, k: bytes) -> bool:
        return k in self.t1 or k in self.t2

    def hit(self, k: bytes) -> None:
        (self.t1 if k in self.t1 else self.t2).pop(k)
        self.t2[k] = None

    def _replace(self, k: bytes) -> None:
        if self.t1 and (len(self.t1) > self.p or (k in self.b2 and len(self.t1) == self.p)):
            self.b1[self.t1.popitem(last=False)[0]] = None
        else:
            self.b2[self.t2.popitem(last=False)[0]] = None

    def miss(self, k: bytes) -> None:
        c = self.c
        if k in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            self._replace(k)
            del self.b1[k]
            self.t2[k] = None
            return
        if k in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            self._replace(k)
            del self.b2[k]
            self.t2[k] = None
            return
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(k)
            else:
                self.t1.popitem(last=False)
        elif total >= c:
            if total == 2 * c:
                self.b2.popitem(last=False)
            self._replace(k)
        self.t1[k] = None


class TextbookS3FIFO:
    """Algorithm 1 of the SOSP'23 paper with libCacheSim's details: small FIFO 10 %,
    ghost 90 % of the capacity, frequencies capped at 3, new objects go straight to
    the main FIFO until the first eviction."""

    def __init__(self, c: int, promote_after: int) -> None:
        self.c, self.small_cap, self.main_cap = c, max(1, c // 10), c - max(1, c // 10)
        self.ghost_cap, self.promote_after = int(c * 0.9), promote_after
        self.small, self.main = OrderedDict[bytes, None](), OrderedDict[bytes, None]()
        self.ghost, self.freq = OrderedDict[bytes, None](), dict[bytes, int]()
        self.evicted = False

    def has(self, k: bytes) -> bool:
        return k in self.freq

    def hit(self, k: bytes) -> None:
        self.freq[k] = min(self.freq[k] + 1, 3)

    def miss(self, k: bytes) -> None:
        ghost = k in self.ghost
        if ghost:
            del self.ghost[k]
        while len(self.freq) >= self.c:
            self._evict()
        to_main = ghost or (not self.evicted and len(self.small) >= self.small_cap)
        (self.main if to_main else self.small)[k] = None
        self.freq[k] = 0

    def _evict(self) -> None:
        self.evicted = True
        if len(self.main) > self.main_cap or not self.small:
            while True:
                k = self.main.popitem(last=False)[0]
                if self.freq[k] == 0:
                    del self.freq[k]
                    return
                self.freq[k] -= 1
                self.main[k] = None
        while self.small:
            k = self.small.popitem(last=False)[0]
            if self.freq[k] >= self.promote_after:
                self.freq[k] = 0
                self.main[k] = None
                continue
            del self.freq[k]
            self.ghost[k] = None
            if len(self.ghost) > self.ghost_cap:
                self.ghost.popitem(last=False)
            return
        self._evict()  # everything in the small FIFO was promoted


class KvdOneAtATime:
    """A kvd policy class through its ABC, one block at a time."""

    def __init__(self, name: str, c: int) -> None:
        self.policy, self.c, self.held = make_policy(name, c), c, set[bytes]()

    def has(self, k: bytes) -> bool:
        return k in self.held

    def hit(self, k: bytes) -> None:
        self.policy.touch([k], 0)

    def miss(self, k: bytes) -> None:
        if len(self.held) >= self.c:
            self.held.difference_update(self.policy.evict(1))
        self.policy.insert(k, 0, 0)
        self.held.add(k)


def one_at_a_time(trace: Trace, cache: Cache) -> float:
    refs = hits = 0
    for keys in trace.requests:
        refs += len(keys)
        lead = 0
        while lead < len(keys) and cache.has(keys[lead]):
            lead += 1
        hits += lead
        for k in keys:
            if cache.has(k):
                cache.hit(k)
            else:
                cache.miss(k)
    return hits / refs if refs else 0.0


ROWS: list[tuple[str, Callable[[Trace, int], float]]] = [
    ("lru, textbook", lambda t, c: one_at_a_time(t, TextbookLRU(c))),
    ("lru, kvd one at a time", lambda t, c: one_at_a_time(t, KvdOneAtATime("lru", c))),
    ("lru, kvd prefix protocol", lambda t, c: replay(t, c, "lru").hit_fraction),
    ("arc, textbook (FAST'03)", lambda t, c: one_at_a_time(t, TextbookARC(c))),
    ("arc, kvd one at a time", lambda t, c: one_at_a_time(t, KvdOneAtATime("arc", c))),
    ("arc, kvd prefix protocol", lambda t, c: replay(t, c, "arc").hit_fraction),
    ("s3fifo, textbook, promote after 2",
     lambda t, c: one_at_a_time(t, TextbookS3FIFO(c, 2))),
    ("s3fifo, textbook, promote after 1",
     lambda t, c: one_at_a_time(t, TextbookS3FIFO(c, 1))),
    ("s3fifo, kvd one at a time",
     lambda t, c: one_at_a_time(t, KvdOneAtATime("s3fifo", c))),
    ("s3fifo, kvd prefix protocol", lambda t, c: replay(t, c, "s3fifo").hit_fraction),
]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--capacity", default="2000,5000,10000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.capacity.split(",")]
    trace = load_trace(args.trace)
    got = {name: [round(run(trace, c), 4) for c in caps] for name, run in ROWS}
    if args.json:
        print(json.dumps({"trace": args.trace, "capacities": caps, "hit_fraction": got}))
        return 0
    width = max(map(len, got))
    print(f"{'prefix-hit fraction':<{width}}  " + "  ".join(f"{c:>7,}" for c in caps))
    for name, row in got.items():
        print(f"{name:<{width}}  " + "  ".join(f"{h:7.3f}" for h in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
