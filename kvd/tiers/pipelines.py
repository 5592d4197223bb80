"""Round trips to a Redis/Valkey Cluster (or one server): one pipeline per master that
owns some of a call's keys, no retries, each cut at a deadline. The keys a master sends
elsewhere (ASK, MOVED) go once more, in one pipeline per node named, under the same
rules.

redis-py's cluster pipeline would resend each failed command alone (a timeout apiece)
and its clients retry with backoff; here a dead or hung master costs one socket timeout,
and a link that trickles bytes costs its round trip's budget, after which a watchdog
shuts the socket. The caller (``remote.RedisTier``) keeps the breakers.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY, ClusterNode, RedisCluster, get_node_name
from redis.exceptions import (AskError, ClusterDownError, MovedError, SlotNotCoveredError,
                              TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvd.errors import BreakerOpen, TierError

Client = redis.Redis | RedisCluster
Command = tuple[Any, ...]


@dataclass
class Sent:
    """What one call's pipelines came back with."""

    replies: list[Any]  # in the commands' order; a TierError where the master failed or
    # was skipped, no master serves the key's slot, or it is mid-migration (TRYAGAIN),
    # an exception object for one key's error (WRONGTYPE, OOM)
    answered: set[str] = field(default_factory=set)  # masters, by redis-py's "host:port"
    failed: dict[str, TierError] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    stale: bool = False  # the client's slot map is out of date (a MOVED, a slot unserved)
    redirected: set[str] = field(default_factory=set)  # nodes the redirects named


def pipelined(client: Client, cmds: list[Command], budget_s: float = 0.0,
              skip: Callable[[str], bool] = lambda name: False) -> Sent:
    """One pipeline per node owning some of ``cmds``' keys, but those ``skip`` names. One
    server (no cluster) raises its failure. Each round trip is cut after ``budget_s``
    (0: the socket timeout)."""
    if not isinstance(client, RedisCluster):
        kw = client.get_connection_kwargs()
        name = f"{kw.get('host')}:{kw.get('port')}"
        return Sent(execute(client, cmds, name, budget_s), {name})
    sent = Sent([None] * len(cmds))
    groups: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, cmd in enumerate(cmds):
        try:
            node = client.get_node_from_key(cmd[1])
        except SlotNotCoveredError:  # its master lost for good (full coverage off)
            sent.replies[i] = TierError(f"redis: no master serves the slot of {cmd[1]!r}")
            sent.stale = True
            continue
        groups.setdefault(node.name, (node, []))[1].append(i)
    _send(client, cmds, groups, sent, budget_s, skip)
    redirected = [i for i, r in enumerate(sent.replies) if isinstance(r, AskError)]
    if redirected:  # (MOVED is an AskError)
        _redirect(client, cmds, redirected, sent, budget_s, skip)
    for i, reply in enumerate(sent.replies):
        if isinstance(reply, TryAgainError):  # a key mid-migration: a miss, not refused
            sent.replies[i] = TierError(f"redis {cmds[i][0]}: TRYAGAIN (slot migrating)")
    return sent


def _send(client: RedisCluster, cmds: list[Command],
          groups: dict[str, tuple[ClusterNode, list[int]]], sent: Sent, budget_s: float,
          skip: Callable[[str], bool], asking: bool = False) -> None:
    """One pipeline per node of ``groups``, its replies into ``sent``. ``asking``: each
    command after an ASKING (which lets the next command into a slot being imported, and
    is harmless where the node owns the slot)."""
    for name, (node, idx) in groups.items():
        if name in sent.failed:  # failed earlier in this call: not a second timeout
            replies: list[Any] = [sent.failed[name]] * len(idx)
        elif skip(name):
            sent.skipped.add(name)
            replies = [BreakerOpen(f"redis node {name}: breaker open")] * len(idx)
        else:
            batch = [cmds[i] for i in idx]
            if asking:
                batch = [c for cmd in batch for c in (("ASKING",), cmd)]
            try:
                replies = execute(client.get_redis_connection(node), batch, name, budget_s)
                sent.answered.add(name)
            except TierError as e:
                sent.failed[name] = e
                replies = [e] * len(batch)
            if asking:
                replies = replies[1::2]
        for i, reply in zip(idx, replies):
            sent.replies[i] = reply


