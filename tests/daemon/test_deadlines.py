"""Every Transfer ends exactly once, and nothing is copied after its client gave it up.

A real daemon subprocess is paused with SIGSTOP (as a swap storm or a stuck host would
pause it) while Transfers of this process wait in its socket. The client here owns real
memory that the daemon reads and writes with process_vm_readv/writev.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvd.engines.base import CopyJob, expired, late
from kvd.engines.host import HostEngine
from kvd_client import Connection, RemoteError, host_regions
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from tests.daemon.workers import Spec, fingerprint
from tests.waiting import wait_for

GRACE_S = m.EXPIRY_GRACE_NS / 1e9
PAGES = (8192, 4096)


class Client:
    """One connection registered as rank 0, with its own KV memory, recording Dones."""

    def __init__(self, socket: str, *, transfer_timeout: float = 5.0, timeout: float = 5.0,
                 ping_interval: float = 1.0) -> None:
        rng = np.random.default_rng(7)
        self.mem = [rng.integers(1, 256, (32, p), dtype=np.uint8) for p in PAGES]
        self.dones: list[tuple[float, m.Done]] = []
        self.cv = threading.Condition()
        spec = Spec(socket, pages=PAGES)
        self.conn = Connection(socket, name="deadlines", on_done=self._done,
                               transfer_timeout=transfer_timeout, timeout=timeout,
                               ping_interval=ping_interval,
                               register=m.Register(0, fingerprint(spec), 0,
                                                   host_regions(self.mem)))
        assert self.conn.wait_up(10)

    def _done(self, done: m.Done) -> None:
        with self.cv:
            self.dones.append((time.monotonic(), done))
            self.cv.notify_all()

    def dones_of(self, event: int) -> list[m.Done]:
        with self.cv:
            return [d for _, d in self.dones if d.event == event]

    def wait_done(self, event: int, timeout: float = 10) -> tuple[float, m.Done]:
        with self.cv:
            assert self.cv.wait_for(lambda: any(d.event == event for _, d in self.dones),
                                    timeout), f"no Done for {event}"
            return next((t, d) for t, d in self.dones if d.event == event)

    def call(self, msg_type, **fields):
        return self.conn.request(msg_type(req=self.conn.next_req(), **fields), 10)

    def transfer(self, event: int, direction: m.Direction, blocks, slots=(), ticket=0) -> float:
        sent = time.monotonic()
        assert self.conn.send(m.Transfer(self.conn.next_req(), event, direction,
                                         pack_u32(blocks), pack_u32(slots), ticket=ticket))
        return sent

    def store(self, keys: list[bytes], blocks: list[int], event: int) -> np.ndarray:
        slots = unpack_u32(self.call(m.Allocate, keys=keys).slots)
        assert (slots != NO_SLOT).all()
        self.transfer(event, m.Direction.STORE, blocks, slots)
        assert self.wait_done(event)[1].code == m.Code.OK
        return slots

    def block_bytes(self, blocks) -> list[bytes]:
        return [b"".join(t[b].tobytes() for t in self.mem) for b in blocks]

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def paused(daemon):
    """``paused()`` stops the daemon; resuming is up to the test (or teardown)."""
    stopped = []

    def stop() -> None:
        os.kill(daemon.pid, signal.SIGSTOP)
        stopped.append(True)

    yield stop
    if stopped:
        os.kill(daemon.pid, signal.SIGCONT)


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + bytes([i]) * 35 for i in range(n)]


def test_a_load_that_waited_out_its_deadline_writes_nothing(daemon, paused):
    c = Client(daemon.socket, transfer_timeout=0.3)
    try:
        k = keys(b"L", 4)
        c.store(k, [0, 1, 2, 3], event=1)
        hit = c.call(m.Lookup, keys=k)
        assert hit.hits == 4
        target = [20, 21, 22, 23]
        for t in c.mem:
            t[target] = 0
        paused()
        sent = c.transfer(2, m.Direction.LOAD, target, unpack_u32(hit.slots))
        time.sleep(0.6)  # past the deadline, short of deadline + grace
        assert c.dones_of(2) == []  # the client frees nothing while kvd might still copy
        os.kill(daemon.pid, signal.SIGCONT)
        at, done = c.wait_done(2)
        assert done.code == m.Code.EXPIRED, done
        assert at - sent < 0.3 + GRACE_S  # the daemon's own answer, not the client's
        assert all(not t[target].any() for t in c.mem)  # not one byte written
        st = daemon.status()["counters"]
        assert st["expired_transfers"] == 1 and st["loaded_blocks"] == 0
    finally:
        c.close()


def test_a_store_that_waited_out_its_deadline_never_becomes_ready(daemon, paused):
    c = Client(daemon.socket, transfer_timeout=0.3)
    try:
        k = keys(b"S", 3)
        slots = unpack_u32(c.call(m.Allocate, keys=k).slots)
        paused()
        c.transfer(5, m.Direction.STORE, [4, 5, 6], slots)
        time.sleep(0.6)
        os.kill(daemon.pid, signal.SIGCONT)
        assert c.wait_done(5)[1].code == m.Code.EXPIRED
        assert c.call(m.Lookup, keys=k).hits == 0
        assert daemon.status()["blocks"]["pending"] == 0  # its slots were given up at once
        # The keys can be stored again, and then they are served.
        c.store(k, [4, 5, 6], event=6)
        assert c.call(m.Lookup, keys=k).hits == 3
    finally:
        c.close()


def test_without_a_done_the_client_gives_up_only_after_deadline_plus_grace(daemon, paused):
    """The daemon stays paused past the give-up time, and past call_timeout (the
    connection is declared lost and comes back): the Transfer is failed by the client
    exactly once, not before deadline + grace; the daemon's late Done is ignored."""
    c = Client(daemon.socket, transfer_timeout=0.4, timeout=0.5, ping_interval=0.2)
    try:
        k = keys(b"G", 2)
        c.store(k, [0, 1], event=1)
        hit = c.call(m.Lookup, keys=k)
        target = [30, 31]
        for t in c.mem:
            t[target] = 0
        paused()
        sent = c.transfer(9, m.Direction.LOAD, target, unpack_u32(hit.slots))
        at, done = c.wait_done(9, timeout=10)
        assert at - sent >= 0.4 + GRACE_S - 0.05, at - sent
        assert done.code == m.Code.EXPIRED and not c.conn.up  # lost, yet not failed early
        time.sleep(0.3)
        os.kill(daemon.pid, signal.SIGCONT)
        assert c.conn.wait_up(10)  # reconnected by itself
        time.sleep(0.5)  # the daemon ran its backlog: its Done for event 9 went nowhere
        assert len(c.dones_of(9)) == 1
        assert all(not t[target].any() for t in c.mem)
        assert c.call(m.Lookup, keys=k).hits == 2  # and it serves again
    finally:
        c.close()


