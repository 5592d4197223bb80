"""A Transfer still ends exactly once when its client closes, reuses a request id or
misuses the API, and nothing is copied to or from its memory after its Done (a real
daemon; the client's memory is read and written with process_vm_readv/writev)."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvd_client import Connection, KvdClientError, host_regions
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from tests.daemon.workers import Spec, fingerprint
from tests.waiting import wait_for

PAGE = 256 << 10  # 16 blocks a copy chunk or two: a close lands while one is copied
BIG = ("--pool-size", "160M")


class Member:
    """A rank-0 connection of model ``model`` with its own memory, recording Dones; its
    on_done may reuse the memory (``reuse``), as a caller may once a Done came."""

    def __init__(self, socket: str, model: str, blocks: int, fill: int,
                 reuse: int | None = None) -> None:
        self.mem = np.full((blocks, PAGE), fill, dtype=np.uint8)
        self.dones: list[m.Done] = []
        self.cv = threading.Condition()
        self.reuse = reuse
        spec = Spec(socket, model=model, pages=(PAGE,))
        self.conn = Connection(socket, name=f"closing-{model}", on_done=self._done,
                               register=m.Register(0, fingerprint(spec), 0,
                                                   host_regions([self.mem])))
        assert self.conn.wait_up(10)

    def _done(self, done: m.Done) -> None:
        if self.reuse is not None:
            self.mem[:] = self.reuse
        with self.cv:
            self.dones.append(done)
            self.cv.notify_all()

    def done_of(self, event: int, timeout: float = 10) -> m.Done:
        with self.cv:
            assert self.cv.wait_for(lambda: any(d.event == event for d in self.dones),
                                    timeout), f"no Done for {event}"
            return next(d for d in self.dones if d.event == event)

    def call(self, msg_type, **fields):
        return self.conn.request(msg_type(req=self.conn.next_req(), **fields), 10)

    def send(self, event: int, direction: m.Direction, blocks, slots=(), ticket=0,
             req: int = 0) -> bool:
        return self.conn.send(m.Transfer(req or self.conn.next_req(), event, direction,
                                         pack_u32(blocks), pack_u32(slots), ticket=ticket))


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(36, b"\0") for i in range(n)]


def stored(w: Member, tag: str) -> list[bytes]:
    """Every block of ``w`` stored under keys of ``tag``: the keys."""
    ks = keys(tag, len(w.mem))
    slots = unpack_u32(w.call(m.Allocate, keys=ks).slots)
    assert w.send(1, m.Direction.STORE, range(len(ks)), slots)
    assert w.done_of(1).code == m.Code.OK
    return ks


def test_a_store_whose_client_closed_while_it_was_copied_is_never_served_changed(
        daemon_factory):
    """A worker closes while its store is copied, and its on_done reuses the memory.
    Its Done came before the daemon's (CLIENT_GONE, made up at close), and the daemon
    still made the block READY from bytes read after it: a mix of the block and of
    what the memory held next. Now close waits for the daemon's Done, and a store of a
    client that left is never stored."""
    d = daemon_factory(*BIG)
    for trial in range(8):
        model = f"close-store-{trial}"
        sched = Member(d.socket, model, blocks=1, fill=0)
        w = Member(d.socket, model, blocks=16, fill=0x11, reuse=0xEE)
        try:
            ks = keys(model, 16)
            slots = unpack_u32(sched.call(m.Allocate, keys=ks).slots)
            assert w.send(1, m.Direction.STORE, range(16), slots)
            time.sleep(0.0005 * trial)
            w.conn.close()
            assert len(w.dones) == 1
            hit = sched.call(m.Lookup, keys=ks)
            assert (hit.hits == 16) == (w.dones[0].code == m.Code.OK), (hit, w.dones)
            if hit.hits:  # stored before the close: the block's own bytes, whole
                r = Member(d.socket, model, blocks=16, fill=0)
                try:
                    assert r.send(2, m.Direction.LOAD, range(16), unpack_u32(hit.slots))
                    assert r.done_of(2).code == m.Code.OK
                    assert (r.mem == 0x11).all()
                finally:
                    r.conn.close()
            if hit.lease:
                sched.call(m.Release, lease=hit.lease)
        finally:
            sched.conn.close()
    assert d.status()["blocks"]["pending"] == 0


def test_a_paused_daemon_stores_nothing_for_a_client_that_left(daemon_factory):
    """The daemon is paused with a store and the client's Bye in its socket; the close
    gives up waiting for the Done, and the caller reuses the memory. Resumed, the
    daemon copies the store before it reads the Bye: it must not make the block READY
    (it would hold the bytes of whatever the memory held next)."""
    d = daemon_factory(*BIG)
    model = "paused-store"
    sched = Member(d.socket, model, blocks=1, fill=0)
    w = Member(d.socket, model, blocks=16, fill=0x11, reuse=0xEE)
    try:
        ks = keys(model, 16)
        slots = unpack_u32(sched.call(m.Allocate, keys=ks).slots)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            assert w.send(1, m.Direction.STORE, range(16), slots)
            w.conn.close()  # waits CLOSE_WAIT_S, then CLIENT_GONE: the memory is 0xEE
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert [x.code for x in w.dones] == [m.Code.CLIENT_GONE] and (w.mem == 0xEE).all()
        assert wait_for(lambda: d.status()["blocks"]["pending"] == 0, 5)
        assert sched.call(m.Lookup, keys=ks).hits == 0
    finally:
        sched.conn.close()


def test_closing_during_a_load_writes_nothing_after_its_done(daemon_factory):
    """A large load is under way when its client closes; its on_done zeroes the memory
    (it is the caller's again). The daemon went on writing megabytes into it after the
    Done close made up."""
    d = daemon_factory(*BIG)
    w = Member(d.socket, "close-load", blocks=128, fill=0x22)
    try:
        ks = stored(w, "load")
        for trial in range(3):
            hit = w.call(m.Lookup, keys=ks)
            assert hit.hits == 128
            r = Member(d.socket, "close-load", blocks=128, fill=0, reuse=0)
            assert r.send(2, m.Direction.LOAD, range(128), unpack_u32(hit.slots))
            time.sleep(0.002)
            r.conn.close()
            assert len(r.dones) == 1
            time.sleep(0.3)
            assert not r.mem.any(), f"trial {trial}: bytes written after the Done"
            w.call(m.Release, lease=hit.lease)
    finally:
        w.conn.close()


def test_a_close_gets_the_daemons_dones_for_what_is_in_flight(daemon_factory):
    """Told Bye, the daemon ends the client's Transfers, and their Dones are what close
    waits for. It dropped every reply to a client that left, so close waited its 2 s
    out and the caller got a Done made up on its side ("connection closed"), each time;
    a Transfer waiting for its ticket's Allocate got nothing either."""
    d = daemon_factory(*BIG)
    w = Member(d.socket, "close-dones", blocks=128, fill=0x22)
    try:
        ks = stored(w, "dones")
        hit = w.call(m.Lookup, keys=ks)
        r = Member(d.socket, "close-dones", blocks=128, fill=0)
        assert r.send(2, m.Direction.LOAD, range(128), unpack_u32(hit.slots))
        assert r.send(3, m.Direction.STORE, range(4), ticket=987654321)  # parked
        time.sleep(0.002)
        r.conn.close()
        got = {x.event: x for x in r.dones}
        assert sorted(got) == [2, 3]
        assert all(x.message != "connection closed" for x in got.values()), got
        assert got[3].code == m.Code.CLIENT_GONE
        at_done = r.mem.copy()  # a cut load may have written part before its Done
        time.sleep(0.3)
        assert (r.mem == at_done).all(), "bytes written after the Done"
        w.call(m.Release, lease=hit.lease)
    finally:
        w.conn.close()


def test_a_request_id_in_flight_is_refused_to_a_second_message(daemon_factory):
    """Two loads under one request id: the first Done ended the second Transfer (its
    copy still running, into memory its caller took back), and the first one's never
    came. The second is refused unsent; each ends once."""
    d = daemon_factory(*BIG)
    w = Member(d.socket, "dup-req", blocks=128, fill=0x33)
    try:
        hit = w.call(m.Lookup, keys=stored(w, "dup"))
        req = w.conn.next_req()
        assert w.send(2, m.Direction.LOAD, range(128), unpack_u32(hit.slots), req=req)
        w.send(3, m.Direction.LOAD, [0], unpack_u32(hit.slots)[:1], req=req)
        refused = w.done_of(3)
        assert refused.code == m.Code.CLIENT_GONE and "in flight already" in refused.message
        assert w.done_of(2).code == m.Code.OK
        time.sleep(0.2)
        assert sorted(d.event for d in w.dones) == [1, 2, 3]
    finally:
        w.conn.close()


def test_a_transfer_given_to_submit_is_refused_unsent(daemon_factory):
    """submit() sent a Transfer without a deadline and tracked it as if it had one
    already passed: ended EXPIRED at once while the daemon, seeing no deadline, still
    copied it; and its future never resolved."""
    d = daemon_factory()
    w = Member(d.socket, "submit", blocks=4, fill=1)
    try:
        fut = w.conn.submit(m.Transfer(w.conn.next_req(), 1, m.Direction.STORE,
                                       pack_u32([0]), pack_u32([0])))
        with pytest.raises(KvdClientError, match="send"):
            fut.result(1)
        time.sleep(0.2)
        assert w.dones == [] and d.status()["counters"]["stored_bytes"] == 0
    finally:
        w.conn.close()


def test_a_store_by_ticket_refused_gives_its_slots_back_at_once(daemon_factory):
    """Refused after it took its rank's turn of the ticket (three block ids for four
    keys), the store left the ticket's slots PENDING until their pending time (a
    minute), though no block of it could ever be whole."""
    d = daemon_factory()
    w = Member(d.socket, "ticket", blocks=4, fill=1)
    try:
        ks = keys("ticket", 4)
        got = w.call(m.Allocate, keys=ks, ticket=5, pending_ms=600_000)
        assert (unpack_u32(got.slots) != NO_SLOT).all()
        assert w.send(1, m.Direction.STORE, [0, 1, 2], ticket=5)
        assert w.done_of(1).code == m.Code.BAD_IDS
        assert wait_for(lambda: d.status()["blocks"]["pending"] == 0, 2)
        assert w.call(m.Lookup, keys=ks).pending == 0
        slots = unpack_u32(w.call(m.Allocate, keys=ks).slots)  # stored again: allowed
        assert w.send(2, m.Direction.STORE, range(4), slots)
        assert w.done_of(2).code == m.Code.OK
    finally:
        w.conn.close()
