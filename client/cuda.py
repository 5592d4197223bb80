"""Worker side of the GPU data path: export KV tensors and an event ring to kvd.

The daemon copies GPU memory it opened from legacy CUDA IPC handles. For that the worker
sends, per KV tensor: the device UUID (not the ordinal: ``CUDA_VISIBLE_DEVICES`` renumbers
devices per process), the IPC handle of the allocation that contains the tensor (a torch
tensor sits inside a larger caching-allocator block), the tensor's offset in it, the
block stride and the page size. It also sends a ring of interprocess events: after the
forward pass it records the next free one on its compute stream and names it in the
store's Transfer; the daemon copies once that record completed (it polls the event).
An event is recorded again only after the daemon confirmed its wait passed
(``EventWaited``, or the Transfer's ``Done``): a wait binds to the record that preceded
it.

Memory that legacy IPC cannot export (PyTorch expandable segments, vLLM sleep mode's
cuMemCreate allocations), a GPU the daemon cannot see (MIG) and a separate PID namespace
are refused with the reason and the fix; such clients register with ``client_copy`` and
copy into the pool themselves with ``ClientCopier`` (the vLLM worker falls back to it).

CUDA calls go through ``kvd_client.cudart`` (imported lazily, so ``import kvd_client``
never loads CUDA; tests inject a fake), the one seam shared with the daemon; torch is
imported by nobody here: tensors are read through ``data_ptr()`` and friends.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvd_client.errors import KvdClientError
from kvd_proto.messages import CudaRegion, Direction, Registered

if TYPE_CHECKING:
    from kvd_client.cudart import CudaApi

DEFAULT_RING = 64
RING_CLOSE_SECONDS = 5.0  # how long close() waits for the daemon to confirm its waits
REGISTER_CHUNK = 64 << 30  # cudaHostRegister fails for one call of 512 GiB or more


def _default_api() -> CudaApi:
    from kvd_client.cudart import load  # noqa: PLC0415 - no CUDA import at module import

    return load()


class CudaExportRefused(KvdClientError):
    """This memory cannot be shared with the daemon; ``reason`` and ``fix`` say why/what."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}. Fix: {fix}")
        self.reason = reason
        self.fix = fix


CLIENT_COPY_FIX = ("register with client_copy=True (kvd_client.cuda.ClientCopier copies "
                   "into the pool from this process)")


@dataclass(frozen=True)
class GpuTensor:
    """One KV tensor in device memory: block b's page is at ptr + b * stride."""

    ptr: int
    num_blocks: int
    stride: int
    page_bytes: int


def gpu_tensors(t: Any, block_dim: int = 0) -> list[GpuTensor]:
    """Describe a torch CUDA tensor whose dimension ``block_dim`` is the block.

    Dimensions before ``block_dim`` (vLLM's FlashAttention layout ``(2, num_blocks, ...)``
    for K and V) give one GpuTensor each. Each block's page must be contiguous.
    """
    if getattr(t, "device", None) is None or t.device.type != "cuda":
        raise ValueError("a CUDA tensor is needed (host tensors use kvd_client.host_regions)")
    if block_dim > 0:
        return [g for i in range(t.shape[0]) for g in gpu_tensors(t[i], block_dim - 1)]
    item = t.element_size()
    if t.shape[0] == 0 or not t[0].is_contiguous():
        raise ValueError("each block's bytes must be contiguous and the tensor not empty")
    return [GpuTensor(t.data_ptr(), t.shape[0], t.stride(0) * item, t[0].numel() * item)]


