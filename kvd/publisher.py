"""Publishing KV event batches on ZeroMQ, framed exactly as vLLM's ``ZmqEventPublisher``.

Each batch is one multipart message ``(topic, 8-byte big-endian sequence number,
msgpack payload)``; the sequence is per daemon, across topics, so a subscriber that
sees a gap asks the replay socket (ROUTER) for the batches it missed: it sends
``(b"", start_seq)`` from a REQ/DEALER socket and gets every buffered batch from that
sequence on as ``(b"", topic, seq, payload)``, then ``(b"", b"", -1 as 8 bytes, b"")``.

Why XPUB with XPUB_NODROP instead of PUB: a PUB socket drops silently at the
high-water mark, so nobody could count what a slow subscriber lost. Here a send that
would exceed some subscriber's high-water mark fails at once (never blocks); the batch
is counted as dropped and sent again in lossy mode, so every other subscriber still
gets it. ZeroMQ then drops for that subscriber without a word until it drains, so the
count is of the times a subscriber fell behind, not of the batches it missed. A stuck
or absent subscriber thus never slows the daemon: sends are non-blocking, and with no
subscriber a batch goes nowhere. XPUB also shows us every (re)subscription: a router that
reconnects (after a daemon restart, say) is sent a heartbeat, so it sees the sequence's gap.

Runs on the event loop (the server services the replay socket from ``loop.add_reader``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import zmq

from kvd.events import (AllBlocksCleared, BatchBuilder, KVEventBatch, TenantInfo, node_name,
                        topic_for)
from kvd.inode import Identity, identity_of, unlink_if

log = logging.getLogger("kvd.publisher")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAYS_PER_PASS = 8  # requests read per pass; then the loop serves other work
REPLAY_BATCHES_PER_PASS = 256  # batches sent per pass, across the replays under way
MAX_REPLAYS = 16  # replays under way at once; more requests wait in the socket
MAX_SUBSCRIPTION = 4096  # bytes of an (un)subscription message; topics are short


@dataclass
class _Replay:
    """One requester's replay, sent a few batches per pass of the loop."""

    client: bytes
    next: int  # the sequence to send next (older than the buffer: its oldest)
    end: int  # the sequence it stops before: the next one when it asked


@dataclass
class PublisherCounters:
    batches: int = 0  # published (sent to every subscriber that kept up)
    events: int = 0
    # Times a subscriber's queue was found full: it misses that batch and, unseen by
    # us (ZeroMQ drops for it quietly until it drains), the ones after; the gap in
    # the sequence tells it to replay. Not a count of the batches it missed.
    dropped_batches: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    bad_replay_requests: int = 0
    heartbeats: int = 0  # empty batches sent because a subscriber (re)joined


