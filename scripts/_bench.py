"""Shared helpers for the benchmarks: a daemon subprocess and table printing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator

from kvd_client import Connection


@contextmanager
def daemon(*args: str) -> Iterator[tuple[str, int]]:
    """A ``kvd serve`` subprocess on a private socket; yields (socket, pid)."""
    tag = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="kvd-bench-")
    sock = os.path.join(tmp, "kvd.sock")
    pool = f"/dev/shm/kvd-bench-{tag}.pool"
    log = open(os.path.join(tmp, "kvd.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli.serve", "serve", "--socket", sock,
         "--pool-path", pool, "--log-level", "warning", *args],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(open(log.name).read())
            if os.path.exists(sock):
                with Connection(sock, timeout=2) as c:
                    if c.wait_up(2):
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("kvd did not start")
            time.sleep(0.05)
        yield sock, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if os.path.exists(pool):
            os.unlink(pool)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
