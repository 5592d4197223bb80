"""The CUDA data path under faults, against the fake driver: waits that fail, sticky
errors, IPC opens that fail for reasons other than namespaces, a worker event that never
completes on the shared load lane, and a stop with copies still on the GPU."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvd_client.cudart import CudaError
from kvd_proto import messages as m

from kvd.engines import cuda as cuda_module
from kvd.errors import RequestError, TransferError
from kvd.pinning import PoolPinner
from tests.engines.test_cuda_fake import Rig, copies_of


def fail_first_wait(fake, monkeypatch, code=999, name="cudaErrorUnknown"):
    """cudaEventSynchronize fails once, with an error that is not sticky."""
    real, failed = fake.event_synchronize, []

    def wait(ev):
        if not failed:
            failed.append(ev)
            raise CudaError("cudaEventSynchronize", code, name)
        return real(ev)

    monkeypatch.setattr(fake, "event_synchronize", wait)
    return failed


def assert_lost(fake, rig) -> None:
    """Job 1 failed and lost the GPU: a next job fails at once, naming the fix, with no
    CUDA call."""
    assert rig.wait_done(1)
    assert rig.err(1).code == m.Code.TRANSFER_FAILED
    assert rig.engine.stats()["lost_gpus"] == 1
    calls = len(fake.calls)
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [1], event=2))
    assert rig.wait_done(2)
    assert rig.err(2).code == m.Code.TRANSFER_FAILED
    assert "unusable" in str(rig.err(2)) and "restart kvd" in str(rig.err(2))
    assert not [c for c in fake.calls[calls:] if c[0] != "on_done"]


def test_a_failed_wait_ends_its_store_only_after_the_copy_ran(fake, monkeypatch):
    """A wait that fails proves nothing about the copy: its Done (after which the slot
    is handed out again, and the client's memory may close) waits for the streams."""
    rig = Rig(fake)
    _, lane = rig.lanes()
    hold = fake.launch(lane)  # the copy engine is busy: the store's copy stays queued
    fail_first_wait(fake, monkeypatch)
    rig.engine.submit(rig.job(m.Direction.STORE, [3], [5], event=1))
    assert not rig.wait_done(1, 0.3)  # no Done while its copy has not run
    hold.set()
    assert rig.wait_done(1)
    assert isinstance(rig.err(1), TransferError)
    assert np.array_equal(rig.slot_bytes(5, 0), rig.block_bytes(3, 0))  # it ran before
    rig.engine.detach(7)
    assert fake.wait_for(lambda: fake.of("ipc_close_mem_handle"))
    assert not fake.poisoned  # nothing copied through a closed mapping
    assert rig.engine.stats()["lost_gpus"] == 0  # one failed wait: the GPU goes on
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=2, client=7))
    assert rig.wait_done(2) and rig.err(2).code == m.Code.CLIENT_GONE
    rig.engine.close()


def test_copies_that_cannot_be_waited_for_keep_their_memory_open_and_the_gpu_lost(
        fake, monkeypatch):
    """The wait fails and so does the wait for the streams (not sticky): the copies
    may still run. The job fails, its client's handles stay open after it leaves, and
    the GPU takes no more work; a stop reports that copies may still run."""
    rig = Rig(fake)
    fail_first_wait(fake, monkeypatch)

    def sync(stream):
        raise CudaError("cudaStreamSynchronize", 999, "cudaErrorUnknown")

    monkeypatch.setattr(fake, "stream_synchronize", sync)
    rig.engine.submit(rig.job(m.Direction.STORE, [3], [5], event=1))
    assert_lost(fake, rig)
    rig.engine.detach(7)
    time.sleep(0.2)
    assert not fake.of("ipc_close_mem_handle")  # copies may still read it
    t0 = time.monotonic()
    assert rig.engine.close(timeout=0.3) is False
    assert time.monotonic() - t0 < 2
    assert not fake.of("release_primary_context")  # the exit ends the copies, not we


