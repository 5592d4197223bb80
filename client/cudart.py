"""The seam between kvd and the CUDA driver: exactly the calls kvd uses, nothing more.

Why a seam: no development machine has a GPU, so every CUDA code path is tested against
a fake driver that implements ``CudaApi`` (tests/engines/fake_cuda.py: asynchronous
streams, per-thread contexts, sticky errors) and is handed to the engine, the pinner and
the client helpers as a constructor argument; a conformance test passes the arguments
``CudaBindings`` builds to the real cuda-bindings functions. ``CudaBindings`` imports
cuda-bindings only when it is built, so ``import kvd`` and ``import kvd_client`` work on
machines without CUDA. It lives in the client package because both sides use it and the
wire package (kvd_proto) holds messages and ids only.

CUDA major versions: cuda-bindings 13.x carries a CUDA 13 runtime, which fails every
runtime call on a CUDA 12 driver (``cudaErrorInsufficientDriver``). Install the bindings
of the node's driver (``kvd[cu12]`` or ``kvd[cu13]``); ``load`` compares the two at start
and refuses with that fix.

Conventions of this seam (not of cuda-python): handles, pointers, streams and events are
plain ``int``; IPC handles are 64 raw ``bytes``; every failure raises ``CudaError`` naming
the call. cuda-python returns a tuple whose first item is the error code, and the arity
differs between releases (``cuMemcpyBatchAsync`` returns ``(err, failIdx)`` in 12.9 and
``(err,)`` in 13.x), so results are unpacked by position here and nowhere else. The
batched copy does not go through the Python wrapper at all (it builds Python lists, O(n)
per call): it is the C entry point from ``cuGetProcAddress`` called through ctypes with
numpy arrays, as vLLM's ``simple_kv_offload/cuda_mem_ops.py`` does.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np

from kvd_client.errors import KvdClientError

IPC_HANDLE_BYTES = 64
# CUmemcpySrcAccessOrder: STREAM when the source may still be written in stream order
# (a store reads GPU memory the forward pass wrote), ANY for a stable source (pinned pool).
ACCESS_ORDER_STREAM = 1
ACCESS_ORDER_ANY = 3
BATCH_MIN_DRIVER = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8


class CudaError(KvdClientError):
    """A CUDA call failed; ``code`` is the numeric error, ``call`` the function name."""

    def __init__(self, call: str, code: int, name: str = "") -> None:
        super().__init__(f"{call} failed: {name or 'error'} ({code})")
        self.call = call
        self.code = code


class CudaApi(Protocol):
    """The driver/runtime calls kvd makes. Real: ``CudaBindings``; tests: the fake."""

    # devices and contexts
    def init(self) -> None: ...
    def driver_version(self) -> int: ...
    def runtime_version(self) -> int: ...
    def device_count(self) -> int: ...
    def device_uuid(self, ordinal: int) -> bytes: ...
    def retain_primary_context(self, ordinal: int) -> int: ...
    def release_primary_context(self, ordinal: int) -> None: ...
    def set_current_context(self, ctx: int) -> None: ...
    # exporting memory and events (worker side)
    def address_range(self, ptr: int) -> tuple[int, int]: ...
    def legacy_ipc_capable(self, ptr: int) -> bool: ...
    def pointer_device(self, ptr: int) -> int: ...
    def ipc_get_mem_handle(self, base: int) -> bytes: ...
    def ipc_get_event_handle(self, event: int) -> bytes: ...
    # importing them (daemon side)
    def ipc_open_mem_handle(self, handle: bytes) -> int: ...
    def ipc_close_mem_handle(self, devptr: int) -> None: ...
    def ipc_open_event_handle(self, handle: bytes) -> int: ...
    # streams, events, copies
    def stream_create(self) -> int: ...
    def stream_destroy(self, stream: int) -> None: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def event_create(self, interprocess: bool = False, blocking: bool = False) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def event_query(self, event: int) -> bool: ...
    def event_synchronize(self, event: int) -> None: ...
    def has_batch_copy(self) -> bool: ...
    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     access_order: int, stream: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    # pinning host memory
    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...
    def clear_last_error(self) -> None: ...


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: one entry at index 0 applies to every copy of a batch."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _Loc),
                ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


# The 12.8 ABI, which keeps failIdx. Asking cuGetProcAddress for version 12080 returns
# this ABI even from a 13.x driver, whose default cuMemcpyBatchAsync dropped failIdx.
BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_uint,  # CUresult
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # attrs, attrsIdxs, numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # stream
)


class CudaBindings:
    """``CudaApi`` over cuda-python (cuda-bindings 12.x or 13.x), imported here, lazily."""

    def __init__(self) -> None:
        from cuda.bindings import driver, runtime  # noqa: PLC0415 - lazy on purpose

        self._drv = driver
        self._rt = runtime
        self._batch: Any = None
        self._batch_checked = False
        # 12.x has cuDeviceGetUuid (GPU UUID even under MIG) and cuDeviceGetUuid_v2 (the
        # MIG instance's UUID); 13.x has only cuDeviceGetUuid, with the v2 meaning.
        self._uuid_fn = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid

    # ------------------------------------------------------------ result checking
    def _ok(self, call: str, res: Any) -> Any:
        """Raise on a failed call; return the first value after the error code."""
        err = res[0] if isinstance(res, tuple) else res
        code = int(err)
        if code != 0:
            raise CudaError(call, code, getattr(err, "name", ""))
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    # ------------------------------------------------------------ devices and contexts
    def init(self) -> None:
        self._ok("cuInit", self._drv.cuInit(0))

    def driver_version(self) -> int:
        return int(self._ok("cuDriverGetVersion", self._drv.cuDriverGetVersion()))

    def runtime_version(self) -> int:
        """The CUDA runtime these bindings carry (needs no driver)."""
        return int(self._ok("cudaRuntimeGetVersion", self._rt.cudaRuntimeGetVersion()))

    def device_count(self) -> int:
        return int(self._ok("cuDeviceGetCount", self._drv.cuDeviceGetCount()))

    def _device(self, ordinal: int) -> Any:
        return self._ok("cuDeviceGet", self._drv.cuDeviceGet(ordinal))

    def device_uuid(self, ordinal: int) -> bytes:
        return bytes(self._ok("cuDeviceGetUuid", self._uuid_fn(self._device(ordinal))).bytes)

    def retain_primary_context(self, ordinal: int) -> int:
        ctx = self._ok("cuDevicePrimaryCtxRetain",
                       self._drv.cuDevicePrimaryCtxRetain(self._device(ordinal)))
        return int(ctx)

    def release_primary_context(self, ordinal: int) -> None:
        self._ok("cuDevicePrimaryCtxRelease",
                 self._drv.cuDevicePrimaryCtxRelease(self._device(ordinal)))

    def set_current_context(self, ctx: int) -> None:
        self._ok("cuCtxSetCurrent", self._drv.cuCtxSetCurrent(self._drv.CUcontext(ctx)))

    # ------------------------------------------------------------ export
    def address_range(self, ptr: int) -> tuple[int, int]:
        res = self._drv.cuMemGetAddressRange(ptr)  # (err, base, size)
        self._ok("cuMemGetAddressRange", res)
        return int(res[1]), int(res[2])

    def _attr(self, name: str, ptr: int) -> int:
        attr = getattr(self._drv.CUpointer_attribute, name)
        return int(self._ok("cuPointerGetAttribute", self._drv.cuPointerGetAttribute(attr, ptr)))

    def legacy_ipc_capable(self, ptr: int) -> bool:
        return bool(self._attr("CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", ptr))

    def pointer_device(self, ptr: int) -> int:
        return self._attr("CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL", ptr)

    def ipc_get_mem_handle(self, base: int) -> bytes:
        h = self._ok("cudaIpcGetMemHandle", self._rt.cudaIpcGetMemHandle(base))
        return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)  # the struct has only getPtr()

    def ipc_get_event_handle(self, event: int) -> bytes:
        h = self._ok("cudaIpcGetEventHandle", self._rt.cudaIpcGetEventHandle(event))
        return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)

    # ------------------------------------------------------------ import
    def ipc_open_mem_handle(self, handle: bytes) -> int:
        h = self._rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), _raw64(handle), IPC_HANDLE_BYTES)
        res = self._rt.cudaIpcOpenMemHandle(h, self._rt.cudaIpcMemLazyEnablePeerAccess)
        return int(self._ok("cudaIpcOpenMemHandle", res))

    def ipc_close_mem_handle(self, devptr: int) -> None:
        self._ok("cudaIpcCloseMemHandle", self._rt.cudaIpcCloseMemHandle(devptr))

    def ipc_open_event_handle(self, handle: bytes) -> int:
        h = self._rt.cudaIpcEventHandle_t()
        ctypes.memmove(h.getPtr(), _raw64(handle), IPC_HANDLE_BYTES)
        return int(self._ok("cudaIpcOpenEventHandle", self._rt.cudaIpcOpenEventHandle(h)))

    # ------------------------------------------------------------ streams and events
    def stream_create(self) -> int:
        # Non-blocking: the legacy default stream would serialise with everything, and
        # cuMemcpyBatchAsync rejects it.
        res = self._rt.cudaStreamCreateWithFlags(self._rt.cudaStreamNonBlocking)
        return int(self._ok("cudaStreamCreateWithFlags", res))

    def stream_destroy(self, stream: int) -> None:
        self._ok("cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._ok("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._ok("cudaStreamWaitEvent", self._rt.cudaStreamWaitEvent(stream, event, 0))

    def event_create(self, interprocess: bool = False, blocking: bool = False) -> int:
        flags = self._rt.cudaEventDisableTiming
        if interprocess:  # both flags are required for an IPC event
            flags |= self._rt.cudaEventInterprocess
        if blocking:  # cudaEventSynchronize sleeps instead of spinning a core
            flags |= self._rt.cudaEventBlockingSync
        return int(self._ok("cudaEventCreateWithFlags", self._rt.cudaEventCreateWithFlags(flags)))

    def event_destroy(self, event: int) -> None:
        self._ok("cudaEventDestroy", self._rt.cudaEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        self._ok("cudaEventRecord", self._rt.cudaEventRecord(event, stream))

    def event_query(self, event: int) -> bool:
        err = self._rt.cudaEventQuery(event)[0]
        if err == self._rt.cudaError_t.cudaErrorNotReady:
            return False
        self._ok("cudaEventQuery", (err,))
        return True

    def event_synchronize(self, event: int) -> None:
        self._ok("cudaEventSynchronize", self._rt.cudaEventSynchronize(event))

    # ------------------------------------------------------------ copies
    def has_batch_copy(self) -> bool:
        if not self._batch_checked:
            self._batch_checked = True
            if self.driver_version() >= BATCH_MIN_DRIVER:
                res = self._drv.cuGetProcAddress(b"cuMemcpyBatchAsync", BATCH_MIN_DRIVER, 0)
                if int(res[0]) == 0 and int(res[1]):  # (err, pfn, symbolStatus)
                    self._batch = BATCH_FN(int(res[1]))
        return self._batch is not None

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     access_order: int, stream: int) -> None:
        if not self.has_batch_copy():
            raise CudaError("cuMemcpyBatchAsync", 801, "CUDA_ERROR_NOT_SUPPORTED")
        call_batch(self._batch, dsts, srcs, sizes, access_order, stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDefault  # direction inferred (UVA)
        self._ok("cudaMemcpyAsync", self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream))

    # ------------------------------------------------------------ pinning
    def host_register(self, ptr: int, nbytes: int) -> None:
        # Portable: pinned for every context, since the daemon uses one per GPU.
        res = self._rt.cudaHostRegister(ptr, nbytes, self._rt.cudaHostRegisterPortable)
        self._ok("cudaHostRegister", res)

    def host_unregister(self, ptr: int) -> None:
        self._ok("cudaHostUnregister", self._rt.cudaHostUnregister(ptr))

    def clear_last_error(self) -> None:
        self._rt.cudaGetLastError()  # reads and resets the latched error


def call_batch(fn: Any, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
               access_order: int, stream: int) -> None:
    """Call the 12.8-ABI ``cuMemcpyBatchAsync`` pointer ``fn`` (a ``BATCH_FN``) with numpy
    arrays: one attribute entry, at index 0, for every copy."""
    dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
    attrs = MemcpyAttributes(srcAccessOrder=access_order)
    idx = ctypes.c_size_t(0)
    fail = ctypes.c_size_t(0)
    err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
             ctypes.addressof(attrs), ctypes.byref(idx), 1, ctypes.byref(fail), stream)
    if err != 0:
        raise CudaError(f"cuMemcpyBatchAsync (copy {fail.value})", int(err))


def copy_runs(api: CudaApi, dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray,
              access_order: int, stream: int) -> None:
    """Enqueue copies: one batched call (driver 12.8+), else one cudaMemcpyAsync per run
    (callers coalesce first, so that loop runs over contiguous runs, not blocks)."""
    if not len(lengths):
        return
    if api.has_batch_copy():
        api.memcpy_batch(dsts, srcs, lengths, access_order, stream)
        return
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), lengths.tolist()):
        api.memcpy_async(d, s, n, stream)


def _raw64(handle: bytes) -> bytes:
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
    return bytes(handle)


def version_refusal(driver: int, runtime: int) -> str | None:
    """Why bindings built for CUDA ``runtime`` cannot run on ``driver``, with the fix."""
    if driver // 1000 >= runtime // 1000:
        return None
    have = f"{driver // 1000}.{driver % 1000 // 10}"
    return (f"the installed cuda-bindings carry a CUDA {runtime // 1000} runtime, but this "
            f"node's driver supports CUDA {have} only (every runtime call would fail with "
            f"cudaErrorInsufficientDriver). Fix: install the bindings of the driver's major, "
            f"pip install 'kvd[cu{driver // 1000}]', or upgrade the NVIDIA driver")


def load(api: CudaApi | None = None) -> CudaApi:
    """The driver seam (``api``, else the real one), initialised and checked: raises
    CudaUnavailable when there is no CUDA, no device, or bindings of another major."""
    if api is None:
        try:
            api = CudaBindings()
        except ImportError:
            raise CudaUnavailable("cuda-bindings is not installed. Fix: pip install "
                                  "'kvd[cu12]' or 'kvd[cu13]', the major of the node's "
                                  "NVIDIA driver (nvidia-smi shows it)") from None
    try:
        api.init()
        why = version_refusal(api.driver_version(), api.runtime_version())
        if why:
            raise CudaVersionMismatch(why)
        if api.device_count() < 1:
            raise CudaUnavailable("no CUDA device is visible")
    except CudaUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable CUDA"
        raise CudaUnavailable(f"CUDA is not usable here: {e}") from e
    return api


class CudaUnavailable(KvdClientError):
    """No driver, no device, or cuda-python missing: CUDA paths are off."""


class CudaVersionMismatch(CudaUnavailable):
    """A driver is there, but the bindings carry another CUDA major: an install to fix."""


def gpu_available() -> bool:
    """True when a CUDA device is usable (for skipping GPU tests and benchmarks)."""
    try:
        load()
    except CudaUnavailable:
        return False
    return True
