"""Callers send (and receive their replies) on their own threads while the I/O thread
delivers pushed Dones: against a real daemon, nothing is lost, reordered or delivered
on the wrong thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np

from kvd_client import Connection, RemoteError, host_regions
from kvd_proto import messages as m
from kvd_proto.ids import pack_u32, unpack_u32
from tests.daemon.workers import Spec, fingerprint
from tests.waiting import wait_for


def test_a_queued_message_is_not_overtaken(daemon):
    """A message queued while the I/O thread was busy goes out before one submitted
    after it, even by a thread that could send at once (here an ``on_done`` callback,
    which runs on the I/O thread): the daemon answers in arrival order."""
    spec = Spec(daemon.socket, pages=(4096,))
    mem = [np.zeros((1, 4096), dtype=np.uint8)]
    inside, queued = threading.Event(), threading.Event()
    answered: list[str] = []
    futs: dict[str, Future] = {}

    def submit(name: str) -> None:
        futs[name] = c.submit(m.Ping(c.next_req()))
        futs[name].add_done_callback(lambda f: answered.append(name))

    def on_done(done: m.Done) -> None:  # holds the I/O thread (and the socket)
        inside.set()
        assert queued.wait(10)
        submit("second")

    sched = Connection(daemon.socket, timeout=10, register=m.Register(0, fingerprint(spec), -1))
    c = Connection(daemon.socket, timeout=10, on_done=on_done,
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    try:
        assert sched.wait_up(5) and c.wait_up(5)
        slots = sched.request(m.Allocate(sched.next_req(), [b"k"])).slots
        assert c.send(m.Transfer(c.next_req(), 1, m.Direction.STORE, pack_u32([0]), slots))
        assert inside.wait(10)
        submit("first")  # the I/O thread is busy: queued
        queued.set()
        assert wait_for(lambda: len(answered) == 2, 10), answered
        assert all(isinstance(f.result(0), m.Ok) for f in futs.values())
        assert answered == ["first", "second"]
    finally:
        c.close()
        sched.close()


def test_calls_on_many_threads_beside_transfers_each_end_once(daemon):
    """Callers receiving their own replies leave every Done to the I/O thread: each
    Transfer ends once, on that thread; each call gets its own reply."""
    spec = Spec(daemon.socket, pages=(4096,))
    n = 256
    mem = [np.random.default_rng(3).integers(0, 255, (n, 4096), dtype=np.uint8)]
    dones: list[tuple[str, m.Done]] = []
    sched = Connection(daemon.socket, timeout=10, register=m.Register(0, fingerprint(spec), -1))
    w = Connection(daemon.socket, timeout=10,
                   on_done=lambda d: dones.append((threading.current_thread().name, d)),
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    keys = [f"key{i}".encode() for i in range(n)]
    wrong: list[str] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            msg = m.Ping(w.next_req())
            reply = w.request(msg)
            if not isinstance(reply, m.Ok) or reply.req != msg.req:
                wrong.append(repr(reply))

    try:
        assert sched.wait_up(5) and w.wait_up(5)
        slots = unpack_u32(sched.request(m.Allocate(sched.next_req(), keys)).slots)
        callers = [threading.Thread(target=caller) for _ in range(3)]
        for t in callers:
            t.start()
        for i in range(n):  # one block per Transfer: many Dones among the replies
            assert w.send(m.Transfer(w.next_req(), i + 1, m.Direction.STORE,
                                     pack_u32([i]), pack_u32(slots[i:i + 1])))
        assert wait_for(lambda: len(dones) >= n, 30), len(dones)
        stop.set()
        for t in callers:
            t.join(10)
        time.sleep(0.2)  # a second Done for any Transfer would have come by now
        assert not wrong, wrong[:3]
        assert sorted(d.event for _, d in dones) == list(range(1, n + 1))
        assert {d.code for _, d in dones} == {m.Code.OK}
        assert {name for name, _ in dones} == {"kvd-client-io"}
        assert sched.request(m.Lookup(sched.next_req(), keys)).hits == n
    finally:
        stop.set()
        w.close()
        sched.close()


def test_an_error_reply_reaches_a_caller_at_once(daemon):
    """An Error answering a call is left to the I/O thread, which ends the call now,
    not after the caller's receive window or its timeout."""
    spec = Spec(daemon.socket, pages=(4096,))
    c = Connection(daemon.socket, timeout=10, register=m.Register(0, fingerprint(spec), -1))
    try:
        assert c.wait_up(5)
        for _ in range(20):
            t0 = time.monotonic()
            try:
                c.request(m.Lookup(c.next_req(), [b"k" * 100_000]))  # too long a key
            except RemoteError as e:
                assert e.code == m.Code.BAD_REQUEST
            else:
                raise AssertionError("a Lookup of a 100 kB key was answered")
            assert time.monotonic() - t0 < 1.0
            assert c.request(m.Ping(c.next_req())).req > 0  # the connection still works
    finally:
        c.close()
