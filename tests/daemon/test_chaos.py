"""The chaos, fuzz and load runs of scripts/, sized for CI (the scripts take counts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _bench import DaemonProc  # noqa: E402
from _chaos import kill_clients, kill_daemon  # noqa: E402
from bench_load import run as load_run  # noqa: E402
from fuzz_daemon import fuzz  # noqa: E402


@pytest.fixture
def proc():
    made: list[DaemonProc] = []

    def make(*args: str, env: dict[str, str] | None = None) -> DaemonProc:
        d = DaemonProc("--pool-size", "256M", "--extent-size", "16M", *args, env=env)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.cleanup()


def test_clients_killed_mid_transfer_leak_nothing(proc):
    d = proc()
    rows = kill_clients(d.socket, 3, d.status)
    for r in rows:
        assert (r["pending"], r["pinned"], r["leases"]) == (0, 0, 0)
        assert r["used_bytes"] == r["ready_bytes"]  # no slot held by a dead client
        assert r["released_s"] < 2.0


def test_daemon_killed_under_stores_restores_every_committed_block(proc):
    d = proc(env={"KVD_PERSIST": "true"})
    rows = kill_daemon(d, rounds=2, writers=1, min_s=2.5, max_s=3.0, rate=800)
    assert rows[-1]["committed"] > 0, "no store committed before the kills"
    for r in rows:
        assert r["missing"] == 0 and r["corrupt_loaded"] == 0 and r["evicted"] == 0


def test_fuzzed_messages_are_all_answered(proc):
    d = proc()
    res = fuzz(d.socket, d.pid, 3000, seed=7)
    assert res["unanswered"] == 0
    assert res["legit_blocks_intact"]
    assert d.proc is not None and d.proc.poll() is None
    assert res["rss_growth_mb"] < 32


def test_concurrent_clients_see_zero_errors(proc):
    d = proc()
    res = load_run(d.socket, clients=4, ops=150)
    assert res["errors"] == 0, res["first_errors"]
    assert res["ops"] == 600
