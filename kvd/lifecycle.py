"""The daemon's life as an operator sees it: start-up, readiness, watchdog, status
line, metrics, SIGHUP reload and a graceful SIGTERM.

Why a module of its own: the server owns the socket and the loop, the service owns the
state; this is the glue between them and the outside (systemd, Prometheus, signals),
and keeping it here keeps both of them small. Everything runs on the event loop except
the start-up timeout extension (the loop is not running yet while the pool is faulted
in) and the metrics HTTP thread (which reads state only through ``LoopSnapshot``).

Phases, reported in ``status()["phase"]``, on STATUS= and as ``kvd_phase``:
``starting`` -> ``serving`` -> ``stopping`` -> ``stopped``. Contract of a stop:
STOPPING=1 first; new Register / Lookup / Allocate / Transfer get ``BUSY``; in-flight
transfers finish (bounded by ``stop_timeout_ms``, cut short by a second signal); then
the server closes (where the journal is flushed).

It sees the daemon only through ``Daemon``: a few verbs, not the server's parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import msgspec

from kvd import start_signals
from kvd.access import Access
from kvd.config import Config
from kvd.errors import KvdError
from kvd.metrics import LoopSnapshot, Metrics
from kvd.notify import Notifier
from kvd_proto import messages as m

log = logging.getLogger("kvd.lifecycle")
STATUS_PERIOD_S = 5.0
# What a stop takes after its drain, at most: the copy engines' closes (5 s each), the
# socket's linger (1 s), the tiers' close (10 s), the log's (2 s); and some slack.
CLOSE_S = 30.0
POOL_PREP_BYTES_PER_S = 100 * 1024**2  # a pessimistic prefault rate for the timeout cap
# What SIGHUP may change without a restart: values the service reads from ``config``
# per request (access rules included: ``Service.access`` is rebuilt when the config
# object changes). A new key belongs here once the service reads it that way or applies
# it in ``Service.reconfigure`` (quotas, policy parameters); everything else is reported
# as "restart needed".
LIVE_KEYS = frozenset({
    "log_level", "max_lease_ms", "max_pending_ms", "max_keys_per_request", "stop_timeout_ms",
    "allowed_uids", "allowed_groups", "admin_uids", "max_leased_blocks",
    "max_pending_blocks", "client_timeout_ms", "max_tenants", "store_claim_ms",
})
ReloadFn = Callable[[], "tuple[Config, dict[str, str]]"]
# Told a reload's outcome: OK, or why not (BAD_REQUEST: the file; BUSY: not serving), and
# the line logged.
Answer = Callable[["m.Code", str], None]


def config_changes(old: Config, new: Config) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """(live changes key -> (old, new), keys that changed but need a restart)."""
    live: dict[str, tuple[Any, Any]] = {}
    restart: list[str] = []
    for key in old.__struct_fields__:
        a, b = getattr(old, key), getattr(new, key)
        if a == b:
            continue
        if key in LIVE_KEYS:
            live[key] = (a, b)
        else:
            restart.append(key)
    return live, restart


class Daemon(Protocol):
    """What the lifecycle needs of the daemon (``kvd.server.Server`` provides it)."""

    loop: asyncio.AbstractEventLoop
    config: Config

    @property
    def inflight(self) -> int: ...

    @property
    def stop_requested(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def apply_config(self, config: Config, origins: dict[str, str]) -> None: ...

    def begin_stop(self) -> None: ...


class Lifecycle:
    def __init__(self, server: Daemon, origins: dict[str, str] | None = None,
                 reload_config: ReloadFn | None = None,
                 notifier: Notifier | None = None) -> None:
        self.server = server
        self.origins = dict(origins or {})
        self.reload_config = reload_config
        self.notifier = notifier if notifier is not None else Notifier.from_environ()
        self.phase = "starting"
        self.metrics: Metrics | None = None
        self._hurry = False
        self._last_counts = (0, 0)  # (lookup_keys, hit_blocks) at the last status line
        self._timers: dict[str, asyncio.TimerHandle] = {}  # chain name -> next call
        self._reading = False  # a reload's read runs on its thread
        self._read_again = False  # a SIGHUP came meanwhile
        self._answers: list[Answer] = []  # kvdctl reloads waiting on the read under way
        self._next_answers: list[Answer] = []  # ... on the read after it

    # ------------------------------------------------------------ start-up
    @contextlib.contextmanager
    def preparing(self, what: str, nbytes: int) -> Iterator[None]:
        """Keep systemd's start timeout extended while start-up work over ``nbytes`` of
        pool runs (creating and faulting the pool in; restoring the index from the
        journal), for at most a pessimistic time for that many bytes."""
        cap = 60.0 + nbytes / POOL_PREP_BYTES_PER_S
        with self.notifier.extending(what, at_most=cap):
            yield

    def started(self) -> None:
        """On the loop, once the ROUTER accepts clients: metrics, READY=1, timers, SIGHUP."""
        server = self.server
        server.apply_config(server.config, self.origins)
        cfg = server.config
        snapshot = LoopSnapshot(server.loop, server.status)
        self.metrics = Metrics(snapshot.get)
        self.metrics.serve(cfg.metrics_addr, cfg.metrics_port)
        if self.phase == "starting":
            self.phase = "serving"
        start_signals.serve_signal(server.loop, signal.SIGHUP, self.reload)
        self.notifier.ready(self.status_line())
        if start_signals.reload_pending():  # a SIGHUP during start-up: the file may
            log.info("applying the reload signalled during start-up")  # have changed
            self.reload()
        if self.notifier.watchdog_interval > 0:
            log.info("systemd watchdog: pinging every %.1fs", self.notifier.watchdog_interval)
            self._watchdog()
        if self.notifier.enabled:
            self._timers["status"] = server.loop.call_later(STATUS_PERIOD_S, self._status_tick)

    def status(self) -> dict[str, Any]:
        """What the lifecycle adds to ``Service.status()``."""
        return {"phase": self.phase,
                "metrics": self.metrics.address if self.metrics else "",
                "systemd": {"notify": self.notifier.enabled,
                            "watchdog_s": self.notifier.watchdog_interval * 2}}

    # ------------------------------------------------------------ periodic, on the loop
    def _watchdog(self) -> None:
        self.notifier.watchdog()
        if self.phase != "stopped":
            self._timers["watchdog"] = self.server.loop.call_later(
                self.notifier.watchdog_interval, self._watchdog)

    def _status_tick(self) -> None:
        self.notifier.status(self.status_line())
        if self.phase not in ("stopping", "stopped"):
            self._timers["status"] = self.server.loop.call_later(STATUS_PERIOD_S,
                                                                 self._status_tick)

    def status_line(self) -> str:
        """One line for ``systemctl status``: phase, pool, pinning, clients, hit rate."""
        st = self.server.status()
        pool, c = st["pool"], st["counters"]
        asked, hit = c["lookup_keys"], c["hit_blocks"]
        d_asked, d_hit = asked - self._last_counts[0], hit - self._last_counts[1]
        self._last_counts = (asked, hit)
        rate = f"{d_hit / d_asked:.1%}" if d_asked else "-"
        used = pool["used_bytes"] / max(1, pool["capacity_bytes"])
        pin = st.get("pinning", {})
        pinned = {"done": "pinned", "running": f"pinning {pin.get('fraction', 0):.0%}"}.get(
            pin.get("state", ""), "unpinned")
        persist = st.get("persistence", {})
        restored = (f", restored {persist.get('restored_blocks', 0)} blocks"
                    if persist.get("enabled") else "")
        return (f"{self.phase}: pool {used:.0%} of {pool['capacity_bytes'] >> 20} MiB, "
                f"{pinned}{restored}; {len(st['clients'])} clients, "
                f"{len(st['tenants'])} tenants; hit rate {rate}")

    # ------------------------------------------------------------ transfers
    def transfer_done(self, direction: int, ok: bool, seconds: float) -> None:
        if self.metrics is not None:
            name = "store" if direction == m.Direction.STORE else "load"
            self.metrics.observe_transfer(name, ok, seconds)

    # ------------------------------------------------------------ SIGHUP, kvdctl reload
    def reload(self, *answers: Answer) -> None:
        """Re-read file, environment and flags; apply what can change live; log it.

        The reading runs on a thread of its own: a configuration file on a network
        mount that hangs must not hold the event loop (every client) with it. What
        was read is applied on the loop; reloads asked for while a read runs make one
        more. ``answers`` (kvdctl reload) are each called once, with the outcome of a
        read that starts after the call: (OK or why not, what was logged)."""
        if self.reload_config is None:
            log.warning("reload not available (no configuration source)")
            _tell(answers, m.Code.BAD_REQUEST, "reload not available (no configuration "
                                               "source)")
            return
        if self.phase != "serving":  # stopping: no RELOADING/READY after STOPPING
            log.warning("reload asked for while %s: not reloaded", self.phase)
            _tell(answers, m.Code.BUSY, f"kvd is {self.phase}: not reloaded")
            return
        if self._reading:
            log.info("reload asked for while the configuration is being read: read again "
                     "after it")
            self._read_again = True
            self._next_answers += answers
            return
        self._reading = True
        self._answers += answers
        self.notifier.reloading()
        try:
            threading.Thread(target=self._read, name="kvd-reload", daemon=True).start()
        except (RuntimeError, MemoryError) as e:  # no thread now (TasksMax, memory):
            # this reload fails; the next one tries again
            self._read_done(KvdError(f"cannot start the thread that reads it: {e}"))

    def _read(self) -> None:
        """On the reload thread (a daemon thread: a read that never returns does not
        hold the daemon's exit)."""
        assert self.reload_config is not None
        try:
            outcome: tuple[Config, dict[str, str]] | BaseException = self.reload_config()
        except Exception as e:  # noqa: BLE001 - reported on the loop
            outcome = e
        try:
            self.server.loop.call_soon_threadsafe(self._read_done, outcome)
        except RuntimeError:  # the loop is closed: the daemon has stopped
            pass

    def _read_done(self, outcome: tuple[Config, dict[str, str]] | BaseException) -> None:
        self._reading = False
        said: tuple[m.Code, str] = (m.Code.INTERNAL, "reload failed: internal error")
        try:
            said = self._outcome(outcome)
        except Exception:  # noqa: BLE001 - a bug in applying: keep serving, say so
            log.exception("reload failed")
        finally:
            answers, self._answers = self._answers, []
            _tell(answers, *said)
            if self.phase == "serving":  # no READY=1 after STOPPING=1
                self.notifier.ready(self.status_line())
            if self._read_again:
                self._read_again = False
                more, self._next_answers = self._next_answers, []
                self.reload(*more)

    def _outcome(self, outcome: tuple[Config, dict[str, str]] | BaseException
                 ) -> tuple[m.Code, str]:
        """Apply what was read; (OK or why not, what was logged)."""
        if isinstance(outcome, KvdError):
            said = f"reload failed, keeping the running configuration: {outcome}"
            log.error("%s", said)
            return m.Code.BAD_REQUEST, said
        if isinstance(outcome, BaseException):  # a bug in loading: keep serving
            log.error("reload failed, keeping the running configuration", exc_info=outcome)
            return m.Code.INTERNAL, ("reload failed, keeping the running configuration: "
                                     f"{type(outcome).__name__}: {outcome}")
        if self.phase != "serving":
            log.warning("configuration read while %s: not applied", self.phase)
            return m.Code.BUSY, f"configuration read while {self.phase}: not applied"
        return self.apply(*outcome)

    def apply(self, new: Config, origins: dict[str, str]) -> tuple[m.Code, str]:
        """Swap in a config with the live keys of ``new`` (Config is frozen: replaced,
        never mutated); (OK or why not, the line logged)."""
        server = self.server
        live, restart = config_changes(server.config, new)
        if live:
            effective = msgspec.structs.replace(server.config,
                                                **{k: v[1] for k, v in live.items()})
            try:  # e.g. a group that does not exist would refuse every client
                Access(effective)
            except KvdError as e:
                said = f"reload failed, keeping the running configuration: {e}"
                log.error("%s", said)
                return m.Code.BAD_REQUEST, said
            server.apply_config(effective, self.origins)
            if "log_level" in live:
                logging.getLogger().setLevel(effective.log_level.upper())
        # Where each running value comes from now: the sources just read name every key
        # but those that changed and wait for a restart (a value the file names as it
        # runs is the file's now; one the file no longer names is the default's).
        self.origins.update({k: v for k, v in origins.items() if k not in restart})
        said = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(live.items()))
        parts = [f"reloaded {said}" if said else "reload: no live setting changed"]
        if restart:
            parts.append(f"restart needed for {', '.join(sorted(restart))} (not applied)")
        said = "; ".join(parts)
        log.info("%s", said)
        return m.Code.OK, said

    # ------------------------------------------------------------ stop
    def request_stop(self) -> None:
        """Signal handler (SIGTERM/SIGINT): the first starts a graceful stop, a second
        cuts the wait for in-flight transfers short."""
        server = self.server
        if server.stop_requested:
            log.warning("second stop signal: not waiting for in-flight transfers")
            self._hurry = True
            return
        self.phase = "stopping"
        waiting, self._answers, self._next_answers = (self._answers + self._next_answers,
                                                      [], [])
        self._read_again = False  # (no read after a stop)
        _tell(waiting, m.Code.BUSY, "kvd is stopping: not reloaded")  # (a read may hang)
        self.notifier.stopping(self.status_line(),
                               within=server.config.stop_timeout_ms / 1000 + CLOSE_S)
        log.info("stopping: refusing new work, finishing %d in-flight transfers",
                 server.inflight)
        server.begin_stop()

    async def drain(self) -> None:
        """Wait (bounded) for in-flight transfers; the server closes after."""
        server = self.server
        deadline = time.monotonic() + server.config.stop_timeout_ms / 1000
        while server.inflight > 0 and not self._hurry and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if server.inflight > 0:
            log.warning("stopping with %d transfers still in flight (they fail)",
                        server.inflight)

    def close(self) -> None:
        self.phase = "stopped"
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        if self.metrics is not None:
            self.metrics.close()
        self.notifier.close()


def _tell(answers: Sequence[Answer], code: m.Code, said: str) -> None:
    """Each answer once; one that fails (a bug) does not keep the others from theirs."""
    for answer in answers:
        try:
            answer(code, said)
        except Exception:  # noqa: BLE001
            log.exception("answering a reload failed")
