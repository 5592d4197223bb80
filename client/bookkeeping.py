"""The client's bookkeeping of what it sent and is still owed: calls waiting for their
reply, Transfers waiting for their Done.

A Transfer ends exactly once: by its Done, by an error about it, by the exit of the
daemon run it went to, or past its deadline plus grace; a call ends by its reply or its
timeout. The I/O thread decides when; this module keeps the records (which daemon run
each Transfer went to, how many each run still has) and ends them, delivering a
Transfer's Done to ``on_done``.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future

from kvd_client.daemon_watch import DaemonWatch
from kvd_client.shared import Shared, log
from kvd_proto import messages as m

GRACE_S = m.EXPIRY_GRACE_NS / 1e9


class Call(Future):
    """A call's future, and the daemon run and registration the call went to (set as it
    is sent): a lease in its reply belongs to them (a reconnect may come between the
    caller's look at the connection and the send)."""

    run = ""
    epoch = 0


class Bookkeeping:
    """The calls and Transfers in flight (used under the connection's ``_lock``)."""

    def __init__(self, conn: Shared, watcher: DaemonWatch) -> None:
        self.c = conn
        self.watcher = watcher
        self.pending: dict[int, tuple[Future | None, float, str]] = {}
        # req -> (Transfer, give-up time on time.monotonic(), the daemon run it went to):
        # kept across a reconnect, since the run it went to may still copy it
        self.transfers: dict[int, tuple[m.Transfer, float, str]] = {}
        self.in_flight: Counter[str] = Counter()  # daemon run -> its Transfers here

    def in_flight_req(self, req: int) -> bool:
        return req in self.transfers or req in self.pending

    def track(self, msg: m.Request, fut: Future | None) -> None:
        """A message went out: wait for its reply (a call) or its Done (a Transfer)."""
        if isinstance(msg, m.Transfer):
            self.transfers[msg.req] = (msg, msg.deadline_ns / 1e9 + GRACE_S, self.c.instance)
            self.in_flight[self.c.instance] += 1
        else:
            if isinstance(fut, Call):
                fut.run, fut.epoch = self.c.instance, self.c.epoch
            self.pending[msg.req] = (fut, time.monotonic() + self.c.timeout * 2,
                                     type(msg).__name__)

    def fail_one(self, msg: m.Request, fut: Future | None, err: Exception) -> None:
        c = self.c
        c.stats.unavailable += 1
        if fut is not None:
            fut.set_exception(err)
        elif isinstance(msg, m.Transfer):
            self.deliver(m.Done(msg.req, msg.event, m.Code.CLIENT_GONE, str(err)))

    def deliver(self, done: m.Done) -> None:
        cb = self.c.on_done
        if cb is not None:
            try:
                cb(done)
            except Exception:  # noqa: BLE001 - a callback bug must not kill the I/O thread
                log.exception("on_done callback failed")

    def pop_transfer(self, req: int) -> m.Transfer | None:
        """A Transfer is over: forget it (and an earlier daemon run it was the last of)."""
        entry = self.transfers.pop(req, None)
        if entry is None:
            return None
        msg, _, run = entry
        self.in_flight[run] -= 1
        if not self.in_flight[run]:
            del self.in_flight[run]
            if run != self.c.instance:
                self.watcher.unwatch_daemons(lambda r: r == run)
        return msg

    def end_transfers(self, code: m.Code, why: str, now: float | None = None,
                      run: str | None = None) -> None:
        """Fail the Transfers nobody will answer: all of them, those that went to daemon
        ``run`` (which exited), or (with ``now``) those past their give-up time, when the
        daemon no longer copies them."""
        c = self.c
        ended = [r for r, (_, give_up, to) in self.transfers.items()
                 if (now is None or give_up <= now) and (run is None or to == run)]
        for r in ended:
            msg = self.pop_transfer(r)
            assert msg is not None
            c.stats.lost_transfers += 1
            self.deliver(m.Done(msg.req, msg.event, code, why))
