"""The CUDA data path against a recording fake of the driver (no GPU needed).

What is checked: call order (the store stream waits on the worker's event before the
copy; Done only after the copy's completion event), the address/size arrays for
multi-layer layouts and TP ranks, open-once/close-once of IPC handles, the event-ring
reuse rule, chunked pinning, and the refusals. Bytes really move (the fake copies), so
data placement is checked too.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvd.engines.base import CopyJob
from kvd.engines.cuda import ClientCopyEngine, CudaEngine, refuse_foreign_pid_namespace
from kvd.errors import RequestError, TransferError
from kvd.pinning import PoolPinner, chunks
from kvd_client.cuda import (ClientCopier, CudaExportRefused, EventRing, GpuTensor,
                             export_regions)
from kvd_proto import messages as m
from tests.engines.fake_cuda import FakeCuda

BLOCKS = 8


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


class Rig:
    """A daemon-side engine plus one worker's exported layers, built like the service."""

    def __init__(self, fake: FakeCuda, pages=(4096,), rank=0, tp=1, events=4,
                 one_allocation=False) -> None:
        self.fake = fake
        self.done: list[tuple[CopyJob, Exception | None]] = []
        self.waited: list[CopyJob] = []
        self.pages = list(pages)
        self.rank, self.tp = rank, tp
        self.engine = CudaEngine(self.on_done, fake, on_waited=self.on_waited)
        strides = [p * 2 for p in self.pages]  # padding between blocks: not contiguous
        if one_allocation:  # several layers inside one caching-allocator block
            total = sum(s * BLOCKS for s in strides) + 512
            base = fake.alloc(total)
            offs = np.concatenate(([256], 256 + np.cumsum([s * BLOCKS for s in strides])))
            self.tensors = [GpuTensor(base + int(o), BLOCKS, s, p)
                            for o, s, p in zip(offs, strides, self.pages)]
        else:
            self.tensors = [GpuTensor(fake.alloc(s * BLOCKS + 128) + 128, BLOCKS, s, p)
                            for s, p in zip(strides, self.pages)]
        for i, t in enumerate(self.tensors):  # distinct bytes per (layer, block)
            buf = fake.buffer(t.ptr)
            for b in range(BLOCKS):
                buf[b * t.stride:b * t.stride + t.page_bytes] = (16 * i + b + 1) % 256
        fake.set_current_context(0xC0)  # the worker: torch made its context current
        self.ring = EventRing(events, fake)
        self.reg = m.Register(1, m.Fingerprint("m", "bf16", "bf16", 16, tp, self.pages, "h",
                                               b""), rank, [],
                              export_regions(self.tensors, fake), self.ring.handles)
        fake.set_current_context(None)  # the daemon's attach must make its own current
        self.rank_bytes = sum(self.pages)
        self.pool = np.zeros(self.rank_bytes * tp * 16, np.uint8)
        self.bases = self.engine.attach(7, 4242, self.reg)
        fake.set_current_context(0xC0)

    def on_done(self, job, err, seconds) -> None:
        self.fake._rec("on_done", job.event)
        self.done.append((job, err))

    def on_waited(self, job) -> None:
        self.fake._rec("on_waited", job.cuda_event)
        self.waited.append(job)

    def job(self, direction, blocks, slots, event=0, cuda_event=-1, client=7) -> CopyJob:
        """The service's formula: remote = base + block * stride; pool = slot + rank + page."""
        blocks = np.array(blocks, np.uint64)
        slots = np.array(slots, np.uint64)
        page_off = np.concatenate(([0], np.cumsum(self.pages)[:-1])).astype(np.uint64)
        slot_off = slots * np.uint64(self.rank_bytes * self.tp)
        pool = (np.uint64(self.pool.ctypes.data + self.rank * self.rank_bytes)
                + slot_off[:, None] + page_off[None, :])
        remote = (np.array(self.bases, np.uint64)[None, :]
                  + blocks[:, None] * np.array([t.stride for t in self.tensors],
                                               np.uint64)[None, :])
        lengths = np.broadcast_to(np.array(self.pages, np.uint64), remote.shape)
        return CopyJob(client, event, event, direction, 4242, pool.ravel(), remote.ravel(),
                       lengths.ravel().copy(), slots.astype(np.int64), cuda_event)

    def slot_bytes(self, slot: int, layer: int) -> np.ndarray:
        off = slot * self.rank_bytes * self.tp + self.rank * self.rank_bytes \
            + sum(self.pages[:layer])
        return self.pool[off:off + self.pages[layer]]

    def block_bytes(self, block: int, layer: int) -> np.ndarray:
        t = self.tensors[layer]
        return self.fake.buffer(t.ptr)[block * t.stride:block * t.stride + t.page_bytes]


