"""The disk tier on real files: round trips, restarts (close, kill -9, torn journal,
changed geometry), corruption, a hard size bound, and concurrent put/get never serving
another block's bytes."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvd.errors import BreakerOpen, ConfigError, KvdError, TierError
from kvd.journal import Journal
from kvd.tiers import disk as disk_module
from kvd.tiers.base import HEADER_BYTES, BlockHeader, TierBlock, make_tier
from kvd.tiers.disk import FAULT_COOLDOWN_S, DiskTier
from kvd.tiers.disk_files import DATA_FILE, JOURNAL_FILE
from kvd.tiers.disk_index import extent_for
from tests.waiting import in_child

ROOT = Path(__file__).resolve().parents[2]
EXT = 1 << 20
SIZE = 4 * EXT  # 256 slots of 16 KiB
B = 12288  # a 12 KiB block takes a 16 KiB slot
NS, OTHER = b"tenant-a", b"tenant-b"


def payload(ns: bytes, key: bytes, n: int = B, version: int = 0) -> np.ndarray:
    """Bytes unique to (ns, key, version): another block's bytes never pass for them."""
    seed = xxhash.xxh3_64_intdigest(ns + b"/" + key + version.to_bytes(4, "little"))
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def blocks(keys: list[bytes], ns: bytes = NS, n: int = B) -> list[TierBlock]:
    return [TierBlock(k, i, payload(ns, k, n)) for i, k in enumerate(keys)]


