"""At the tenant limit, a tenant no client uses makes room for a new fingerprint: a
fleet that restarts engines with new fingerprints (a random root hash without
PYTHONHASHSEED, new weights) is never refused for good, and tenants in use keep their
blocks. A real daemon, real client processes."""

from __future__ import annotations

import numpy as np
import pytest
from kvd_client import Connection, RemoteError, host_regions
from kvd_proto import messages as m

from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker, fingerprint
from tests.waiting import wait_for


def stored(d, model: str, n: int) -> tuple[Connection, list[bytes]]:
    """A tenant with ``n`` READY blocks; its scheduler connection stays."""
    spec = Spec(d.socket, model=model)
    sched = scheduler(d, spec)
    w = Worker(spec)
    ks = keys(n, model)
    assert w.store(1, range(n), allocate(sched, ks))[1] == 0
    w.close()
    return sched, ks


def clients_of(d, model: str) -> int:
    return sum(t["clients"] for t in d.status()["tenants"] if t["model"] == model)


def register(conn: Connection, model: str) -> m.Reply:
    return conn.request(m.Register(conn.next_req(), fingerprint(Spec("", model=model)), -1))


def test_a_tenant_without_clients_makes_room_for_a_new_one(daemon_factory):
    d = daemon_factory(env={"KVD_MAX_TENANTS": "2"})
    sched_a, ks_a = stored(d, "a", 4)  # in use: its scheduler stays
    sched_b, _ = stored(d, "b", 3)
    sched_b.close()  # b: nobody left
    assert wait_for(lambda: clients_of(d, "b") == 0, 20)
    sched_c = scheduler(d, Spec(d.socket, model="c"))  # b gives up its place and blocks
    st = d.status()
    assert sorted(t["model"] for t in st["tenants"]) == ["a", "c"]
    assert st["counters"]["evicted_blocks"] == 3
    assert lookup(sched_a, ks_a).hits == 4  # a tenant in use keeps its blocks
    # Every tenant has a client: a new fingerprint gets a typed refusal, nothing is lost.
    other = Connection(d.socket, name="late")
    assert other.wait_up(10)
    with pytest.raises(RemoteError, match="tenant limit") as refused:
        register(other, "d")
    assert refused.value.code == m.Code.BAD_REQUEST
    assert lookup(sched_a, ks_a).hits == 4
    sched_c.close()  # c leaves: d gets in on the same connection
    assert wait_for(lambda: clients_of(d, "c") == 0, 20)
    assert isinstance(register(other, "d"), m.Registered)
    assert sorted(t["model"] for t in d.status()["tenants"]) == ["a", "d"]
    assert lookup(sched_a, ks_a).hits == 4
    other.close()
    sched_a.close()


def test_a_register_refused_for_its_memory_drops_no_other_tenant(daemon_factory):
    """A worker of a new fingerprint registers memory that does not match it: the typed
    refusal comes before any idle tenant gives up its place (its blocks were evicted
    first, and lost to a bad request)."""
    d = daemon_factory(env={"KVD_MAX_TENANTS": "2"})
    sched_a, _ = stored(d, "a", 2)
    sched_b, ks_b = stored(d, "b", 5)
    sched_b.close()
    assert wait_for(lambda: clients_of(d, "b") == 0, 20)
    bad = Connection(d.socket, name="bad")
    assert bad.wait_up(10)
    one_region = host_regions([np.zeros((4, 8192), dtype=np.uint8)])  # 2 tensors named
    with pytest.raises(RemoteError, match="1 memory regions") as refused:
        bad.request(m.Register(bad.next_req(), fingerprint(Spec("", model="c")), 0,
                               one_region))
    assert refused.value.code == m.Code.SIZE_MISMATCH
    st = d.status()
    assert sorted(t["model"] for t in st["tenants"]) == ["a", "b"]
    assert st["counters"]["evicted_blocks"] == 0
    sched_b = scheduler(d, Spec(d.socket, model="b"))  # b's engine is back: all there
    assert lookup(sched_b, ks_b).hits == 5
    for c in (bad, sched_a, sched_b):
        c.close()