@pytest.fixture
def fake():
    return FakeCuda()


def test_store_waits_on_event_before_copy_and_done_follows_completion(fake):
    fake.auto_complete = False
    rig = Rig(fake)
    ev = rig.ring.record_next(stream=99)
    assert ev == 0
    rig.engine.submit(rig.job(m.Direction.STORE, [3], [5], event=1, cuda_event=ev))
    wait_for(lambda: fake.of("event_record")[-1][3] != 99)
    time.sleep(0.02)
    assert rig.done == []  # copy enqueued but its completion event has not fired
    store_stream = fake.of("stream_create")[0][2]
    seq = [c for c in fake.calls if c[0] in ("stream_wait_event", "on_waited", "memcpy_batch",
                                             "event_record", "on_done")][1:]  # 0: worker
    assert [c[0] for c in seq] == ["stream_wait_event", "on_waited", "memcpy_batch",
                                   "event_record"]
    imported = fake.of("ipc_open_event_handle")[ev][3]
    assert seq[0][2:] == (store_stream, imported)
    assert seq[2][2] == store_stream and seq[3][3] == store_stream
    assert seq[2][6] == 1  # srcAccessOrder STREAM: the source is live GPU memory
    fake.complete(seq[3][2])
    wait_for(lambda: rig.done)
    assert fake.names()[-1] == "on_done" and rig.done[0][1] is None
    assert np.array_equal(rig.slot_bytes(5, 0), rig.block_bytes(3, 0))
    rig.engine.close()


def test_load_needs_no_event_and_uses_the_load_stream(fake):
    rig = Rig(fake)
    rig.pool[:] = 0xAB
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [1], event=4))
    wait_for(lambda: rig.done)
    load_stream = fake.of("stream_create")[1][2]
    assert not fake.of("stream_wait_event") and not rig.waited
    (call,) = fake.of("memcpy_batch")
    assert call[2] == load_stream and call[6] == 3  # ANY: the pinned pool is stable
    assert (rig.block_bytes(2, 0) == 0xAB).all()
    rig.engine.close()


def test_multi_layer_tp_rank_arrays(fake):
    pages = (4096, 1024, 2048)
    rig = Rig(fake, pages=pages, rank=1, tp=2)
    blocks, slots = [0, 5, 6], [9, 2, 3]
    rig.engine.submit(rig.job(m.Direction.STORE, blocks, slots, cuda_event=-1))
    wait_for(lambda: rig.done)
    (call,) = fake.of("memcpy_batch")
    dsts, srcs, sizes = call[3], call[4], call[5]
    base = rig.pool.ctypes.data
    rank_bytes = sum(pages)
    want_d, want_s, want_n = [], [], []
    for b, s in zip(blocks, slots):
        for layer, p in enumerate(pages):
            want_d.append(base + s * 2 * rank_bytes + rank_bytes + sum(pages[:layer]))
            want_s.append(rig.bases[layer] + b * rig.tensors[layer].stride)
            want_n.append(p)
    # Slots 2 and 3 are adjacent in the pool, blocks 5 and 6 are not on the device side
    # (stride = 2 pages), so nothing coalesces: one entry per (block, layer).
    assert dsts.tolist() == want_d and srcs.tolist() == want_s and sizes.tolist() == want_n
    for b, s in zip(blocks, slots):
        for layer in range(3):
            assert np.array_equal(rig.slot_bytes(s, layer), rig.block_bytes(b, layer))
    # The other rank's half of each slot is untouched.
    assert not rig.pool[9 * 2 * rank_bytes:9 * 2 * rank_bytes + rank_bytes].any()
    rig.engine.close()


