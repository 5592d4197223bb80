"""SIGHUP reload and the graceful stop: what changes live, what is refused while stopping,
and that a stop waits (boundedly) for transfers in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid

import msgspec
import pytest
import uvloop

from kvd.access import Access, Peer
from kvd.cli import ctl
from kvd.config import Config
from kvd.engines.host import HostEngine
from kvd.lifecycle import Lifecycle, config_changes
from kvd.notify import Notifier
from kvd.pool import Pool
from kvd.server import Server
from kvd.service import Service
from kvd_client import host_regions
from kvd_proto import messages as m
from kvd_proto.ids import pack_u32
from tests.daemon.workers import Spec, fingerprint, make_memory
from tests.waiting import in_child, wait_for


def wait_log(d, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = d.logs()
        if text in logs:
            return logs
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged:\n{d.logs()[-2000:]}")


def config_json(d, capsys) -> dict:
    assert ctl.main(["--socket", d.socket, "config", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_sighup_applies_live_keys_and_names_the_rest(daemon_factory, tmp_path, capsys):
    f = tmp_path / "kvd.toml"
    f.write_text("max_lease_ms = 1000\ncopy_threads = 2\n")
    d = daemon_factory("--config", str(f), "--metrics-port", "0")
    before = config_json(d, capsys)
    assert before["max_lease_ms"] == {"value": 1000, "origin": f"file {f}"}
    assert before["pool_size"]["origin"] == "flag"

    f.write_text("max_lease_ms = 2000\ncopy_threads = 3\nmax_pending_ms = 5000\n")
    d.proc.send_signal(signal.SIGHUP)
    logs = wait_log(d, "reloaded ")
    assert "max_lease_ms 1000 -> 2000" in logs and "max_pending_ms 600000 -> 5000" in logs
    assert "restart needed for copy_threads (not applied)" in logs
    after = config_json(d, capsys)
    assert after["max_lease_ms"] == {"value": 2000, "origin": f"file {f}"}
    assert after["max_pending_ms"] == {"value": 5000, "origin": f"file {f}"}
    assert after["copy_threads"]["value"] == 2  # a restart applies it

    f.write_text("max_lease_ms = 'soon'\n")
    d.proc.send_signal(signal.SIGHUP)
    wait_log(d, "reload failed, keeping the running configuration")
    assert config_json(d, capsys)["max_lease_ms"]["value"] == 2000
    assert d.stop() == 0


def test_config_changes_split_live_from_restart():
    old = Config(pool_size=64 << 20, extent_size=1 << 20)
    new = Config(pool_size=128 << 20, extent_size=1 << 20, log_level="debug",
                 max_lease_ms=5)
    live, restart = config_changes(old, new)
    assert live == {"log_level": ("info", "debug"), "max_lease_ms": (120_000, 5)}
    assert restart == ["pool_size"]


@pytest.fixture
def service():
    path = f"/dev/shm/kvd-test-{uuid.uuid4().hex[:8]}.pool"
    cfg = Config(pool_size=8 << 20, extent_size=1 << 20, pool_path=path)
    pool = Pool(path, cfg.pool_size, prefault=False)
    sent: list = []
    engine = HostEngine(lambda *a: None, threads=1)  # (a worker registers host memory)
    svc = Service(cfg, pool, {"host": engine}, lambda ident, reply: sent.append(reply))
    yield svc
    engine.close()
    pool.close(unlink=True)


def test_a_reload_applies_the_tenant_limit_to_the_next_register(service):
    ident, me = b"c1", Peer(os.getpid(), os.getuid(), os.getgid())
    assert isinstance(service.handle(ident, me, m.Hello(1, m.PROTOCOL_VERSION, 1)), m.HelloOk)
    assert isinstance(service.handle(ident, me, m.Register(2, fingerprint(Spec("", model="x")), -1)),
                      m.Registered)
    service.reconfigure(Config(pool_size=8 << 20, extent_size=1 << 20,
                               pool_path=service.pool.path, max_tenants=1))
    other = b"c2"
    assert isinstance(service.handle(other, me, m.Hello(3, m.PROTOCOL_VERSION, 1)), m.HelloOk)
    refused = service.handle(other, me, m.Register(4, fingerprint(Spec("", model="y")), -1))
    assert isinstance(refused, m.Error) and "tenant limit (1)" in refused.message


def test_a_reload_that_revokes_a_uid_drops_its_connections(service, monkeypatch):
    """Access was checked at Hello only: a uid taken out of ``allowed_uids`` by a reload
    kept its connection, its stores and leases, and its admin rights until it
    reconnected. Now the reload drops it; its next request is told to Hello again,
    which is refused."""
    base = {"pool_size": 8 << 20, "extent_size": 1 << 20, "pool_path": service.pool.path}
    other = Peer(os.getpid(), 4242, 4242)  # (the kernel's word, in the daemon)
    # This process is not uid 4242's: the host path's owner check would refuse it.
    monkeypatch.setattr("kvd.registration.check_owner", lambda pid, uid: None)
    service.reconfigure(Config(**base, allowed_uids=[4242], admin_uids=[4242]))
    ident = b"other"
    assert isinstance(service.handle(ident, other, m.Hello(1, m.PROTOCOL_VERSION, 1)), m.HelloOk)
    mem = make_memory(Spec("x"))  # a worker's: without one nothing is allocated
    assert isinstance(service.handle(ident, other, m.Register(
        2, fingerprint(Spec("x")), 0, host_regions(mem))), m.Registered)
    keys = [i.to_bytes(8, "little") for i in range(4)]
    assert isinstance(service.handle(ident, other, m.Allocate(3, keys)), m.Allocated)
    assert service.index.pending_blocks == 4
    assert isinstance(service.handle(ident, other, m.Evict(4)), m.Ok)

    service.reconfigure(Config(**base, allowed_uids=[4242]))  # no longer an admin
    refused = service.handle(ident, other, m.Evict(5))
    assert isinstance(refused, m.Error) and refused.code == m.Code.FORBIDDEN
    assert service.index.pending_blocks == 4  # still a client
    # A reload of other keys judges nobody again (a group membership is read from /proc,
    # and a passing failure to read it must not drop a client).
    with monkeypatch.context() as patch:
        patch.setattr(Access, "allowed", lambda self, peer: False)
        service.reconfigure(Config(**base, allowed_uids=[4242], max_lease_ms=5000))
    assert ident in service.clients

    service.reconfigure(Config(**base))  # no longer allowed at all
    assert service.index.pending_blocks == 0 and ident not in service.clients
    gone = service.handle(ident, other, m.Lookup(6, keys))
    assert isinstance(gone, m.Error) and gone.code == m.Code.NOT_REGISTERED
    again = service.handle(ident, other, m.Hello(7, m.PROTOCOL_VERSION, 1))
    assert isinstance(again, m.Error) and again.code == m.Code.FORBIDDEN
    me = Peer(os.getpid(), os.getuid(), os.getgid())  # the daemon's own uid stays in
    assert isinstance(service.handle(b"me", me, m.Hello(8, m.PROTOCOL_VERSION, 1)), m.HelloOk)


def test_stopping_refuses_new_work_with_busy(service):
    ident, me = b"c1", Peer(os.getpid(), os.getuid(), os.getgid())
    assert isinstance(service.handle(ident, me, m.Hello(1, m.PROTOCOL_VERSION, 1)), m.HelloOk)
    service.stopping = True
    reg = service.handle(ident, me, m.Register(2, fingerprint(Spec("x")), -1))
    assert isinstance(reg, m.Error) and reg.code == m.Code.BUSY and "stopping" in reg.message
    done = service.handle(ident, me, m.Transfer(3, 7, m.Direction.LOAD, pack_u32([1]),
                                               pack_u32([1])))
    assert isinstance(done, m.Done) and done.code == m.Code.BUSY and done.event == 7
    assert isinstance(service.handle(ident, me, m.Ping(4)), m.Ok)  # probes still answered
    assert isinstance(service.handle(ident, me, m.Stats(5)), m.StatsOk)
    assert service.status()["counters"]["errors_by_code"] == {"BUSY": 2}


class _FakeDaemon:
    """Just the ``kvd.lifecycle.Daemon`` verbs, with transfers that finish on cue."""

    def __init__(self, inflight: int, stop_timeout_ms: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.config = Config(stop_timeout_ms=stop_timeout_ms)
        self.inflight = inflight
        self.stop_requested = False
        self.calls: list[str] = []

    def status(self) -> dict:
        return {}

    def apply_config(self, config: Config, origins: dict[str, str]) -> None:
        self.config = config

    def begin_stop(self) -> None:
        self.calls.append("begin_stop")
        self.stop_requested = True


def test_stop_waits_for_inflight_transfers():
    async def scenario():
        server = _FakeDaemon(inflight=2, stop_timeout_ms=5000)
        life = Lifecycle(server, notifier=Notifier(None))
        life.status_line = lambda: "x"  # no real service behind this fake
        life.request_stop()
        assert server.stop_requested and life.phase == "stopping"
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, setattr, server, "inflight", 0)
        t0 = time.monotonic()
        await life.drain()
        return time.monotonic() - t0, server.calls

    waited, calls = asyncio.run(scenario())
    assert 0.15 <= waited < 2.0 and calls == ["begin_stop"]


def test_stop_wait_is_bounded_and_a_second_signal_cuts_it_short():
    async def scenario(second_signal: bool):
        server = _FakeDaemon(inflight=1, stop_timeout_ms=300)
        life = Lifecycle(server, notifier=Notifier(None))
        life.status_line = lambda: "x"
        life.request_stop()
        if second_signal:
            life.request_stop()
        t0 = time.monotonic()
        await life.drain()
        return time.monotonic() - t0, server.calls

    waited, calls = asyncio.run(scenario(False))
    assert 0.25 <= waited < 2.0 and calls == ["begin_stop"]
    waited, calls = asyncio.run(scenario(True))
    assert waited < 0.1 and calls == ["begin_stop"]  # the second signal begins no 2nd stop


def test_log_lines_fit_journald(tmp_path):
    import io
    import logging

    from kvd.logs import OneLineFormatter, stream_is_journal

    fmt = OneLineFormatter("%(levelname)s %(name)s: %(message)s", multiline=False,
                           priority=True)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("kvd.x", logging.WARNING, __file__, 1,
                                "client %s joined", ("\x1b[31mevil\nFAKE entry",), sys.exc_info())
    line = fmt.format(rec)
    assert "\n" not in line and "\x1b" not in line
    assert line.startswith("<4>WARNING kvd.x: client \\x1b[31mevil\\nFAKE entry")
    assert "Traceback" in line and "ValueError: boom" in line
    with open(tmp_path / "j", "w") as f:
        st = os.fstat(f.fileno())
        assert stream_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not stream_is_journal(f, {"JOURNAL_STREAM": "1:2"})
        assert not stream_is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def test_a_log_nobody_reads_never_blocks_the_logging_thread(tmp_path):
    """Logging wrote on the event loop's thread: with stdout a pipe nobody read, the
    loop sat in the write once the pipe was full, and every client lost kvd."""
    import logging

    from kvd.logs import NeverBlockingHandler

    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    handler = NeverBlockingHandler(stream, backlog=100)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("kvd.test-pipe")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    lines = [f"line {i} " + "x" * 1000 for i in range(500)]  # 500 KB: the pipe holds 64
    done = threading.Event()

    def emit_all() -> None:
        for line in lines:
            log.info(line)
        done.set()

    t = threading.Thread(target=emit_all, daemon=True)
    t.start()
    try:
        assert done.wait(10), "logging blocked on the full pipe"
        got = b""
        os.set_blocking(read_end, False)  # the reader comes back
        deadline = time.monotonic() + 10
        drained = False
        while True:
            try:
                got += os.read(read_end, 1 << 20)
            except BlockingIOError:
                if drained:  # (read once more after the writer was seen done)
                    break
                drained = not handler._lines and not handler._busy
                assert time.monotonic() < deadline, got[-300:]
                time.sleep(0.01)
        text = got.decode().splitlines()
        kept = [ln for ln in text if ln.startswith("line ")]
        order = [int(ln.split()[1]) for ln in kept]
        assert order == sorted(set(order))  # in order, none twice
        dropped = sum(int(ln.split()[0]) for ln in text if "log lines dropped" in ln)
        assert dropped > 0 and len(kept) + dropped == 500
    finally:
        log.removeHandler(handler)
        os.close(read_end)  # first: a write still blocked fails (EPIPE) rather than hangs
        with contextlib.suppress(OSError):
            stream.close()


def test_lines_still_queued_when_the_log_closes_go_out(monkeypatch):
    """At exit the writer thread, a daemon thread, died with the lines it held: the
    stop's last lines were the ones lost."""
    import logging

    from kvd import logs
    from kvd.logs import NeverBlockingHandler

    monkeypatch.setattr(logs, "CLOSE_WAIT_S", 30.0)  # (it returns once drained)

    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    handler = NeverBlockingHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for i in range(300):  # 300 KB: most wait for the reader
        handler.handle(logging.makeLogRecord({"msg": f"line {i} " + "x" * 1000,
                                              "levelno": logging.INFO}))
    got = bytearray()

    def read() -> None:
        time.sleep(0.3)  # the reader comes back late
        while chunk := os.read(read_end, 1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        handler.close()  # as logging.shutdown does at exit
        stream.close()
        reader.join(10)
        lines = bytes(got).decode().splitlines()
        assert len(lines) == 300 and lines[-1].startswith("line 299 ")
    finally:
        os.close(read_end)


def test_a_log_file_is_written_at_once(tmp_path):
    import logging

    from kvd.logs import NeverBlockingHandler

    with open(tmp_path / "log", "w") as f:
        handler = NeverBlockingHandler(f)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.handle(logging.makeLogRecord({"msg": "now", "levelno": logging.INFO}))
        assert (tmp_path / "log").read_text() == "now\n"  # no thread in between


def test_daemon_log_is_plain_one_line_events(daemon_factory):
    d = daemon_factory("--metrics-port", "0")
    d.stop()
    lines = d.logs().splitlines()
    assert lines and all(re.match(r"(DEBUG|INFO|WARNING|ERROR) kvd[\w.]*: ", ln) for ln in lines)
    assert "\x1b" not in d.logs()


def _daemon_env() -> dict[str, str]:
    """The suite's own KVD_E2E_* switches are not daemon configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVD_E2E")}


def _start_slowly(d):
    """Start ``d`` with a pool large enough (2 GiB) that its start-up can be caught:
    the process, once the pool file exists (the pool is being made)."""
    d.args[d.args.index("--pool-size") + 1] = "2G"
    cmd = [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", d.socket,
           "--pool-path", d.pool_path, *d.args]
    proc = subprocess.Popen(cmd, stdout=open(d.log, "ab"), stderr=subprocess.STDOUT,
                            env=_daemon_env())
    deadline = time.monotonic() + 20
    while not os.path.exists(d.pool_path) and time.monotonic() < deadline:
        time.sleep(0.001)
    return proc


def _run_to_exit(d, timeout: float = 30.0) -> int:
    """Start ``d`` without waiting for it to serve; its exit status."""
    cmd = [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", d.socket,
           "--pool-path", d.pool_path, *d.args]
    with open(d.log, "ab") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env=_daemon_env()).returncode


def test_a_start_that_fails_after_the_pool_exists_leaves_nothing_behind(daemon_factory):
    """The events endpoint is taken; then a socket group that does not exist (checked
    after the socket is bound). Before, the pool file (all of pool_size in tmpfs) and
    the socket stayed behind."""
    import socket as so
    taken = so.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        d = daemon_factory("--events-endpoint", f"tcp://127.0.0.1:{port}", start=False)
        assert _run_to_exit(d) == 1
        assert "cannot bind the events endpoint" in d.logs()
        assert not os.path.exists(d.pool_path) and not os.path.exists(d.socket)
    finally:
        taken.close()
    d = daemon_factory(start=False)
    f = d.log.parent / f"{uuid.uuid4().hex[:6]}.toml"
    f.write_text('socket_group = "no-such-group-kvd"\n')
    d.args += ["--config", str(f)]
    assert _run_to_exit(d) == 1
    assert "socket_group" in d.logs()
    assert not os.path.exists(d.pool_path) and not os.path.exists(d.socket)


def test_a_socket_or_pool_path_that_cannot_be_made_is_one_line_not_a_traceback(
        daemon_factory, tmp_path):
    plain = tmp_path / "a-file"
    plain.write_text("")
    for attr, path, said in (("socket", f"{plain}/kvd.sock", "socket's directory"),
                             ("pool_path", f"{plain}/kvd.pool", "cannot open pool file")):
        d = daemon_factory(start=False)
        setattr(d, attr, path)
        assert _run_to_exit(d) == 1
        assert said in d.logs() and "Traceback" not in d.logs(), d.logs()


def test_a_stopping_daemon_leaves_the_socket_of_the_daemon_that_replaced_it(
        daemon_factory):
    """A's socket file was removed (a tmpfiles clean-up, an operator) and B bound the
    path; A's stop then removed B's socket, and every engine reconnecting afterwards
    served without kvd until B restarted."""
    a = daemon_factory()
    os.kill(a.pid, signal.SIGSTOP)  # (else A binds the removed path again at its tick)
    try:
        os.unlink(a.socket)
        b = daemon_factory(start=False)
        b.socket = a.socket
        b.start()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    time.sleep(0.5)  # A's ticks: the path is B's, left alone
    assert a.stop() == 0
    assert os.path.exists(b.socket)
    assert "pool" in b.status()  # new connections reach B
    assert b.stop() == 0
    assert not os.path.exists(b.socket)  # its own socket, it removes


def test_a_daemon_that_started_meanwhile_keeps_its_socket(daemon_factory):
    """A checked that nobody listened on the socket, then made its pool; B started and
    bound the socket meanwhile. A then took B's live socket for a dead daemon's, unlinked
    it and bound its own: both ran, B unreachable. Now A asks again before it unlinks."""
    a = daemon_factory(start=False)
    a.proc = _start_slowly(a)  # past its first check, making its pool
    os.kill(a.pid, signal.SIGSTOP)  # (and it stays there)
    b = daemon_factory(start=False)
    b.socket = a.socket
    try:
        b.start()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert a.proc.wait(30) != 0
    assert f"another kvd is listening at {a.socket}" in a.logs()
    assert b.status()["pid"] == b.pid  # B kept its socket
    assert not os.path.exists(a.pool_path)  # A left nothing behind


def test_a_stop_during_start_up_exits_cleanly_and_a_reload_waits(daemon_factory):
    """SIGTERM while the pool is still being made: exit 0, nothing left (before: killed
    by the signal, the pool file left). SIGHUP then: ignored until the daemon serves
    (before: killed)."""
    for sig, serving in ((signal.SIGTERM, False), (signal.SIGHUP, True)):
        d = daemon_factory(start=False)
        proc = _start_slowly(d)
        try:
            proc.send_signal(sig)
            if serving:
                deadline = time.monotonic() + 60
                while not os.path.exists(d.socket) and proc.poll() is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert proc.poll() is None and os.path.exists(d.socket), d.logs()
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, d.logs()
            assert not os.path.exists(d.pool_path) and not os.path.exists(d.socket)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_reload_signalled_during_start_up_is_applied_once_serving(daemon_factory):
    """The operator edits the file and sends SIGHUP while a large pool is prepared: the
    signal was ignored, and the edit silently not applied until the next reload."""
    d = daemon_factory(start=False)
    f = d.log.parent / f"{uuid.uuid4().hex[:6]}.toml"
    f.write_text("max_lease_ms = 1000\n")
    d.args += ["--config", str(f)]
    proc = _start_slowly(d)
    try:
        f.write_text("max_lease_ms = 777\n")
        proc.send_signal(signal.SIGHUP)
        d.proc = proc
        assert wait_for(lambda: os.path.exists(d.socket) or proc.poll() is not None, 60)
        assert proc.poll() is None, d.logs()
        assert wait_for(lambda: _config_value(d, "max_lease_ms") == 777, 10), d.logs()
        assert d.stop() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _config_value(d, key: str):
    from kvd_client import Connection

    with Connection(d.socket, name="test-config") as c:
        assert c.wait_up(10)
        reply = c.request(m.GetConfig(c.next_req()), 10)
    return json.loads(reply.values)[key]


def test_reloads_that_would_lock_clients_out_are_refused(daemon_factory, tmp_path, capsys):
    """A group that does not exist would refuse every Hello (kvdctl's too); a client
    timeout of 0 would drop every client at the next tick. The running values stay."""
    f = tmp_path / "kvd.toml"
    f.write_text("client_timeout_ms = 10000\n")
    d = daemon_factory("--config", str(f), "--metrics-port", "0")
    f.write_text('allowed_groups = ["no-such-group-kvd"]\n')
    os.kill(d.pid, signal.SIGHUP)
    assert "reload failed, keeping the running configuration" in wait_log(
        d, "reload failed")
    assert config_json(d, capsys)["allowed_groups"]["value"] == []  # kvdctl still gets in
    f.write_text("client_timeout_ms = 0\n")
    os.kill(d.pid, signal.SIGHUP)
    assert "client_timeout_ms must be at least 1" in wait_log(d, "client_timeout_ms must")
    assert config_json(d, capsys)["client_timeout_ms"]["value"] == 10000
    from kvd.access import Access
    from kvd.errors import ConfigError
    with pytest.raises(ConfigError, match="no-such"):
        Access(Config(allowed_groups=["no-such-group-kvd"]))


@pytest.mark.parametrize("content", [
    b"\xff\xfe\x00 not text",                       # UnicodeDecodeError from tomllib
    b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n",      # RecursionError
    'allowed_groups = ["\u00b2"]\n'.encode(),          # str.isdigit() but not int()
    b'events_topic = "{node.x}"\n',                    # AttributeError from format()
])
def test_a_file_that_fails_to_load_in_any_way_is_a_failed_reload_not_a_dead_daemon(
        daemon_factory, tmp_path, capsys, content):
    """Each of these raised past the reload's ``KvdError`` handler: the serving daemon
    exited 1 and left its socket and pool behind."""
    f = tmp_path / "kvd.toml"
    f.write_text("client_timeout_ms = 10000\n")
    d = daemon_factory("--config", str(f), "--metrics-port", "0")
    f.write_bytes(content)
    os.kill(d.pid, signal.SIGHUP)
    logs = wait_log(d, "reload failed")
    assert "Traceback" not in logs  # typed: one line naming the file
    assert re.search(r"reload failed, keeping the running configuration: .*(kvd\.toml|"
                     r"allowed_groups|events_topic)", logs), logs[-1000:]
    assert d.proc.poll() is None
    assert config_json(d, capsys)["client_timeout_ms"]["value"] == 10000
    assert d.stop() == 0


def test_signals_kvd_does_not_use_are_logged_and_ignored(daemon_factory):
    """SIGUSR1 (a log-rotation script's habit), SIGUSR2 and SIGALRM killed the daemon
    without a log line, leaving its socket and pool behind."""
    d = daemon_factory()
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        os.kill(d.pid, sig)
        wait_log(d, f"signal {sig.name} ignored")
    assert d.proc.poll() is None
    assert ctl.main(["--socket", d.socket, "health"]) == 0
    assert d.stop() == 0


def _serving_lifecycle(asked: list[int]) -> Lifecycle:
    """A serving daemon's lifecycle whose reloads read nothing but count in ``asked``."""
    server = _FakeDaemon(inflight=0, stop_timeout_ms=300)
    life = Lifecycle(server, None, lambda: asked.append(1) or (server.config, {}),
                     notifier=Notifier(None))
    life.status_line = lambda: "x"
    life.phase = "serving"
    return life


@pytest.mark.parametrize(("limit", "warned"), [(256, True), (8192, False)])
def test_a_low_descriptor_limit_is_said_at_start(limit, warned):
    """ZeroMQ aborts the daemon when an accept finds no descriptor left (a hunt ended it
    with 42 connections under a hard limit of 64): raising the soft limit to the hard
    one cannot help there, so the start says so."""
    import logging

    from kvd.cli.serve import raise_fd_limit

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the hard descriptor limit here is below the case's")

    def said() -> bool:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, limit))
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore
        logging.getLogger("kvd").addHandler(handler)
        raise_fd_limit()
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0] == limit
        return raised and any(f"descriptor limit {limit}" in x for x in lines) == warned

    assert in_child(said, 30) == 0


