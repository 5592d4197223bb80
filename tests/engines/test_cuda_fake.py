"""The CUDA data path against a fake driver that behaves like one (no GPU needed).

The fake (tests/engines/fake_cuda.py) runs copies later, on per-stream threads, after
the events they wait on completed; contexts are per thread; out-of-bounds copies poison
the device; pageable copies are synchronous. What is checked: call order (the store
lane waits on the worker's event before the copy; Done only after the copy completed),
the address/size arrays for multi-layer layouts and TP ranks, open-once/close-once of
IPC handles, the event-ring reuse rule, chunked pinning, the refusals, and the seven
defects of issue 13 (each test named ``test_d<N>_...``).
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import xxhash

from kvd.engines.base import ChecksumSpec, CopyJob
from kvd.engines.cuda_device import COPY_STREAMS, SPLIT_MIN_RUNS
from kvd.engines.client_copy import ClientCopyEngine
from kvd.engines.cuda import CudaEngine, gpu_path, refuse_foreign_pid_namespace
from kvd.errors import RequestError, TransferError
from kvd.pinning import PoolPinner, chunks
from kvd_client.cuda import (ClientCopier, CudaExportRefused, EventRing, GpuTensor,
                             export_regions)
from kvd_client.cudart import CudaError, CudaUnavailable, load, version_refusal
from kvd_client.errors import KvdClientError
from kvd_proto import messages as m
from tests.engines.fake_cuda import FakeCuda

BLOCKS = 8
WORKER_CTX = 0xC0


class Rig:
    """A daemon-side engine plus one worker's exported layers, built like the service.

    The worker's compute stream is ``compute``; ``forward()`` holds it with a kernel
    (a forward pass) until the returned gate is set."""

    def __init__(self, fake: FakeCuda, pages=(4096,), rank=0, tp=1, events=4,
                 one_allocation=False, engine: CudaEngine | None = None, client=7,
                 pool_slots=16, pin=True, **engine_kw) -> None:
        self.fake = fake
        self.done: list[tuple[CopyJob, Exception | None]] = []
        self.waited: list[CopyJob] = []
        self.pages = list(pages)
        self.rank, self.tp, self.client = rank, tp, client
        self.engine = engine or CudaEngine(self.on_done, fake, on_waited=self.on_waited,
                                           **engine_kw)
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
        fake.set_current_context(WORKER_CTX)  # the worker: torch made its context current
        self.compute = fake.stream_create()
        self.ring = EventRing(events, fake)
        self.reg = m.Register(1, m.Fingerprint("m", "bf16", "bf16", 16, tp, self.pages, "h",
                                               b""), rank, [],
                              export_regions(self.tensors, fake), self.ring.handles)
        self.rank_bytes = sum(self.pages)
        self.pool = np.zeros(self.rank_bytes * tp * pool_slots, np.uint8)
        if pin:
            fake.host_register(self.pool.ctypes.data, self.pool.nbytes)
        fake.set_current_context(None)  # the daemon's attach must make its own current
        self.bases = self.engine.attach(client, 4242, self.reg)
        fake.set_current_context(WORKER_CTX)

    def on_done(self, job, err, seconds) -> None:
        self.fake._rec("on_done", job.event)
        self.done.append((job, err))
        with self.fake._cv:
            self.fake._cv.notify_all()

    def on_waited(self, job) -> None:
        self.fake._rec("on_waited", job.cuda_event)
        self.waited.append(job)
        self.ring.waited(job.cuda_event)  # what the worker does on EventWaited

    def forward(self) -> tuple[threading.Event, int]:
        """A forward pass on the compute stream, then the store's event recorded."""
        gate = self.fake.launch(self.compute)
        ev = self.ring.record_next(self.compute)
        assert ev is not None
        return gate, ev

    def job(self, direction, blocks, slots, event=0, cuda_event=-1, client=None,
            deadline=math.inf) -> CopyJob:
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
        return CopyJob(self.client if client is None else client, event, event, direction,
                       4242, pool.ravel(), remote.ravel(), lengths.ravel().copy(),
                       slots.astype(np.int64), cuda_event, deadline)

    def lanes(self) -> tuple[int, int]:
        """(load lane, this client's store lane) streams, from the fake's record."""
        made = [c[2] for c in self.fake.of("stream_create")]
        mine = made[made.index(self.compute) + 1:][::COPY_STREAMS]  # each lane's main one
        if len(mine) == 1 or len(mine) > 1 and self.client != 7:
            return made[1], mine[0]  # the engine existed: the load lane came earlier
        return mine[0], mine[1]

    def wait_done(self, n: int = 1, timeout: float = 5.0) -> bool:
        return self.fake.wait_for(lambda: len(self.done) >= n, timeout)

    def err(self, event: int) -> Exception | None:
        return next(e for j, e in self.done if j.event == event)

    def slot_bytes(self, slot: int, layer: int) -> np.ndarray:
        off = slot * self.rank_bytes * self.tp + self.rank * self.rank_bytes \
            + sum(self.pages[:layer])
        return self.pool[off:off + self.pages[layer]]

    def block_bytes(self, block: int, layer: int) -> np.ndarray:
        t = self.tensors[layer]
        return self.fake.buffer(t.ptr)[block * t.stride:block * t.stride + t.page_bytes]