def test_a_sticky_error_marks_the_gpu_lost_and_refuses_its_work_plainly(fake):
    rig = Rig(fake)
    job = rig.job(m.Direction.STORE, [0], [0], event=1)
    job.remote = job.remote + np.uint64(10 ** 9)  # outside every mapping: illegal address
    rig.engine.submit(job)
    assert_lost(fake, rig)
    fake.set_current_context(None)
    with pytest.raises(TransferError, match="restart kvd") as e:  # not "PID namespace"
        rig.engine.attach(9, 4243, rig.reg)
    assert e.value.code == m.Code.TRANSFER_FAILED
    t0 = time.monotonic()
    rig.engine.close()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("code,name,want,text", [
    (2, "cudaErrorMemoryAllocation", m.Code.NO_SPACE, "no room to map"),
    (217, "cudaErrorPeerAccessUnsupported", m.Code.PERMISSION, "peer access"),
    (205, "cudaErrorMapBufferObjectFailed", m.Code.PERMISSION, "PID namespace"),
])
def test_an_ipc_open_failure_gets_the_advice_that_fits_it(fake, monkeypatch, code, name,
                                                          want, text):
    rig = Rig(fake)
    rig.engine.detach(7)
    assert fake.wait_for(lambda: rig.engine.stats()["ipc_memory"] == 0)

    def fail(handle):
        raise CudaError("cudaIpcOpenMemHandle", code, name)

    monkeypatch.setattr(fake, "ipc_open_mem_handle", fail)
    fake.set_current_context(None)
    with pytest.raises(TransferError, match=text) as e:
        rig.engine.attach(8, 4242, rig.reg)
    assert e.value.code == want
    assert rig.engine.stats()["ipc_memory"] == 0 and rig.engine.stats()["lost_gpus"] == 0
    rig.engine.close()


def test_a_load_without_a_deadline_cannot_hold_the_shared_load_lane(fake, monkeypatch):
    """A load naming a worker event that never completes, with no deadline (a raw
    client): the GPU's other clients load again after EVENT_WAIT_MAX_S."""
    monkeypatch.setattr(cuda_module, "EVENT_WAIT_MAX_S", 0.3)
    a = Rig(fake)
    b = Rig(fake, engine=a.engine, client=8)
    b.done = a.done
    gate, ev = a.forward()  # a's forward pass never ends
    a.engine.submit(a.job(m.Direction.LOAD, [0], [0], event=1, cuda_event=ev))
    time.sleep(0.4)
    a.engine.submit(b.job(m.Direction.LOAD, [2], [2], event=2,
                          deadline=time.monotonic() + 2))
    assert a.wait_done(2)
    assert a.err(1).code == m.Code.EXPIRED and a.err(2) is None
    gate.set()
    a.engine.close()


def test_an_event_index_below_minus_one_is_a_bad_request(fake):
    rig = Rig(fake)
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=1, cuda_event=-2))
    assert rig.wait_done(1)
    assert isinstance(rig.err(1), RequestError) and rig.err(1).code == m.Code.BAD_REQUEST
    assert not copies_of(fake, rig)
    rig.engine.close()


def test_a_stop_with_a_stalled_copy_is_bounded_and_keeps_the_context(fake):
    rig = Rig(fake)
    load_lane, _ = rig.lanes()
    hold = fake.launch(load_lane)  # the GPU has not run the copy yet
    rig.engine.submit(rig.job(m.Direction.LOAD, [1], [1], event=1))
    assert fake.wait_for(lambda: len(copies_of(fake, rig)) == 1)
    t0 = time.monotonic()
    assert rig.engine.close(timeout=0.3) is False
    assert time.monotonic() - t0 < 2
    assert not fake.of("release_primary_context")
    hold.set()
    assert rig.wait_done(1) and rig.err(1) is None  # its one Done, once it ran


def test_a_stop_cancels_pinning_between_chunks(fake, monkeypatch):
    """A stop during a large pool's pinning waits for one chunk, not all of them, and
    unregisters exactly what was registered."""
    real, started = fake.host_register, threading.Event()

    def slow(ptr, n):
        started.set()
        time.sleep(0.05)
        real(ptr, n)

    monkeypatch.setattr(fake, "host_register", slow)
    pinner = PoolPinner(0x10_0000_0000, 40 << 30, fake, chunk_bytes=1 << 30)
    pinner.start()
    assert started.wait(5)
    t0 = time.monotonic()
    pinner.release()
    assert time.monotonic() - t0 < 1
    registered = len(fake.of("host_register"))
    assert 1 <= registered < 40
    assert len(fake.of("host_unregister")) == registered and not fake.registered
    assert pinner.status()["state"] == "released"