def test_a_reload_names_where_each_running_value_comes_from_now():
    """Origins followed only the live keys whose value changed: a file that stopped
    naming a key (its value the default's) still showed as its source, and a file that
    began naming one at its running value still showed the default."""
    async def scenario():
        server = _FakeDaemon(inflight=0, stop_timeout_ms=300)
        life = Lifecycle(server, {"max_lease_ms": "file a", "max_tenants": "default",
                                  "pool_size": "file a", "log_level": "default"},
                         notifier=Notifier(None))
        new = msgspec.structs.replace(server.config, pool_size=server.config.pool_size * 2,
                                      log_level=server.config.log_level)
        code, _ = life.apply(new, {"max_lease_ms": "default", "max_tenants": "file b",
                                   "pool_size": "file b", "log_level": "env"})
        return code, life.origins

    code, origins = asyncio.run(scenario())
    assert code == m.Code.OK
    assert origins == {"max_lease_ms": "default", "max_tenants": "file b",
                       "pool_size": "file a",  # changed, not applied: still the old one's
                       "log_level": "env"}


def test_a_reload_signal_while_stopping_is_not_applied():
    """systemd would see RELOADING=1 and READY=1 after STOPPING=1."""
    async def scenario():
        asked: list[int] = []
        life = _serving_lifecycle(asked)
        life.reload()
        while life._reading:  # the read runs on its thread
            await asyncio.sleep(0.01)
        assert asked == [1]  # serving: reloaded
        life.request_stop()
        life.reload()
        await life.drain()
        return asked

    assert asyncio.run(scenario()) == [1]