def copies_of(fake: FakeCuda, rig: Rig) -> list[tuple]:
    return [c for c in fake.of("memcpy_batch") if c[2] != rig.compute]


# ------------------------------------------------------------ the data path


def test_store_waits_on_event_before_copy_and_done_follows_completion(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [3], [5], event=1, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    time.sleep(0.02)
    assert not rig.done and not fake.of("memcpy_batch")  # the forward pass still runs
    gate.set()
    assert rig.wait_done()
    seq = [c for c in fake.calls if c[0] in ("event_query", "on_waited", "memcpy_batch",
                                             "on_done")]
    names = [c[0] for c in seq]
    assert names[-3:] == ["on_waited", "memcpy_batch", "on_done"]
    assert set(names[:-3]) == {"event_query"}  # polled until the forward pass ended
    imported = fake.of("ipc_open_event_handle")[ev][3]
    assert {c[2] for c in seq[:-3]} == {imported}
    assert seq[-2][2] != rig.compute
    assert seq[-2][6] == 1  # srcAccessOrder STREAM: the source is live GPU memory
    assert not fake.of("stream_wait_event")  # no daemon stream ever waits on a worker
    assert rig.done[0][1] is None
    assert np.array_equal(rig.slot_bytes(5, 0), rig.block_bytes(3, 0))
    rig.engine.close()


def test_load_needs_no_event_and_uses_its_own_lane(fake):
    rig = Rig(fake)
    rig.pool[:] = 0xAB
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [1], event=4))
    assert rig.wait_done()
    assert not fake.of("stream_wait_event") and not rig.waited
    (call,) = fake.of("memcpy_batch")
    assert call[6] == 3  # ANY: the pinned pool is stable
    assert call[1].startswith("kvd-cuda-load")
    assert (rig.block_bytes(2, 0) == 0xAB).all()
    rig.engine.close()


def test_a_load_with_an_event_copies_only_after_the_workers_stream_passed_it(fake):
    """vLLM may still be zeroing the blocks on its compute stream when it submits the
    load: the copy into them is enqueued only once the worker's event completed (polled:
    a daemon stream waiting on a dead worker's event would stop the GPU's loads)."""
    rig = Rig(fake)
    rig.pool[:] = 0xCD
    zeroing = fake.launch(rig.compute)  # still running when the load comes
    ev = rig.ring.record_next(rig.compute)
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [1], event=4, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    time.sleep(0.02)
    assert not fake.of("memcpy_batch") and not rig.done and not rig.waited
    zeroing.set()
    assert rig.wait_done()
    assert [j.cuda_event for j in rig.waited] == [ev]  # the ring may record it again
    assert rig.done[0][1] is None and (rig.block_bytes(2, 0) == 0xCD).all()
    assert not fake.of("stream_wait_event")
    rig.engine.close()


def test_multi_layer_tp_rank_arrays(fake):
    pages = (4096, 1024, 2048)
    rig = Rig(fake, pages=pages, rank=1, tp=2)
    blocks, slots = [0, 5, 6], [9, 2, 3]
    rig.engine.submit(rig.job(m.Direction.STORE, blocks, slots, cuda_event=-1))
    assert rig.wait_done()
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
    assert not rig.pool[9 * 2 * rank_bytes:9 * 2 * rank_bytes + rank_bytes].any()
    rig.engine.close()


def test_offsets_inside_one_allocation_use_the_opened_pointer(fake):
    rig = Rig(fake, pages=(512, 512), one_allocation=True)
    assert len(fake.of("ipc_open_mem_handle")) == 1  # two layers, one allocation
    opened = fake.of("ipc_open_mem_handle")[0][3]
    assert rig.bases == [opened + 256, opened + 256 + 1024 * BLOCKS]
    assert all(b != t.ptr for b, t in zip(rig.bases, rig.tensors))  # not the worker's view
    rig.engine.submit(rig.job(m.Direction.STORE, [7], [0]))
    assert rig.wait_done()
    assert np.array_equal(rig.slot_bytes(0, 1), rig.block_bytes(7, 1))
    rig.engine.close()


def test_contiguous_runs_coalesce(fake):
    rig = Rig(fake)
    t = rig.tensors[0]
    rig.tensors[0] = GpuTensor(t.ptr, t.num_blocks, t.page_bytes, t.page_bytes)
    rig.engine.submit(rig.job(m.Direction.STORE, [1, 2, 3, 6], [4, 5, 6, 0]))
    assert rig.wait_done()
    (call,) = fake.of("memcpy_batch")
    assert call[5].tolist() == [3 * 4096, 4096]
    rig.engine.close()


