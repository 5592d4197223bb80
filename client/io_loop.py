"""The I/O thread of a ``Connection`` and the state it shares with its callers.

``IOLoop`` runs the socket: it sends what callers queued, receives, routes replies by
request id, delivers pushed Done events (callbacks run on this thread only), pings the
daemon, and re-runs the handshake (Hello, then the saved Register) whenever the daemon
restarts. It polls the socket's FD, not the socket, so that a caller may use the socket
meanwhile under ``Shared._lock``; the FD is edge-triggered, so whoever touched the
socket last checks it for input before anyone sleeps. While callers receive their own
replies (``await_reply``) the thread stops watching the socket and looks every
``RECEIVE_WINDOW_S``: waking on each reply would only compete with the caller.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from kvd_client.errors import KvdClientError, RemoteError, Timeout, Unavailable
from kvd_client.process import allow_ptrace
from kvd_proto import messages as m

log = logging.getLogger("kvd_client")
GRACE_S = m.EXPIRY_GRACE_NS / 1e9
# How long a caller waiting for its reply may keep the socket (and the I/O thread) to
# itself: a reply within it needs no thread hand-off; a slower one comes the usual way.
RECEIVE_WINDOW_S = 0.002
# When the daemon's process ends, its last Dones may still be inside ZeroMQ's threads:
# this long for them, so a Transfer it ended is not reported CLIENT_GONE instead.
EXIT_GRACE_S = 0.05
# How long closing waits for the Dones of Transfers in flight (the daemon, told Bye, ends
# them at once); past it, a paused daemon's are reported CLIENT_GONE unconfirmed.
CLOSE_WAIT_S = 2.0
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # not enums
# Messages sent from the outbox, and received, per wake-up: callers sending without pause
# (or a flood of Dones) must not keep the thread from the other and from firing timeouts
# (Connection bounds the outbox at MAX_QUEUED and refuses beyond it).
FLUSH_BUDGET = 1000
MAX_QUEUED = 2 * FLUSH_BUDGET
# While messages keep coming (more than a wake-up reads), deadlines are still checked
# this often: a flood must not keep a Transfer past its deadline (an engine's step waits).
FLOOD_EXPIRY_S = 0.1
# An undecodable message is logged once per this long (a flood of them wrote 40,000
# lines a second to the engine's stderr); the others are counted.
WARN_EVERY_S = 10.0
MAX_PID = 1 << 22  # Linux's pid_max at most: a larger pid in a HelloOk is not a process
CLOCK_SLACK_NS = 50_000_000  # a HelloOk's clock may read this far outside the round trip


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


class IOLoop:
    """The I/O thread's state (and, under the lock, a sending caller's)."""

    def __init__(self, conn: Shared) -> None:
        self.c = conn
        self.sock: zmq.Socket | None = None
        self.pending: dict[int, tuple[Future | None, float, str]] = {}
        # req -> (Transfer, give-up time on time.monotonic(), the daemon run it went to):
        # kept across a reconnect, since the run it went to may still copy it
        self.transfers: dict[int, tuple[m.Transfer, float, str]] = {}
        self.in_flight: Counter[str] = Counter()  # daemon run -> its Transfers here
        self.poller: zmq.Poller | None = None
        self.sock_fd = -1  # the socket's (edge-triggered) FD, which the thread polls
        self.inbox: list[bytes] = []  # received on a caller's thread, for this one
        self.watched_fd = -1
        self.callers_until = 0.0  # until then, callers receive: the thread need not watch
        self.expire_by = 0.0  # deadlines are checked by then, even in a flood
        self.undecodable = 0  # messages that could not be read, since the last warning
        self.warned_at = -WARN_EVERY_S
        # pidfd -> daemon run, where it is in our PID namespace: the current run, and an
        # earlier one while Transfers sent to it are not over (it may still copy them)
        self.daemons: dict[int, str] = {}
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

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        c = self.c
        poller = self.poller = zmq.Poller()
        poller.register(c._wake, zmq.POLLIN)
        while not c._closed:
            try:
                self.step(poller)
            except Exception as e:  # noqa: BLE001 - never leave the engine without kvd for good
                # A bug or a reply nothing foresaw: this connection is dropped and made
                # again, like a lost one; the thread goes on (logged whole once per
                # kind of failure: a lasting one must not flood the engine's log).
                why = f"client error: {e!r}"
                if why != self.why_down:
                    log.exception("kvd client I/O step failed; reconnecting")
                with c._lock:
                    self.lost(why)
                time.sleep(0.05)  # one that recurs must not spin on the engine's CPU

    def step(self, poller: zmq.Poller) -> None:
        """One wait for news, and the work it brings."""
        c = self.c
        with c._lock:
            now = time.monotonic()
            if self.phase == "down" and now >= self.next_attempt:
                self.connect(poller)
            # While callers receive their own replies, waking up on each of them
            # would only compete with the caller: look every RECEIVE_WINDOW_S.
            quiet = now < self.callers_until
            self.watch(-1 if quiet or self.sock is None else self.sock_fd)
            # The last look at the socket before sleeping: its FD only signals news.
            ms = 0 if self.readable() or not c._outbox.empty() else self.poll_ms(now)
            if quiet:
                ms = min(ms, int((self.callers_until - now) * 1000) + 1)
        events = dict(poller.poll(ms))
        c.stats.wakeups += 1
        with c._lock:
            if c._wake in events:
                try:
                    os.eventfd_read(c._wake)
                except BlockingIOError:
                    pass
            self.flush_outbox(budget=FLUSH_BUDGET)
            more = self.drain(budget=FLUSH_BUDGET)
            # After the socket: the daemon's last Dones may have come with its exit.
            for fd in [fd for fd in self.daemons if fd in events]:
                self.daemon_exited(fd)
            # Nothing expires while replies wait unread (its own may be among them),
            # unless they keep coming: then every FLOOD_EXPIRY_S all the same.
            now = time.monotonic()
            expire = not more or now >= self.expire_by
            if expire:
                self.expire_by = now + FLOOD_EXPIRY_S
            self.timers(now, expire=expire)

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

    def await_reply(self, fut: Future, wait: float) -> None:
        """On a caller's thread, holding the lock: receive until ``fut`` has its reply,
        ``wait`` passed, or a message comes that is not a plain reply to a call (a Done,
        an error, the handshake's or a ping's answer): that one is left in the inbox for
        the I/O thread, which handles the rest, so callbacks never run on a caller's
        thread."""
        sock = self.sock
        assert sock is not None
        end = time.monotonic() + wait
        self.callers_until = end
        while not fut.done() and time.monotonic() < end:
            try:
                data = sock.recv()  # blocks for RECEIVE_WINDOW_S at most (RCVTIMEO)
            except zmq.ZMQError:  # (Again: nothing in the window) the I/O thread goes on
                return
            self.last_rx = time.monotonic()
            if not self.answer(data):
                self.inbox.append(data)
                return

    def answer(self, data: bytes) -> bool:
        """Settle the call that ``data`` answers, if that is all it does."""
        try:
            reply = m.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        req = reply.req
        if (isinstance(reply, (m.Error, m.Done, m.EventWaited)) or req in self.transfers
                or req == self.handshake_req or req == self.ping_req):
            return False
        entry = self.pending.pop(req, None)
        if entry is not None and entry[0] is not None:
            entry[0].set_result(reply)
        return True  # (or a late answer to a call that timed out: dropped, as receive does)

    def drain(self, budget: int | None = None) -> bool:
        """Handle what came (``budget``: at most that many messages from the socket
        now; the loop comes back at once for the rest). True: some may be left."""
        inbox, self.inbox = self.inbox, []
        for data in inbox:
            self.receive(data)
        for _ in itertools.repeat(None) if budget is None else range(budget):
            if not self.readable():
                return False
            assert self.sock is not None
            self.receive(self.sock.recv(_NOBLOCK))
        return True

    def poll_ms(self, now: float) -> int:
        ms = self.phase_poll_ms(now)
        if self.transfers:  # wake up when the first of them may be given up
            give_up = min(g for _, g, _ in self.transfers.values())
            ms = min(ms, max(1, int((give_up - now) * 1000) + 1))
        return ms

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

    def flush_outbox(self, transfers: bool = True, budget: int | None = None) -> None:
        """Send what callers queued (``budget``: at most that many now); without
        ``transfers`` (closing), a Transfer is ended unsent instead: nobody would be
        left to take its Done."""
        c = self.c
        for _ in itertools.repeat(None) if budget is None else range(budget):
            try:
                msg, fut, instance = c._outbox.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            if instance and instance != c.instance:  # slots of an earlier daemon run
                self.fail_one(msg, fut, Unavailable("kvd restarted: the slots are gone"))
                continue
            if self.phase != "up" or (not transfers and isinstance(msg, m.Transfer)):
                self.fail_one(msg, fut, Unavailable("kvd connection lost"))
                continue
            if self.in_flight_req(msg.req):  # its reply would end the other one
                self.fail_one(msg, fut, KvdClientError(
                    f"request id {msg.req} is in flight already: use next_req()"))
                continue
            try:
                sent = self.raw_send(msg)
            except Exception as e:  # noqa: BLE001 - one message that cannot be encoded
                self.fail_one(msg, fut, Unavailable(f"cannot send {type(msg).__name__}: {e!r}"))
                continue
            if not sent:  # up, but 1,000 messages wait for the daemon
                self.fail_one(msg, fut, Unavailable("kvd is not keeping up: the socket's "
                                                    "queue to it is full"))
                continue
            self.track(msg, fut)

    def in_flight_req(self, req: int) -> bool:
        return req in self.transfers or req in self.pending

    def track(self, msg: m.Request, fut: Future | None) -> None:
        """A message went out: wait for its reply (a call) or its Done (a Transfer)."""
        if isinstance(msg, m.Transfer):
            self.transfers[msg.req] = (msg, msg.deadline_ns / 1e9 + GRACE_S, self.c.instance)
            self.in_flight[self.c.instance] += 1
        else:
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

    def receive(self, data: bytes) -> None:
        c = self.c
        self.last_rx = time.monotonic()
        try:
            reply = m.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # (A newer daemon's reply, say: a Code this client does not know.) What it
            # answers ends now rather than at its timeout: a call, a Transfer it ended (a
            # Done; an Error, which refuses one it did not take), the ping, the
            # handshake (a refusal). Another reply to a Transfer is left to its Done or
            # deadline (the daemon may still be copying it).
            self.undecodable += 1
            if time.monotonic() - self.warned_at >= WARN_EVERY_S:
                log.warning("undecodable reply from kvd: %s (%d such since the last "
                            "warning)", e, self.undecodable)
                self.warned_at, self.undecodable = time.monotonic(), 0
            tag, req = m.peek(data)
            entry = self.pending.pop(req, None)
            if entry is not None and entry[0] is not None:
                entry[0].set_exception(RemoteError(m.Code.INTERNAL, f"undecodable reply: {e}"))
            elif req in self.transfers and tag in ("done", "error"):  # copying is over
                msg = self.pop_transfer(req)
                self.deliver(m.Done(req, msg.event, m.Code.INTERNAL,
                                    f"undecodable {tag}: {e}"))
            elif req and req == self.ping_req:
                self.ping_req = 0
            elif req and req == self.handshake_req and self.phase in ("hello", "register"):
                self.handshake(m.Error(req, m.Code.INTERNAL, f"undecodable reply: {e}"))
            return
        if isinstance(reply, m.Done):
            msg = self.pop_transfer(reply.req)
            if msg is not None:  # its event is ours, whatever the reply says
                self.deliver(msgspec.structs.replace(reply, event=msg.event))
            return
        if isinstance(reply, m.EventWaited):  # the store may now reuse its CUDA event
            if c.on_event_waited is not None:
                try:
                    c.on_event_waited(reply)
                except Exception:  # noqa: BLE001
                    log.exception("on_event_waited callback failed")
            return
        if reply.req in self.transfers:  # an error about a Transfer still ends it
            msg = self.pop_transfer(reply.req)
            code = reply.code if isinstance(reply, m.Error) else m.Code.INTERNAL
            text = reply.message if isinstance(reply, m.Error) else "unexpected reply"
            self.deliver(m.Done(msg.req, msg.event, code, text))
            if code == m.Code.NOT_REGISTERED and self.phase == "up":  # the daemon dropped
                # this connection (it thought us silent): register again, or every
                # Transfer fails like this (once: the next refusals need no new try)
                self.lost("kvd forgot this client")
            return
        if reply.req == self.handshake_req and self.phase in ("hello", "register"):
            self.handshake(reply)
            return
        if reply.req == self.ping_req:
            self.ping_req = 0
            if isinstance(reply, m.Error) and reply.code == m.Code.NOT_REGISTERED:
                self.lost("kvd restarted")
            return
        entry = self.pending.pop(reply.req, None)
        if entry is None:
            return  # a late answer to a call that timed out
        fut = entry[0]
        if isinstance(reply, m.Error):
            c.stats.remote_errors += 1
            if reply.code == m.Code.NOT_REGISTERED:
                self.lost("kvd forgot this client (restarted)")
            if fut is not None:
                fut.set_exception(RemoteError(reply.code, reply.message))
        elif fut is not None:
            fut.set_result(reply)

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
            self.watch_daemon(reply)
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
        for fut, _, _ in self.pending.values():
            if fut is not None and not fut.done():
                fut.set_exception(Unavailable(f"kvd connection lost: {why}"))
        self.pending.clear()
        # Transfers stay: the daemon may still copy them until their deadline.

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
                self.unwatch_daemons(lambda r: r == run)
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

    def watch_daemon(self, hello: m.HelloOk) -> None:
        """Learn at once when the daemon's process ends (it can copy nothing more then).
        Only where its pid means the same process to us: same PID namespace, which the
        daemon tells by echoing our pid as it sees it. An earlier run stays watched while
        Transfers sent to it are not over: only its own exit (or their deadlines) ends
        them, never the exit of the run that replaced it."""
        self.unwatch_daemons(lambda r: r != hello.instance and r not in self.in_flight)
        if hello.instance in self.daemons.values():
            return  # the same run again (the connection was lost, not the daemon)
        if hello.peer_pid != os.getpid() or hello.daemon_pid <= 0 or self.poller is None:
            return  # another namespace (or an older daemon): deadlines alone decide
        try:
            fd = os.pidfd_open(hello.daemon_pid)
        except OSError:
            return
        self.poller.register(fd, zmq.POLLIN)
        self.daemons[fd] = hello.instance

    def unwatch_daemons(self, which: Callable[[str], bool] = lambda run: True) -> None:
        for fd in [fd for fd, run in self.daemons.items() if which(run)]:
            del self.daemons[fd]
            if self.poller is not None:
                self.poller.unregister(fd)
            os.close(fd)

    def daemon_exited(self, fd: int) -> None:
        run = self.daemons.get(fd)
        if run is None:  # no longer watched (its last Transfer ended meanwhile)
            return
        self.unwatch_daemons(lambda r: r == run)
        if run != self.c.instance:  # an earlier run: what it was sent is over now
            self.end_transfers(m.Code.CLIENT_GONE, "an earlier kvd run exited", run=run)
            return
        end = time.monotonic() + EXIT_GRACE_S
        while self.in_flight[run] and self.sock is not None and time.monotonic() < end:
            if self.sock.poll(5):
                self.drain()  # (what a gone daemon sent is finite: all of its Dones)
        self.end_transfers(m.Code.CLIENT_GONE, "kvd exited", run=run)
        if self.phase != "down":
            self.lost("kvd exited")

    def timers(self, now: float, expire: bool = True) -> None:
        """Retries, pings, and (with ``expire``) calls and Transfers past their time."""
        c = self.c
        if self.transfers and expire:
            self.end_transfers(m.Code.EXPIRED, "no Done from kvd by the transfer's deadline "
                               "plus grace; kvd copies nothing for it any more", now)
        if self.phase in ("hello", "register"):
            if self.phase == "hello" and not self.hello_sent:
                self.send_hello()
            if now - self.last_rx > c.timeout:
                self.lost("handshake timed out", quiet=True)
            return
        if self.phase != "up":
            return
        expired = [r for r, (_, dl, _) in self.pending.items() if dl <= now] if expire else []
        for r in expired:
            fut, _, what = self.pending.pop(r)
            if fut is not None and not fut.done():
                fut.set_exception(Timeout(f"kvd did not answer {what}"))
        idle = now - self.last_rx
        if idle > c.ping_interval and self.ping_req == 0:
            self.ping_req = c.next_req()
            self.raw_send(m.Ping(self.ping_req))
            self.ping_sent = now
        elif self.ping_req and now - self.ping_sent > max(c.timeout, 2 * c.ping_interval):
            self.ping_req = 0
            self.lost("kvd stopped answering")

    def shutdown(self) -> None:
        linger = 0
        if self.phase == "up":
            # What close() found queued (a Release, an Abort) goes out; a Transfer does
            # not (its Done would come to nobody while the daemon copied). Bye: the
            # daemon lets go of what this client held (and its copies) at once.
            self.flush_outbox(transfers=False)
            self.raw_send(m.Bye(0))
            linger = 100  # ms for zmq to write it; never an unbounded wait
            # Told Bye, the daemon starts no copy for us and stops those under way at
            # their next chunk: their Dones come at once, unless it is paused.
            end = time.monotonic() + CLOSE_WAIT_S
            while self.transfers and self.sock is not None and time.monotonic() < end:
                if self.sock.poll(5):
                    self.drain(budget=FLUSH_BUDGET)  # (bounded: the wait's end is checked)
        self.lost("connection closed", quiet=True)
        self.flush_outbox()  # anything left: ended here (the connection is down now)
        # Closing means this process stops using kvd (an engine shutting down): what is
        # still in flight is reported to the caller, whose memory goes away with it.
        self.end_transfers(m.Code.CLIENT_GONE, "connection closed")
        self.unwatch_daemons()
        if self.sock is not None:
            self.sock.close(linger=linger)
