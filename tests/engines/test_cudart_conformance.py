"""Conformance of ``kvd_client.cudart.CudaBindings`` with the installed cuda-bindings.

The fake driver checks what kvd asks for; this checks that the real bindings accept the
way it asks. A worker, a daemon engine, the pinner and a client-side copier run a store
and a load against the fake through a recorder that keeps the exact argument objects
kvd built; every recorded call is then replayed through ``CudaBindings`` on the real
``cuda.bindings``. Without a driver each call fails with "driver not found" (driver API)
or ``cudaErrorInsufficientDriver`` (runtime API), but a wrong-typed argument fails with
TypeError first: that is what this test catches. Every ``CudaApi`` method must have been
replayed. Skipped where cuda-bindings is missing, and where a GPU is usable (replaying
bogus pointers on a live driver is not a test; the gpu tests cover that machine).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import pytest

from kvd.engines.base import CopyJob
from kvd.engines.cuda import CudaEngine
from kvd.pinning import PoolPinner
from kvd_client.cuda import ClientCopier, EventRing, GpuTensor, export_regions
from kvd_client.cudart import (BATCH_FN, CudaApi, CudaBindings, CudaError, call_batch,
                               gpu_available, load)
from kvd_proto import messages as m
from tests.engines.fake_cuda import FakeCuda

bindings = pytest.importorskip("cuda.bindings")
pytestmark = pytest.mark.skipif(gpu_available(), reason="a live driver is present")

API = sorted(n for n in vars(CudaApi) if not n.startswith("_"))


class Recorder:
    """Forwards to the fake and keeps ``(method, args, kwargs)`` as kvd passed them."""

    def __init__(self, fake: FakeCuda) -> None:
        self._fake = fake
        self.seen: list[tuple[str, tuple, dict]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._fake, name)
        if name not in API:
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.seen.append((name, args, kwargs))
            return target(*args, **kwargs)

        return call


def _drive(api: Recorder, fake: FakeCuda, tmp_path, driver: int) -> None:
    """What kvd does on a GPU node: export, register, store, load, pin, copy, stop."""
    fake.driver = driver
    assert load(api) is api  # the start-up check: driver and runtime versions
    fake.set_current_context(0xC0)
    compute = api.stream_create()
    t = GpuTensor(fake.alloc(4096 * 4), 4, 4096, 4096)
    ring = EventRing(2, api)
    regions = export_regions([t], api)
    pool = np.zeros(4096 * 8, np.uint8)
    done: list = []
    pinner = PoolPinner(pool.ctypes.data, pool.nbytes, api)
    pinner.start()
    assert pinner.wait(5)
    def on_done(job: CopyJob, err: Exception | None, seconds: float) -> None:
        done.append(err)
        fake._rec("on_done", job.event)  # wakes fake.wait_for

    engine = CudaEngine(on_done, api, pool=pool, pinned=pinner.ready)
    fake.set_current_context(None)
    (base,) = engine.attach(1, 4242, m.Register(
        1, m.Fingerprint("m", "d", "d", 16, 1, [4096], "h", b""), 0, [], regions, ring.handles))
    fake.set_current_context(0xC0)
    ev = ring.record_next(compute)
    arr = np.array
    for direction, cuda_event in ((m.Direction.STORE, ev), (m.Direction.LOAD, -1)):
        engine.submit(CopyJob(1, 1, 1, direction, 4242, arr([pool.ctypes.data], np.uint64),
                              arr([base + 4096], np.uint64), arr([4096], np.uint64),
                              arr([0]), cuda_event))
    assert fake.wait_for(lambda: len(done) == 2) and done == [None, None]
    engine.detach(1)
    engine.close()
    pinner.release()
    path = tmp_path / f"pool{driver}"
    path.write_bytes(bytes(1 << 16))
    cc_stream = api.stream_create()
    cc = ClientCopier(m.Registered(1, 1, 4096, 4096, str(path), 1 << 16, 16), 0, [t],
                      cc_stream, api)
    cc.wait(cc.start(m.Direction.STORE, arr([1]), arr([2])))
    order = api.event_create()  # ClientCopyPath: a load after the compute stream's work
    api.event_record(order, compute)
    api.stream_wait_event(cc_stream, order)
    token = cc.start(m.Direction.LOAD, arr([1]), arr([2]))
    fake.idle()
    assert cc.done(token)
    cc.start(m.Direction.LOAD, arr([1]), arr([2]))
    cc.close()  # waits for that copy before unmapping
    api.stream_synchronize(compute)
    api.stream_destroy(compute)
    ring.close(timeout=0)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> list[tuple[str, tuple, dict]]:
    seen: list[tuple[str, tuple, dict]] = []
    for driver in (12090, 12040):  # batched copies, and the per-run fallback
        fake = FakeCuda(driver=driver)
        rec = Recorder(fake)
        try:
            _drive(rec, fake, tmp_path_factory.mktemp("pool"), driver)
        finally:
            fake.shutdown()
        assert fake.violations == []
        seen += rec.seen
    seen.append(("clear_last_error", (), {}))  # kvd calls it only after a failed pin
    return seen


def _driver_missing(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "driver" in text or "libcuda" in text


def replay(name: str, args: tuple, kwargs: dict) -> None:
    """Call ``CudaBindings.<name>``; only typed CUDA failures are acceptable."""
    real = CudaBindings()
    try:
        getattr(real, name)(*args, **kwargs)
    except CudaError:
        pass  # the runtime answered (cudaErrorInsufficientDriver): the arguments passed
    except (TypeError, AttributeError, ValueError, OverflowError):
        raise
    except Exception as e:  # noqa: BLE001 - the driver API without a driver
        if not _driver_missing(e):
            raise


def test_every_call_kvd_makes_was_replayed(recorded):
    assert sorted({name for name, _, _ in recorded}) == API


def test_the_bindings_accept_every_argument_kvd_builds(recorded):
    unique: dict[tuple, tuple[str, tuple, dict]] = {}
    for name, args, kwargs in recorded:  # one per method and argument types
        key = (name, tuple(type(a).__name__ for a in args), tuple(sorted(kwargs)))
        unique.setdefault(key, (name, args, kwargs))
    for name, args, kwargs in unique.values():
        replay(name, args, kwargs)


def test_a_wrong_type_is_caught_before_the_missing_driver():
    from cuda.bindings import driver, runtime

    with pytest.raises(TypeError):
        driver.cuStreamWaitEvent("x", 5, 0)
    with pytest.raises(TypeError):
        replay("stream_wait_event", ("x", 5), {})
    with pytest.raises(TypeError):  # the handle struct, not raw bytes
        runtime.cudaIpcOpenMemHandle(b"x" * 64, runtime.cudaIpcMemLazyEnablePeerAccess)


def test_the_batched_copy_passes_the_12_8_abi():
    got: dict[str, Any] = {}

    def fake_entry(dsts, srcs, sizes, count, attrs, idxs, nattrs, fail, stream):  # noqa: PLR0913
        at = ctypes.cast(attrs, ctypes.POINTER(ctypes.c_uint))
        got.update(dsts=[ctypes.cast(dsts, ctypes.POINTER(ctypes.c_uint64))[i]
                         for i in range(count)],
                   sizes=[ctypes.cast(sizes, ctypes.POINTER(ctypes.c_uint64))[i]
                          for i in range(count)],
                   order=at[0], idx=ctypes.cast(idxs, ctypes.POINTER(ctypes.c_size_t))[0],
                   nattrs=nattrs, stream=stream)
        return 0

    fn = BATCH_FN(fake_entry)
    call_batch(fn, np.array([7, 9], np.uint64), np.array([1, 2], np.uint64),
               np.array([4096, 512], np.uint64), 3, 0x5000)
    assert got == {"dsts": [7, 9], "sizes": [4096, 512], "order": 3, "idx": 0, "nattrs": 1,
                   "stream": 0x5000}


class _DriverAnswers(CudaBindings):
    """The real bindings, except that the first call of a chain answers what a driver
    would have (a device handle, a driver version): without a driver that first call
    fails, and the calls behind it (cuDeviceGetUuid, cuDevicePrimaryCtxRetain/Release,
    cuGetProcAddress) would never meet the bindings."""

    def _device(self, ordinal: int) -> Any:
        return self._drv.CUdevice(ordinal)

    def driver_version(self) -> int:
        return 12090


@pytest.mark.parametrize("name,args", [
    ("device_uuid", (0,)), ("retain_primary_context", (0,)),
    ("release_primary_context", (0,)), ("has_batch_copy", ()),
])
def test_calls_behind_the_first_one_of_a_chain_take_kvds_arguments(name, args):
    try:
        getattr(_DriverAnswers(), name)(*args)
    except CudaError:
        pass
    except (TypeError, AttributeError, ValueError, OverflowError):
        raise
    except Exception as e:  # noqa: BLE001 - the driver API without a driver
        if not _driver_missing(e):
            raise


def test_the_chain_check_would_see_a_wrong_type():
    from cuda.bindings import driver

    with pytest.raises(TypeError):
        driver.cuDevicePrimaryCtxRetain("device 0")
    with pytest.raises(TypeError):
        driver.cuGetProcAddress(b"cuMemcpyBatchAsync", "12080", 0)
