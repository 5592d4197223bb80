"""Many concurrent clients doing a mix of real operations; zero errors allowed.

Each client process has a scheduler and a worker connection over private memory and
runs a random mix: store a chain of blocks (Allocate + Transfer), look a chain up
(Lookup, then load the hits and Release), or Ping. Latency is per operation round
trip (a store or load counts until its Done). Every error reply, failed Done,
timeout or corrupt block counts as an error.

    python scripts/bench_load.py --clients 32 --ops 10000 [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import DaemonProc, emit, pct  # noqa: E402
from _chaos import Client, key_of  # noqa: E402

from kvd_client import KvdClientError  # noqa: E402
from kvd_proto import messages as m  # noqa: E402


def _client(socket: str, n: int, seed: int, start, out) -> None:
    rng = random.Random(seed)
    c = Client(socket, blocks=64, timeout=10)
    c.up(30)
    lat: dict[str, list[float]] = {"store": [], "lookup+load": [], "ping": []}
    errors: list[str] = []
    chains: list[list[int]] = []
    base = seed << 40
    start.wait()
    for op in range(n):
        kind = rng.choices(["store", "lookup+load", "ping"], [3, 5, 2])[0]
        t0 = time.perf_counter()
        try:
            if kind == "store":
                ids = list(range(base + op * 64, base + op * 64 + rng.randrange(1, 16)))
                done = c.store(ids, timeout=30)
                if len(done) != len(ids):
                    errors.append(f"store committed {len(done)} of {len(ids)}")
                chains.append(ids)
            elif kind == "lookup+load" and chains:
                hits, corrupt = c.verify(rng.choice(chains), timeout=30)
                if corrupt:
                    errors.append(f"{corrupt} corrupt blocks")
            else:
                kind = "ping"
                c.sched.request(m.Ping(c.sched.next_req()), 10)
        except (KvdClientError, AssertionError) as e:
            errors.append(f"{kind}: {e}")
        lat[kind].append(time.perf_counter() - t0)
    c.close()
    out.put((lat, errors))


def run(socket: str, clients: int, ops: int) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(socket, ops, i + 1, start, out))
             for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(3 + clients * 0.15)  # every client connected before the clock starts
    t0 = time.perf_counter()
    start.set()
    results = [out.get(timeout=3600) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    lat: dict[str, list[float]] = {}
    errors: list[str] = []
    for ls, es in results:
        for k, v in ls.items():
            lat.setdefault(k, []).extend(v)
        errors += es
    rows = [{"op": k, "count": len(v), "p50_ms": pct(v, 0.5) * 1e3,
             "p99_ms": pct(v, 0.99) * 1e3} for k, v in sorted(lat.items())]
    return {"rows": rows, "errors": len(errors), "first_errors": errors[:5],
            "ops": sum(len(v) for v in lat.values()), "seconds": round(elapsed, 1),
            "ops_per_s": round(sum(len(v) for v in lat.values()) / elapsed)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--pool-size", default="2G")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    d = DaemonProc("--pool-size", args.pool_size, "--extent-size", "16M",
                   "--log-level", "warning")
    try:
        d.start()
        res = run(d.socket, args.clients, args.ops)
    finally:
        d.cleanup()
    rows = res.pop("rows")
    res["clients"] = args.clients
    emit(rows, [("op", "op", "s"), ("count", "count", "d"), ("p50_ms", "p50 ms", ".2f"),
                ("p99_ms", "p99 ms", ".2f")], args.json, res)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