def test_a_reload_whose_thread_cannot_start_fails_and_the_next_one_is_read(monkeypatch,
                                                                          caplog):
    """A thread that could not start (TasksMax, memory) left the reload marked as being
    read for good: every later SIGHUP was put off 'until after it', and nothing applied."""
    async def scenario():
        asked: list[int] = []
        life = _serving_lifecycle(asked)
        start = threading.Thread.start

        def cannot_start(self):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", cannot_start)
        life.reload()
        monkeypatch.setattr(threading.Thread, "start", start)
        assert not life._reading and asked == []
        life.reload()  # the next SIGHUP reads
        while life._reading:
            await asyncio.sleep(0.01)
        return asked

    with caplog.at_level("ERROR", logger="kvd"):
        assert asyncio.run(scenario()) == [1]
    assert "cannot start the thread that reads it" in caplog.text


def test_a_configuration_read_that_hangs_does_not_hold_the_loop():
    """A config file on a network mount that hangs held the event loop (every client)
    for as long as the read. The read runs on a thread; SIGHUPs meanwhile make one
    more read after it; what was read is applied on the loop."""
    gate = threading.Event()

    async def scenario():
        server = _FakeDaemon(inflight=0, stop_timeout_ms=300)
        reads = []

        def read():
            reads.append(threading.current_thread().name)
            assert gate.wait(10)
            return Config(stop_timeout_ms=300, client_timeout_ms=1234 + len(reads)), {}

        life = Lifecycle(server, None, read, notifier=Notifier(None))
        life.status_line = lambda: "x"
        life.phase = "serving"
        life.reload()
        life.reload()
        life.reload()
        started = time.monotonic()
        await asyncio.sleep(0.2)  # the loop runs while the read hangs
        assert time.monotonic() - started < 1
        assert len(reads) == 1 and server.config.client_timeout_ms != 1235
        gate.set()
        deadline = time.monotonic() + 10
        while (len(reads) < 2 or life._reading) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return reads, server.config.client_timeout_ms

    reads, applied = asyncio.run(scenario())
    assert reads == ["kvd-reload", "kvd-reload"]  # the two SIGHUPs during it: one read
    assert applied == 1236


