"""What a ``Connection`` shares with its I/O thread: the fields both read and write.

``Connection`` (the callers' side) and ``IOLoop`` (the thread's side) are two classes over
one set of fields; ``Shared`` declares them, so that the thread's modules see the
connection's settings, callbacks and counters without importing ``Connection`` itself.
The limits both sides keep (the outbox's bound, a caller's receive window) live here
too, beside the logger they share.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from kvd_proto import messages as m

log = logging.getLogger("kvd_client")
# How long a caller waiting for its reply may keep the socket (and the I/O thread) to
# itself: a reply within it needs no thread hand-off; a slower one comes the usual way.
RECEIVE_WINDOW_S = 0.002
# Messages sent from the outbox, and received, per wake-up: callers sending without pause
# (or a flood of Dones) must not keep the thread from the other and from firing timeouts
# (Connection bounds the outbox at MAX_QUEUED and refuses beyond it).
FLUSH_BUDGET = 1000
MAX_QUEUED = 2 * FLUSH_BUDGET


@dataclass
class ClientStats:
    """Why calls did not reach the daemon (part of the API: fail-open needs counters)."""

    sent: int = 0
    timeouts: int = 0
    unavailable: int = 0
    remote_errors: int = 0
    reconnects: int = 0
    lost_transfers: int = 0  # ended without a Done: past deadline + grace, or kvd exited
    wakeups: int = 0  # of the I/O thread: what an engine pays while kvd is away
    # Leases of Lookups answered after their callers gave up, sent back (or queued to be:
    # one a reconnect then drops is counted unavailable as well)
    late_leases: int = 0


class Shared:
    """A connection's fields that its I/O thread reads and writes too (``Connection``
    sets them; the socket and ``IOLoop``'s state are used under ``_lock`` only)."""

    endpoint: str
    name: str
    timeout: float
    ping_interval: float
    on_done: Callable[[m.Done], None] | None
    on_ready: Callable[[m.Registered | None], None] | None
    on_event_waited: Callable[[m.EventWaited], None] | None
    stats: ClientStats
    daemon_pid: int
    instance: str
    epoch: int
    registered: m.Registered | None
    _register: m.Register | None
    _req: itertools.count
    # (message, its future for a call, the daemon run a Transfer's slots belong to)
    _outbox: queue.SimpleQueue[tuple[m.Request, Future | None, str]]
    _wake: int
    _up: threading.Event
    _handshaking: bool
    _closed: bool
    _ctx: zmq.Context
    # Held by the I/O thread while it works (never while it sleeps) and by a caller
    # sending on its own thread.
    _lock: threading.RLock

    def next_req(self) -> int:
        return next(self._req)