def test_many_runs_are_split_over_the_lanes_streams_and_done_waits_for_all(fake):
    """40 layers x 8 blocks, nothing adjacent: 320 runs, split over the lane's
    COPY_STREAMS streams (the copy engines overlap per-copy costs); the Done waits for
    the slowest of them."""
    rig = Rig(fake, pages=(256,) * 40)
    _, main = rig.lanes()
    made = [c[2] for c in fake.of("stream_create")]
    helpers = made[made.index(main) + 1:made.index(main) + COPY_STREAMS]
    assert 320 // SPLIT_MIN_RUNS >= COPY_STREAMS
    hold = fake.launch(helpers[-1])  # one copy engine is busy
    slots = list(range(0, 16, 2))
    rig.engine.submit(rig.job(m.Direction.STORE, range(8), slots))
    assert fake.wait_for(lambda: len(fake.of("memcpy_batch")) == COPY_STREAMS)
    calls = fake.of("memcpy_batch")
    assert [c[2] for c in calls] == [main, *helpers]
    assert sum(len(c[5]) for c in calls) == 320
    time.sleep(0.05)
    assert not rig.done  # the last part has not run
    hold.set()
    assert rig.wait_done() and rig.done[0][1] is None
    for b, slot in enumerate(slots):
        for layer in (0, 17, 39):
            assert np.array_equal(rig.slot_bytes(slot, layer), rig.block_bytes(b, layer))
    rig.engine.close()


def test_old_driver_copies_coalesced_runs_one_by_one(fake):
    fake.driver = 12040
    rig = Rig(fake, pages=(1024, 2048))
    rig.engine.submit(rig.job(m.Direction.STORE, [1, 4], [0, 3]))
    assert rig.wait_done()
    assert not fake.of("memcpy_batch")
    # Per slot the two layers are adjacent in the pool but not on the device: 4 runs.
    assert [c[5] for c in fake.of("memcpy_async")] == [1024, 2048, 1024, 2048]
    assert np.array_equal(rig.slot_bytes(3, 1), rig.block_bytes(4, 1))
    rig.engine.close()


def test_handles_open_once_and_close_once_after_copies_drain(fake):
    rig = Rig(fake, pages=(512, 512), one_allocation=True)
    rig.engine.attach(8, 4242, rig.reg)  # same pid registers again (second connection)
    assert len(fake.of("ipc_open_mem_handle")) == 1
    assert len(fake.of("ipc_open_event_handle")) == len(rig.ring)
    assert rig.engine.stats() == {"gpus": 1, "lost_gpus": 0, "clients": 2, "gone_clients": 0,
                                  "retiring": 0, "ipc_memory": 1, "ipc_events": len(rig.ring)}
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], cuda_event=-1))
    assert rig.wait_done()
    rig.engine.detach(7)
    rig.engine.detach(8)
    assert fake.wait_for(lambda: fake.of("ipc_close_mem_handle"))  # as its lane ends
    assert fake.wait_for(lambda: rig.engine.stats()["retiring"] == 0)
    assert rig.engine.stats() == {"gpus": 1, "lost_gpus": 0, "clients": 0, "gone_clients": 0,
                                  "retiring": 0, "ipc_memory": 0, "ipc_events": 0}
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
        rig.engine.submit(rig.job(m.Direction.LOAD, [i % BLOCKS], [i % 16], event=i))
    rig.engine.close()
    assert len(rig.done) == 20 and len({j.event for j, _ in rig.done}) == 20
    assert len(fake.of("ipc_close_mem_handle")) == 1
    rig.engine.submit(rig.job(m.Direction.LOAD, [0], [0], event=99))
    assert isinstance(rig.done[-1][1], TransferError)
    assert fake.of("release_primary_context")


def test_close_waits_for_a_copy_on_the_gpu_then_closes_its_handles(fake):
    rig = Rig(fake)
    hold = fake.launch(rig.lanes()[1])  # the copy engine is busy
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1]))
    assert fake.wait_for(lambda: fake.of("memcpy_batch"))
    rig.engine.detach(7)
    assert not fake.of("ipc_close_mem_handle")  # its copy is still on the GPU
    closer = threading.Thread(target=rig.engine.close)
    closer.start()
    hold.set()
    closer.join(10)
    assert len(rig.done) == 1 and rig.done[0][1] is None
    assert len(fake.of("ipc_close_mem_handle")) == 1


def test_unknown_client_and_bad_event_index_fail_the_job(fake):
    rig = Rig(fake, events=2)
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], cuda_event=5))
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], client=99))
    assert [e.code for _, e in rig.done] == [m.Code.BAD_REQUEST, m.Code.CLIENT_GONE]
    rig.engine.close()


def test_a_late_done_does_not_free_an_event_recorded_again_for_another_transfer(fake):
    """EventWaited and then the Done of transfer 1 both free its event. In between,
    transfer 2 recorded the same event (the ring reuses the freed one first): 1's Done
    freed it under 2, whose wait the daemon had yet to pass, and a third transfer
    recording it over (on another stream) would have let that wait pass early."""
    rig = Rig(fake, events=2)
    a = rig.ring.record_next(rig.compute, 1)
    rig.ring.waited(a, 1)  # transfer 1's EventWaited
    b = rig.ring.record_next(rig.compute, 2)
    assert b == a
    rig.ring.waited(a, 1)  # transfer 1's Done
    assert rig.ring.in_use() == 1
    c = rig.ring.record_next(fake.stream_create(), 3)
    assert c is not None and c != b
    assert rig.ring.record_next(rig.compute, 4) is None  # both awaited
    rig.ring.waited(b, 2)
    rig.ring.waited(b, 2)  # 2's Done after its EventWaited: once only
    assert rig.ring.in_use() == 1
    rig.engine.close()


