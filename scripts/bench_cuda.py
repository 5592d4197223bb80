"""GPU store/load bandwidth of kvd's CUDA engine, beside a pinned cudaMemcpyAsync baseline.

For a GPU machine (an H200's figures: docs/gpu_verified.md). A spawned worker process
allocates KV memory with cuMemAlloc and exports it through ``kvd_client.cuda`` (IPC
handles and an event ring), exactly as a vLLM worker would; this process runs
``CudaEngine`` against a pinned pool (``PoolPinner``) and, for each block size, stores
every block into slots in a shuffled order (nothing coalesces) and loads them back.
Bandwidth counts payload bytes from submit to the last completion. The baseline,
measured in the same run on the same device, is one contiguous cudaMemcpyAsync of the
same number of bytes between device memory and pinned host memory, per direction.
Goal: >= 0.90 of the baseline. Beside it: the same copies with the per-run fallback
(one cudaMemcpyAsync per run, as on drivers older than 12.8) and, at the largest size,
into a pool that was never pinned.

    python scripts/bench_cuda.py [--total 1G] [--repeat 5] [--quick] [--no-fallback] [--json]

Without a GPU it prints why and exits 0 (``{"skipped": ...}`` with --json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import emit
from kvd_client.cudart import CudaUnavailable, load

from kvd.config import parse_size

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]


def _worker(conn, nbytes: int) -> None:
    """The exporting process: one allocation, exported; holds it until told to stop."""
    from cuda.bindings import driver as drv
    from kvd_client.cuda import EventRing, GpuTensor, export_regions

    api = load()
    api.set_current_context(api.retain_primary_context(0))
    err, ptr = drv.cuMemAlloc(nbytes)
    if int(err):
        conn.send(f"cuMemAlloc failed: {err}")
        return
    ring = EventRing(4, api)
    while (msg := conn.recv()) is not None:
        page = msg
        t = GpuTensor(int(ptr), nbytes // page, page, page)
        conn.send((export_regions([t], api), ring.handles))
    drv.cuMemFree(ptr)


def _wait(done: list, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(done) < n:
        if time.monotonic() > deadline:
            raise RuntimeError("copies did not complete")
        time.sleep(20e-6)


def baseline(api, dev_ptr: int, host_ptr: int, nbytes: int, repeat: int) -> tuple[float, float]:
    """GB/s of one contiguous cudaMemcpyAsync device->host and host->device."""
    stream = api.stream_create()
    out = []
    for dst, src in ((host_ptr, dev_ptr), (dev_ptr, host_ptr)):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            api.memcpy_async(dst, src, nbytes, stream)
            api.stream_synchronize(stream)
            times.append(time.perf_counter() - t0)
        out.append(nbytes / statistics.median(times) / 1e9)
    api.stream_destroy(stream)
    return out[0], out[1]


class _PerRun:
    """The driver seam without ``cuMemcpyBatchAsync``: the < 12.8 fallback (one
    cudaMemcpyAsync per coalesced run), measured on the same driver."""

    def __init__(self, api) -> None:
        self._api = api

    def has_batch_copy(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._api, name)


def _engine_gbps(api, proc, conn, pool_base: int, total: int, page: int, repeat: int,
                 client: int, rng) -> dict:
    """Store every block of ``page`` bytes into shuffled slots of the pool, then load them
    back, ``repeat`` times each; GB/s per direction (median)."""
    from kvd_proto import messages as m

    from kvd.engines.base import CopyJob
    from kvd.engines.cuda import CudaEngine

    conn.send(page)
    regions, _ = conn.recv()
    done: list = []
    engine = CudaEngine(lambda j, e, s: done.append(e), api)
    reg = m.Register(1, m.Fingerprint("bench", "u8", "u8", 16, 1, [page], "h", b""), 0,
                     [], regions, [])
    (base,) = engine.attach(client, proc.pid, reg)
    n = total // page
    blocks = np.arange(n, dtype=np.uint64)
    slots = rng.permutation(n).astype(np.uint64)
    lengths = np.full(n, page, np.uint64)
    pool_addr = np.uint64(pool_base) + slots * np.uint64(page)
    remote = np.uint64(base) + blocks * np.uint64(page)
    out = {}
    try:
        for name, direction in (("store", m.Direction.STORE), ("load", m.Direction.LOAD)):
            times = []
            for _ in range(repeat):
                job = CopyJob(client, 0, 0, direction, proc.pid, pool_addr, remote, lengths,
                              slots.astype(np.int64))
                before = len(done)
                t0 = time.perf_counter()
                engine.submit(job)
                _wait(done, before + 1)
                times.append(time.perf_counter() - t0)
                assert done[-1] is None, done[-1]
            out[name] = total / statistics.median(times) / 1e9
    finally:
        engine.detach(client)
        engine.close()
    return out


def run(total: int, repeat: int, sizes: list[int], fallback: bool = True
        ) -> tuple[list[dict], dict]:
    from kvd.pinning import PoolPinner

    api = load()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, total), daemon=True)
    proc.start()
    pool = np.zeros(total, np.uint8)
    pinner = PoolPinner(pool.ctypes.data, total, api)
    t0 = time.perf_counter()
    pinner.start()
    pinner.wait()
    pin_seconds = time.perf_counter() - t0
    api.set_current_context(api.retain_primary_context(0))
    from cuda.bindings import driver as drv

    err, own = drv.cuMemAlloc(total)
    if int(err):
        raise RuntimeError(f"cuMemAlloc of the baseline's buffer failed: {err}")
    d2h, h2d = baseline(api, int(own), pool.ctypes.data, total, repeat)
    rows = []
    rng = np.random.default_rng(0)
    client = 0
    for page in sizes:
        row = {"block_kib": page >> 10, "blocks": total // page}
        client += 1
        got = _engine_gbps(api, proc, conn, pool.ctypes.data, total, page, repeat, client, rng)
        row.update(store_gbps=got["store"], store_ratio=got["store"] / d2h,
                   load_gbps=got["load"], load_ratio=got["load"] / h2d)
        if fallback:
            client += 1
            per_run = _engine_gbps(_PerRun(api), proc, conn, pool.ctypes.data, total, page,
                                   repeat, client, rng)
            row.update(store_per_run_gbps=per_run["store"], load_per_run_gbps=per_run["load"])
        rows.append(row)
    # Pinned against pageable: the same copies into a pool that was never registered.
    unpinned = np.zeros(total, np.uint8)
    unpinned[::4096] = 1  # faulted in, as a daemon's pool is
    page = max(sizes)
    client += 1
    pageable = _engine_gbps(api, proc, conn, unpinned.ctypes.data, total, page, repeat, client,
                            rng)
    u_d2h, u_h2d = baseline(api, int(own), unpinned.ctypes.data, total, repeat)
    drv.cuMemFree(own)
    conn.send(None)
    proc.join(30)
    pinner.release()
    extra = {"baseline_d2h_gbps": round(d2h, 2), "baseline_h2d_gbps": round(h2d, 2),
             "pinned": pinner.status()["state"], "pin_seconds": round(pin_seconds, 3),
             "driver": api.driver_version(), "batched": api.has_batch_copy(),
             "unpinned": {"block_kib": page >> 10,
                          "store_gbps": round(pageable["store"], 2),
                          "load_gbps": round(pageable["load"], 2),
                          "memcpy_d2h_gbps": round(u_d2h, 2),
                          "memcpy_h2d_gbps": round(u_h2d, 2)},
             "goal": ">= 0.90 of the baseline"}
    return rows, extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total", default="1G", help="bytes moved per run (default 1G)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64M, 2 repeats, 2 sizes")
    ap.add_argument("--no-fallback", action="store_true",
                    help="skip the per-run (cudaMemcpyAsync) fallback columns")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        load()
    except CudaUnavailable as e:
        msg = f"skipped: no usable CUDA GPU ({e})"
        print(json.dumps({"skipped": msg}) if args.json else msg)
        return 0
    total, repeat, sizes = parse_size(args.total), args.repeat, SIZES
    if args.quick:
        total, repeat, sizes = 64 << 20, 2, [64 << 10, 2 << 20]
    rows, extra = run(total, repeat, sizes, fallback=not args.no_fallback)
    cols = [("block_kib", "block KiB", "d"), ("blocks", "blocks", "d"),
            ("store_gbps", "store GB/s", ".2f"), ("store_ratio", "x D2H", ".2f"),
            ("load_gbps", "load GB/s", ".2f"), ("load_ratio", "x H2D", ".2f")]
    if not args.no_fallback:
        cols += [("store_per_run_gbps", "store per-run", ".2f"),
                 ("load_per_run_gbps", "load per-run", ".2f")]
    emit(rows, cols, args.json, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
