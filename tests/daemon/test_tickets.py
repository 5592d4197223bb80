"""Stores by ticket: the scheduler's Allocate names a ticket, the workers' Transfers use it."""

from __future__ import annotations

import signal
import time

import pytest

from kvd_client import Connection, RemoteError
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from tests.daemon.test_integration import keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for


def allocate(conn: Connection, ks: list[bytes], ticket: int) -> m.Reply:
    return conn.request(m.Allocate(conn.next_req(), ks, ticket=ticket))


def test_ticketed_stores_across_ranks_overtaking_and_misuse(daemon):
    r0, r1 = Spec(daemon.socket, tp_size=2, rank=0), Spec(daemon.socket, tp_size=2, rank=1)
    sched = scheduler(daemon, r0)
    w0, w1 = Worker(r0), Worker(r1)
    try:
        ks = keys(6)
        # Rank 0's Transfer overtakes the Allocate (another connection): it waits for it.
        assert w0.send_store(1, range(6), ticket=77)
        time.sleep(0.2)
        assert unpack_u32(allocate(sched, ks, 77).slots).tolist() != [NO_SLOT] * 6
        code, _, nbytes = w0.wait(1)[1:]
        assert code == 0 and nbytes == 6 * sum(r0.pages)
        assert lookup(sched, ks).pending == 6  # rank 1 has not stored yet
        assert w1.store(2, range(10, 16), [], ticket=77)[1] == 0
        assert lookup(sched, ks).hits == 6

        # Every rank used ticket 77: a third store by it is refused (after the wait).
        t0 = time.monotonic()
        code, message = w0.store(3, range(6), [], ticket=77)[1:3]
        assert code == m.Code.BAD_IDS and "ticket 77" in message
        assert time.monotonic() - t0 >= 1.5

        # Keys kvd holds get no slot: only the new blocks are copied.
        more = ks + keys(2, "new")
        slots = unpack_u32(allocate(sched, more, 78).slots)
        assert (slots[:6] == NO_SLOT).all() and (slots[6:] != NO_SLOT).all()
        assert w0.store(4, range(8), [], ticket=78)[3] == 2 * sum(r0.pages)
        assert w1.store(5, range(8), [], ticket=78)[1] == 0
        assert lookup(sched, more).hits == 8
        stored = daemon.status()["counters"]["stored_blocks"]
        # All present: the Done comes at once, nothing is copied.
        allocate(sched, more, 79)
        assert w0.store(6, range(8), [], ticket=79)[1:4:2] == (0, 0)
        assert daemon.status()["counters"]["stored_blocks"] == stored

        # A ticket in use cannot be taken twice; a store must match its key count.
        assert isinstance(allocate(sched, keys(1, "x"), 80), m.Allocated)
        with pytest.raises(RemoteError) as refused:
            allocate(sched, keys(1, "y"), 80)
        assert refused.value.code == m.Code.BAD_REQUEST
        assert w0.store(7, range(3), [], ticket=80)[1] == m.Code.BAD_IDS
    finally:
        for w in (w0, w1):
            w.close()
        sched.close()


def test_a_ticket_whose_slot_was_given_up_and_handed_out_again_stores_nothing(daemon):
    """The scheduler gave ticket 7's slot up (its request went away) and the slot went
    to another key under ticket 8: a late store by ticket 7 must not land in it."""
    spec = Spec(daemon.socket, seed=5)
    sched, w = scheduler(daemon, spec), Worker(spec)
    r = Worker(Spec(daemon.socket, seed=None))
    try:
        a = unpack_u32(allocate(sched, keys(1, "a"), 7).slots)
        sched.request(m.Abort(sched.next_req(), pack_u32(a)))
        b = unpack_u32(allocate(sched, keys(1, "b"), 8).slots)
        assert b[0] == a[0]  # the same slot, handed out again
        code, _, nbytes = w.store(1, [0], [], ticket=7)[1:4]
        assert (code, nbytes) == (0, 0)  # nothing copied
        assert w.store(2, [1], [], ticket=8)[1] == 0  # b's own store, of block 1
        hit = lookup(sched, keys(1, "b"))
        assert hit.hits == 1
        assert r.load(3, [0], unpack_u32(hit.slots))[1] == 0
        assert r.digest([0]) == w.digest([1])
    finally:
        for x in (w, r):
            x.close()
        sched.close()