def test_event_ring_reuse_only_after_the_daemon_passed_the_wait(fake):
    rig = Rig(fake, events=2)
    gate, a = rig.forward()
    b = rig.ring.record_next(rig.compute)
    assert {a, b} == {0, 1} and rig.ring.record_next(rig.compute) is None
    assert rig.ring.exhausted == 1
    rig.engine.submit(rig.job(m.Direction.STORE, [0], [0], cuda_event=a))
    assert fake.wait_for(lambda: fake.of("event_query"))
    assert rig.ring.in_use() == 2  # the daemon waits for the forward pass
    gate.set()
    assert rig.wait_done()
    assert rig.ring.record_next(rig.compute) == a
    rig.ring.waited(b)
    rig.ring.waited(b)  # Done after EventWaited: idempotent
    assert rig.ring.in_use() == 1
    created = [c for c in fake.of("event_create") if c[3]]
    assert len(created) == 2  # ring events are interprocess
    rig.engine.close()


def test_device_error_is_reported_and_sticks(fake):
    rig = Rig(fake)
    job = rig.job(m.Direction.STORE, [0], [0])
    job.remote = job.remote + np.uint64(10 ** 9)  # outside the opened mapping
    rig.engine.submit(job)
    assert rig.wait_done()
    assert isinstance(rig.done[0][1], TransferError) and "700" in str(rig.done[0][1])
    rig.engine.submit(rig.job(m.Direction.LOAD, [0], [0], event=2))
    assert rig.wait_done(2) and isinstance(rig.done[1][1], TransferError)  # sticky
    rig.engine.close()


def test_a_failed_completion_record_fails_the_job_and_leaks_no_event(fake, monkeypatch):
    """The copies are queued, then recording their completion event fails: the job ends
    with the error once the stream settled, and that event is destroyed, not leaked."""
    rig = Rig(fake)
    ring = {c[2] for c in fake.of("event_create")}  # the worker's
    real, failed = fake.event_record, []

    def record(event: int, stream: int) -> None:
        if stream != rig.compute and not failed:
            failed.append(event)
            raise CudaError("cudaEventRecord", 1, "cudaErrorInvalidValue")
        real(event, stream)

    monkeypatch.setattr(fake, "event_record", record)
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [2], event=1))
    assert rig.wait_done()
    assert isinstance(rig.err(1), TransferError)
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [3], event=2))
    assert rig.wait_done(2) and rig.err(2) is None  # not sticky: the lane goes on
    rig.engine.close()
    made = {c[2] for c in fake.of("event_create")} - ring
    assert failed[0] in made
    assert made <= {c[2] for c in fake.of("event_destroy")}


def test_a_gpu_whose_load_lane_cannot_be_made_is_not_kept_retained(fake, monkeypatch):
    """Making the daemon's streams on a GPU fails: the attach fails, the GPU's primary
    context is released again, and a later attach starts afresh and works."""
    real, calls = fake.stream_create, []

    def stream_create() -> int:
        calls.append(1)
        if len(calls) == 2:  # the first is the worker's compute stream
            raise CudaError("cuStreamCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return real()

    monkeypatch.setattr(fake, "stream_create", stream_create)
    rigs: list[Rig] = []
    engine = CudaEngine(lambda job, err, s: rigs[0].on_done(job, err, s), fake)
    with pytest.raises(TransferError, match="cannot use the client's GPU"):
        Rig(fake, engine=engine)
    assert len(fake.of("retain_primary_context")) == 1
    assert len(fake.of("release_primary_context")) == 1
    rig = Rig(fake, engine=engine, client=8)
    rigs.append(rig)
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [2], event=1))
    assert rig.wait_done() and rig.err(1) is None
    rig.engine.close()
    assert len(fake.of("retain_primary_context")) == len(fake.of("release_primary_context"))


# ------------------------------------------------------------ issue 13, defect by defect


def test_d1_bindings_of_a_newer_cuda_major_are_refused_with_the_fix():
    with pytest.raises(CudaUnavailable, match=r"kvd\[cu12\]") as e:
        load(FakeCuda(driver=12090, runtime=13040))
    assert "cudaErrorInsufficientDriver" in str(e.value)
    assert load(FakeCuda(driver=13000, runtime=12090)).driver_version() == 13000
    assert version_refusal(12080, 12090) is None  # minor versions are compatible