def test_a_drain_queued_before_the_socket_closed_does_nothing_after_it(tmp_path):
    """A copy finishing during the stop queues a drain (``_send``) that the loop's
    shutdown runs after ``close()``: it raised ENOTSOCK from the closed socket."""
    tag = uuid.uuid4().hex[:8]
    cfg = Config(socket=str(tmp_path / f"kvd-{tag}.sock"),
                 pool_path=f"/dev/shm/kvd-test-{tag}.pool", pool_size=8 << 20,
                 extent_size=1 << 20, metrics_port=0)
    outcome: list[BaseException | None] = []

    async def scenario() -> None:
        server = Server(cfg)
        server.loop.call_soon(server.stopping.set)
        await server.run()
        assert server.router.sock.closed
        try:
            server.router.drain()  # what a queued call_soon(drain) does at shutdown
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    def in_thread() -> None:  # (not the main thread: pytest keeps its signal handlers)
        uvloop.run(scenario())

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(30)
    assert not os.path.exists(cfg.pool_path) and not os.path.exists(cfg.socket)
    assert outcome == [None]


@pytest.mark.parametrize("closed", [(2,), (1,), (1, 2)])
def test_a_daemon_started_with_stdout_or_stderr_closed_serves_and_stops_cleanly(tmp_path,
                                                                                closed):
    """``kvd serve 2>&-`` exited 1 without a word (logging found no stderr); with stdout
    closed, uvloop's epoll descriptor took 1 and libuv aborted the process at its stop."""
    from tests.conftest import wait_ready

    tag = uuid.uuid4().hex[:8]
    sock, pool = str(tmp_path / "kvd.sock"), f"/dev/shm/kvd-test-{tag}.pool"
    log = tmp_path / "kvd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", sock, "--pool-path",
             pool, "--pool-size", "64M", "--extent-size", "1M", "--metrics-port", "0",
             "--persist"], stdout=out, stderr=out, env=env,
            preexec_fn=lambda: [os.close(fd) for fd in closed])  # noqa: PLW1509
    try:
        wait_ready(sock, proc, 20, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in (pool, pool + ".journal", pool + ".journal.lock"):
            if os.path.exists(path):
                os.unlink(path)


def test_a_socket_removed_while_serving_is_bound_again(daemon):
    """A removed socket file was never made again: clients connected went on, but a
    restarted engine or kvdctl found nothing and ran without kvd."""
    from kvd_client import Connection

    with Connection(daemon.socket, name="before") as before:
        assert before.wait_up(10)
        os.unlink(daemon.socket)
        assert wait_for(lambda: os.path.exists(daemon.socket), 5)
        with Connection(daemon.socket, name="after", timeout=5) as after:
            assert after.wait_up(10)
            assert after.request(m.Ping(after.next_req()), 5)
        assert before.request(m.Ping(before.next_req()), 5)  # not affected
    assert "was removed while serving: bound again" in daemon.logs()
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket)  # the new one goes at the stop


