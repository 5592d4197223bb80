"""The remote tier: blocks in a Redis/Valkey Cluster that every node of a fleet shares.

Keys are ``kvd:<ns>:<key>`` with no hash tag, so one tenant's blocks spread over all
masters; values are ``BlockHeader.pack() + payload``, so a torn, stale or foreign value
reads as a miss. A single non-cluster server works too (``INFO cluster`` decides).

Every call is a few pipelines, one per master owning the batch's keys, with no retries
(``pipelines.py``): a dead or hung master costs one timeout.

One master down is not the cluster down: a cluster that serves the slots it still
covers (``cluster-require-full-coverage no``, or the seconds before a failover) keeps
serving kvd, the dead master's keys reading as misses and its puts as declined (a
master lost for good, its slots unserved, too: the client takes a slot map with holes). A
breaker per master stops calling one that keeps failing; the tier's own breaker opens
when no master answers. While a master fails or is skipped, the slot map is looked up
again in place, at most every REFRESH_S: a replica that took over is used within that.
A failure of the whole cluster drops the client.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, NodesManager, RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvd.errors import BreakerOpen, ConfigError, TierError
from kvd.tiers.base import HEADER_BYTES, BlockHeader, Tier, TierBlock
from kvd.tiers.pipelines import Client, Command, describe, no_retry, pipelined

# What makes a call fail (and count against the breaker), as opposed to one bad block.
_FAILURES = (RedisError, RedisClusterException, OSError)
# A round trip's deadline: ``remote_timeout_ms`` plus its value bytes at this rate. Each
# socket read has the timeout, but a link that trickles bytes inside it would otherwise
# hold a read (and the Lookups promised its blocks) for as long as it likes.
MIN_BYTES_PER_S = 32 << 20
# While a master fails or is skipped, the slots are looked up again at most this often (a
# replica that took over is found within it).
REFRESH_S = 1.0
# A node only redirects name (a slot migrating to a node just added) keeps its breaker
# this long after the last redirect to it: it is in no slot map until the slot is its.
REDIRECT_KEEP_S = 60.0
# redis-py 8 can ask the master just seen failing last when it looks the slots up again.
_ASK_IT_LAST = "last_failed_node_name" in inspect.signature(NodesManager.initialize).parameters
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
        self._masters: dict[str, _NodeBreaker] = {}  # by "host:port", as redis-py names
        self._redirected: dict[str, float] = {}  # node -> when a redirect last named it
        self._refreshed_at = float("-inf")  # the slot map was last looked up again

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
            # (a master that failed or is skipped leaves TierErrors: declined, not refused)
            refused = [r for r in replies if isinstance(r, Exception)
                       and not isinstance(r, TierError)]
            with self._lock:
                self.written_blocks += ok
                if refused:  # OOM, READONLY...: the cluster is up but keeps nothing
                    self.rejected_blocks += len(refused)
                    self.last_error = f"redis put: {describe(refused[0])}"
            kept += ok
        return kept

    def contains(self, ns: bytes, keys: Sequence[bytes], nbytes: int = 0) -> int:
        run = 0
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start:start + self.max_batch]
            # STRLEN, not EXISTS: a value of another type (a list...) is no block, and
            # a GET of it fails, so the run would be promised and never come up.
            cmds = [("STRLEN", _name(ns, k)) for k in chunk]
            for key, size in zip(chunk, self._call("contains", cmds)):
                if not isinstance(size, int) or size <= HEADER_BYTES or (
                        nbytes and size != HEADER_BYTES + nbytes):
                    if isinstance(size, Exception) and not _wrong_type(size):
                        return run  # its master is down, or a retry failed: a miss
                    if size:  # not a block: forgotten
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
                replies = self._call("get_into", self._reads(ns, chunk), nbytes)
            except TierError:
                if run:  # the batches read and verified before stay good
                    return run
                raise
            values = replies[::2] if self.ttl_s else replies  # (not the EXPIREs')
            got = 0
            for key, value, out in zip(chunk, values, outs[start:start + len(chunk)]):
                if not isinstance(value, bytes):  # missing, a per-key error, master down
                    if _wrong_type(value):  # not a block (another error: a miss)
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

    def _reads(self, ns: bytes, keys: Sequence[bytes]) -> list[Command]:
        """A GET per key, each followed by an EXPIRE when blocks have a TTL: a block
        the fleet keeps reading stays (blocks promoted from here are not written back,
        so nothing else renews it). Not GETEX: that needs Redis 6.2, and a server that
        refuses writes (MISCONF, NOREPLICAS) would refuse the read too; a failed EXPIRE
        costs only the renewal."""
        names = [_name(ns, k) for k in keys]
        if not self.ttl_s:
            return [("GET", n) for n in names]
        return [cmd for n in names for cmd in (("GET", n), ("EXPIRE", n, self.ttl_s))]

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
                    "consecutive_failures": self._failures, "last_error": self.last_error,
                    "masters_down": sorted(n for n, b in self._masters.items()
                                           if b.opened_at is not None)}

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

    def _failed(self, error: TierError, counted: bool = False) -> None:
        """A failed call; ``counted``: its round trips are in ``errors`` already."""
        with self._lock:
            self._failures += 1
            self.errors += 0 if counted else 1
            self.last_error = str(error)
            if self._trial or self._failures >= self.breaker_failures:
                self._opened_at = self.clock()
            self._trial = False
            # Rediscover the topology next time. The old client is not closed here: the
            # other thread may be mid-call on it (it would fail with a closed file, not
            # a TierError); it closes its connections once nobody holds it.
            self._client = None

    # ------------------------------------------------------------ one breaker per master
    def _skipped(self, name: str) -> bool:
        """Whether master ``name``'s breaker says not to call it now. Past its cooldown
        every call may try it (no single trial: a master is a few threads' worth)."""
        with self._lock:
            b = self._masters.get(name)
            return (b is not None and b.opened_at is not None
                    and self.clock() - b.opened_at < self.breaker_cooldown_s)

    def _masters_answered(self, answered: set[str], failed: dict[str, TierError]) -> None:
        with self._lock:
            for name in answered:
                self._masters.pop(name, None)
            for name, error in failed.items():
                b = self._masters.setdefault(name, _NodeBreaker())
                b.failures += 1
                if b.failures >= self.breaker_failures:
                    b.opened_at = self.clock()
                self.last_error = str(error)
            if failed:
                self.errors += 1  # calls that failed, in part or whole

    def _call(self, what: str, cmds: list[Command], nbytes: int = 0) -> list[Any]:
        """``cmds`` (one key each, at ``[1]``) sent through the breaker; their replies in
        order, per-key errors (OOM, ...) as exception objects, and a ``TierError`` for
        each key whose master failed or is skipped. TierError when no master of the
        cluster answers. A round trip carrying ``nbytes`` of values ends within the
        timeout plus their time at MIN_BYTES_PER_S."""
        self._admit(what)
        try:
            client = self._connected()
            sent = pipelined(client, cmds, self.timeout_s + nbytes / MIN_BYTES_PER_S,
                             self._skipped)
        except TierError as e:
            self._failed(e)
            raise
        except _FAILURES as e:
            error = TierError(f"redis {what}: {describe(e)}")
            self._failed(error)
            raise error from e
        except BaseException:
            with self._lock:  # not the cluster's fault: no verdict on it
                self._trial = False
            raise
        failed = sent.failed
        if sent.redirected:
            with self._lock:
                self._redirected.update(dict.fromkeys(sent.redirected, self.clock()))
        self._masters_answered(sent.answered, failed)
        if sent.answered or not cmds:
            self._succeeded()
        elif failed and self._all_down(client, failed):  # the cluster is down
            error = next(iter(failed.values()))
            self._failed(error, counted=True)
            raise error
        else:  # only masters known (or just found) down were asked: no verdict on it
            with self._lock:
                self._trial = False
        if failed or sent.skipped or sent.stale:
            self._refresh(client, next(iter(failed or sent.skipped), ""))
        return sent.replies

    def _refresh(self, client: Client, suspect: str) -> None:
        """Look up the slots again (at most every REFRESH_S) while a master fails or is
        skipped, or the slot map is out of date: a replica that took over is used from
        then on. In place: a new client would send ``COMMAND`` first, to a master that
        may be the one down."""
        with self._lock:
            if self.clock() - self._refreshed_at < REFRESH_S:
                return
            self._refreshed_at = self.clock()
        try:
            client.nodes_manager.initialize(  # type: ignore[union-attr]
                disconnect_startup_nodes_pools=False,  # other threads' calls use them
                **({"last_failed_node_name": suspect} if _ASK_IT_LAST and suspect else {}))
            self._keep_masters(client)
        except _FAILURES:
            with self._lock:
                if self._client is client:
                    self._client = None

    def _keep_masters(self, client: Client) -> None:
        """Breakers of the client's masters only: a master replaced by its replica is no
        longer one (it stayed "down" for good when a new client, made after the whole
        cluster failed, never called it again). Kept too: a node that redirects named in
        the last REDIRECT_KEEP_S, in no slot map while a slot migrates to it."""
        if not isinstance(client, RedisCluster):
            return
        masters = {n.name for n in client.get_primaries()}
        with self._lock:
            since = self.clock() - REDIRECT_KEEP_S
            self._redirected = {n: t for n, t in self._redirected.items() if t >= since}
            for name in [n for n in self._masters
                         if n not in masters and n not in self._redirected]:
                del self._masters[name]

    def _all_down(self, client: Client, failed: dict[str, TierError]) -> bool:
        """Whether every master of the cluster failed in this call or is skipped."""
        return all(n.name in failed or self._skipped(n.name) for n in client.get_primaries())

    def _forget(self, ns: bytes, key: bytes) -> None:
        """Count and delete a value that failed verification (best effort)."""
        with self._lock:
            self.corrupt_blocks += 1
            client = self._client
        if client is None:
            return
        try:
            pipelined(client, [("DEL", _name(ns, key))], skip=self._skipped)
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
                self._keep_masters(client)
                with self._lock:
                    self._client, self._cluster = client, cluster
            return client

    def _connect(self) -> tuple[Client, bool]:
        """The first node that answers says whether it is a cluster: a cluster client
        on all the URLs, else a plain client on that node."""
        opts: dict[str, Any] = {"socket_timeout": self.timeout_s,
                                "socket_connect_timeout": self.timeout_s}
        error: Exception | None = None
        for host, port in sorted(self.nodes, key=lambda n: self._skipped(f"{n[0]}:{n[1]}")):
            node = redis.Redis(host=host, port=port, retry=no_retry(), **opts)
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
            # A new client sends COMMAND to its default node, the first master CLUSTER
            # SLOTS names: redis-py's own retries move it on if that one is down.
            # Full coverage not required: the slots of a master lost for good (with its
            # replicas) are misses, the others served (the client refused to start).
            client = RedisCluster(startup_nodes=startup, require_full_coverage=False,
                                  retry=Retry(NoBackoff(), len(self.nodes)), **opts)
            client.set_retry(no_retry())  # from here on the breakers decide
            return client, True
        raise TierError(f"redis: no node of {self.urls} answered ({describe(error)})")


# ---------------------------------------------------------------- helpers
def _name(ns: bytes, key: bytes) -> bytes:
    return b"kvd:" + ns + b":" + key


def _value(ns: bytes, block: TierBlock) -> bytes:
    head = BlockHeader.of(ns, block.key, block.data, block.depth).pack()
    return b"".join((head, memoryview(block.data).cast("B")))


def _wrong_type(reply: object) -> bool:
    """A value of another type than a string under a block's name: no block, ever (a
    redirect that failed or TRYAGAIN says nothing about the value)."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


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


class _NodeBreaker:
    """One master's consecutive failures, and since when it is skipped."""

    __slots__ = ("failures", "opened_at")

    def __init__(self) -> None:
        self.failures = 0
        self.opened_at: float | None = None
