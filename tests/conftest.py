"""Shared fixtures: a real ``kvd serve`` subprocess on a private socket and pool file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Daemon:
    socket: str
    pool_path: str
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 20.0) -> Daemon:
        cmd = [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", self.socket,
               "--pool-path", self.pool_path, *self.args]
        # The suite's own KVD_E2E_* switches are not daemon configuration.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_E2E")}
        env.update(self.env)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT, env=env)
        wait_ready(self.socket, self.proc, timeout, self.log)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.proc = None
        return rc

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> Daemon:
        self.stop()
        return self.start()

    def status(self) -> dict:
        from kvd_client import Connection
        import json

        from kvd_proto import messages as m

        with Connection(self.socket, name="test-status") as c:
            assert c.wait_up(10), "daemon not answering"
            return json.loads(c.request(m.Stats(c.next_req()), 10).status)

    def wait_counter(self, key: str, at_least: int, timeout: float = 30.0) -> dict:
        """The status once ``counters[key]`` reached ``at_least``, or at the timeout
        (the caller's assertion then says what was missing)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st["counters"][key] >= at_least or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def wait_ready(socket: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    from kvd_client import Connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvd exited with {proc.returncode}:\n{log.read_text()}")
        if os.path.exists(socket):
            with Connection(socket, name="probe", timeout=2) as c:
                if c.wait_up(2):
                    return
        time.sleep(0.05)
    raise RuntimeError(f"kvd did not come up in {timeout}s:\n{log.read_text()}")


def make_daemon(tmp_path: Path, *args: str) -> Daemon:
    tag = uuid.uuid4().hex[:8]
    return Daemon(
        socket=str(tmp_path / f"kvd-{tag}.sock"),
        pool_path=f"/dev/shm/kvd-test-{tag}.pool",
        args=["--pool-size", "64M", "--extent-size", "1M", "--log-level", "debug",
              "--metrics-port", "0", *args],
        log=tmp_path / f"kvd-{tag}.log",
    )


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    made: list[Daemon] = []

    def factory(*args: str, start: bool = True, env: dict[str, str] | None = None) -> Daemon:
        """``env``: settings (KVD_*) for this daemon, over the environment."""
        d = make_daemon(tmp_path, *args)
        d.env = dict(env or {})
        made.append(d)
        return d.start() if start else d

    yield factory
    for d in made:
        # Shown by pytest only when the test failed.
        print(f"--- {d.log.name} ---\n{d.logs()[-4000:] if d.log.exists() else ''}")
        if d.proc is not None:
            d.stop(signal.SIGKILL)
        for path in (d.pool_path, d.pool_path + ".journal", d.pool_path + ".journal.lock"):
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory()


# ------------------------------------------------------------ real Redis servers
def _need_redis() -> None:
    """Skip without redis-server, but fail where the suite must run everything (CI)."""
    from tests.redis_servers import available

    reason = available()
    if reason is None:
        return
    if os.environ.get("KVD_E2E_REQUIRE") == "1":
        pytest.fail(f"KVD_E2E_REQUIRE=1: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A 3-master cluster on loopback, shared by the session; a test that stops it
    starts it again (in a ``finally``)."""
    _need_redis()
    from tests.redis_servers import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_cluster_with_replicas(tmp_path: Path) -> Iterator:
    """Three masters with a replica each, for one test (it may fail a master over)."""
    _need_redis()
    from tests.redis_servers import RedisCluster

    cluster = RedisCluster(tmp_path / "redis-replicated", replicas=1)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator:
    """One standalone (non-cluster) redis-server."""
    _need_redis()
    from tests.redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis")
    try:
        yield server
    finally:
        server.close()