def test_kvdctl_reload_returns_once_the_file_is_applied_or_refused(daemon_factory, tmp_path,
                                                                    capsys):
    """ExecReload=/bin/kill -HUP returned at once: `systemctl reload kvd && next step`
    ran before the file was read, and a refused file still reloaded "successfully"."""
    f = tmp_path / "kvd.toml"
    f.write_text("max_lease_ms = 5000\n")
    d = daemon_factory("--config", str(f), "--metrics-port", "0")
    f.write_text("max_lease_ms = 7000\ncopy_threads = 1\n")
    assert ctl.main(["--socket", d.socket, "reload"]) == 0
    said = capsys.readouterr().out
    assert "max_lease_ms 5000 -> 7000" in said and "restart needed for copy_threads" in said
    assert config_json(d, capsys)["max_lease_ms"]["value"] == 7000  # applied on return
    f.write_text("max_lease_ms = -1\n")
    assert ctl.main(["--socket", d.socket, "reload"]) == 1
    err = capsys.readouterr().err
    assert "reload failed, keeping the running configuration" in err and "max_lease_ms" in err
    assert config_json(d, capsys)["max_lease_ms"]["value"] == 7000
    # kvd not to be asked on that socket (another path, a kvd from before reload
    # requests): with --pid (systemd's $MAINPID), a SIGHUP instead.
    f.write_text("max_lease_ms = 8000\n")
    nowhere = str(tmp_path / "nowhere.sock")
    assert ctl.main(["--socket", nowhere, "reload"]) == 3
    assert ctl.main(["--socket", nowhere, "reload", "--pid", str(d.pid)]) == 0
    assert "sent SIGHUP to pid" in capsys.readouterr().err
    assert "max_lease_ms 7000 -> 8000" in wait_log(d, "7000 -> 8000")
    pid = d.pid
    assert d.stop() == 0
    # A pid gone is said (it was a traceback); 0 and -1 would signal a group, or all.
    assert ctl.main(["--socket", nowhere, "reload", "--pid", str(pid)]) == 3
    assert "nor signalled" in capsys.readouterr().err
    for pid in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as e:
            ctl.main(["--socket", nowhere, "reload", "--pid", pid])
        assert e.value.code == 2


