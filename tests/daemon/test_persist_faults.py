"""The pool journal when the disk fails: the daemon keeps serving, nothing wrong is kept.

Disk errors are injected at ``os.write`` (a full disk cannot be made without a mount);
everything else is the real journal, index and policy."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import numpy as np
import pytest

from kvd import persist
from kvd.core.allocator import Allocator
from kvd.core.index import NO_SLOT, Index
from kvd.core.policies import make_policy
from kvd.core.tenants import Tenants
from kvd.errors import ConfigError
from kvd.journal import Commit, Header, Journal, TenantRec, read_records, replay
from kvd.persist import Persistence
from tests.waiting import in_child

BLOCK = 4096
H = Header(16 * BLOCK, 4 * BLOCK, BLOCK)


def full_disk(fd, buf):
    raise OSError(errno.ENOSPC, "No space left on device")


def setup(path: str):
    ix = Index(Allocator(16 * BLOCK, 4 * BLOCK, 1024), make_policy("lru", 16), record=True)
    tenants = Tenants()
    t = tenants.get_or_create("t", model="m", tp_size=1, rank_page_bytes=(BLOCK,))
    p = Persistence(path, H)
    p.recover(ix, tenants, np.zeros(16 * BLOCK, np.uint8), reused=True)
    p.tenant_added(t)
    return ix, tenants, t, p


def store(ix, t, p, keys: list[bytes]) -> None:
    r = ix.allocate(t, keys)
    ix.store_done(np.array([s for s in r.slots if s != NO_SLOT], dtype=np.int64), 0,
                  [7] * len(keys))
    p.drain(ix)


def test_lost_journal_records_are_written_again_by_the_next_snapshot(tmp_path, monkeypatch):
    path = str(tmp_path / "pool.journal")
    monkeypatch.setattr(persist, "RETRY_S", 0.0)
    ix, tenants, t, p = setup(path)
    keys = [bytes([i]) * 8 for i in range(4)]
    store(ix, t, p, keys[:2])
    real = os.write
    monkeypatch.setattr(os, "write", full_disk)
    store(ix, t, p, keys[2:])  # no error reaches the caller: the index change stands
    assert p.recovery.errors == 1 and ix.events == []
    assert {b.key for b in replay(path).blocks.values()} == set(keys[:2])  # a gap
    monkeypatch.setattr(os, "write", real)  # room again
    p.maybe_compact(ix, tenants)  # records were lost: a full snapshot, however small
    assert p._compacting is not None
    # What lived before is out of the collector's full passes while the thread makes
    # records (each pass read it all, holding the loop), and back in once it is done.
    assert gc.get_freeze_count() > 0
    p._compacting.join()
    p.finish_compaction()
    assert gc.get_freeze_count() == 0
    assert {b.key for b in replay(path).blocks.values()} == set(keys)
    store(ix, t, p, [b"late" * 2])  # appends go on into the new journal
    assert len(replay(path).blocks) == 5
    p.close()


def test_a_failed_compaction_keeps_the_journal_and_is_retried(tmp_path, monkeypatch):
    path = str(tmp_path / "pool.journal")
    ix, tenants, t, p = setup(path)
    for i in range(15):  # churn: commits and drops, many more records than blocks
        store(ix, t, p, [bytes([i, j]) * 4 for j in range(4)])
    store(ix, t, p, [b"a" * 8, b"b" * 8])
    before = Path(path).read_bytes()
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, buf: real(fd, bytes(buf)[:len(buf) // 2]))
    with pytest.raises(OSError, match="short write"):
        p.journal.write_snapshot(p.snapshot(ix, tenants))  # a cut snapshot is no journal
    assert not os.path.exists(path + ".tmp")
    monkeypatch.setattr(persist, "COMPACT_MIN_RECORDS", 0)
    p.maybe_compact(ix, tenants)
    assert p._compacting is not None
    p._compacting.join()
    p.finish_compaction()  # the thread's snapshot failed the same way: logged, kept
    assert gc.get_freeze_count() == 0
    assert p.recovery.errors == 1 and Path(path).read_bytes() == before
    assert not os.path.exists(path + ".tmp")
    monkeypatch.setattr(os, "write", real)
    p.maybe_compact(ix, tenants)
    assert p._compacting is None  # backed off: not a snapshot every tick on a full disk
    p.close()
    assert [r for r in read_records(path) if isinstance(r, Commit)][-1].key == b"b" * 8


def test_a_journal_that_cannot_be_written_at_start_leaves_persistence_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ix, _, t, p = setup(str(blocker / "pool.journal"))  # ENOTDIR, even for root
    assert p.journal is None and p.recovery.errors == 1
    store(ix, t, p, [b"x" * 8])  # serving goes on, unjournaled
    assert ix.ready_blocks == 1 and ix.events == []
    p.close()


def test_an_unreadable_journal_starts_an_empty_pool(tmp_path):
    path = tmp_path / "pool.journal"
    path.mkdir()  # EISDIR on read and on the rewrite
    ix, _, _, p = setup(str(path))
    assert p.recovery.discarded.startswith("journal unreadable")
    assert p.journal is None and ix.ready_blocks == 0
    p.close()


def test_a_fifo_for_a_journal_starts_an_empty_pool_without_persistence(tmp_path):
    path = tmp_path / "pool.journal"
    os.mkfifo(path)  # the start waited in open() for a writer, for good

    def started() -> bool:
        ix, _, _, p = setup(str(path))
        return (p.recovery.discarded.startswith("journal unreadable")
                and p.journal is None and ix.ready_blocks == 0)

    assert in_child(started, 10) == 0


def test_one_daemon_per_journal(tmp_path):
    """Two daemons (two pools) on one journal_path restored each other's blocks after a
    restart, or dropped their own: the second is refused while the first holds it."""
    path = str(tmp_path / "j")
    ix, tenants, t, p = setup(path)
    with pytest.raises(ConfigError, match="in use by another kvd"):
        Persistence(path, H)
    p.close()
    assert not os.path.exists(path + ".lock")  # a clean stop leaves no lock file
    Persistence(path, H).close()  # free again once the first is gone


@pytest.mark.parametrize("bad", [
    {"tp_size": 0}, {"rank_page_bytes": []}, {"rank_page_bytes": [-4096]},
    {"id": -1}, {"id": 1 << 40}, {"id": (1 << 32) - 1},
])
def test_a_journal_tenant_kvd_cannot_make_is_left_out_and_the_rest_restored(tmp_path, bad):
    """A well-framed tenant record with fields kvd never writes (another writer's) made
    every start fail (a crash loop until the journal was removed), or, with the largest
    id, every new tenant's Register after it."""
    path = str(tmp_path / "pool.journal")
    fields = {"id": 2, "digest": "bad", "model": "m", "tp_size": 1,
              "rank_page_bytes": [BLOCK], **bad}
    j = Journal(path)
    j.append([H, TenantRec(**fields), Commit(fields["id"], b"k", 0, 0, [7])])
    j.close()
    ix, tenants, t, p = setup(path)
    assert tenants.get(fields["id"]) is None
    fresh = tenants.get_or_create("other", model="m2", tp_size=1, rank_page_bytes=(BLOCK,))
    assert 0 < fresh.id < 1 << 31 and fresh.prefix  # a new tenant still gets an id
    store(ix, t, p, [b"x" * 8])
    assert ix.ready_blocks == 1
    p.close()


def test_a_compaction_stuck_at_the_stop_does_not_leave_the_collector_frozen(
        tmp_path, monkeypatch):
    """The stop gives up on a snapshot write that does not end: what the compaction
    left out of the collector's passes is back in them (cycles among it were never
    collected again in that process)."""
    import threading

    path = str(tmp_path / "pool.journal")
    monkeypatch.setattr(persist, "CLOSE_WAIT_S", 0.05)
    ix, tenants, t, p = setup(path)
    store(ix, t, p, [b"a" * 8])
    stuck = threading.Event()
    write = p.journal.write_snapshot
    monkeypatch.setattr(p.journal, "write_snapshot",
                        lambda records: (stuck.wait(10), write(records)))
    p._dirty = True
    p.maybe_compact(ix, tenants)
    assert gc.get_freeze_count() > 0
    try:
        p.close()
        assert gc.get_freeze_count() == 0
    finally:
        stuck.set()


def test_a_start_restoring_many_blocks_holds_the_collector_off(tmp_path):
    """Each full collection read every object made so far: at a million blocks about
    half of a start. One pass at the end, and the collector on again."""
    path = str(tmp_path / "pool.journal")
    ix, tenants, t, p = setup(path)
    for i in range(20):
        store(ix, t, p, [bytes([i, j]) * 4 for j in range(4)])
    p.close()
    ix2 = Index(Allocator(16 * BLOCK, 4 * BLOCK, 1024), make_policy("lru", 16), record=True)
    p2 = Persistence(path, H)
    runs: list[int] = []

    def counted(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])
    gc.callbacks.append(counted)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at every object made: many, were it on
    try:
        rec = p2.recover(ix2, Tenants(), np.zeros(16 * BLOCK, np.uint8), reused=True)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(counted)
    assert rec.restored + rec.corrupt == 16 and gc.isenabled()
    assert runs.count(2) == 1 and len(runs) < 20  # (thousands with it on)
    p2.close()
