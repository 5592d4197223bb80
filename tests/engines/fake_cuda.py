"""A fake CUDA driver that behaves like one (implements ``kvd_client.cudart.CudaApi``).

It stands in for both processes of a test: the worker's allocations ("device memory" is
a numpy buffer of this process, seen at a fake device address) and the daemon's opened
IPC mappings (another fake address range over the same buffer). What makes it strict:

- work is asynchronous: every stream has a worker thread that runs its operations later,
  in stream order; a copy runs only after the events it waits on were recorded *and*
  completed, and an event completes when its stream reaches the record;
- ``launch(stream)`` enqueues a "kernel" (the forward pass) that runs until the test
  releases it, so a test decides when a worker's event completes;
- a context is per device and per thread: a call on a thread whose current context is
  not the object's device fails with ``cudaErrorInvalidContext`` (201);
- a copy outside a mapping poisons the device like a sticky ``cudaErrorIllegalAddress``:
  every later call on that device fails;
- a copy between device memory and host memory that is not registered
  (``host_register``) is synchronous for the calling thread, as pageable copies are;
- the legacy default stream (0) is refused by the batched copy;
- the exporter destroying an event that a queued wait still references is recorded in
  ``violations``; a copy through an IPC mapping already closed poisons the device.

Every call is appended to ``calls`` as ``(name, thread name, *args)``. ``shutdown()``
releases held kernels and stuck waits and joins every stream thread.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd_client.cudart import CudaError

INVALID_VALUE = 1
INVALID_CONTEXT = 201
INVALID_HANDLE = 400
ILLEGAL_ADDRESS = 700
MAP_FAILED = 205
DEVICE_LO, DEVICE_HI = 0x7A00_0000_0000, 0x7B00_0000_0000


@dataclass
class Allocation:
    buf: np.ndarray  # backing bytes
    worker_base: int  # address in the (fake) worker process
    device: int
    ipc_capable: bool


@dataclass(eq=False)
class _Event:
    device: int
    recorded: int = 0  # sequence number of the latest record call
    completed: int = 0  # the latest record its stream reached
    waiters: int = 0  # queued waits that reference it
    destroyed: bool = False


@dataclass(eq=False)
class _Stream:
    ident: int
    device: int
    ops: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    enqueued: int = 0
    retired: int = 0
    thread: threading.Thread | None = None


class FakeCuda:
    def __init__(self, uuids: tuple[bytes, ...] = (bytes(range(16)),), *,
                 driver: int = 12090, runtime: int = 12090) -> None:
        self.uuids = list(uuids)
        self.driver, self.runtime = driver, runtime
        self.calls: list[tuple] = []
        self.violations: list[str] = []
        self.allocs: list[Allocation] = []
        self.maps: dict[int, Allocation] = {}  # daemon-side devptr -> allocation
        self.handles: dict[bytes, Allocation] = {}
        self.open_count: dict[bytes, int] = {}
        self.registered: dict[int, int] = {}  # host ptr -> bytes (cudaHostRegister)
        self.poisoned: set[int] = set()  # devices with a sticky error
        self.fail_register: set[int] = set()  # chunk index (by call order) that fails
        self.fail_open = False
        self.last_error = 0
        self._events: dict[int, _Event] = {}  # handle (worker's or imported) -> event
        self._owner: dict[int, bool] = {}  # handle -> created here (not imported)
        self._ipc_events: dict[bytes, _Event] = {}
        self._streams: dict[int, _Stream] = {}
        self._threads: list[threading.Thread] = []
        self._gates: list[threading.Event] = []
        self._stopping = False
        self._next = 0x1000
        self._next_addr = DEVICE_LO
        self._cv = threading.Condition()
        self._tls = threading.local()

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
        return [c[0] for c in list(self.calls) if not only or c[0] in only]

    def of(self, name: str) -> list[tuple]:
        return [c for c in list(self.calls) if c[0] == name]

    def launch(self, stream: int) -> threading.Event:
        """Enqueue a kernel on ``stream`` that runs until the returned event is set."""
        gate = threading.Event()
        self._gates.append(gate)
        self._enqueue("launch", self._stream(stream), gate.wait)
        return gate

    def poison(self, device: int) -> None:
        """A sticky error on ``device`` (as an illegal address raises): every later call
        there fails, and waits blocked on it return failing."""
        with self._cv:
            self.poisoned.add(device)
            self._cv.notify_all()

    def idle(self, timeout: float = 5.0) -> bool:
        """Wait until every stream ran all it was given (True) or ``timeout`` passed."""
        with self._cv:
            return self._cv.wait_for(lambda: all(s.retired == s.enqueued
                                                 for s in self._streams.values()), timeout)

    def wait_for(self, cond: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until ``cond()`` (evaluated whenever the fake's state changes)."""
        with self._cv:
            return self._cv.wait_for(cond, timeout)

    def shutdown(self) -> None:
        """Release held kernels and stuck waits, stop and join every stream thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for g in self._gates:
            g.set()
        for s in list(self._streams.values()):
            s.ops.put(None)
        for t in self._threads:
            t.join(10)
            assert not t.is_alive(), f"{t.name} did not stop"

    # ------------------------------------------------------------ internals
    def _addr(self, nbytes: int) -> int:
        with self._cv:
            a = self._next_addr
            self._next_addr += (nbytes + 0xFFFFF) & ~0xFFFFF
            return a

    def _id(self) -> int:
        with self._cv:
            self._next += 1
            return self._next

    def _rec(self, name: str, *args: object) -> None:
        with self._cv:
            self.calls.append((name, threading.current_thread().name, *args))
            self._cv.notify_all()

    def _ctx(self, call: str, device: int | None = None) -> int:
        """The calling thread's device; fails without the right current context or on
        a poisoned device (sticky error)."""
        ctx = getattr(self._tls, "ctx", None)
        if ctx is None or (device is not None and ctx != 0xC0 + device):
            raise CudaError(call, INVALID_CONTEXT, "cudaErrorInvalidContext")
        dev = ctx - 0xC0
        if dev in self.poisoned:
            raise CudaError(call, ILLEGAL_ADDRESS, "cudaErrorIllegalAddress (sticky)")
        return dev

    def _stream(self, ident: int, call: str = "launch") -> _Stream:
        s = self._streams.get(ident)
        if s is None:
            raise CudaError(call, INVALID_HANDLE, f"no stream {ident}")
        return s

    def _event(self, handle: int, call: str) -> _Event:
        ev = self._events.get(handle)
        if ev is None:
            raise CudaError(call, INVALID_HANDLE, "cudaErrorInvalidResourceHandle")
        return ev

    def _enqueue(self, name: str, s: _Stream, op: Callable[[], None]) -> threading.Event:
        retired = threading.Event()
        with self._cv:
            s.enqueued += 1
        s.ops.put((name, op, retired))
        return retired

    def _run_stream(self, s: _Stream) -> None:
        while True:
            item = s.ops.get()
            if item is None:
                return
            _name, op, retired = item
            if s.device not in self.poisoned:
                op()
            retired.set()
            with self._cv:
                s.retired += 1
                self._cv.notify_all()

    def _real(self, addr: int, n: int, device: int) -> int | None:
        """A daemon or worker device address -> its bytes; host addresses pass through;
        None when the range is outside every mapping (the caller poisons the device)."""
        if not DEVICE_LO <= addr < DEVICE_HI:
            return addr
        views = [*self.maps.items(), *((a.worker_base, a) for a in self.allocs)]
        for base, a in views:
            if base <= addr < base + len(a.buf):
                return a.buf.ctypes.data + (addr - base) if addr + n <= base + len(a.buf) \
                    else None
        return None

    def _pinned(self, addr: int, n: int) -> bool:
        return DEVICE_LO <= addr < DEVICE_HI or any(
            p <= addr and addr + n <= p + k for p, k in self.registered.items())

    def _copy(self, call: str, s: _Stream, runs: list[tuple[int, int, int]]) -> None:
        def op() -> None:
            for d, src, n in runs:
                rd, rs = self._real(d, n, s.device), self._real(src, n, s.device)
                if rd is None or rs is None:
                    self.poisoned.add(s.device)
                    return
                ctypes.memmove(rd, rs, n)

        retired = self._enqueue(call, s, op)
        if not all(self._pinned(d, n) and self._pinned(src, n) for d, src, n in runs):
            retired.wait()  # pageable memory: the call returns when the copy is done

    # ------------------------------------------------------------ devices and contexts
    def init(self) -> None:
        self._rec("init")

    def driver_version(self) -> int:
        return self.driver

    def runtime_version(self) -> int:
        return self.runtime

    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, ordinal: int) -> bytes:
        return self.uuids[ordinal]

    def retain_primary_context(self, ordinal: int) -> int:
        self._rec("retain_primary_context", ordinal)
        return 0xC0 + ordinal

    def release_primary_context(self, ordinal: int) -> None:
        self._rec("release_primary_context", ordinal)

    def set_current_context(self, ctx: int | None) -> None:
        self._tls.ctx = ctx

    # ------------------------------------------------------------ export / import
    def address_range(self, ptr: int) -> tuple[int, int]:
        self._ctx("cuMemGetAddressRange")
        for base, a in [*((a.worker_base, a) for a in self.allocs), *self.maps.items()]:
            if base <= ptr < base + len(a.buf):
                return base, len(a.buf)
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
        ev = self._event(event, "cudaIpcGetEventHandle")
        h = b"EVT!" + event.to_bytes(8, "little") + bytes(52)
        self._ipc_events[h] = ev
        return h

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        self._ctx("cudaIpcOpenMemHandle")
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
        self._ctx("cudaIpcCloseMemHandle")
        a = self.maps.pop(devptr, None)
        if a is None:
            raise CudaError("cudaIpcCloseMemHandle", INVALID_VALUE, "not open")
        h = next(h for h, x in self.handles.items() if x is a)
        self.open_count[h] -= 1
        self._rec("ipc_close_mem_handle", devptr)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        self._ctx("cudaIpcOpenEventHandle")
        ev = self._ipc_events.get(handle)
        if ev is None or ev.destroyed:
            raise CudaError("cudaIpcOpenEventHandle", INVALID_VALUE, "no such event")
        h = self._id()
        self._events[h], self._owner[h] = ev, False
        self._rec("ipc_open_event_handle", handle, h)
        return h

    # ------------------------------------------------------------ streams and events
    def stream_create(self) -> int:
        dev = self._ctx("cudaStreamCreateWithFlags")
        s = _Stream(self._id(), dev)
        s.thread = threading.Thread(target=self._run_stream, args=(s,), daemon=True,
                                    name=f"fake-stream-{s.ident}")
        self._streams[s.ident] = s
        self._threads.append(s.thread)
        s.thread.start()
        self._rec("stream_create", s.ident)
        return s.ident

    def stream_destroy(self, stream: int) -> None:
        s = self._stream(stream, "cudaStreamDestroy")
        self._ctx("cudaStreamDestroy", s.device)
        self._rec("stream_destroy", stream)
        del self._streams[stream]
        s.ops.put(None)  # queued work still runs; the thread ends after it

    def stream_synchronize(self, stream: int) -> None:
        s = self._stream(stream, "cudaStreamSynchronize")
        self._ctx("cudaStreamSynchronize", s.device)
        self._rec("stream_synchronize", stream)
        with self._cv:
            target = s.enqueued
            self._cv.wait_for(lambda: s.retired >= target or self._stopping
                              or s.device in self.poisoned)
        self._ctx("cudaStreamSynchronize", s.device)

    def stream_wait_event(self, stream: int, event: int) -> None:
        s = self._stream(stream, "cudaStreamWaitEvent")
        self._ctx("cudaStreamWaitEvent", s.device)
        ev = self._event(event, "cudaStreamWaitEvent")
        self._rec("stream_wait_event", stream, event)
        with self._cv:
            if ev.destroyed:
                self.violations.append(f"wait on event {event}, destroyed by its exporter")
            target = ev.recorded  # binds to the latest record at the time of the call
            ev.waiters += 1

        def op() -> None:
            with self._cv:
                self._cv.wait_for(lambda: ev.completed >= target or self._stopping)
                ev.waiters -= 1
                self._cv.notify_all()

        self._enqueue("wait", s, op)

    def event_create(self, interprocess: bool = False, blocking: bool = False) -> int:
        dev = self._ctx("cudaEventCreateWithFlags")
        h = self._id()
        self._events[h], self._owner[h] = _Event(dev), True
        self._rec("event_create", h, interprocess)
        return h

    def event_destroy(self, event: int) -> None:
        ev = self._event(event, "cudaEventDestroy")
        self._ctx("cudaEventDestroy", ev.device)
        with self._cv:
            if self._owner[event] and ev.waiters:
                self.violations.append(f"event {event} destroyed by its exporter while "
                                       f"{ev.waiters} queued wait(s) reference it")
            if self._owner[event]:
                ev.destroyed = True
            del self._events[event]
        self._rec("event_destroy", event)

    def event_record(self, event: int, stream: int) -> None:
        ev = self._event(event, "cudaEventRecord")
        s = self._stream(stream, "cudaEventRecord")
        self._ctx("cudaEventRecord", s.device)
        with self._cv:
            ev.recorded += 1
            seq = ev.recorded

        def op() -> None:
            with self._cv:
                ev.completed = max(ev.completed, seq)
                self._cv.notify_all()

        self._rec("event_record", event, stream)
        self._enqueue("record", s, op)

    def event_query(self, event: int) -> bool:
        ev = self._event(event, "cudaEventQuery")
        self._ctx("cudaEventQuery", ev.device)
        self._rec("event_query", event)
        with self._cv:
            return ev.completed >= ev.recorded

    def event_synchronize(self, event: int) -> None:
        ev = self._event(event, "cudaEventSynchronize")
        self._ctx("cudaEventSynchronize", ev.device)
        self._rec("event_synchronize", event)
        with self._cv:
            target = ev.recorded
            self._cv.wait_for(lambda: ev.completed >= target or self._stopping
                              or ev.device in self.poisoned)
        self._ctx("cudaEventSynchronize", ev.device)  # a sticky error surfaces here

    # ------------------------------------------------------------ copies
    def has_batch_copy(self) -> bool:
        return self.driver >= 12080

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                     access_order: int, stream: int) -> None:
        if stream == 0:
            raise CudaError("cuMemcpyBatchAsync", INVALID_VALUE,
                            "CUDA_ERROR_INVALID_VALUE (legacy default stream)")
        s = self._stream(stream, "cuMemcpyBatchAsync")
        self._ctx("cuMemcpyBatchAsync", s.device)
        assert self.has_batch_copy()
        self._rec("memcpy_batch", stream, np.array(dsts, np.uint64), np.array(srcs, np.uint64),
                  np.array(sizes, np.uint64), access_order)
        self._copy("memcpy_batch", s, list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist())))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        s = self._stream(stream, "cudaMemcpyAsync")
        self._ctx("cudaMemcpyAsync", s.device)
        self._rec("memcpy_async", stream, dst, src, nbytes)
        self._copy("memcpy_async", s, [(dst, src, nbytes)])

    # ------------------------------------------------------------ pinning
    def host_register(self, ptr: int, nbytes: int) -> None:
        self._ctx("cudaHostRegister")
        index = len(self.of("host_register"))
        self._rec("host_register", ptr, nbytes)
        if index in self.fail_register or nbytes >= 512 << 30:
            self.last_error = 2
            raise CudaError("cudaHostRegister", 2, "cudaErrorMemoryAllocation")
        self.registered[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        self._ctx("cudaHostUnregister")
        self._rec("host_unregister", ptr)
        del self.registered[ptr]

    def clear_last_error(self) -> None:
        self._rec("clear_last_error")
        self.last_error = 0
