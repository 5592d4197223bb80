"""The worker's GPU data paths and their fallbacks (issue 13, defect 2), on the fake driver.

vLLM must start and serve when the daemon cannot copy: memory legacy IPC cannot export
falls back to client-side copies (loads copied here, stores skipped), no usable CUDA to
no offloading (stores skipped, loads failed so vLLM recomputes them).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvd_client.cuda import GpuTensor  # noqa: E402
from kvd_client.cudart import gpu_available  # noqa: E402
from kvd_client.vllm import cuda_paths  # noqa: E402
from kvd_client.vllm.cuda_paths import ClientCopyPath, CudaPath, cuda_data_path  # noqa: E402
from kvd_client.vllm.off import OffloadOff  # noqa: E402
from kvd_proto import messages as m  # noqa: E402
from tests.engines.fake_cuda import FakeCuda  # noqa: E402

PAGE, BLOCKS = 1024, 4
FP = m.Fingerprint("m", "bf16", "bf16", 16, 1, [PAGE // 2, PAGE // 2], "h", b"")


@pytest.fixture
def fake():
    f = FakeCuda()
    f.set_current_context(0xC0)
    yield f
    f.shutdown()
    assert f.violations == []


@pytest.fixture
def compute(fake, monkeypatch):
    """vLLM's compute stream (torch's current stream on a GPU)."""
    stream = fake.stream_create()
    monkeypatch.setattr(cuda_paths, "compute_stream", lambda: stream)
    return stream


def test_d2_refused_export_falls_back_to_client_copies(fake, compute, tmp_path):
    t = GpuTensor(fake.alloc(PAGE * BLOCKS, ipc_capable=False), BLOCKS, PAGE, PAGE)
    path = cuda_data_path([t], fake)
    assert isinstance(path, ClientCopyPath)
    reg = path.register(FP, rank=0)
    assert reg.client_copy and "legacy-IPC" in reg.client_copy_reason
    assert not reg.cuda_regions
    pool = tmp_path / "pool"
    slot_bytes = PAGE
    data = np.zeros(1 << 16, np.uint8)
    data[3 * slot_bytes:4 * slot_bytes] = 0x5A  # slot 3
    pool.write_bytes(data.tobytes())
    conn = SimpleNamespace(registered=m.Registered(1, 1, slot_bytes, PAGE, str(pool),
                                                   1 << 16, 64))
    assert path.before_send(False, np.array([1]), np.zeros(0, np.uint32), conn) \
        == "client_copy"  # a store by ticket: its slots are the daemon's
    assert path.before_send(True, np.array([2]), np.array([3], np.uint32), conn) == ""
    assert (fake.buffer(t.ptr)[2 * PAGE:3 * PAGE] == 0x5A).all()  # copied before Transfer
    assert not fake.buffer(t.ptr)[:2 * PAGE].any()
    assert fake.registered  # from a pinned mapping
    path.close()
    assert not fake.registered


def test_a_client_copied_load_runs_after_the_compute_stream_and_checks_the_daemon_run(
        fake, compute, tmp_path):
    """vLLM may still be zeroing the blocks on its stream: the load's copy waits for it.
    A daemon restarted while the copy ran makes the load fail (vLLM recomputes)."""
    import threading

    t = GpuTensor(fake.alloc(PAGE * BLOCKS, ipc_capable=False), BLOCKS, PAGE, PAGE)
    path = cuda_data_path([t], fake)
    assert isinstance(path, ClientCopyPath)
    path.register(FP, rank=0)
    pool = tmp_path / "pool"
    data = np.zeros(1 << 16, np.uint8)
    data[3 * PAGE:4 * PAGE] = 0x5A
    pool.write_bytes(data.tobytes())
    reg = m.Registered(1, 1, PAGE, PAGE, str(pool), 1 << 16, 64)
    conn = SimpleNamespace(registered=reg)
    zeroing = fake.launch(compute)
    out: list[str] = []

    def load() -> None:  # on vLLM's thread, where torch made the context current
        fake.set_current_context(0xC0)
        out.append(path.before_send(True, np.array([2]), np.array([3], np.uint32), conn))

    th = threading.Thread(target=load)
    th.start()
    th.join(0.3)
    assert th.is_alive() and not fake.buffer(t.ptr).any()  # behind the zeroing
    zeroing.set()
    th.join(5)
    assert out == [""] and (fake.buffer(t.ptr)[2 * PAGE:3 * PAGE] == 0x5A).all()

    class Restarting:  # the daemon restarts while the copy runs
        calls = 0

        @property
        def registered(self):
            self.calls += 1
            return reg if self.calls == 1 else m.Registered(2, 1, PAGE, PAGE, str(pool),
                                                             1 << 16, 64)

    assert path.before_send(True, np.array([1]), np.array([3], np.uint32),
                            Restarting()) == "stale_instance"
    path.close()


@pytest.mark.skipif(gpu_available(), reason="CUDA is usable here: the loader succeeds")
def test_d2_no_usable_cuda_means_no_offloading_not_a_crash():
    t = GpuTensor(0x7A00_0000_0000, BLOCKS, PAGE, PAGE)
    why = cuda_data_path([t])  # the real loader: no driver on this machine
    assert isinstance(why, str) and why
    worker = OffloadOff(0, why)
    assert worker.submit_store(1, None, None)
    assert worker.submit_load(2, None, SimpleNamespace(block_ids=[4, 5]))
    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    assert worker.take_load_errors() == {4, 5}  # vLLM recomputes them
    assert worker.boundary.counts == {"store.skipped.offload_off": 1,
                                      "load.skipped.offload_off": 1}


def test_exportable_memory_keeps_the_daemon_copy_path(fake):
    t = GpuTensor(fake.alloc(PAGE * BLOCKS), BLOCKS, PAGE, PAGE)
    path = cuda_data_path([t], fake)
    assert isinstance(path, CudaPath)
    reg = path.register(FP, rank=0)
    assert [r.page_bytes for r in reg.cuda_regions] == [PAGE // 2, PAGE // 2]
    assert len(reg.cuda_event_handles) == len(path.ring)
    path.close()


def test_the_cuda_path_frees_an_event_only_for_the_transfer_it_was_recorded_for(
        fake, compute):
    t = GpuTensor(fake.alloc(PAGE * BLOCKS), BLOCKS, PAGE, PAGE)
    path = cuda_data_path([t], fake)
    assert isinstance(path, CudaPath)
    first = path.order_event(1)
    path.event_done(first, 1)  # EventWaited
    again = path.order_event(2)
    assert again == first
    path.event_done(first, 1)  # transfer 1's Done comes after
    assert path.ring.in_use() == 1
    path.event_done(again, 2)
    assert path.ring.in_use() == 0
    path.close()


def test_a_client_copy_that_fails_midway_lands_nothing_after_the_failure(
        tmp_path, monkeypatch):
    """The second of a load's copy calls fails: the first was enqueued already and,
    with the copy stream busy, landed after the load was reported failed (vLLM then
    recomputes into those blocks). The failure is reported once the stream is idle."""
    import threading

    from kvd_client.cudart import CudaError

    fake = FakeCuda(driver=12070)  # no batched copy: one cudaMemcpyAsync per run
    try:
        pages = [1024, 512]
        extent = 64 * 1024
        pool = tmp_path / "pool"
        pool.write_bytes(bytes([0x5A]) * (extent * 2))
        reg = m.Registered(1, 1, sum(pages), sum(pages), str(pool), extent, 4)
        fake.set_current_context(0xC0)
        tensors = [GpuTensor(fake.alloc(p * BLOCKS), BLOCKS, p, p) for p in pages]
        stream = fake.stream_create()
        monkeypatch.setattr(cuda_paths, "compute_stream", lambda: stream)
        path = ClientCopyPath(tensors, "test", fake)
        path.register(m.Fingerprint("m", "d", "d", 16, 1, pages, "h", b""), 0)
        hold = fake.launch(path.stream)  # the copy stream is busy for a while
        real, calls = fake.memcpy_async, []

        def flaky(dst, src, nbytes, s):
            calls.append(nbytes)
            if len(calls) == 2:
                threading.Timer(0.2, hold.set).start()
                raise CudaError("cudaMemcpyAsync", 1, "cudaErrorInvalidValue")
            return real(dst, src, nbytes, s)

        monkeypatch.setattr(fake, "memcpy_async", flaky)
        conn = SimpleNamespace(registered=reg)
        with pytest.raises(CudaError):
            path.before_send(True, np.array([2, 3]), np.array([1, 3]), conn)
        block = fake.buffer(tensors[0].ptr)[2 * 1024:3 * 1024]
        at_failure = block.copy()
        hold.set()
        assert fake.idle()
        assert (block == at_failure).all(), "a copy landed after the load failed"
        path.close()
        assert fake.violations == []
    finally:
        fake.shutdown()
