"""The daemon process: start-up, the event loop's readers and timers, and the stop.

One uvloop loop owns all daemon state. The ROUTER socket's request path is
kvd/router.py, its file kvd/socket_file.py, the copy engines kvd/data_paths.py. Copy
threads report through ``call_soon_threadsafe``; clients' pids are watched with pidfds
so a client that dies releases its leases and pending stores at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import zmq

from kvd.access import Access
from kvd.clients import Client
from kvd.config import Config
from kvd.data_paths import DataPaths
from kvd.engines.base import CopyJob
from kvd.lifecycle import Lifecycle, ReloadFn
from kvd.start_signals import ignore_stop_signals, serve_signal, take_start_signals
from kvd.errors import ConfigError
from kvd.fd_guard import listening
from kvd.pool import Pool
from kvd.router import Router, router_socket
from kvd.service import Service
from kvd.socket_file import SocketFile
from kvd.tiers.tiering import Tiering
from kvd_proto import messages as m

log = logging.getLogger("kvd.server")
TICK_S = 0.25
STOP_LINGER_MS = 1000  # how long a stop waits for its last replies to leave
# A (re)subscription's heartbeat leaves after this, with the others of a burst of them,
# and at most once per HEARTBEAT_EVERY_S (a subscription flood must not fill the replay
# buffer with empty batches).
HEARTBEAT_DELAY_S = 0.05
HEARTBEAT_EVERY_S = 1.0


class Server:
    def __init__(self, config: Config, origins: dict[str, str] | None = None,
                 reload_config: ReloadFn | None = None) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        # systemd, metrics, SIGHUP and the graceful stop live in kvd.lifecycle.
        self.lifecycle = Lifecycle(self, origins, reload_config)
        if listening(config.socket):  # before the pool: a refusal leaves nothing behind
            raise ConfigError(f"another kvd is listening at {config.socket}; stop it or "
                              "give this one another socket")
        Access(config)  # allowed_groups that name no group: refused before anything exists
        # Until run() takes them over: a stop during a long start-up (pool prefault,
        # journal restore) exits cleanly, removing what was made; a reload waits.
        take_start_signals()
        self.paths = DataPaths()
        self.socket_file = SocketFile(config)
        self.loop_has_signals = False  # run() took SIGTERM/SIGINT over from start-up
        self._ticking: asyncio.TimerHandle | None = None
        try:
            self._start(config)
        except BaseException:
            self._undo_start()
            raise

    def _start(self, config: Config) -> None:
        if config.pool_bytes < config.pool_size:
            log.warning("pool_size %d is not a multiple of extent_size %d: the pool is %d "
                        "bytes (%d bytes unused otherwise)", config.pool_size,
                        config.extent_size, config.pool_bytes,
                        config.pool_size - config.pool_bytes)
        with self.lifecycle.preparing(f"preparing pool: {config.pool_bytes >> 20} MiB at "
                                      f"{config.pool_path}", config.pool_bytes):
            self.pool = Pool(config.pool_path, config.pool_bytes, prefault=config.prefault,
                             lock=config.mlock, keep=config.persist)
        self.paths.start(config, self.pool.array, self._engine_done, self._engine_waited)
        with self.lifecycle.preparing(f"restoring the index from {config.journal}"
                                      if config.persist else "indexing", config.pool_size):
            self.service = Service(config, self.pool, self.paths.engines, self._send)
            self.service.reloader = self.lifecycle.reload
            self.service.later = self.loop.call_soon
        self.service.extra_status = self._extra_status
        if config.disk_path or config.remote:
            with self.lifecycle.preparing("opening the tiers", 0):
                self.service.tiering = Tiering(
                    config, self.service.index, self.pool.array,
                    self.loop.call_soon_threadsafe, self.loop.call_later, time.monotonic,
                    committed=self.service.commit)
        self.service.transfers.on_finished = self.lifecycle.transfer_done
        self.service.on_client = self._watch
        self.kv_events = self.service.kv_events
        if self.kv_events is not None:  # one batch per loop iteration, after its work
            self.kv_events.on_pending = lambda: self.loop.call_soon(self._publish)
            self.kv_events.publisher.on_join = self._heartbeat_due
        self._heartbeat: asyncio.TimerHandle | None = None
        self._last_heartbeat = -HEARTBEAT_EVERY_S
        self._pidfds: dict[int, int] = {}  # pid -> pidfd
        self.ctx = zmq.Context.instance()
        self.router = Router(self.loop, router_socket(self.ctx, config), self.service,
                             self.socket_file)
        self.socket_file.bind(self.router.sock)

    def _undo_start(self) -> None:
        """A start-up that failed (or was stopped) removes what it made: the socket, the
        engines' threads, the pool file (kept when persistence is on), best effort."""
        service, router, pool = (getattr(self, a, None) for a in ("service", "router", "pool"))
        steps = [engine.close for engine in self.paths.engines.values()]
        if service is not None and service.tiering is not None:
            steps.append(service.tiering.close)
        if service is not None and service.kv_events is not None:
            steps.append(lambda: service.kv_events.close(clear=service.persist is None))
        if self.paths.pinner is not None:
            steps.append(self.paths.pinner.release)
        if router is not None:
            steps.append(lambda: router.sock.close(linger=0))
        if self.socket_file.bound is not None:
            steps.append(self.socket_file.unlink)
        if service is not None and service.persist is not None:
            steps.append(service.persist.close)
        if pool is not None:
            steps.append(pool.close)
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - the start-up error is the one to report
                log.exception("cleaning up after a failed start")

    def _extra_status(self) -> dict:
        return {**self.paths.status(), **self.lifecycle.status()}

    # ------------------------------------------------------------ for the lifecycle
    @property
    def inflight(self) -> int:
        return self.service.inflight

    @property
    def stop_requested(self) -> bool:
        return self.stopping.is_set()

    def status(self) -> dict:
        return self.service.status()

    def apply_config(self, config: Config, origins: dict[str, str]) -> None:
        self.config = config
        self.service.reconfigure(config)
        self.service.origins = origins

    def begin_stop(self) -> None:
        self.service.stopping = True  # new work gets BUSY
        self.service.transfers.end_parked()  # their Allocates would get BUSY too
        self.stopping.set()

    # ------------------------------------------------------------ engines
    # Engines report on their own threads; the Transfer's owner finishes it on the loop.
    def _engine_done(self, job: CopyJob, error: Exception | None, seconds: float) -> None:
        self.loop.call_soon_threadsafe(self.service.transfers.complete, job, error, seconds)

    def _engine_waited(self, job: CopyJob) -> None:
        self.loop.call_soon_threadsafe(self.service.transfers.event_waited, job)

    # The service's ``send``: the router is made after the service, before any client.
    def _send(self, identity: bytes, reply: m.Reply) -> None:
        self.router.send(identity, reply)

    # ------------------------------------------------------------ liveness
    def _watch(self, client: Client) -> None:
        pid = client.peer_pid  # a pid the client only claims may be another process's
        if pid <= 0 or pid in self._pidfds:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # not our namespace or already gone; deadlines still clean up
        self._pidfds[pid] = fd
        self.loop.add_reader(fd, self._pid_exited, pid)

    def _pid_exited(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        for identity in self.service.client_by_pid(pid):
            self.service.client_gone(identity)

    # ------------------------------------------------------------ KV events
    def _publish(self) -> None:
        try:
            assert self.kv_events is not None
            self.kv_events.flush()
        except Exception:  # noqa: BLE001 - events are not the data path
            log.exception("publishing KV events failed")

    def _heartbeat_due(self) -> None:
        if self._heartbeat is None and not self.stopping.is_set():
            at = max(self.loop.time() + HEARTBEAT_DELAY_S,
                     self._last_heartbeat + HEARTBEAT_EVERY_S)
            self._heartbeat = self.loop.call_at(at, self._send_heartbeat)

    def _send_heartbeat(self) -> None:
        self._heartbeat, self._last_heartbeat = None, self.loop.time()
        try:
            assert self.kv_events is not None
            self.kv_events.heartbeat()
        except Exception:  # noqa: BLE001 - events are not the data path
            log.exception("publishing a KV events heartbeat failed")

    def _subscriptions(self) -> None:
        assert self.kv_events is not None
        self.kv_events.publisher.drain_subscriptions()
        self.socket_file.guard()  # a subscriber over TCP holds a descriptor too

    def _service_replay(self) -> None:
        assert self.kv_events is not None
        if self.kv_events.publisher.service_replay():  # more waiting: after other work
            self.loop.call_soon(self._service_replay)

    def _tick(self) -> None:
        try:
            self.socket_file.guard(tick=True)
            self.socket_file.check(self.router.sock)
            self.service.tick()
        except Exception:  # noqa: BLE001 - expiry and cleanup must go on ticking
            log.exception("housekeeping tick failed")
        finally:
            if not self.stopping.is_set():
                self._ticking = self.loop.call_later(TICK_S, self._tick)

    # ------------------------------------------------------------ run
    async def run(self) -> None:
        # First: from here a stop is the loop's (a graceful one), no longer start-up's.
        for sig in (signal.SIGINT, signal.SIGTERM):
            serve_signal(self.loop, sig, self.lifecycle.request_stop)
        self.loop_has_signals = True
        self.loop.add_reader(self.router.sock.getsockopt(zmq.FD), self.router.drain)
        if self.kv_events is not None:
            self.loop.add_reader(self.kv_events.publisher.fd, self._subscriptions)
            self._subscriptions()
        replay_fd = self.kv_events.publisher.replay_fd if self.kv_events else None
        if replay_fd is not None:
            assert self.kv_events is not None
            self.loop.add_reader(replay_fd, self._service_replay)
            self._service_replay()
        self._ticking = self.loop.call_later(TICK_S, self._tick)
        self.router.drain()
        log.info("kvd serving on %s: pool %d MiB at %s, policy %s, pid %d",
                 self.config.socket, self.config.pool_bytes >> 20, self.config.pool_path,
                 self.service.policy_name, os.getpid())
        self.lifecycle.started()  # READY=1 once the socket accepts clients
        await self.stopping.wait()
        await self.lifecycle.drain()
        try:
            self.service.finish_evictions()  # answered while the socket is open
        except Exception:  # noqa: BLE001 - the stop goes on: journal, pool, socket file
            log.exception("finishing the evictions under way failed")
        log.info("kvd stopped")
        self.close()
        ignore_stop_signals()

    def close(self) -> None:
        if self._ticking is not None:  # a tick due now would find the journal closed
            self._ticking.cancel()
        self.lifecycle.close()
        self.loop.remove_reader(self.router.sock.getsockopt(zmq.FD))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.kv_events is not None:
            self.loop.remove_reader(self.kv_events.publisher.fd)
            if self.kv_events.publisher.replay_fd is not None:
                self.loop.remove_reader(self.kv_events.publisher.replay_fd)
            self.kv_events.close(clear=self.service.persist is None)
        settled = self.paths.close()
        for fd in self._pidfds.values():
            self.loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()
        # The last replies and Dones leave before the exit (a second at most: a client
        # that reads nothing must not hold the stop up).
        self.router.sock.close(linger=STOP_LINGER_MS)
        self.socket_file.unlink()
        if self.service.persist is not None:
            self.service.persist.drain(self.service.index)
            self.service.persist.close()
        # Then queued tier writes finish (bounded: a stalled disk must not keep the
        # daemon from exiting, nor its journal from being written first); the tiers
        # read the pool, so it closes last.
        if self.service.tiering is not None:
            self.service.tiering.close()
        self.pool.close(mapping=settled)  # the file is kept when persistence is on
        self.ctx.destroy(linger=0)  # waits for the socket's linger; ZeroMQ's threads end


async def serve(config: Config, origins: dict[str, str] | None = None,
                reload_config: ReloadFn | None = None) -> None:
    server = Server(config, origins, reload_config)
    try:
        await server.run()
    except SystemExit:  # a stop in the instant between start-up and the loop's handlers
        if not server.loop_has_signals:
            server._undo_start()
        raise
