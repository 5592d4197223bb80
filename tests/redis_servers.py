"""Real ``redis-server`` processes on loopback for the remote-tier tests.

A 3-master cluster (``RedisCluster``) and one standalone server (``RedisServer``), each
in its own directory. Ports are drawn at random from 20000-22767 and checked free, so the
cluster bus ports (+10000) stay below the kernel's ephemeral range and parallel runs do
not collide; a start that loses a race for a port is retried on fresh ports.
No pytest here: the fixtures in ``conftest.py`` decide between skip and fail.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BUS_OFFSET = 10_000  # redis' cluster bus listens on port + 10000
PORT_RANGE = (20_000, 22_767)


def available() -> str | None:
    """None when the servers can run here, else why not."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if not missing:
        return None
    return (f"the remote-tier tests need {' and '.join(missing)} on PATH (Debian: "
            "`apt-get install redis-server`; `make test` installs it)")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, bus: bool = True) -> list[int]:
    """``n`` distinct loopback ports that are free now (and their bus ports)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    ports: list[int] = []
    for _ in range(1000):
        p = rng.randint(*PORT_RANGE)
        if p not in ports and _free(p) and (not bus or _free(p + BUS_OFFSET)):
            ports.append(p)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports in {PORT_RANGE}")


class _Node:
    """One redis-server process with its arguments, log and pid."""

    def __init__(self, port: int, workdir: Path, extra: list[str]) -> None:
        self.port = port
        self.log = workdir / f"redis-{port}.log"
        self.args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                     "--protected-mode", "no", "--dir", str(workdir), "--save", "",
                     "--appendonly", "no", "--daemonize", "no", "--logfile", str(self.log),
                     *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def cli(self, *args: str, timeout: float = 10.0, check: bool = True) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                             timeout=timeout, check=check)
        return out.stdout.decode(errors="replace").strip()

    def wait_up(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False  # exited: the port was taken, or a bad argument
            if self.cli("PING", timeout=2, check=False) == "PONG":
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


class RedisCluster:
    """Three masters (and ``replicas`` replicas of each), slots spread by ``redis-cli
    --cluster create``.

    ``stop()`` takes every node down; ``start()`` brings them back on the same ports and
    node config files, so the same cluster (empty: nothing is persisted) answers again.
    """

    def __init__(self, tmp_dir: str | os.PathLike[str], ports: list[int] | None = None,
                 attempts: int = 3, replicas: int = 0) -> None:
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.created = False
        self.replicas = replicas
        self.added: list[_Node] = []
        for attempt in range(attempts):
            self.ports = list(ports) if ports else free_ports(3 * (1 + replicas))
            self.nodes = [_Node(p, self.dir, [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / f"nodes-{p}.conf"),
                "--cluster-node-timeout", "3000"]) for p in self.ports]
            try:
                self.start()
                return
            except RuntimeError:
                self.stop()
                if ports or attempt == attempts - 1:
                    raise

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 30.0) -> None:
        for n in self.nodes:
            if n.proc is None:
                n.start()
        for n in self.nodes:
            if not n.wait_up():
                raise RuntimeError(f"redis-server on port {n.port} did not come up:\n"
                                   f"{n.tail()}")
        if not self.created:
            addrs = [f"127.0.0.1:{p}" for p in self.ports]
            out = subprocess.run(["redis-cli", "--cluster", "create", *addrs,
                                  "--cluster-replicas", str(self.replicas),
                                  "--cluster-yes"],
                                 capture_output=True, timeout=60, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"cluster create failed:\n{out.stdout.decode()}"
                                   f"{out.stderr.decode()}")
            self.created = True
        self.wait_ok(timeout)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False)
                   for n in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok after {timeout}s:\n"
                           + "\n".join(n.cli("CLUSTER", "INFO", check=False)
                                       for n in self.nodes))

    def stop(self) -> None:
        for n in self.nodes + self.added:
            n.stop()

    def add_node(self, timeout: float = 30.0) -> _Node:
        """A new empty master met by the cluster (owning no slot, so absent from the
        slot map a client read before); stopped with the cluster."""
        port = free_ports(1)[0]
        node = _Node(port, self.dir, ["--cluster-enabled", "yes", "--cluster-config-file",
                                      str(self.dir / f"nodes-{port}.conf"),
                                      "--cluster-node-timeout", "3000"])
        self.added.append(node)
        node.start()
        if not node.wait_up():
            raise RuntimeError(f"redis-server on port {port} did not come up:\n{node.tail()}")
        self.nodes[0].cli("CLUSTER", "MEET", "127.0.0.1", str(port))
        deadline = time.monotonic() + timeout
        while not (all(f":{port}@" in n.cli("CLUSTER", "NODES", check=False)
                       and "handshake" not in n.cli("CLUSTER", "NODES", check=False)
                       for n in self.nodes)
                   and "cluster_state:ok" in node.cli("CLUSTER", "INFO", check=False)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {port} not met by the cluster")
            time.sleep(0.05)
        return node

    def cli(self, *args: str) -> str:
        """``redis-cli -c`` on the first node (redirects followed); its stdout."""
        return self.nodes[0].cli("-c", *args)

    def node_cli(self, i: int, *args: str) -> str:
        """``redis-cli`` on node ``i`` alone (per-node DBSIZE, FLUSHALL, ...)."""
        return self.nodes[i].cli(*args)

    def flush(self) -> None:
        for n in self.nodes:
            n.cli("FLUSHALL")

    def close(self) -> None:
        self.stop()


class RedisServer:
    """One standalone (non-cluster) server."""

    def __init__(self, tmp_dir: str | os.PathLike[str], port: int | None = None,
                 attempts: int = 3) -> None:
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            self.port = port or free_ports(1, bus=False)[0]
            self.node = _Node(self.port, self.dir, [])
            self.node.start()
            if self.node.wait_up():
                return
            tail = self.node.tail()
            self.node.stop()
            if port or attempt == attempts - 1:
                raise RuntimeError(f"redis-server on port {self.port} did not come up:\n{tail}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        return self.node.cli(*args)

    def close(self) -> None:
        self.node.stop()
