"""Warm restart with a real daemon killed by SIGKILL: committed blocks come back,
verified by checksum; a corrupted or torn block is never served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

from kvd.journal import Commit, TenantRec, read_records
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32
from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for

PAGES = (8192, 4096)


def persistent(daemon_factory, *extra: str, verify: bool = False):
    d = daemon_factory(start=False)
    d.env = {"KVD_PERSIST": "true", "KVD_VERIFY_ON_LOAD": "true" if verify else "false"}
    d.args += list(extra)
    return d.start()


def store(d, n: int, tag: str = "k"):
    spec = Spec(d.socket, pages=PAGES)
    sched = scheduler(d, spec)
    w = Worker(spec)
    ks = keys(n, tag)
    slots = allocate(sched, ks)
    assert w.store(1, range(n), slots)[1] == 0
    digest = w.digest(range(n))
    w.close()
    sched.close()
    return ks, slots, digest


def load_digest(d, ks: list[bytes]) -> tuple[int, str | None, int]:
    spec = Spec(d.socket, pages=PAGES)
    sched = scheduler(d, spec)
    r = Worker(Spec(d.socket, pages=PAGES, seed=None))
    try:
        hit = lookup(sched, ks)
        if not hit.hits:
            return 0, None, 0
        done = r.load(2, range(hit.hits), unpack_u32(hit.slots))
        return hit.hits, r.digest(range(hit.hits)), done[1]
    finally:
        r.close()
        sched.close()


def test_kill9_then_restart_restores_committed_blocks(daemon_factory):
    d = persistent(daemon_factory)
    ks, _, digest = store(d, 12)
    d.kill()
    d.start()
    hits, got, code = load_digest(d, ks)
    assert (hits, code) == (12, 0) and got == digest
    st = d.status()
    assert st["blocks"]["ready"] == 12 and st["tenants"][0]["blocks"] == 12
    # Stored again after the restart: the keys are known, nothing is re-allocated.
    spec = Spec(d.socket, pages=PAGES)
    sched, worker = scheduler(d, spec), Worker(spec)
    r = sched.request(m.Allocate(sched.next_req(), ks))
    assert unpack_u32(r.slots).tolist() == [0xFFFFFFFF] * 12
    worker.close()
    sched.close()


def test_tenants_dropped_at_the_tenant_limit_do_not_come_back_at_restart(daemon_factory):
    """A tenant dropped to make room leaves no journal record of its own: restored
    with the others, the daemon held more tenants than its limit after a restart."""
    d = daemon_factory(start=False)
    d.env = {"KVD_PERSIST": "true", "KVD_MAX_TENANTS": "2"}
    d.start()
    ks, _, digest = store(d, 4)  # tenant 1, idle, with blocks
    for model in ("b", "c"):  # b: idle, no block; c's Register drops it
        sched = scheduler(d, Spec(d.socket, model=model, pages=PAGES))
        sched.close()
        assert wait_for(lambda: all(t["clients"] == 0 for t in d.status()["tenants"]), 20)
    assert sorted(t["model"] for t in d.status()["tenants"]) == ["c", "tiny"]
    d.kill()
    d.start()
    assert sorted(t["model"] for t in d.status()["tenants"]) == ["c", "tiny"]
    hits, got, code = load_digest(d, ks)
    assert (hits, code) == (4, 0) and got == digest



def test_a_tenant_dropped_at_the_limit_stays_gone_after_a_restart_with_a_higher_one(
        daemon_factory):
    """The journal still named a tenant dropped to make room: restarted under a higher
    limit (nothing over it for the restore to drop), it came back, blockless, taking a
    place. The drop has the next tick rewrite the journal."""
    d = daemon_factory(start=False)
    d.env = {"KVD_PERSIST": "true", "KVD_MAX_TENANTS": "2"}
    d.start()
    store(d, 4)
    for model in ("b", "c"):  # c's Register drops b
        sched = scheduler(d, Spec(d.socket, model=model, pages=PAGES))
        sched.close()
        assert wait_for(lambda: all(t["clients"] == 0 for t in d.status()["tenants"]), 20)
    assert sorted(t["model"] for t in d.status()["tenants"]) == ["c", "tiny"]
    assert wait_for(lambda: "b" not in {  # the next tick rewrites the journal
        r.model for r in read_records(d.pool_path + ".journal") if isinstance(r, TenantRec)},
        10)
    d.kill()
    d.env["KVD_MAX_TENANTS"] = "8"
    d.start()
    assert sorted(t["model"] for t in d.status()["tenants"]) == ["c", "tiny"]


def test_a_journal_removed_while_running_is_written_again(daemon_factory):
    """Removed under a running daemon, the journal took its commits on an unlinked inode:
    the next warm restart restored nothing. Now the next tick writes it again."""
    d = persistent(daemon_factory)
    ks, _, digest = store(d, 6)
    journal = d.pool_path + ".journal"
    os.unlink(journal)
    assert wait_for(lambda: os.path.exists(journal), 10), d.logs()[-2000:]
    assert "was removed; writing it again" in d.logs()
    more, _, more_digest = store(d, 4, tag="m")
    d.kill()
    d.start()
    assert load_digest(d, ks) == (6, digest, 0)
    assert load_digest(d, more) == (4, more_digest, 0)


def test_a_corrupted_block_is_dropped_at_restart(daemon_factory):
    d = persistent(daemon_factory)
    ks, slots, _ = store(d, 6)
    d.kill()
    # Flip bytes of the 4th block in the kept pool file (what a torn write looks like).
    commits = {r.slot: r for r in read_records(d.pool_path + ".journal")
               if isinstance(r, Commit)}
    victim = int(slots[3])
    assert victim in commits
    st_slot_bytes = sum(PAGES)
    # Slot offsets: extent * extent_bytes + index * slot_bytes (1 MiB extents in tests).
    per_extent = (1 << 20) // 4096
    e, i = divmod(victim, per_extent)
    offset = e * (1 << 20) + i * st_slot_bytes
    with open(d.pool_path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xde\xad\xbe\xef")
    d.start()
    hits, _, _ = load_digest(d, ks)
    assert hits == 3  # the run stops at the dropped block
    st = d.status()
    assert st["blocks"]["ready"] == 5
    assert "corrupt" in d.logs() or st["blocks"]["ready"] == 5


def test_torn_journal_tail_is_ignored(daemon_factory):
    d = persistent(daemon_factory)
    ks, _, digest = store(d, 4)
    d.kill()
    with open(d.pool_path + ".journal", "ab") as f:
        f.write(b"\x30\x00\x00\x00garbage-that-is-not-a-record")
    d.start()
    hits, got, _ = load_digest(d, ks)
    assert hits == 4 and got == digest
    assert "the last 32 bytes are not intact records" in d.logs()


def test_verify_on_load_refuses_a_corrupt_block(daemon_factory):
    d = persistent(daemon_factory, verify=True)
    ks, slots, _ = store(d, 3)
    per_extent = (1 << 20) // 4096
    e, i = divmod(int(slots[0]), per_extent)
    with open(d.pool_path, "r+b") as f:  # the daemon's own mapping sees this
        f.seek(e * (1 << 20) + i * sum(PAGES) + 5)
        f.write(b"\x00\x01\x02\x03\x04")
    hits, _, code = load_digest(d, ks)
    assert hits == 3 and code == m.Code.CHECKSUM
    assert lookup(scheduler(d, Spec(d.socket, pages=PAGES)), ks).hits == 0
    assert d.status()["counters"]["corrupt_blocks"] == 1


def test_without_persistence_the_pool_file_goes_away(daemon_factory):
    d = daemon_factory()
    assert os.path.exists(d.pool_path)
    assert d.stop(signal.SIGTERM) == 0
    assert not os.path.exists(d.pool_path)
    assert not os.path.exists(d.pool_path + ".journal")


def test_clean_stop_with_persistence_keeps_everything(daemon_factory):
    d = persistent(daemon_factory)
    ks, _, digest = store(d, 5)
    assert d.stop(signal.SIGTERM) == 0
    assert os.path.exists(d.pool_path)
    d.start()
    hits, got, _ = load_digest(d, ks)
    assert hits == 5 and got == digest
    assert np.all(np.array([hits]) == 5)


def test_a_second_daemon_on_the_same_pool_or_socket_is_refused(daemon_factory, tmp_path):
    """Another kvd started on a live daemon's pool file (it would empty or share the pool
    under the first one's index) or its socket (it would take its clients) stops with
    a clear error; the first one goes on serving its blocks, whose file stays."""
    d = persistent(daemon_factory)
    ks, _, digest = store(d, 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_E2E")}
    for other in (
        [d.socket.replace(".sock", "-b.sock"), d.pool_path],  # same pool
        [d.socket, d.pool_path.replace(".pool", "-b.pool")],  # same socket
    ):
        r = subprocess.run([sys.executable, "-m", "kvd.cli.serve", "serve", "--socket",
                            other[0], "--pool-path", other[1], "--pool-size", "64M",
                            "--extent-size", "1M", "--metrics-port", "0", "--persist"],
                           capture_output=True, text=True, timeout=60, env=env,
                           check=False)
        assert r.returncode != 0
        assert "in use by another kvd" in r.stderr or "another kvd is listening" in r.stderr
        assert "Traceback" not in r.stderr
        assert not os.path.exists(other[1]) or other[1] == d.pool_path  # nothing left
    assert os.path.exists(d.socket) and os.path.exists(d.pool_path)
    hits, got, code = load_digest(d, ks)
    assert (hits, code, got) == (4, 0, digest)
