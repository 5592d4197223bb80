"""An admin eviction of many blocks goes in parts, with requests served in between: a
flush of a million blocks held every engine's Lookups two seconds in one piece."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from kvd import admin
from kvd.access import Peer
from kvd.config import Config
from kvd.core.index import NO_SLOT
from kvd.pool import Pool
from kvd.service import Service
from kvd_proto import messages as m
from tests.daemon.workers import Spec, fingerprint

PART = 8  # blocks per part here (the daemon's is thousands)


@pytest.fixture
def parts(monkeypatch):
    """A service whose ``later`` calls queue up until the test runs them, and what it
    sent on its own (the answers that come after a part)."""
    monkeypatch.setattr(admin, "EVICT_PART", PART)
    path = f"/dev/shm/kvd-test-{uuid.uuid4().hex[:8]}.pool"
    cfg = Config(pool_size=8 << 20, extent_size=1 << 20, pool_path=path)
    pool = Pool(path, cfg.pool_size, prefault=False)
    sent: list[tuple[bytes, m.Reply]] = []
    queued: list[Callable[[], None]] = []
    svc = Service(cfg, pool, {}, lambda ident, reply: sent.append((ident, reply)))
    svc.later = queued.append
    yield svc, sent, queued
    pool.close(unlink=True)


def client(svc: Service, ident: bytes, model: str) -> Peer:
    peer = Peer(os.getpid(), os.getuid(), os.getgid())
    assert isinstance(svc.handle(ident, peer, m.Hello(1, m.PROTOCOL_VERSION, 1)), m.HelloOk)
    reply = svc.handle(ident, peer, m.Register(2, fingerprint(Spec("unused", model=model)), -1))
    assert isinstance(reply, m.Registered), reply
    return peer


def stored(svc: Service, ident: bytes, keys: list[bytes]) -> None:
    tenant = svc.clients[ident].tenant
    slots = svc.index.allocate(tenant, keys).slots
    assert NO_SLOT not in slots
    svc.index.store_done(np.array(slots, dtype=np.int64), 0)
    svc.commit()


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "little") for i in range(n)]


@pytest.mark.parametrize("what", ["flush", "evict"])
def test_an_eviction_in_parts_serves_requests_between_and_answers_once(parts, what):
    svc, sent, queued = parts
    peer = client(svc, b"a", "m1")
    client(svc, b"b", "m2")
    a, b = keys(b"a", 3 * PART + 3), keys(b"b", PART)
    stored(svc, b"a", a)
    stored(svc, b"b", b)
    a_id = svc.clients[b"a"].tenant.id
    msg = m.Flush(7) if what == "flush" else m.Evict(7, a_id)
    assert svc.handle(b"a", peer, msg) is None  # answered after the last part
    assert not sent and len(queued) == 1
    # Between parts: a Lookup is answered, the blocks not reached yet still hit, and
    # the one it leases is kept by the next parts.
    left = a[PART:]
    hit = svc.handle(b"a", peer, m.Lookup(8, left))
    assert isinstance(hit, m.LookupOk) and hit.hits == len(left)
    while queued:
        queued.pop(0)()
    assert sent == [(b"a", m.Ok(7, len(a) - len(left) + (len(b) if what == "flush" else 0)))]
    assert svc.index.lookup(svc.clients[b"a"].tenant, left)[0] == len(left)  # leased: kept
    assert svc.index.lookup(svc.clients[b"a"].tenant, a[:1])[0] == 0
    kept_b = svc.index.lookup(svc.clients[b"b"].tenant, b)[0]
    assert kept_b == (0 if what == "flush" else len(b))
    assert svc.index.pinned_blocks == len(left)


def test_a_slot_reused_by_another_tenant_between_parts_is_not_taken(parts):
    svc, sent, queued = parts
    peer = client(svc, b"a", "m1")
    client(svc, b"b", "m2")
    a = keys(b"a", 2 * PART)
    stored(svc, b"a", a)
    a_tenant = svc.clients[b"a"].tenant
    a_slots = set(svc.index.evictable(a_tenant).tolist())
    assert svc.handle(b"a", peer, m.Evict(7, a_tenant.id)) is None
    # Between parts, the engine's blocks go another way (a tenant's own flush, say) and
    # another tenant's blocks take their slots.
    svc.index.evict_tenant(a_tenant)
    b = keys(b"b", 2 * PART)
    stored(svc, b"b", b)
    b_slots = svc.index.evictable(svc.clients[b"b"].tenant).tolist()
    assert a_slots & set(b_slots)  # (reused)
    while queued:
        queued.pop(0)()
    assert sent == [(b"a", m.Ok(7, PART))]  # the first part only
    assert svc.index.lookup(svc.clients[b"b"].tenant, b)[0] == len(b)


def test_a_failing_part_is_answered_with_an_error(parts, monkeypatch):
    svc, sent, queued = parts
    peer = client(svc, b"a", "m1")
    stored(svc, b"a", keys(b"a", 2 * PART))
    assert svc.handle(b"a", peer, m.Flush(7)) is None

    def broken(slots, tenant):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(svc.index, "evict_slots", broken)
    queued.pop(0)()
    [(ident, reply)] = sent
    assert ident == b"a" and isinstance(reply, m.Error) and reply.code == m.Code.INTERNAL
    assert "disk on fire" in reply.message and not queued


def test_without_a_loop_an_eviction_is_answered_at_once(parts):
    svc, sent, queued = parts
    svc.later = None  # (in-process use: the simulator, tests)
    peer = client(svc, b"a", "m1")
    stored(svc, b"a", keys(b"a", 3 * PART))
    assert svc.handle(b"a", peer, m.Flush(7)) == m.Ok(7, 3 * PART)
    assert not sent and not queued


def test_a_stop_finishes_the_evictions_under_way_and_answers_them(parts):
    """The daemon stops while evictions go in parts: they finish at once and are
    answered while the socket is open; the parts still queued do nothing (they ran
    after the journal and the event stream had closed, and nobody was answered)."""
    svc, sent, queued = parts
    peer = client(svc, b"a", "m1")
    client(svc, b"b", "m2")
    stored(svc, b"a", keys(b"a", 3 * PART))
    stored(svc, b"b", keys(b"b", 3 * PART))
    b_id = svc.clients[b"b"].tenant.id
    assert svc.handle(b"a", peer, m.Flush(7)) is None
    assert svc.handle(b"a", peer, m.Evict(8, b_id)) is None
    svc.finish_evictions()
    assert sent == [(b"a", m.Ok(7, 5 * PART)), (b"a", m.Ok(8, PART))]  # (in order)
    assert not svc.evictions and svc.index.evictable(None).size == 0
    while queued:
        queued.pop(0)()
    assert len(sent) == 2