def _redirect(client: RedisCluster, cmds: list[Command], idx: list[int], sent: Sent,
              budget_s: float, skip: Callable[[str], bool]) -> None:
    """The commands a master sent elsewhere (its slot migrating: ASK; moved: MOVED),
    once, one pipeline per node named, under the same budget and breakers as the first
    round (re-sent one by one, each redirect to a hung master cost a socket timeout, and
    its failures no breaker). A node the client has not met yet (just added to the
    cluster) is met here; a second redirect is a miss."""
    groups: dict[str, tuple[ClusterNode, list[int]]] = {}
    met: list[ClusterNode] = []  # nodes not in the client's table, for this call only
    for i in idx:
        err = sent.replies[i]
        sent.stale |= isinstance(err, MovedError)
        name = get_node_name(err.host, err.port)
        sent.redirected.add(name)
        node = client.get_node(node_name=name)
        if node is None:  # (not added to redis-py's table: its lock is its own)
            node = ClusterNode(err.host, err.port, PRIMARY)
            met.append(node)
        groups.setdefault(name, (node, []))[1].append(i)
    try:
        _send(client, cmds, groups, sent, budget_s, skip, asking=True)
    finally:
        for node in met:
            if node.redis_connection is not None:
                node.redis_connection.close()
    for i in idx:
        if isinstance(sent.replies[i], (AskError, TryAgainError)):
            sent.replies[i] = TierError(f"redis {cmds[i][0]}: redirected twice")


def execute(node: redis.Redis, cmds: list[Command], where: str,
             budget_s: float = 0.0) -> list[Any]:
    pipe = node.pipeline(transaction=False)
    for cmd in cmds:
        pipe.execute_command(*cmd)
    watchdog: _Watchdog | None = None
    pool = node.connection_pool
    try:
        if budget_s > 0:  # this call's own connection, kept from the pool until the
            # watchdog is cancelled: it must never cut a connection another call took
            pipe.connection = pool.get_connection()
            pipe.connection_pool = _Held(pool)
            watchdog = _Watchdog(pipe.connection, budget_s)
        replies = pipe.execute(raise_on_error=False)
    except (RedisConnectionError, RedisTimeoutError) as e:
        if watchdog is not None and watchdog.fired:
            raise TierError(f"redis node {where}: no whole reply within {budget_s:.2f}s "
                            "(a slow link)") from e
        raise TierError(f"redis node {where}: {describe(e)}") from e
    finally:
        if watchdog is not None:
            conn = watchdog.cancel()
            pipe.reset()  # (into _Held)
            if watchdog.fired:
                conn.disconnect()  # its socket is shut: the pool reconnects it
            pool.release(conn)
        else:
            pipe.reset()  # gives the connection back (execute did, unless it never ran)
    for reply in replies:
        if isinstance(reply, ClusterDownError):  # and MASTERDOWN
            raise TierError(f"redis node {where}: cluster down ({reply})")
    return replies


class _Held:
    """A connection pool whose ``release`` only holds the connection: the caller gives
    it back once its watchdog can no longer fire."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def release(self, conn: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class _Watchdog:
    """Shuts a connection's socket down if its call outlives ``budget_s``: the blocked
    read then fails, where a socket timeout would not fire as long as some bytes keep
    coming. The connection stays the call's until ``cancel``."""

    def __init__(self, conn: Any, budget_s: float) -> None:
        self.conn = conn
        self._sock = getattr(conn, "_sock", None)  # redis-py's socket of this connection
        self._lock = threading.Lock()
        self.fired = self.done = False
        _DEADLINES.add(time.monotonic() + budget_s, self)

    def fire(self) -> None:
        with self._lock:
            if self.done or self._sock is None:
                return
            self.fired = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> Any:
        """No firing from now on; the connection, for the caller to give back."""
        with self._lock:
            self.done = True
        return self.conn


class _Deadlines:
    """One thread fires every round trip's watchdog at its deadline (a timer thread per
    round trip cost a thread start each). A cancelled watchdog stays queued until its
    deadline or until it comes first, then is dropped unfired."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[float, int, _Watchdog]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, when: float, dog: _Watchdog) -> None:
        with self._cond:
            heapq.heappush(self._queue, (when, next(self._seq), dog))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvd-remote-deadlines")
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        queue = self._queue
        with self._cond:
            while True:
                while queue and queue[0][2].done:
                    heapq.heappop(queue)
                if not queue:
                    self._cond.wait()
                    continue
                wait = queue[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(queue)[2].fire()


_DEADLINES = _Deadlines()


def no_retry() -> Retry:
    """redis-py retries up to 10 times with backoff by default (5.x/6.x+): a failing call
    would take seconds; the breaker decides what happens next instead."""
    return Retry(NoBackoff(), 0)


def describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "no node given"
