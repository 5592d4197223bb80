"""Prometheus metrics: the daemon's status document, exported at scrape time.

Why a custom collector instead of Counter objects incremented on the hot path: every
number already lives in the core's counters and in ``Service.status()``; counting twice
would cost time per request and could drift from ``kvdctl status``. So a scrape asks the
event loop for a fresh status document (the loop owns the state; the HTTP server runs
on prometheus-client's own thread and must not read it directly) and translates it.
If the loop does not answer within a second (it is hung, and the watchdog will act),
the last document is served and ``kvd_status_age_seconds`` says how old it is.

Only the transfer-latency histograms are observed as events happen (on the loop, when a
copy completes): a distribution cannot be rebuilt from counters.

Everything registers into an injected ``CollectorRegistry``, never the global one, so
tests and several daemons in one process do not collide.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvd.metrics")
DEFAULT_PORT = 9727
# The HTTP endpoint's bounds: a connection waits at most this long for each read or
# write, and at most this many are served at once (more are closed at once), so idle or
# trickling connections cannot pile up threads in the daemon.
HTTP_TIMEOUT_S = 10.0
HTTP_CONNECTIONS = 16
ACCEPT_PAUSE_S = 0.1  # after an accept that found no descriptor left
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# (metric name without _total, key in status["counters"], help). Names match the JSON
# of `kvdctl status --json` so a dashboard and the CLI always agree.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvd_requests", "requests", "Requests received"),
    ("kvd_lookups", "lookups", "Lookup requests"),
    ("kvd_lookup_blocks", "lookup_keys", "Blocks asked for by lookups"),
    ("kvd_hit_blocks", "hit_blocks", "Blocks found by lookups (leading READY run)"),
    ("kvd_lookup_tokens", "lookup_tokens", "Tokens asked for (blocks x block_tokens)"),
    ("kvd_hit_tokens", "hit_tokens", "Tokens found by lookups (blocks x block_tokens)"),
    ("kvd_stored_blocks", "stored_blocks", "Blocks that became READY"),
    ("kvd_stored_bytes", "stored_bytes", "Bytes copied into the pool"),
    ("kvd_loaded_blocks", "loaded_blocks", "Blocks copied out of the pool"),
    ("kvd_loaded_bytes", "loaded_bytes", "Bytes copied out of the pool"),
    ("kvd_evicted_blocks", "evicted_blocks", "Blocks evicted (policy or admin)"),
    ("kvd_evicted_bytes", "evicted_bytes", "Bytes of the slots evicted blocks held"),
    ("kvd_failed_stores", "failed_stores", "Stores aborted before READY"),
    ("kvd_failed_transfers", "failed_transfers", "Transfers that completed with an error"),
    ("kvd_expired_transfers", "expired_transfers",
     "Transfers ended unstarted (or not committed) because their deadline passed"),
    ("kvd_stalled_lookups", "stalled_lookups",
     "Lookups answered as misses while copies were overdue (a stuck copy path)"),
    ("kvd_unclaimed_blocks", "unclaimed_blocks",
     "Slots of ticketed stores not every rank made in time (skipped stores), given back"),
    ("kvd_expired_leases", "expired_leases", "Leases dropped at their deadline"),
    ("kvd_expired_pending", "expired_pending", "Pending stores dropped at their deadline"),
    ("kvd_no_space", "no_space", "Allocations that found no room"),
    ("kvd_quota_cut_keys", "quota_cut_keys",
     "Keys of Allocates past the pending-store quota (per connection, or 3/4 of the pool "
     "per tenant), given no slot"),
    # Tiers below the pool (README "Tiers").
    ("kvd_demoted_blocks", "demoted_blocks", "Evicted blocks kept by the disk tier"),
    ("kvd_demote_dropped_blocks", "demote_dropped",
     "Evicted blocks that did not go down (queue full, tier error)"),
    ("kvd_written_behind_blocks", "written_behind_blocks",
     "Blocks written to the remote tier"),
    ("kvd_write_behind_dropped_blocks", "write_behind_dropped",
     "Blocks not written to the remote tier (queue full, tier error)"),
    ("kvd_promoted_blocks", "promoted_blocks", "Blocks brought up into the pool from a tier"),
    ("kvd_disk_hit_blocks", "disk_hit_blocks", "Blocks promoted from the disk tier"),
    ("kvd_remote_hit_blocks", "remote_hit_blocks", "Blocks promoted from the remote tier"),
    ("kvd_promote_failed_blocks", "promote_failed",
     "Promotions given up (missing, corrupt, tier error)"),
    ("kvd_remote_probe_timeouts", "probe_timeouts",
     "Lookups answered before the remote tier did"),
    ("kvd_remote_probes_skipped", "probes_skipped",
     "Lookups not asked of the remote tier: too many probes in flight"),
    ("kvd_tier_errors", "tier_errors", "Tier operations that failed"),
    ("kvd_corrupt_held_back_blocks", "corrupt_held_back",
     "Blocks that failed their checksum in the pool on the way down a tier: not sent"),
)


EVENT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvd_event_batches", "batches", "KV event batches published (one per tenant and loop "
                                     "iteration with changes)"),
    ("kvd_events", "events", "KV events published (BlockStored, BlockRemoved, "
                             "AllBlocksCleared)"),
    ("kvd_event_batches_dropped", "dropped_batches",
     "Times a slow subscriber's queue (events_hwm) was full: it misses batches from "
     "then until it drains, and replays them"),
    ("kvd_event_replay_requests", "replay_requests", "Replay requests answered"),
)


class LoopSnapshot:
    """A status document taken on the event loop, for readers on other threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, status: Callable[[], dict],
                 timeout: float = 1.0) -> None:
        self.loop = loop
        self.status = status
        self.timeout = timeout
        self._last: dict[str, Any] = {}
        self._taken = 0.0

    def get(self) -> tuple[dict[str, Any], float]:
        """The freshest document and its age in seconds."""
        box: list[dict] = []
        ready = threading.Event()

        def take() -> None:
            try:
                box.append(self.status())
            except Exception:  # noqa: BLE001 - a scrape must not kill the loop
                log.exception("status for metrics failed")
            finally:
                ready.set()

        try:
            self.loop.call_soon_threadsafe(take)
        except RuntimeError:  # the loop is closed: the daemon is exiting
            ready.set()
        if ready.wait(self.timeout) and box:
            self._last, self._taken = box[0], time.monotonic()
        age = time.monotonic() - self._taken if self._taken else float("inf")
        return self._last, age


