"""A real daemon subprocess, real client processes with private memory, real sockets."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest

from kvd_client import Connection, RemoteError, host_regions
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from tests.daemon.workers import Spec, Worker, fingerprint
from tests.waiting import wait_for


def scheduler(daemon, spec: Spec) -> Connection:
    c = Connection(daemon.socket, name="sched", register=m.Register(0, fingerprint(spec), -1))
    assert c.wait_up(10)
    return c


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(36, b"\0") for i in range(n)]


def allocate(conn: Connection, ks: list[bytes]) -> np.ndarray:
    r = conn.request(m.Allocate(conn.next_req(), ks))
    assert isinstance(r, m.Allocated) and r.allocated == len(ks)
    return unpack_u32(r.slots)


def lookup(conn: Connection, ks: list[bytes]) -> m.LookupOk:
    r = conn.request(m.Lookup(conn.next_req(), ks))
    assert isinstance(r, m.LookupOk)
    return r


def test_store_in_one_process_load_in_another(daemon):
    spec = Spec(daemon.socket)
    sched = scheduler(daemon, spec)
    a = Worker(spec)
    b = Worker(Spec(daemon.socket, seed=None))
    try:
        ks = keys(16)
        slots = allocate(sched, ks)
        src = list(range(3, 19))
        assert a.store(1, src, slots)[1] == 0
        hit = lookup(sched, ks + keys(1, "miss"))
        assert hit.hits == 16 and hit.lease > 0
        dst = list(range(40, 56))
        assert b.digest(dst) != a.digest(src)
        done = b.load(2, dst, unpack_u32(hit.slots))
        assert done[1] == 0 and done[3] == 16 * sum(spec.pages)
        assert b.digest(dst) == a.digest(src)
        st = daemon.status()
        assert st["counters"]["stored_blocks"] == 16
        assert st["counters"]["loaded_blocks"] == 16
        assert st["blocks"]["ready"] == 16
    finally:
        a.close()
        b.close()
        sched.close()


def test_tenants_never_see_each_other(daemon):
    one, two = Spec(daemon.socket, model="one"), Spec(daemon.socket, model="two")
    s1, s2 = scheduler(daemon, one), scheduler(daemon, two)
    w1, w2 = Worker(one), Worker(Spec(daemon.socket, model="two", seed=None))
    try:
        ks = keys(8)
        slots = allocate(s1, ks)
        assert w1.store(1, range(8), slots)[1] == 0
        assert lookup(s1, ks).hits == 8
        assert lookup(s2, ks).hits == 0
        # A worker of the other tenant cannot read those slots, even by guessing ids.
        done = w2.load(2, range(8), slots)
        assert done[1] == m.Code.BAD_IDS
        assert w2.digest(range(8)) == w2.digest(range(8, 16))  # still zeros
        # The same keys stored by tenant two land in their own slots.
        slots2 = allocate(s2, ks)
        assert set(slots2.tolist()).isdisjoint(slots.tolist())
        st = daemon.status()
        assert sorted(t["blocks"] for t in st["tenants"]) == [0, 8]
    finally:
        for c in (w1, w2):
            c.close()
        s1.close()
        s2.close()


def test_tp_block_ready_only_after_every_rank(daemon):
    r0, r1 = Spec(daemon.socket, tp_size=2, rank=0), Spec(daemon.socket, tp_size=2, rank=1)
    sched = scheduler(daemon, r0)
    w0, w1 = Worker(r0), Worker(r1)
    l0 = Worker(Spec(daemon.socket, tp_size=2, rank=0, seed=None))
    l1 = Worker(Spec(daemon.socket, tp_size=2, rank=1, seed=None))
    try:
        ks = keys(6)
        slots = allocate(sched, ks)
        assert w0.store(1, range(6), slots)[1] == 0
        first = lookup(sched, ks)
        assert first.hits == 0 and first.pending == 6
        # The same rank cannot count twice.
        assert w0.store(2, range(6), slots)[1] == m.Code.BAD_IDS
        assert w1.store(3, range(10, 16), slots)[1] == 0
        hit = lookup(sched, ks)
        assert hit.hits == 6
        hs = unpack_u32(hit.slots)
        assert l0.load(4, range(20, 26), hs)[1] == 0
        assert l1.load(5, range(30, 36), hs)[1] == 0
        assert l0.digest(range(20, 26)) == w0.digest(range(6))
        assert l1.digest(range(30, 36)) == w1.digest(range(10, 16))
    finally:
        for w in (w0, w1, l0, l1):
            w.close()
        sched.close()


def test_failed_store_never_becomes_ready(daemon):
    spec = Spec(daemon.socket, pages=(4096,))
    sched = scheduler(daemon, spec)
    bogus = [m.HostRegion(base=4096, num_blocks=64, stride=4096, page_bytes=4096)]
    dones: list[m.Done] = []
    w = Connection(daemon.socket, on_done=dones.append,
                   register=m.Register(0, fingerprint(spec), 0, bogus))
    try:
        assert w.wait_up(10)
        ks = keys(4)
        slots = allocate(sched, ks)
        assert w.send(m.Transfer(w.next_req(), 9, m.Direction.STORE, pack_u32(range(4)),
                                 pack_u32(slots)))
        deadline = time.monotonic() + 10
        while not dones and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dones and dones[0].code == m.Code.TRANSFER_FAILED
        assert lookup(sched, ks).hits == 0
        st = daemon.status()
        assert st["blocks"]["pending"] == 0 and st["pool"]["used_bytes"] == 0
        # The keys can be stored again later.
        assert allocate(sched, ks).tolist() != [NO_SLOT] * 4
    finally:
        w.close()
        sched.close()


def test_allocate_skips_stored_keys_and_reports_no_room(daemon_factory):
    d = daemon_factory("--pool-size", "1M", "--extent-size", "1M")
    spec = Spec(d.socket, pages=(65536,))  # 16 blocks fit
    spec2 = Spec(d.socket, model="other", pages=(65536,))
    # Two tenants: one holds at most 3/4 of the pool PENDING.
    sched, other = scheduler(d, spec), scheduler(d, spec2)
    w, w2 = Worker(spec), Worker(spec2)
    try:
        ks = keys(16)
        slots = [allocate(sched, ks[:8]), allocate(other, ks[8:])]
        r = sched.request(m.Allocate(sched.next_req(), ks[:4]))
        assert unpack_u32(r.slots).tolist() == [NO_SLOT] * 4  # PENDING already
        # All 16 PENDING: nothing can be evicted, so no room at all.
        r = sched.request(m.Allocate(sched.next_req(), keys(2, "x")))
        assert r.allocated == 0 and r.evicted == []
        assert w.store(1, range(8), slots[0])[1] == 0
        assert w2.store(1, range(8), slots[1])[1] == 0
        hit = lookup(sched, ks[:2])  # leased: pinned, not evictable
        r = sched.request(m.Allocate(sched.next_req(), keys(12, "y")))
        r2 = other.request(m.Allocate(other.next_req(), keys(3, "z")))
        assert (r.allocated, r2.allocated) == (12, 2)  # the pinned two stop it
        assert d.status()["counters"]["evicted_blocks"] == 14
        # Each reply names the tenant's own keys evicted, never another tenant's.
        assert set(r.evicted) <= set(ks[2:8]) and set(r2.evicted) <= set(ks[8:])
        assert set(r.evicted + r2.evicted).isdisjoint(ks[:2])
        assert lookup(sched, ks[:2]).hits == 2
        sched.request(m.Release(sched.next_req(), hit.lease))
    finally:
        w.close()
        w2.close()
        sched.close()
        other.close()


def test_version_mismatch_names_both_versions(daemon):
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{daemon.socket}")
    s.send(m.encode(m.Hello(7, 999, 1, "old")))
    assert s.poll(5000)
    r = m.decode_reply(s.recv())
    assert isinstance(r, m.Error) and r.req == 7 and r.code == m.Code.VERSION_MISMATCH
    assert "999" in r.message and str(m.PROTOCOL_VERSION) in r.message
    s.close()
    ctx.term()


def test_malformed_messages_get_typed_errors(daemon):
    import zmq

    spec = Spec(daemon.socket, pages=(4096,))
    other = scheduler(daemon, spec)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{daemon.socket}")

    def ask(*frames: bytes) -> m.Reply:
        s.send_multipart(list(frames))
        assert s.poll(5000), "daemon did not answer"
        return m.decode_reply(s.recv())

    cases = [
        (b"\xff\x00garbage",),
        (m.encode(m.Lookup(3, [b"k"]))[:-3],),  # truncated
        (b"a", b"b"),  # two frames
        (b"a", b"b", b"c"),  # three: read whole, the next message stays its own
        (m.encode(m.Lookup(4, [b"k"])),),  # before Hello
    ]
    for frames in cases:
        r = ask(*frames)
        assert isinstance(r, m.Error) and r.code in (m.Code.BAD_REQUEST, m.Code.NOT_REGISTERED)
    assert isinstance(ask(m.encode(m.Hello(5, m.PROTOCOL_VERSION, 0, "fuzz"))), m.HelloOk)
    r = ask(m.encode(m.Lookup(6, [b"k"])))
    assert isinstance(r, m.Error) and r.code == m.Code.NOT_REGISTERED and r.req == 6
    bad_fp = m.Fingerprint("x", "bf16", "bf16", 16, 0, [4096], "sha256", b"")
    r = ask(m.encode(m.Register(7, bad_fp, -1)))
    assert isinstance(r, m.Error) and r.req == 7
    mismatch = [m.HostRegion(base=4096, num_blocks=8, stride=4096, page_bytes=2048)]
    r = ask(m.encode(m.Register(8, fingerprint(spec), 0, mismatch)))
    assert isinstance(r, m.Error) and r.code == m.Code.SIZE_MISMATCH
    mem = np.zeros((8, 4096), dtype=np.uint8)
    assert isinstance(ask(m.encode(m.Register(9, fingerprint(spec), 0, host_regions([mem])))),
                      m.Registered)
    for req, transfer in enumerate([
        m.Transfer(0, 1, m.Direction.LOAD, pack_u32([0]), pack_u32([10**6])),  # slot range
        m.Transfer(0, 1, m.Direction.LOAD, pack_u32([0]), pack_u32([0])),  # not READY
        m.Transfer(0, 1, m.Direction.STORE, b"\x01\x02\x03", pack_u32([0])),  # torn ids
        m.Transfer(0, 1, m.Direction.STORE, pack_u32([0, 1]), pack_u32([0])),  # lengths
    ], start=20):
        r = ask(m.encode(msgspec.structs.replace(transfer, req=req)))
        assert isinstance(r, m.Done) and r.code == m.Code.BAD_IDS and r.req == req
    slots = allocate(other, keys(1))
    r = ask(m.encode(m.Transfer(30, 1, m.Direction.STORE, pack_u32([8]), pack_u32(slots))))
    assert isinstance(r, m.Done) and r.code == m.Code.BAD_IDS  # block 8 of 8
    r = ask(m.encode(m.Lookup(31, [b"k"] * 100_000)))
    assert isinstance(r, m.Error) and r.code == m.Code.BAD_REQUEST
    # Another client is still served, and the daemon is still the same process.
    assert lookup(other, keys(1)).hits == 0
    assert daemon.proc.poll() is None
    s.close()
    ctx.term()
    other.close()


def test_dead_client_releases_leases_and_pending(daemon):
    spec = Spec(daemon.socket, pages=(4096,))
    sched = scheduler(daemon, spec)
    w = Worker(spec)
    try:
        slots = allocate(sched, keys(4))
        assert w.store(1, range(4), slots)[1] == 0
        lease = lookup(sched, keys(4))
        assert lease.hits == 4
        # A second scheduler process leases and allocates, then dies without a word.
        dying = Worker(spec)
        reply = dying.call("raw", m.Lookup, {"keys": keys(4)})
        assert reply[1].hits == 4
        dying.call("raw", m.Allocate, {"keys": keys(3, "p")})
        st = daemon.status()
        assert st["blocks"]["pending"] == 3
        dying.kill()
        assert wait_for(lambda: daemon.status()["blocks"]["pending"] == 0, 2.0)
        st = daemon.status()
        assert st["blocks"]["pinned"] == 4  # only the living client's lease remains
        sched.request(m.Release(sched.next_req(), lease.lease))
        assert daemon.status()["blocks"]["pinned"] == 0
    finally:
        w.close()
        sched.close()


def test_a_closed_connection_releases_its_leases_and_pending_at_once(daemon_factory):
    """Its process lives on (an engine shut down inside a longer-lived process): the
    Bye, not the silence timeout (a minute here), lets go of what it held."""
    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "60000"})
    spec = Spec(d.socket, pages=(4096,))
    sched = scheduler(d, spec)
    w = Worker(spec)
    try:
        assert w.store(1, range(4), allocate(sched, keys(4)))[1] == 0
        closing = scheduler(d, spec)
        assert lookup(closing, keys(4)).hits == 4
        allocate(closing, keys(3, "p"))
        st = d.status()
        assert (st["blocks"]["pinned"], st["blocks"]["pending"]) == (4, 3)
        clients = len(st["clients"])
        closing.close()
        assert wait_for(lambda: len(d.status()["clients"]) < clients, 20)
        st = d.status()
        assert (st["blocks"]["pinned"], st["blocks"]["pending"]) == (0, 0)
        assert len(st["clients"]) == clients - 1
        assert "said bye" in d.logs()
    finally:
        w.close()
        sched.close()


def test_release_of_foreign_lease_is_refused(daemon):
    spec = Spec(daemon.socket, pages=(4096,))
    a, b = scheduler(daemon, spec), scheduler(daemon, spec)
    w = Worker(spec)
    try:
        slots = allocate(a, keys(2))
        assert w.store(1, range(2), slots)[1] == 0
        lease = lookup(a, keys(2)).lease
        with pytest.raises(RemoteError) as e:
            b.request(m.Release(b.next_req(), lease))
        assert e.value.code == m.Code.BAD_IDS
        assert a.request(m.Release(a.next_req(), lease)).count == 1
    finally:
        w.close()
        a.close()
        b.close()


def test_a_second_connection_cannot_take_over_a_clients_identity(daemon):
    """A client is its connection: a peer that claims a live client's routing id is
    not handed that client (its registration, memory and leases), it is ignored."""
    import zmq

    ctx = zmq.Context()

    def dealer(routing_id: bytes) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, routing_id)
        s.connect(f"ipc://{daemon.socket}")
        return s

    def ask(s: zmq.Socket, msg: m.Request, timeout_ms: int = 5000) -> m.Reply | None:
        s.send(m.encode(msg))
        return m.decode_reply(s.recv()) if s.poll(timeout_ms) else None

    owner = dealer(b"engine-7")
    hello = ask(owner, m.Hello(1, m.PROTOCOL_VERSION, os.getpid(), "owner"))
    assert isinstance(hello, m.HelloOk)
    thief = dealer(b"engine-7")
    # Not answered as the owner (nor as anyone): its messages go nowhere.
    assert ask(thief, m.Ping(2), timeout_ms=1000) is None
    reply = ask(owner, m.Ping(3))
    assert isinstance(reply, m.Ok) and reply.req == 3  # the owner still has its client
    for s in (owner, thief):
        s.close()
    ctx.term()


def test_the_policy_is_sized_to_the_blocks_the_pool_holds(daemon):
    """Before a model's block size is known the policy counts the pool in 4 KiB slots;
    once its 12 KiB blocks arrive, in what 64 extents of 1 MiB hold of them."""
    assert daemon.status()["blocks"]["capacity"] == (64 << 20) // 4096
    sched, worker = scheduler(daemon, Spec(daemon.socket)), Worker(Spec(daemon.socket))
    try:
        allocate(sched, keys(4))
        assert daemon.status()["blocks"]["capacity"] == 64 * ((1 << 20) // 12288)
    finally:
        worker.close()
        sched.close()


class _NewerRequest(msgspec.Struct, frozen=True, array_like=True, tag="lookup_many"):
    """A request a newer client could send: a tag this daemon does not know."""

    req: int
    keys: list[bytes] = []


def test_a_client_whose_requests_this_daemon_cannot_read_is_not_dropped_as_silent(
        daemon_factory):
    """Each such request gets an Error, which keeps the client from pinging; the daemon
    did not count the request as a sign of life, and dropped the client as silent
    (its leases and stores released) after client_timeout_ms."""
    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "3000"})
    spec = Spec(d.socket)
    sched = scheduler(d, spec)
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            with pytest.raises(RemoteError) as e:
                sched.request(_NewerRequest(sched.next_req(), [b"k" * 36]), 5)
            assert e.value.code == m.Code.BAD_REQUEST
            time.sleep(0.1)
        assert isinstance(lookup(sched, keys(1)), m.LookupOk)  # still registered
        assert "silent" not in d.logs()
    finally:
        sched.close()
