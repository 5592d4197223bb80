"""Shared helpers for the benchmarks and chaos scripts: a daemon subprocess and tables."""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvd_client import Connection
from kvd_proto import messages as m


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))  # the engine runner and its result lines
from _engine import RESULT_PREFIX  # noqa: E402


def start_engine(config: dict, log: Path, env: dict | None = None) -> subprocess.Popen:
    """A vLLM engine process (``tests/e2e/_engine.py``) in a session of its own, its
    output to ``log`` (a pipe nobody reads would stall it)."""
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/e2e/_engine.py"), "-"],
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=REPO, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config))
    proc.stdin.close()
    return proc


def finish_engine(proc: subprocess.Popen, log: Path, timeout: float = 600) -> list[dict]:
    """Wait for an engine from ``start_engine`` (killed, with its children, past
    ``timeout``); its result dicts. RuntimeError with the log's tail when it failed."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = log.read_text()
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in out.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if proc.returncode or any(r.get("op") == "error" for r in results):
        raise RuntimeError("engine failed:\n" + "\n".join(out.splitlines()[-40:]))
    return results


class DaemonProc:
    """A ``kvd serve`` subprocess on a private socket and pool file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.dir = tempfile.mkdtemp(prefix="kvd-bench-")
        self.socket = os.path.join(self.dir, "kvd.sock")
        self.pool_path = f"/dev/shm/kvd-bench-{tag}.pool"
        self.log_path = os.path.join(self.dir, "kvd.log")
        self.args = list(args)
        self.env = {"KVD_METRICS_PORT": "0", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> DaemonProc:
        log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", self.socket,
             "--pool-path", self.pool_path, *self.args],
            stdout=log, stderr=subprocess.STDOUT, env={**env, **self.env})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log_path).read())
            if os.path.exists(self.socket):
                with Connection(self.socket, timeout=2) as c:
                    if c.wait_up(2):
                        return self
            if time.monotonic() > deadline:
                raise RuntimeError("kvd did not start")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return 0 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9

    def status(self) -> dict:
        with Connection(self.socket, timeout=10) as c:
            assert c.wait_up(10), "kvd not answering"
            return json.loads(c.request(m.Stats(c.next_req()), 10).status)

    def cleanup(self) -> None:
        self.stop()
        for path in (self.pool_path, self.pool_path + ".journal"):
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def daemon(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """A started daemon for the duration of a block; yields (socket, pid)."""
    d = DaemonProc(*args, "--log-level", "warning", env=env)
    try:
        d.start()
        yield d.socket, d.pid
    finally:
        d.cleanup()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of a process and all its live descendants (a vLLM engine with
    its engine-core and worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return total


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    cells += [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns]
              for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def emit(rows: list[dict], columns, as_json: bool, extra: dict | None = None) -> None:
    if as_json:
        print(json.dumps({"rows": rows, **(extra or {})}, indent=2))
    else:
        print_table(rows, columns)
        for k, v in (extra or {}).items():
            print(f"{k}: {v}")