class StatusCollector(Collector):
    """Translates a status document into metric families at scrape time."""

    def __init__(self, source: Callable[[], tuple[dict[str, Any], float]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        st, age = self.source()
        yield GaugeMetricFamily("kvd_status_age_seconds",
                                "Age of the status document behind this scrape", value=age)
        if not st:
            return
        yield from self._counters(st.get("counters", {}))
        yield from self._gauges(st)
        yield from self._tenants(st.get("tenants", []))
        yield from self._events(st.get("events", {}))
        yield from self._tiers(st.get("tiers", {}))

    @staticmethod
    def _tiers(tiers: dict[str, Any]) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("kvd_tier_blocks", "Blocks held per tier", labels=["tier"])
        used = GaugeMetricFamily("kvd_tier_bytes", "Bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvd_tier_capacity_bytes", "Capacity per tier (where known)",
                                labels=["tier"])
        up = GaugeMetricFamily("kvd_tier_up", "1 unless the tier's last call failed (or its "
                               "breaker is open)", labels=["tier"])
        rejected = CounterMetricFamily("kvd_tier_rejected_blocks", "Blocks a tier answered "
                                       "with an error when written (a full cluster...)",
                                       labels=["tier"])
        masters = GaugeMetricFamily("kvd_tier_masters_down", "Cluster masters skipped after "
                                    "failing in a row (their keys read as misses)",
                                    labels=["tier"])
        for name, t in sorted(tiers.items()):
            for fam, key in ((blocks, "blocks"), (used, "bytes"), (cap, "capacity_bytes"),
                             (rejected, "rejected_blocks")):
                if isinstance(t.get(key), int):
                    fam.add_metric([name], t[key])
            if isinstance(t.get("masters_down"), list):
                masters.add_metric([name], len(t["masters_down"]))
            down = t.get("state") in ("open", "half_open") or t.get("consecutive_failures")
            up.add_metric([name], 0 if down else 1)
        yield from (blocks, used, cap, up, rejected, masters)

    @staticmethod
    def _counters(c: dict[str, Any]) -> Iterator[Metric]:
        for name, key, doc in COUNTERS:
            if key in c:
                yield CounterMetricFamily(name, doc, value=c[key])
        for miss, asked, hit, doc in (
            ("kvd_missed_blocks", "lookup_keys", "hit_blocks", "Blocks asked for and not found"),
            ("kvd_missed_tokens", "lookup_tokens", "hit_tokens", "Tokens asked for and not found"),
        ):
            if asked in c and hit in c:
                yield CounterMetricFamily(miss, doc, value=c[asked] - c[hit])
        errors = CounterMetricFamily("kvd_errors", "Error replies and failed transfers by code",
                                     labels=["code"])
        for code, n in sorted(c.get("errors_by_code", {}).items()):
            errors.add_metric([code], n)
        yield errors

    @staticmethod
    def _gauges(st: dict[str, Any]) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvd_info", "Constant 1, labelled with what this daemon is",
                                 labels=["instance_id", "policy", "protocol"])
        info.add_metric([st.get("instance", ""), st.get("policy", ""),
                         str(st.get("version", ""))], 1)
        yield info
        phase = GaugeMetricFamily("kvd_phase", "1 for the daemon's current phase",
                                  labels=["phase"])
        phase.add_metric([st.get("phase", "serving")], 1)
        yield phase
        yield GaugeMetricFamily("kvd_uptime_seconds", "Seconds since start",
                                value=st.get("uptime_s", 0))
        pool = st.get("pool", {})
        yield GaugeMetricFamily("kvd_pool_capacity_bytes", "Pool bytes usable for slots",
                                value=pool.get("capacity_bytes", 0))
        yield GaugeMetricFamily("kvd_pool_used_bytes", "Pool bytes in slots of any state",
                                value=pool.get("used_bytes", 0))
        pin = st.get("pinning", {})
        if "pinned_bytes" in pin:
            yield GaugeMetricFamily("kvd_pool_pinned_bytes", "Pool bytes registered for DMA",
                                    value=pin["pinned_bytes"])
        blocks = st.get("blocks", {})
        fam = GaugeMetricFamily("kvd_blocks", "Pool slots by state", labels=["state"])
        for state in ("ready", "pending", "pinned"):
            fam.add_metric([state], blocks.get(state, 0))
        yield fam
        yield GaugeMetricFamily("kvd_leases", "Open leases (looked-up blocks held for a load)",
                                value=blocks.get("leases", 0))
        yield GaugeMetricFamily("kvd_pending_stores", "Blocks allocated and not yet READY",
                                value=blocks.get("pending", 0))
        yield GaugeMetricFamily("kvd_clients", "Connected clients",
                                value=len(st.get("clients", [])))
        yield GaugeMetricFamily("kvd_tenants", "Tenants known", value=len(st.get("tenants", [])))
        yield GaugeMetricFamily("kvd_inflight_transfers", "Transfers submitted and not done",
                                value=st.get("transfers", {}).get("inflight", 0))
        yield GaugeMetricFamily("kvd_overdue_transfers",
                                "Transfers past their deadline and grace, not ended "
                                "(above 0: the copy path is stuck; lookups miss)",
                                value=st.get("transfers", {}).get("overdue", 0))

    @staticmethod
    def _events(ev: dict[str, Any]) -> Iterator[Metric]:
        """The KV event stream for fleet routers (only when it is on)."""
        if not ev.get("enabled"):
            return
        for name, key, doc in EVENT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=ev.get(key, 0))

    @staticmethod
    def _tenants(tenants: list[dict[str, Any]]) -> Iterator[Metric]:
        labels = ["tenant", "model"]
        used = GaugeMetricFamily("kvd_tenant_used_bytes", "READY bytes held per tenant", labels=labels)
        blocks = GaugeMetricFamily("kvd_tenant_blocks", "READY blocks held per tenant", labels=labels)
        clients = GaugeMetricFamily("kvd_tenant_clients", "Clients per tenant", labels=labels)
        for t in tenants:
            key = [str(t["id"]), t.get("model", "")]
            used.add_metric(key, t.get("bytes", 0))
            blocks.add_metric(key, t.get("blocks", 0))
            clients.add_metric(key, t.get("clients", 0))
        yield from (used, blocks, clients)


