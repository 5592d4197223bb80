"""The remote tier: blocks in a Redis/Valkey Cluster that every node of a fleet shares.

Keys are ``kvd:<ns>:<key>`` with no hash tag, so one tenant's blocks spread over all
masters; values are ``BlockHeader.pack() + payload``, so a torn, stale or foreign value
reads as a miss. A single non-cluster server works too (``INFO cluster`` decides).

Every call is a few pipelines, one per master owning the batch's keys, each sent on
that master's own (thread-safe) client, with no retries anywhere: a dead or hung node
costs one socket timeout and a ``TierError`` naming it, never redis-py's retry loops
(its cluster pipeline would resend each failed command alone, a timeout apiece). A
slot that moved (MOVED/ASK) is re-sent alone through the cluster client, which follows
the redirect and patches its slot map. A failure drops the client, so the next call
rediscovers the topology (a failover); a breaker stops calling a cluster that is down.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvd.errors import BreakerOpen, ConfigError, TierError
from kvd.tiers.base import HEADER_BYTES, BlockHeader, Tier, TierBlock

Client = redis.Redis | RedisCluster
Command = tuple[Any, ...]
# What makes a call fail (and count against the breaker), as opposed to one bad block.
_FAILURES = (RedisError, RedisClusterException, OSError)
# A round trip's deadline: ``remote_timeout_ms`` plus its value bytes at this rate. Each
# socket read has the timeout, but a link that trickles bytes inside it would otherwise
# hold a read (and the Lookups promised its blocks) for as long as it likes.
MIN_BYTES_PER_S = 32 << 20
_ADDR = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})")


def parse_urls(urls: str) -> list[tuple[str, int]]:
    """``redis://HOST:PORT[,HOST:PORT...]`` (the scheme on the first or on each) as
    (host, port) pairs; ConfigError names the part that is not one."""
    nodes = []
    for i, part in enumerate(urls.split(",")):
        text = part.strip()
        addr = text.removeprefix("redis://")
        if i == 0 and addr == text:
            raise ConfigError(f"remote {urls!r}: expected redis://HOST:PORT[,HOST:PORT...]")
        m = _ADDR.fullmatch(addr)
        if m is None or not 0 < int(m["port"]) < 65536:
            raise ConfigError(f"remote {urls!r}: {text!r} is not HOST:PORT")
        nodes.append((m["host"].strip("[]"), int(m["port"])))
    return nodes


class RedisTier(Tier):
    """Blocks in a Redis/Valkey Cluster (or one server), behind a breaker.

    Thread-safe as the ``Tier`` contract asks: the redis-py clients are (a pipeline is
    built per call and never shared), and the counters and the breaker are under a lock.
    ``status()`` never touches the network, so the event loop may call it.
    """

    name = "redis"
    local = False

    def __init__(self, urls: str, ttl_s: int = 86400, timeout_ms: int = 500,
                 max_batch: int = 64, max_batch_bytes: int = 4 << 20,
                 breaker_failures: int = 3,
                 breaker_cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = parse_urls(urls)
        if (ttl_s < 0 or timeout_ms <= 0 or max_batch <= 0 or max_batch_bytes <= 0
                or breaker_failures <= 0):
            raise ConfigError("remote tier: ttl_s >= 0, timeout_ms, max_batch(_bytes) and "
                              "breaker_failures > 0 expected")
        self.urls = urls
        self.ttl_s = ttl_s
        self.timeout_s = timeout_ms / 1000
        self.max_batch = max_batch
        # A round trip carries at most this many value bytes (one value at least), so
        # the timeout bounds a round trip of a known size, not a whole promotion.
        self.max_batch_bytes = max_batch_bytes
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.clock = clock
        self._lock = threading.Lock()  # breaker, counters, the client reference
        self._connecting = threading.Lock()  # one thread connects, others wait for it
        self._client: Client | None = None
        self._cluster: bool | None = None
        self._failures = 0  # consecutive
        self._opened_at: float | None = None  # the breaker is open (or half open)
        self._trial = False  # the one call let through while half open is in flight
        self.written_blocks = self.read_blocks = self.corrupt_blocks = self.errors = 0
        self.rejected_blocks = 0  # puts the cluster answered with an error (OOM...)
        self.last_error = ""

    # ------------------------------------------------------------ the Tier API
    def put(self, ns: bytes, blocks: Sequence[TierBlock]) -> int:
        ttl = ("EX", self.ttl_s) if self.ttl_s else ()
        kept = 0
        sizes = [memoryview(b.data).nbytes for b in blocks]
        for start, end in self._batches(sizes):
            cmds = []
            for b in blocks[start:end]:
                try:
                    cmds.append(("SET", _name(ns, b.key), _value(ns, b), *ttl))
                except ValueError:  # a key or depth its header cannot hold: declined
                    continue
            try:
                replies = self._call("put", cmds, sum(sizes[start:end])) if cmds else []
            except TierError:
                if kept:  # the batches written before stay written
                    return kept
                raise
            ok = sum(r is True for r in replies)
            refused = [r for r in replies if isinstance(r, Exception)]
            with self._lock:
                self.written_blocks += ok
                if refused:  # OOM, READONLY...: the cluster is up but keeps nothing
                    self.rejected_blocks += len(refused)
                    self.last_error = f"redis put: {_describe(refused[0])}"
            kept += ok
        return kept

    def contains(self, ns: bytes, keys: Sequence[bytes]) -> int:
        run = 0
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start:start + self.max_batch]
            # STRLEN, not EXISTS: a value of another type (a list...) is no block, and
            # a GET of it fails, so the run would be promised and never come up.
            cmds = [("STRLEN", _name(ns, k)) for k in chunk]
            for key, size in zip(chunk, self._call("contains", cmds)):
                if not isinstance(size, int) or size <= HEADER_BYTES:
                    if isinstance(size, Exception) or size:  # not a block: forgotten
                        self._forget(ns, key)
                    return run
                run += 1
        return run

    def get_into(self, ns: bytes, keys: Sequence[bytes], outs: Sequence[Any]) -> int:
        if len(outs) < len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        run = 0
        for start, end in self._batches([memoryview(o).nbytes for o in outs[:len(keys)]]):
            chunk = keys[start:end]
            nbytes = sum(memoryview(o).nbytes for o in outs[start:end])
            try:
                values = self._call("get_into", [("GET", _name(ns, k)) for k in chunk], nbytes)
            except TierError:
                if run:  # the batches read and verified before stay good
                    return run
                raise
            got = 0
            for key, value, out in zip(chunk, values, outs[start:start + len(chunk)]):
                if not isinstance(value, bytes):  # missing, or a per-key error
                    if isinstance(value, ResponseError):  # WRONGTYPE: not a block
                        self._forget(ns, key)
                    break
                if not _copy_verified(ns, key, value, out):
                    self._forget(ns, key)
                    break
                got += 1
            with self._lock:
                self.read_blocks += got
            run += got
            if got < len(chunk):
                break
        return run

    def connect(self) -> None:
        """Discover the cluster's topology now, so the first Lookup does not pay for it."""
        self._call("connect", [])

    def _batches(self, sizes: list[int]) -> list[tuple[int, int]]:
        """[start, end) ranges of at most ``max_batch`` values and ``max_batch_bytes``."""
        out, start, nbytes = [], 0, 0
        for i, size in enumerate(sizes):
            if i > start and (i - start >= self.max_batch
                              or nbytes + size > self.max_batch_bytes):
                out.append((start, i))
                start, nbytes = i, 0
            nbytes += size
        if start < len(sizes):
            out.append((start, len(sizes)))
        return out

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self._state(), "urls": self.urls, "cluster": self._cluster,
                    "written_blocks": self.written_blocks, "read_blocks": self.read_blocks,
                    "corrupt_blocks": self.corrupt_blocks,
                    "rejected_blocks": self.rejected_blocks, "errors": self.errors,
                    "consecutive_failures": self._failures, "last_error": self.last_error}

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------ the breaker
    def _state(self) -> str:
        if self._opened_at is not None:
            waited = self.clock() - self._opened_at >= self.breaker_cooldown_s
            return "half_open" if self._trial or waited else "open"
        return "closed" if self._client is not None else "unconnected"

    def _admit(self, what: str) -> None:
        """Let a call through, or raise at once while the breaker is open (or its one
        half-open trial is in flight)."""
        with self._lock:
            if self._opened_at is None:
                return
            if self._trial or self.clock() - self._opened_at < self.breaker_cooldown_s:
                raise BreakerOpen(f"redis {what}: breaker open after {self._failures} "
                                  f"failures (last: {self.last_error})")
            self._trial = True

    def _succeeded(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._trial = 0, None, False

    def _failed(self, error: TierError) -> None:
        with self._lock:
            self._failures += 1
            self.errors += 1
            self.last_error = str(error)
            if self._trial or self._failures >= self.breaker_failures:
                self._opened_at = self.clock()
            self._trial = False
            # Rediscover the topology next time. The old client is not closed here: the
            # other thread may be mid-call on it (it would fail with a closed file, not
            # a TierError); it closes its connections once nobody holds it.
            self._client = None

    def _call(self, what: str, cmds: list[Command], nbytes: int = 0) -> list[Any]:
        """``cmds`` (one key each, at ``[1]``) sent through the breaker; their replies in
        order, per-key errors (OOM, ...) as exception objects. A round trip carrying
        ``nbytes`` of values ends within the timeout plus their time at MIN_BYTES_PER_S."""
        self._admit(what)
        try:
            results = _pipelined(self._connected(), cmds,
                                 self.timeout_s + nbytes / MIN_BYTES_PER_S)
        except TierError as e:
            self._failed(e)
            raise
        except _FAILURES as e:
            error = TierError(f"redis {what}: {_describe(e)}")
            self._failed(error)
            raise error from e
        except BaseException:
            with self._lock:  # not the cluster's fault: no verdict on it
                self._trial = False
            raise
        self._succeeded()
        return results

    def _forget(self, ns: bytes, key: bytes) -> None:
        """Count and delete a value that failed verification (best effort)."""
        with self._lock:
            self.corrupt_blocks += 1
            client = self._client
        if client is None:
            return
        try:
            _pipelined(client, [("DEL", _name(ns, key))])
        except (TierError, *_FAILURES):
            pass  # it stays a miss; its TTL or the cluster's eviction removes it

    # ------------------------------------------------------------ connecting
    def _connected(self) -> Client:
        client = self._client
        if client is not None:
            return client
        with self._connecting:
            client = self._client
            if client is None:
                client, cluster = self._connect()
                with self._lock:
                    self._client, self._cluster = client, cluster
            return client

    def _connect(self) -> tuple[Client, bool]:
        """The first node that answers says whether it is a cluster: a cluster client
        on all the URLs, else a plain client on that node."""
        opts: dict[str, Any] = {"socket_timeout": self.timeout_s,
                                "socket_connect_timeout": self.timeout_s}
        error: Exception | None = None
        for host, port in self.nodes:
            node = redis.Redis(host=host, port=port, retry=_no_retry(), **opts)
            try:
                enabled = bool(node.info("cluster").get("cluster_enabled"))
            except ResponseError:  # INFO not allowed (ACL): let the cluster client try
                enabled = True
            except _FAILURES as e:
                node.close()
                error = e
                continue
            if not enabled:
                return node, False
            node.close()
            startup = [ClusterNode(h, p) for h, p in self.nodes]
            return RedisCluster(startup_nodes=startup, retry=_no_retry(), **opts), True
        raise TierError(f"redis: no node of {self.urls} answered ({_describe(error)})")


# ---------------------------------------------------------------- helpers
def _name(ns: bytes, key: bytes) -> bytes:
    return b"kvd:" + ns + b":" + key


def _value(ns: bytes, block: TierBlock) -> bytes:
    head = BlockHeader.of(ns, block.key, block.data, block.depth).pack()
    return b"".join((head, memoryview(block.data).cast("B")))


def _copy_verified(ns: bytes, key: bytes, value: bytes, out: Any) -> bool:
    """Copy ``value``'s payload into ``out`` if it is (ns, key)'s block, intact and of
    ``out``'s size; nothing is written into ``out`` otherwise."""
    header = BlockHeader.unpack(value)
    payload = memoryview(value)[HEADER_BYTES:]
    dst = memoryview(out).cast("B")
    if header is None or payload.nbytes != dst.nbytes or not header.matches(ns, key, payload):
        return False
    dst[:] = payload
    return True


def _pipelined(client: Client, cmds: list[Command], budget_s: float = 0.0) -> list[Any]:
    """One pipeline per node owning some of ``cmds``' keys; replies in ``cmds``' order.
    Each node's round trip is cut after ``budget_s`` (0: only the socket timeout)."""
    if not isinstance(client, RedisCluster):
        kw = client.get_connection_kwargs()
        return _execute(client, cmds, f"{kw.get('host')}:{kw.get('port')}", budget_s)
    groups: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, cmd in enumerate(cmds):
        node = client.get_node_from_key(cmd[1])
        groups.setdefault(node.name, (node, []))[1].append(i)
    results: list[Any] = [None] * len(cmds)
    for name, (node, idx) in groups.items():
        replies = _execute(client.get_redis_connection(node), [cmds[i] for i in idx], name,
                           budget_s)
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
    return results


def _execute(node: redis.Redis, cmds: list[Command], where: str,
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
        raise TierError(f"redis node {where}: {_describe(e)}") from e
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
        self.fired = self._done = False
        self._timer = threading.Timer(budget_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._done or self._sock is None:
                return
            self.fired = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> Any:
        """No firing from now on; the connection, for the caller to give back."""
        with self._lock:
            self._done = True
        self._timer.cancel()
        return self.conn


def _no_retry() -> Retry:
    """redis-py retries up to 10 times with backoff by default (5.x/6.x+): a failing call
    would take seconds; the breaker decides what happens next instead."""
    return Retry(NoBackoff(), 0)


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "no node given"
