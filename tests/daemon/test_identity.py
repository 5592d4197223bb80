"""A client is its connection: another process's connection that takes a closed one's
ZeroMQ routing id (before the daemon has timed the old client out) is not that client,
and never gets its tenant, memory or leases (a real daemon, raw ZeroMQ peers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import zmq

from kvd_proto import messages as m
from tests.daemon.workers import Spec, fingerprint

ROUTING_ID = b"kvd-test-claimed-id"


def ask(sock: zmq.Socket, msg: m.Request) -> m.Reply:
    sock.send(m.encode(msg))
    assert sock.poll(10_000), f"no reply to {type(msg).__name__}"
    return m.decode_reply(sock.recv())


def connect(ctx: zmq.Context, path: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, ROUTING_ID)
    sock.connect(f"ipc://{path}")
    return sock


def _claim(path: str, out) -> None:
    """Another process, the same routing id: what the daemon answers it."""
    ctx = zmq.Context()
    sock = connect(ctx, path)
    replies = [ask(sock, m.Lookup(5, [b"k"])), ask(sock, m.Hello(6, m.PROTOCOL_VERSION,
                                                                 os.getpid()))]
    out.put([(type(r).__name__, getattr(r, "code", None), getattr(r, "message", ""))
             for r in replies])
    ctx.destroy(linger=0)


def test_another_connection_with_a_closed_ones_routing_id_is_not_that_client(daemon):
    ctx = zmq.Context()
    owner = connect(ctx, daemon.socket)
    assert isinstance(ask(owner, m.Hello(1, m.PROTOCOL_VERSION, os.getpid())), m.HelloOk)
    registered = ask(owner, m.Register(2, fingerprint(Spec(daemon.socket)), -1))
    assert isinstance(registered, m.Registered)
    owner.close(linger=0)  # gone without a Bye: the daemon keeps the client a while
    ctx.destroy(linger=0)
    time.sleep(0.5)  # the ROUTER lets the old pipe go, so the id is free to take
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    child = spawn.Process(target=_claim, args=(daemon.socket, out), daemon=True)
    child.start()
    (lookup, hello) = out.get(timeout=60)
    child.join(10)
    # Before: the Lookup was answered as the old client's (its tenant, its leases).
    assert lookup[:2] == ("Error", m.Code.NOT_REGISTERED), lookup
    assert "not the one that said Hello" in lookup[2]
    assert hello[:2] == ("Error", m.Code.NOT_REGISTERED), hello
