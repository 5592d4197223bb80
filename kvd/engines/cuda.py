"""GPU data path: the daemon copies between a worker's GPU memory and the pinned pool.

A worker exports each KV tensor with a legacy CUDA IPC handle and a ring of
interprocess events (``kvd_client.cuda``). Per GPU, found by UUID because ordinals
differ between processes, the engine runs one submit thread and two non-blocking
streams (store, load) in the device's primary context, plus a completion thread:

    submit thread:  [store] cudaStreamWaitEvent(store, ring[i]) -> on_waited(job)
                    copy (cuMemcpyBatchAsync, or cudaMemcpyAsync per coalesced run)
                    cudaEventRecord(done_ev, stream)
    completion:     cudaEventQuery(done_ev) -> on_done(job)      (exactly once per job)

``on_waited`` lets the daemon tell the worker that event ``i`` may be recorded again:
the wait binds to the record that preceded it. Each IPC memory handle is opened once
per (client pid, handle) and closed exactly once, after the last in-flight copy of the
last client using it completed. All CUDA calls go through ``kvd_proto.cudart`` (a
seam tests replace with a recording fake).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.engines.base import CopyJob, DoneCallback, TransferEngine
from kvd_proto.ids import coalesce
from kvd_proto.cudart import (ACCESS_ORDER_ANY, ACCESS_ORDER_STREAM, IPC_HANDLE_BYTES,
                                CudaApi, copy_runs)
from kvd.errors import RequestError, TransferError
from kvd_proto.messages import Code, Direction, Register

log = logging.getLogger("kvd.engines.cuda")
MAX_EVENTS = 4096  # event-ring entries one client may register
POLL_SECONDS = 100e-6  # completion polling interval while copies are in flight
STOP_SECONDS = 30.0  # how long close() waits for copies in flight

WaitedCallback = Callable[[CopyJob], None]


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi -L prints it."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def refuse_foreign_pid_namespace(hello_pid: int, peer_pid: int) -> None:
    """Raise when the client lives in another PID namespace than the daemon.

    ``hello_pid`` is the pid the client reports for itself, ``peer_pid`` the one the
    kernel reports for the socket peer (ZeroMQ ``Peer-Address``); they differ exactly
    when the namespaces differ, and then legacy CUDA IPC fails ("invalid device context").
    """
    if hello_pid != peer_pid:
        raise RequestError(
            f"the client (pid {hello_pid} in its namespace, {peer_pid} in the daemon's) runs "
            "in a separate PID namespace, where CUDA IPC handles cannot be opened. Fix: share "
            "the host PID namespace (Kubernetes hostPID: true, docker --pid=host), or "
            "register with client_copy=True so the client copies into the pool itself",
            Code.PERMISSION,
        )


@dataclass(eq=False)
class _Client:
    pid: int
    device: _Device
    mem_keys: list[tuple[int, bytes]]
    events: list[int]
    event_keys: list[tuple[int, bytes]]
    inflight: int = 0
    gone: bool = False


@dataclass(eq=False)
class _Opened:
    """One opened IPC handle (memory or event), shared by clients of the same pid."""

    value: int  # device pointer or event
    device: _Device
    refs: int = 1


@dataclass(eq=False)
class _Device:
    ordinal: int
    uuid: bytes
    ctx: int
    store_stream: int = 0
    load_stream: int = 0
    work: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pending: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    free_events: list[int] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)


class _Release:
    """Work item: the client's copies drained, close what attach opened."""

    def __init__(self, client: _Client) -> None:
        self.client = client


_STOP = object()


