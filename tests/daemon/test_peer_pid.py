"""The host data path copies by pid: only by one the kernel names, never the client's word."""

from __future__ import annotations

import os
import uuid

import pytest

from kvd.access import Peer
from kvd.config import Config
from kvd.engines.host import HostEngine
from kvd.pool import Pool
from kvd.service import Service
from kvd_client import host_regions
from kvd_proto import messages as m
from tests.daemon.workers import Spec, fingerprint, make_memory


@pytest.fixture
def service():
    path = f"/dev/shm/kvd-test-{uuid.uuid4().hex[:8]}.pool"
    cfg = Config(pool_size=8 << 20, extent_size=1 << 20, pool_path=path)
    pool = Pool(path, cfg.pool_size, prefault=False)
    engine = HostEngine(lambda *a: None, threads=1)
    svc = Service(cfg, pool, {"host": engine}, lambda ident, reply: None)
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
