"""The moving parts of the CUDA engine: lanes (a stream and its two threads), the
per-job state that makes completion exactly-once, and the deadline watchdog.

Why lanes: a lane waiting for a worker's event stops everything queued behind it, so
each client gets its own store lane and a device's loads get one more; a lane that waits
long (a worker whose forward pass never ends) stops nobody else. Each lane has a submit
thread, which may wait (polling its client's event), and a completion thread, which blocks
in ``cudaEventSynchronize`` on the lane's own completion events (created with blocking
sync: no polling, no spinning core), in stream order. A lane copies on up to
``COPY_STREAMS`` streams: a job of many runs is split over them (one batched copy per
stream, or its runs one by one on drivers older than 12.8) and joined back on the lane's
main stream, so one event there completes it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd.engines.base import CopyJob
from kvd_client.cudart import CudaApi, CudaError, copy_runs

QUEUED, COPYING, FINISHED = 0, 1, 2
# Streams a lane splits a job's copies over: the copy engines then overlap the per-copy
# costs of small copies. Measured on an H200 (PCIe Gen5, memcpy 55 GB/s), 1 GiB in 64 KiB
# copies: 42 GB/s on one stream, 44-49 on two, 48-50 on four; 256 KiB: 50 -> 53.
COPY_STREAMS = 4
SPLIT_MIN_RUNS = 32  # fewer runs per stream gain nothing over the extra calls
# CUDA's sticky errors: after one, the context runs nothing again (every later call
# fails the same way) until the process ends.
STICKY_CODES = frozenset({214, 220, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719})


def is_sticky(error: BaseException | None) -> bool:
    return isinstance(error, CudaError) and error.code in STICKY_CODES


class Unsettled(Exception):
    """A failed wait for a job's copies, after which the lane's streams could not be
    waited for either, with an error that is not sticky: the copies may still run."""


@dataclass(eq=False)
class Work:
    """One job inside the engine. ``state`` moves QUEUED -> COPYING -> FINISHED or
    QUEUED -> FINISHED, under the engine's lock, so exactly one party reports it: the
    lane that copied it, or whoever failed it first (deadline, detach, close)."""

    job: CopyJob
    client: object  # the engine's _Client
    started: float = field(default_factory=time.perf_counter)
    state: int = QUEUED


class Lane:
    """Non-blocking streams in ``ctx`` (``stream`` and its copy helpers) with a submit
    thread and a completion thread.

    ``start(work, lane)`` runs on the submit thread and returns the completion event of
    the copies it enqueued, or None when it finished the work itself; ``end(work, error)``
    runs on the completion thread once that event completed (or failed)."""

    def __init__(self, api: CudaApi, ctx: int, name: str,
                 start: Callable[[Work, Lane], int | None],
                 end: Callable[[Work, Exception | None], None]) -> None:
        self.api, self.ctx, self.name = api, ctx, name
        self._start, self._end = start, end
        api.set_current_context(ctx)
        streams: list[int] = []
        events: list[int] = []
        try:
            for _ in range(COPY_STREAMS):
                streams.append(api.stream_create())
            for _ in range(COPY_STREAMS):  # the fork, then a join per helper
                events.append(api.event_create())
        except Exception:  # what was made is freed: a refused attach leaks nothing
            for call, arg in [*((api.event_destroy, e) for e in events),
                              *((api.stream_destroy, s) for s in streams)]:
                try:
                    call(arg)
                except Exception:  # noqa: BLE001, S110 - the first error is the one to raise
                    pass
            raise
        self.stream, self.helpers = streams[0], streams[1:]
        self._fork, self._joins = events[0], events[1:]
        self.todo: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Work, int] | None] = queue.SimpleQueue()
        self._free: list[int] = []
        self._retired: Callable[[list[Exception]], None] | None = None
        self._outstanding = 0  # works whose copies are enqueued and not completed
        self._cv = threading.Condition()
        self.threads = [threading.Thread(target=self._submit, name=f"kvd-cuda-{name}",
                                         daemon=True),
                        threading.Thread(target=self._complete, daemon=True,
                                         name=f"kvd-cuda-done-{name}")]
        for t in self.threads:
            t.start()

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, lengths: np.ndarray,
             access_order: int) -> None:
        """Enqueue the copies (submit thread only), split over the lane's streams when
        there are many, all joined back on ``stream``: what is recorded on it next
        completes after every one of them. A fork event orders the helpers after what
        ``stream`` holds. (The events are the lane's own: a wait binds to the record
        before it, so reusing them per job is safe.)"""
        parts = min(COPY_STREAMS, len(lengths) // SPLIT_MIN_RUNS)
        if parts <= 1:
            copy_runs(self.api, dsts, srcs, lengths, access_order, self.stream)
            return
        helpers = self.helpers[:parts - 1]
        self.api.event_record(self._fork, self.stream)
        for h in helpers:
            self.api.stream_wait_event(h, self._fork)
        bounds = np.linspace(0, len(lengths), parts + 1).astype(np.int64).tolist()
        for i, stream in enumerate([self.stream, *helpers]):
            lo, hi = bounds[i], bounds[i + 1]
            copy_runs(self.api, dsts[lo:hi], srcs[lo:hi], lengths[lo:hi], access_order,
                      stream)
        for h, join in zip(helpers, self._joins):
            self.api.event_record(join, h)
            self.api.stream_wait_event(self.stream, join)

    def synchronize(self) -> None:
        """Wait for everything enqueued on the lane's streams (after a failed enqueue),
        each stream even when another one fails; the first error is raised."""
        errors = []
        for s in (self.stream, *self.helpers):
            try:
                self.api.stream_synchronize(s)
            except Exception as e:  # noqa: BLE001 - raised below, after the others
                errors.append(e)
        if errors:
            raise errors[0]

    def settle(self, error: Exception) -> Exception:
        """After ``error`` (an enqueue or a wait that failed), wait for what the streams
        hold: a Done must not leave before its copies ran (a load's client would reuse
        its blocks under them; a store's slot would be handed out again). The error to
        report: ``error``, the sticky one that ended the context, or ``Unsettled``."""
        try:
            self.synchronize()
        except Exception as e:  # noqa: BLE001 - sorted below
            if is_sticky(e):
                return e if not is_sticky(error) else error  # nothing runs any more
            return Unsettled(f"{error}; and waiting for the lane's streams: {e}")
        return error

    def done_event(self) -> int:
        """A completion event for the copies just enqueued (submit thread only)."""
        return self._free.pop() if self._free else self.api.event_create(blocking=True)

    def drop_event(self, ev: int) -> None:
        """A completion event that was never recorded (its record failed): destroyed,
        not reused, as after a failed wait; a poisoned context has nothing to free."""
        try:
            self.api.event_destroy(ev)
        except Exception:  # noqa: BLE001, S110 - nothing more to do with it
            pass

    def _submit(self) -> None:
        self.api.set_current_context(self.ctx)
        while (work := self.todo.get()) is not None:
            ev = self._start(work, self)
            if ev is not None:
                with self._cv:
                    self._outstanding += 1
                self._done.put((work, ev))
        self._done.put(None)

    def _complete(self) -> None:
        self.api.set_current_context(self.ctx)
        while (item := self._done.get()) is not None:
            work, ev = item
            err: Exception | None = None
            try:
                self.api.event_synchronize(ev)  # blocks, in stream order
                self._free.append(ev)
            except Exception as e:  # noqa: BLE001 - the copy failed on the device
                self.drop_event(ev)  # not reused after a failure
                err = self.settle(e)  # a failed wait proves nothing about the copies
            with self._cv:
                self._outstanding -= 1
                self._cv.notify_all()
            self._end(work, err)
        if self._retired is not None:  # the last user of the stream and events is gone
            self._retired(self.destroy())

    def wait_room(self, depth: int, until: float) -> None:
        """On the submit thread: wait until fewer than ``depth`` works have copies on
        the GPU, or ``until`` (time.monotonic()) passed. Loads use it so that a deadline
        checked after it is checked close to when the copy runs, not behind a backlog."""
        with self._cv:
            self._cv.wait_for(lambda: self._outstanding < depth,
                              max(0.0, min(until, time.monotonic() + 3600) - time.monotonic()))

    def retire(self, then: Callable[[list[Exception]], None]) -> None:
        """End the lane without waiting: its threads finish what they hold (the submit
        thread may be waiting for a client's event), then the completion thread frees the
        stream and events and calls ``then(errors)``. Nothing is freed under a thread
        still using it."""
        self._retired = then
        self.todo.put(None)

    def stop(self, timeout: float) -> bool:
        """Let queued work drain, end both threads; True when they ended in time."""
        self.todo.put(None)
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def destroy(self) -> list[Exception]:
        """Free the stream and events (after ``stop``); the errors, to log."""
        errors = []
        self.api.set_current_context(self.ctx)
        events = [*self._free, self._fork, *self._joins]
        for call, arg in [*((self.api.event_destroy, e) for e in events),
                          *((self.api.stream_destroy, s) for s in (self.stream, *self.helpers))]:
            try:
                call(arg)
            except Exception as e:  # noqa: BLE001 - shutting down: the caller logs
                errors.append(e)
        self._free.clear()
        return errors


class Watchdog:
    """Fails queued work whose deadline passed while its lane was waiting (a client's
    event that does not complete): ``expire(work)`` is called at the deadline and does
    nothing to work that started copying meanwhile. One thread, sleeping until the
    earliest deadline: no polling."""

    def __init__(self, expire: Callable[[Work], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, Work]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def watch(self, work: Work) -> None:
        if math.isinf(work.job.deadline):
            return
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-cuda-deadlines",
                                                daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (work.job.deadline, next(self._seq), work))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (
                        not self._heap or self._heap[0][0] > time.monotonic()):
                    # (bounded: a deadline years away overflows the wait's time_t, and
                    # the thread died of it, leaving every later deadline unwatched)
                    wait = (min(self._heap[0][0] - time.monotonic(), 3600.0)
                            if self._heap else None)
                    self._cv.wait(wait)
                if self._stopped:
                    return
                _, _, work = heapq.heappop(self._heap)
            self._expire(work)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(10)
