"""What a buggy or hostile client may send, against the daemon's service: typed refusals
that leave nothing behind, never another process's or tenant's bytes."""

from __future__ import annotations

import os
import uuid

import msgspec
import pytest

from kvd.access import Peer
from kvd.config import Config
from kvd.engines.cuda import ClientCopyEngine
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


@pytest.mark.parametrize("change, why", [
    ({"rank_page_bytes": [1] * 5000}, "page sizes"),
    ({"rank_page_bytes": [4096, 0]}, "page sizes"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": 65}, "tp_size"),
    ({"model": "m" * 5000}, "longer than"),
    ({"rank_page_bytes": [1 << 40]}, "does not fit an extent"),
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
