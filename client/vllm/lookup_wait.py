"""How long a scheduler step may wait for kvd: the ``lookup_wait_ms`` budget.

vLLM's scheduler must not stall on kvd. A scan may wait for a Lookup reply on its way,
or for the connection's first handshake, but only out of a budget of
``lookup_wait_ms`` per scheduler step in all; an engine's first requests wait for that
handshake at most ``lookup_timeout_ms``. Apart from the manager because the budget and
the handshake wait are state of their own, renewed each step, that no other hook reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvd_client.connection import Connection
from kvd_client.vllm.failopen import Boundary
from kvd_client.vllm.options import KvdOptions


class LookupWait:
    """This step's wait budget and the first handshake's wait (scheduler thread only)."""

    def __init__(self, conn: Connection, options: KvdOptions, boundary: Boundary) -> None:
        self.conn = conn
        self.options = options
        self.boundary = boundary
        self._wait_left = options.lookup_wait_ms / 1000  # this step's budget for replies
        self._connecting: dict[str, float] = {}  # req -> first seen, before the first handshake
        self._connect_gave_up = False

    def new_step(self) -> None:
        self._wait_left = self.options.lookup_wait_ms / 1000

    def forget(self, req_id: str) -> None:
        self._connecting.pop(req_id, None)

    def await_connection(self, req_id: str, now: float) -> bool:
        """Whether a request should wait for the first handshake instead of missing.

        An engine's first requests can come while its connection is still being set up
        (the handshake takes a few round trips, longer on a busy machine): their blocks
        may well be in kvd, so they wait for it like for a Lookup reply, within this
        step's wait budget, then RETRY until ``lookup_timeout_ms``. Only before the first
        registration and only while a daemon is answering: a daemon that is not there, or
        a connection lost later, misses at once. Once one request waited in vain, the
        next ones do not.
        """
        if self.conn.epoch or self._connect_gave_up or not self.conn.handshaking:
            return False
        first = self._connecting.setdefault(req_id, now)
        if now - first >= self.options.lookup_timeout_ms / 1000:
            self._connect_gave_up = True
            self.boundary.note("lookup", "connecting", f"kvd did not complete the handshake "
                               f"in {self.options.lookup_timeout_ms} ms; serving as a miss")
            return False
        self.spend_wait(self.conn.wait_up)
        return True

    def spend_wait(self, wait: Callable[[float], object]) -> None:
        """Wait for something on its way, out of this step's ``lookup_wait_ms`` budget."""
        if self._wait_left > 0:
            started = time.monotonic()
            wait(self._wait_left)
            self._wait_left -= time.monotonic() - started
