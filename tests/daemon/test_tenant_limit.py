"""At the tenant limit, a tenant no client uses makes room for a new fingerprint: a
fleet that restarts engines with new fingerprints (a random root hash without
PYTHONHASHSEED, new weights) is never refused for good, and tenants in use keep their
blocks. A real daemon, real client processes."""

from __future__ import annotations

import pytest
from kvd_client import Connection, RemoteError
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