def test_a_store_that_names_a_slot_twice_is_refused(daemon):
    spec = Spec(daemon.socket, seed=6)
    sched, w = scheduler(daemon, spec), Worker(spec)
    try:
        s = unpack_u32(sched.request(m.Allocate(sched.next_req(), keys(2, "d"))).slots)
        code, message = w.store(1, [0, 1], [s[0], s[0]])[1:3]
        assert code == m.Code.BAD_IDS and "twice" in message
        assert w.store(2, [0, 1], list(s))[1] == 0  # the same slots, each once: fine
        assert lookup(sched, keys(2, "d")).hits == 2
    finally:
        w.close()
        sched.close()


def test_stores_by_a_refused_allocation_end_at_once_copying_nothing(daemon_factory, tmp_path):
    """An Allocate refused (a key too long, the pending-store quota) leaves its ticket
    with no slots: the workers' stores by it, sent before or after the refusal, end
    without waiting out the ticket wait, and nothing is stored."""
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("max_keys_per_request = 4\nmax_pending_blocks = 3\n")
    daemon = daemon_factory("--config", str(cfg))
    spec = Spec(daemon.socket, seed=8)
    sched, w = scheduler(daemon, spec), Worker(spec)
    try:
        t0 = time.monotonic()
        assert w.send_store(1, range(2), ticket=90)  # overtakes its Allocate
        time.sleep(0.1)
        with pytest.raises(RemoteError) as too_long:
            allocate(sched, [b"x" * 2000, b"y" * 2000], 90)
        assert too_long.value.code == m.Code.BAD_REQUEST
        assert w.wait(1)[1:4:2] == (0, 0)  # ended, nothing copied
        assert time.monotonic() - t0 < 1.0  # not the 2 s a missing Allocate waits

        held = unpack_u32(allocate(sched, keys(3, "q"), 91).slots)
        assert (held != NO_SLOT).all()  # the quota is now in use
        with pytest.raises(RemoteError) as busy:
            allocate(sched, keys(2, "late"), 92)
        assert busy.value.code == m.Code.BUSY
        t0 = time.monotonic()
        assert w.store(2, range(2), [], ticket=92)[1:4:2] == (0, 0)
        assert time.monotonic() - t0 < 1.0
        assert w.store(3, range(3), [], ticket=91)[3] == 3 * sum(spec.pages)
        assert lookup(sched, keys(3, "q")).hits == 3
        assert lookup(sched, keys(2, "late")).hits == 0
        assert daemon.status()["counters"]["stored_blocks"] == 3
    finally:
        w.close()
        sched.close()


def test_a_load_naming_a_lease_that_is_gone_is_refused(daemon_factory):
    """A load names the Lookup lease its slots came from: once the lease is released
    (or lapsed, or of another daemon run) the slots may hold other blocks, so the load
    copies nothing and fails (vLLM recomputes)."""
    daemon = daemon_factory()
    spec = Spec(daemon.socket, seed=9)
    sched, w = scheduler(daemon, spec), Worker(spec)
    r = Worker(Spec(daemon.socket, seed=None))
    try:
        slots = unpack_u32(sched.request(m.Allocate(sched.next_req(), keys(2, "l"))).slots)
        assert w.store(1, [0, 1], list(slots))[1] == 0
        hit = lookup(sched, keys(2, "l"))
        assert hit.lease > 1  # a run's lease ids start at a random point, not at 1
        assert r.load(2, [0, 1], unpack_u32(hit.slots), lease=hit.lease)[1] == 0
        assert r.digest([0, 1]) == w.digest([0, 1])
        assert sched.request(m.Release(sched.next_req(), hit.lease)).count == 1
        r2 = Worker(Spec(daemon.socket, seed=None))
        try:
            code, message = r2.load(3, [0, 1], unpack_u32(hit.slots), lease=hit.lease)[1:3]
            assert code == m.Code.EXPIRED and "lease" in message
            assert r2.digest([0, 1]) != w.digest([0, 1])  # nothing copied
            hit = lookup(sched, keys(2, "l"))  # leased again: loads again
            assert r2.load(4, [0, 1], unpack_u32(hit.slots), lease=hit.lease)[1] == 0
            # Released, then its slots emptied: still "the lease is gone", not a slot id
            # of the wrong state (the reason is the lease).
            assert sched.request(m.Release(sched.next_req(), hit.lease)).count == 1
            assert sched.request(m.Flush(sched.next_req())).count == 2
            code, message = r2.load(5, [0, 1], unpack_u32(hit.slots), lease=hit.lease)[1:3]
            assert code == m.Code.EXPIRED and "lease" in message, message
        finally:
            r2.close()
    finally:
        for x in (w, r):
            x.close()
        sched.close()


