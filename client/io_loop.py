"""The I/O thread of a ``Connection``: the loop that runs its socket.

``IOLoop`` runs the socket: it sends what callers queued, receives, routes replies by
request id, delivers pushed Done events (callbacks run on this thread only), pings the
daemon, and re-runs the handshake (Hello, then the saved Register) whenever the daemon
restarts. It polls the socket's FD, not the socket, so that a caller may use the socket
meanwhile under ``Shared._lock``; the FD is edge-triggered, so whoever touched the
socket last checks it for input before anyone sleeps. While callers receive their own
replies (``await_reply``) the thread stops watching the socket and looks every
``RECEIVE_WINDOW_S``: waking on each reply would only compete with the caller.

The loop's collaborators each hold one part of its state: ``link.Link`` the socket and
the handshake, ``bookkeeping.Bookkeeping`` the calls and Transfers in flight,
``daemon_watch.DaemonWatch`` the pidfds of the daemon runs; ``shared.Shared`` declares
the fields the thread shares with the ``Connection``.
"""

from __future__ import annotations

import itertools
import os
import queue
import time
from concurrent.futures import Future

import msgspec
import zmq

from kvd_client.bookkeeping import Bookkeeping
from kvd_client.daemon_watch import DaemonWatch
from kvd_client.errors import KvdClientError, RemoteError, Timeout, Unavailable
from kvd_client.link import Link
from kvd_client.shared import FLUSH_BUDGET, Shared, log
from kvd_proto import messages as m

# When the daemon's process ends, its last Dones may still be inside ZeroMQ's threads:
# this long for them, so a Transfer it ended is not reported CLIENT_GONE instead.
EXIT_GRACE_S = 0.05
# How long closing waits for the Dones of Transfers in flight (the daemon, told Bye, ends
# them at once); past it, a paused daemon's are reported CLIENT_GONE unconfirmed.
CLOSE_WAIT_S = 2.0
_NOBLOCK = int(zmq.NOBLOCK)  # not an enum
# While messages keep coming (more than a wake-up reads), deadlines are still checked
# this often: a flood must not keep a Transfer past its deadline (an engine's step waits).
FLOOD_EXPIRY_S = 0.1
# An undecodable message is logged once per this long (a flood of them wrote 40,000
# lines a second to the engine's stderr); the others are counted.
WARN_EVERY_S = 10.0