def test_a_late_done_on_the_same_connection_is_ignored(daemon, paused):
    """The connection stays up (a pause shorter than call_timeout) but longer than
    deadline + grace: the client ends the Transfer itself, then the daemon wakes up and
    sends its own Done on the same connection, which must not end it a second time."""
    c = Client(daemon.socket, transfer_timeout=0.3, timeout=5.0, ping_interval=5.0)
    try:
        k = keys(b"D", 2)
        c.store(k, [0, 1], event=1)
        hit = c.call(m.Lookup, keys=k)
        paused()
        c.transfer(4, m.Direction.LOAD, [24, 25], unpack_u32(hit.slots))
        at, done = c.wait_done(4, timeout=5)
        assert done.code == m.Code.EXPIRED and c.conn.up
        os.kill(daemon.pid, signal.SIGCONT)
        assert c.call(m.Lookup, keys=k).hits == 2  # the daemon ran its backlog
        time.sleep(0.2)
        assert len(c.dones_of(4)) == 1
        assert daemon.status()["counters"]["expired_transfers"] == 1, str(daemon.status()["counters"])
    finally:
        c.close()


def test_a_daemon_that_dies_ends_transfers_at_once(daemon, paused):
    c = Client(daemon.socket, transfer_timeout=30)
    try:
        k = keys(b"D", 1)
        c.store(k, [0], event=1)
        hit = c.call(m.Lookup, keys=k)
        paused()
        sent = c.transfer(3, m.Direction.LOAD, [10], unpack_u32(hit.slots))
        os.kill(daemon.pid, signal.SIGKILL)
        at, done = c.wait_done(3, timeout=10)
        assert done.code == m.Code.CLIENT_GONE and at - sent < 5  # not after 31 s
    finally:
        c.close()


