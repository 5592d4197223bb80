"""Store and load throughput through a real kvd, beside local memcpy in the same run.

For each block size: a client process registers KV memory, a scheduler connection
allocates slots, the client stores every block (random engine block order, so nothing
coalesces) and then loads them into another region. Throughput counts payload bytes
from the first Transfer sent to the last Done received. The baseline is a single
memcpy (numpy copyto) of the same number of bytes, measured in the same run; beside it,
the ceiling under kvd: the daemon's own copy function (``vm_copy``, process_vm_readv)
run by as many threads as the daemon has copy threads, on the same block size and
order, with no daemon around it ("syscall", into private memory as memcpy's): store /
syscall is what the daemon's machinery (its loop, index, policy and threads on the same
cores) leaves of it. "pool syscall store / load" run the same copies with this side's
memory a real ``kvd.pool.Pool`` (a shared mapping of a /dev/shm file, as the daemon's
pool), in both directions: the ceiling with the daemon's own kind of memory.

    python scripts/bench_transfer.py [--total 256M] [--json]
Targets: >= 0.70 of memcpy at >= 64 KiB blocks, >= 0.50 at 16 KiB.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import daemon, emit  # noqa: E402
from _chaos import Waiter  # noqa: E402

from kvd.config import parse_size  # noqa: E402
from kvd.engines.host import vm_copy  # noqa: E402
from kvd.pool import Pool  # noqa: E402
from kvd_client import Connection, host_regions  # noqa: E402
from kvd_proto import messages as m  # noqa: E402
from kvd_proto.ids import pack_u32, unpack_u32  # noqa: E402

SIZES = [16 << 10, 64 << 10, 256 << 10, 2 << 20]
EVENTS = itertools.count(1)


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


HOLDER = ("import numpy as np, sys; a = np.ones(int(sys.argv[1]), np.uint8); "
          "print(a.ctypes.data, flush=True); sys.stdin.read()")


def syscall_gbps(nbytes: int, block: int, threads: int, repeat: int,
                 direction: m.Direction, pool: bool) -> float:
    """The ceiling under kvd: ``threads`` threads copying ``block``-sized pieces, in
    random order, out of (store) or into (load) another process with the daemon's own
    ``vm_copy`` (one system call per 4 MiB, as its copy threads do), with no daemon
    around it. ``pool``: this side's memory is a ``kvd.pool.Pool`` (a shared mapping of
    a /dev/shm file, as the daemon's); else private anonymous memory, as memcpy's."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(nbytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mapping = Pool(f"/dev/shm/kvd-bench-ceiling-{os.getpid()}.pool", nbytes) if pool else None
    try:
        assert holder.stdout is not None
        far = int(holder.stdout.readline())
        local = mapping.array if mapping is not None else np.ones(nbytes, dtype=np.uint8)
        n = nbytes // block
        order = np.random.default_rng(3).permutation(n).astype(np.uint64)
        per = max(1, (4 << 20) // block)
        pieces = [(i, min(n, i + per)) for i in range(0, n, per)]
        lengths = np.full(n, block, dtype=np.uint64)
        base = local.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(block)
        remote = far + order * np.uint64(block)

        def work(mine: list[tuple[int, int]]) -> None:
            for lo, hi in mine:
                vm_copy(direction, holder.pid, base[lo:hi], remote[lo:hi], lengths[lo:hi])

        best = float("inf")
        for _ in range(repeat):
            workers = [threading.Thread(target=work, args=(pieces[t::threads],))
                       for t in range(threads)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    finally:
        holder.kill()
        holder.wait()
        if mapping is not None:
            mapping.close(unlink=True)  # a view still alive keeps the mapping, not the file


def timed_transfers(conn: Connection, waiter: Waiter, direction: m.Direction,
                    blocks: np.ndarray, slots: np.ndarray, per: int) -> float:
    """Send every block in Transfers of ``per`` blocks; seconds until the last Done."""
    events = []
    t0 = time.perf_counter()
    for i in range(0, len(blocks), per):
        event = next(EVENTS)
        events.append(event)
        conn.send(m.Transfer(conn.next_req(), event, direction,
                             pack_u32(blocks[i:i + per]), pack_u32(slots[i:i + per])))
    done = [waiter.wait(e, 120) for e in events]
    seconds = time.perf_counter() - t0
    bad = [d for d in done if d is None or d.code != m.Code.OK]
    assert not bad, bad[0]
    return seconds


def run_size(sock: str, block: int, total: int, batch: int, repeat: int) -> dict:
    n = total // block
    fp = m.Fingerprint(model=f"bench-{block}", dtype="bf16", kv_dtype="bf16",
                       block_tokens=16, tp_size=1, rank_page_bytes=[block],
                       hash_algo="sha256", root_hash=b"")
    src = np.random.default_rng(1).integers(0, 255, (n, block), dtype=np.uint8)
    dst = np.ones((n, block), dtype=np.uint8)  # written once: pages are resident
    waiter = Waiter()
    reg_src = m.Register(0, fp, 0, host_regions([src]))
    reg_dst = m.Register(0, fp, 0, host_regions([dst]))
    sched = Connection(sock, register=m.Register(0, fp, -1), timeout=30)
    a = Connection(sock, register=reg_src, on_done=waiter, timeout=30)
    b = Connection(sock, register=reg_dst, on_done=waiter, timeout=30)
    assert sched.wait_up(10) and a.wait_up(10) and b.wait_up(10)
    rng = np.random.default_rng(2)
    per = max(1, batch // block)
    store_s, load_s = [], []
    try:
        for rep in range(repeat):
            keys = [f"{block}-{rep}-{i}".encode().ljust(36, b"\0") for i in range(n)]
            slots = np.concatenate([
                unpack_u32(sched.request(m.Allocate(sched.next_req(), keys[i:i + 8192])).slots)
                for i in range(0, n, 8192)])
            order = rng.permutation(n)
            store_s.append(timed_transfers(a, waiter, m.Direction.STORE, order, slots, per))
            hit = sched.request(m.Lookup(sched.next_req(), keys))
            assert hit.hits == n
            hslots = unpack_u32(hit.slots)
            dorder = rng.permutation(n)
            load_s.append(timed_transfers(b, waiter, m.Direction.LOAD, dorder, hslots, per))
            # Correctness: dst[dorder[j]] == src[order[j]].
            j = rng.integers(0, n, 16)
            assert (dst[dorder[j]] == src[order[j]]).all(), "loaded bytes differ"
            sched.request(m.Release(sched.next_req(), hit.lease))
            sched.request(m.Evict(sched.next_req(), -1))
    finally:
        for c in (a, b, sched):
            c.close()
    nbytes = n * block
    return {"block_kib": block // 1024, "blocks": n,
            "store_gbps": nbytes / min(store_s) / 1e9, "load_gbps": nbytes / min(load_s) / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", default="256M", help="bytes moved per direction and size")
    p.add_argument("--batch", default="16M", help="bytes per Transfer message")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--copy-threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    total, batch = parse_size(args.total), parse_size(args.batch)
    pool = max(4 * total, 1 << 30)
    rows = []
    with daemon("--pool-size", str(pool), "--extent-size", "64M",
                "--copy-threads", str(args.copy_threads)) as (sock, _):
        for block in SIZES:
            base = memcpy_gbps(total, 5)
            ceiling = syscall_gbps(total, block, args.copy_threads, 3, m.Direction.STORE,
                                   pool=False)
            store_ceiling = syscall_gbps(total, block, args.copy_threads, 3,
                                         m.Direction.STORE, pool=True)
            load_ceiling = syscall_gbps(total, block, args.copy_threads, 3,
                                        m.Direction.LOAD, pool=True)
            r = run_size(sock, block, total, batch, args.repeat)
            r["memcpy_gbps"] = base
            r["syscall_gbps"] = ceiling
            r["pool_store_gbps"] = store_ceiling
            r["pool_load_gbps"] = load_ceiling
            r["store_ratio"] = r["store_gbps"] / base
            r["load_ratio"] = r["load_gbps"] / base
            r["store_of_syscall"] = r["store_gbps"] / ceiling
            r["store_of_pool"] = r["store_gbps"] / store_ceiling
            r["load_of_pool"] = r["load_gbps"] / load_ceiling
            target = 0.70 if block >= 64 << 10 else 0.50
            r["target"] = target
            r["ok"] = "yes" if min(r["store_ratio"], r["load_ratio"]) >= target else "NO"
            rows.append(r)
    emit(rows, [("block_kib", "block KiB", "d"), ("blocks", "blocks", "d"),
                ("memcpy_gbps", "memcpy GB/s", ".2f"), ("store_gbps", "store GB/s", ".2f"),
                ("load_gbps", "load GB/s", ".2f"), ("store_ratio", "store/memcpy", ".2f"),
                ("load_ratio", "load/memcpy", ".2f"), ("syscall_gbps", "syscall GB/s", ".2f"),
                ("store_of_syscall", "store/syscall", ".2f"),
                ("pool_store_gbps", "pool syscall store", ".2f"),
                ("pool_load_gbps", "pool syscall load", ".2f"),
                ("store_of_pool", "store/pool sc", ".2f"), ("load_of_pool", "load/pool sc", ".2f"),
                ("target", "target", ".2f"),
                ("ok", "met", "s")],
         args.json, {"copy_threads": args.copy_threads, "total_bytes": total})
    return 0


if __name__ == "__main__":
    sys.exit(main())