class IOLoop:
    """The I/O thread's state (and, under the lock, a sending caller's)."""

    def __init__(self, conn: Shared) -> None:
        self.c = conn
        self.watcher = DaemonWatch()
        self.book = Bookkeeping(conn, self.watcher)
        self.link = Link(conn, self.book, self.watcher)
        self.inbox: list[bytes] = []  # received on a caller's thread, for this one
        self.callers_until = 0.0  # until then, callers receive: the thread need not watch
        self.expire_by = 0.0  # deadlines are checked by then, even in a flood
        self.undecodable = 0  # messages that could not be read, since the last warning
        self.warned_at = -WARN_EVERY_S

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        c = self.c
        poller = self.link.poller = self.watcher.poller = zmq.Poller()
        poller.register(c._wake, zmq.POLLIN)
        while not c._closed:
            try:
                self.step(poller)
            except Exception as e:  # noqa: BLE001 - never leave the engine without kvd for good
                # A bug or a reply nothing foresaw: this connection is dropped and made
                # again, like a lost one; the thread goes on (logged whole once per
                # kind of failure: a lasting one must not flood the engine's log).
                why = f"client error: {e!r}"
                if why != self.link.why_down:
                    log.exception("kvd client I/O step failed; reconnecting")
                with c._lock:
                    self.link.lost(why)
                time.sleep(0.05)  # one that recurs must not spin on the engine's CPU

    def step(self, poller: zmq.Poller) -> None:
        """One wait for news, and the work it brings."""
        c = self.c
        link = self.link
        with c._lock:
            now = time.monotonic()
            if link.phase == "down" and now >= link.next_attempt:
                link.connect(poller)
            # While callers receive their own replies, waking up on each of them
            # would only compete with the caller: look every RECEIVE_WINDOW_S.
            quiet = now < self.callers_until
            link.watch(-1 if quiet or link.sock is None else link.sock_fd)
            # The last look at the socket before sleeping: its FD only signals news.
            ms = 0 if link.readable() or not c._outbox.empty() else self.poll_ms(now)
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
            for fd in [fd for fd in self.watcher.daemons if fd in events]:
                self.daemon_exited(fd)
            # Nothing expires while replies wait unread (its own may be among them),
            # unless they keep coming: then every FLOOD_EXPIRY_S all the same.
            now = time.monotonic()
            expire = not more or now >= self.expire_by
            if expire:
                self.expire_by = now + FLOOD_EXPIRY_S
            self.timers(now, expire=expire)

    def await_reply(self, fut: Future, wait: float) -> None:
        """On a caller's thread, holding the lock: receive until ``fut`` has its reply,
        ``wait`` passed, or a message comes that is not a plain reply to a call (a Done,
        an error, the handshake's or a ping's answer): that one is left in the inbox for
        the I/O thread, which handles the rest, so callbacks never run on a caller's
        thread."""
        sock = self.link.sock
        assert sock is not None
        end = time.monotonic() + wait
        self.callers_until = end
        while not fut.done() and time.monotonic() < end:
            try:
                data = sock.recv()  # blocks for RECEIVE_WINDOW_S at most (RCVTIMEO)
            except zmq.ZMQError:  # (Again: nothing in the window) the I/O thread goes on
                return
            self.link.last_rx = time.monotonic()
            if not self.answer(data):
                self.inbox.append(data)
                return

    def answer(self, data: bytes) -> bool:
        """Settle the call that ``data`` answers, if that is all it does."""
        link, book = self.link, self.book
        try:
            reply = m.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        req = reply.req
        if (isinstance(reply, (m.Error, m.Done, m.EventWaited)) or req in book.transfers
                or req == link.handshake_req or req == link.ping_req):
            return False
        entry = book.pending.pop(req, None)
        if entry is None:
            self.late(reply)
        elif entry[0] is not None:
            entry[0].set_result(reply)
        return True

    def drain(self, budget: int | None = None) -> bool:
        """Handle what came (``budget``: at most that many messages from the socket
        now; the loop comes back at once for the rest). True: some may be left."""
        inbox, self.inbox = self.inbox, []
        for data in inbox:
            self.receive(data)
        for _ in itertools.repeat(None) if budget is None else range(budget):
            if not self.link.readable():
                return False
            assert self.link.sock is not None
            self.receive(self.link.sock.recv(_NOBLOCK))
        return True

    def poll_ms(self, now: float) -> int:
        ms = self.link.phase_poll_ms(now)
        if self.book.transfers:  # wake up when the first of them may be given up
            give_up = min(g for _, g, _ in self.book.transfers.values())
            ms = min(ms, max(1, int((give_up - now) * 1000) + 1))
        return ms

    def flush_outbox(self, transfers: bool = True, budget: int | None = None) -> None:
        """Send what callers queued (``budget``: at most that many now); without
        ``transfers`` (closing), a Transfer is ended unsent instead: nobody would be
        left to take its Done."""
        c = self.c
        link, book = self.link, self.book
        for _ in itertools.repeat(None) if budget is None else range(budget):
            try:
                msg, fut, instance = c._outbox.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            if instance and instance != c.instance:  # slots of an earlier daemon run
                book.fail_one(msg, fut, Unavailable("kvd restarted: the slots are gone"))
                continue
            if link.phase != "up" or (not transfers and isinstance(msg, m.Transfer)):
                book.fail_one(msg, fut, Unavailable("kvd connection lost"))
                continue
            if book.in_flight_req(msg.req):  # its reply would end the other one
                book.fail_one(msg, fut, KvdClientError(
                    f"request id {msg.req} is in flight already: use next_req()"))
                continue
            try:
                sent = link.raw_send(msg)
            except Exception as e:  # noqa: BLE001 - one message that cannot be encoded
                book.fail_one(msg, fut, Unavailable(f"cannot send {type(msg).__name__}: {e!r}"))
                continue
            if not sent:  # up, but 1,000 messages wait for the daemon
                book.fail_one(msg, fut, Unavailable("kvd is not keeping up: the socket's "
                                               "queue to it is full"))
                continue
            book.track(msg, fut)
            if fut is None and isinstance(msg, m.Release):  # (only a late lease's goes so)
                c.stats.late_leases += 1

    def receive(self, data: bytes) -> None:
        c = self.c
        link, book = self.link, self.book
        link.last_rx = time.monotonic()
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
            entry = book.pending.pop(req, None)
            if entry is not None and entry[0] is not None:
                entry[0].set_exception(RemoteError(m.Code.INTERNAL, f"undecodable reply: {e}"))
            elif req in book.transfers and tag in ("done", "error"):  # copying is over
                msg = book.pop_transfer(req)
                book.deliver(m.Done(req, msg.event, m.Code.INTERNAL,
                               f"undecodable {tag}: {e}"))
            elif req and req == link.ping_req:
                link.ping_req = 0
            elif req and req == link.handshake_req and link.phase in ("hello", "register"):
                link.handshake(m.Error(req, m.Code.INTERNAL, f"undecodable reply: {e}"))
            return
        if isinstance(reply, m.Done):
            msg = book.pop_transfer(reply.req)
            if msg is not None:  # its event is ours, whatever the reply says
                book.deliver(msgspec.structs.replace(reply, event=msg.event))
            return
        if isinstance(reply, m.EventWaited):  # the store may now reuse its CUDA event
            if c.on_event_waited is not None:
                try:
                    c.on_event_waited(reply)
                except Exception:  # noqa: BLE001
                    log.exception("on_event_waited callback failed")
            return
        if reply.req in book.transfers:  # an error about a Transfer still ends it
            msg = book.pop_transfer(reply.req)
            code = reply.code if isinstance(reply, m.Error) else m.Code.INTERNAL
            text = reply.message if isinstance(reply, m.Error) else "unexpected reply"
            book.deliver(m.Done(msg.req, msg.event, code, text))
            if code == m.Code.NOT_REGISTERED and link.phase == "up":  # the daemon dropped
                # this connection (it thought us silent): register again, or every
                # Transfer fails like this (once: the next refusals need no new try)
                link.lost("kvd forgot this client")
            return
        if reply.req == link.handshake_req and link.phase in ("hello", "register"):
            link.handshake(reply)
            return
        if reply.req == link.ping_req:
            link.ping_req = 0
            if isinstance(reply, m.Error) and reply.code == m.Code.NOT_REGISTERED:
                link.lost("kvd restarted")
            return
        entry = book.pending.pop(reply.req, None)
        if entry is None:
            return self.late(reply)
        fut = entry[0]
        if isinstance(reply, m.Error):
            c.stats.remote_errors += 1
            if reply.code == m.Code.NOT_REGISTERED:
                link.lost("kvd forgot this client (restarted)")
            if fut is not None:
                fut.set_exception(RemoteError(reply.code, reply.message))
        elif fut is not None:
            fut.set_result(reply)

    def late(self, reply: m.Reply) -> None:
        """A reply to a call that timed out: nobody holds what it gives. A lease goes
        back at once: its blocks stayed pinned, unevictable, for ``lease_ms`` after
        every request had ended (a daemon stalled past the calls' time but not the
        link's). A late ``Allocated``'s slots are left to their pending time: workers
        may be storing into them by ticket."""
        if isinstance(reply, m.LookupOk) and reply.lease \
                and self.link.raw_send(m.Release(self.c.next_req(), reply.lease)):
            self.c.stats.late_leases += 1

    def daemon_exited(self, fd: int) -> None:
        link, book = self.link, self.book
        run = self.watcher.daemons.get(fd)
        if run is None:  # no longer watched (its last Transfer ended meanwhile)
            return
        self.watcher.unwatch_daemons(lambda r: r == run)
        if run != self.c.instance:  # an earlier run: what it was sent is over now
            book.end_transfers(m.Code.CLIENT_GONE, "an earlier kvd run exited", run=run)
            return
        end = time.monotonic() + EXIT_GRACE_S
        while book.in_flight[run] and link.sock is not None and time.monotonic() < end:
            if link.sock.poll(5):
                self.drain()  # (what a gone daemon sent is finite: all of its Dones)
        book.end_transfers(m.Code.CLIENT_GONE, "kvd exited", run=run)
        if link.phase != "down":
            link.lost("kvd exited")

    def timers(self, now: float, expire: bool = True) -> None:
        """Retries, pings, and (with ``expire``) calls and Transfers past their time."""
        c = self.c
        link, book = self.link, self.book
        if book.transfers and expire:
            book.end_transfers(m.Code.EXPIRED, "no Done from kvd by the transfer's deadline "
                          "plus grace; kvd copies nothing for it any more", now)
        if link.phase in ("hello", "register"):
            if link.phase == "hello" and not link.hello_sent:
                link.send_hello()
            if now - link.last_rx > c.timeout:
                link.lost("handshake timed out", quiet=True)
            return
        if link.phase != "up":
            return
        expired = [r for r, (_, dl, _) in book.pending.items() if dl <= now] if expire else []
        for r in expired:
            fut, _, what = book.pending.pop(r)
            if fut is not None and not fut.done():
                fut.set_exception(Timeout(f"kvd did not answer {what}"))
        idle = now - link.last_rx
        if idle > c.ping_interval and link.ping_req == 0:
            link.ping_req = c.next_req()
            link.raw_send(m.Ping(link.ping_req))
            link.ping_sent = now
        elif link.ping_req and now - link.ping_sent > max(c.timeout, 2 * c.ping_interval):
            link.ping_req = 0
            link.lost("kvd stopped answering")

    def shutdown(self) -> None:
        link, book = self.link, self.book
        linger = 0
        if link.phase == "up":
            # What close() found queued (a Release, an Abort) goes out; a Transfer does
            # not (its Done would come to nobody while the daemon copied). Bye: the
            # daemon lets go of what this client held (and its copies) at once.
            self.flush_outbox(transfers=False)
            link.raw_send(m.Bye(0))
            linger = 100  # ms for zmq to write it; never an unbounded wait
            # Told Bye, the daemon starts no copy for us and stops those under way at
            # their next chunk: their Dones come at once, unless it is paused.
            end = time.monotonic() + CLOSE_WAIT_S
            while book.transfers and link.sock is not None and time.monotonic() < end:
                if link.sock.poll(5):
                    self.drain(budget=FLUSH_BUDGET)  # (bounded: the wait's end is checked)
        link.lost("connection closed", quiet=True)
        self.flush_outbox()  # anything left: ended here (the connection is down now)
        # Closing means this process stops using kvd (an engine shutting down): what is
        # still in flight is reported to the caller, whose memory goes away with it.
        book.end_transfers(m.Code.CLIENT_GONE, "connection closed")
        self.watcher.unwatch_daemons()
        if link.sock is not None:
            link.sock.close(linger=linger)