def test_offsets_inside_one_allocation_use_the_opened_pointer(fake):
    rig = Rig(fake, pages=(512, 512), one_allocation=True)
    assert len(fake.of("ipc_open_mem_handle")) == 1  # two layers, one allocation
    opened = fake.of("ipc_open_mem_handle")[0][3]
    assert rig.bases == [opened + 256, opened + 256 + 1024 * BLOCKS]
    assert all(b != t.ptr for b, t in zip(rig.bases, rig.tensors))  # not the worker's view
    rig.engine.submit(rig.job(m.Direction.STORE, [7], [0]))
    wait_for(lambda: rig.done)
    assert np.array_equal(rig.slot_bytes(0, 1), rig.block_bytes(7, 1))
    rig.engine.close()


def test_contiguous_runs_coalesce(fake):
    rig = Rig(fake)
    t = rig.tensors[0]
    rig.tensors[0] = GpuTensor(t.ptr, t.num_blocks, t.page_bytes, t.page_bytes)
    job = rig.job(m.Direction.STORE, [1, 2, 3, 6], [4, 5, 6, 0])
    rig.engine.submit(job)
    wait_for(lambda: rig.done)
    (call,) = fake.of("memcpy_batch")
    assert call[5].tolist() == [3 * 4096, 4096]
    rig.engine.close()


def test_old_driver_copies_coalesced_runs_one_by_one(fake):
    fake.driver = 12040
    rig = Rig(fake, pages=(1024, 2048))
    rig.engine.submit(rig.job(m.Direction.STORE, [1, 4], [0, 3]))
    wait_for(lambda: rig.done)
    assert not fake.of("memcpy_batch")
    # Per slot the two layers are adjacent in the pool but not on the device: 4 runs.
    assert [c[5] for c in fake.of("memcpy_async")] == [1024, 2048, 1024, 2048]
    assert np.array_equal(rig.slot_bytes(3, 1), rig.block_bytes(4, 1))
    rig.engine.close()


def test_handles_open_once_and_close_once_after_copies_drain(fake):
    fake.auto_complete = False
    rig = Rig(fake, pages=(512, 512), one_allocation=True)
    rig.engine.attach(8, 4242, rig.reg)  # same pid registers again (second connection)
    assert len(fake.of("ipc_open_mem_handle")) == 1
    assert len(fake.of("ipc_open_event_handle")) == len(rig.ring)
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1]))
    wait_for(lambda: fake.of("event_record"))
    rig.engine.detach(7)
    rig.engine.detach(8)
    time.sleep(0.05)
    assert not fake.of("ipc_close_mem_handle")  # a copy is still in flight
    fake.complete_all()
    wait_for(lambda: fake.of("ipc_close_mem_handle"))
    time.sleep(0.02)
    assert len(fake.of("ipc_close_mem_handle")) == 1
    assert fake.names("on_done", "ipc_close_mem_handle") == ["on_done", "ipc_close_mem_handle"]
    imported = {c[3] for c in fake.of("ipc_open_event_handle")}
    assert {c[2] for c in fake.of("event_destroy")} >= imported
    rig.engine.detach(7)  # a second detach closes nothing
    rig.engine.close()
    assert len(fake.of("ipc_close_mem_handle")) == 1


def test_close_closes_every_handle_once_and_answers_every_job(fake):
    rig = Rig(fake, pages=(512,))
    for i in range(20):
        rig.engine.submit(rig.job(m.Direction.LOAD, [i % BLOCKS], [i], event=i))
    rig.engine.close()
    assert len(rig.done) == 20 and len({j.event for j, _ in rig.done}) == 20
    assert len(fake.of("ipc_close_mem_handle")) == 1
    rig.engine.submit(rig.job(m.Direction.LOAD, [0], [0], event=99))
    assert isinstance(rig.done[-1][1], TransferError)
    assert fake.of("release_primary_context")


def test_detached_client_with_copy_in_flight_is_closed_at_shutdown(fake):
    fake.auto_complete = False
    rig = Rig(fake)
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1]))
    wait_for(lambda: fake.of("memcpy_batch"))
    rig.engine.detach(7)
    threading.Timer(0.1, fake.complete_all).start()
    rig.engine.close()
    assert len(rig.done) == 1 and rig.done[0][1] is None
    assert len(fake.of("ipc_close_mem_handle")) == 1


