"""A pool file another process cut or punched a hole in, while the daemon runs: its
blocks are never served (their pages read as zeros, or past the file's end as SIGBUS),
the daemon says so and makes the file whole again, and serves on."""

from __future__ import annotations

import ctypes
import os

import pytest

from kvd.cli import ctl
from kvd_proto.ids import unpack_u32
from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for

_libc = ctypes.CDLL(None, use_errno=True)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def punch(path: str, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        if _libc.fallocate(fd, PUNCH_HOLE, ctypes.c_long(offset), ctypes.c_long(length)):
            pytest.skip(f"cannot punch a hole here: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def cut_and_grow(path: str) -> None:
    size = os.path.getsize(path)
    os.truncate(path, 0)
    os.truncate(path, size)


def cut(path: str) -> None:
    os.truncate(path, 0)


@pytest.mark.parametrize("tamper", [lambda p: punch(p, 0, os.path.getsize(p)),
                                    cut_and_grow, cut], ids=["punch", "cut-and-grow", "cut"])
@pytest.mark.parametrize("verify", [False, True], ids=["", "verify-on-load"])
def test_blocks_of_a_pool_file_tampered_with_are_never_served(daemon_factory, tamper, verify,
                                                              capsys):
    """Loads of blocks stored before a hole was punched ended OK with zeros; a file cut
    short made every copy fail as the client's bad address, and with --verify-on-load
    the daemon died of SIGBUS, without a word."""
    d = daemon_factory(*(["--verify-on-load"] if verify else []))
    spec = Spec(d.socket)
    sched = scheduler(d, spec)
    a, b = Worker(spec), Worker(Spec(d.socket, seed=None))
    try:
        ks = keys(16)
        assert a.store(1, range(16), allocate(sched, ks))[1] == 0
        tamper(d.pool_path)
        assert wait_for(lambda: d.status()["blocks"]["ready"] == 0, 5), d.status()["blocks"]
        assert "blocks may have lost their bytes; 16 blocks dropped" in d.logs()
        assert os.path.getsize(d.pool_path) == 64 << 20  # whole again
        assert lookup(sched, ks).hits == 0  # nothing served from the lost bytes
        assert ctl.main(["--socket", d.socket, "health"]) == 0  # and whole: healthy
        assert "ok: serving" in capsys.readouterr().out
        # The pool serves again: stored anew, loaded back exactly.
        assert a.store(2, range(16, 32), allocate(sched, keys(16, "again")))[1] == 0
        hit = lookup(sched, keys(16, "again"))
        assert hit.hits == 16
        assert b.load(3, range(40, 56), unpack_u32(hit.slots))[1] == 0
        assert b.digest(range(40, 56)) == a.digest(range(16, 32))
        assert d.proc is not None and d.proc.poll() is None
    finally:
        a.close()
        b.close()
        sched.close()