def test_the_exit_of_a_replacing_daemon_ends_only_its_own_transfers(daemon_factory):
    """A Transfer went to daemon A, which then paused; its socket was taken over by a
    new daemon B, and the client moved to B. When B exits, A's Transfer is not over: A
    may wake and still copy it into the engine's blocks, so only A's own exit (or the
    Transfer's deadline) ends it, once."""
    a = daemon_factory()
    c = Client(a.socket, transfer_timeout=60, timeout=0.5, ping_interval=0.2)
    try:
        k = keys(b"R", 2)
        c.store(k, [0, 1], event=1)
        hit = c.call(m.Lookup, keys=k)
        os.kill(a.pid, signal.SIGSTOP)
        c.transfer(2, m.Direction.LOAD, [40, 41], unpack_u32(hit.slots))
        assert wait_for(lambda: not c.conn.up, 10)  # the paused daemon was given up
        os.unlink(a.socket)  # (an operator's cleanup; a second kvd takes the path)
        b = daemon_factory(start=False)
        b.socket = a.socket
        b.start()
        assert c.conn.wait_up(10) and c.conn.daemon_pid == b.pid
        b.kill()
        assert wait_for(lambda: not c.conn.up, 10)  # the client saw B exit
        time.sleep(0.3)
        assert c.dones_of(2) == []  # A still holds it
        a.kill()
        _, done = c.wait_done(2, timeout=5)  # A's exit ends it at once, not at 60 s
        assert done.code == m.Code.CLIENT_GONE
        time.sleep(0.2)
        assert len(c.dones_of(2)) == 1
    finally:
        c.close()
        if a.proc is not None:
            os.kill(a.pid, signal.SIGCONT)


