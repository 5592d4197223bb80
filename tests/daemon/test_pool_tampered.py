"""A pool file another process cut or punched a hole in, while the daemon runs: its
blocks are never served (their pages read as zeros, or past the file's end as SIGBUS),
the daemon says so and makes the file whole again, and serves on."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from kvd.cli import ctl
from kvd_proto.ids import unpack_u32
from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.test_pool_space import small_tmpfs  # noqa: F401 - a fixture
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


def test_while_the_pool_cannot_be_made_whole_stores_are_refused_and_said_once(
        daemon_factory, small_tmpfs, capsys):
    """With its filesystem full, the punched pool cannot be reserved again: every tick
    dropped what was stored since and logged an ERROR, four times a second."""
    from kvd_client import RemoteError
    from kvd_proto import messages as m

    pool = str(small_tmpfs / "kvd.pool")
    d = daemon_factory("--pool-size", "8M", "--pool-path", pool)
    spec = Spec(d.socket)
    sched = scheduler(d, spec)
    a = Worker(spec)
    filler = small_tmpfs / "filler"
    try:
        assert a.store(1, range(4), allocate(sched, keys(4)))[1] == 0
        # Held still meanwhile: a tick between the punch and the fill made the pool
        # whole while there was room, and no fault came (under load, now and then).
        d.proc.send_signal(signal.SIGSTOP)
        try:
            punch(pool, 0, 4 << 20)
            with open(filler, "wb") as f:  # the room the hole gave back, and more
                with pytest.raises(OSError):
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: d.status()["pool"]["fault"], 5)
        with pytest.raises(RemoteError) as e:
            allocate(sched, keys(4, "during"))
        assert e.value.code == m.Code.BUSY and "refused until it is whole" in e.value.message
        assert ctl.main(["--socket", d.socket, "health"]) == 1
        assert "unhealthy: the pool file lost part of its memory" in capsys.readouterr().out
        time.sleep(1)  # four ticks: said once
        assert d.logs().count("its blocks may have lost their bytes") == 1
        filler.unlink()  # room again: made whole at the next tick
        assert wait_for(lambda: not d.status()["pool"]["fault"], 5)
        assert "is whole again: stores are taken again" in d.logs()
        assert a.store(2, range(4, 8), allocate(sched, keys(4, "after")))[1] == 0
    finally:
        a.close()
        sched.close()


@pytest.mark.parametrize("persist", [False, True], ids=["", "persist"])
def test_a_pool_file_removed_is_said_once_and_its_blocks_still_served(daemon_factory,
                                                                      persist):
    """Removed (a clean-up of /dev/shm), the file's memory serves on, unlike a cut
    one; with persistence, the next start would find nothing, which nobody was told."""
    d = daemon_factory(*(["--persist"] if persist else []))
    spec = Spec(d.socket)
    sched = scheduler(d, spec)
    a, b = Worker(spec), Worker(Spec(d.socket, seed=None))
    try:
        ks = keys(8)
        assert a.store(1, range(8), allocate(sched, ks))[1] == 0
        os.unlink(d.pool_path)
        said = "next start will not find them" if persist else "serves on from its memory"
        assert wait_for(lambda: said in d.logs(), 5)
        time.sleep(0.6)  # more ticks: once
        assert d.logs().count("was removed") == 1
        hit = lookup(sched, ks)
        assert hit.hits == 8
        assert b.load(2, range(8), unpack_u32(hit.slots))[1] == 0
        assert b.digest(range(8)) == a.digest(range(8))
    finally:
        a.close()
        b.close()
        sched.close()
