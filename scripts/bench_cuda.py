"""GPU store/load bandwidth of kvd's CUDA engine, beside a pinned cudaMemcpyAsync baseline.

For a GPU machine (NOT YET RUN ON HARDWARE). A spawned worker process allocates KV
memory with cuMemAlloc and exports it through ``kvd_client.cuda`` (IPC handles and an
event ring), exactly as a vLLM worker would; this process runs ``CudaEngine`` against a
pinned pool (``PoolPinner``) and, for each block size, stores every block into slots in
a shuffled order (nothing coalesces) and loads them back. Bandwidth counts payload bytes
from submit to the last completion. The baseline, measured in the same run on the same
device, is one contiguous cudaMemcpyAsync of the same number of bytes between device
memory and pinned host memory, per direction. Goal: >= 0.90 of the baseline.

    python scripts/bench_cuda.py [--total 1G] [--repeat 5] [--quick] [--json]

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
from _bench import emit  # noqa: E402

from kvd.config import parse_size  # noqa: E402
from kvd_client.cudart import CudaUnavailable, load  # noqa: E402

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


def run(total: int, repeat: int, sizes: list[int]) -> tuple[list[dict], dict]:
    from kvd.engines.base import CopyJob
    from kvd.engines.cuda import CudaEngine
    from kvd.pinning import PoolPinner
    from kvd_proto import messages as m

    api = load()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, total), daemon=True)
    proc.start()
    pool = np.zeros(total, np.uint8)
    pinner = PoolPinner(pool.ctypes.data, total, api)
    pinner.start()
    pinner.wait()
    api.set_current_context(api.retain_primary_context(0))
    from cuda.bindings import driver as drv

    err, own = drv.cuMemAlloc(total)
    d2h, h2d = baseline(api, int(own), pool.ctypes.data, total, repeat)
    drv.cuMemFree(own)
    rows = []
    rng = np.random.default_rng(0)
    for i, page in enumerate(sizes):
        conn.send(page)
        regions, handles = conn.recv()
        done: list = []
        engine = CudaEngine(lambda j, e, s: done.append(e), api)
        reg = m.Register(1, m.Fingerprint("bench", "u8", "u8", 16, 1, [page], "h", b""), 0,
                         [], regions, [])
        (base,) = engine.attach(i, proc.pid, reg)
        n = total // page
        blocks = np.arange(n, dtype=np.uint64)
        slots = rng.permutation(n).astype(np.uint64)
        lengths = np.full(n, page, np.uint64)
        pool_addr = np.uint64(pool.ctypes.data) + slots * np.uint64(page)
        remote = np.uint64(base) + blocks * np.uint64(page)
        result = {"block_kib": page >> 10, "blocks": n}
        for name, direction in (("store", m.Direction.STORE), ("load", m.Direction.LOAD)):
            times = []
            for _ in range(repeat):
                job = CopyJob(i, 0, 0, direction, proc.pid, pool_addr, remote, lengths,
                              slots.astype(np.int64))
                before = len(done)
                t0 = time.perf_counter()
                engine.submit(job)
                _wait(done, before + 1)
                times.append(time.perf_counter() - t0)
                assert done[-1] is None, done[-1]
            result[f"{name}_gbps"] = total / statistics.median(times) / 1e9
        result["store_ratio"] = result["store_gbps"] / d2h
        result["load_ratio"] = result["load_gbps"] / h2d
        rows.append(result)
        engine.detach(i)
        engine.close()
    conn.send(None)
    proc.join(30)
    pinner.release()
    extra = {"baseline_d2h_gbps": round(d2h, 2), "baseline_h2d_gbps": round(h2d, 2),
             "pinned": pinner.status()["state"], "driver": api.driver_version(),
             "batched": api.has_batch_copy(), "goal": ">= 0.90 of the baseline"}
    return rows, extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total", default="1G", help="bytes moved per run (default 1G)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64M, 2 repeats, 2 sizes")
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
    rows, extra = run(total, repeat, sizes)
    emit(rows, [("block_kib", "block KiB", "d"), ("blocks", "blocks", "d"),
                ("store_gbps", "store GB/s", ".2f"), ("store_ratio", "x D2H", ".2f"),
                ("load_gbps", "load GB/s", ".2f"), ("load_ratio", "x H2D", ".2f")],
         args.json, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
