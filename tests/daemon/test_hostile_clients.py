"""What a buggy or hostile client may send, against the daemon's service: typed refusals
that leave nothing behind, never another process's or tenant's bytes."""

from __future__ import annotations

import os
import uuid

import msgspec
import numpy as np
import pytest

from kvd.access import Peer
from kvd.config import Config
from kvd.engines.client_copy import ClientCopyEngine
from kvd.engines.host import HostEngine
from kvd.pool import Pool
from kvd.service import Service
from kvd_client import host_regions
from kvd_proto import messages as m
from kvd_proto.ids import pack_u32
from tests.daemon.workers import Spec, fingerprint, make_memory

OTHER_UID = 54321  # an allowed uid that is not the daemon's


@pytest.fixture
def service():
    path = f"/dev/shm/kvd-test-{uuid.uuid4().hex[:8]}.pool"
    cfg = Config(pool_size=8 << 20, extent_size=1 << 20, pool_path=path,
                 allowed_uids=[OTHER_UID], max_keys_per_request=64)
    pool = Pool(path, cfg.pool_size, prefault=False)
    engine = HostEngine(lambda *a: None, threads=1)
    engines = {"host": engine, "client_copy": ClientCopyEngine(lambda *a: None)}
    svc = Service(cfg, pool, engines, lambda ident, reply: None)
    yield svc
    engine.close()
    pool.close(unlink=True)


def register(service: Service, ident: bytes, peer: Peer, spec: Spec, mem) -> m.Reply:
    hello = service.handle(ident, peer, m.Hello(1, m.PROTOCOL_VERSION, os.getpid()))
    assert isinstance(hello, m.HelloOk)
    assert hello.peer_pid == peer.pid
    return service.handle(ident, peer, m.Register(2, fingerprint(spec), 0, host_regions(mem)))


def test_host_memory_is_attached_only_for_a_pid_the_kernel_names(service):
    spec = Spec("unused", seed=1)
    mem = make_memory(spec)
    uid, gid = os.getuid(), os.getgid()
    # The kernel did not say who is behind the socket (another PID namespace): the pid
    # in the Hello may be any process's, so the daemon copies nothing by it.
    refused = register(service, b"unseen", Peer(0, uid, gid), spec, mem)
    assert isinstance(refused, m.Error) and refused.code == m.Code.PERMISSION
    assert "PID namespace" in refused.message
    client = service.clients[b"unseen"]
    assert client.tenant is None and client.engine is None
    # The same process, named by the kernel: attached.
    ok = register(service, b"seen", Peer(os.getpid(), uid, gid), spec, mem)
    assert isinstance(ok, m.Registered)
    assert service.clients[b"seen"].pid == os.getpid()


def hello(service: Service, ident: bytes, uid: int | None = None, name: str = "") -> Peer:
    peer = Peer(os.getpid(), os.getuid() if uid is None else uid, os.getgid())
    assert isinstance(service.handle(ident, peer, m.Hello(1, m.PROTOCOL_VERSION, 1, name)),
                      m.HelloOk)
    return peer


def registered(service: Service, ident: bytes, seed: int):
    """A client registered with host memory of its own (rank 0): its peer, and the
    memory (keep it alive while the daemon may copy)."""
    spec = Spec("unused", seed=seed)
    mem = make_memory(spec)
    peer = hello(service, ident)
    reply = service.handle(ident, peer, m.Register(2, fingerprint(spec), 0, host_regions(mem)))
    assert isinstance(reply, m.Registered)
    return peer, mem


