"""The CUDA data path on a real GPU: a worker process exports memory, this one copies.

Skipped without a GPU (CI has none); passed on an H200 on 2026-11-26
(docs/gpu_verified.md). Run on a GPU node with

    .venv/bin/python -m pytest tests/engines/test_cuda_gpu.py -m gpu -v

The worker is a child process (legacy CUDA IPC handles cannot be opened by the process
that exported them). It allocates with cuMemAlloc, fills block b of layer l with the
byte (16*l + b + 1), exports regions and an event ring through ``kvd_client.cuda``,
records an event, and waits; this process stores, checks the pool, loads a pattern
into another block, and the child checks it.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from kvd_client.cudart import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")]

PAGES = (65536, 16384)
BLOCKS = 16


def _worker(conn) -> None:  # runs in the child (spawned: fresh CUDA state)
    from cuda.bindings import driver as drv

    from kvd_client.cudart import load
    from kvd_client.cuda import EventRing, GpuTensor, export_regions

    api = load()
    ctx = api.retain_primary_context(0)
    api.set_current_context(ctx)
    tensors = []
    for layer, page in enumerate(PAGES):
        err, ptr = drv.cuMemAlloc(page * BLOCKS)
        assert int(err) == 0
        for b in range(BLOCKS):
            drv.cuMemsetD8(int(ptr) + b * page, (16 * layer + b + 1) % 256, page)
        tensors.append(GpuTensor(int(ptr), BLOCKS, page, page))
    ring = EventRing(4, api)
    ev = ring.record_next(0)  # the legacy default stream: ordered after the memsets
    conn.send((export_regions(tensors, api), ring.handles, ev))
    block, layer = conn.recv()  # the parent loaded 0xEE into this block: check it
    out = np.zeros(PAGES[layer], np.uint8)
    drv.cuMemcpyDtoH(out.ctypes.data, tensors[layer].ptr + block * PAGES[layer], PAGES[layer])
    conn.send(bool((out == 0xEE).all()))
    conn.recv()


@pytest.fixture
def worker():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child,), daemon=True)
    proc.start()
    yield parent, proc
    parent.send(None)
    proc.join(30)


def _job(direction, bases, pool_base, blocks, slots, cuda_event=-1):
    from kvd.engines.base import CopyJob

    rank_bytes = sum(PAGES)
    page_off = np.array([0, PAGES[0]], np.uint64)
    slots = np.array(slots, np.uint64)
    blocks = np.array(blocks, np.uint64)
    pool = np.uint64(pool_base) + slots[:, None] * np.uint64(rank_bytes) + page_off[None, :]
    remote = np.array(bases, np.uint64)[None, :] + blocks[:, None] * np.array(
        PAGES, np.uint64)[None, :]
    lengths = np.broadcast_to(np.array(PAGES, np.uint64), remote.shape).ravel().copy()
    return CopyJob(1, 1, 1, direction, 0, pool.ravel(), remote.ravel(), lengths,
                   slots.astype(np.int64), cuda_event)


def test_store_and_load_through_ipc(worker):
    from kvd.engines.cuda import CudaEngine
    from kvd_client.cudart import load
    from kvd.pinning import PoolPinner
    from kvd_proto import messages as m

    conn, proc = worker
    regions, handles, ev = conn.recv()
    pool = np.zeros(sum(PAGES) * 8, np.uint8)
    api = load()
    pinner = PoolPinner(pool.ctypes.data, pool.nbytes, api)
    pinner.start()
    assert pinner.wait(60) and pinner.status()["state"] == "done", pinner.status()
    done, waited = [], []
    engine = CudaEngine(lambda j, e, s: done.append(e), api, on_waited=waited.append)
    reg = m.Register(1, m.Fingerprint("m", "u8", "u8", 16, 1, list(PAGES), "h", b""), 0, [],
                     regions, handles)
    bases = engine.attach(1, proc.pid, reg)
    engine.submit(_job(m.Direction.STORE, bases, pool.ctypes.data, [3, 9], [0, 5], ev))
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == [None] and len(waited) == 1
    rank = sum(PAGES)
    assert (pool[0:PAGES[0]] == 4).all()  # layer 0, block 3
    assert (pool[5 * rank + PAGES[0]:6 * rank] == (16 + 9 + 1)).all()  # layer 1, block 9
    pool[7 * rank:8 * rank] = 0xEE
    engine.submit(_job(m.Direction.LOAD, bases, pool.ctypes.data, [12], [7]))
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == [None, None]
    conn.send((12, 1))
    assert conn.recv() is True
    engine.detach(1)
    engine.close()
    pinner.release()


def test_bandwidth_script_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_cuda.py"
    out = subprocess.run([sys.executable, str(script), "--quick", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
