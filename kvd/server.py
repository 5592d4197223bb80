"""The event loop and the ROUTER socket.

One uvloop loop owns all daemon state. A synchronous zmq ROUTER socket is driven by
``loop.add_reader`` on its FD (faster here than zmq.asyncio); the FD is edge-triggered,
so the socket is drained until EVENTS has no POLLIN, and again after every send. Copy
threads report through ``call_soon_threadsafe``; clients' pids are watched with pidfds
so a client that dies releases its leases and pending stores at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import time

import msgspec
import zmq

from kvd.access import UNKNOWN_PEER, Access, Peer, peer_address
from kvd.clients import Client
from kvd.config import Config
from kvd.engines.base import CopyJob, TransferEngine
from kvd.engines.client_copy import ClientCopyEngine
from kvd.engines.cuda import CudaEngine, gpu_path
from kvd.engines.host import HostEngine
from kvd.lifecycle import Lifecycle, ReloadFn
from kvd.start_signals import ignore_stop_signals, serve_signal, take_start_signals
from kvd.pinning import PoolPinner
from kvd.errors import ConfigError
from kvd.fd_guard import FdGuard, listening
from kvd.inode import Identity, identity, unlink_if
from kvd.pool import Pool
from kvd.service import Service
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
# Per connection: replies and Dones queued for a client that does not read them (then it
# is dropped: it registers again once it reads), and messages taken in ahead of the loop
# (then its sends wait, and its own queue of 1,000 fills: calls fail at once there).
SEND_HWM = 4096
RECV_HWM = 1000
DRAIN_BATCH = 256  # messages per turn of the loop: completions and timers run between
# Plain ints: pyzmq's enum members cost an object per operation on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_MORE = _NOBLOCK | int(zmq.SNDMORE)


def _reply(sock: zmq.Socket, identity: bytes, reply: m.Reply) -> None:
    """Two sends with int flags: a third of ``send_multipart``'s cost (its enum flags
    and checks are Python). Encoded first, so the identity frame never goes out alone;
    a reply to a peer that is gone is dropped whole (EHOSTUNREACH); ``zmq.Again``: the
    peer's queue is full (it does not read)."""
    data = m.encode(reply)
    sock.send(identity, _MORE)
    sock.send(data, _NOBLOCK)


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
        self.pinner: PoolPinner | None = None
        self.engines: dict[str, TransferEngine] = {}
        self._bound: Identity | None = None  # the socket file this daemon bound
        self._rebind_error = ""  # why the removed socket could not be bound again
        self.fd_guard = FdGuard(config.socket)  # hides it while descriptors run short
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
        self.engines = {
            "host": HostEngine(self._engine_done, threads=config.copy_threads,
                               nice=config.copy_nice,
                               pool=self.pool.array),
            "client_copy": ClientCopyEngine(self._engine_done, self.pool.array),
        }
        if config.cuda:
            self._start_cuda()
        with self.lifecycle.preparing(f"restoring the index from {config.journal}"
                                      if config.persist else "indexing", config.pool_size):
            self.service = Service(config, self.pool, self.engines, self._send)
            self.service.reloader = self.lifecycle.reload
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
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A client is its connection: Hello checked that peer's credentials, and a
        # second connection claiming the same routing id must not inherit them (with
        # handover it would take over the client, its memory and leases, unchecked).
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # The hard cap drops the connection; below it, oversize gets a typed error.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, not drops
        self._bind()

    def _undo_start(self) -> None:
        """A start-up that failed (or was stopped) removes what it made: the socket, the
        engines' threads, the pool file (kept when persistence is on), best effort."""
        service, sock, pool = (getattr(self, a, None) for a in ("service", "sock", "pool"))
        steps = [engine.close for engine in self.engines.values()]
        if service is not None and service.tiering is not None:
            steps.append(service.tiering.close)
        if service is not None and service.kv_events is not None:
            steps.append(lambda: service.kv_events.close(clear=service.persist is None))
        if self.pinner is not None:
            steps.append(self.pinner.release)
        if sock is not None:
            steps.append(lambda: sock.close(linger=0))
        if self._bound is not None:
            steps.append(self._unlink_socket)
        if service is not None and service.persist is not None:
            steps.append(service.persist.close)
        if pool is not None:
            steps.append(pool.close)
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - the start-up error is the one to report
                log.exception("cleaning up after a failed start")

    def _unlink_socket(self) -> None:
        """Remove the socket file this daemon bound, and only it: once the path was
        removed and another daemon bound it, that one's clients must still find it."""
        unlink_if(self.config.socket, self._bound)
        self.fd_guard.unlink_hidden(self._bound)

    def _check_socket(self) -> None:
        """The socket file removed while serving (a cleanup of the directory, a careless
        rm): clients connected go on, but a restarted engine or kvdctl finds nothing
        and runs without kvd. Bound again, as a removed journal is written again; a
        path another daemon has bound since is left to it. The old listener keeps its
        descriptor (one per removal): unbinding it would drop the connected clients."""
        if self._bound is None or self.fd_guard.hidden \
                or os.path.lexists(self.config.socket):
            self._rebind_error = ""
            return
        try:
            self._bind()
        except (ConfigError, OSError) as e:
            if str(e) != self._rebind_error:
                log.error("socket %s was removed and cannot be bound again: %s",
                          self.config.socket, e)
            self._rebind_error = str(e)
            return
        self._rebind_error = ""
        self.fd_guard.recount()  # bound with no count: the next tick counts
        log.warning("socket %s was removed while serving: bound again (clients "
                    "connected before were not affected)", self.config.socket)

    def _bind(self) -> None:
        path = self.config.socket
        directory = os.path.dirname(path) or "."
        try:
            os.makedirs(directory, mode=0o770, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the socket's directory {directory}: "
                              f"{e.strerror}") from None
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigError(f"{path} exists and is not a socket")
            # Asked again: another kvd may have bound it while this one made its pool.
            if listening(path):
                raise ConfigError(f"another kvd is listening at {path} (it started while "
                                  "this one prepared its pool); stop it or give this one "
                                  "another socket")
            os.unlink(path)  # a stale socket of a dead daemon
        try:
            self.sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot bind {path}: {e}") from None
        self._bound = identity(os.stat(path))
        os.chmod(path, self.config.socket_mode)
        if self.config.socket_group:
            import grp

            try:
                gid = grp.getgrnam(self.config.socket_group).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group: no group {self.config.socket_group!r}") from None
            os.chown(path, -1, gid)
            os.chown(directory, -1, gid)
        self.fd_guard.sweep()  # names a daemon killed while hiding its socket left

    def _start_cuda(self) -> None:
        from kvd_client.cudart import CudaUnavailable, CudaVersionMismatch, load

        try:
            api = load()
        except CudaVersionMismatch as e:  # a GPU node with the wrong install: say so loudly
            log.warning("GPU data path off: %s", e)
            return
        except CudaUnavailable as e:
            log.info("no GPU data path: %s", e)
            return
        self.engines["cuda"], self.pinner = gpu_path(self._engine_done, api, self.pool.array,
                                                     on_waited=self._engine_waited)
        self.pinner.start()  # registers the pool in the background; unpinned until then

    def _extra_status(self) -> dict:
        cuda = self.engines.get("cuda")
        return {"pinning": self.pinner.status() if self.pinner else {"state": "unavailable"},
                "data_paths": sorted(self.engines),
                **({"cuda": cuda.stats()} if isinstance(cuda, CudaEngine) else {}),
                **self.lifecycle.status()}

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

    # ------------------------------------------------------------ socket
    def _send(self, identity: bytes, reply: m.Reply) -> None:
        self._reply(identity, reply)
        self.loop.call_soon(self._drain)  # sending can swallow the FD's edge

    def _reply(self, identity: bytes, reply: m.Reply) -> None:
        try:
            _reply(self.sock, identity, reply)
        except zmq.Again:  # SEND_HWM replies wait for it: a client that does not read
            self.service.client_gone(identity, f"does not read its replies ({SEND_HWM} "
                                               "queued): dropped; it registers again")
        except zmq.ZMQError as e:
            log.debug("reply to a vanished peer dropped: %s", e)

    def _drain(self) -> None:
        """Up to DRAIN_BATCH messages, then the rest at the loop's next turn: a client
        that floods the socket must not hold up other clients' Dones and the timers."""
        sock = self.sock
        if sock.closed:  # queued by a late Done before the stop closed it
            return
        for _ in range(DRAIN_BATCH):
            if not sock.get(_EVENTS) & _POLLIN:
                break
            try:  # two recvs: a third of recv_multipart's cost (its RCVMORE checks)
                identity = sock.recv(_NOBLOCK)
                frame = sock.recv(_NOBLOCK, copy=False)
                part, extra = frame, 0
                while part.more:  # a message of several frames: read whole, refused
                    part = sock.recv(_NOBLOCK, copy=False)
                    extra += 1
            except zmq.Again:
                break
            try:
                reply = self._answer(identity, frame, extra)
            except Exception as e:  # noqa: BLE001 - the drain loop must never stop early
                log.exception("internal error")
                reply = self.service.error(0, m.Code.INTERNAL, f"internal error: {e}")
            if reply is not None:
                self._reply(identity, reply)
        else:  # the batch is full: more may wait (the FD signals no edge for them)
            self.loop.call_soon(self._drain)
        try:
            self.service.idle()  # bookkeeping that need not delay the replies
        except Exception:  # noqa: BLE001
            log.exception("idle work failed")

    def _answer(self, identity: bytes, frame: zmq.Frame, extra: int) -> m.Reply | None:
        service = self.service
        if extra:
            return service.error(0, m.Code.BAD_REQUEST, f"expected 1 frame, got {1 + extra}")
        data = frame.buffer
        if len(data) > self.config.max_message_bytes:
            self._heard(identity, frame)
            return service.error(m.peek_req(data), m.Code.BAD_REQUEST,
                                 f"message of {len(data)} bytes exceeds max_message_bytes")
        try:
            msg = m.decode_request(data)
        except (msgspec.MsgspecError, ValueError) as e:
            self._heard(identity, frame)
            return service.error(m.peek_req(data), m.Code.BAD_REQUEST,
                                 f"malformed message: {e}")
        try:
            client = service.clients.get(identity)
            if client is not None and client.address \
                    and peer_address(frame) != client.address:
                # Another connection with a closed one's routing id (its client not yet
                # timed out): it is not that client, and never gets its memory or leases.
                return service.error(getattr(msg, "req", 0), m.Code.NOT_REGISTERED,
                                     "this connection is not the one that said Hello")
            if isinstance(msg, m.Transfer):  # the data path: straight to its owner
                return service.transfers.handle(identity, msg)
            peer = UNKNOWN_PEER
            if isinstance(msg, m.Hello):  # a new connection: one descriptor more
                self.fd_guard.check(self._bound)
                peer = Peer.of(frame)
            return service.handle(identity, peer, msg)
        except Exception as e:  # noqa: BLE001 - no input may crash the daemon
            log.exception("internal error on %s", type(msg).__name__)
            return service.error(getattr(msg, "req", 0), m.Code.INTERNAL,
                                 f"internal error: {e}")

    def _heard(self, identity: bytes, frame: zmq.Frame) -> None:
        """A message this daemon cannot read (a newer client's) is still a sign of life:
        each gets an Error, which keeps the client from pinging, so a client whose
        traffic is such messages was dropped as silent."""
        client = self.service.clients.get(identity)
        if client is not None and (not client.address or peer_address(frame) == client.address):
            client.last_seen = self.service.clock()

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
        self.fd_guard.check(self._bound)  # a subscriber over TCP holds a descriptor too

    def _service_replay(self) -> None:
        assert self.kv_events is not None
        if self.kv_events.publisher.service_replay():  # more waiting: after other work
            self.loop.call_soon(self._service_replay)

    def _tick(self) -> None:
        try:
            self.fd_guard.check(self._bound, tick=True)
            self._check_socket()
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
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        if self.kv_events is not None:
            self.loop.add_reader(self.kv_events.publisher.fd, self._subscriptions)
            self._subscriptions()
        replay_fd = self.kv_events.publisher.replay_fd if self.kv_events else None
        if replay_fd is not None:
            assert self.kv_events is not None
            self.loop.add_reader(replay_fd, self._service_replay)
            self._service_replay()
        self._ticking = self.loop.call_later(TICK_S, self._tick)
        self._drain()
        log.info("kvd serving on %s: pool %d MiB at %s, policy %s, pid %d",
                 self.config.socket, self.config.pool_bytes >> 20, self.config.pool_path,
                 self.service.policy_name, os.getpid())
        self.lifecycle.started()  # READY=1 once the socket accepts clients
        await self.stopping.wait()
        await self.lifecycle.drain()
        log.info("kvd stopped")
        self.close()
        ignore_stop_signals()

    def close(self) -> None:
        if self._ticking is not None:  # a tick due now would find the journal closed
            self._ticking.cancel()
        self.lifecycle.close()
        self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.kv_events is not None:
            self.loop.remove_reader(self.kv_events.publisher.fd)
            if self.kv_events.publisher.replay_fd is not None:
                self.loop.remove_reader(self.kv_events.publisher.replay_fd)
            self.kv_events.close(clear=self.service.persist is None)
        # Copies still running after the engines' wait keep the pool pinned and mapped
        # (the exit ends them; unregistering or unmapping memory under a DMA would not).
        settled = True
        for engine in self.engines.values():  # each closes, settled or not
            settled = engine.close() and settled
        if not settled:
            log.error("copies still in flight at the stop: the pool stays mapped until exit")
        elif self.pinner is not None:
            self.pinner.release()
        for fd in self._pidfds.values():
            self.loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()
        # The last replies and Dones leave before the exit (a second at most: a client
        # that reads nothing must not hold the stop up).
        self.sock.close(linger=STOP_LINGER_MS)
        self._unlink_socket()
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
