"""Round trips to a Redis/Valkey Cluster (or one server): one pipeline per master that
owns some of a call's keys, no retries, each cut at a deadline.

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
from typing import Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvd.errors import BreakerOpen, TierError

Client = redis.Redis | RedisCluster
Command = tuple[Any, ...]


class Sent(NamedTuple):
    """What one call's pipelines came back with."""

    replies: list[Any]  # in the commands' order; a TierError where the master failed or
    # was skipped, an exception object for one key's error (WRONGTYPE, OOM)
    answered: set[str]  # masters, by redis-py's "host:port" name
    failed: dict[str, TierError]
    skipped: set[str]


def pipelined(client: Client, cmds: list[Command], budget_s: float = 0.0,
              skip: Callable[[str], bool] = lambda name: False) -> Sent:
    """One pipeline per node owning some of ``cmds``' keys, but those ``skip`` names. One
    server (no cluster) raises its failure. Each round trip is cut after ``budget_s``
    (0: the socket timeout)."""
    if not isinstance(client, RedisCluster):
        kw = client.get_connection_kwargs()
        name = f"{kw.get('host')}:{kw.get('port')}"
        return Sent(execute(client, cmds, name, budget_s), {name}, {}, set())
    groups: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, cmd in enumerate(cmds):
        node = client.get_node_from_key(cmd[1])
        groups.setdefault(node.name, (node, []))[1].append(i)
    sent = Sent([None] * len(cmds), set(), {}, set())
    results = sent.replies
    for name, (node, idx) in groups.items():
        if skip(name):
            sent.skipped.add(name)
            replies: list[Any] = [BreakerOpen(f"redis node {name}: breaker open")] * len(idx)
        else:
            try:
                replies = execute(client.get_redis_connection(node),
                                  [cmds[i] for i in idx], name, budget_s)
                sent.answered.add(name)
            except TierError as e:
                sent.failed[name] = e
                replies = [e] * len(idx)
        for i, reply in zip(idx, replies):
            results[i] = reply
    for i, reply in enumerate(results):
        if isinstance(reply, (AskError, TryAgainError)):  # MOVED is an AskError
            try:
                results[i] = client.execute_command(*cmds[i])
            except ResponseError as e:  # one key's error (WRONGTYPE, OOM), as above
                if isinstance(e, ClusterDownError):
                    raise
                results[i] = e
            except (RedisConnectionError, RedisTimeoutError) as e:  # moved to one now down
                results[i] = TierError(f"redis {cmds[i][0]} after a redirect: {describe(e)}")
    return sent


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
