"""The GPU data path end to end on a real GPU: a real ``kvd serve`` with its CUDA engine,
worker processes holding torch KV tensors (``tests/engines/gpu_worker.py``), real IPC.

Skipped without a GPU (every development machine). Run on a GPU node with

    python -m pytest tests/engines -m gpu -v
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from kvd_client import Connection
from kvd_client.cudart import gpu_available
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

from tests.engines.gpu_worker import GpuSpec, GpuWorker, fingerprint, page_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")]


def _status_when(daemon, ok, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = daemon.status()
        if ok(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


@pytest.fixture
def gpu_daemon(daemon_factory):
    d = daemon_factory()
    st = _status_when(d, lambda s: s["pinning"]["state"] in ("done", "failed"))
    assert "cuda" in st["data_paths"], st["data_paths"]
    assert st["pinning"]["state"] == "done", st["pinning"]
    return d


class Scheduler:
    """The scheduler side of one tenant: Allocate and Lookup, as KvdOffloadingManager."""

    def __init__(self, daemon, spec: GpuSpec) -> None:
        self.conn = Connection(daemon.socket, name="sched",
                               register=m.Register(0, fingerprint(spec), -1))
        assert self.conn.wait_up(20)

    def allocate(self, keys: list[bytes]) -> list[int]:
        r = self.conn.request(m.Allocate(self.conn.next_req(), keys), 20)
        assert isinstance(r, m.Allocated) and r.allocated == len(keys), r
        return unpack_u32(r.slots).tolist()

    def lookup(self, keys: list[bytes]) -> tuple[int, list[int], int]:
        r = self.conn.request(m.Lookup(self.conn.next_req(), keys), 20)
        assert isinstance(r, m.LookupOk), r
        return r.hits, unpack_u32(r.slots).tolist(), r.lease

    def close(self) -> None:
        self.conn.close()


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(36, b"\0") for i in range(n)]


@pytest.fixture
def workers():
    made: list[GpuWorker] = []

    def make(spec: GpuSpec) -> GpuWorker:
        w = GpuWorker(spec)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _registered(w: GpuWorker) -> m.Registered:
    got = w.register()
    assert got[0] == "registered", got
    return got[1]


def test_startup_check_accepts_this_node_and_names_the_versions(gpu_daemon):
    import torch
    from cuda import bindings
    from kvd_client.cudart import load, version_refusal

    api = load()
    driver, runtime = api.driver_version(), api.runtime_version()
    assert version_refusal(driver, runtime) is None
    print(f"driver CUDA {driver}, cuda-bindings {bindings.__version__} (runtime {runtime}), "
          f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    assert gpu_daemon.status()["cuda"] == {"gpus": 0, "lost_gpus": 0, "clients": 0,
                                           "gone_clients": 0,
                                           "retiring": 0, "ipc_memory": 0, "ipc_events": 0}


@pytest.mark.parametrize("layout", ["layers", "packed"])
def test_torch_tensors_at_offsets_store_then_load_exactly(gpu_daemon, workers, layout):
    spec = GpuSpec(gpu_daemon.socket, layout=layout)
    sched = Scheduler(gpu_daemon, spec)
    a = workers(spec)
    b = workers(GpuSpec(gpu_daemon.socket, layout=layout, seed=None))
    try:
        # The caching allocator put tensors inside larger allocations, at offsets.
        assert any(a.info["offsets"]), a.info
        assert a.info["allocations"] < len(a.info["offsets"]) or layout == "packed"
        _registered(a)
        _registered(b)
        ks = keys(16, f"t-{layout}")
        slots = sched.allocate(ks)
        src, dst = list(range(3, 19)), list(range(40, 56))
        done = a.store(1, src, slots)
        assert done[1] == 0, done
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 16
        assert b.digest(dst) != a.digest(src)
        done = b.load(2, dst, hit_slots, lease)
        assert done[1] == 0 and done[3] == 16 * sum(page_bytes(spec)), done
        assert b.digest(dst) == a.digest(src)
        st = gpu_daemon.status()
        assert st["cuda"]["clients"] == 2 and st["cuda"]["gpus"] == 1, st["cuda"]
        assert st["cuda"]["ipc_memory"] == a.info["allocations"] + b.info["allocations"]
    finally:
        sched.close()


def test_stores_copy_what_the_forward_pass_wrote_last(gpu_daemon, workers):
    """A "forward pass" of ~300 ms writes the blocks; the Transfer leaves at once. The
    daemon's copy waits on the worker's event: the pool gets the final bytes. Then many
    such stores in a row through a ring of 2 events (reused as soon as the daemon passed
    each wait)."""
    spec = GpuSpec(gpu_daemon.socket, ring=2)
    sched = Scheduler(gpu_daemon, spec)
    a = workers(spec)
    b = workers(GpuSpec(gpu_daemon.socket, seed=None))
    try:
        _registered(a)
        _registered(b)
        ks = keys(4, "order")
        slots = sched.allocate(ks)
        assert a.call("fill", [0, 1, 2, 3], 0)[0] == "filled"  # stale bytes, on the GPU
        done = a.store(1, [0, 1, 2, 3], slots, sleep_s=0.3, value=77)
        assert done[1] == 0, done
        assert done[4] >= 0.08, f"Done {done[4]:.3f}s after the send: no wait?"
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 4
        assert b.load(2, [10, 11, 12, 13], hit_slots, lease)[1] == 0
        assert b.digest([10, 11, 12, 13]) == a.digest([0, 1, 2, 3])

        n = 24
        ks = keys(2 * n, "reuse")
        slots = sched.allocate(ks)
        sent = [a.store(100 + i, [2 * i, 2 * i + 1], slots[2 * i:2 * i + 2], sleep_s=0.02,
                        value=i + 1, wait=False) for i in range(n)]
        assert all(s[1] for s in sent), sent
        recorded = [s[2] for s in sent]
        assert any(e >= 0 for e in recorded), recorded  # the ring was used, not only syncs
        for i in range(n):
            done = a.wait(100 + i)
            assert done[1] == 0, (i, done)
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 2 * n
        assert b.load(3, range(2 * n), hit_slots, lease)[1] == 0
        assert b.digest(range(2 * n)) == a.digest(range(2 * n))
        print(f"ring of 2: events recorded {sum(e >= 0 for e in recorded)}/{n}, "
              f"ring state {a.call('ring')}")
    finally:
        sched.close()


def test_killed_worker_with_a_store_on_its_event_blocks_nobody(gpu_daemon, workers):
    """kill -9 while the daemon's copy waits on the worker's event (a 5 s forward pass):
    another client's stores on the same GPU complete, and the dead client's handles
    and slots are released."""
    spec = GpuSpec(gpu_daemon.socket)
    sched = Scheduler(gpu_daemon, spec)
    a = workers(spec)
    b = workers(GpuSpec(gpu_daemon.socket, seed=2))
    try:
        _registered(a)
        _registered(b)
        ka, kb = keys(8, "dead"), keys(8, "alive")
        sa, sb = sched.allocate(ka), sched.allocate(kb)
        assert a.call("fill", list(range(8)), 0)[0] == "filled"
        sent = a.store(1, range(8), sa, sleep_s=5.0, value=9, wait=False)
        assert sent[1] and sent[2] >= 0, sent
        time.sleep(0.5)
        a.kill()
        t0 = time.monotonic()
        done = b.store(2, range(8), sb)
        assert done[1] == 0, done
        assert time.monotonic() - t0 < 3.0
        st = _status_when(gpu_daemon, lambda s: s["cuda"]["clients"] == 1
                          and s["cuda"]["gone_clients"] == 0 and s["cuda"]["retiring"] == 0,
                          timeout=30)
        assert st["cuda"]["clients"] == 1 and st["cuda"]["gone_clients"] == 0, st["cuda"]
        assert st["cuda"]["ipc_memory"] == b.info["allocations"], st["cuda"]
        assert st["cuda"]["ipc_events"] == b.spec.ring, st["cuda"]
        print(f"after the kill: {st['cuda']}")
        assert sched.lookup(ka)[0] == 0  # never READY
        assert sched.lookup(kb)[0] == 8
        assert b.call("cuda_ok")[1] == 4
        c = workers(GpuSpec(gpu_daemon.socket, seed=3))  # the GPU serves new clients
        _registered(c)
        kc = keys(8, "after")
        assert c.store(3, range(8), sched.allocate(kc))[1] == 0
        assert sched.lookup(kc)[0] == 8
        hits, hit_slots, lease = sched.lookup(kb)
        assert hits == 8
        assert c.load(4, range(20, 28), hit_slots, lease)[1] == 0
        assert c.digest(range(20, 28)) == b.digest(range(8))
    finally:
        sched.close()
    for w in (b, c):
        w.close()
    t0 = time.monotonic()
    assert gpu_daemon.stop(timeout=20) == 0  # SIGTERM: nothing left waiting on the dead
    print(f"daemon stopped in {time.monotonic() - t0:.1f}s")


def test_a_region_past_its_allocation_is_refused_without_a_sticky_error(gpu_daemon, workers):
    spec = GpuSpec(gpu_daemon.socket)
    sched = Scheduler(gpu_daemon, spec)
    a = workers(spec)
    b = workers(GpuSpec(gpu_daemon.socket, seed=None))
    try:
        got = a.register(overrun=100_000)
        assert got[0] == "error" and "reaches" in got[2], got
        st = gpu_daemon.status()
        assert st["cuda"]["ipc_memory"] == 0 and st["cuda"]["ipc_events"] == 0, st["cuda"]
        _registered(a)  # the same process, the right geometry: accepted
        _registered(b)
        ks = keys(8, "after-refusal")
        assert a.store(1, range(8), sched.allocate(ks))[1] == 0
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 8
        assert b.load(2, range(20, 28), hit_slots, lease)[1] == 0
        assert b.digest(range(20, 28)) == a.digest(range(8))
        assert a.call("cuda_ok")[1] == 4 and b.call("cuda_ok")[1] == 4
    finally:
        sched.close()


def test_client_side_copy_round_trips_bytes(gpu_daemon, workers):
    """Expandable segments: legacy IPC cannot export the KV cache (the driver says so, and
    kvd refuses it), so the worker registers client_copy and copies with ClientCopier;
    its bytes meet those of a daemon-copy worker both ways."""
    spec = GpuSpec(gpu_daemon.socket)
    sched = Scheduler(gpu_daemon, spec)
    a = workers(spec)
    c = workers(GpuSpec(gpu_daemon.socket, seed=None, client_copy=True,
                        alloc_conf="expandable_segments:True"))
    try:
        assert "expandable segments" in c.info["refused"], c.info
        assert not any(c.info["ipc_capable"]), c.info  # the driver's own answer
        assert all(a.info["ipc_capable"]), a.info
        _registered(a)
        reg = _registered(c)
        assert reg.pool_path and reg.slots_per_extent > 0
        ks = keys(8, "cc-in")
        assert a.store(1, range(8), sched.allocate(ks))[1] == 0
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 8
        assert c.load(2, range(20, 28), hit_slots, lease)[1] == 0
        assert c.digest(range(20, 28)) == a.digest(range(8))
        assert c.call("fill", [30, 31, 32, 33], 5)[0] == "filled"
        ks = keys(4, "cc-out")
        assert c.store(3, [30, 31, 32, 33], sched.allocate(ks))[1] == 0
        hits, hit_slots, lease = sched.lookup(ks)
        assert hits == 4
        assert a.load(4, [40, 41, 42, 43], hit_slots, lease)[1] == 0
        assert a.digest([40, 41, 42, 43]) == c.digest([30, 31, 32, 33])
    finally:
        sched.close()


def test_a_multi_gib_pool_is_pinned_in_chunks(daemon_factory):
    """In the daemon: a 2 GiB pool pinned in the background, its state in kvdctl status.
    Here: the pinner over 3 GiB in 1 GiB chunks (real cudaHostRegister calls)."""
    from kvd_client.cudart import load

    from kvd.pinning import PoolPinner

    d = daemon_factory("--pool-size", "2G")
    st = _status_when(d, lambda s: s["pinning"]["state"] in ("done", "failed"), timeout=120)
    pin = st["pinning"]
    assert pin["state"] == "done" and pin["pinned_bytes"] == 2 << 30, pin
    out = subprocess.run([sys.executable, "-m", "kvd.cli.ctl", "--socket", d.socket, "status"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    print(f"daemon: 2 GiB pinned in {pin['seconds']:.2f}s")
    buf = np.frombuffer(mmap.mmap(-1, 3 << 30), np.uint8)  # page-aligned, as the pool
    buf[::4096] = 1  # fault the pages in, as the daemon's pool is
    pinner = PoolPinner(buf.ctypes.data, buf.nbytes, load(), chunk_bytes=1 << 30)
    pinner.start()
    assert pinner.wait(120)
    s = pinner.status()
    assert s["state"] == "done" and s["chunks_done"] == s["chunks_total"] == 3, s
    print(f"pinner: 3 GiB in 3 chunks in {s['seconds']:.2f}s")
    pinner.release()
    assert pinner.status()["state"] == "released"
    assert os.path.exists(d.pool_path)
