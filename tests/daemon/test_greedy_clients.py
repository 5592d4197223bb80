"""One client that floods the daemon, or never reads its replies, must not cost the other
clients their service, nor the daemon its memory (a real daemon, raw ZeroMQ peers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import zmq

from kvd_client import RemoteError
from kvd_proto import messages as m
from tests.daemon.test_integration import allocate, keys, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for


def raw_hello(path: str, ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    sock.send(m.encode(m.Hello(1, m.PROTOCOL_VERSION, os.getpid(), "greedy")))
    assert sock.poll(10_000), "no HelloOk"
    assert isinstance(m.decode_reply(sock.recv()), m.HelloOk)
    return sock


def _flood(path: str, seconds: float, ready) -> None:
    """Pings as fast as blocking sends go (honouring the socket's HWM), never read."""
    ctx = zmq.Context()
    sock = raw_hello(path, ctx)
    ping = m.encode(m.Ping(7))
    ready.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            sock.send(ping)
    ctx.destroy(linger=0)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_flooding_client_does_not_hold_up_another_clients_dones(daemon):
    spec = Spec(daemon.socket)
    sched, worker = scheduler(daemon, spec), Worker(spec)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    flooder = ctx.Process(target=_flood, args=(daemon.socket, 3.0, ready), daemon=True)
    flooder.start()
    try:
        assert ready.wait(30)
        time.sleep(0.5)  # a backlog builds up
        t0 = time.monotonic()
        _, code, *_ = worker.store(1, range(8), allocate(sched, keys(8)))
        took = time.monotonic() - t0
        assert code == 0
        assert took < 2.0, f"the store's Done took {took:.1f}s behind the flood"
    finally:
        flooder.join(30)
        worker.close()
        sched.close()


def test_a_client_that_never_reads_is_dropped_before_the_daemon_grows(daemon):
    spec = Spec(daemon.socket)
    ctx = zmq.Context()
    sock = raw_hello(daemon.socket, ctx)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    stats = m.encode(m.Stats(2))  # a small request, a reply of a kilobyte or more
    before = rss_mb(daemon.pid)
    try:
        for _ in range(100_000):  # 150 MB of replies, were they all kept
            sock.send(stats)
        assert wait_for(lambda: "does not read its replies" in daemon.logs(), 30)
        assert rss_mb(daemon.pid) - before < 60
    finally:
        ctx.destroy(linger=0)
    sched, worker = scheduler(daemon, spec), Worker(spec)  # the others are served
    try:
        assert worker.store(1, range(4), allocate(sched, keys(4)))[1] == 0
    finally:
        worker.close()
        sched.close()


def test_the_daemon_takes_the_hard_descriptor_limit(daemon_factory):
    """ZeroMQ aborts the process when an accept finds no descriptor left: a shell's soft
    limit (1,024) would let 1,000 idle connections kill the daemon."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the daemon
    try:
        d = daemon_factory()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with open(f"/proc/{d.pid}/limits") as f:
        row = next(line for line in f if line.startswith("Max open files")).split()
    assert int(row[3]) == min(hard, 1 << 20) > low


def test_copy_threads_take_turns_between_clients(monkeypatch):
    """A client's large load (64 chunks here) does not hold the copy threads until it is
    through: another client's small load, sent after it, ends long before it."""
    import numpy as np

    from kvd.engines import host
    from kvd.engines.base import CopyJob

    monkeypatch.setattr(host, "CHUNK_BYTES", 64 << 10)
    real = host._vm_writev

    def slow_writev(*args):  # each chunk takes a while (a busy machine)
        time.sleep(0.01)
        return real(*args)

    monkeypatch.setattr(host, "_vm_writev", slow_writev)
    order: list[int] = []
    engine = host.HostEngine(lambda job, err, s: order.append(job.client), threads=1)
    big_src, big_dst = np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)
    small_src, small_dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)

    def load(client: int, src: np.ndarray, dst: np.ndarray) -> CopyJob:
        return CopyJob(client, client, client, m.Direction.LOAD, os.getpid(),
                       np.array([src.ctypes.data], np.uint64),
                       np.array([dst.ctypes.data], np.uint64),
                       np.array([src.size], np.uint64), np.arange(1), -1,
                       time.monotonic() + 30)

    try:
        engine.submit(load(1, big_src, big_dst))
        engine.submit(load(2, small_src, small_dst))
        assert wait_for(lambda: len(order) == 2, 30)
        assert order == [2, 1]
        assert big_dst.all() and small_dst.all()
    finally:
        engine.close()


def test_no_slot_is_allocated_while_a_rank_has_no_worker(daemon):
    """A scheduler whose workers' Registers were refused (or not made yet) got slots for
    blocks nobody would copy: each Allocate evicted other blocks and held its slots
    PENDING until they lapsed. Refused (BUSY) until every rank of the tenant has a
    worker, allocating nothing; a store by its ticket ends at once."""
    spec = Spec(daemon.socket, tp_size=2)
    sched = scheduler(daemon, spec)
    rank0 = rank1 = None
    try:
        for ticket, missing in ((5, "ranks 0, 1:"), (6, "rank 1:")):
            if ticket == 6:
                rank0 = Worker(spec)
            with pytest.raises(RemoteError) as refused:
                sched.request(m.Allocate(sched.next_req(), keys(8), ticket=ticket))
            assert refused.value.code == m.Code.BUSY and missing in str(refused.value)
            assert daemon.status()["blocks"]["pending"] == 0
        assert rank0 is not None
        t0 = time.monotonic()
        _, code, _, nbytes = rank0.store(1, range(8), [], ticket=6)
        assert (code, nbytes) == (0, 0) and time.monotonic() - t0 < 5  # copying nothing,
        # at once (not after the pending time)
        rank1 = Worker(Spec(daemon.socket, tp_size=2, rank=1))
        assert allocate(sched, keys(8)).size == 8  # every rank has a worker now
    finally:
        for w in (rank0, rank1):
            if w is not None:
                w.call("exit")
        sched.close()