def test_a_lane_that_cannot_be_made_frees_what_it_made_and_says_so(fake, monkeypatch):
    """The store lane's second event fails to be made: its four streams and first event
    were never freed (each refused attach leaked them), and the refusal blamed the
    client's IPC handles, which had opened fine."""
    rig = Rig(fake)
    real = fake.event_create
    made = {"n": 0}

    def flaky(interprocess=False, blocking=False):
        if threading.current_thread().name == "MainThread" and not interprocess:
            made["n"] += 1
            if made["n"] == 2:
                raise CudaError("cudaEventCreateWithFlags", 2, "cudaErrorMemoryAllocation")
        return real(interprocess, blocking)

    fake.set_current_context(None)
    streams_before = {c[2] for c in fake.of("stream_create")}
    events_before = {c[2] for c in fake.of("event_create")}
    monkeypatch.setattr(fake, "event_create", flaky)
    for attempt in range(3):
        made["n"] = 0
        with pytest.raises(TransferError) as refused:
            rig.engine.attach(100 + attempt, 4242, rig.reg)
        assert "copy streams" in str(refused.value) and "IPC" not in str(refused.value)
    monkeypatch.setattr(fake, "event_create", real)
    made_streams = {c[2] for c in fake.of("stream_create")} - streams_before
    made_events = {c[2] for c in fake.of("event_create")} - events_before
    freed = {c[2] for c in fake.of("stream_destroy")} | {c[2] for c in fake.of("event_destroy")}
    assert len(made_streams) == 12 and not made_streams - freed
    assert len(made_events) == 3 and not made_events - freed
    rig.engine.close()


def test_a_sticky_error_met_polling_a_workers_event_loses_the_gpu(fake):
    """The vLLM store path waits for the worker's event first: a sticky error there
    failed the job but left the GPU counted usable (`lost_gpus` 0), and each later job
    tried the dead context again."""
    rig = Rig(fake)
    gate, ev = rig.forward()
    rig.engine.submit(rig.job(m.Direction.STORE, [3], [5], event=1, cuda_event=ev))
    assert fake.wait_for(lambda: fake.of("event_query"))
    fake.poison(0)  # another copy hit an illegal address, say
    assert_lost(fake, rig)
    gate.set()
    rig.engine.close()


def test_a_sticky_error_first_met_by_an_attach_loses_the_gpu_without_a_deadlock(fake):
    """attach holds the engine's lock, and losing the GPU took it again: a Register
    that was the first call to meet a sticky error (vLLM restarted after an ECC fault)
    froze the daemon's loop and every copy thread until it was killed."""
    rig = Rig(fake)
    fake.poison(0)
    fake.set_current_context(None)
    out: list[BaseException] = []

    def attach() -> None:
        try:
            rig.engine.attach(9, 4243, rig.reg)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    t = threading.Thread(target=attach, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "attach deadlocked"
    assert isinstance(out[0], TransferError) and out[0].code == m.Code.TRANSFER_FAILED
    assert "restart kvd" in str(out[0])
    assert rig.engine.stats()["lost_gpus"] == 1
    t0 = time.monotonic()
    rig.engine.close(timeout=2)
    assert time.monotonic() - t0 < 5


def test_a_deadline_years_away_leaves_the_deadline_watch_running(fake, monkeypatch):
    """A far deadline (deadline_ns near 2**64, as some clients say "none") overflowed
    the watchdog's wait and ended its thread: a store waiting for a worker event that
    never completes was no longer ended at its capped deadline."""
    monkeypatch.setattr(cuda_module, "EVENT_WAIT_MAX_S", 0.5)
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(str(a.exc_value)))
    rig = Rig(fake)
    rig.engine.submit(rig.job(m.Direction.LOAD, [0], [0], event=1,
                              deadline=(2**64 - 1) / 1e9))
    assert rig.wait_done(1) and rig.err(1) is None
    gate, ev = rig.forward()  # the worker's forward pass never ends
    rig.engine.submit(rig.job(m.Direction.STORE, [1], [1], event=2, cuda_event=ev,
                              deadline=time.monotonic() + 0.3))
    assert rig.wait_done(2, 5)
    assert rig.err(2).code == m.Code.EXPIRED and died == []
    gate.set()
    rig.engine.close()


def test_a_pinner_whose_context_cannot_be_made_current_still_releases_it(fake, monkeypatch):
    """The primary context was retained, then cuCtxSetCurrent failed: release() did not
    know it owed a release, and the retain stayed for the process's life."""
    def refuse(ctx):
        raise CudaError("cuCtxSetCurrent", 201, "CUDA_ERROR_INVALID_CONTEXT")

    monkeypatch.setattr(fake, "set_current_context", refuse)
    pool = np.zeros(1 << 16, np.uint8)
    pinner = PoolPinner(pool.ctypes.data, pool.nbytes, fake)
    pinner.start()
    assert pinner.wait(5)
    assert pinner.status()["state"] == "failed"
    pinner.release()
    assert len(fake.of("retain_primary_context")) == len(fake.of("release_primary_context")) == 1