def test_unknown_client_and_bad_event_index_fail_the_job(fake):
    rig = Rig(fake, events=2)
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], cuda_event=5))
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], client=99))
    assert [e.code for _, e in rig.done] == [m.Code.BAD_REQUEST, m.Code.CLIENT_GONE]
    rig.engine.close()


def test_event_ring_reuse_only_after_the_wait_was_enqueued(fake):
    rig = Rig(fake, events=2)
    a, b = rig.ring.record_next(1), rig.ring.record_next(1)
    assert {a, b} == {0, 1} and rig.ring.record_next(1) is None
    assert rig.ring.exhausted == 1
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], cuda_event=a))
    wait_for(lambda: rig.waited)
    rig.ring.waited(rig.waited[0].cuda_event)  # what the client does on EventWaited
    assert rig.ring.record_next(1) == a
    rig.ring.waited(b)
    rig.ring.waited(b)  # Done after EventWaited: idempotent
    assert rig.ring.in_use() == 1
    created = [c for c in fake.of("event_create") if c[3]]
    assert len(created) == 2  # ring events are interprocess
    rig.engine.close()


def test_failed_copy_is_reported_and_still_releases_the_event(fake):
    rig = Rig(fake)
    job = rig.job(m.Direction.STORE, [0], [0], cuda_event=0)
    job.remote = job.remote + np.uint64(10 ** 9)  # outside the opened mapping
    rig.engine.submit(job)
    wait_for(lambda: rig.done)
    assert isinstance(rig.done[0][1], TransferError) and rig.waited
    rig.engine.close()


# ------------------------------------------------------------ refusals


def test_refuses_a_gpu_the_daemon_cannot_see(fake):
    other = FakeCuda(uuids=(b"\x01" * 16,))
    other.allocs, other.handles = fake.allocs, fake.handles
    tensors = [GpuTensor(fake.alloc(8192), 2, 4096, 4096)]
    reg = m.Register(1, m.Fingerprint("m", "d", "d", 16, 1, [4096], "h", b""), 0, [],
                     export_regions(tensors, fake))
    engine = CudaEngine(lambda *a: None, other)
    with pytest.raises(RequestError, match="MIG") as e:
        engine.attach(1, 1, reg)
    assert "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f" in str(e.value)
    assert "client_copy" in str(e.value)
    engine.close()


def test_refuses_separate_pid_namespace():
    refuse_foreign_pid_namespace(10, 10)
    with pytest.raises(RequestError, match="PID namespace.*hostPID"):
        refuse_foreign_pid_namespace(1, 52011)


def test_open_failure_is_explained_and_rolled_back(fake):
    rig = Rig(fake)
    fake.fail_open = True
    fake.maps.clear()
    fake.open_count.clear()
    with pytest.raises(TransferError, match="PID namespace") as e:
        rig.engine.attach(9, 777, rig.reg)
    assert e.value.code == m.Code.PERMISSION
    rig.engine.close()


def test_refuses_memory_without_legacy_ipc(fake):
    t = GpuTensor(fake.alloc(8192, ipc_capable=False), 2, 4096, 4096)
    with pytest.raises(CudaExportRefused, match="expandable") as e:
        export_regions([t], fake)
    assert "client_copy" in e.value.fix