def test_d3_a_client_stuck_on_its_event_does_not_hold_back_another(fake):
    rig = Rig(fake)
    other = Rig(fake, engine=rig.engine, client=8)
    other.done = rig.done
    gate, ev = rig.forward()  # client 7's forward pass never ends (in this test)
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    g2, ev2 = other.forward()
    g2.set()
    rig.engine.submit(other.job(m.Direction.STORE, [2], [2], event=2, cuda_event=ev2))
    assert rig.wait_done(1, timeout=3)  # the old shared store stream: never
    assert [j.event for j, _ in rig.done] == [2] and rig.done[0][1] is None
    gate.set()
    assert rig.wait_done(2)
    rig.engine.close()


def test_d3_a_gone_clients_queued_jobs_fail_before_their_wait(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    gate2, ev2 = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [2], [2], event=2, cuda_event=ev2))
    rig.engine.detach(7)
    assert rig.wait_done(2, timeout=3)
    assert {j.event: e.code for j, e in rig.done} == {1: m.Code.CLIENT_GONE,
                                                      2: m.Code.CLIENT_GONE}
    # The worker was killed: its forward pass never ends. The daemon stops waiting for
    # it, ends the lane and closes the handles all the same (the dead engine's KV
    # memory stays allocated on the GPU while the daemon maps it).
    assert fake.wait_for(lambda: fake.of("ipc_close_mem_handle"))
    assert len(fake.of("stream_destroy")) == COPY_STREAMS  # the lane's
    assert rig.engine.stats()["retiring"] == 0 and rig.engine.stats()["ipc_events"] == 0
    assert not copies_of(fake, rig)
    t0 = time.monotonic()
    rig.engine.close()
    assert time.monotonic() - t0 < 5
    gate.set()
    gate2.set()


def test_d3_a_load_lane_never_polls_an_event_of_a_client_already_gone(fake, monkeypatch):
    """The GPU's load lane polls a load's event; the client goes between two looks and
    its store lane destroys its events. The next look must not touch the destroyed event
    (on a GPU: undefined, or another event's answer once the handle is reused)."""
    from kvd.engines import cuda as cuda_mod

    rig = Rig(fake)
    gate, ev = rig.forward()  # the worker's event does not complete
    imported = {c[3] for c in fake.of("ipc_open_event_handle")}
    destroyed: set[int] = set()
    late: list[int] = []
    destroy, query, sleep = fake.event_destroy, fake.event_query, time.sleep

    def event_destroy(e: int) -> None:
        destroyed.add(e)
        destroy(e)

    def event_query(e: int) -> bool:
        if e in destroyed:
            late.append(e)
        return query(e)

    def between_looks(d: float) -> None:  # the client goes while the lane sleeps
        if threading.current_thread().name.startswith("kvd-cuda-load") and not destroyed:
            rig.engine.detach(7)
            fake.wait_for(lambda: imported <= destroyed, 2)
        sleep(d)

    monkeypatch.setattr(fake, "event_destroy", event_destroy)
    monkeypatch.setattr(fake, "event_query", event_query)
    monkeypatch.setattr(cuda_mod.time, "sleep", between_looks)
    rig.engine.submit(rig.job(m.Direction.LOAD, [0], [0], event=1, cuda_event=ev))
    assert rig.wait_done(1) and rig.err(1).code == m.Code.CLIENT_GONE
    assert fake.wait_for(lambda: imported <= destroyed, 2)
    sleep(0.05)
    assert late == []
    gate.set()
    rig.engine.close()


def test_d3_worker_keeps_its_ring_until_the_daemon_passed_its_waits(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    closed: list[int] = []
    def close_ring() -> None:  # the worker's shutdown, on a thread of its own
        fake.set_current_context(WORKER_CTX)
        closed.append(rig.ring.close(timeout=10))

    closer = threading.Thread(target=close_ring)
    closer.start()  # the worker shuts down while the daemon still waits
    assert not fake.wait_for(lambda: bool(closed), timeout=0.2)
    gate.set()
    closer.join(10)
    assert closed == [0]  # every wait confirmed; the fixture checks no violation
    rig.engine.close()


def test_d3_ring_close_is_bounded(fake):
    fake.set_current_context(WORKER_CTX)
    ring = EventRing(2, fake)
    assert ring.record_next(fake.stream_create()) == 0
    t = time.monotonic()
    assert ring.close(timeout=0.05) == 1 and time.monotonic() - t < 5


def test_d4_job_queued_behind_a_stuck_wait_expires_and_is_never_copied(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    rig.engine.submit(rig.job(m.Direction.STORE, [2], [2], event=2,
                              deadline=time.monotonic() + 0.2))
    assert rig.wait_done(1, timeout=3)
    assert rig.done[0][0].event == 2 and rig.done[0][1].code == m.Code.EXPIRED
    gate.set()
    assert rig.wait_done(2)
    assert fake.idle()
    assert len(copies_of(fake, rig)) == 1  # only job 1 was copied
    assert not rig.slot_bytes(2, 0).any()
    rig.engine.close()


def test_d4_nothing_starts_past_the_deadline(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev,
                              deadline=time.monotonic() - 1))
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [2], event=2,
                              deadline=time.monotonic() - 1))
    assert rig.wait_done(2)
    assert {e.code for _, e in rig.done} == {m.Code.EXPIRED}
    assert not fake.of("stream_wait_event") and not copies_of(fake, rig)
    gate.set()
    rig.engine.close()


