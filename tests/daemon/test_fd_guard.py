"""Descriptors running out: ZeroMQ aborts the process when an accept finds none left, so
the daemon hides its socket before that (a hunt ended a daemon with a hard limit of 64
at its 42nd client)."""

from __future__ import annotations

import os
import resource
import time

import zmq

from kvd_client import Connection
from kvd_proto import messages as m
from tests.waiting import wait_for

LIMIT = 128  # the guard hides the socket at 112 descriptors in use, shows it below 96


def _hello(ctx: zmq.Context, path: str, i: int) -> zmq.Socket | None:
    """A raw client that said Hello and was answered; None when nobody answered."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    sock.send(m.encode(m.Hello(1, m.PROTOCOL_VERSION, os.getpid(), f"c{i}")))
    if not sock.poll(2000):
        sock.close(linger=0)
        return None
    assert isinstance(m.decode_reply(sock.recv()), m.HelloOk)
    return sock


def test_connections_that_would_take_the_last_descriptors_find_no_socket(daemon):
    resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    ctx = zmq.Context()
    clients: list[zmq.Socket] = []
    try:
        for i in range(LIMIT):
            sock = _hello(ctx, daemon.socket, i)
            if sock is None:
                break
            clients.append(sock)
        assert daemon.proc.poll() is None, daemon.logs()[-2000:]
        assert not os.path.exists(daemon.socket)  # hidden: the next ones found nothing
        assert 60 < len(clients) < LIMIT - 16
        assert "descriptors in use: the socket" in daemon.logs()
        for sock in clients:  # the connected ones are served on
            sock.send(m.encode(m.Ping(2)))
        for sock in clients:
            assert sock.poll(5000) and isinstance(m.decode_reply(sock.recv()), m.Ok)
        for sock in clients[len(clients) // 2:]:
            sock.close(linger=0)
        del clients[len(clients) // 2:]
        assert wait_for(lambda: os.path.exists(daemon.socket), 10)  # back, the same one
        with Connection(daemon.socket, timeout=5) as c:
            assert c.wait_up(5)
        time.sleep(0.5)
        assert daemon.proc.poll() is None
        assert "accepts clients again" in daemon.logs()
        where = os.path.dirname(daemon.socket)
        assert not [f for f in os.listdir(where) if f.endswith(".full")]
        # Hidden again, then stopped: neither name is left behind.
        while (sock := _hello(ctx, daemon.socket, len(clients))) is not None:
            clients.append(sock)
        assert [f for f in os.listdir(where) if f.endswith(".full")]
        assert daemon.stop() == 0
        assert not [f for f in os.listdir(where) if f.endswith((".full", ".sock"))]
    finally:
        for sock in clients:
            sock.close(linger=0)
        ctx.term()