@pytest.mark.parametrize("change, why", [
    ({"rank_page_bytes": [1] * 5000}, "page sizes"),
    ({"rank_page_bytes": [4096, 0]}, "page sizes"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": 65}, "tp_size"),
    ({"model": "m" * 5000}, "longer than"),
    ({"rank_page_bytes": [1 << 40]}, "does not fit an extent"),
    ({"block_tokens": -1}, "block_tokens"),  # (tokens counted per hit: the
    ({"block_tokens": 2**64 - 1}, "block_tokens"),  # counters went negative or huge)
])
def test_a_refused_fingerprint_leaves_no_tenant(service, change, why):
    peer = hello(service, b"c")
    fp = msgspec.structs.replace(fingerprint(Spec("unused")), **change)
    reply = service.handle(b"c", peer, m.Register(2, fp, -1))
    assert isinstance(reply, m.Error) and why in reply.message
    assert len(service.tenants) == 0


def test_only_the_daemons_uid_may_copy_into_the_pool_itself(service):
    fp = fingerprint(Spec("unused"))
    other = hello(service, b"other", uid=OTHER_UID)
    refused = service.handle(b"other", other, m.Register(2, fp, 0, client_copy=True))
    assert isinstance(refused, m.Error) and refused.code == m.Code.PERMISSION
    me = hello(service, b"me")
    assert isinstance(service.handle(b"me", me, m.Register(2, fp, 0, client_copy=True)),
                      m.Registered)


def test_oversized_keys_names_and_transfers_are_refused(service):
    spec = Spec("unused", seed=2)
    mem = make_memory(spec)
    peer = hello(service, b"w", name="n" * 100_000)
    assert len(service.clients[b"w"].name) <= 1024  # kept short, whatever was sent
    assert isinstance(service.handle(b"w", peer, m.Register(
        2, fingerprint(spec), 0, host_regions(mem))), m.Registered)
    long_key = service.handle(b"w", peer, m.Allocate(3, [b"k" * 2000]))
    assert isinstance(long_key, m.Error) and "longer than" in long_key.message
    many = service.handle(b"w", peer, m.Transfer(4, 9, m.Direction.LOAD,
                                                 pack_u32(range(65)), pack_u32(range(65))))
    assert isinstance(many, m.Done) and many.code == m.Code.BAD_IDS
    assert service.index.ready_blocks == 0 and service.index.pending_blocks == 0


def test_a_host_region_outside_the_address_space_is_refused(service):
    spec = Spec("unused", seed=3)
    peer = hello(service, b"w")
    for regions in ([m.HostRegion(-4096, 4, p, p) for p in spec.pages],
                    [m.HostRegion(1 << 40, 1 << 31, 1 << 40, p) for p in spec.pages]):
        reply = service.handle(b"w", peer, m.Register(2, fingerprint(spec), 0, regions))
        assert isinstance(reply, m.Error) and "address space" in reply.message


def test_a_region_of_no_blocks_is_refused_as_such(service):
    """It was refused as 'not inside the address space', which sent one looking at the
    address."""
    spec = Spec("unused", seed=3)
    regions = [m.HostRegion(1 << 30, 0, p, p) for p in spec.pages]
    reply = service.handle(b"w", hello(service, b"w"), m.Register(2, fingerprint(spec), 0,
                                                                   regions))
    assert isinstance(reply, m.Error) and reply.code == m.Code.SIZE_MISMATCH
    assert "of 0 blocks: it has none" in reply.message


def test_a_register_refused_at_its_memory_leaves_no_tenant(service):
    spec = Spec("unused", seed=4)
    mem = make_memory(spec)
    peer = hello(service, b"w")
    regions = host_regions(mem)[:1]  # one region for a fingerprint of two tensors
    reply = service.handle(b"w", peer, m.Register(2, fingerprint(spec), 0, regions))
    assert isinstance(reply, m.Error) and reply.code == m.Code.SIZE_MISMATCH
    assert len(service.tenants) == 0
    # a tenant that other clients use stays when one more is refused
    assert isinstance(service.handle(b"w2", hello(service, b"w2"), m.Register(
        2, fingerprint(spec), 0, host_regions(mem))), m.Registered)
    reply = service.handle(b"w3", hello(service, b"w3"), m.Register(
        2, fingerprint(spec), 0, regions))
    assert isinstance(reply, m.Error) and len(service.tenants) == 1


@pytest.mark.parametrize("depth, length", [
    (-1, 0), (1 << 32, 0), ((1 << 64) - 1, 0), ((1 << 32) - 2, 0), (0, -1), (0, 1 << 32)])
def test_a_position_out_of_range_is_refused_before_the_index_changes(service, depth, length):
    """Before, an Allocate at depth 2**63 or more failed INTERNAL with its slots left
    PENDING (Lookups then said "pending" for blocks that never came), and a negative
    depth made READY blocks that no tier could take, failing their whole batch."""
    peer, _mem = registered(service, b"w", seed=5)
    keys = [b"a", b"b", b"c"]
    got = service.handle(b"w", peer, m.Allocate(3, keys, depth=depth, length=length))
    assert isinstance(got, m.Error) and got.code == m.Code.BAD_REQUEST
    assert "positions must lie in" in got.message
    if length == 0:
        looked = service.handle(b"w", peer, m.Lookup(4, keys, depth=depth))
        assert isinstance(looked, m.Error) and looked.code == m.Code.BAD_REQUEST
    assert service.index.pending_blocks == 0 and service.index.ready_blocks == 0
    assert not service.index.leases.by_owner
    ok = service.handle(b"w", peer, m.Allocate(5, keys, depth=(1 << 32) - 4, length=0))
    assert isinstance(ok, m.Allocated) and ok.allocated == 3  # the last positions fit


def test_hits_are_always_leased_so_a_load_cannot_outlive_its_blocks(service):
    """A Lookup asking for no lease (lease_ms 0) still gets one, of 1 ms: a load naming
    it later is refused instead of copying whatever the slots hold by then."""
    peer, _mem = registered(service, b"w", seed=6)
    got = service.handle(b"w", peer, m.Allocate(3, [b"k"]))
    assert isinstance(got, m.Allocated)
    service.index.store_done(np.frombuffer(got.slots, dtype=np.uint32).astype(np.int64), 0)
    hit = service.handle(b"w", peer, m.Lookup(4, [b"k"], lease_ms=0))
    assert isinstance(hit, m.LookupOk) and hit.hits == 1 and hit.lease != 0
    assert service.index.leases.holds(hit.lease, np.frombuffer(hit.slots, dtype=np.uint32)
                                .astype(np.int64))
    with pytest.raises(ValueError, match="max_lease_ms"):
        Config(max_lease_ms=0)


def test_a_late_store_into_a_slot_handed_out_again_is_refused_by_its_gens(service):
    """K1's slot is aborted and handed to K2 (the free list is last-in first-out); K1's
    late store names the slot with the allocation number it was given: refused, so K2
    never holds K1's bytes. K2's own store, with its number, goes ahead."""
    peer, _mem = registered(service, b"w", seed=7)
    first = service.handle(b"w", peer, m.Allocate(3, [b"k1"]))
    assert isinstance(first, m.Allocated) and len(first.gens) == 4
    assert isinstance(service.handle(b"w", peer, m.Abort(4, first.slots)), m.Ok)
    second = service.handle(b"w", peer, m.Allocate(5, [b"k2"]))
    assert second.slots == first.slots and second.gens != first.gens
    late = service.handle(b"w", peer, m.Transfer(6, 1, m.Direction.STORE, pack_u32([0]),
                                                 first.slots, gens=first.gens))
    assert isinstance(late, m.Done) and late.code == m.Code.EXPIRED
    assert "handed out again" in late.message
    torn = service.handle(b"w", peer, m.Transfer(7, 2, m.Direction.STORE, pack_u32([0]),
                                                 first.slots, gens=b"\x01"))
    assert isinstance(torn, m.Done) and torn.code == m.Code.BAD_IDS
    assert service.index.pending_blocks == 1  # K2's slot, still waiting for its store
    own = service.handle(b"w", peer, m.Transfer(8, 3, m.Direction.STORE, pack_u32([0]),
                                                second.slots, gens=second.gens))
    assert own is None  # accepted: its Done comes when the copy ends


def test_a_late_store_into_a_slot_given_up_meanwhile_is_expired_not_bad_ids(service):
    """Its allocation ended (aborted here; its pending time passing is the same) and
    the slot is free: BAD_IDS said "fix the caller" where the slot handed out again said
    EXPIRED, for the same late store. A slot never handed out is still BAD_IDS."""
    peer, _mem = registered(service, b"w", seed=9)
    got = service.handle(b"w", peer, m.Allocate(3, [b"k1"]))
    assert isinstance(got, m.Allocated)
    assert isinstance(service.handle(b"w", peer, m.Abort(4, got.slots)), m.Ok)
    late = service.handle(b"w", peer, m.Transfer(5, 1, m.Direction.STORE, pack_u32([0]),
                                                 got.slots, gens=got.gens))
    assert isinstance(late, m.Done) and late.code == m.Code.EXPIRED, late
    assert "allocation ended" in late.message
    # Slots or gens the daemon never handed out are the caller's bug: BAD_IDS.
    never = int(np.frombuffer(got.slots, dtype=np.uint32)[0]) + 1
    for i, gens in enumerate((pack_u32([0]), got.gens, pack_u32([12345]))):
        stray = service.handle(b"w", peer, m.Transfer(6 + i, 2 + i, m.Direction.STORE,
                                                      pack_u32([0]), pack_u32([never]),
                                                      gens=gens))
        assert isinstance(stray, m.Done) and stray.code == m.Code.BAD_IDS, (i, stray)
    # Another tenant's slot: BAD_IDS whatever the gens (its state is not this one's to
    # learn), as before.
    spec = Spec("unused", model="another", seed=10)
    mem = make_memory(spec)
    other = hello(service, b"o")
    assert isinstance(service.handle(b"o", other, m.Register(
        2, fingerprint(spec), 0, host_regions(mem))), m.Registered)
    theirs = service.handle(b"o", other, m.Allocate(3, [b"k9"]))
    slot = int(np.frombuffer(theirs.slots, dtype=np.uint32)[0])
    gen = int(np.frombuffer(theirs.gens, dtype=np.uint32)[0])
    for i, g in enumerate(range(max(gen - 1, 1), gen + 2)):
        probe = service.handle(b"w", peer, m.Transfer(20 + i, 20 + i, m.Direction.STORE,
                                                      pack_u32([0]), pack_u32([slot]),
                                                      gens=pack_u32([g])))
        assert isinstance(probe, m.Done) and probe.code == m.Code.BAD_IDS, (g, probe)
    assert service.index.pending_blocks == 1  # the other tenant's, untouched


def test_transfers_released_by_their_allocate_each_get_one_done_despite_a_bug(service,
                                                                             monkeypatch):
    """Stores that overtook their Allocate wait for it; when it comes, each one ends
    once, even if accepting one of them hits an internal error (before, the error left
    add_ticket and the rest, already taken off the parked list, never got a Done)."""
    peer, _mem = registered(service, b"w", seed=8)
    pushed: list[m.Done] = []
    monkeypatch.setattr(service.transfers, "send", lambda ident, reply: pushed.append(reply))
    for event in (1, 2):
        parked = service.handle(b"w", peer, m.Transfer(10 + event, event, m.Direction.STORE,
                                                       pack_u32([0]), b"", ticket=42))
        assert parked is None
    from kvd import transfers

    real = transfers.build_job
    calls = []

    def broken_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(transfers, "build_job", broken_once)
    allocated = service.handle(b"w", peer, m.Allocate(20, [b"k"], ticket=42))
    assert isinstance(allocated, m.Allocated)
    assert [(d.event, d.code) for d in pushed] == [(1, m.Code.INTERNAL)]
    # TP=1: the first used the ticket up, so the second waits again, and ends at its
    # deadline like any Transfer whose ticket never comes
    assert service.transfers.tickets.parked == 1
    service.transfers.expire(now=float("inf"))
    assert [(d.event, d.code) for d in pushed] == [(1, m.Code.INTERNAL), (2, m.Code.BAD_IDS)]


def test_a_release_of_malformed_slot_ids_is_refused(service):
    peer, _mem = registered(service, b"w", seed=3)
    reply = service.handle(b"w", peer, m.Release(3, 1, b"\x01\x02\x03"))
    assert isinstance(reply, m.Error) and reply.code == m.Code.BAD_IDS


def test_a_load_naming_a_slot_twice_is_refused(service):
    """One READY slot named 65,536 times would be 256 GiB of copying for one Transfer."""
    peer, _mem = registered(service, b"w", seed=4)
    done = service.handle(b"w", peer, m.Transfer(3, 9, m.Direction.LOAD, pack_u32([1, 2]),
                                                 pack_u32([5, 5])))
    assert isinstance(done, m.Done) and done.code == m.Code.BAD_IDS
    assert "named twice" in done.message and service.index.pinned_blocks == 0


def test_one_tenant_holds_at_most_three_quarters_of_the_pool_pending(service):
    """A scheduler that allocates and never stores: its Allocates stop at 3/4 of the
    pool's slots, and a second connection of its fingerprint gets none past them (it
    got 3/4 of its own, the whole pool), so another tenant still gets room."""
    spec = Spec("unused", model="hog")
    peers = {}
    for ident in (b"hog", b"hog2"):
        peers[ident] = hello(service, ident)
        assert isinstance(service.handle(ident, peers[ident],
                                         m.Register(2, fingerprint(spec), -1)), m.Registered)
    hog_mem = make_memory(spec)  # its worker: without one, no slot is allocated at all
    worker = hello(service, b"hog-worker")
    assert isinstance(service.handle(b"hog-worker", worker, m.Register(
        2, fingerprint(spec), 0, host_regions(hog_mem))), m.Registered)
    peer = peers[b"hog"]
    tenant = service.clients[b"hog"].tenant
    quota = service.index.allocator.total_slots(tenant.slot_bytes) * 3 // 4
    got = asked = 0
    for req in range(10, 10 + 3 * quota // 64):  # twice what the pool holds
        reply = service.handle(b"hog", peer, m.Allocate(
            req, [f"h{req}-{i}".encode() for i in range(64)], pending_ms=600_000))
        asked += 64
        if isinstance(reply, m.Error):
            assert reply.code == m.Code.BUSY and "3/4 of the pool" in reply.message
            break
        got += reply.allocated
    assert got == quota == service.index.pending_blocks
    # The keys past the quota, in the Allocate it cut short and the one it refused, are
    # counted (``no_space`` is for a pool with no room: it said nothing of them).
    assert service.counters.quota_cut_keys == asked - got > 64
    assert service.index.counters.no_space == 0
    cut = service.counters.quota_cut_keys  # keys held or being stored need no slot: not cut
    service.handle(b"hog", peer, m.Allocate(9, [b"h10-0", b"h10-1", b"new"]))
    assert service.counters.quota_cut_keys == cut + 1
    reply = service.handle(b"hog2", peers[b"hog2"], m.Allocate(
        3, [b"g%d" % i for i in range(64)], pending_ms=600_000))
    assert isinstance(reply, m.Error) and reply.code == m.Code.BUSY
    assert service.index.pending_blocks == quota
    other, _mem = registered(service, b"w", seed=5)
    reply = service.handle(b"w", other, m.Allocate(3, [b"x%d" % i for i in range(64)]))
    assert isinstance(reply, m.Allocated) and reply.allocated == 64


def test_a_store_whose_slots_were_given_up_during_its_copy_does_not_end_ok(service,
                                                                          monkeypatch):
    """One of the store's slots is aborted while its copy runs: that block is not
    stored, so the Done says ABORTED (before, OK with every byte counted); the block
    whose allocation stayed is stored."""
    peer, _mem = registered(service, b"w", seed=9)
    pushed: list[m.Done] = []
    monkeypatch.setattr(service.transfers, "send", lambda ident, reply: pushed.append(reply))
    got = service.handle(b"w", peer, m.Allocate(3, [b"a", b"b"]))
    assert isinstance(got, m.Allocated) and got.allocated == 2
    store = m.Transfer(4, 1, m.Direction.STORE, pack_u32([0, 1]), got.slots, gens=got.gens)
    assert service.handle(b"w", peer, store) is None
    (job,) = list(service.transfers.owners)
    assert isinstance(service.handle(b"w", peer, m.Abort(5, got.slots[:4])), m.Ok)
    service.transfers.complete(job, None, 0.001)  # as the engine reports the copy done
    (done,) = pushed
    assert done.code == m.Code.ABORTED and done.nbytes == 0
    assert "1 of 2 blocks" in done.message
    assert service.index.pinned_blocks == 0 and service.index.pending_blocks == 0
    assert service.handle(b"w", peer, m.Lookup(6, [b"a"])).hits == 0
    assert service.handle(b"w", peer, m.Lookup(7, [b"b"])).hits == 1


def test_an_abort_of_another_connections_allocation_is_refused(service):
    """Two workers of one tenant: one may not give up the other's pending slots (its
    store would then fail); its own, yes."""
    peer_v, _mem_v = registered(service, b"v", seed=10)
    peer_s, _mem_s = registered(service, b"s", seed=10)  # same spec: the same tenant
    assert service.clients[b"v"].tenant is service.clients[b"s"].tenant
    got = service.handle(b"v", peer_v, m.Allocate(3, [b"a", b"b"]))
    assert isinstance(got, m.Allocated) and got.allocated == 2
    refused = service.handle(b"s", peer_s, m.Abort(4, got.slots))
    assert isinstance(refused, m.Error) and refused.code == m.Code.BAD_IDS
    assert "another connection" in refused.message
    assert service.index.pending_blocks == 2
    own = service.handle(b"v", peer_v, m.Abort(5, got.slots))
    assert isinstance(own, m.Ok) and own.count == 2 and service.index.pending_blocks == 0


def test_a_second_hello_on_one_connection_is_refused_and_keeps_its_transfers(service,
                                                                            monkeypatch):
    """A second Hello used to replace the client, and the Dones of its running and
    waiting Transfers went nowhere; now it is refused and they end as usual."""
    peer, _mem = registered(service, b"w", seed=11)
    pushed: list[m.Done] = []
    monkeypatch.setattr(service.transfers, "send", lambda ident, reply: pushed.append(reply))
    waiting = service.handle(b"w", peer, m.Transfer(3, 1, m.Direction.STORE, pack_u32([0]),
                                                    b"", ticket=77))
    assert waiting is None and service.transfers.tickets.parked == 1
    again = service.handle(b"w", peer, m.Hello(4, m.PROTOCOL_VERSION, os.getpid()))
    assert isinstance(again, m.Error) and again.code == m.Code.BAD_REQUEST
    assert service.clients[b"w"].tenant is not None  # still registered
    service.transfers.expire(now=float("inf"))
    assert [(d.event, d.code) for d in pushed] == [(1, m.Code.BAD_IDS)]


def test_transfers_waiting_for_their_allocate_are_bounded_per_connection(service,
                                                                        monkeypatch):
    """Stores naming tickets no Allocate made each waited 2 s with their block ids, and
    nothing bounded how many: 5,000 took the daemon from 123 MiB to 1.6 GiB. Past the
    bound they end BUSY at once; those waiting end as before, and the room comes back."""
    from kvd import transfers

    peer, _mem = registered(service, b"w", seed=12)
    pushed: list[m.Done] = []
    monkeypatch.setattr(service.transfers, "send", lambda ident, reply: pushed.append(reply))
    ids = pack_u32(range(64))
    monkeypatch.setattr(transfers, "MAX_PARKED_BYTES", 10 * (len(ids) + 256))

    def park(event: int) -> m.Done | None:
        return service.handle(b"w", peer, m.Transfer(100 + event, event, m.Direction.STORE,
                                                     ids, b"", ticket=1000 + event))

    assert [park(e) for e in range(10)] == [None] * 10
    refused = park(10)
    assert isinstance(refused, m.Done) and refused.code == m.Code.BUSY
    assert service.transfers.tickets.parked == 10
    service.transfers.expire(now=float("inf"))
    assert sorted(d.event for d in pushed) == list(range(10))  # each ended once
    assert service.clients[b"w"].parked_bytes == 0
    assert park(11) is None


def test_a_transfer_of_too_many_copy_segments_is_refused_before_the_loop_builds_them(
        service, monkeypatch):
    """4,096 one-byte tensors times 8,192 blocks made 33.5 M copy segments, built on the
    event loop: other clients' replies waited 6 s. Now such a Transfer is refused."""
    from kvd import copy_jobs

    peer, _mem = registered(service, b"w", seed=13)  # two tensors
    got = service.handle(b"w", peer, m.Allocate(3, [b"k%d" % i for i in range(8)]))
    assert isinstance(got, m.Allocated) and got.allocated == 8
    monkeypatch.setattr(copy_jobs, "MAX_SEGMENTS", 15)
    done = service.handle(b"w", peer, m.Transfer(4, 1, m.Direction.STORE, pack_u32(range(8)),
                                                 got.slots, gens=got.gens))
    assert isinstance(done, m.Done) and done.code == m.Code.BAD_REQUEST
    assert "copy segments" in done.message and service.index.pinned_blocks == 0
    monkeypatch.setattr(copy_jobs, "MAX_SEGMENTS", 16)
    assert service.handle(b"w", peer, m.Transfer(5, 2, m.Direction.STORE, pack_u32(range(8)),
                                                 got.slots, gens=got.gens)) is None


@pytest.mark.parametrize("make", [lambda ids: m.Abort(3, ids), lambda ids: m.Release(3, 1, ids)])
def test_slot_ids_of_an_abort_or_release_are_capped_as_a_transfers(service, make):
    peer, _mem = registered(service, b"w", seed=14)
    reply = service.handle(b"w", peer, make(pack_u32([0] * 65)))  # max_keys_per_request 64
    assert isinstance(reply, m.Error) and reply.code == m.Code.BAD_IDS
    assert "65 slot ids" in reply.message


def test_uptime_does_not_follow_the_wall_clock_back(service, monkeypatch):
    """Uptime came from the wall clock: setting the clock back an hour (NTP stepping a
    node's clock at boot) made it negative in status and in kvd_uptime_seconds."""
    import time

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    assert 0 <= service.status()["uptime_s"] < 600


def test_tenants_dropped_at_the_limit_leave_no_tables_behind(tmp_path):
    """Each new fingerprint (engines restarted with a random root hash) left its key
    tables in the index and its topic in the KV events for good, though the tenant was
    dropped at the limit: about 4 KiB per engine restart, for as long as kvd ran."""
    path = f"/dev/shm/kvd-test-{uuid.uuid4().hex[:8]}.pool"
    cfg = Config(pool_size=8 << 20, extent_size=1 << 20, pool_path=path, max_tenants=2,
                 events_endpoint=f"ipc://{tmp_path}/events.ipc")
    pool = Pool(path, cfg.pool_size, prefault=False)
    svc = Service(cfg, pool, {}, lambda ident, reply: None)
    try:
        for i in range(200):
            ident = f"engine-{i}".encode()
            reply = svc.handle(ident, hello(svc, ident), m.Register(
                2, fingerprint(Spec("unused", model=f"m{i}")), -1))
            assert isinstance(reply, m.Registered), reply
            tenant = svc.clients[ident].tenant
            slots = svc.index.allocate(tenant, [b"k" * 36]).slots
            svc.index.store_done(np.array(slots, dtype=np.int64), 0)
            svc.commit()
            svc.idle()  # the events go out
            svc.client_gone(ident)
        assert len(svc.tenants) == 2
        assert len(svc.index._spaces) <= 2 and len(svc.index._ready) <= 2
        assert len(svc.kv_events._topics) < 200 // 2
    finally:
        if svc.kv_events is not None:
            svc.kv_events.close()
        pool.close(unlink=True)