def test_d4_a_store_whose_copy_ends_after_give_up_is_not_committed(fake):
    rig = Rig(fake)
    job = rig.job(m.Direction.STORE, [1], [1], event=1, deadline=time.monotonic() + 0.1)
    job.checksum = ChecksumSpec(np.array([rig.rank_bytes], np.int64), rig.rank_bytes)
    hold = fake.launch(rig.lanes()[1])  # the copy engine is busy: the copy will end late
    rig.engine.submit(job)
    assert fake.wait_for(lambda: len(copies_of(fake, rig)) == 1)
    while time.monotonic() <= job.give_up:
        time.sleep(0.05)
    hold.set()
    assert rig.wait_done()
    assert rig.err(1).code == m.Code.EXPIRED and job.checksums is None
    rig.engine.close()


class _Watched(np.ndarray):
    """A pool view that records which threads read it (where checksums are computed)."""

    readers: set[str]

    def __getitem__(self, key):  # type: ignore[override]
        self.readers.add(threading.current_thread().name)
        return super().__getitem__(key)


def collector(fake: FakeCuda, done: list):
    def on_done(job, err, seconds) -> None:
        done.append((job, err))
        fake._rec("on_done", job.event)  # wakes fake.wait_for

    return on_done


def test_d5_store_checksums_come_from_the_copied_bytes_on_the_completion_thread(fake):
    rig_pool = np.zeros(4096 * 16, np.uint8)
    watched = rig_pool.view(_Watched)
    watched.readers = set()
    done: list = []
    engine = CudaEngine(collector(fake, done), fake, pool=watched)
    rig = Rig(fake, engine=engine)
    rig.pool = rig_pool
    fake.host_register(rig_pool.ctypes.data, rig_pool.nbytes)
    gate, ev = rig.forward()
    job = rig.job(m.Direction.STORE, [3, 4], [5, 6], cuda_event=ev)
    job.checksum = ChecksumSpec(np.array([5 * 4096, 6 * 4096], np.int64), 4096)
    engine.submit(job)
    gate.set()
    assert fake.wait_for(lambda: bool(done))
    assert done[0][1] is None
    want = [xxhash.xxh3_64_intdigest(rig.block_bytes(b, 0).tobytes()) for b in (3, 4)]
    assert job.checksums == want
    assert watched.readers and all(n.startswith("kvd-cuda-done-") for n in watched.readers)
    engine.close()


def test_d5_d6_the_daemons_gpu_path_checksums_stores_and_waits_for_pinning(fake):
    """What the daemon builds (``gpu_path``), not an engine wired by hand: until the
    pinner registered the pool a store is refused BUSY; then its checksums come from the
    pool. (Before, the daemon built its engine without the pool and without the pinner.)"""
    pool = np.zeros(4096 * 16, np.uint8)
    done: list = []
    engine, pinner = gpu_path(collector(fake, done), fake, pool)
    rig = Rig(fake, engine=engine, pin=False)
    rig.pool = pool

    def store(event: int) -> CopyJob:
        job = rig.job(m.Direction.STORE, [3, 4], [5, 6], event=event)
        job.checksum = ChecksumSpec(np.array([5 * 4096, 6 * 4096], np.int64), 4096)
        engine.submit(job)
        assert fake.wait_for(lambda: any(j.event == event for j, _ in done))
        return job

    store(1)
    assert done[0][1].code == m.Code.BUSY and not fake.of("memcpy_batch")
    pinner.start()
    assert pinner.wait(5) and pinner.status()["state"] == "done"
    job = store(2)
    assert done[1][1] is None
    assert job.checksums == [xxhash.xxh3_64_intdigest(rig.block_bytes(b, 0).tobytes())
                             for b in (3, 4)]
    engine.close()
    pinner.release()


def test_d5_verify_on_load_drops_corrupt_blocks_and_copies_nothing(fake):
    pool = np.zeros(4096 * 16, np.uint8)
    done: list = []
    engine = CudaEngine(collector(fake, done), fake, pool=pool)
    rig = Rig(fake, engine=engine)
    rig.pool = pool
    fake.host_register(pool.ctypes.data, pool.nbytes)
    pool[2 * 4096:3 * 4096] = 9
    good = xxhash.xxh3_64_intdigest(pool[2 * 4096:3 * 4096].tobytes())
    job = rig.job(m.Direction.LOAD, [1, 2], [2, 3])
    job.checksum = ChecksumSpec(np.array([2 * 4096, 3 * 4096], np.int64), 4096, [good, 12345])
    engine.submit(job)
    assert fake.wait_for(lambda: bool(done))
    assert done[0][1].code == m.Code.CHECKSUM and job.corrupt == [1]
    assert not fake.of("memcpy_batch")
    engine.close()