def test_refuses_expandable_segments_and_sleep_mode(fake, monkeypatch):
    t = GpuTensor(fake.alloc(8192), 2, 4096, 4096)
    with pytest.raises(CudaExportRefused, match="sleep mode"):
        export_regions([t], fake, sleep_mode=True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    with pytest.raises(CudaExportRefused, match="expandable segments"):
        export_regions([t], fake)


def test_export_sends_uuid_offset_and_one_handle_per_allocation(fake):
    base = fake.alloc(1 << 20, device=0)
    regions = export_regions([GpuTensor(base + 4096, 4, 8192, 8192),
                              GpuTensor(base + 65536, 4, 8192, 4096)], fake)
    assert [r.offset for r in regions] == [4096, 65536]
    assert regions[0].ipc_handle == regions[1].ipc_handle
    assert regions[0].device_uuid == fake.uuids[0] and len(regions[0].ipc_handle) == 64
    assert len(fake.of("ipc_get_mem_handle")) == 1


# ------------------------------------------------------------ client-side copy


def test_client_copy_writes_the_daemons_slot_layout(fake, tmp_path):
    pages = [1024, 512]
    rank, tp, spe, extent = 1, 2, 4, 64 * 1024
    rank_bytes = sum(pages)
    path = tmp_path / "pool"
    path.write_bytes(bytes(extent * 2))
    reg = m.Registered(1, 1, rank_bytes * tp, rank_bytes, str(path), extent, spe)
    tensors = [GpuTensor(fake.alloc(p * BLOCKS), BLOCKS, p, p) for p in pages]
    for t in tensors:
        fake.buffer(t.ptr)[:] = np.arange(len(fake.buffer(t.ptr))) % 251
    fake.set_current_context(1)
    cc = ClientCopier(reg, rank, tensors, stream=5, api=fake)
    tok = cc.start(m.Direction.STORE, np.array([3]), np.array([5]))
    assert cc.done(tok)
    pool = np.fromfile(path, np.uint8)
    slot_off = (5 // spe) * extent + (5 % spe) * rank_bytes * tp
    got = pool[slot_off + rank_bytes + 1024:slot_off + rank_bytes + 1536]
    assert np.array_equal(got, fake.buffer(tensors[1].ptr)[3 * 512:4 * 512])
    cc.close()


def test_client_copy_engine_completes_on_arrival():
    done = []
    eng = ClientCopyEngine(lambda job, err, s: done.append(err))
    reg = m.Register(1, m.Fingerprint("m", "d", "d", 16, 1, [1, 2], "h", b""), 0,
                     client_copy=True)
    assert eng.attach(1, 1, reg) == [0, 0]
    z = np.zeros(0, np.uint64)
    eng.submit(CopyJob(1, 1, 1, m.Direction.STORE, 1, z, z, z, z))
    assert done == [None]


# ------------------------------------------------------------ pinning


def test_pinning_is_chunked_at_64_gib_with_progress(fake):
    base, size = 0x10_0000_0000, (200 << 30) + 4096
    pinner = PoolPinner(base, size, fake)
    assert pinner.status()["state"] == "idle"
    pinner.start()
    assert pinner.wait(5)
    st = pinner.status()
    assert st["state"] == "done" and st["pinned_bytes"] == size and st["fraction"] == 1.0
    calls = [(c[2], c[3]) for c in fake.of("host_register")]
    assert calls == [(base, 64 << 30), (base + (64 << 30), 64 << 30),
                     (base + (128 << 30), 64 << 30), (base + (192 << 30), (8 << 30) + 4096)]
    assert fake.of("host_register")[0][1] == "kvd-pin"  # on the background thread
    pinner.release()
    assert [c[2] for c in fake.of("host_unregister")] == [c[0] for c in calls]
    assert pinner.status()["state"] == "released"


def test_failed_pinning_is_reported_and_the_error_cleared(fake):
    fake.fail_register = {1}
    pinner = PoolPinner(0x10_0000_0000, 3 << 30, fake, chunk_bytes=1 << 30)
    pinner.start()
    assert pinner.wait(5)
    st = pinner.status()
    assert st["state"] == "failed" and st["pinned_bytes"] == 1 << 30
    assert "unpinned" in st["error"] and st["chunks_total"] == 3
    assert fake.names("host_register", "clear_last_error")[-1] == "clear_last_error"
    pinner.release()
    assert len(fake.of("host_unregister")) == 1  # only what was registered


def test_pinning_without_cuda_is_unavailable():
    pinner = PoolPinner(0x1000, 1 << 20)  # the real loader: no GPU on this machine
    pinner.start()
    assert pinner.wait(30)
    st = pinner.status()
    if st["state"] != "done":  # on a GPU machine this really pins a bogus range: fails
        assert st["state"] in ("unavailable", "failed") and st["error"]
    pinner.release()


def test_chunks_cover_the_range():
    assert chunks(100, 10, 4) == [(100, 4), (104, 4), (108, 2)]
    assert chunks(0, 200 << 30, 1 << 40)[0] == (0, 64 << 30)
