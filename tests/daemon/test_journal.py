from __future__ import annotations

import os

import pytest

from kvd.journal import Commit, Drop, Header, Journal, TenantRec, read_records, replay
from tests.waiting import in_child

H = Header(1 << 20, 1 << 16, 4096)


def test_replay_folds_commits_and_drops_in_order(tmp_path):
    path = str(tmp_path / "j")
    j = Journal(path)
    j.append([H, TenantRec(1, "d", "m", 1, [4096]),
              Commit(1, b"a", 0, 0, [2**64 - 1]), Commit(1, b"b", 1, 1, [7]),
              Drop(0), Commit(1, b"c", 0, 2, [9])])
    j.close()
    rp = replay(path)
    assert rp.header == H and rp.records == 6
    assert [(b.key, b.slot) for b in rp.blocks.values()] == [(b"b", 1), (b"c", 0)]
    assert rp.blocks[1].checksums == [7]


def test_a_torn_tail_keeps_everything_before_it(tmp_path):
    path = str(tmp_path / "j")
    j = Journal(path)
    j.append([H, Commit(1, b"a", 0, 0, [2**63 + 5])])
    j.close()
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00\x00" + b"\x00" * 8 + b"torn")
    recs = list(read_records(path))
    assert recs == [H, Commit(1, b"a", 0, 0, [2**63 + 5])]  # 64-bit sums stay exact
    assert replay(path).skipped_bytes == 16  # said, so the start-up can log it
    assert replay(path + "-none").skipped_bytes == 0


def test_rewrite_is_a_compact_snapshot_plus_backlog(tmp_path):
    path = str(tmp_path / "j")
    j = Journal(path)
    j.append([H] + [Commit(1, bytes([i]), i, 0, [i]) for i in range(10)])
    j.write_snapshot([H, Commit(1, b"\x09", 9, 0, [9])])
    j.append([Drop(9)])  # written meanwhile to the old journal...
    j.swap_snapshot([Drop(9)])  # ...and carried over to the new one
    j.append([Commit(1, b"z", 3, 0, [3])])
    j.close()
    rp = replay(path)
    assert [b.key for b in rp.blocks.values()] == [b"z"]
    assert rp.records == 4


def test_a_short_write_leaves_no_torn_frame_between_good_ones(tmp_path, monkeypatch):
    """A full disk writes part of an append: it is taken back and raised, so the
    records appended after it (once there is room) still replay."""
    path = str(tmp_path / "j")
    j = Journal(path)
    j.append([H, Commit(1, b"a", 0, 0, [1])])
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, buf: real(fd, bytes(buf)[:len(buf) // 2]))
    with pytest.raises(OSError, match="of"):
        j.append([Commit(1, b"b", 1, 0, [2])])
    monkeypatch.setattr(os, "write", real)
    j.append([Commit(1, b"c", 2, 0, [3])])
    j.close()
    assert [b.key for b in replay(path).blocks.values()] == [b"a", b"c"]


def test_a_fifo_in_the_journals_place_is_refused_not_waited_on(tmp_path):
    """A start opened the journal without a word and waited in ``open`` for a peer
    that never came (a FIFO put there by mistake): now a typed error, at once."""
    path = str(tmp_path / "j")
    os.mkfifo(path)

    def refused(call) -> bool:
        try:
            call()
        except OSError as e:
            return path in str(e)
        return False

    assert in_child(lambda: refused(lambda: Journal(path)), 10) == 0
    assert in_child(lambda: refused(lambda: list(read_records(path))), 10) == 0


def test_a_snapshot_is_written_in_chunks_and_one_whose_records_fail_leaves_none(
        tmp_path, monkeypatch):
    """Records are framed a chunk at a time (a million alive at once set off full
    garbage collections that held the event loop); an error raised by the iterator
    itself, part way, leaves the journal as it was and no snapshot file behind."""
    from kvd import journal

    monkeypatch.setattr(journal, "SNAPSHOT_CHUNK", 3, raising=False)
    path = str(tmp_path / "j")
    j = Journal(path)
    j.append([H, Commit(1, b"old", 0, 0, [1])])
    made: list[int] = []

    def records(fail_at: int | None = None):
        yield H
        for i in range(10):
            if i == fail_at:
                raise RuntimeError("a record could not be made")
            tmp = path + ".tmp"  # what is written of the snapshot so far
            made.append(os.path.getsize(tmp) if os.path.exists(tmp) else -1)
            yield Commit(1, bytes([i]), i, 0, [i])

    with pytest.raises(RuntimeError):
        j.write_snapshot(records(fail_at=7))
    assert len(made) == 7 and not os.path.exists(path + ".tmp")
    assert made[0] == 0 < made[2] < made[5]  # written while the records are made
    assert list(read_records(path)) == [H, Commit(1, b"old", 0, 0, [1])]
    j.write_snapshot(records())
    j.swap_snapshot([Drop(9)])
    assert [b.key for b in replay(path).blocks.values()] == [bytes([i]) for i in range(9)]
    assert j.bytes == os.path.getsize(path)
    j.close()