def test_reload_answers_wait_for_a_read_that_starts_after_them():
    """One asked for while a read is under way is answered by the read after it (the
    file may have changed after the first read began), SIGHUPs and asks alike."""
    async def scenario():
        asked: list[int] = []
        life = _serving_lifecycle(asked)
        server = life.server
        life.reload_config = lambda: asked.append(1) or (  # each read: another value
            msgspec.structs.replace(server.config, max_lease_ms=1000 + len(asked)), {})
        said: list[tuple[str, m.Code, str]] = []
        life.reload(lambda code, text: said.append(("first", code, text)))
        life.reload(lambda code, text: said.append(("second", code, text)))
        while life._reading or life._read_again:
            await asyncio.sleep(0.01)
        life.request_stop()
        life.reload(lambda code, text: said.append(("stopping", code, text)))
        await life.drain()
        return asked, said

    asked, said = asyncio.run(scenario())
    assert asked == [1, 1]  # two reads: the second ask waited for its own
    assert [(w, code) for w, code, _ in said] == [("first", m.Code.OK), ("second", m.Code.OK),
                                                 ("stopping", m.Code.BUSY)]
    assert "-> 1001" in said[0][2] and "1001 -> 1002" in said[1][2]  # its own read
    assert "stopping" in said[2][2]