class Metrics:
    """The daemon's registry: the status collector plus the transfer histograms."""

    def __init__(self, source: Callable[[], tuple[dict[str, Any], float]],
                 registry: CollectorRegistry | None = None) -> None:
        # The status collector names its metrics only when it collects: a registry that
        # does not keep such collectors answers ``?name[]=...`` with none of kvd's.
        self.registry = registry if registry is not None else CollectorRegistry(
            support_collectors_without_names=True)
        self.registry.register(StatusCollector(source))
        self.transfer_seconds = Histogram(
            "kvd_transfer_seconds", "Transfer latency from submit to completion",
            ["direction", "outcome"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._server: Any = None
        self.address = ""

    def observe_transfer(self, direction: str, ok: bool, seconds: float) -> None:
        """On the loop, once per completed Transfer (prometheus-client locks inside)."""
        self.transfer_seconds.labels(direction, "ok" if ok else "error").observe(seconds)

    def serve(self, addr: str, port: int) -> str:
        """Start the HTTP endpoint on prometheus-client's thread; '' when not started.

        A port that cannot be bound is logged and skipped: metrics are not the data
        path, and refusing to start would turn a monitoring mistake into a cache outage.
        """
        if port <= 0:
            return ""
        addr = addr or "0.0.0.0"  # every interface
        try:
            self._server = _serve(addr, port, self.registry)
        except OSError as e:
            log.error("metrics endpoint not started: cannot bind %s:%d: %s", addr, port,
                      e.strerror or e)
            return ""
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address in a URL
        self.address = f"http://{host}:{port}/metrics"
        log.info("metrics on %s", self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # per read and write of the connection's socket

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""

    def get_stderr(self) -> Any:
        """wsgiref prints an application's traceback here: to the log, one line."""
        return _LogStream()


class _LogStream:
    def write(self, text: str) -> None:
        if text.strip():
            log.debug("metrics request: %s", text.strip())

    def flush(self) -> None:
        pass


class _Server(ThreadingMixIn, WSGIServer):
    """prometheus-client's threading WSGI server, with a bound on the connections it
    serves at once (its own starts a thread per connection, however many)."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(HTTP_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many open: this one is closed
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def get_request(self) -> Any:
        try:
            return super().get_request()
        except OSError as e:  # (socketserver drops the connection attempt quietly)
            if e.errno in (errno.EMFILE, errno.ENFILE):  # the listener stays readable:
                time.sleep(ACCEPT_PAUSE_S)  # without a pause this thread spins a core
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or went away: socketserver printed a traceback
        to stderr (a journal entry per idle connection, every 10 s)."""
        log.debug("metrics connection from %s ended", client_address, exc_info=True)


def _serve(addr: str, port: int, registry: CollectorRegistry) -> _Server:
    """The endpoint on its own thread (as prometheus-client's ``start_http_server``)."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    server_class = type("_Server", (_Server,), {"address_family": family})
    server = make_server(addr, port, make_wsgi_app(registry), server_class, _Handler)
    threading.Thread(target=server.serve_forever, name="kvd-metrics", daemon=True).start()
    return server