def test_a_store_parked_for_its_allocate_ends_when_the_daemon_stops(daemon):
    """A stopping daemon answers Allocates BUSY and ticks no more: the store that
    overtook its Allocate gets its Done from the daemon at once (before, none came, and
    the client made one up when the daemon exited)."""
    r0 = Spec(daemon.socket, seed=8)
    sched, w = scheduler(daemon, r0), Worker(r0)
    try:
        assert w.send_store(1, range(2), ticket=90)  # overtakes its Allocate: parked
        time.sleep(0.2)
        daemon.proc.send_signal(signal.SIGTERM)
        code, message = w.wait(1)[1:3]
        assert code == m.Code.BUSY and "stopping" in message
        assert daemon.proc.wait(15) == 0
        daemon.proc = None
    finally:
        w.close()
        sched.close()


def test_a_store_no_worker_makes_gives_its_slots_back(daemon_factory):
    """Workers that copy for themselves (or run without offloading) skip every store:
    the slots of their scheduler's Allocates stayed PENDING for pending_ms (a minute),
    so another engine's Lookups of those blocks waited on them and its stores found
    them present, never stored."""
    d = daemon_factory(env={"KVD_STORE_CLAIM_MS": "500"})
    spec = Spec(d.socket, seed=3)
    skipping, other = scheduler(d, spec), scheduler(d, spec)
    w = Worker(spec)
    try:
        ks = keys(4, "skipped")
        allocate(skipping, ks, 5)  # its workers never store with ticket 5
        assert lookup(other, ks).pending == 4
        assert wait_for(lambda: d.status()["counters"]["unclaimed_blocks"] == 4, 10)
        assert lookup(other, ks).pending == 0
        allocate(other, ks, 6)  # the other engine's store now goes in
        assert w.store(1, range(4), [], ticket=6)[1] == 0
        assert lookup(other, ks).hits == 4
        # A ticket some worker stored with is kept (the other ranks may come later).
        more = keys(2, "claimed")
        allocate(other, more, 7)
        assert w.store(2, range(2), [], ticket=7)[1] == 0
        time.sleep(1.0)
        assert d.status()["counters"]["unclaimed_blocks"] == 4
    finally:
        w.close()
        skipping.close()
        other.close()


def test_a_store_one_rank_never_makes_gives_its_slots_back(daemon_factory):
    """Two engines of a tp=2 tenant, the second without its rank 1 (its Register was
    refused): the first engine's rank 1 made the tenant look whole, so the second's
    Allocate passed and its rank 0 stored by ticket. Nothing stored rank 1's half, and
    the blocks stayed PENDING for the pending time (a minute), holding them from the
    first engine: its Lookups waited on them, its Allocates got no slots."""
    d = daemon_factory(env={"KVD_STORE_CLAIM_MS": "500"})
    r0, r1 = Spec(d.socket, tp_size=2, rank=0), Spec(d.socket, tp_size=2, rank=1)
    whole, halved = scheduler(d, r0), scheduler(d, r0)
    a0, a1, b0 = Worker(r0), Worker(r1), Worker(r0)
    try:
        ks = keys(4, "halved")
        allocate(halved, ks, 5)
        assert b0.store(1, range(4), [], ticket=5)[1] == 0  # rank 0's half
        assert lookup(whole, ks).pending == 4
        assert wait_for(lambda: d.status()["counters"]["unclaimed_blocks"] == 4, 10)
        assert lookup(whole, ks).pending == 0
        assert d.status()["blocks"]["pending"] == 0
        allocate(whole, ks, 6)  # the whole engine's store now goes in
        assert a0.store(2, range(4), [], ticket=6)[1] == 0
        assert a1.store(3, range(4), [], ticket=6)[1] == 0
        assert lookup(whole, ks).hits == 4
        # Rank 1 of the halved engine, late past its time: its store finds no ticket.
        late = Worker(r1)
        try:
            code, message = late.store(4, range(4), [], ticket=5)[1:3]
            assert code == m.Code.BAD_IDS and "ticket 5" in message
        finally:
            late.close()
        assert lookup(whole, ks).hits == 4
        assert d.status()["counters"]["unclaimed_blocks"] == 4
    finally:
        for c in (a0, a1, b0, whole, halved):
            c.close()