def ks(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def read(tier: DiskTier, keys: list[bytes], ns: bytes = NS, n: int = B
         ) -> tuple[int, list[np.ndarray]]:
    outs = [np.zeros(n, dtype=np.uint8) for _ in keys]
    return tier.get_into(ns, keys, outs), outs


def assert_hits(tier: DiskTier, keys: list[bytes], ns: bytes = NS, n: int = B) -> None:
    ok, outs = read(tier, keys, ns, n)
    assert ok == len(keys)
    for k, out in zip(keys, outs):
        assert np.array_equal(out, payload(ns, k, n))


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    yield t
    t.close()


def headers(path: Path) -> dict[tuple[bytes, bytes], tuple[int, int]]:
    """(ns, key) -> (offset, payload length) of each header in the data file (scanning
    its 4 KiB pages; a freed slot may still show an old one)."""
    data = path.read_bytes()
    out = {}
    for off in range(0, len(data), 4096):
        h = BlockHeader.unpack(data[off:off + HEADER_BYTES])
        if h is not None:
            out[(h.ns, h.key)] = (off, h.length)
    return out


def offset_of(path: Path, ns: bytes, key: bytes) -> int:
    """Where the block's header lies in the data file."""
    return headers(path)[(ns, key)][0]


# ------------------------------------------------------------------ round trips
def test_round_trip_two_sizes_two_namespaces(tier):
    small, large = ks("s", 10), ks("l", 5)
    assert tier.put(NS, blocks(small)) == 10
    assert tier.put(NS, blocks(large, n=3 * B)) == 5
    assert tier.put(OTHER, blocks(small[:3], OTHER)) == 3
    assert_hits(tier, small)
    assert_hits(tier, large, n=3 * B)
    assert_hits(tier, small[:3], OTHER)
    assert tier.contains(OTHER, small) == 3  # a tenant never sees another's blocks
    assert read(tier, small[3:4], OTHER)[0] == 0
    assert tier.put(NS, blocks(small)) == 10  # already held: kept, not written again
    st_ = tier.status()
    assert st_["blocks"] == 18 and st_["written_blocks"] == 18
    assert st_["bytes"] == 13 * 16384 + 5 * 40960  # 12 KiB + header -> 16 KiB slots


def test_the_policy_is_sized_to_the_blocks_the_file_holds(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    try:
        assert t.policy.capacity == SIZE // 4096  # no block size known yet
        t.put(NS, blocks(ks("s", 4)))
        assert t.policy.capacity == 4 * (EXT // 16384)
    finally:
        t.close()
    again = DiskTier(str(tmp_path), SIZE, extent_size=EXT)  # sized by its recovery too
    try:
        assert again.status()["blocks"] == 4 and again.policy.capacity == 4 * (EXT // 16384)
    finally:
        again.close()


def test_contains_and_get_into_end_at_the_first_miss_or_wrong_size(tier):
    keys = ks("k", 6)
    tier.put(NS, blocks(keys[:2] + keys[3:]))
    assert tier.contains(NS, keys) == 2
    assert tier.contains(NS, keys[3:]) == 3
    assert tier.contains(NS, []) == 0
    assert read(tier, keys)[0] == 2
    outs = [np.zeros(B, np.uint8), np.zeros(B - 1, np.uint8), np.zeros(B, np.uint8)]
    assert tier.get_into(NS, keys[3:], outs) == 1  # a wrong-sized buffer is a miss...
    assert tier.contains(NS, keys[3:]) == 3  # ...but not a reason to forget the block
    assert tier.status()["corrupt_blocks"] == 0


def test_a_batch_is_written_and_read_in_few_calls(tmp_path, monkeypatch):
    t = DiskTier(str(tmp_path), 8 * EXT, extent_size=EXT)
    calls = {"pwritev": 0, "preadv": 0}
    for name in calls:
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(os, name, counted)
    keys = ks("k", 400)
    assert t.put(NS, blocks(keys)) == 400
    assert calls["pwritev"] <= 2  # adjacent slots, at most 1024 iovecs a call
    assert_hits(t, keys)
    assert calls["preadv"] <= 2
    t.close()


def test_a_bad_sector_is_set_aside_on_write_and_a_miss_on_read(tmp_path, monkeypatch):
    """An I/O error under one slot: a failed write sets its batch's slots aside (the next
    put does not take them again); a read retries slot by slot, so the blocks around
    the bad one still read, the run ends at it, and it is forgotten, never raised."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    now = [0.0]
    t.clock = lambda: now[0]
    real_w, real_r = os.pwritev, os.preadv
    bad: dict[str, int] = {}

    def covers(bufs, off: int) -> bool:
        return off <= bad["at"] < off + sum(memoryview(b).nbytes for b in bufs)

    def pwritev(fd, bufs, off):
        bad.setdefault("at", off)  # the first slot ever written
        if covers(bufs, off):
            raise OSError(errno.EIO, "bad sector")
        return real_w(fd, bufs, off)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with pytest.raises(KvdError):
        t.put(NS, blocks(ks("a", 4)))
    assert t.status()["bad_slots"] == 4 and t.status()["blocks"] == 0
    now[0] += FAULT_COOLDOWN_S  # the tier was off meanwhile (see the fault tests below)
    for r in range(8):  # every later put lands elsewhere
        assert t.put(NS, blocks(ks(f"b{r}-", 4))) == 4
    assert_hits(t, ks("b7-", 4))

    keys = ks("c", 8)
    assert t.put(NS, blocks(keys)) == 8
    bad["at"] = offset_of(tmp_path / DATA_FILE, NS, keys[5])

    def preadv(fd, bufs, off):
        if covers(bufs, off):
            raise OSError(errno.EIO, "bad sector")
        return real_r(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    ok, outs = read(t, keys)
    assert ok == 5  # the five before the bad one, intact
    assert all(np.array_equal(o, payload(NS, k)) for k, o in zip(keys[:5], outs))
    assert t.status()["state"] == "open" and t.contains(NS, keys) == 0  # off a while
    now[0] += FAULT_COOLDOWN_S
    assert t.contains(NS, keys) == 5  # forgotten: the next lookup ends there at once
    assert_hits(t, keys[6:])
    st = t.status()
    assert st["unreadable_blocks"] == 1 and st["bad_slots"] == 5 and st["corrupt_blocks"] == 0
    t.close()


def test_a_journal_error_after_the_data_is_written_keeps_the_blocks(tier, monkeypatch):
    """The blocks are written and indexed before the journal's fsync: an error there
    is logged, not a put that failed (which would count held blocks as dropped)."""
    def broken() -> None:
        raise OSError(5, "journal fsync failed")

    monkeypatch.setattr(tier.journal, "sync", broken)
    assert tier.put(NS, blocks(ks("j", 4))) == 4
    assert_hits(tier, ks("j", 4))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_filesystem_turns_the_tier_off_and_loses_no_slots(
        tmp_path, monkeypatch, code):
    """ENOSPC or EROFS is the filesystem's state, not a bad sector: the slots were set
    aside for good (a full disk for a minute shrank the tier until a restart), and
    every put meanwhile evicted good blocks for writes that then failed."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    now = [0.0]
    t.clock = lambda: now[0]
    held = SIZE // EXT * (EXT // (B + 4096))  # blocks of B (and a header) the file holds
    assert t.put(NS, blocks(ks("a", held))) == held
    real = os.pwritev

    def failing(fd, bufs, off):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(TierError):
        t.put(NS, blocks(ks("b", 4)))  # evicted 4 for room, then failed
    st = t.status()
    assert st["bad_slots"] == 0 and st["state"] == "open" and st["consecutive_failures"] == 1
    assert os.strerror(code) in st["last_error"]
    for r in range(3):  # off: nothing is evicted for writes that would fail
        with pytest.raises(BreakerOpen):
            t.put(NS, blocks(ks(f"c{r}-", 4)))
    assert t.status()["blocks"] == held - 4
    assert t.contains(NS, ks("a", held)[-1:]) == 0  # nor promoted from
    now[0] += FAULT_COOLDOWN_S
    monkeypatch.setattr(os, "pwritev", real)
    assert t.put(NS, blocks(ks("d", 4))) == 4  # the freed slots serve again
    st = t.status()
    assert st["blocks"] == held and st["state"] == "closed" and st["consecutive_failures"] == 0
    assert_hits(t, ks("d", 4))
    t.close()


def test_a_journal_that_cannot_grow_frees_the_slots_it_wrote(tier, monkeypatch):
    """The data is written, but its Puts cannot be journaled (the disk filled): the
    blocks are not held (a restart would not know them) and their slots are free."""
    real = tier.journal.append

    def append(records):
        if any(isinstance(r, disk_module.DiskPut) for r in records):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(records)

    monkeypatch.setattr(tier.journal, "append", append)
    tier.clock = lambda: 0.0
    with pytest.raises(TierError):
        tier.put(NS, blocks(ks("j", 4)))
    st = tier.status()
    assert st["blocks"] == 0 and st["bad_slots"] == 0 and tier.allocator.used_bytes == 0


def test_a_stalled_journal_never_blocks_contains_or_status(tmp_path, monkeypatch):
    """The event loop asks ``contains`` and ``status``: a put stuck in a journal write
    (a frozen filesystem) held the lock they take, so the daemon stopped answering."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    held = SIZE // EXT * (EXT // (B + 4096))
    assert t.put(NS, blocks(ks("a", held))) == held
    stuck, release = threading.Event(), threading.Event()
    real = t.journal.append

    def append(records):
        stuck.set()
        release.wait(30)
        real(records)

    monkeypatch.setattr(t.journal, "append", append)
    writer = threading.Thread(target=t.put, args=(NS, blocks(ks("b", 4))))
    writer.start()
    try:
        assert stuck.wait(10)
        answers: list = []
        asker = threading.Thread(target=lambda: answers.extend(
            [t.contains(NS, ks("a", held)), t.status()["blocks"]]))
        asker.start()
        asker.join(5)
        assert not asker.is_alive() and answers[1] == held - 4
    finally:
        release.set()
        writer.join()
    t.close()


def test_close_gives_up_on_a_write_that_never_ends(tmp_path, monkeypatch):
    """A put stuck on a stalled disk held the lock ``close`` waited for: the daemon
    logged "kvd stopped" and never exited, a second SIGTERM or not."""
    monkeypatch.setattr(disk_module, "CLOSE_WAIT_S", 0.5)
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    stuck, release = threading.Event(), threading.Event()

    def pwritev(fd, bufs, off):
        stuck.set()
        release.wait(30)
        raise OSError(errno.EIO, "device gone")

    monkeypatch.setattr(os, "pwritev", pwritev)
    writer = threading.Thread(target=lambda: pytest.raises(TierError, t.put, NS,
                                                           blocks(ks("a", 2))))
    writer.start()
    try:
        assert stuck.wait(10)
        closer = threading.Thread(target=t.close)
        closer.start()
        closer.join(5)
        assert not closer.is_alive()
        with pytest.raises(TierError, match="closed"):
            t.get_into(NS, ks("a", 1), [np.zeros(B, np.uint8)])
    finally:
        release.set()
        writer.join()


def test_a_journal_that_cannot_be_rewritten_at_start_does_not_stop_the_start(
        tmp_path, monkeypatch):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert t.put(NS, blocks(ks("a", 3))) == 3
    t.close()

    def full(self, records):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Journal, "write_snapshot", full)
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)  # restored, not refused
    st = t.status()
    assert st["restored_blocks"] == 3 and "No space" in st["last_error"]
    # Served at once: the journal as it was names them (the tier was turned off for
    # its fault cooldown, every restored block a miss for 5 s).
    assert st["state"] == "closed"
    assert_hits(t, ks("a", 3))
    t.close()


def test_blocks_that_cannot_fit_are_declined_and_counted(tier):
    big = TierBlock(b"big", 0, np.zeros(EXT, np.uint8))  # + header > an extent
    assert tier.put(NS, [big] + blocks([b"a"])) == 1
    assert tier.status()["declined_blocks"] == 1 and tier.contains(NS, [b"big"]) == 0
    data = np.zeros(4096, np.uint8)
    odd = [TierBlock(b"neg", -1, data), TierBlock(b"deep", 1 << 32, data),
           TierBlock(b"x" * 200, 0, data)]  # fields no header holds: declined, not raised
    assert tier.put(NS, odd + blocks([b"b"])) == 1
    assert tier.status()["declined_blocks"] == 4 and tier.contains(NS, [b"b"]) == 1
    with pytest.raises(ValueError, match="block header"):
        BlockHeader(NS, b"k", 1, 0, depth=-1).pack()


# ------------------------------------------------------------------ restarts
def test_close_and_reopen_serves_the_same_blocks(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("a", 20)))
    t.put(OTHER, blocks(ks("b", 3), OTHER, n=2 * B))
    t.close()
    t.close()  # idempotent
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert t.status()["blocks"] == 23 and t.status()["restored_blocks"] == 23
    assert_hits(t, ks("a", 20))
    assert_hits(t, ks("b", 3), OTHER, n=2 * B)
    t.close()


def flip(path: Path, off: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x10]), off)
    finally:
        os.close(fd)


def test_blocks_survive_a_kill_9_without_close(tmp_path):
    code = (
        "import os\n"
        "from pathlib import Path\n"
        "from kvd.tiers.disk import DiskTier\n"
        "from kvd.tiers.disk_files import DATA_FILE\n"
        "from tests.tiers.test_disk import *\n"
        f"d = Path({str(tmp_path)!r})\n"
        "t = DiskTier(str(d), SIZE, extent_size=EXT)\n"
        "t.put(NS, blocks(ks('k', 40)))\n"
        "t.put(NS, blocks(ks('m', 5), n=5000))\n"
        "flip(d / DATA_FILE, offset_of(d / DATA_FILE, NS, b'k3') + 4000)\n"
        "assert read(t, ks('k', 6))[0] == 3\n"  # k3 is found corrupt and forgotten
        "os.kill(os.getpid(), 9)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       check=False)
    assert r.returncode == -9, r.stderr.decode()
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert t.status()["blocks"] == 44 and t.contains(NS, ks("k", 40)) == 3
    assert_hits(t, ks("k", 40)[:3] + ks("k", 40)[4:])
    assert_hits(t, ks("m", 5), n=5000)
    t.close()


def test_a_journal_removed_while_open_is_written_again(tmp_path):
    """Removed under a running tier (a clean-up job), the journal took appends on an
    unlinked inode: after a kill -9 every block on disk was lost (none served wrong)."""
    code = (
        "import os\n"
        "from pathlib import Path\n"
        "from kvd.tiers.disk import DiskTier\n"
        "from kvd.tiers.disk_files import JOURNAL_FILE\n"
        "from tests.tiers.test_disk import *\n"
        f"d = Path({str(tmp_path)!r})\n"
        "t = DiskTier(str(d), SIZE, extent_size=EXT)\n"
        "t.put(NS, blocks(ks('k', 10)))\n"
        "os.unlink(d / JOURNAL_FILE)\n"
        "t.put(NS, blocks(ks('m', 5)))\n"
        "assert (d / JOURNAL_FILE).exists()\n"
        "t.put(NS, blocks(ks('n', 5)))\n"
        "os.kill(os.getpid(), 9)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       check=False)
    assert r.returncode == -9, r.stderr.decode()
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert t.status()["blocks"] == 20
    for prefix in "kmn":
        assert_hits(t, ks(prefix, 10 if prefix == "k" else 5))
    t.close()


def test_a_torn_journal_tail_loses_nothing_before_it(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("a", 10)))
    t.close()
    with open(tmp_path / JOURNAL_FILE, "ab") as f:
        f.write(b"\x40\x00\x00\x00" + b"\x01" * 8 + b"torn record")
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert_hits(t, ks("a", 10))
    t.put(NS, blocks(ks("b", 5)))  # appended after the (compacted away) torn tail
    t.close()
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert_hits(t, ks("a", 10) + ks("b", 5))
    t.close()


def test_damage_inside_the_journal_is_said_at_start(tmp_path, caplog):
    """A damaged record ends the replay (what it and the records after it named is
    lost, and the start's compaction rewrites the journal without them): as for the
    pool's journal, the start says so instead of losing the blocks in silence."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("p", 20)))
    t.close()
    path = tmp_path / JOURNAL_FILE
    flip(path, path.stat().st_size // 2)
    caplog.set_level(logging.WARNING, logger="kvd")
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    kept = len(t.index.entries)
    assert 0 < kept < 20  # the blocks named before the damage
    said = [r.getMessage() for r in caplog.records if "not intact records" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0]
    t.close()


def test_a_changed_geometry_starts_empty(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("a", 10)))
    t.close()
    t = DiskTier(str(tmp_path), 2 * SIZE, extent_size=EXT)
    assert t.status()["blocks"] == 0 and t.contains(NS, ks("a", 10)) == 0
    assert os.path.getsize(tmp_path / DATA_FILE) == 2 * SIZE
    t.put(NS, blocks(ks("b", 3)))
    t.close()
    t = DiskTier(str(tmp_path), 2 * SIZE, extent_size=EXT // 2)
    assert t.status()["blocks"] == 0
    t.close()


def test_evictions_are_journaled(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, policy="lru", extent_size=EXT)
    for r in range(3):  # 3 x 200 blocks through 256 slots
        t.put(NS, blocks(ks(f"r{r}-", 200)))
    held = t.status()["blocks"]
    t.close()
    t = DiskTier(str(tmp_path), SIZE, policy="lru", extent_size=EXT)
    assert t.status()["blocks"] == held == 256
    assert t.contains(NS, ks("r0-", 1)) == 0  # evicted, and not brought back
    assert_hits(t, ks("r2-", 200))
    t.close()


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="extent"):
        DiskTier(str(tmp_path), EXT // 2, extent_size=EXT)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="cannot create"):
        DiskTier(str(tmp_path / "file" / "disk"), SIZE, extent_size=EXT)
    (tmp_path / "there" / DATA_FILE).mkdir(parents=True)  # there, but not to be opened
    with pytest.raises(ConfigError, match="cannot open"):
        DiskTier(str(tmp_path / "there"), SIZE, extent_size=EXT)
    t = make_tier("disk", path=str(tmp_path / "d"), size=SIZE, extent_size=EXT)
    with pytest.raises(ConfigError, match="in use"):
        DiskTier(str(tmp_path / "d"), SIZE, extent_size=EXT)
    t.close()
    with pytest.raises(KvdError):  # a closed tier: TierError
        t.put(NS, blocks([b"a"]))


def test_a_fifo_for_a_journal_refuses_the_start_at_once(tmp_path):
    """It held the start in open() with no word (systemd's start timeout said the rest)."""
    os.mkfifo(tmp_path / JOURNAL_FILE)

    def refused() -> bool:
        try:
            DiskTier(str(tmp_path), SIZE, extent_size=EXT)
        except ConfigError as e:
            return f"cannot open {tmp_path / JOURNAL_FILE}: not a regular file" in str(e)
        return False

    assert in_child(refused, 10) == 0


def test_a_slot_file_removed_while_open_is_made_again_and_its_blocks_dropped(tmp_path,
                                                                             caplog):
    """Demotions went on into the removed inode with no word: a restart found none of
    them, and a second daemon could take the directory (the lock was on that inode)."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("a", 8)))
    (tmp_path / DATA_FILE).unlink()
    with caplog.at_level(logging.ERROR, logger="kvd.tiers.disk"):
        assert t.put(NS, blocks(ks("b", 8))) == 8
    assert "slot file was removed" in caplog.text
    assert t.contains(NS, ks("a", 1)) == 0  # no restart would find them
    assert_hits(t, ks("b", 8))
    with pytest.raises(ConfigError, match="in use"):  # locked again
        DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.close()
    again = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert again.restored_blocks == 8
    assert_hits(again, ks("b", 8))
    again.close()


def test_a_slot_file_removed_and_taken_by_another_daemon_is_left_to_it(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.put(NS, blocks(ks("a", 8)))
    (tmp_path / DATA_FILE).unlink()
    other = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    other.put(NS, blocks(ks("o", 8)))
    with pytest.raises(KvdError, match="slot file was removed.*another file has taken"):
        t.put(NS, blocks(ks("b", 8)))
    assert t.status()["state"] == "open"  # off: no evictions for writes that would fail
    t.clock = lambda: time.monotonic() + 3600  # and for good: not tried every 5 s
    with pytest.raises(KvdError, match="off after a fault"):
        t.put(NS, blocks(ks("b", 8)))
    assert t.contains(NS, ks("a", 1)) == 0
    other.close()  # stopped: its files stay its own
    with pytest.raises(KvdError, match="off after a fault"):
        t.put(NS, blocks(ks("b", 8)))
    t.close()  # and its journal is not written over the other's
    again = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert again.restored_blocks == 8
    assert_hits(again, ks("o", 8))
    again.close()


# ------------------------------------------------------------------ corruption, size
def test_a_flipped_byte_is_a_miss_forgotten_and_counted(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    keys = ks("k", 5)
    t.put(NS, blocks(keys))
    flip(tmp_path / DATA_FILE, offset_of(tmp_path / DATA_FILE, NS, keys[2]) + 777)
    ok, outs = read(t, keys)
    assert ok == 2  # the run ends at the corrupt block
    for k, out in zip(keys[:2], outs):
        assert np.array_equal(out, payload(NS, k))
    st_ = t.status()
    assert st_["corrupt_blocks"] == 1 and st_["blocks"] == 4
    assert t.contains(NS, keys) == 2
    assert_hits(t, keys[3:])
    t.close()
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)  # forgotten for good
    assert t.contains(NS, keys) == 2 and t.status()["blocks"] == 4
    t.close()


def test_never_beyond_size_and_recent_blocks_stay(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    cap = SIZE // 16384
    for r in range(3 * cap // 32):
        assert t.put(NS, blocks(ks(f"r{r}-", 32))) == 32
        st_ = t.status()
        assert st_["bytes"] <= st_["capacity_bytes"] == SIZE
        assert os.path.getsize(tmp_path / DATA_FILE) == SIZE
    assert st_["blocks"] + st_["evicted_blocks"] == 3 * cap
    assert_hits(t, ks(f"r{r}-", 32))  # the latest batch is there
    t.close()


@pytest.mark.parametrize("size_mib, filled", [(8, 0.6), (64, 0.85), (100, 0.85)])
def test_the_daemons_extent_fits_a_whole_pool_extent_and_fills_the_file(tmp_path, size_mib,
                                                                        filled):
    """With the extent the daemon gives the tier, a block as large as a pool extent is
    held (not declined), and blocks of half a pool extent fill most of the file: with
    the pool's own extent each would take a whole extent for its header's sake. (A file
    under eight pool extents is cut into four, so two block sizes fit: three such
    blocks an extent, and the whole block held its own for a while.)"""
    pool_ext, size = 1 << 20, size_mib << 20
    t = DiskTier(str(tmp_path), size, policy="lru", extent_size=extent_for(pool_ext, size))
    assert t.status()["capacity_bytes"] > size - 8 * 4096
    assert t.put(NS, blocks([b"whole"], n=pool_ext)) == 1
    assert_hits(t, [b"whole"], n=pool_ext)
    half = pool_ext // 2
    for r in range(2 * size // half // 8):  # twice the file, 8 blocks a put
        assert t.put(NS, blocks(ks(f"h{r}-", 8), n=half)) == 8
    st_ = t.status()
    assert st_["bytes"] <= st_["capacity_bytes"]
    assert st_["blocks"] * half >= filled * size
    assert t.counts["declined_blocks"] == 0
    t.close()


@pytest.mark.parametrize("size_mib", [3, 4, 7])
def test_a_file_smaller_than_eight_pool_extents_still_holds_two_block_sizes(tmp_path,
                                                                          size_mib):
    """Below eight pool extents the daemon made the file one extent: one size class at a
    time, so a tenant of another block size wiped every block of the first at its first
    put, however empty the file was. The file is cut into several extents that each
    still hold a block as large as a pool extent."""
    pool_ext, size = 1 << 20, size_mib << 20
    t = DiskTier(str(tmp_path), size, policy="lru", extent_size=extent_for(pool_ext, size))
    assert t.put(NS, blocks(ks("a", 8))) == 8  # 16 KiB slots
    assert t.put(OTHER, blocks(ks("b", 2), OTHER, n=5 * B)) == 2  # 64 KiB slots
    assert_hits(t, ks("a", 8))
    assert_hits(t, ks("b", 2), OTHER, n=5 * B)
    assert t.put(NS, blocks([b"whole"], n=pool_ext)) == 1  # the largest block still fits
    t.close()


def test_two_sizes_share_the_file_by_freeing_whole_extents(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, policy="lru", extent_size=EXT)
    t.put(NS, blocks(ks("s", 256)))  # fills every extent with 16 KiB slots
    assert t.put(NS, blocks(ks("l", 40), n=5 * B)) == 40  # 64 KiB slots: 2.5 extents
    st_ = t.status()
    assert st_["bytes"] <= SIZE and st_["blocks"] == 40 + 64
    assert_hits(t, ks("l", 40), n=5 * B)
    assert_hits(t, ks("s", 256)[-64:])  # the newest small ones were kept
    t.close()


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_one_block_of_another_size_evicts_one_extent_not_the_whole_tier(tmp_path, policy):
    """Another model's first block needs one extent: it empties the least-used one,
    not, in policy order, every extent that still held one recently used block."""
    t = DiskTier(str(tmp_path), SIZE, policy=policy, extent_size=EXT, sync=False)
    small = ks("s", 256)
    assert t.put(NS, blocks(small)) == 256  # every extent full of 16 KiB slots
    for k in small[::64 // 4]:  # a recent use in each extent (64 slots per extent)
        assert t.contains(NS, [k]) == 1
    before = t.counts["evicted_blocks"]
    assert t.put(OTHER, blocks([b"big"], ns=OTHER, n=5 * B)) == 1
    assert t.counts["evicted_blocks"] - before == 64  # one extent, no more
    assert_hits(t, [b"big"], ns=OTHER, n=5 * B)
    held = [k for k in small if t.contains(NS, [k])]
    assert len(held) == 192
    for k in held[::16]:
        assert_hits(t, [k])
    t.close()


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_tenant_that_left_gives_its_extents_up_to_one_still_writing(tmp_path, policy):
    """Its blocks of another size, never read again, stayed for good: the tenant still
    writing evicted its own new blocks within the one extent left to it."""
    t = DiskTier(str(tmp_path), SIZE, policy=policy, extent_size=EXT, sync=False)
    assert t.put(OTHER, blocks(ks("b", 48), ns=OTHER, n=5 * B)) == 48  # 3 of 4 extents
    for step in range(40):
        assert t.put(NS, blocks(ks(f"s{step}-", 8))) == 8
    assert sum(t.contains(OTHER, [k], 5 * B) for k in ks("b", 48)) == 0
    assert sum(t.contains(NS, ks(f"s{step}-", 8)) for step in range(40)) == 256  # all of it
    assert_hits(t, ks("s39-", 8))
    t.close()


# ------------------------------------------------------------------ properties
class DiskModel(RuleBasedStateMachine):
    """Random puts, gets, byte flips and restarts on a tiny tier (two 64 KiB extents, three
    size classes): a hit is always exactly the bytes last stored for its key."""

    SIZES = (100, 3000, 5000, 9000)  # 4, 4, 8 and 12 KiB slots

    @initialize()
    def open(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvd-disk-model-")
        self.tier = DiskTier(self.dir, 2 << 16, policy="lru", extent_size=1 << 16, sync=False)
        self.tier.compact_min_records = 8
        self.expect: dict[tuple[bytes, bytes], np.ndarray] = {}
        self.version = 0

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(ns=st.sampled_from([NS, OTHER]),
          items=st.lists(st.tuples(st.integers(0, 11), st.sampled_from(SIZES)),
                         min_size=1, max_size=8))
    def put(self, ns: bytes, items: list[tuple[int, int]]) -> None:
        self.version += 1
        batch, fresh = [], {}
        for i, n in items:
            key = b"k%d" % i
            data = payload(ns, key, n, self.version)
            batch.append(TierBlock(key, 0, data))
            if not self.tier.contains(ns, [key]):
                fresh.setdefault(key, data)  # the first of a batch wins
        self.tier.put(ns, batch)
        for key, data in fresh.items():
            self.expect[(ns, key)] = data

    @rule(ns=st.sampled_from([NS, OTHER]), keys=st.lists(st.integers(0, 11), max_size=6))
    def get(self, ns: bytes, keys: list[int]) -> None:
        names = [b"k%d" % i for i in keys]
        outs = [np.zeros(len(self.expect.get((ns, k), b"")) or 1, np.uint8) for k in names]
        ok = self.tier.get_into(ns, names, outs)
        assert self.tier.contains(ns, names) >= ok  # a hit stays held
        for k, out in zip(names[:ok], outs):
            assert np.array_equal(out, self.expect[(ns, k)])

    @rule(data=st.data())
    def get_stored(self, data: st.DataObject) -> None:
        """A run of keys stored so far (most still held): hits are the common case."""
        if self.expect:
            ns, _ = data.draw(st.sampled_from(sorted(self.expect)))
            names = data.draw(st.lists(st.sampled_from(
                sorted(k for n, k in self.expect if n == ns)), min_size=1, max_size=6))
            self.get(ns, [int(k[1:]) for k in names])

    @rule(data=st.data())
    def flip_stored(self, data: st.DataObject) -> None:
        """A byte of a stored block's header or payload, then a read of that block."""
        found = headers(Path(self.dir) / DATA_FILE)
        if found:
            ns, key = data.draw(st.sampled_from(sorted(found)))
            off, length = found[(ns, key)]
            # within the file: an earlier flip may have made a header's length huge
            span = min(HEADER_BYTES + length, (Path(self.dir) / DATA_FILE).stat().st_size - off)
            flip(Path(self.dir) / DATA_FILE, off + data.draw(st.integers(0, span - 1)))
            if (ns, key) in self.expect:
                self.get(ns, [int(key[1:])])

    @rule(where=st.integers(0, (2 << 16) - 1))
    def flip(self, where: int) -> None:
        flip(Path(self.dir) / DATA_FILE, where)

    @rule()
    def reopen(self) -> None:
        self.tier.close()
        self.tier = DiskTier(self.dir, 2 << 16, policy="lru", extent_size=1 << 16,
                             sync=False)

    @invariant()
    def bounded(self) -> None:
        st_ = self.tier.status()
        assert st_["bytes"] <= st_["capacity_bytes"] == 2 << 16
        assert os.path.getsize(os.path.join(self.dir, DATA_FILE)) == 2 << 16

    @invariant()
    def slots_name_their_blocks(self) -> None:
        """The slot -> key map that emptying an extent reads agrees with the index."""
        t = self.tier
        assert t.index.slot_key == {p.slot: k for k, p in t.index.entries.items()}


DiskModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                       deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_disk_model = DiskModel.TestCase


def test_a_slot_reused_under_a_read_is_a_miss_not_corruption(tmp_path, monkeypatch):
    t = DiskTier(str(tmp_path), EXT, policy="lru", extent_size=EXT)  # 64 slots
    t.put(NS, blocks(ks("a", 64)))
    real = os.preadv

    def put_first(fd, iov, off):  # a put lands between the lookup and the read
        monkeypatch.setattr(os, "preadv", real)
        t.put(NS, blocks([b"b0"]))  # evicts a0 (least recent) into its slot
        return real(fd, iov, off)
    monkeypatch.setattr(os, "preadv", put_first)
    assert read(t, [b"a0", b"a1"])[0] == 0
    st_ = t.status()
    assert st_["corrupt_blocks"] == 0 and st_["evicted_blocks"] == 1
    assert_hits(t, [b"b0"] + ks("a", 64)[1:])
    t.close()


def test_concurrent_put_and_get_never_serve_another_blocks_bytes(tmp_path):
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT, sync=False)
    universe = ks("k", 600)  # > 256 slots: slots are evicted and reused all along

    def size(key: bytes) -> int:
        return B if key[-1] % 2 else 2 * B  # two size classes

    errors: list[BaseException] = []
    stop = time.monotonic() + 1.5
    hits = [0]

    def writer() -> None:
        rng = np.random.default_rng(1)
        try:
            while time.monotonic() < stop:
                pick = [universe[i] for i in rng.integers(0, len(universe), 24)]
                t.put(NS, [TierBlock(k, 0, payload(NS, k, size(k))) for k in pick])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader() -> None:
        rng = np.random.default_rng(2)
        try:
            while time.monotonic() < stop:
                start = int(rng.integers(0, len(universe) - 8))
                keys = universe[start:start + 8]
                outs = [np.zeros(size(k), np.uint8) for k in keys]
                ok = t.get_into(NS, keys, outs)
                for k, out in zip(keys[:ok], outs):
                    assert np.array_equal(out, payload(NS, k, size(k))), k
                hits[0] += ok
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader),
               threading.Thread(target=reader)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    st_ = t.status()
    assert hits[0] > 0 and st_["evicted_blocks"] > 0
    assert st_["corrupt_blocks"] == 0  # a slot reused under a read is a miss, not corrupt
    t.close()


def test_a_file_that_cannot_have_its_size_refuses_the_start(tmp_path):
    """The slot file is sized (and allocated) at start: no room is a clear error then,
    not a failed write later. Shown under a 1 MiB file-size limit."""
    code = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from kvd.errors import ConfigError
from kvd.tiers.disk import DiskTier
try:
    DiskTier({str(tmp_path)!r}, 8 << 20, extent_size=1 << 20)
except ConfigError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: disk tier") and str(tmp_path) in out.stdout


def test_a_reservation_that_fails_part_way_gives_back_what_it_got(tmp_path, monkeypatch):
    """posix_fallocate that runs out of room keeps the blocks it allocated: a start
    refused for a 200 GB tier on a 73 GB disk left a file holding 72 GB. A new file is
    removed; a kept one (a restart's blocks) is left as it was."""
    real = os.posix_fallocate

    def part_way(fd, off, size):
        real(fd, off, size // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", part_way)
    with pytest.raises(ConfigError, match="cannot reserve"):
        DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert sorted(os.listdir(tmp_path)) == []
    monkeypatch.setattr(os, "posix_fallocate", real)
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    assert t.put(NS, blocks(ks("a", 3))) == 3
    t.close()
    monkeypatch.setattr(os, "posix_fallocate", part_way)
    with pytest.raises(ConfigError):
        DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    monkeypatch.setattr(os, "posix_fallocate", real)
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)  # its blocks still there
    assert t.status()["restored_blocks"] == 3
    assert_hits(t, ks("a", 3))
    t.close()


def test_a_journal_rewrite_that_fails_is_not_tried_at_every_put(tmp_path, monkeypatch):
    """A disk that refuses the journal's snapshot (full, or no permission) got a full
    snapshot of the index, with its fsync, tried again at every put."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    now = [0.0]
    t.clock = lambda: now[0]
    tries = []

    def refused(records):
        tries.append(1)
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(t.journal, "write_snapshot", refused)
    for i in range(6):
        t.keeper.records = 10**6  # a journal long past its rewrite point
        assert t.put(NS, blocks(ks(f"a{i}-", 2))) == 2  # the blocks are held all the same
    assert len(tries) == 1
    now[0] += disk_module.COMPACT_RETRY_S
    t.put(NS, blocks(ks("b", 2)))
    assert len(tries) == 2
    assert_hits(t, ks("a5-", 2))


def test_only_a_data_write_that_fails_with_eio_sets_slots_aside(tmp_path, monkeypatch):
    """A journal that fails with EIO while the evicted blocks' Drops are written (nothing
    written to the new slots yet), and a short write of a filesystem that filled during
    the call, set the batch's slots aside as bad sectors until a restart."""
    t = DiskTier(str(tmp_path), SIZE, extent_size=EXT)
    t.clock = lambda: 0.0
    held = SIZE // EXT * (EXT // (B + 4096))
    assert t.put(NS, blocks(ks("a", held))) == held  # full: the next put evicts
    real_append, real_write = t.journal.append, os.pwritev

    def drops_fail(records):
        if any(isinstance(r, disk_module.DiskDrop) for r in records):
            raise OSError(errno.EIO, "journal I/O error")
        real_append(records)

    monkeypatch.setattr(t.journal, "append", drops_fail)
    with pytest.raises(TierError):
        t.put(NS, blocks(ks("b", 4)))
    assert t.status()["bad_slots"] == 0
    monkeypatch.setattr(t.journal, "append", real_append)
    t.clock = lambda: 1e12  # past the cooldown

    def short(fd, bufs, off):
        return real_write(fd, bufs[:1], off)  # the first buffer fitted, then no room

    monkeypatch.setattr(os, "pwritev", short)
    with pytest.raises(TierError, match="short write"):
        t.put(NS, blocks(ks("c", 4)))
    assert t.status()["bad_slots"] == 0
    monkeypatch.setattr(os, "pwritev", real_write)
    t.clock = lambda: 2e12
    assert t.put(NS, blocks(ks("d", 8))) == 8  # every slot serves again
    t.close()
