"""GPU data path: the daemon copies between a worker's GPU memory and the pinned pool.

A worker exports each KV tensor with a legacy CUDA IPC handle and a ring of
interprocess events (``kvd_client.cuda``). Per GPU, found by UUID because ordinals
differ between processes, the engine works in the device's primary context with one
lane (a non-blocking stream, a submit thread, a completion thread:
``kvd.engines.cuda_device``) per client for stores and one per GPU for loads:

    store lane:  expired? -> poll cudaEventQuery(ring[i]) until the forward pass ended
                 -> on_waited(job) -> expired? -> copy (cuMemcpyBatchAsync, or
                 cudaMemcpyAsync per run) -> record done
    load lane:   verify checksums -> expired? -> poll ring[i] (when named) -> copy
                 -> record done
    completion:  cudaEventSynchronize(done) -> [store] late? checksum -> on_done(job)

The worker's event is polled from the host, never waited on by a daemon stream: on an
H200, a stream waiting on the event of a worker killed before its stream reached it
waited for ever, and with it every copy behind it on that stream and the close of that
worker's IPC memory (cudaIpcCloseMemHandle blocked, and the dead engine's KV cache
stayed allocated). A poll ends when the work does (deadline, detach, close). A store
lane waiting for its client's event blocks nobody else; a load naming an event that
does not complete holds up the loads of that GPU behind it until its deadline or its
client's detach. Jobs queued behind a wait fail at their deadline (the watchdog) or
when the client is detached, never later than that start. ``on_waited`` lets the
daemon tell the worker that event ``i`` may be recorded again (or destroyed): the wait
on it has passed. Each IPC memory handle is opened
once per (client pid, handle), checked against the client's geometry, and closed
exactly once, after the last copy of the last client using it completed. Copies into
pool chunks that are not pinned yet are not issued (they would be synchronous): the job
fails with BUSY, a miss. All CUDA calls go through ``kvd_client.cudart``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvd.engines.base import (STOP_S, CopyJob, DoneCallback, TransferEngine, checksum_after,
                              expired, late, verify_then)
from kvd.engines.cuda_device import (COPYING, FINISHED, QUEUED, Lane, Unsettled, Watchdog,
                                     Work, is_sticky)
from kvd.engines.cuda_handles import (  # noqa: F401 - refuse_...: kvd.registration's import
    Client, Device, Handles, format_uuid, open_failure, refuse_foreign_pid_namespace)
from kvd.errors import RequestError, TransferError
from kvd.pinning import PoolPinner
from kvd_client.cudart import ACCESS_ORDER_ANY, ACCESS_ORDER_STREAM, IPC_HANDLE_BYTES, CudaApi
from kvd_client.runs import coalesce
from kvd_proto.messages import Code, Direction, Register

log = logging.getLogger("kvd.engines.cuda")
MAX_EVENTS = 4096  # event-ring entries one client may register
# The longest a job waits for its worker's event, whatever its deadline: a load lane is
# shared by the GPU's clients, and a worker's forward pass ends within seconds.
EVENT_WAIT_MAX_S = 10.0
# Polling a worker's event: the first look again after POLL_FIRST_S, doubling up to
# POLL_MAX_S (a forward pass ends within milliseconds; a stalled one costs ~1k looks/s).
POLL_FIRST_S = 50e-6
POLL_MAX_S = 1e-3

WaitedCallback = Callable[[CopyJob], None]
# Loads with copies on the GPU at once, per device: the deadline of the next one is
# checked only once these completed, so a stalled GPU cannot run it long after its check.
LOAD_DEPTH = 1
PinnedCheck = Callable[[int, int], bool]  # (lowest address, end) -> copies may be issued


class CudaEngine(TransferEngine):
    """Copies with CUDA: a store lane per client, a load lane per GPU.

    ``pool`` (the daemon's pool mapping) is needed for checksums; ``pinned(lo, hi)``
    says whether copies touching ``[lo, hi)`` of the pool may be issued (the pinner's
    progress); without it the caller vouches that the pool is pinned."""

    name = "cuda"

    def __init__(self, on_done: DoneCallback, api: CudaApi, *,
                 on_waited: WaitedCallback | None = None, pool: np.ndarray | None = None,
                 pinned: PinnedCheck | None = None) -> None:
        super().__init__(on_done)
        self.api = api
        self.on_waited = on_waited
        self.pool = pool
        self.pinned = pinned
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a copy completes
        self._closed = False
        self._settled = True  # close() saw every copy complete
        self._uuids: dict[bytes, int] | None = None
        self._devices: dict[bytes, Device] = {}
        self._clients: dict[int, Client] = {}
        self._gone: set[Client] = set()  # detached, handles not closed yet
        self._retiring: set[Lane] = set()  # lanes of gone clients, ending by themselves
        self._handles = Handles(api)
        self._watchdog = Watchdog(self._expire)

    # ------------------------------------------------------------ devices
    def _device_for(self, uuid: bytes) -> Device:
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
        dev = Device(ordinal, uuid, self.api.retain_primary_context(ordinal))
        try:
            dev.loads = Lane(self.api, dev.ctx, f"load-{format_uuid(uuid)[4:12]}",
                             self._start, self._end)
        except Exception:
            try:  # the next client of this GPU retains it afresh
                self.api.release_primary_context(ordinal)
            except Exception:  # noqa: BLE001, S110 - the first error is the one to report
                pass
            raise
        if not self.api.has_batch_copy():
            log.warning("GPU %s: driver older than 12.8, copying with one cudaMemcpyAsync "
                        "per coalesced run", format_uuid(uuid))
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
            if dev.lost:
                raise self._lost_error(dev)
            c = Client(pid, dev, [], [], [])
            opened = False
            try:
                self.api.set_current_context(dev.ctx)  # this thread opens the handles
                self._handles.open(c, regions, reg.cuda_event_handles)
                opened = True
                c.lane = Lane(self.api, dev.ctx, f"store-{client}", self._start, self._end)
            except Exception as e:
                self._release(c)
                if isinstance(e, RequestError):
                    raise
                if is_sticky(e):
                    self._mark_lost(dev, e)  # (the lock is held: _lose would wait on it)
                    raise self._lost_error(dev) from e
                if opened:  # the handles were fine: the daemon's own streams were not
                    raise TransferError(f"cannot create the copy streams for the client's "
                                        f"GPU: {e}") from e
                raise open_failure(pid, e) from e
            self._clients[client] = c
            base = {h: self._handles.base(c, h) for (_, h) in c.mem_keys}
        return [base[r.ipc_handle] + r.offset for r in regions]

    def detach(self, client: int) -> None:
        """The client is gone: its queued jobs fail now (CLIENT_GONE, nothing copied); its
        handles close once the copies already on the GPU completed. May be called while
        jobs are in flight."""
        with self._lock:
            c = self._clients.pop(client, None)
            if c is None:
                return
            c.gone = True
            self._gone.add(c)
            failed = self._take_queued(c)
        for w in failed:
            self._report(w, TransferError(f"client {client} is gone", Code.CLIENT_GONE))
        self._maybe_release(c)

    def _take_queued(self, c: Client) -> list[Work]:
        """Mark the client's not-yet-copying works finished (lock held); returns them."""
        out = [w for w in c.works if w.state == QUEUED]
        for w in out:
            w.state = FINISHED
        return out

    def _maybe_release(self, c: Client, wait: float = 0.0) -> None:
        """Once a gone client has no copies on the GPU: end its lane, then close its
        handles. Without ``wait`` it never joins: the lane's submit thread may still be
        in a poll of the client's event (it ends at its next look) or a copy call, and
        the lane frees itself and the handles once that returned. With ``wait``
        (shutdown) it joins the lane that long."""
        with self._lock:
            if not c.gone or c.copying or c.released:
                return
            c.released = True
            lane, c.lane = c.lane, None
            if lane is not None and not wait:
                self._retiring.add(lane)  # in the same step: close() must see it
        if lane is None:
            self._retired(c, [])
        elif wait:
            if lane.stop(wait):
                self._retired(c, lane.destroy())
            else:
                log.warning("GPU %s: the store lane of pid %d did not end in time; its "
                            "handles stay open", format_uuid(c.device.uuid), c.pid)
        else:
            lane.retire(lambda errors: self._retired(c, errors, lane))

    def _retired(self, c: Client, errors: list[Exception], lane: Lane | None = None) -> None:
        """The gone client's lane threads ended: close its handles (events included)."""
        self._log_errors(c.device, errors)
        with self._lock:
            self._retiring.discard(lane)  # type: ignore[arg-type]
            self.api.set_current_context(c.device.ctx)
            self._release(c)

    def _release(self, c: Client) -> None:
        self._gone.discard(c)
        self._handles.release(c)

    def _lose(self, dev: Device, error: Exception) -> None:
        """A sticky error (or copies that could not be waited for): the GPU's context is
        done for. Its clients' jobs fail at once from now on and new ones are refused,
        until kvd restarts (a new process gets a new context)."""
        with self._lock:
            self._mark_lost(dev, error)

    def _mark_lost(self, dev: Device, error: Exception) -> None:
        """``_lose`` with the lock held."""
        if dev.lost:
            return
        dev.lost = str(error)
        log.error("GPU %s: its CUDA context is unusable (%s): copies with it fail until kvd "
                  "restarts (systemctl restart kvd; the other GPUs and host clients go on)",
                  format_uuid(dev.uuid), error)

    def _lost_error(self, dev: Device) -> TransferError:
        return TransferError(f"the daemon's CUDA context on GPU {format_uuid(dev.uuid)} is "
                             f"unusable ({dev.lost}); restart kvd", Code.TRANSFER_FAILED)

    def stats(self) -> dict[str, int]:
        """For the status document: what is open on the GPUs (a dead client's handles
        close once its copies drained; ``retiring`` counts lanes still draining)."""
        with self._lock:
            return {"gpus": len(self._devices),
                    "lost_gpus": sum(bool(d.lost) for d in self._devices.values()),
                    "clients": len(self._clients),
                    "gone_clients": len(self._gone), "retiring": len(self._retiring),
                    "ipc_memory": len(self._handles.mem),
                    "ipc_events": len(self._handles.events)}

    # ------------------------------------------------------------ jobs
    def submit(self, job: CopyJob) -> None:
        err: Exception | None = None
        with self._lock:
            c = self._clients.get(job.client)
            if self._closed or c is None:
                err = TransferError("daemon is stopping", Code.ABORTED) if self._closed \
                    else TransferError(f"client {job.client} is not attached", Code.CLIENT_GONE)
            elif not -1 <= job.cuda_event < len(c.events):
                err = RequestError(f"CUDA event {job.cuda_event} is not in the client's ring "
                                   f"of {len(c.events)}", Code.BAD_REQUEST)
            elif c.device.lost:
                err = self._lost_error(c.device)
            else:
                err = expired(job) or self._unpinned(job)
                if job.cuda_event >= 0:  # see EVENT_WAIT_MAX_S
                    job.deadline = min(job.deadline, time.monotonic() + EVENT_WAIT_MAX_S)
            if err is None:
                assert c is not None and c.lane is not None and c.device.loads is not None
                work = Work(job, c)
                c.works.add(work)
                lane = c.lane if job.direction == Direction.STORE else c.device.loads
                lane.todo.put(work)
        if err is not None:
            self.on_done(job, err, 0.0)
            return
        self._watchdog.watch(work)

    def _unpinned(self, job: CopyJob) -> TransferError | None:
        if self.pinned is None or not len(job.pool):
            return None
        lo = int(job.pool.min())
        hi = int((job.pool + job.lengths).max())
        if self.pinned(lo, hi):
            return None
        return TransferError("the pool chunk of these slots is not pinned yet (pinning runs "
                             "in the background); not copied", Code.BUSY)

    def _start(self, work: Work, lane: Lane) -> int | None:
        """On the lane's submit thread: order, check, enqueue; the completion event."""
        job = work.job
        store = job.direction == Direction.STORE
        if work.state != QUEUED:
            return None  # failed while queued (deadline, detach, close)
        c = work.client
        assert isinstance(c, Client)
        claimed = False
        try:
            err = self._lost_error(c.device) if c.device.lost else None
            err = err or (None if store else verify_then(job, self.pool))
            err = err or self._await_worker(work)
            if not store:  # a load's bytes cannot be taken back: no backlog ahead of it
                lane.wait_room(LOAD_DEPTH, job.deadline)
            err = err or expired(job)
            if err is not None:
                self._fail(work, err)
                return None
            if not self._claim(work):
                return None  # failed meanwhile (deadline, detach, close)
            claimed = True
            pool, remote, lengths = coalesce(job.pool, job.remote, job.lengths)
            dsts, srcs = (pool, remote) if store else (remote, pool)
            lane.copy(dsts, srcs, lengths, ACCESS_ORDER_STREAM if store else ACCESS_ORDER_ANY)
            ev = lane.done_event()
            try:
                self.api.event_record(ev, lane.stream)
            except Exception:
                lane.drop_event(ev)
                raise
            return ev
        except Exception as e:  # noqa: BLE001 - reported to the client as Done
            if not claimed:
                if is_sticky(e):  # e.g. polling the worker's event: the context is done
                    self._lose(c.device, e)
                self._fail(work, e)  # nothing if somebody else ended it meanwhile
                return None
            # Part of the copies may be on the streams already: no Done before they ran.
            self._end(work, lane.settle(e))
            return None

    def _await_worker(self, work: Work) -> Exception | None:
        """Until the worker's stream passed the event the job names (a store: the forward
        pass that wrote the blocks; a load: what vLLM queued before it, e.g. zeroing
        them), polled from this thread (see the module docstring for why not on the
        GPU). Returns early, with nothing to report, once the work was ended meanwhile."""
        job, c = work.job, work.client
        assert isinstance(c, Client)
        if work.state != QUEUED:
            return None
        err = expired(job)
        if err is not None or job.cuda_event < 0:
            return err
        event = c.events[job.cuda_event]  # the worker's latest record of it
        delay = POLL_FIRST_S
        while True:
            # Under the lock: a work still QUEUED means its client is attached, so its
            # event handles are open (a load lane polls for every client of its GPU, and
            # a gone client's events are destroyed under this lock).
            with self._lock:
                if work.state != QUEUED:
                    return None
                if self.api.event_query(event):
                    break
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
        if self.on_waited is not None:  # passed: the worker may record it again, or
            self.on_waited(job)  # destroy it
        return None

    def _claim(self, work: Work) -> bool:
        with self._lock:
            if work.state != QUEUED:
                return False
            work.state = COPYING
            assert isinstance(work.client, Client)
            work.client.copying += 1
            return True

    def _fail(self, work: Work, err: Exception) -> None:
        """End a work that copied nothing, unless somebody else ended it first."""
        with self._lock:
            if work.state != QUEUED:
                return
            work.state = FINISHED
        self._report(work, err)

    def _expire(self, work: Work) -> None:
        """The watchdog: a work still queued at its deadline ends with EXPIRED."""
        self._fail(work, expired(work.job, work.job.deadline + 1e-9) or
                   TransferError("deadline passed", Code.EXPIRED))

    def _end(self, work: Work, err: Exception | None) -> None:
        """On the completion thread: the copies of ``work`` completed (or failed)."""
        job, c = work.job, work.client
        assert isinstance(c, Client)
        if err is None and job.direction == Direction.STORE:
            err = late(job)  # read after its client gave up: not trusted
            if err is None:
                try:
                    checksum_after(job, self.pool)  # from the host copy, off the submit thread
                except Exception as e:  # noqa: BLE001
                    err = e
        unsettled = isinstance(err, Unsettled)
        if unsettled or is_sticky(err):
            self._lose(c.device, err)  # type: ignore[arg-type]
        with self._lock:
            work.state = FINISHED
            if not unsettled:  # else its copies may still run: its handles stay open
                c.copying -= 1
            self._idle.notify_all()
        self._report(work, err)
        self._maybe_release(c)

    def _report(self, work: Work, err: Exception | None) -> None:
        if err is not None and not isinstance(err, TransferError | RequestError):
            err = TransferError(f"CUDA copy failed: {err}", Code.TRANSFER_FAILED)
        c = work.client
        assert isinstance(c, Client)
        with self._lock:
            c.works.discard(work)
        self.on_done(work.job, err, time.perf_counter() - work.started)

    # ------------------------------------------------------------ shutdown
    def close(self, timeout: float = STOP_S) -> bool:
        """Stop taking jobs, fail queued ones, wait (``timeout`` in all) for copies in
        flight, close handles. False when copies may still run: then the contexts are
        kept, and the caller must keep the pool pinned and mapped (the process's exit
        ends the copies; unregistering or unmapping memory under them would not)."""
        end = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, end - time.monotonic())

        with self._lock:
            if self._closed:
                return self._settled
            self._closed = True
            clients = [*self._clients.values(), *self._gone]
            self._clients.clear()
            failed = [w for c in clients for w in self._take_queued(c)]
            for c in clients:
                c.gone = True
                self._gone.add(c)
        for w in failed:
            self._report(w, TransferError("daemon is stopping", Code.ABORTED))
        self._watchdog.stop()
        with self._idle:
            drained = self._idle.wait_for(lambda: not any(c.copying for c in clients), left())
        for c in clients:
            if c.copying:
                log.warning("GPU %s: copies of pid %d did not complete before the daemon "
                            "stopped; its handles stay open", format_uuid(c.device.uuid), c.pid)
            else:
                self._maybe_release(c, wait=left())
        with self._lock:
            retiring = list(self._retiring)
        for lane in retiring:  # they release their handles before the contexts go
            for t in lane.threads:
                t.join(left())
        for dev in self._devices.values():
            if not drained:  # copies may still run in it: the process's exit ends them
                continue
            if dev.loads is not None and dev.loads.stop(left()):
                self._log_errors(dev, dev.loads.destroy())
            try:
                self.api.release_primary_context(dev.ordinal)
            except Exception as e:  # noqa: BLE001 - shutting down: log and go on
                self._log_errors(dev, [e])
        self._settled = drained
        return drained

    def _log_errors(self, dev: Device, errors: list[Exception]) -> None:
        for e in errors:
            log.warning("CUDA cleanup on %s: %s", format_uuid(dev.uuid), e)


def gpu_path(on_done: DoneCallback, api: CudaApi, pool: np.ndarray, *,
             on_waited: WaitedCallback | None = None) -> tuple[CudaEngine, PoolPinner]:
    """The daemon's GPU data path over ``pool``: the engine and the pool's pinner, wired
    so that stores are checksummed from the pool and no copy enters an unpinned chunk.
    The caller starts the pinner (``start()``) and releases it after closing the engine."""
    pinner = PoolPinner(pool.ctypes.data, pool.nbytes, api)
    engine = CudaEngine(on_done, api, on_waited=on_waited, pool=pool, pinned=pinner.ready)
    return engine, pinner
