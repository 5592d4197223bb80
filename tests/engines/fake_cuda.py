"""A recording fake of the CUDA calls kvd makes (implements ``kvd_proto.cudart.CudaApi``).

It stands in for both processes of a test: the worker's allocations ("device memory" is
a numpy buffer of this process, seen at a fake device address) and the daemon's opened
IPC mappings (another fake address range over the same buffer). Copies really move
bytes, translating fake device addresses; host (pool) addresses are real. Every call is
appended to ``calls`` as ``(name, thread name, *args)`` so tests assert order.

Completion is under the test's control: with ``auto_complete`` off, a recorded event is
complete only after ``complete(event)`` or ``complete_all()``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from kvd_proto.cudart import CudaError

INVALID_VALUE = 1
INVALID_CONTEXT = 201
NOT_READY = 600
ILLEGAL_ADDRESS = 700
MAP_FAILED = 205


@dataclass
class Allocation:
    buf: np.ndarray  # backing bytes
    worker_base: int  # address in the (fake) worker process
    device: int
    ipc_capable: bool


class FakeCuda:
    def __init__(self, uuids: tuple[bytes, ...] = (bytes(range(16)),), *,
                 driver: int = 12090, auto_complete: bool = True) -> None:
        self.uuids = list(uuids)
        self.driver = driver
        self.auto_complete = auto_complete
        self.calls: list[tuple] = []
        self.allocs: list[Allocation] = []
        self.maps: dict[int, Allocation] = {}  # daemon-side devptr -> allocation
        self.handles: dict[bytes, Allocation] = {}
        self.open_count: dict[bytes, int] = {}
        self.ipc_events: dict[bytes, int] = {}  # handle -> worker event
        self.events: set[int] = set()
        self.recorded: set[int] = set()
        self.completed: set[int] = set()
        self.registered: dict[int, int] = {}
        self.fail_register: set[int] = set()  # chunk index (by call order) that fails
        self.fail_open = False
        self.last_error = 0
        self._next = 0x1000
        self._next_addr = 0x7A00_0000_0000
        self._lock = threading.Lock()
        self._ctx = threading.local()

    # ------------------------------------------------------------ helpers for tests
    def alloc(self, nbytes: int, device: int = 0, ipc_capable: bool = True) -> int:
        """A worker allocation; returns its (fake) worker address."""
        a = Allocation(np.zeros(nbytes, np.uint8), self._addr(nbytes), device, ipc_capable)
        self.allocs.append(a)
        return a.worker_base

    def buffer(self, worker_ptr: int) -> np.ndarray:
        for a in self.allocs:
            if a.worker_base <= worker_ptr < a.worker_base + len(a.buf):
                return a.buf[worker_ptr - a.worker_base:]
        raise KeyError(worker_ptr)

    def names(self, *only: str) -> list[str]:
        return [c[0] for c in self.calls if not only or c[0] in only]

    def of(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]

    def complete(self, event: int) -> None:
        with self._lock:
            self.completed.add(event)

    def complete_all(self) -> None:
        with self._lock:
            self.completed |= self.recorded

    # ------------------------------------------------------------ internals
    def _addr(self, nbytes: int) -> int:
        with self._lock:
            a = self._next_addr
            self._next_addr += (nbytes + 0xFFFFF) & ~0xFFFFF
            return a

    def _id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _rec(self, name: str, *args: object) -> None:
        with self._lock:
            self.calls.append((name, threading.current_thread().name, *args))

    def _need_ctx(self, call: str) -> None:
        if getattr(self._ctx, "ctx", None) is None:
            raise CudaError(call, INVALID_CONTEXT, "cudaErrorInvalidContext")

    def _real(self, addr: int, n: int) -> int:
        """Host addresses pass through; daemon device addresses map to their buffer."""
        views = [*self.maps.items(), *((a.worker_base, a) for a in self.allocs)]
        for base, a in views:  # the daemon's mappings, and the worker's own addresses
            if base <= addr < base + len(a.buf):
                if addr + n > base + len(a.buf):
                    raise CudaError("copy", ILLEGAL_ADDRESS, "cudaErrorIllegalAddress")
                return a.buf.ctypes.data + (addr - base)
        if addr >= 0x7A00_0000_0000 and addr < 0x7B00_0000_0000:
            raise CudaError("copy", ILLEGAL_ADDRESS, "cudaErrorIllegalAddress")
        return addr

    # ------------------------------------------------------------ CudaApi
    def init(self) -> None:
        self._rec("init")

    def driver_version(self) -> int:
        return self.driver

    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, ordinal: int) -> bytes:
        return self.uuids[ordinal]

    def retain_primary_context(self, ordinal: int) -> int:
        self._rec("retain_primary_context", ordinal)
        return 0xC0 + ordinal

    def release_primary_context(self, ordinal: int) -> None:
        self._rec("release_primary_context", ordinal)

    def set_current_context(self, ctx: int) -> None:
        self._ctx.ctx = ctx

    def address_range(self, ptr: int) -> tuple[int, int]:
        for a in self.allocs:
            if a.worker_base <= ptr < a.worker_base + len(a.buf):
                return a.worker_base, len(a.buf)
        raise CudaError("cuMemGetAddressRange", INVALID_VALUE, "CUDA_ERROR_NOT_FOUND")

    def _alloc_of(self, ptr: int) -> Allocation:
        base, _ = self.address_range(ptr)
        return next(a for a in self.allocs if a.worker_base == base)

    def legacy_ipc_capable(self, ptr: int) -> bool:
        return self._alloc_of(ptr).ipc_capable

    def pointer_device(self, ptr: int) -> int:
        return self._alloc_of(ptr).device

    def ipc_get_mem_handle(self, base: int) -> bytes:
        a = self._alloc_of(base)
        if not a.ipc_capable or a.worker_base != base:
            raise CudaError("cudaIpcGetMemHandle", INVALID_VALUE, "cudaErrorInvalidValue")
        h = b"MEM!" + base.to_bytes(8, "little") + bytes(52)
        self.handles[h] = a
        self._rec("ipc_get_mem_handle", base)
        return h

    def ipc_get_event_handle(self, event: int) -> bytes:
        h = b"EVT!" + event.to_bytes(8, "little") + bytes(52)
        self.ipc_events[h] = event
        return h

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        self._need_ctx("cudaIpcOpenMemHandle")
        if self.fail_open or handle not in self.handles:
            raise CudaError("cudaIpcOpenMemHandle", MAP_FAILED, "cudaErrorMapBufferObjectFailed")
        if self.open_count.get(handle, 0):  # one open per context per exporting process
            raise CudaError("cudaIpcOpenMemHandle", INVALID_VALUE, "opened twice")
        a = self.handles[handle]
        ptr = self._addr(len(a.buf))
        self.maps[ptr] = a
        self.open_count[handle] = 1
        self._rec("ipc_open_mem_handle", handle, ptr)
        return ptr

    def ipc_close_mem_handle(self, devptr: int) -> None:
        self._need_ctx("cudaIpcCloseMemHandle")
        a = self.maps.pop(devptr, None)
        if a is None:
            raise CudaError("cudaIpcCloseMemHandle", INVALID_VALUE, "not open")
        h = next(h for h, x in self.handles.items() if x is a)
        self.open_count[h] -= 1
        self._rec("ipc_close_mem_handle", devptr)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        self._need_ctx("cudaIpcOpenEventHandle")
        ev = self._id()
        self.events.add(ev)
        self._rec("ipc_open_event_handle", handle, ev)
        return ev

    def stream_create(self) -> int:
        self._need_ctx("cudaStreamCreateWithFlags")
        s = self._id()
        self._rec("stream_create", s)
        return s

    def stream_destroy(self, stream: int) -> None:
        self._rec("stream_destroy", stream)

    def stream_synchronize(self, stream: int) -> None:
        self._rec("stream_synchronize", stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._need_ctx("cudaStreamWaitEvent")
        self._rec("stream_wait_event", stream, event)

    def event_create(self, interprocess: bool = False) -> int:
        self._need_ctx("cudaEventCreateWithFlags")
        ev = self._id()
        self.events.add(ev)
        self._rec("event_create", ev, interprocess)
        return ev

    def event_destroy(self, event: int) -> None:
        if event not in self.events:
            raise CudaError("cudaEventDestroy", INVALID_VALUE, "not an event")
        self.events.discard(event)
        self._rec("event_destroy", event)

    def event_record(self, event: int, stream: int) -> None:
        self._need_ctx("cudaEventRecord")
        with self._lock:
            self.recorded.add(event)
            self.completed.discard(event)
        self._rec("event_record", event, stream)

    def event_query(self, event: int) -> bool:
        with self._lock:
            return self.auto_complete or event in self.completed

    def has_batch_copy(self) -> bool:
        return self.driver >= 12080

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     access_order: int, stream: int) -> None:
        self._need_ctx("cuMemcpyBatchAsync")
        assert self.has_batch_copy()
        self._rec("memcpy_batch", stream, np.array(dsts, np.uint64), np.array(srcs, np.uint64),
                  np.array(sizes, np.uint64), access_order)
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(self._real(d, n), self._real(s, n), n)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._need_ctx("cudaMemcpyAsync")
        self._rec("memcpy_async", stream, dst, src, nbytes)
        ctypes.memmove(self._real(dst, nbytes), self._real(src, nbytes), nbytes)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._need_ctx("cudaHostRegister")
        index = len(self.of("host_register"))
        self._rec("host_register", ptr, nbytes)
        if index in self.fail_register or nbytes >= 512 << 30:
            self.last_error = 2
            raise CudaError("cudaHostRegister", 2, "cudaErrorMemoryAllocation")
        self.registered[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        self._rec("host_unregister", ptr)
        del self.registered[ptr]

    def clear_last_error(self) -> None:
        self._rec("clear_last_error")
        self.last_error = 0