class CudaEngine(TransferEngine):
    """Copies with CUDA; one submit thread, one completion thread, two streams per GPU."""

    name = "cuda"

    def __init__(self, on_done: DoneCallback, api: CudaApi, *,
                 on_waited: WaitedCallback | None = None) -> None:
        super().__init__(on_done)
        self.api = api
        self.on_waited = on_waited
        self._lock = threading.Lock()
        self._closed = False
        self._uuids: dict[bytes, int] | None = None
        self._devices: dict[bytes, _Device] = {}
        self._clients: dict[int, _Client] = {}
        self._mem: dict[tuple[int, bytes], _Opened] = {}
        self._events: dict[tuple[int, bytes], _Opened] = {}
        self._gone: set[_Client] = set()  # detached, handles not closed yet

    # ------------------------------------------------------------ devices
    def _device_for(self, uuid: bytes) -> _Device:
        dev = self._devices.get(uuid)
        if dev is not None:
            return dev
        if self._uuids is None:
            self.api.init()
            self._uuids = {self.api.device_uuid(i): i for i in range(self.api.device_count())}
        ordinal = self._uuids.get(uuid)
        if ordinal is None:
            seen = ", ".join(format_uuid(u) for u in self._uuids) or "none"
            raise RequestError(
                f"the client's GPU {format_uuid(uuid)} is not visible to the daemon (it sees: "
                f"{seen}). Either the daemon's CUDA_VISIBLE_DEVICES hides it, or the client "
                "runs on a MIG instance: CUDA IPC does not cross MIG instances. Fix: make the "
                "GPU visible to the daemon, run one daemon per MIG instance "
                "(CUDA_VISIBLE_DEVICES=MIG-<uuid>), or register with client_copy=True",
                Code.BAD_REQUEST,
            )
        ctx = self.api.retain_primary_context(ordinal)
        self.api.set_current_context(ctx)
        dev = _Device(ordinal, uuid, ctx)
        dev.store_stream = self.api.stream_create()
        dev.load_stream = self.api.stream_create()
        if not self.api.has_batch_copy():
            log.warning("GPU %s: driver older than 12.8, copying with one cudaMemcpyAsync "
                        "per coalesced run", format_uuid(uuid))
        tag = format_uuid(uuid)[:12]
        dev.threads = [threading.Thread(target=self._run, args=(dev,), daemon=True,
                                        name=f"kvd-cuda-{tag}"),
                       threading.Thread(target=self._complete, args=(dev,), daemon=True,
                                        name=f"kvd-cuda-done-{tag}")]
        for t in dev.threads:
            t.start()
        self._devices[uuid] = dev
        return dev

    # ------------------------------------------------------------ clients
    def attach(self, client: int, pid: int, reg: Register) -> list[int]:
        """Open the client's IPC handles; returns each region's device address."""
        regions = reg.cuda_regions
        if not regions:
            raise RequestError("a CUDA registration needs at least one cuda region")
        uuids = {r.device_uuid for r in regions}
        if len(uuids) != 1:
            raise RequestError("one client registers memory of one GPU only")
        if len(reg.cuda_event_handles) > MAX_EVENTS:
            raise RequestError(f"at most {MAX_EVENTS} CUDA events per client")
        for r in regions:
            if len(r.ipc_handle) != IPC_HANDLE_BYTES or r.num_blocks < 1 or r.offset < 0 \
                    or r.stride < r.page_bytes or r.page_bytes < 1:
                raise RequestError("malformed cuda region (handle size, blocks or stride)")
        if any(len(h) != IPC_HANDLE_BYTES for h in reg.cuda_event_handles):
            raise RequestError(f"a CUDA event handle has {IPC_HANDLE_BYTES} bytes")
        with self._lock:
            if self._closed:
                raise TransferError("daemon is stopping", Code.ABORTED)
            if client in self._clients:
                raise RequestError(f"client {client} is attached already")
            try:
                dev = self._device_for(uuids.pop())
            except RequestError:
                raise
            except Exception as e:
                raise TransferError(f"cannot use the client's GPU: {e}") from e
            self.api.set_current_context(dev.ctx)  # this thread opens the handles
            c = _Client(pid, dev, [], [], [])
            try:
                for h in dict.fromkeys(r.ipc_handle for r in regions):
                    c.mem_keys.append(self._open(self._mem, (pid, h), dev,
                                                 self.api.ipc_open_mem_handle, h))
                for h in reg.cuda_event_handles:
                    key = (pid, h)
                    self._open(self._events, key, dev, self.api.ipc_open_event_handle, h)
                    c.event_keys.append(key)
                    c.events.append(self._events[key].value)
            except Exception as e:
                self._release(c)
                raise TransferError(
                    f"cannot open the CUDA IPC handles of pid {pid}: {e}. Legacy CUDA IPC "
                    "needs the daemon and the engine in one PID namespace on one node, and "
                    "memory from cudaMalloc (not expandable segments or cuMemCreate)",
                    Code.PERMISSION) from e
            self._clients[client] = c
            base = {h: self._mem[(pid, h)].value for (_, h) in c.mem_keys}
        return [base[r.ipc_handle] + r.offset for r in regions]

    def _open(self, table: dict[tuple[int, bytes], _Opened], key: tuple[int, bytes],
              dev: _Device, opener: Callable[[bytes], int], handle: bytes) -> tuple[int, bytes]:
        got = table.get(key)
        if got is not None:
            got.refs += 1
        else:
            table[key] = _Opened(opener(handle), dev)
        return key

    def detach(self, client: int) -> None:
        """Forget the client; its handles close once its in-flight copies completed."""
        with self._lock:
            c = self._clients.pop(client, None)
            if c is None:
                return
            c.gone = True
            self._gone.add(c)
            drained = c.inflight == 0
        if drained:
            c.device.work.put(_Release(c))

    def _release(self, c: _Client) -> None:
        """Drop the client's references; close handles nobody else uses (lock held).

        Idempotent: the references are dropped once, so a handle is closed exactly once.
        """
        self._gone.discard(c)
        for table, keys, closer in ((self._mem, c.mem_keys, self.api.ipc_close_mem_handle),
                                    (self._events, c.event_keys, self.api.event_destroy)):
            for key in keys:
                got = table[key]
                got.refs -= 1
                if got.refs == 0:
                    del table[key]
                    try:
                        closer(got.value)
                    except Exception as e:  # noqa: BLE001 - nothing else to do: log
                        log.warning("closing a CUDA IPC handle of pid %d: %s", c.pid, e)
            keys.clear()

    # ------------------------------------------------------------ jobs
    def submit(self, job: CopyJob) -> None:
        with self._lock:
            c = self._clients.get(job.client)
            if self._closed or c is None:
                err = TransferError("daemon is stopping", Code.ABORTED) if self._closed \
                    else TransferError(f"client {job.client} is not attached", Code.CLIENT_GONE)
            elif job.direction == Direction.STORE and job.cuda_event >= len(c.events):
                err = RequestError(f"CUDA event {job.cuda_event} is not in the client's ring "
                                   f"of {len(c.events)}", Code.BAD_REQUEST)
            else:
                c.inflight += 1
                c.device.work.put((job, c))
                return
        self.on_done(job, err, 0.0)

    def _run(self, dev: _Device) -> None:
        """Submit thread: wait on the worker's event, enqueue the copy, record completion."""
        self.api.set_current_context(dev.ctx)
        while True:
            item = dev.work.get()
            if item is _STOP:
                break
            if isinstance(item, _Release):
                with self._lock:
                    self._release(item.client)
                continue
            job, c = item
            started = time.perf_counter()
            try:
                done_ev = self._enqueue(dev, job, c)
            except Exception as e:  # noqa: BLE001 - reported to the client as Done
                self._finish(job, c, e, started)
                continue
            dev.pending.put((job, c, done_ev, started))
        self._shutdown(dev)

    def _enqueue(self, dev: _Device, job: CopyJob, c: _Client) -> int:
        store = job.direction == Direction.STORE
        stream = dev.store_stream if store else dev.load_stream
        if store and job.cuda_event >= 0:
            # Binds to the worker's latest record of this event: the forward pass.
            self.api.stream_wait_event(stream, c.events[job.cuda_event])
            if self.on_waited is not None:
                self.on_waited(job)
        pool, remote, lengths = coalesce(job.pool, job.remote, job.lengths)
        dsts, srcs = (pool, remote) if store else (remote, pool)
        copy_runs(self.api, dsts, srcs, lengths,
                  ACCESS_ORDER_STREAM if store else ACCESS_ORDER_ANY, stream)
        done_ev = dev.free_events.pop() if dev.free_events else self.api.event_create()
        self.api.event_record(done_ev, stream)
        return done_ev

    def _complete(self, dev: _Device) -> None:
        """Completion thread: poll the completion events, report each job once."""
        self.api.set_current_context(dev.ctx)
        inflight: list[tuple[CopyJob, _Client, int, float]] = []
        stop_by = 0.0  # once stopping: give up on copies still running at this time
        while True:
            try:
                while True:
                    item = dev.pending.get(block=not inflight and not stop_by)
                    if item is _STOP:
                        stop_by = time.monotonic() + STOP_SECONDS
                    else:
                        inflight.append(item)
            except queue.Empty:
                pass
            still = []
            for job, c, ev, started in inflight:
                try:
                    ready = self.api.event_query(ev)
                except Exception as e:  # noqa: BLE001 - the copy failed on the device
                    self._finish(job, c, e, started)
                    continue
                if ready:
                    dev.free_events.append(ev)  # list ops are atomic; the submit thread pops
                    self._finish(job, c, None, started)
                else:
                    still.append((job, c, ev, started))
            inflight = still
            if stop_by and (not inflight or time.monotonic() > stop_by):
                for job, c, _ev, started in inflight:  # a copy that never completes
                    self._finish(job, c, TransferError("copy did not complete before the "
                                                       "daemon stopped"), started)
                return
            if inflight:
                time.sleep(POLL_SECONDS)

    def _finish(self, job: CopyJob, c: _Client, err: Exception | None, started: float) -> None:
        if err is not None and not isinstance(err, TransferError | RequestError):
            err = TransferError(f"CUDA copy failed: {err}", Code.TRANSFER_FAILED)
        try:
            self.on_done(job, err, time.perf_counter() - started)
        finally:
            with self._lock:
                c.inflight -= 1
                release = c.gone and c.inflight == 0
            if release:
                c.device.work.put(_Release(c))

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop taking jobs, fail queued ones, wait for copies in flight, close handles."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            devices = list(self._devices.values())
        for dev in devices:
            dev.work.put(_STOP)
        for dev in devices:
            for t in dev.threads:
                t.join(timeout=60)

    def _shutdown(self, dev: _Device) -> None:
        """On the submit thread: drain, then free everything of this device."""
        while True:
            try:
                item = dev.work.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                self._finish(item[0], item[1], TransferError("daemon is stopping",
                                                             Code.ABORTED), time.perf_counter())
        dev.pending.put(_STOP)
        dev.threads[1].join(timeout=STOP_SECONDS + 30)
        with self._lock:
            for cid, c in list(self._clients.items()):
                if c.device is dev:
                    del self._clients[cid]
                    self._gone.add(c)
            for c in [c for c in self._gone if c.device is dev]:
                self._release(c)  # idempotent: a client released before closes nothing
        # _Release items put after this point (late completions) find nothing to close.
        api = self.api
        for call, arg in ([(api.event_destroy, e) for e in dev.free_events]
                          + [(api.stream_destroy, dev.store_stream),
                             (api.stream_destroy, dev.load_stream),
                             (api.release_primary_context, dev.ordinal)]):
            try:
                call(arg)
            except Exception as e:  # noqa: BLE001 - shutting down: log and go on
                log.warning("CUDA cleanup on %s: %s", format_uuid(dev.uuid), e)
        dev.free_events.clear()


class ClientCopyEngine(TransferEngine):
    """For clients registered with ``client_copy``: the client copied into the slots
    before sending the Transfer, so a job is complete when it arrives. The daemon keeps
    the index and the policy (PENDING -> READY, leases) and moves no bytes."""

    name = "client_copy"

    def attach(self, client: int, pid: int, reg: Register) -> list[int]:
        return [0] * len(reg.fingerprint.rank_page_bytes)  # no remote addresses

    def submit(self, job: CopyJob) -> None:
        self.on_done(job, None, 0.0)

    def close(self) -> None:
        pass