class Publisher:
    def __init__(self, endpoint: str, replay_endpoint: str = "", hwm: int = 100_000,
                 buffer_steps: int = 10_000, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.counters = PublisherCounters()
        # Microseconds since the epoch at start: a restarted daemon continues above the
        # last run's sequence, so a subscriber sees the restart as a gap and replays
        # the new run's opening AllBlocksCleared instead of mistaking seq 0 for old.
        self.seq = time.time_ns() // 1000
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.XPUB_NODROP, 1)
        # Every subscription reaches us, a second router's on a topic already followed too.
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Called when a subscription arrives (KvEvents: a heartbeat is due).
        self.on_join: Callable[[], None] | None = None
        # A subscription is a topic prefix: a peer that sends more is dropped, before
        # its message (and the prefix it would keep in the subscription trie) is held.
        self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION)
        self._ipc_files: dict[str, Identity | None] = {}  # bound here: removed at the close
        self.endpoint = self._bind(self.pub, endpoint)
        self.replay: zmq.Socket | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            # A requester that does not read holds at most one replay's worth: past
            # that its replay is cut short (it asks again), never queued without end.
            self.replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
            self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # full: EAGAIN, not a drop
            self.replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes
            self.replay_endpoint = self._bind(self.replay, replay_endpoint)
        self._replays: deque[_Replay] = deque()

    def _bind(self, sock: zmq.Socket, endpoint: str) -> str:
        """Bind (routers connect to kvd); port 0 picks one. Returns the bound address."""
        from kvd.errors import ConfigError

        if endpoint.startswith("tcp://[") or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint.replace("tcp://*:", "tcp://0.0.0.0:", 1))
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ConfigError(f"cannot bind the events endpoint {endpoint}: {e}") from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if bound.startswith("ipc://") and not bound.startswith("ipc://@"):
            with contextlib.suppress(OSError):
                self._ipc_files[path] = identity_of(path := bound[len("ipc://"):])
        return bound

    def publish(self, batches: list[tuple[bytes, bytes, int]]) -> None:
        """Send (topic, payload, event count) batches, in order, one sequence each."""
        self.drain_subscriptions()
        pub, buf = self.pub, self._buffer
        c = self.counters
        for topic, payload, n_events in batches:
            seq_bytes = self.seq.to_bytes(8, "big")
            buf.append((self.seq, topic, payload))
            self.seq += 1
            frames = (topic, seq_bytes, payload)
            try:
                pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a subscriber is full: it misses this one, the rest do not
                c.dropped_batches += 1
                pub.setsockopt(zmq.XPUB_NODROP, 0)
                try:
                    pub.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                finally:
                    pub.setsockopt(zmq.XPUB_NODROP, 1)
            c.batches += 1
            c.events += n_events

    @property
    def fd(self) -> int:
        """Readable (edge-triggered) when subscriptions wait: call ``drain_subscriptions``."""
        return self.pub.getsockopt(zmq.FD)

    def drain_subscriptions(self) -> None:
        """Read out XPUB's queued (un)subscription messages; a subscription calls ``on_join``."""
        pub, joined = self.pub, False
        while pub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            joined = joined or msg[:1] == b"\x01"
        if joined and self.on_join is not None:
            self.on_join()

    @property
    def replay_fd(self) -> int | None:
        return None if self.replay is None else self.replay.getsockopt(zmq.FD)

    def service_replay(self) -> bool:
        """Read a few replay requests (edge-triggered FD), then send at most
        ``REPLAY_BATCHES_PER_PASS`` batches of the replays under way, in turns: a
        replay of the whole buffer, or many at once, never holds the loop (each used
        to be sent whole, a pass at a time: 40 of 2,700 batches held a Ping 1.2 s).
        True when more is to do: the caller calls again soon, after other work."""
        sock = self.replay
        if sock is None:
            return False
        for _ in range(REPLAYS_PER_PASS):
            if len(self._replays) >= MAX_REPLAYS or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[2]) != 8:
                self.counters.bad_replay_requests += 1
                if self.counters.bad_replay_requests in (1, 1000):  # not one line each
                    log.warning("invalid replay request of %d frames (more are counted, "
                                "not logged)", len(frames))
                continue
            self.counters.replay_requests += 1
            start = int.from_bytes(frames[2], "big", signed=True)
            self._replays.append(_Replay(frames[0], start, self.seq))
        budget = REPLAY_BATCHES_PER_PASS
        while self._replays and budget > 0:
            r = self._replays.popleft()
            try:
                sent, done = self._send_some(r, budget)
            except Exception:  # noqa: BLE001 - one request must not stop the others
                log.exception("replay request failed")
                continue
            budget -= max(sent, 1)
            if not done:
                self._replays.append(r)
        return bool(self._replays) or bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _send_some(self, r: _Replay, budget: int) -> tuple[int, bool]:
        """Up to ``budget`` batches of ``r``, and its end marker once it is through;
        (batches sent, whether it is over)."""
        sock = self.replay
        assert sock is not None
        buf = self._buffer
        first = buf[0][0] if buf else self.seq
        start = max(r.next, first)
        n = 0
        try:
            if start < r.end:
                for seq, topic, payload in itertools.islice(buf, start - first, None):
                    if seq >= r.end or n == budget:
                        break
                    sock.send_multipart((r.client, b"", topic, seq.to_bytes(8, "big"), payload),
                                        flags=zmq.NOBLOCK, copy=False)
                    n += 1
            r.next = start + n
            if n == budget and r.next < r.end:
                return n, False
            sock.send_multipart((r.client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone, or not reading (its queue is full): it asks again
            log.debug("replay cut short: %s", e)
        finally:
            self.counters.replayed_batches += n
        return n, True

    def status(self) -> dict:
        c = self.counters
        oldest = self._buffer[0][0] if self._buffer else self.seq
        return {"enabled": True, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "next_seq": self.seq,
                "replay_from_seq": oldest, "batches": c.batches, "events": c.events,
                "dropped_batches": c.dropped_batches,
                "replay_requests": c.replay_requests,
                "bad_replay_requests": c.bad_replay_requests,
                "replayed_batches": c.replayed_batches, "heartbeats": c.heartbeats}

    def close(self, linger_ms: int = 0) -> None:
        self.pub.close(linger=linger_ms)
        if self.replay is not None:
            self.replay.close(linger=0)
        for path, ident in self._ipc_files.items():  # the ones it bound, as the daemon's
            with contextlib.suppress(OSError):  # socket: not a later daemon's at the path
                unlink_if(path, ident)


class KvEvents:
    """The daemon's KV event stream: collects the index's changes of one loop iteration
    and publishes them as one batch per tenant (never one per block).

    ``add`` queues the core's event tuples; the first one of an iteration calls
    ``on_pending`` (the server schedules ``flush`` with ``loop.call_soon``, so what
    the rest of the iteration adds joins the same batch). ``clear`` marks a flush.
    """

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str, node: str,
                 hwm: int, int_hashes: bool, info: Callable[[int], TenantInfo],
                 tenants: Callable[[], Iterable[int]],
                 holds: Callable[[int, bytes], bool] = lambda tid, key: False) -> None:
        self.publisher = Publisher(endpoint, replay_endpoint, hwm)
        self.builder = BatchBuilder(int_hashes)
        self.node = node_name(node)
        self.topic = topic
        self.info = info
        self.tenants = tenants
        self.holds = holds  # (tenant id, key): whether that tenant has the block READY
        self.pending: list[tuple] = []
        self.on_pending: Callable[[], None] | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._topics: dict[int, bytes] = {}
        self._prune_topics_at = 64  # (see _forget_topics)
        # Topics this daemon has spoken on since it started: the first batch on a topic
        # opens with AllBlocksCleared, so a router drops what an earlier daemon on this
        # node announced (a restart without --persist keeps nothing of it).
        self._opened: set[bytes] = set()
        self._gone: set[bytes] = set()  # topics to clear that no tenant here speaks on

    def add(self, events: list[tuple]) -> None:
        if not events:
            return
        first = not self.pending
        self.pending.extend(events)
        if first and self.on_pending is not None:
            self.on_pending()

    def clear(self, kept: list[tuple], gone: dict[int, str] | None = None) -> None:
        """Everything before is superseded: AllBlocksCleared on every tenant's topic,
        then BlockStored for ``kept`` (commit tuples of the blocks still held).
        ``gone``: tenants (id -> model) of an earlier run that this one did not keep;
        their topics are cleared too (a router held what that run announced there)."""
        for tid, model in (gone or {}).items():
            self._gone.add(topic_for(self.topic, self.node, tid, model))
        self.add([("clear", kept)])

    def flush(self) -> None:
        """Publish what this iteration queued."""
        if not self.pending:
            return
        events, self.pending = self._shared_drops(self.pending), []
        by_tenant = self.builder.build(events, self.info, self.tenants())
        ts = time.time()
        batches = []
        if self._gone:
            for topic in sorted(self._gone - set(map(self._topic, self.tenants()))):
                self._opened.add(topic)  # a heartbeat tells a late router of the gap
                batches.append((topic, self._encode(KVEventBatch(ts, [AllBlocksCleared()])),
                                1))
            self._gone.clear()
        if not by_tenant and not batches:
            return
        cleared: set[bytes] = set()  # one clear per topic: tenants may share a topic
        for tid, evs in by_tenant.items():
            topic = self._topic(tid)
            if topic not in self._opened:
                self._opened.add(topic)
                if not isinstance(evs[0], AllBlocksCleared):
                    evs.insert(0, AllBlocksCleared())
            if isinstance(evs[0], AllBlocksCleared):
                if topic in cleared:  # would wipe what the other tenant just announced
                    evs = evs[1:]
                cleared.add(topic)
            if evs:
                batches.append((topic, self._encode(KVEventBatch(ts, evs)), len(evs)))
        self.publisher.publish(batches)
        self._forget_topics()

    def heartbeat(self) -> None:
        """An empty batch on each topic this run has spoken on. Sent when a subscriber
        (re)joins: a router back after this daemon restarted missed the run's opening
        batch (AllBlocksCleared and what it kept); the heartbeat's sequence shows it the
        gap, and it replays. Without one an idle daemon published nothing, and the
        router kept its view of the previous run."""
        self.flush()  # what is queued goes first
        if not self._opened:
            return
        payload = self._encode(KVEventBatch(time.time(), []))
        self.publisher.publish([(t, payload, 0) for t in sorted(self._opened)])
        self.publisher.counters.heartbeats += 1

    def _shared_drops(self, events: list[tuple]) -> list[tuple]:
        """Without the drops of blocks that another tenant on the same topic still
        holds: two tenants of one model (two TP sizes, say) share the default topic,
        and evicting one of them told routers the node had lost the other's blocks."""
        droppers = {e[2] for e in events if e[0] == "drop"}
        if not droppers:
            return events
        on: dict[bytes, list[int]] = {}
        for tid in self.tenants():
            on.setdefault(self._topic(tid), []).append(tid)
        # By the dropping tenant's own topic, not among the tenants still here: one
        # dropped at the tenant limit is gone by now, and its drops are all it has left.
        others = {tid: [o for o in on.get(self._topic(tid), ()) if o != tid]
                  for tid in droppers}
        if not any(others.values()):
            return events
        holds = self.holds
        return [e for e in events if e[0] != "drop"
                or not any(holds(o, e[3]) for o in others.get(e[2], ()))]

    def _forget_topics(self) -> None:
        """The topics of tenants gone (dropped at the tenant limit), once their last
        events went out: each new fingerprint left one for good. Looked at when the
        table has doubled since, so the cost per flush stays constant."""
        if len(self._topics) <= self._prune_topics_at:
            return
        live = set(self.tenants())
        for tid in [t for t in self._topics if t not in live]:
            del self._topics[tid]
        self._prune_topics_at = 2 * len(self._topics) + 64

    def _topic(self, tenant_id: int) -> bytes:
        t = self._topics.get(tenant_id)
        if t is None:
            t = topic_for(self.topic, self.node, tenant_id, self.info(tenant_id).model)
            self._topics[tenant_id] = t
        return t

    def status(self) -> dict:
        return {**self.publisher.status(), "node": self.node, "topic": self.topic}

    def close(self, clear: bool = False) -> None:
        """``clear``: the blocks go with this daemon (no persistence): routers are told
        on every topic it spoke on, instead of routing to it until another run does."""
        self.flush()
        if clear and self._opened:
            payload = self._encode(KVEventBatch(time.time(), [AllBlocksCleared()]))
            self.publisher.publish([(t, payload, 1) for t in sorted(self._opened)])
        self.publisher.close(linger_ms=500 if clear and self._opened else 0)
