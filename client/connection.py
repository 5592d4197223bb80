"""The connection to the local kvd: a DEALER socket run by one I/O thread.

The I/O thread (``io_loop.IOLoop``) receives replies and pushed Done events, pings the
daemon and re-runs the handshake after a restart. A caller on any thread sends its own
message while the I/O thread is idle (the socket's lock is free and nothing is queued
before it): no thread hand-off on the way out. Otherwise it queues the message for the
I/O thread (an eventfd wakes it), so a caller never waits for the lock. Replies come
back on a future; a synchronous ``request`` receives its own reply for up to
``RECEIVE_WINDOW_S``, so a round trip needs no hand-off at all. While the daemon is
unreachable the connection is *down*: every call fails at once with ``Unavailable``
(a circuit breaker) instead of waiting, so an engine built on it never stalls.

A Transfer ends exactly once, and never while the daemon might still copy: each carries
a deadline (``transfer_timeout`` from now, on CLOCK_MONOTONIC) after which the daemon
starts no copy for it. Its Done comes from the daemon; without one, the connection
reports it failed only when the daemon's process is gone (a pidfd, where the daemon is
in our PID namespace) or once deadline + ``EXPIRY_GRACE_NS`` passed. A connection lost
while the daemon lives (a long pause) keeps its Transfers until then, across the
reconnect. Closing is the one exception: ``close()`` tells the daemon Bye (it starts no
copy for this client and stops those under way) and waits up to ``CLOSE_WAIT_S`` for
their Dones; a paused daemon's are reported CLIENT_GONE then, unconfirmed, so a caller
whose memory outlives the connection waits for its Transfers' Dones before closing (as
the vLLM worker's shutdown does). The daemon stores nothing a departed client sent.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import zmq

from kvd_client.bookkeeping import Call
from kvd_client.errors import KvdClientError, Timeout, Unavailable
from kvd_client.io_loop import IOLoop
from kvd_client.process import leave_compute_cpus
from kvd_client.shared import MAX_QUEUED, RECEIVE_WINDOW_S, ClientStats, Shared, log
from kvd_proto import messages as m

__all__ = ["ClientStats", "Connection"]

_LIVE: weakref.WeakSet[Connection] = weakref.WeakSet()  # for a fork's child


class Connection(Shared):
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
        self.registered = None
        self._register = register
        self._req = itertools.count(1)
        self._outbox = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._up = threading.Event()
        self._handshaking = False  # a daemon took the Hello; the answer is on its way
        self._closed = False
        # Taken to queue a message, and by close() to end what is queued and close the
        # eventfd: a message queued after that would get no Done, and a wake-up written
        # to a closed fd number could land in a file the engine opened since.
        self._closing = threading.Lock()
        self._drained = False
        self._ctx = zmq.Context()
        self._lock = threading.RLock()
        self._io = IOLoop(self)
        self._thread = threading.Thread(target=self._run, name="kvd-client-io", daemon=True)
        self._thread.start()
        _LIVE.add(self)

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

    def wait_up(self, timeout: float) -> bool:
        """Whether the connection is up within ``timeout``; False at once once closed
        (or in a fork's child)."""
        return not self._closed and self._up.wait(timeout)

    def register(self, msg: m.Register, timeout: float | None = None) -> m.Registered:
        """Join a tenant; replayed by itself after every reconnect."""
        self._register = msg
        if self._up.is_set() and self.registered is None:
            reply = self.request(msgspec.structs.replace(msg, req=self.next_req()), timeout)
            assert isinstance(reply, m.Registered)
            self.registered = reply
            return reply
        if not self.wait_up(self.timeout if timeout is None else timeout):
            raise Unavailable(f"kvd at {self.endpoint} did not accept the registration")
        assert self.registered is not None
        return self.registered

    def submit(self, msg: m.Request, _wait: float = 0.0) -> Future:
        """Send now; the future gets the reply (or Unavailable / Timeout / RemoteError).
        (``_wait``: ``request``'s receive window.)"""
        fut: Future = Call()
        if isinstance(msg, m.Transfer):  # its Done goes to on_done, never to a future
            fut.set_exception(KvdClientError("a Transfer is sent with send(), not submit()"))
            return fut
        if not self._up.is_set():
            self.stats.unavailable += 1
            why = self._io.link.why_down
            fut.set_exception(Unavailable(f"kvd at {self.endpoint} is not connected"
                                          + (f" ({why})" if why else "")))
            return fut
        if not self._direct(msg, fut, "", _wait):
            if not self._queue((msg, fut, "")):
                fut.set_exception(Unavailable(
                    "kvd connection closed" if self._drained else
                    f"the kvd client is not keeping up: {MAX_QUEUED} messages queued"))
        return fut

    def request(self, msg: m.Request, timeout: float | None = None) -> m.Reply:
        """Send and wait for the reply; one that comes within ``RECEIVE_WINDOW_S`` is
        received on this thread (no hand-off to the I/O thread and back)."""
        limit = self.timeout if timeout is None else timeout
        fut = self.submit(msg, min(limit, RECEIVE_WINDOW_S))
        try:
            return fut.result(limit)
        except FutureTimeout:
            self.stats.timeouts += 1
            self.give_up(fut)
            raise Timeout(f"kvd did not answer {type(msg).__name__} in time") from None

    def give_up(self, fut: Future) -> None:
        """The caller stops waiting for a call of ``submit``'s: not sent yet, it is not
        sent; sent, a lease in its reply (in already, or when it comes) goes back."""
        if not fut.cancel():  # sent: a reply may still come, to nobody
            fut.add_done_callback(self._unclaimed)

    def _unclaimed(self, fut: Future) -> None:
        """A reply its caller gave up waiting for: a lease in it goes back (as the I/O
        thread gives back one that comes after the call's expiry), to the daemon run
        the call went to (connected to another by then, the Release is not sent: that
        run's lease ids mean other leases). The run is the one the call was sent to,
        not the one when ``request`` began: a reconnect may come in between."""
        if fut.cancelled() or fut.exception() is not None or not isinstance(fut, Call):
            return
        reply = fut.result()
        if isinstance(reply, m.LookupOk) and reply.lease and fut.run:  # (counted as sent)
            self._queue((m.Release(self.next_req(), reply.lease), None, fut.run))

    def send(self, msg: m.Transfer, instance: str = "") -> bool:
        """Queue a Transfer; its one Done reaches ``on_done`` (see the module docstring
        for when the connection itself ends it). Stamps the deadline unless the caller
        set one. False when the connection is down, or ``MAX_QUEUED`` messages wait for
        the I/O thread: nothing was sent. With
        ``instance``, the daemon run its slots belong to: connected to another run by
        the time it goes out, it ends unsent (CLIENT_GONE)."""
        if self._closed or not self._up.is_set():
            self.stats.unavailable += 1
            return False
        if not msg.deadline_ns:
            deadline = time.monotonic_ns() + int(self.transfer_timeout * 1e9)
            msg = msgspec.structs.replace(msg, deadline_ns=deadline)
        return self._direct(msg, None, instance) or self._queue((msg, None, instance))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup()
        self._thread.join(timeout=5)
        # A send() that raced with close() may have queued after the I/O thread's last
        # look: its Transfer (or call) still ends exactly once, here.
        with self._closing:
            self._drained = True
            while True:
                try:
                    msg, fut, _ = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if fut is not None:
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(Unavailable("kvd connection closed"))
                elif isinstance(msg, m.Transfer) and self.on_done is not None:
                    self.on_done(m.Done(msg.req, msg.event, m.Code.CLIENT_GONE,
                                        "connection closed"))
            os.close(self._wake)
        if self._thread.is_alive():  # stuck: term() would wait for its socket for ever
            log.warning("kvd client I/O thread did not stop; leaving its socket open")
            return
        self._ctx.term()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _direct(self, msg: m.Request, fut: Future | None, instance: str,
                wait: float = 0.0) -> bool:
        """Send on the caller's thread if that is possible at once: the I/O thread is
        not working, the connection is up, nothing queued must go first. False: the
        caller queues it (whatever fails is then reported by the I/O thread, never by
        a callback on the caller's thread). With ``wait``, receive the reply here too,
        for up to that long."""
        # A caller that will wait for its reply anyway may wait for the lock as long.
        # An exception from a signal handler (Ctrl-C) can land right after the acquire,
        # before ``locked`` is set: the lock is released by who holds it, not by
        # ``locked`` alone, or the I/O thread would wait for it for ever. (Handlers run
        # on the main thread only; ``held``: re-entered from a callback on this thread.)
        held = self._lock._is_owned()  # type: ignore[attr-defined]
        locked = False
        try:
            locked = (self._lock.acquire(timeout=wait) if wait > 0
                      else self._lock.acquire(False))
            if not locked:
                return False
            io = self._io
            if self._closed and fut is not None:  # (close() may have looked at the queue)
                fut.set_exception(Unavailable("kvd connection closed"))
                return True
            if (self._closed or io.link.phase != "up" or not self._outbox.empty()
                    or (instance and instance != self.instance)
                    or io.book.in_flight_req(msg.req)):
                return False
            try:
                if not io.link.raw_send(msg):
                    return False
            except Exception:  # noqa: BLE001 - cannot be encoded: the I/O thread fails
                return False  # it once queued, as it does any message it cannot send
            if fut is not None:  # (its reply waits for the lock, held here)
                fut.set_running_or_notify_cancel()  # new: cannot have been cancelled
            io.book.track(msg, fut)
            if fut is not None and wait > 0:
                io.await_reply(fut, wait)
            if io.inbox or io.link.readable():  # the FD's edge may be gone: tell the I/O thread
                self._wakeup()
            return True
        finally:
            if locked or (not held and self._lock._is_owned()):  # type: ignore[attr-defined]
                self._lock.release()

    def _queue(self, item: tuple[m.Request, Future | None, str]) -> bool:
        """Hand a message to the I/O thread; False (nothing queued, counted as
        unavailable) once closed, or when ``MAX_QUEUED`` wait already: callers sending
        faster than the thread can send fail at once instead of piling up without
        bound."""
        with self._closing:
            if self._drained or self._outbox.qsize() >= MAX_QUEUED:
                self.stats.unavailable += 1
                return False
            self._outbox.put(item)
            self._wakeup()
        return True

    def _forked(self) -> None:
        """In a fork's child: the I/O thread and ZeroMQ's threads stayed in the parent,
        and the socket is the parent's. Every call fails open (``Unavailable``) at once
        instead of waiting on them for ever; nothing of the parent's is touched. The
        locks are new: the parent's may have been held by a thread the child lacks."""
        self._closed = True
        self._up = threading.Event()
        self._lock = threading.RLock()
        self._closing = threading.Lock()
        self._outbox = queue.SimpleQueue()

    def _wakeup(self) -> None:
        try:
            os.eventfd_write(self._wake, 1)
        except OSError:
            pass  # closed

    # ------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        leave_compute_cpus()  # first: zmq's own threads, started below, inherit it
        io = self._io
        try:
            io.loop()
        except Exception:  # noqa: BLE001 - the thread must not die silently
            log.exception("kvd client I/O thread failed")
        finally:
            with self._lock:
                io.shutdown()


def _after_fork_in_child() -> None:
    for conn in list(_LIVE):
        conn._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
