"""The I/O thread's socket to the daemon, and the state of the connection over it.

A connection is *down*, then says Hello, checks the daemon's HelloOk (the protocol
version, a pid that names a process, a clock that is ours), sends the saved Register,
and is *up*; losing it fails the calls waiting for a reply and tries again after a
backoff. This module holds that lifecycle (``Link``: the socket, the handshake's phase
and its checks, the pings' state, why it last went down); the loop that drives it, and
routes what the socket receives, is ``IOLoop``'s.
"""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from kvd_client.bookkeeping import Bookkeeping
from kvd_client.daemon_watch import DaemonWatch
from kvd_client.errors import Unavailable
from kvd_client.process import allow_ptrace
from kvd_client.shared import RECEIVE_WINDOW_S, Shared, log
from kvd_proto import messages as m

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # not enums
MAX_PID = 1 << 22  # Linux's pid_max at most: a larger pid in a HelloOk is not a process
CLOCK_SLACK_NS = 50_000_000  # a HelloOk's clock may read this far outside the round trip


class Link:
    """The socket and the connection's phase (used under the connection's ``_lock``)."""

    def __init__(self, conn: Shared, book: Bookkeeping, watcher: DaemonWatch) -> None:
        self.c = conn
        self.book = book
        self.watcher = watcher
        self.sock: zmq.Socket | None = None
        self.poller: zmq.Poller | None = None  # the I/O thread's, once its loop runs
        self.sock_fd = -1  # the socket's (edge-triggered) FD, which the thread polls
        self.watched_fd = -1
        self.phase = "down"  # down -> hello -> register -> up
        self.handshake_req = 0
        self.next_attempt = 0.0
        self.backoff = 0.05
        self.last_rx = time.monotonic()
        self.ping_req = 0
        self.ping_sent = 0.0
        self.hello_sent = False
        self.hello_sent_ns = 0  # CLOCK_MONOTONIC when it went out (the HelloOk's must match)
        self.hello_poll = 10  # twice the next wait for the Hello to go out, in ms
        self.greeted = False  # the daemon answered this socket's Hello
        self.why_down = ""  # why the last connection ended or could not be made

    def watch(self, fd: int) -> None:
        """Poll ``fd`` (the socket's FD; -1: none) from now on."""
        if fd != self.watched_fd:
            if self.watched_fd >= 0 and self.poller is not None:
                self.poller.unregister(self.watched_fd)
            if fd >= 0 and self.poller is not None:
                self.poller.register(fd, zmq.POLLIN)
            self.watched_fd = fd

    def readable(self) -> bool:
        """A message waits (and the FD's edge is consumed: the caller acts on it)."""
        return self.sock is not None and bool(self.sock.getsockopt(_EVENTS) & _POLLIN)

    def phase_poll_ms(self, now: float) -> int:
        if self.phase == "down":
            return max(1, int((self.next_attempt - now) * 1000))
        if self.phase == "hello" and not self.hello_sent:
            # No daemon behind the socket yet: retry the Hello at 5 ms, backing off to
            # 100 ms, so an engine whose daemon is down is not woken 200 times a second.
            self.hello_poll = min(self.hello_poll * 2, 200)
            return self.hello_poll // 2
        return 100

    def connect(self, poller: zmq.Poller) -> None:
        c = self.c
        if self.sock is not None:
            self.watch(-1)
            # Given up as lost, the daemon may only have been slow (paused): told Bye,
            # it lets go of the old connection's leases now, not at client_timeout_ms.
            said = self.greeted and self.raw_send(m.Bye(0))
            self.sock.close(linger=100 if said else 0)  # zmq writes it in the background
        self.greeted = False
        sock = c._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # Only a caller's receive window blocks in recv (the I/O thread never does).
        sock.setsockopt(zmq.RCVTIMEO, int(RECEIVE_WINDOW_S * 1000))
        # A larger message is no kvd's: ZeroMQ drops the connection instead of holding
        # it (a 256 MiB reply took 600 MiB of the engine's memory).
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        try:
            sock.connect(c.endpoint)
        except zmq.ZMQError as e:  # (a path too long for a socket, say): stays down
            sock.close(linger=0)
            self.sock = None
            why = f"cannot connect to {c.endpoint}: {e}"
            if why != self.why_down:
                log.error("kvd: %s; serving without kvd", why)
            self.lost(why, quiet=True)
            return
        self.sock_fd = sock.getsockopt(zmq.FD)
        self.watch(self.sock_fd)
        self.sock = sock
        self.phase = "hello"
        self.handshake_req = c.next_req()
        self.last_rx = time.monotonic()
        self.hello_sent = False
        self.hello_poll = 10
        self.send_hello()

    def send_hello(self) -> None:
        # With IMMEDIATE the send fails until the pipe exists: retried from the loop.
        self.hello_sent_ns = time.monotonic_ns()
        self.hello_sent = self.raw_send(
            m.Hello(self.handshake_req, m.PROTOCOL_VERSION, os.getpid(), self.c.name))
        self.c._handshaking = self.hello_sent

    def raw_send(self, msg: m.Request) -> bool:
        try:
            assert self.sock is not None
            self.sock.send(m.encode(msg), _NOBLOCK)
            self.c.stats.sent += 1
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def handshake(self, reply: m.Reply) -> None:
        c = self.c
        if isinstance(reply, m.Error):
            return self.refused(f"refused: {reply.message}",
                                f"kvd refused the handshake: {reply.message}")
        if isinstance(reply, m.HelloOk):
            if reply.version != m.PROTOCOL_VERSION:  # (a daemon that takes older clients
                # but speaks another version: nothing it says can be trusted as read)
                why = f"kvd speaks protocol {reply.version}, this client {m.PROTOCOL_VERSION}"
                return self.refused(why, f"{why}: running without kvd")
            if not 0 <= reply.daemon_pid <= MAX_PID:  # (-1 would let anyone ptrace us)
                return self.refused(f"bad HelloOk (pid {reply.daemon_pid})",
                                    f"kvd's HelloOk names pid {reply.daemon_pid}, no process")
            if reply.monotonic_ns and not (self.hello_sent_ns - CLOCK_SLACK_NS
                                           <= reply.monotonic_ns
                                           <= time.monotonic_ns() + CLOCK_SLACK_NS):
                # Read between this Hello's send and now on one clock: it is another one.
                off = (reply.monotonic_ns - self.hello_sent_ns) / 1e9
                return self.refused("kvd's clock differs", (
                    f"kvd's CLOCK_MONOTONIC is about {off:+.0f} s off this process's "
                    "(another time namespace?): the deadlines of its transfers would "
                    "mean other times there; running without kvd"))
            self.greeted = True
            if c.instance and c.instance != reply.instance:
                c.stats.reconnects += 1
            c.instance, c.daemon_pid = reply.instance, reply.daemon_pid
            if reply.daemon_pid > 0:  # (0: an older daemon; PR_SET_PTRACER 0 clears it)
                allow_ptrace(reply.daemon_pid)
            self.watcher.watch_daemon(reply, self.book.in_flight)
            if c._register is None:
                return self.ready(None)
            self.phase = "register"
            self.handshake_req = c.next_req()
            reg = msgspec.structs.replace(c._register, req=self.handshake_req)
            self.raw_send(reg)
        elif isinstance(reply, m.Registered) and self.phase == "register":
            self.ready(reply)
        else:  # (a Registered for a Hello skipped the version and pid checks)
            name = type(reply).__name__
            self.refused(f"bad handshake ({name})", f"kvd answered the handshake with a "
                                                    f"{name}: running without kvd")

    def refused(self, why: str, warning: str) -> None:
        """A handshake that cannot go on: down for ``why``, said once per reason, tried
        again in 5 s (a refusal will not fix itself fast)."""
        if why != self.why_down:
            log.warning("%s", warning)
        self.lost(why, quiet=True)
        self.next_attempt = time.monotonic() + 5.0

    def ready(self, reg: m.Registered | None) -> None:
        c = self.c
        self.phase = "up"
        self.backoff = 0.05
        self.why_down = ""
        c.registered = reg
        c.epoch += 1
        c._handshaking = False
        c._up.set()
        log.info("connected to kvd (pid %d) at %s", c.daemon_pid, c.endpoint)
        if c.on_ready is not None:
            try:
                c.on_ready(reg)
            except Exception:  # noqa: BLE001
                log.exception("on_ready callback failed")

    def lost(self, why: str, quiet: bool = False) -> None:
        """Drop the connection: fail every waiting call and transfer, retry later."""
        c = self.c
        was_up = c._up.is_set()
        c._up.clear()
        c._handshaking = False
        self.phase = "down"
        self.why_down = why
        self.ping_req = 0  # its answer cannot come: not a second loss once back up
        self.next_attempt = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 2.0)
        if was_up and not quiet:
            log.warning("kvd connection lost (%s); serving without kvd until it is back", why)
        for fut, _, _ in self.book.pending.values():
            if fut is not None and not fut.done():
                fut.set_exception(Unavailable(f"kvd connection lost: {why}"))
        self.book.pending.clear()
        # Transfers stay: the daemon may still copy them until their deadline.