def _job(direction: m.Direction, pool: np.ndarray, far: np.ndarray, deadline: float,
         event: int = 1) -> CopyJob:
    n = len(pool)
    return CopyJob(1, event, event, direction, os.getpid(),
                   np.array([pool[i:].ctypes.data for i in range(0, n, 4096)], np.uint64),
                   np.array([far[i:].ctypes.data for i in range(0, n, 4096)], np.uint64),
                   np.full(n // 4096, 4096, np.uint64), np.arange(n // 4096), -1, deadline)


@pytest.mark.parametrize("direction", [m.Direction.LOAD, m.Direction.STORE])
def test_host_engine_never_starts_a_copy_past_its_deadline(direction):
    """A copy thread is held (inside the previous job's completion) while the next job's
    deadline passes; released, it ends that job EXPIRED without copying a byte."""
    release, finished = threading.Event(), []

    def on_done(job: CopyJob, error: Exception | None, seconds: float) -> None:
        finished.append((job.event, error))
        if job.event == 1:
            release.wait(10)

    src = np.full(4 * 4096, 5, np.uint8)
    dst = np.zeros(4 * 4096, np.uint8)
    engine = HostEngine(on_done, threads=1)
    try:
        # The job holds addresses only: the arrays must outlive its copy.
        first_pool, first_far = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
        engine.submit(_job(m.Direction.LOAD, first_pool, first_far, time.monotonic() + 60,
                           event=1))
        pool, far = (src, dst) if direction == m.Direction.LOAD else (dst, src)
        engine.submit(_job(direction, pool, far, time.monotonic() + 0.05, event=2))
        time.sleep(0.2)
        release.set()
        deadline = time.monotonic() + 10
        while len(finished) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        (_, first), (event, error) = finished
        assert first is None and event == 2
        assert error is not None and error.code == m.Code.EXPIRED
        assert not dst.any()
        assert first_far.all()  # the held job did copy
    finally:
        release.set()
        engine.close()


def test_give_up_and_late_follow_the_protocol_grace():
    job = _job(m.Direction.STORE, np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), 100.0)
    assert job.give_up == 100.0 + GRACE_S
    assert expired(job, 100.0) is None and expired(job, 100.001).code == m.Code.EXPIRED
    assert late(job, 100.0 + GRACE_S) is None
    assert late(job, 100.01 + GRACE_S).code == m.Code.EXPIRED
    job.direction = m.Direction.LOAD  # a load's late end cannot be undone: not "late"
    assert late(job, 1e9) is None


def test_vm_copy_checks_the_deadline_before_each_system_call():
    """The check sits right before each system call (a batch longer than IOV_MAX
    segments takes several): past the deadline nothing is written."""
    from kvd.engines.host import IOV_MAX, vm_copy

    n = IOV_MAX + 8
    pool = np.zeros(n * 64, np.uint8)
    target = np.zeros(n * 64, np.uint8)
    pool[:] = 7
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(64)
    lengths = np.full(n, 64, np.uint64)
    with pytest.raises(Exception) as err:
        vm_copy(m.Direction.LOAD, os.getpid(), np.uint64(pool.ctypes.data) + offsets,
                np.uint64(target.ctypes.data) + offsets, lengths, time.monotonic() - 1)
    assert err.value.code == m.Code.EXPIRED and not target.any()
    # With time left it copies every segment (the same call, the deadline ahead).
    assert vm_copy(m.Direction.LOAD, os.getpid(), np.uint64(pool.ctypes.data) + offsets,
                   np.uint64(target.ctypes.data) + offsets, lengths,
                   time.monotonic() + 60) == n * 64
    assert (target == 7).all()


def test_a_load_of_consecutive_blocks_checks_its_deadline_every_chunk(monkeypatch):
    """Consecutive blocks into consecutive slots merge into one run (32 MiB here): the
    engine still copies it in calls of at most CHUNK_BYTES, so a load whose deadline
    passes part way (a starved copy thread) stops there, short of blocks its client
    may already have given to another request."""
    from kvd.engines import host

    calls: list[int] = []
    real = host._vm_writev

    def slow_writev(pid, local, n, far, n_far, flags):  # a copy thread that gets no core
        iov = np.ctypeslib.as_array(ctypes.cast(local, ctypes.POINTER(ctypes.c_uint64)),
                                    (n, 2))
        calls.append(int(iov[:, 1].sum()))
        time.sleep(0.05)
        return real(pid, local, n, far, n_far, flags)

    monkeypatch.setattr(host, "_vm_writev", slow_writev)
    done: list[Exception | None] = []
    blocks, size = 16, 2 << 20
    pool = np.full(blocks * size, 9, np.uint8)
    dst = np.zeros(blocks * size, np.uint8)
    engine = host.HostEngine(lambda job, err, s: done.append(err), threads=1)
    try:
        engine.submit(CopyJob(1, 1, 1, m.Direction.LOAD, os.getpid(),
                              np.uint64(pool.ctypes.data) + np.arange(blocks, dtype=np.uint64)
                              * np.uint64(size),
                              np.uint64(dst.ctypes.data) + np.arange(blocks, dtype=np.uint64)
                              * np.uint64(size),
                              np.full(blocks, size, np.uint64), np.arange(blocks), -1,
                              time.monotonic() + 0.12))
        end = time.monotonic() + 10
        while not done and time.monotonic() < end:
            time.sleep(0.01)
        assert done and done[0] is not None and done[0].code == m.Code.EXPIRED
        assert max(calls) <= host.CHUNK_BYTES
        assert 0 < int((dst == 9).sum()) < dst.size  # stopped part way: the rest untouched
        assert not dst[-size:].any()
    finally:
        engine.close()


def test_a_paused_daemon_does_not_count_its_own_absence_as_its_clients_silence(
        daemon_factory):
    """SIGSTOPped past client_timeout_ms (a frozen VM, a starved CPU), the daemon's first
    tick after it dropped every client as silent, their pings still unread in the socket,
    and with them their PENDING stores."""
    import zmq

    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "2000"})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{d.socket}")

    def call(msg: m.Request) -> m.Reply:
        s.send(m.encode(msg))
        assert s.poll(5000)
        return m.decode_reply(s.recv())

    try:
        assert isinstance(call(m.Hello(1, m.PROTOCOL_VERSION, os.getpid(), "raw")), m.HelloOk)
        spec = Spec(d.socket, pages=(4096,))
        mem = np.zeros((2, 4096), dtype=np.uint8)
        assert isinstance(call(m.Register(2, fingerprint(spec), 0, host_regions([mem]))),
                          m.Registered)
        assert isinstance(call(m.Allocate(3, [b"k1", b"k2"])), m.Allocated)
        os.kill(d.pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
            s.send(m.encode(m.Ping(4)))  # on time, by the client's clock
            time.sleep(2.5)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert isinstance(call(m.Ping(5)), m.Ok)  # (the queued Ping's answer: req 4)
        assert d.status()["blocks"]["pending"] == 2
        assert "silent for" not in d.logs()
    finally:
        s.close()
        ctx.term()


@contextlib.contextmanager
def copy_threads_stopped(pid: int) -> Iterator[None]:
    """Stop a daemon's threads other than its event loop's and ZeroMQ's (ptrace
    interrupts, no signal): copies hang while the loop answers, as with a copy thread
    stuck in a system call or a GPU event that never completes."""
    libc = ctypes.CDLL(None, use_errno=True)
    seize, interrupt, detach, wall = 0x4206, 0x4207, 17, 0x40000000
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid
            and not open(f"/proc/{pid}/task/{t}/comm").read().startswith("ZMQ")]
    held = []
    try:
        for tid in tids:
            if libc.ptrace(seize, tid, 0, 0) != 0:
                pytest.skip(f"cannot ptrace the daemon here: {os.strerror(ctypes.get_errno())}")
            held.append(tid)
            libc.ptrace(interrupt, tid, 0, 0)
            os.waitpid(tid, wall)
        yield
    finally:
        for tid in held:
            libc.ptrace(detach, tid, 0, 0)