def test_d6_a_store_blocked_on_pageable_memory_does_not_hold_back_loads(fake):
    rig = Rig(fake, pin=False)  # nothing registered: copies are synchronous
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [2], event=2))
    assert rig.wait_done(1, timeout=3)  # old: one submit thread, stuck in the store copy
    assert rig.done[0][0].event == 2 and rig.done[0][1] is None
    gate.set()
    assert rig.wait_done(2)
    rig.engine.close()


def test_d6_no_copy_into_pool_chunks_not_pinned_yet(fake):
    pinned = {"ok": False}
    rig = Rig(fake, pinned=lambda lo, hi: pinned["ok"])
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1))
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [1], event=2))
    assert [e.code for _, e in rig.done] == [m.Code.BUSY, m.Code.BUSY]
    pinned["ok"] = True
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=3))
    assert rig.wait_done(3) and rig.done[2][1] is None
    assert len(fake.of("memcpy_batch")) == 1
    rig.engine.close()


def test_d6_pinner_says_which_ranges_are_ready(fake):
    base = 0x10_0000_0000
    pinner = PoolPinner(base, 3 << 30, fake, chunk_bytes=1 << 30)
    assert not pinner.ready(base, base + 1)
    fake.fail_register = {1}
    pinner.start()
    assert pinner.wait(5)
    assert pinner.ready(base, base + (1 << 30))  # pinned
    assert pinner.ready(base + (2 << 30), base + (3 << 30))  # failed: served unpinned
    pinner.release()


def test_d6_completion_blocks_instead_of_polling(fake):
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev))
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [2], event=2))
    gate.set()
    assert rig.wait_done(2)
    # The worker's event is polled by the submit thread; completions block.
    assert {c[1] for c in fake.of("event_query")} == {"kvd-cuda-store-7"}
    assert {c[1] for c in fake.of("event_synchronize")} >= {"kvd-cuda-done-store-7"}
    rig.engine.close()


def test_d7_register_beyond_the_allocation_is_refused(fake):
    rig = Rig(fake)
    fake.set_current_context(WORKER_CTX)
    (r,) = export_regions([GpuTensor(fake.alloc(4096 * 4), 4, 4096, 4096)], fake)
    lying = m.CudaRegion(r.device_uuid, r.ipc_handle, r.offset, 5, r.stride, r.page_bytes)
    reg = m.Register(1, rig.reg.fingerprint, 0, [], [lying], [])
    fake.set_current_context(None)
    with pytest.raises(RequestError, match="reaches") as e:
        rig.engine.attach(9, 4243, reg)
    assert e.value.code == m.Code.SIZE_MISMATCH
    assert fake.of("ipc_close_mem_handle")[-1][2] == fake.of("ipc_open_mem_handle")[-1][3]
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], client=9))
    assert rig.done[-1][1].code == m.Code.CLIENT_GONE  # not attached
    rig.engine.close()


# ------------------------------------------------------------ refusals


def test_refuses_a_gpu_the_daemon_cannot_see(fake):
    other = FakeCuda(uuids=(b"\x01" * 16,))
    other.allocs, other.handles = fake.allocs, fake.handles
    fake.set_current_context(WORKER_CTX)
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
    fake.set_current_context(None)
    with pytest.raises(TransferError, match="PID namespace") as e:
        rig.engine.attach(9, 777, rig.reg)
    assert e.value.code == m.Code.PERMISSION
    rig.engine.detach(7)
    rig.engine.close()


def test_refuses_memory_without_legacy_ipc(fake):
    fake.set_current_context(WORKER_CTX)
    t = GpuTensor(fake.alloc(8192, ipc_capable=False), 2, 4096, 4096)
    with pytest.raises(CudaExportRefused, match="expandable") as e:
        export_regions([t], fake)
    assert "client_copy" in e.value.fix


