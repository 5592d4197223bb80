"""The one fail-open boundary: vLLM hooks degrade instead of raising.

Every manager / worker hook vLLM calls runs its body through ``Boundary.guard``: a
``KvdClientError`` (the daemon is down, slow, or refused) and, as a last resort, any other
exception are counted by cause, logged at most once per interval per cause, and turned
into the hook's safe answer (a miss, a skipped store, a failed load reported for
recompute). Code below the hooks raises typed errors only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from kvd_client.errors import KvdClientError, RemoteError, Timeout, Unavailable

T = TypeVar("T")
log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config


def cause_of(exc: BaseException) -> str:
    if isinstance(exc, Timeout):
        return "timeout"
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, RemoteError):
        return f"remote_{exc.code.name.lower()}"
    if isinstance(exc, KvdClientError):
        return "client_error"
    return "bug"


class Boundary:
    """Counts degradations by (hook, cause); rate-limits their log lines."""

    def __init__(self, side: str, interval: float = 30.0) -> None:
        self.side = side
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        _LIVE.add(self)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def note(self, hook: str, cause: str, detail: object = "") -> None:
        """Count one degradation and log it unless its key logged recently."""
        key = f"{hook}.{cause}"
        now = time.monotonic()
        with self._lock:
            self.counts[key] += 1
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                return
            self._last[key] = now
            total = self.counts[key]
        level = logging.ERROR if cause == "bug" else logging.WARNING
        log.log(level, "kvd %s %s degraded (%s, %d so far): %s", self.side, hook, cause,
                total, detail, exc_info=cause == "bug")

    def guard(self, hook: str, fallback: Callable[[], T], body: Callable[[], T]) -> T:
        try:
            return body()
        except Exception as e:  # noqa: BLE001 - the one boundary: vLLM must keep serving
            self.note(hook, cause_of(e), e)
            return fallback()


_LIVE: weakref.WeakSet[Boundary] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork while the parent's I/O thread counted under a boundary's lock leaves it
    held in the child, where no thread will release it: every hook would hang there."""
    for boundary in list(_LIVE):
        boundary._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