def test_a_stuck_copy_path_makes_lookups_miss_until_its_copies_end(daemon_factory):
    """The copy threads hang while the loop answers: every Lookup hit, and each load
    of it held the engine's step for its deadline plus grace, for as long as it
    lasted (1.5 s per loading step with a 0.5 s deadline). Once a copy is overdue,
    lookups miss and stores are refused (BUSY); served again once the copies end."""
    d = daemon_factory("--copy-threads", "1")
    c = Client(d.socket, transfer_timeout=0.3)
    try:
        k = keys(b"T", 4)
        c.store(k, [0, 1, 2, 3], event=1)
        for t in c.mem:
            t[[20, 21, 22, 23]] = 0
        with copy_threads_stopped(d.pid):
            hit = c.call(m.Lookup, keys=k)
            assert hit.hits == 4  # nothing overdue yet
            c.transfer(2, m.Direction.LOAD, [20, 21, 22, 23], unpack_u32(hit.slots))
            assert wait_for(lambda: d.status()["transfers"]["overdue"] == 1, 10)
            assert c.call(m.Lookup, keys=k).hits == 0
            with pytest.raises(RemoteError) as refused:
                c.call(m.Allocate, keys=keys(b"U", 2))
            assert refused.value.code == m.Code.BUSY
            counters = d.status()["counters"]
            assert counters["stalled_lookups"] == 1
            assert counters["lookup_keys"] == 8  # the missed one counts as asked
            assert c.wait_done(2)[1].code == m.Code.EXPIRED  # the client gave it up
        assert wait_for(lambda: d.status()["transfers"]["overdue"] == 0, 10)
        assert c.call(m.Lookup, keys=k).hits == 4
        assert all(not t[[20, 21, 22, 23]].any() for t in c.mem)  # the late copy wrote nothing
        assert "copy path is stuck" in d.logs()
    finally:
        c.close()
