"""The connection to the local kvd: a DEALER socket owned by one I/O thread.

Callers on any thread hand messages to the I/O thread (a queue plus an eventfd wake-up)
and wait on a future with a deadline. The I/O thread sends, receives, routes replies by
request id, delivers pushed Done events, pings the daemon, and re-runs the handshake
(Hello, then the saved Register) whenever the daemon restarts. While the daemon is
unreachable the connection is *down*: every call fails at once with ``Unavailable``
(a circuit breaker) instead of waiting, so an engine built on it never stalls.

A Transfer ends exactly once, and never while the daemon might still copy: each carries
a deadline (``transfer_timeout`` from now, on CLOCK_MONOTONIC) after which the daemon
starts no copy for it. Its Done comes from the daemon; without one, the connection
reports it failed only when the daemon's process is gone (a pidfd, where the daemon is
in our PID namespace) or once deadline + ``EXPIRY_GRACE_NS`` passed. A connection lost
while the daemon lives (a long pause) keeps its Transfers until then, across the
reconnect.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import msgspec
import zmq

from kvd_client.errors import RemoteError, Timeout, Unavailable
from kvd_client.process import allow_ptrace, leave_compute_cpus
from kvd_proto import messages as m

log = logging.getLogger("kvd_client")
GRACE_S = m.EXPIRY_GRACE_NS / 1e9


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


class Connection:
    def __init__(
        self,
        socket_path: str,
        *,
        name: str = "",
        timeout: float = 5.0,
        ping_interval: float = 1.0,
        transfer_timeout: float = 60.0,
        on_done: Callable[[m.Done], None] | None = None,
        on_ready: Callable[[m.Registered | None], None] | None = None,
        register: m.Register | None = None,
        on_event_waited: Callable[[m.EventWaited], None] | None = None,
    ) -> None:
        self.endpoint = f"ipc://{socket_path}"
        self.name = name
        self.timeout = timeout
        self.ping_interval = ping_interval
        self.transfer_timeout = transfer_timeout
        self.on_done = on_done
        self.on_ready = on_ready
        self.on_event_waited = on_event_waited
        self.stats = ClientStats()
        self.daemon_pid = 0
        self.instance = ""
        # Registrations so far: a new one is a new socket identity, so leases taken by an
        # earlier one may be gone (the daemon drops a silent identity's leases).
        self.epoch = 0
        self.registered: m.Registered | None = None
        self._register: m.Register | None = register
        self._req = itertools.count(1)
        # (message, its future for a call, the daemon run a Transfer's slots belong to)
        self._outbox: queue.SimpleQueue[tuple[m.Request, Future | None, str]] = \
            queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._up = threading.Event()
        self._handshaking = False  # a daemon took the Hello; the answer is on its way
        self._closed = False
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvd-client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    @property
    def up(self) -> bool:
        """True while the handshake (and registration, if any) is complete."""
        return self._up.is_set()

    @property
    def handshaking(self) -> bool:
        """True while a daemon is behind the socket and the handshake is under way: being
        up is a matter of milliseconds, unlike a daemon that is not there."""
        return self._handshaking

    def next_req(self) -> int:
        return next(self._req)

    def wait_up(self, timeout: float) -> bool:
        return self._up.wait(timeout)

    def register(self, msg: m.Register, timeout: float | None = None) -> m.Registered:
        """Join a tenant; replayed by itself after every reconnect."""
        self._register = msg
        if self._up.is_set() and self.registered is None:
            reply = self.request(msgspec.structs.replace(msg, req=self.next_req()), timeout)
            assert isinstance(reply, m.Registered)
            self.registered = reply
            return reply
        if not self._up.wait(self.timeout if timeout is None else timeout):
            raise Unavailable(f"kvd at {self.endpoint} did not accept the registration")
        assert self.registered is not None
        return self.registered

    def submit(self, msg: m.Request) -> Future:
        """Send now; the future gets the reply (or Unavailable / Timeout / RemoteError)."""
        fut: Future = Future()
        if not self._up.is_set():
            self.stats.unavailable += 1
            fut.set_exception(Unavailable(f"kvd at {self.endpoint} is not connected"))
            return fut
        self._outbox.put((msg, fut, ""))
        self._wakeup()
        return fut

    def request(self, msg: m.Request, timeout: float | None = None) -> m.Reply:
        fut = self.submit(msg)
        try:
            return fut.result(self.timeout if timeout is None else timeout)
        except FutureTimeout:
            self.stats.timeouts += 1
            fut.cancel()
            raise Timeout(f"kvd did not answer {type(msg).__name__} in time") from None

    def send(self, msg: m.Transfer, instance: str = "") -> bool:
        """Queue a Transfer; its one Done reaches ``on_done`` (see the module docstring
        for when the connection itself ends it). Stamps the deadline unless the caller
        set one. False when the connection is down: nothing was sent. With
        ``instance``, the daemon run its slots belong to: connected to another run by
        the time it goes out, it ends unsent (CLIENT_GONE)."""
        if self._closed or not self._up.is_set():
            self.stats.unavailable += 1
            return False
        if not msg.deadline_ns:
            deadline = time.monotonic_ns() + int(self.transfer_timeout * 1e9)
            msg = msgspec.structs.replace(msg, deadline_ns=deadline)
        self._outbox.put((msg, None, instance))
        self._wakeup()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup()
        self._thread.join(timeout=5)
        # A send() that raced with close() may have queued after the I/O thread's last
        # look: its Transfer (or call) still ends exactly once, here.
        while True:
            try:
                msg, fut, _ = self._outbox.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(Unavailable("kvd connection closed"))
            elif isinstance(msg, m.Transfer) and self.on_done is not None:
                self.on_done(m.Done(msg.req, msg.event, m.Code.CLIENT_GONE, "connection closed"))
        os.close(self._wake)
        self._ctx.term()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wakeup(self) -> None:
        try:
            os.eventfd_write(self._wake, 1)
        except OSError:
            pass  # closed

    # ------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        leave_compute_cpus()  # first: zmq's own threads, started below, inherit it
        io = _IO(self)
        try:
            io.loop()
        except Exception:  # noqa: BLE001 - the thread must not die silently
            log.exception("kvd client I/O thread failed")
        finally:
            io.shutdown()


class _IO:
    """State owned by the I/O thread only."""

    def __init__(self, conn: Connection) -> None:
        self.c = conn
        self.sock: zmq.Socket | None = None
        self.pending: dict[int, tuple[Future | None, float, str]] = {}
        # req -> (Transfer, give-up time on time.monotonic()): kept across a reconnect
        self.transfers: dict[int, tuple[m.Transfer, float]] = {}
        self.poller: zmq.Poller | None = None
        self.daemon_fd = -1  # pidfd of the daemon, where it is in our PID namespace
        self.phase = "down"  # down -> hello -> register -> up
        self.handshake_req = 0
        self.next_attempt = 0.0
        self.backoff = 0.05
        self.last_rx = time.monotonic()
        self.ping_req = 0
        self.ping_sent = 0.0
        self.hello_sent = False
        self.hello_poll = 10  # twice the next wait for the Hello to go out, in ms
        self.greeted = False  # the daemon answered this socket's Hello

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        c = self.c
        poller = self.poller = zmq.Poller()
        poller.register(c._wake, zmq.POLLIN)
        while not c._closed:
            now = time.monotonic()
            if self.phase == "down" and now >= self.next_attempt:
                self.connect(poller)
            events = dict(poller.poll(self.poll_ms(now)))
            c.stats.wakeups += 1
            if c._wake in events:
                try:
                    os.eventfd_read(c._wake)
                except BlockingIOError:
                    pass
            self.flush_outbox()
            if self.sock is not None:
                while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self.receive(self.sock.recv(zmq.NOBLOCK))
            # After the socket: the daemon's last Dones may have come with its exit.
            if self.daemon_fd >= 0 and self.daemon_fd in events:
                self.daemon_exited()
            self.timers(time.monotonic())

    def poll_ms(self, now: float) -> int:
        ms = self.phase_poll_ms(now)
        if self.transfers:  # wake up when the first of them may be given up
            give_up = min(g for _, g in self.transfers.values())
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
            poller.unregister(self.sock)
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
        sock.connect(c.endpoint)
        poller.register(sock, zmq.POLLIN)
        self.sock = sock
        self.phase = "hello"
        self.handshake_req = c.next_req()
        self.last_rx = time.monotonic()
        self.hello_sent = False
        self.hello_poll = 10
        self.send_hello()

    def send_hello(self) -> None:
        # With IMMEDIATE the send fails until the pipe exists: retried from the loop.
        self.hello_sent = self.raw_send(
            m.Hello(self.handshake_req, m.PROTOCOL_VERSION, os.getpid(), self.c.name))
        self.c._handshaking = self.hello_sent

    def raw_send(self, msg: m.Request) -> bool:
        try:
            assert self.sock is not None
            self.sock.send(m.encode(msg), zmq.NOBLOCK)
            self.c.stats.sent += 1
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def flush_outbox(self, transfers: bool = True) -> None:
        """Send what callers queued; without ``transfers`` (closing), a Transfer is
        ended unsent instead: nobody would be left to take its Done."""
        c = self.c
        while True:
            try:
                msg, fut, instance = c._outbox.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            if instance and instance != c.instance:  # slots of an earlier daemon run
                self.fail_one(msg, fut, Unavailable("kvd restarted: the slots are gone"))
                continue
            if (self.phase != "up" or (not transfers and isinstance(msg, m.Transfer))
                    or not self.raw_send(msg)):
                self.fail_one(msg, fut, Unavailable("kvd connection lost"))
                continue
            now = time.monotonic()
            if isinstance(msg, m.Transfer):
                self.transfers[msg.req] = (msg, msg.deadline_ns / 1e9 + GRACE_S)
            else:
                self.pending[msg.req] = (fut, now + c.timeout * 2, type(msg).__name__)

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
            # (A newer daemon's reply, say.) A call it answered fails now rather than at
            # its timeout; a Transfer is left to its Done or deadline (the daemon may
            # still be copying it).
            log.warning("undecodable reply from kvd: %s", e)
            tag, req = m.peek(data)
            entry = self.pending.pop(req, None)
            if entry is not None and entry[0] is not None:
                entry[0].set_exception(RemoteError(m.Code.INTERNAL, f"undecodable reply: {e}"))
            elif req in self.transfers and tag == "done":  # copying is over
                msg, _ = self.transfers.pop(req)
                self.deliver(m.Done(req, msg.event, m.Code.INTERNAL, f"undecodable Done: {e}"))
            return
        if isinstance(reply, m.Done):
            entry = self.transfers.pop(reply.req, None)
            if entry is not None:  # its event is ours, whatever the reply says
                self.deliver(msgspec.structs.replace(reply, event=entry[0].event))
            return
        if isinstance(reply, m.EventWaited):  # the store may now reuse its CUDA event
            if c.on_event_waited is not None:
                try:
                    c.on_event_waited(reply)
                except Exception:  # noqa: BLE001
                    log.exception("on_event_waited callback failed")
            return
        if reply.req in self.transfers:  # an error about a Transfer still ends it
            msg, _ = self.transfers.pop(reply.req)
            code = reply.code if isinstance(reply, m.Error) else m.Code.INTERNAL
            text = reply.message if isinstance(reply, m.Error) else "unexpected reply"
            self.deliver(m.Done(msg.req, msg.event, code, text))
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
            log.warning("kvd refused the handshake: %s", reply.message)
            self.lost(f"refused: {reply.message}", quiet=True)
            self.next_attempt = time.monotonic() + 5.0  # a refusal will not fix itself fast
            return
        if isinstance(reply, m.HelloOk):
            self.greeted = True
            if c.instance and c.instance != reply.instance:
                c.stats.reconnects += 1
            c.instance, c.daemon_pid = reply.instance, reply.daemon_pid
            allow_ptrace(reply.daemon_pid)
            self.watch_daemon(reply)
            if c._register is None:
                return self.ready(None)
            self.phase = "register"
            self.handshake_req = c.next_req()
            reg = msgspec.structs.replace(c._register, req=self.handshake_req)
            self.raw_send(reg)
        elif isinstance(reply, m.Registered):
            self.ready(reply)

    def ready(self, reg: m.Registered | None) -> None:
        c = self.c
        self.phase = "up"
        self.backoff = 0.05
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

    def end_transfers(self, code: m.Code, why: str, now: float | None = None) -> None:
        """Fail the Transfers nobody will answer: all of them, or (with ``now``) those
        past their give-up time, when the daemon no longer copies them."""
        c = self.c
        ended = [r for r, (_, give_up) in self.transfers.items()
                 if now is None or give_up <= now]
        for r in ended:
            msg, _ = self.transfers.pop(r)
            c.stats.lost_transfers += 1
            self.deliver(m.Done(msg.req, msg.event, code, why))

    def watch_daemon(self, hello: m.HelloOk) -> None:
        """Learn at once when the daemon's process ends (it can copy nothing more then).
        Only where its pid means the same process to us: same PID namespace, which the
        daemon tells by echoing our pid as it sees it."""
        self.unwatch_daemon()
        if hello.peer_pid != os.getpid() or hello.daemon_pid <= 0 or self.poller is None:
            return  # another namespace (or an older daemon): deadlines alone decide
        try:
            self.daemon_fd = os.pidfd_open(hello.daemon_pid)
        except OSError:
            return
        self.poller.register(self.daemon_fd, zmq.POLLIN)

    def unwatch_daemon(self) -> None:
        if self.daemon_fd >= 0:
            if self.poller is not None:
                self.poller.unregister(self.daemon_fd)
            os.close(self.daemon_fd)
            self.daemon_fd = -1

    def daemon_exited(self) -> None:
        self.unwatch_daemon()
        self.end_transfers(m.Code.CLIENT_GONE, "kvd exited")
        if self.phase != "down":
            self.lost("kvd exited")

    def timers(self, now: float) -> None:
        c = self.c
        if self.transfers:
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
        expired = [r for r, (_, dl, _) in self.pending.items() if dl <= now]
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
        self.lost("connection closed", quiet=True)
        self.flush_outbox()  # anything left: ended here (the connection is down now)
        # Closing means this process stops using kvd (an engine shutting down): what is
        # still in flight is reported to the caller, whose memory goes away with it.
        self.end_transfers(m.Code.CLIENT_GONE, "connection closed")
        self.unwatch_daemon()
        if self.sock is not None:
            self.sock.close(linger=linger)
