"""The systemd notify protocol against a real ``kvd serve``: the test plays systemd by
listening on the datagram socket named by $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time
import uuid

import pytest

from kvd.cli.admin import AdminClient
from kvd.lifecycle import CLOSE_S
from kvd.notify import Notifier
from kvd_proto import messages as m


class FakeSystemd:
    """A datagram socket collecting (monotonic time, {key: value}) per notification."""

    def __init__(self, path: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if path is None:  # abstract, as systemd uses: @name
            name = f"kvd-test-{uuid.uuid4().hex[:12]}"
            self.sock.bind(b"\0" + name.encode())
            self.address = "@" + name
        else:
            self.sock.bind(path)
            self.address = path
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.on_ready: list = []
        self.cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            if fields.get("READY") == "1":
                for hook in self.on_ready:
                    hook()
            with self.cv:
                self.messages.append((time.monotonic(), fields))
                self.cv.notify_all()

    def wait_for(self, key: str, value: str | None = None, timeout: float = 10.0) -> dict:
        def found():
            return next((f for _, f in self.messages
                         if key in f and (value is None or f[key] == value)), None)
        with self.cv:
            assert self.cv.wait_for(lambda: found() is not None, timeout), \
                f"no {key} in {self.messages}"
            return found()

    def times(self, key: str) -> list[float]:
        with self.cv:
            return [t for t, f in self.messages if key in f]

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        self._thread.join(2)


@pytest.fixture
def systemd():
    s = FakeSystemd()
    yield s
    s.close()


def test_ready_comes_once_the_socket_accepts_clients(daemon_factory, systemd):
    d = daemon_factory("--metrics-port", "0", start=False)
    d.env = {"NOTIFY_SOCKET": systemd.address}
    probe: dict = {}

    def at_ready() -> None:  # runs the moment READY=1 arrives, before anything else
        try:
            with AdminClient(d.socket, timeout=2) as c:
                probe["reply"] = c.request(m.Stats)
        except Exception as e:  # noqa: BLE001
            probe["error"] = e

    systemd.on_ready.append(at_ready)
    d.start()
    ready = systemd.wait_for("READY", "1")
    assert isinstance(probe.get("reply"), m.StatsOk), probe
    assert ready["MAINPID"] == str(d.pid)
    assert ready["STATUS"].startswith("serving:") and "clients" in ready["STATUS"]
    # The pool was prepared under an extended start timeout, before READY.
    keys = [list(f) for _, f in systemd.messages]
    extend = next(i for i, k in enumerate(keys) if "EXTEND_TIMEOUT_USEC" in k)
    assert extend < next(i for i, k in enumerate(keys) if "READY" in k)
    assert d.stop() == 0


def test_watchdog_pings_at_half_the_timeout(daemon_factory, systemd):
    d = daemon_factory("--metrics-port", "0", start=False)
    d.env = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "400000"}
    d.start()
    systemd.wait_for("READY", "1")
    time.sleep(2.0)
    pings = systemd.times("WATCHDOG")
    assert len(pings) >= 7, pings  # ~10 expected at 0.2 s
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert 0.15 <= statistics.median(gaps) <= 0.3, gaps
    late = sorted(gaps)[int(len(gaps) * 0.9)]
    assert late < 0.4, gaps  # (almost) never as late as the watchdog timeout itself
    assert d.stop() == 0


def test_no_watchdog_when_it_names_another_process(daemon_factory, systemd):
    d = daemon_factory("--metrics-port", "0", start=False)
    d.env = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "200000",
             "WATCHDOG_PID": "1"}
    d.start()
    systemd.wait_for("READY", "1")
    time.sleep(0.5)
    assert systemd.times("WATCHDOG") == []
    d.stop()


def test_sigterm_sends_stopping_and_exits_zero(daemon_factory, systemd):
    d = daemon_factory("--metrics-port", "0", start=False)
    # Past the unit's TimeoutStopSec=30s: systemd would kill the drain part way.
    d.env = {"NOTIFY_SOCKET": systemd.address, "KVD_STOP_TIMEOUT_MS": "45000"}
    d.start()
    systemd.wait_for("READY", "1")
    d.proc.send_signal(signal.SIGTERM)
    stopping = systemd.wait_for("STOPPING", "1")
    assert stopping["STATUS"].startswith("stopping")
    assert int(stopping["EXTEND_TIMEOUT_USEC"]) >= (45 + CLOSE_S) * 1e6
    assert d.stop() == 0
    assert not os.path.exists(d.socket)
    assert "kvd stopped" in d.logs()


def test_stop_signals_until_it_is_gone_still_exit_zero(daemon_factory):
    """Stop signals keep coming (systemd's, an operator's) while the daemon winds down
    and after its loop is gone: the exit is still a clean one."""
    d = daemon_factory("--metrics-port", "0")
    proc = d.proc
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.001)
    assert proc.wait(5) == 0
    assert "kvd stopped" in d.logs()


def test_filesystem_notify_socket_and_no_socket(tmp_path):
    s = FakeSystemd(str(tmp_path / "notify"))
    try:
        n = Notifier(s.address, watchdog_usec=3_000_000)
        assert n.watchdog_interval == 1.5
        assert n.ready("up") and n.status("busy") and not n.status("busy")  # no repeats
        assert n.extend_timeout(2.5)
        s.wait_for("EXTEND_TIMEOUT_USEC", "2500000")
        assert s.wait_for("READY")["STATUS"] == "up"
        n.close()
    finally:
        s.close()
    quiet = Notifier.from_environ({})
    assert not quiet.enabled and not quiet.ready() and quiet.watchdog_interval == 0
    gone = Notifier(str(tmp_path / "nobody-listens"))
    assert gone.enabled and not gone.watchdog()  # sending never raises


def test_persistent_start_extends_while_restoring_and_says_so(daemon_factory, systemd):
    d = daemon_factory("--metrics-port", "0", start=False)
    d.env = {"NOTIFY_SOCKET": systemd.address, "KVD_PERSIST": "true"}
    d.start()
    ready = systemd.wait_for("READY", "1")
    assert "restored 0 blocks" in ready["STATUS"]
    steps = [f["STATUS"] for _, f in systemd.messages if "EXTEND_TIMEOUT_USEC" in f]
    assert steps[0].startswith("preparing pool") and steps[-1].startswith("restoring the index")
    assert d.stop() == 0
    for leftover in (d.pool_path + ".journal",):
        if os.path.exists(leftover):
            os.unlink(leftover)