def test_refuses_expandable_segments_and_sleep_mode(fake, monkeypatch):
    fake.set_current_context(WORKER_CTX)
    t = GpuTensor(fake.alloc(8192), 2, 4096, 4096)
    with pytest.raises(CudaExportRefused, match="sleep mode"):
        export_regions([t], fake, sleep_mode=True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    with pytest.raises(CudaExportRefused, match="expandable segments"):
        export_regions([t], fake)


def test_export_sends_uuid_offset_and_one_handle_per_allocation(fake):
    fake.set_current_context(WORKER_CTX)
    base = fake.alloc(1 << 20, device=0)
    regions = export_regions([GpuTensor(base + 4096, 4, 8192, 8192),
                              GpuTensor(base + 65536, 4, 8192, 4096)], fake)
    assert [r.offset for r in regions] == [4096, 65536]
    assert regions[0].ipc_handle == regions[1].ipc_handle
    assert regions[0].device_uuid == fake.uuids[0] and len(regions[0].ipc_handle) == 64
    assert len(fake.of("ipc_get_mem_handle")) == 1


# ------------------------------------------------------------ client-side copy


def _copier_setup(fake, tmp_path):
    pages = [1024, 512]
    rank, tp, spe, extent = 1, 2, 4, 64 * 1024
    rank_bytes = sum(pages)
    path = tmp_path / "pool"
    path.write_bytes(bytes(extent * 2))
    reg = m.Registered(1, 1, rank_bytes * tp, rank_bytes, str(path), extent, spe)
    fake.set_current_context(WORKER_CTX)
    tensors = [GpuTensor(fake.alloc(p * BLOCKS), BLOCKS, p, p) for p in pages]
    for t in tensors:
        fake.buffer(t.ptr)[:] = np.arange(len(fake.buffer(t.ptr))) % 251
    return reg, rank, tensors, path, (spe, extent, rank_bytes, tp)


def test_client_copy_writes_the_daemons_slot_layout_from_a_pinned_mapping(fake, tmp_path):
    reg, rank, tensors, path, (spe, extent, rank_bytes, tp) = _copier_setup(fake, tmp_path)
    cc = ClientCopier(reg, rank, tensors, stream=fake.stream_create(), api=fake)
    assert fake.registered == {cc.pool_base: extent * 2}  # pinned before any copy
    tok = cc.start(m.Direction.STORE, np.array([3]), np.array([5]))
    cc.wait(tok)
    pool = np.fromfile(path, np.uint8)
    slot_off = (5 // spe) * extent + (5 % spe) * rank_bytes * tp
    got = pool[slot_off + rank_bytes + 1024:slot_off + rank_bytes + 1536]
    assert np.array_equal(got, fake.buffer(tensors[1].ptr)[3 * 512:4 * 512])
    cc.close()
    assert fake.registered == {}


def test_client_copy_refuses_the_legacy_default_stream(fake, tmp_path):
    reg, rank, tensors, _, _ = _copier_setup(fake, tmp_path)
    with pytest.raises(KvdClientError, match="default stream"):
        ClientCopier(reg, rank, tensors, stream=0, api=fake)


def test_client_copy_engine_completes_on_arrival():
    done = []
    eng = ClientCopyEngine(lambda job, err, s: done.append(err))
    reg = m.Register(1, m.Fingerprint("m", "d", "d", 16, 1, [1, 2], "h", b""), 0,
                     client_copy=True)
    assert eng.attach(1, 1, reg) == [0, 0]
    z = np.zeros(0, np.uint64)
    eng.submit(CopyJob(1, 1, 1, m.Direction.STORE, 1, z, z, z, z))
    assert done == [None]


def test_client_copy_stores_are_checksummed_from_the_pool():
    """With checksums on (persistence, verify_on_load) a block the client wrote itself
    gets its checksum as one a copy thread wrote would: before, it had none, and a
    restart's recovery dropped it as corrupt."""
    pool = np.random.default_rng(1).integers(0, 256, 1 << 16, np.uint8)
    done = []
    eng = ClientCopyEngine(lambda job, err, s: done.append((job, err)), pool)
    z = np.zeros(0, np.uint64)
    job = CopyJob(1, 1, 1, m.Direction.STORE, 1, z, z, z, np.array([0, 1]))
    job.checksum = ChecksumSpec(np.array([4096, 8192], dtype=np.int64), 4096)
    eng.submit(job)
    assert done == [(job, None)]
    assert job.checksums == [xxhash.xxh3_64_intdigest(pool[o:o + 4096].tobytes())
                             for o in (4096, 8192)]


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


def test_d4_a_load_behind_a_stalled_copy_is_checked_when_it_can_run_not_before(fake):
    """The load lane holds no backlog: a load queued behind a copy the GPU has not
    finished (a stall) is checked against its deadline once that copy completed, so it
    never runs on the GPU long after its check (a load's bytes cannot be taken back)."""
    rig = Rig(fake)
    load_lane = rig.lanes()[0]
    hold = fake.launch(load_lane)  # the GPU stalls ahead of the load lane's copies
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [1], event=1))
    assert fake.wait_for(lambda: len(copies_of(fake, rig)) == 1)
    rig.engine.submit(rig.job(m.Direction.LOAD, [2], [2], event=2,
                              deadline=time.monotonic() + 0.2))
    time.sleep(0.4)  # past the second load's deadline while the first is still stalled
    assert len(copies_of(fake, rig)) == 1  # the second was not enqueued behind it
    hold.set()
    assert rig.wait_done(2)
    assert rig.err(1) is None and rig.err(2).code == m.Code.EXPIRED
    assert len(copies_of(fake, rig)) == 1
    rig.engine.close()


def test_a_store_expired_in_its_gate_is_reported_once_even_if_the_gate_then_fails(fake):
    """The watchdog ends a store whose worker event never completes; when the gate's
    wait then fails too (a sticky error on the device), nobody reports it again."""
    rig = Rig(fake)
    gate, ev = rig.forward()  # the worker's forward pass never ends
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=ev,
                              deadline=time.monotonic() + 0.2))
    assert rig.wait_done(1)
    assert rig.err(1).code == m.Code.EXPIRED
    fake.poison(0)  # a sticky error on the device: the gate's wait returns failing
    time.sleep(0.3)
    assert len(rig.done) == 1, rig.done
    gate.set()
    rig.engine.close()
