"""The stores an idle in-process engine would hold back.

vLLM defers each step's stores to the start of the next step (so that they start after
the step's sampling). An engine in its own process keeps stepping while stores are
pending, so they go out at once; an in-process one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
steps only inside ``generate()``: its last step's stores waited for the next call, and
once that was more than the daemon's ``store_claim_ms`` away their slots had been given
back and the blocks were never stored. ``IdleFlush`` submits them once no step has run
for ``IDLE_S``. The worker's step hooks run under its lock, so it acts only between
steps and never beside vLLM's own submission of the same list.

Host memory only: on a GPU a store is ordered after the forward pass on the compute
stream of the thread that submits it (``kvd_client.vllm.cuda_paths``), which this
thread is not.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvd_client.process import leave_compute_cpus

IDLE_S = 0.2  # far above the gap between two steps of a busy engine (scheduling only)
_LIVE: weakref.WeakSet[IdleFlush] = weakref.WeakSet()


class IdleFlush:
    """Owns a thread that submits ``connector_worker``'s deferred stores when idle."""

    def __init__(self, connector_worker: Any, idle_s: float = IDLE_S) -> None:
        self._cw = connector_worker
        self._idle_s = idle_s
        self._cv = threading.Condition()
        self._due: float | None = None  # when to flush, while stores wait and no step ran
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvd-idle-flush",
                                        daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _forked(self) -> None:
        """In a fork's child the thread stayed in the parent, which may have held the
        lock: a new one, and nothing flushed from here."""
        self._closed = True
        self._cv = threading.Condition()
        self._due = None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around each worker hook that may touch the deferred stores."""
        with self._cv:
            self._due = None
            yield
            if self._deferred():
                self._due = time.monotonic() + self._idle_s
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _deferred(self) -> list:
        return getattr(self._cw, "_unsubmitted_store_jobs", None) or []

    def _run(self) -> None:
        leave_compute_cpus()
        with self._cv:
            while not self._closed:
                left = None if self._due is None else self._due - time.monotonic()
                if left is None or left > 0:
                    self._cv.wait(left)
                    continue
                self._due = None
                deferred = self._deferred()
                worker = self._cw.worker
                if not deferred:
                    continue
                # As vLLM submits them; kvd's submit_store never raises (its boundary).
                for job_id, src, dst in deferred:
                    worker.submit_store(job_id, src, dst)
                worker.boundary.count("store.idle_flushed", len(deferred))
                deferred.clear()


def _after_fork_in_child() -> None:
    for flush in list(_LIVE):
        flush._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