def allocator_refusal(sleep_mode: bool = False) -> str | None:
    """Why this process's allocator cannot export KV memory with legacy IPC, or None."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF",
                                                      "PYTORCH_ALLOC_CONF"))
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return ("PyTorch expandable segments are on (PYTORCH_CUDA_ALLOC_CONF): their "
                "cuMemCreate memory has no legacy CUDA IPC handle")
    if sleep_mode:
        return ("vLLM sleep mode allocates the KV cache with cuMemCreate, which legacy "
                "CUDA IPC cannot export")
    return None


def export_regions(tensors: Sequence[GpuTensor], api: CudaApi | None = None, *,
                   sleep_mode: bool = False) -> list[CudaRegion]:
    """CudaRegions for Register; raises CudaExportRefused when the daemon cannot copy."""
    why = allocator_refusal(sleep_mode)
    if why:
        raise CudaExportRefused(why, "unset expandable_segments / sleep mode, or "
                                + CLIENT_COPY_FIX)
    api = api or _default_api()
    handles: dict[int, bytes] = {}  # allocation base -> handle (one per allocation)
    out: list[CudaRegion] = []
    uuid = b""
    for t in tensors:
        if not api.legacy_ipc_capable(t.ptr):
            raise CudaExportRefused(
                f"the KV tensor at {t.ptr:#x} is not legacy-IPC capable (expandable "
                "segments, vLLM sleep mode or another cuMemCreate allocator)",
                "allocate the KV cache with cudaMalloc (PYTORCH_CUDA_ALLOC_CONF without "
                "expandable_segments, no sleep mode), or " + CLIENT_COPY_FIX)
        base, size = api.address_range(t.ptr)
        end = t.ptr + (t.num_blocks - 1) * t.stride + t.page_bytes
        if end > base + size or t.page_bytes > t.stride:
            raise ValueError(f"tensor at {t.ptr:#x} overruns its allocation or its stride")
        dev_uuid = api.device_uuid(api.pointer_device(t.ptr))
        if uuid and dev_uuid != uuid:
            raise ValueError("all KV tensors of one worker must be on one GPU")
        uuid = dev_uuid
        if base not in handles:
            handles[base] = api.ipc_get_mem_handle(base)
        out.append(CudaRegion(uuid, handles[base], t.ptr - base, t.num_blocks, t.stride,
                              t.page_bytes))
    return out


class EventRing:
    """Interprocess events the worker records after forward passes, reused safely.

    Rule: ``record_next`` hands out an event only when the daemon confirmed the previous
    wait on it passed (``waited``). When all are in use it returns None: the caller
    synchronises its stream and sends ``cuda_event=-1``, or skips the store.
    """

    def __init__(self, size: int = DEFAULT_RING, api: CudaApi | None = None) -> None:
        if size < 1:
            raise ValueError("an event ring needs at least one event")
        self.api = api or _default_api()
        self._events = [self.api.event_create(interprocess=True) for _ in range(size)]
        self.handles = [self.api.ipc_get_event_handle(e) for e in self._events]
        self._free = list(range(size - 1, -1, -1))
        self._busy: dict[int, int] = {}  # index -> the owner (transfer) it was recorded for
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.exhausted = 0  # record_next calls that found no free event

    def __len__(self) -> int:
        return len(self._events)

    def record_next(self, stream: int, owner: int = -1) -> int | None:
        """Record a free event on ``stream`` (the compute stream) for ``owner`` (the
        transfer that sends it); its index, or None."""
        with self._lock:
            if not self._free:
                self.exhausted += 1
                return None
            i = self._free.pop()
            self._busy[i] = owner
        try:
            self.api.event_record(self._events[i], stream)
        except Exception:
            self.waited(i, owner)
            raise
        return i

    def waited(self, index: int, owner: int = -1) -> None:
        """The daemon's wait on ``index`` for ``owner`` passed (EventWaited, or the
        transfer's Done). Both arrive: the second must not free the index once another
        transfer recorded it again (the daemon still waits on it for that one; a third
        one recording it over, on another stream, would let that wait pass early)."""
        with self._lock:
            if index in self._busy and self._busy[index] == owner:
                del self._busy[index]
                self._free.append(index)
                self._cv.notify_all()

    def in_use(self) -> int:
        with self._lock:
            return len(self._busy)

    def close(self, timeout: float = RING_CLOSE_SECONDS) -> int:
        """Destroy the events once the daemon confirmed every wait on them (EventWaited or
        Done), or ``timeout`` passed: a wait the daemon has yet to pass must not find its
        event destroyed. Returns how many were still unconfirmed."""
        with self._cv:
            self._cv.wait_for(lambda: not self._busy, timeout)
            left = len(self._busy)
            events, self._events = self._events, []
        for e in events:
            self.api.event_destroy(e)
        return left


class ClientCopier:
    """Client-side copies for memory the daemon cannot open: the daemon keeps the index
    and policy, this process maps the pool file and copies with its own stream.

    Order: ``start`` enqueues the copies on ``stream`` (the caller orders that stream
    after the forward pass for stores) and records a completion event; when ``done``
    says so, send the Transfer (it reports the finished copy; the daemon copies nothing).
    Slot layout is the daemon's: slot offset (from ``Registered``) + rank x rank_bytes +
    the tensor's page offset (cumulative page sizes, in registration order).

    The mapping is registered with ``cudaHostRegister`` (in chunks) before any copy: a
    copy with pageable memory is synchronous and cannot overlap compute. ``stream`` must
    be a created stream: the batched copy refuses the legacy default stream (0).
    """

    def __init__(self, reg: Registered, rank: int, tensors: Sequence[GpuTensor], stream: int,
                 api: CudaApi | None = None) -> None:
        if not reg.pool_path or reg.slots_per_extent < 1:
            raise KvdClientError("the daemon did not send its pool layout (too old?)")
        if stream == 0:
            raise KvdClientError("ClientCopier needs a created stream, not the legacy default "
                                 "stream (cuMemcpyBatchAsync refuses it)")
        self.api = api or _default_api()
        self.reg, self.rank, self.stream = reg, rank, stream
        try:
            fd = os.open(reg.pool_path, os.O_RDWR)
        except OSError as e:
            raise KvdClientError(f"cannot open the pool file {reg.pool_path}: {e.strerror}"
                                 ) from None
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._mm, np.uint8)
        self.pool_base = self._view.ctypes.data
        self._free_events: list[int] = []
        self._registered: list[int] = []
        try:
            for off in range(0, len(self._view), REGISTER_CHUNK):
                self.api.host_register(self.pool_base + off,
                                       min(REGISTER_CHUNK, len(self._view) - off))
                self._registered.append(self.pool_base + off)
        except Exception as e:
            self.api.clear_last_error()
            self.close()
            raise KvdClientError(f"cannot pin the pool mapping for client-side copies: {e} "
                                 "(raise RLIMIT_MEMLOCK)") from e
        pages = np.array([t.page_bytes for t in tensors], np.uint64)
        self._pages = pages
        self._page_off = np.concatenate(([0], np.cumsum(pages)[:-1])).astype(np.uint64)
        self._bases = np.array([t.ptr for t in tensors], np.uint64)
        self._strides = np.array([t.stride for t in tensors], np.uint64)

    def addresses(self, block_ids: np.ndarray, slots: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pool, device, lengths) per (block, tensor), as the daemon would build them."""
        s = np.asarray(slots, np.uint64)
        r = self.reg
        spe = np.uint64(r.slots_per_extent)
        slot_off = (s // spe) * np.uint64(r.extent_bytes) + (s % spe) * np.uint64(r.slot_bytes)
        pool = (np.uint64(self.pool_base + self.rank * r.rank_bytes) + slot_off[:, None]
                + self._page_off[None, :])
        dev = self._bases[None, :] + np.asarray(block_ids, np.uint64)[:, None] \
            * self._strides[None, :]
        lengths = np.broadcast_to(self._pages, dev.shape)
        return pool.ravel(), dev.ravel(), lengths.ravel().copy()

    def start(self, direction: Direction, block_ids: np.ndarray, slots: np.ndarray) -> int:
        """Enqueue the copies; returns a completion token for ``done``."""
        pool, dev, lengths = self.addresses(block_ids, slots)
        dsts, srcs = (pool, dev) if direction == Direction.STORE else (dev, pool)
        from kvd_client.runs import coalesce  # noqa: PLC0415 - see the module docstring
        from kvd_client.cudart import ACCESS_ORDER_STREAM, copy_runs  # noqa: PLC0415

        try:
            copy_runs(self.api, *coalesce(dsts, srcs, lengths), ACCESS_ORDER_STREAM,
                      self.stream)
            ev = self._free_events.pop() if self._free_events \
                else self.api.event_create(blocking=True)
            try:
                self.api.event_record(ev, self.stream)
            except Exception:
                self._free_events.append(ev)
                raise
        except Exception:
            # The runs enqueued before the failure would land after it was reported
            # (a load failed: vLLM recomputes into those blocks meanwhile).
            try:
                self.api.stream_synchronize(self.stream)
            except Exception:  # noqa: BLE001, S110 - a sticky error: nothing runs on
                pass
            raise
        return ev

    def done(self, token: int) -> bool:
        """True once the copies of ``token`` completed (the token is then spent)."""
        if not self.api.event_query(token):
            return False
        self._free_events.append(token)
        return True

    def wait(self, token: int) -> None:
        """Block until the copies of ``token`` completed (the token is then spent)."""
        self.api.event_synchronize(token)
        self._free_events.append(token)

    def close(self) -> None:
        """Wait for copies in flight (they use the mapping), then unpin and unmap."""
        if self._registered:
            self.api.stream_synchronize(self.stream)
        for e in self._free_events:
            self.api.event_destroy(e)
        self._free_events = []
        for ptr in self._registered:
            try:
                self.api.host_unregister(ptr)
            except Exception:  # noqa: BLE001 - closing: the mapping goes away anyway
                self.api.clear_last_error()
        self._registered = []
        self._view = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