def test_every_reload_answer_is_given_once_whatever_happens():
    """An apply that raised left the ask queued behind it waiting for good, and a stop
    during a read that hangs (a network mount) left kvdctl waiting out its timeout."""
    async def scenario():
        life = _serving_lifecycle([])
        said: list[tuple[str, m.Code]] = []
        applied = life.apply
        calls: list[int] = []

        def apply_once_broken(new: Config, origins: dict[str, str]):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in applying")
            return applied(new, origins)

        life.apply = apply_once_broken
        life.reload(lambda code, _: said.append(("a", code)))
        life.reload(lambda code, _: said.append(("b", code)))  # the read after a's
        for _ in range(500):  # (a lost read-again would wait here for good)
            if not (life._reading or life._read_again):
                break
            await asyncio.sleep(0.01)
        gate = threading.Event()
        config = life.server.config
        life.reload_config = lambda: gate.wait(10) and (config, {})
        life.reload(lambda code, _: said.append(("c", code)))
        life.reload(lambda code, _: said.append(("d", code)))
        await asyncio.sleep(0.05)
        life.request_stop()  # the read still hangs
        gate.set()
        await life.drain()
        await asyncio.sleep(0.1)  # the read ends after the stop: nobody told twice
        return said

    assert asyncio.run(scenario()) == [("a", m.Code.INTERNAL), ("b", m.Code.OK),
                                       ("c", m.Code.BUSY), ("d", m.Code.BUSY)]
