"""Fail-open behaviour of the client against a real daemon that is absent, dies,
hangs and comes back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvd_client import Connection, RemoteError, Timeout, Unavailable, host_regions
from kvd_client.bookkeeping import GRACE_S
from kvd_client.io_loop import CLOSE_WAIT_S
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from tests.daemon.workers import Spec, fingerprint
from tests.waiting import child_exit, wait_for


def test_absent_daemon_fails_fast(tmp_path):
    c = Connection(str(tmp_path / "nobody.sock"), timeout=5)
    try:
        assert not c.wait_up(0.3)
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.request(m.Ping(c.next_req()))
        assert not c.send(m.Transfer(c.next_req(), 1, m.Direction.STORE, b"", b""))
        assert time.monotonic() - t0 < 0.1  # a breaker, not a wait for the deadline
        assert c.stats.unavailable == 2
    finally:
        c.close()


def test_an_absent_daemon_costs_the_engine_few_wakeups(tmp_path):
    """While the daemon is away the I/O thread backs off (it used to wake every 5 ms,
    taking cycles and the GIL from the engine it lives in)."""
    c = Connection(str(tmp_path / "nobody.sock"), timeout=5)
    try:
        time.sleep(1.0)
        assert 0 < c.stats.wakeups < 40, c.stats
    finally:
        c.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_io_thread_leaves_the_compute_cpu_it_was_started_from(tmp_path):
    """A vLLM CPU worker pins its threads to its compute core; the client's I/O thread
    (and zmq's, started from it) must run on the CPUs left free for helpers."""
    code = textwrap.dedent("""
        import json, os, threading, time
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[0]})  # as vLLM pins its worker
        from kvd_client import Connection
        c = Connection(%r, timeout=5)
        time.sleep(0.3)
        io = {t.native_id for t in threading.enumerate() if t.name == "kvd-client-io"}
        zmq_threads = [int(t) for t in os.listdir("/proc/self/task")
                       if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg")]
        print(json.dumps({"io": sorted(os.sched_getaffinity(io.pop())), "pinned": cpus[0],
                          "zmq": [sorted(os.sched_getaffinity(t)) for t in zmq_threads]}))
        c.close()
    """ % str(tmp_path / "nobody.sock"))
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, timeout=60, check=True).stdout)
    assert out["io"] and out["pinned"] not in out["io"], out
    assert out["zmq"] and all(out["pinned"] not in cpus for cpus in out["zmq"]), out


def worker_and_scheduler(socket: str, worker_ping: float = 0.2):
    """A worker connection with host memory (its Dones collected) and a scheduler
    connection of the same tenant: (worker, scheduler, dones, memory)."""
    spec = Spec(socket, pages=(4096,))
    mem = [np.zeros((8, 4096), dtype=np.uint8)]
    dones: list[m.Done] = []
    c = Connection(socket, ping_interval=worker_ping, timeout=1.0, on_done=dones.append,
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    sched = Connection(socket, ping_interval=0.2, timeout=1.0,
                       register=m.Register(0, fingerprint(spec), -1))
    return c, sched, dones, mem


def test_reconnects_and_reregisters_after_a_daemon_restart(daemon):
    c, sched, dones, _mem = worker_and_scheduler(daemon.socket)
    try:
        assert c.wait_up(5) and sched.wait_up(5)
        first = c.instance
        daemon.kill()
        assert wait_for(lambda: not c.up, 5), "loss of the daemon not noticed"
        with pytest.raises(Unavailable):
            sched.request(m.Lookup(sched.next_req(), [b"k"]))
        daemon.start()
        assert c.wait_up(10) and sched.wait_up(10)
        assert c.instance != first and c.stats.reconnects == 1
        # Registered again by itself: the new daemon serves both.
        slots = unpack_u32(sched.request(m.Allocate(sched.next_req(), [b"k"])).slots)
        assert c.send(m.Transfer(c.next_req(), 4, m.Direction.STORE, pack_u32([0]),
                                 pack_u32(slots)))
        assert wait_for(lambda: dones and dones[-1].event == 4, 5)
        assert dones[-1].code == m.Code.OK
        assert sched.request(m.Lookup(sched.next_req(), [b"k"])).hits == 1
    finally:
        c.close()
        sched.close()


def test_a_hung_daemon_costs_at_most_the_deadline(daemon):
    spec = Spec(daemon.socket, pages=(4096,))
    c = Connection(daemon.socket, ping_interval=0.2, timeout=0.3,
                   register=m.Register(0, fingerprint(spec), -1))
    try:
        assert c.wait_up(5)
        daemon.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            c.request(m.Lookup(c.next_req(), [b"k"]))
        assert time.monotonic() - t0 < 0.6
        assert wait_for(lambda: not c.up, 3)  # pings stopped coming back: breaker open
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.request(m.Lookup(c.next_req(), [b"k"]))
        assert time.monotonic() - t0 < 0.05
        daemon.proc.send_signal(signal.SIGCONT)
        assert c.wait_up(10)
        assert c.request(m.Lookup(c.next_req(), [b"k"])).hits == 0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        c.close()


def two_blocks_and_a_caller_that_gives_up(socket: str):
    """Blocks ``a`` and ``b`` stored; a scheduler connection that gives a call up after
    0.5 s (expired after 1 s) and pings every second: (worker, scheduler, it, the
    worker's memory: keep it while the daemon may copy)."""
    c, sched, dones, mem = worker_and_scheduler(socket)
    spec = Spec(socket, pages=(4096,))
    late = Connection(socket, ping_interval=1.0, timeout=0.5,
                      register=m.Register(0, fingerprint(spec), -1))
    assert c.wait_up(5) and sched.wait_up(5) and late.wait_up(5)
    slots = unpack_u32(sched.request(m.Allocate(sched.next_req(), [b"a", b"b"])).slots)
    assert c.send(m.Transfer(c.next_req(), 4, m.Direction.STORE, pack_u32([0, 1]),
                             pack_u32(slots)))
    assert wait_for(lambda: dones and dones[-1].event == 4, 5)
    assert dones[-1].code == m.Code.OK
    return c, sched, late, mem


@pytest.mark.parametrize("stall", [0.7, 1.6])  # past the call's wait; past its expiry
def test_a_lookup_answered_after_its_caller_gave_up_gives_its_lease_back(daemon, stall):
    """A daemon stalled past a call's time but not the link's (pings every second):
    the LookupOk it sent on waking leased the hits for nobody (the reply was dropped,
    or set on a future nobody read), and they stayed pinned, unevictable, for the
    lease's 30 s after every request had ended."""
    c, sched, late, _mem = two_blocks_and_a_caller_that_gives_up(daemon.socket)
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                late.request(m.Lookup(late.next_req(), [b"a", b"b"]))
            time.sleep(stall - 0.5)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: daemon.status()["blocks"]["leases"] == 0, 5)
        assert daemon.status()["blocks"]["pinned"] == 0
        assert wait_for(lambda: late.stats.late_leases == 1, 5)  # (counted after the send)
        assert late.up and late.stats.reconnects == 0  # the link held: no Bye cleared it
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        for conn in (c, sched, late):
            conn.close()


def test_a_late_lease_goes_back_to_the_run_the_lookup_went_to(daemon_factory):
    """``request`` took the daemon run before sending: a reconnect in between sent the
    Lookup to the new run while its late lease was marked for the old one, so it was
    never given back (pinned for the lease's 30 s)."""
    d = daemon_factory("--persist")  # (the new run has the blocks too)
    c, sched, late, _mem = two_blocks_and_a_caller_that_gives_up(d.socket)
    try:
        first, submit = late.instance, late.submit

        def reconnecting_first(msg: m.Request, _wait: float = 0.0):
            late.submit = submit  # (once)
            d.restart()
            assert wait_for(lambda: late.up and late.instance != first, 10)
            d.proc.send_signal(signal.SIGSTOP)  # answers once the caller gave up
            return submit(msg, _wait)

        late.submit = reconnecting_first  # type: ignore[method-assign]
        try:
            with pytest.raises(Timeout):
                late.request(m.Lookup(late.next_req(), [b"a", b"b"]))
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: late.stats.late_leases == 1, 5)
        assert wait_for(lambda: d.status()["blocks"]["leases"] == 0, 5)
        assert d.status()["blocks"]["pinned"] == 0 and d.status()["blocks"]["ready"] == 2
    finally:
        if d.proc is not None:
            d.proc.send_signal(signal.SIGCONT)
        for conn in (c, sched, late):
            conn.close()


def test_a_connection_replaced_after_a_pause_lets_go_of_what_it_held(daemon_factory):
    """The daemon was only paused: the connection declared lost says Bye on its way
    out, so its PENDING slots come back at once, not after client_timeout_ms (a minute)."""
    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "60000"})
    spec = Spec(d.socket, pages=(4096,))
    mem = np.zeros((4, 4096), dtype=np.uint8)
    c = Connection(d.socket, ping_interval=0.2, timeout=0.3,
                   register=m.Register(0, fingerprint(spec), 0, host_regions([mem])))
    try:
        assert c.wait_up(5)
        assert c.request(m.Allocate(c.next_req(), [b"a", b"b", b"c"])).allocated == 3
        assert d.status()["blocks"]["pending"] == 3
        d.proc.send_signal(signal.SIGSTOP)
        try:
            assert wait_for(lambda: not c.up, 5)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert c.wait_up(10)
        assert wait_for(lambda: d.status()["blocks"]["pending"] == 0, 20)
        assert sum(cl["tenant"] is not None for cl in d.status()["clients"]) == 1
    finally:
        c.close()


def test_a_client_the_daemon_forgot_registers_again_at_its_next_transfer(daemon_factory):
    """The daemon dropped a quiet connection (client_timeout_ms); a busy worker sends a
    Transfer before its next ping would have told it, and every one was refused
    NOT_REGISTERED for as long as Transfers kept coming: offloading off for good."""
    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "1000"})
    c, sched, dones, _mem = worker_and_scheduler(d.socket, worker_ping=60)
    try:
        assert c.wait_up(5) and sched.wait_up(5)
        epoch = c.epoch
        assert wait_for(lambda: len(d.status()["clients"]) == 2, 10)  # the worker dropped
        codes = []
        for i in range(20):
            try:
                slots = unpack_u32(sched.request(m.Allocate(sched.next_req(),
                                                            [b"k%d" % i])).slots)
            except RemoteError as e:  # no worker registered for rank 0: nothing allocated
                assert e.code == m.Code.BUSY
                slots = np.array([NO_SLOT], dtype=np.uint32)
            n = len(dones)
            if c.send(m.Transfer(c.next_req(), i, m.Direction.STORE, pack_u32([0]),
                                 pack_u32(slots))):
                assert wait_for(lambda: len(dones) > n, 5)
                codes.append(dones[-1].code)
                if codes[-1] == m.Code.OK:
                    break
            time.sleep(0.1)
        assert codes[0] == m.Code.NOT_REGISTERED and codes[-1] == m.Code.OK, codes
        assert c.epoch > epoch  # registered again
    finally:
        c.close()
        sched.close()


def test_a_forked_child_fails_open_and_the_parent_goes_on(daemon):
    """The child of a fork has the parent's socket but none of its threads: a call there
    blocked for ever in the parent's socket (its timeout never fired)."""
    spec = Spec(daemon.socket, pages=(4096,))
    c = Connection(daemon.socket, timeout=0.5, register=m.Register(0, fingerprint(spec), -1))
    try:
        assert c.wait_up(5)
        pid = os.fork()
        if pid == 0:  # the child: only os._exit leaves it
            code = 3
            try:
                c.request(m.Lookup(c.next_req(), [b"k"]))
            except Unavailable:
                code = 0 if not c.send(m.Transfer(1, 1, m.Direction.LOAD, b"", b"")) else 4
                if c.wait_up(30):  # at once, not after the timeout
                    code = 6
            except BaseException:  # noqa: BLE001
                code = 5
            os._exit(code)
        code = child_exit(pid, 10)
        if code is None:
            pytest.fail("the forked child hung in a kvd call")
        assert code == 0
        assert c.request(m.Lookup(c.next_req(), [b"k"])).hits == 0  # the parent goes on
    finally:
        c.close()


def test_lost_transfers_complete_with_an_error(daemon):
    """Every Transfer ends in exactly one Done, even when the daemon dies under it."""
    spec = Spec(daemon.socket, pages=(4096,))
    mem = [np.zeros((8, 4096), dtype=np.uint8)]
    dones: list[m.Done] = []
    c = Connection(daemon.socket, ping_interval=0.2, timeout=0.5, on_done=dones.append,
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    try:
        assert c.wait_up(5)
        daemon.proc.send_signal(signal.SIGSTOP)
        assert c.send(m.Transfer(c.next_req(), 11, m.Direction.STORE, pack_u32([0]),
                                 pack_u32([0])))
        daemon.kill()
        assert wait_for(lambda: len(dones) == 1, 5)
        assert dones[0].event == 11 and dones[0].code == m.Code.CLIENT_GONE
        assert c.stats.lost_transfers == 1
    finally:
        c.close()


def test_a_transfer_for_slots_of_another_daemon_run_is_never_sent(daemon):
    """The worker checks the slots' daemon run, then sends: a restart in between must
    not hand them to the new daemon. The connection checks again as it sends."""
    spec = Spec(daemon.socket, pages=(4096,))
    mem = [np.zeros((8, 4096), dtype=np.uint8)]
    dones: list[m.Done] = []
    c = Connection(daemon.socket, on_done=dones.append,
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    try:
        assert c.wait_up(5)
        sent = c.stats.sent
        assert c.send(m.Transfer(c.next_req(), 5, m.Direction.LOAD, pack_u32([0]),
                                 pack_u32([0])), instance="an-earlier-run")
        assert wait_for(lambda: dones, 5)
        assert dones[0].event == 5 and dones[0].code == m.Code.CLIENT_GONE
        assert c.stats.sent == sent  # it never left
    finally:
        c.close()


def misbehaving_daemon(path: str, answer, daemon_pid=lambda: 1, hello=None, ping=None) -> tuple:
    """A ROUTER that completes the handshake and answers everything else with
    ``answer(request)`` (raw bytes): a daemon with a bug, or of a newer version.
    ``daemon_pid()``: the pid its HelloOk names; ``hello``, ``ping``: their answers
    instead (raw bytes, from the request)."""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, data = sock.recv_multipart()
            msg = m.decode_request(data)
            if isinstance(msg, m.Hello) and hello is not None:
                out = hello(msg)
            elif isinstance(msg, m.Ping) and ping is not None:
                out = ping(msg)
            elif isinstance(msg, m.Hello):
                out = m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, daemon_pid(), "fake",
                                         1, 0))
            elif isinstance(msg, m.Register):
                out = m.encode(m.Registered(msg.req, 1, 4096, 4096))
            elif isinstance(msg, m.Ping):
                out = m.encode(m.Ok(msg.req))
            else:
                out = answer(msg)
            sock.send_multipart([ident, out])
        sock.close(linger=0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t, stop


def test_replies_a_daemon_should_not_send_end_calls_and_transfers_once(tmp_path):
    """A Done naming another event still ends its own Transfer (by request id), once;
    an undecodable reply fails its call at once, and an undecodable Done (a newer
    daemon's code) ends its Transfer at once, failed, instead of at the deadline."""
    import msgspec

    def answer(msg):
        if isinstance(msg, m.Transfer) and msg.event == 1:
            return m.encode(m.Done(msg.req, 999))  # the wrong event
        if isinstance(msg, m.Transfer):  # a code this client does not know
            return msgspec.msgpack.encode(["done", msg.req, msg.event, 77, "", 0, 0.0])
        return msgspec.msgpack.encode(["lookup_ok_v9", msg.req, "???"])

    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, answer)
    dones: list[m.Done] = []
    c = Connection(path, on_done=dones.append, transfer_timeout=30,
                   register=m.Register(0, fingerprint(Spec(path, pages=(4096,))), -1))
    try:
        assert c.wait_up(5)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            c.request(m.Lookup(c.next_req(), [b"k"]), timeout=10)
        assert e.value.code == m.Code.INTERNAL and time.monotonic() - t0 < 2
        for event in (1, 2):
            assert c.send(m.Transfer(c.next_req(), event, m.Direction.LOAD, pack_u32([0]),
                                     pack_u32([0])))
        assert wait_for(lambda: len(dones) == 2, 5)
        assert {d.event: d.code for d in dones} == {1: m.Code.OK, 2: m.Code.INTERNAL}
        time.sleep(0.2)
        assert len(dones) == 2
    finally:
        c.close()
        stop.set()
        t.join(5)


NEW_CODE = 77  # a Code a newer daemon added: its replies do not decode here


def _new_error(msg) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(["error", msg.req, NEW_CODE, "a reason of a newer kvd"])


def test_answers_a_newer_daemon_gives_end_what_they_answer_at_once(tmp_path):
    """Undecodable, an Error refusing a Transfer left it to its deadline (the engine's
    step held up to it), and an Error answering a ping dropped the connection as if
    kvd had stopped answering."""
    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, _new_error, ping=_new_error)
    dones: list[m.Done] = []
    c = Connection(path, on_done=dones.append, transfer_timeout=30, timeout=3,
                   ping_interval=0.1)
    try:
        assert c.wait_up(5)
        t0 = time.monotonic()
        assert c.send(m.Transfer(c.next_req(), 5, m.Direction.LOAD, pack_u32([0]),
                                 pack_u32([0])))
        assert wait_for(lambda: dones, 5) and time.monotonic() - t0 < 2
        assert (dones[0].event, dones[0].code) == (5, m.Code.INTERNAL)
        epoch = c.epoch
        time.sleep(7)  # pings every 0.1 s, each answered so: the connection stays
        assert c.up and c.epoch == epoch, c._io.link.why_down  # (never registered again)
    finally:
        c.close()
        stop.set()
        t.join(5)


@pytest.mark.parametrize("hello", [_new_error, lambda msg: m.encode(m.HelloOk(
    msg.req, m.PROTOCOL_VERSION + 1, os.getpid(), "fake", 1, 0)),
    # Taken as a finished handshake: up without the version and pid checks, and with
    # no daemon run to tell a slot's run by.
    lambda msg: m.encode(m.Registered(msg.req, 1, 4096, 4096)),
    # A daemon on another CLOCK_MONOTONIC (ahead, behind): deadlines would not hold.
    lambda msg: m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, os.getpid(), "fake", 1, 0,
                                   time.monotonic_ns() + 10**12)),
    lambda msg: m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, os.getpid(), "fake", 1, 0,
                                   time.monotonic_ns() - 10**12 or -1))],
    ids=["error", "version", "registered", "clock-ahead", "clock-behind"])
def test_a_handshake_a_newer_daemon_refuses_or_speaks_another_version_is_a_refusal(tmp_path,
                                                                                  hello):
    """An undecodable refusal left the client handshaking until its timeout, then
    retrying fast; a HelloOk of another protocol version was taken as this one's."""
    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, _new_error, hello=hello)
    c = Connection(path, timeout=5)
    try:
        assert wait_for(lambda: c._io.link.why_down, 4), "still handshaking"  # (timeout: 5 s)
        assert not c.up and not c.handshaking
        with pytest.raises(Unavailable):
            c.request(m.Ping(c.next_req()))
    finally:
        c.close()
        stop.set()
        t.join(5)


def test_a_burst_beyond_the_sockets_queue_fails_at_once_and_says_why(daemon):
    """A daemon that does not keep up (here stopped) fills the socket's queue (1,000
    messages): further calls fail at once as Unavailable, saying so, not as a lost
    connection; the connection itself stays up."""
    spec = Spec(daemon.socket, pages=(4096,))
    c = Connection(daemon.socket, timeout=10, register=m.Register(0, fingerprint(spec), -1))
    try:
        assert c.wait_up(5)
        keys = [i.to_bytes(36, "little") for i in range(1000)]  # 36 kB: few fit the kernel's buffer
        daemon.proc.send_signal(signal.SIGSTOP)
        futs = [c.submit(m.Lookup(c.next_req(), keys)) for _ in range(1200)]
        assert wait_for(lambda: sum(f.done() for f in futs) >= 100, 5)
        errors = [f.exception(0) for f in futs if f.done()]
        assert all(isinstance(e, Unavailable) and "not keeping up" in str(e) for e in errors)
        assert c.up
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        c.close()


@contextlib.contextmanager
def io_thread_held(c: Connection) -> Iterator[None]:
    """Another thread holds the connection's lock: the I/O thread cannot flush meanwhile,
    nor a caller send on its own thread, so what is sent queues."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with c._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        holder.join(5)


def test_a_hello_naming_no_process_is_refused_and_the_thread_lives_on(tmp_path):
    """A HelloOk naming pid 2**31 killed the I/O thread (pidfd_open overflowed): the
    engine ran without kvd for good, even once a sound daemon answered. (And pid -1
    would have let any process ptrace the engine.) Refused; retried 5 s later."""
    pid = [2**31]
    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, lambda msg: m.encode(m.Ok(msg.req)), lambda: pid[0])
    c = Connection(path, timeout=2)
    try:
        assert wait_for(lambda: "bad HelloOk" in c._io.link.why_down, 10)
        assert not c.up and c._thread.is_alive()
        with pytest.raises(Unavailable, match="bad HelloOk"):
            c.request(m.Ping(c.next_req()))
        pid[0] = os.getpid() + 1  # a sound answer: connected at the next try
        assert c.wait_up(15) and c._thread.is_alive()
        assert isinstance(c.request(m.Ping(c.next_req())), m.Ok)
    finally:
        c.close()
        stop.set()
        t.join(5)


def test_a_socket_path_too_long_says_why_and_the_thread_lives_on(tmp_path):
    """The I/O thread died on connect's error, and calls said only "not connected"."""
    c = Connection("/tmp/" + "x" * 120 + "/kvd.sock", timeout=1)
    try:
        assert wait_for(lambda: "cannot connect" in c._io.link.why_down, 10)
        assert not c.up
        with pytest.raises(Unavailable, match="cannot connect.*File name too long"):
            c.request(m.Ping(c.next_req()))
        assert c._thread.is_alive()
    finally:
        c.close()


def test_the_outbox_is_bounded_and_what_it_took_ends_once(daemon):
    """Callers sending faster than the I/O thread can send piled messages up without
    bound (and the thread, flushing them, handled nothing else): past MAX_QUEUED a send
    is refused at once; what was queued goes out and ends exactly once."""
    from kvd_client.shared import MAX_QUEUED

    dones: list[m.Done] = []
    mem = [np.zeros((4, 4096), dtype=np.uint8)]
    spec = Spec(daemon.socket, pages=(4096,))
    c = Connection(daemon.socket, timeout=5, on_done=dones.append, transfer_timeout=30,
                   register=m.Register(0, fingerprint(spec), 0, host_regions(mem)))
    try:
        assert c.wait_up(5)
        with io_thread_held(c):
            before = c.stats.unavailable
            sent = [c.send(m.Transfer(c.next_req(), e, m.Direction.LOAD, pack_u32([0]),
                                      pack_u32([0]))) for e in range(MAX_QUEUED + 50)]
            assert sent.count(True) == MAX_QUEUED and not any(sent[MAX_QUEUED:])
            assert c.stats.unavailable - before == 50
        assert wait_for(lambda: len(dones) == MAX_QUEUED, 30)
        time.sleep(0.2)
        assert sorted(d.event for d in dones) == list(range(MAX_QUEUED))
    finally:
        c.close()


def test_a_queued_message_that_cannot_be_encoded_ends_alone(tmp_path):
    """It raised in the I/O thread between the outbox and the socket: the Transfer got
    no Done at all (the job never ended), and the thread died."""
    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, lambda msg: m.encode(
        m.Done(msg.req, msg.event) if isinstance(msg, m.Transfer) else m.Ok(msg.req)))
    dones: list[m.Done] = []
    c = Connection(path, timeout=2, on_done=dones.append, transfer_timeout=30)
    try:
        assert c.wait_up(5)
        with io_thread_held(c):
            assert c.send(m.Transfer(c.next_req(), 1, m.Direction.LOAD, pack_u32([0]),
                                     pack_u32([0]), ticket=2**70))  # no u64
            assert c.send(m.Transfer(c.next_req(), 2, m.Direction.LOAD, pack_u32([0]),
                                     pack_u32([0])))
        assert wait_for(lambda: len(dones) == 2, 5)
        assert {d.event: d.code for d in dones} == {1: m.Code.CLIENT_GONE, 2: m.Code.OK}
        assert c.up and c._thread.is_alive()
    finally:
        c.close()
        stop.set()
        t.join(5)


def test_a_message_that_cannot_be_encoded_fails_typed_on_the_callers_thread_too(daemon):
    """Sent on the caller's thread (the I/O thread idle), the encoding error left as a
    raw OverflowError; queued, the same message failed as Unavailable."""
    dones: list[m.Done] = []
    c = Connection(daemon.socket, timeout=2, on_done=dones.append)
    try:
        assert c.wait_up(5)
        with pytest.raises(Unavailable, match="cannot send Lookup"):
            c.request(m.Lookup(c.next_req(), [b"k"], 2**70))  # no u64
        assert c.send(m.Transfer(c.next_req(), 7, m.Direction.LOAD, b"", b"", ticket=2**70))
        assert wait_for(lambda: [d.event for d in dones] == [7], 5)
        assert dones[0].code == m.Code.CLIENT_GONE
        assert c.request(m.Ping(c.next_req())) is not None  # and the connection goes on
    finally:
        c.close()


class _InterruptedAfterAcquire:
    """The connection's lock, where a signal handler's exception lands right after an
    acquire that succeeded (as Ctrl-C can, once the C call returned)."""

    def __init__(self, lock) -> None:
        self.lock = lock
        self.armed = True

    def acquire(self, *args, **kwargs) -> bool:
        got = self.lock.acquire(*args, **kwargs)
        if got and self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def __getattr__(self, name: str):
        return getattr(self.lock, name)


def test_an_interrupt_right_after_the_lock_was_taken_leaves_it_free(daemon):
    """The lock stayed held by the interrupted caller: the I/O thread waited for it for
    ever, no call or Done got through again, and close() hung in term()."""
    c = Connection(daemon.socket, timeout=2)
    try:
        assert c.wait_up(5)
        lock = c._lock
        c._lock = _InterruptedAfterAcquire(lock)
        with pytest.raises(KeyboardInterrupt):
            c.request(m.Ping(c.next_req()))
        c._lock = lock
        done: list[object] = []
        t = threading.Thread(target=lambda: done.append(c.request(m.Ping(c.next_req()))))
        t.start()  # another thread: it would wait on a lock held by this one
        t.join(5)
        assert done and isinstance(done[0], m.Ok)
    finally:
        c.close()


def test_close_returns_while_the_io_thread_is_stuck(daemon):
    """term() waited for the stuck thread's socket for ever: the engine never exited."""
    c = Connection(daemon.socket, timeout=2)
    assert c.wait_up(5)
    with io_thread_held(c):
        t0 = time.monotonic()
        closer = threading.Thread(target=c.close, daemon=True)
        closer.start()
        closer.join(15)
        assert not closer.is_alive() and time.monotonic() - t0 < 10


def test_a_send_that_races_close_is_refused_not_lost(daemon):
    """close() ran between a send's check and its queueing (another thread): the
    Transfer was queued after close() had ended the queue, got no Done ever, and its
    wake-up went to the closed eventfd's number, which the engine may have reopened."""
    dones: list[m.Done] = []
    c = Connection(daemon.socket, timeout=2, on_done=dones.append, transfer_timeout=30)
    assert c.wait_up(5)
    direct = c._direct

    def close_meanwhile(*args, **kw) -> bool:  # the interleaving, made certain
        c.close()
        return False

    c._direct = close_meanwhile
    try:
        assert not c.send(m.Transfer(c.next_req(), 1, m.Direction.LOAD, pack_u32([0]),
                                     pack_u32([0])))
        with pytest.raises(Unavailable, match="closed"):
            c.submit(m.Ping(c.next_req())).result(1)
        assert dones == []  # refused: the caller ends it, nothing else will
    finally:
        c._direct = direct
        c.close()


def test_a_refused_register_is_logged_once_while_it_is_retried(daemon_factory, caplog):
    """A Register the daemon refuses (the tenant limit reached) is retried every 5 s;
    each retry logged a WARNING again, for as long as the refusal lasted (with TP=8,
    about 100 lines a minute). Said once per reason, and still retried."""
    d = daemon_factory(env={"KVD_MAX_TENANTS": "1"})
    first = Connection(d.socket, register=m.Register(0, fingerprint(Spec("", model="a")), -1))
    assert first.wait_up(10)
    caplog.set_level("WARNING", logger="kvd_client")
    c = Connection(d.socket, register=m.Register(0, fingerprint(Spec("", model="b")), -1))
    try:
        # Three tries (a Hello and a Register each), 5 s apart, each refused.
        assert wait_for(lambda: c.stats.sent >= 6 and not c._handshaking, 20)
        said = [r for r in caplog.records if "refused the handshake" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert not c.up and "tenant limit" in c._io.link.why_down
    finally:
        c.close()
        first.close()


FLOODER = """
import sys, time, zmq
from kvd_proto import messages as m
path, seconds = sys.argv[1], float(sys.argv[2])
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.setsockopt(zmq.SNDHWM, 0)
sock.bind(f"ipc://{path}")
print("ready", flush=True)
while True:
    ident, data = sock.recv_multipart()
    msg = m.decode_request(data)
    if isinstance(msg, m.Hello):
        sock.send_multipart([ident, m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, 1,
                                                       "flood", 1, 0))])
    elif isinstance(msg, m.Transfer):  # never a Done: bytes no kvd sends, without pause
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(1000):
                sock.send_multipart([ident, b"\\xc1"])
        break
"""


@pytest.mark.parametrize("closing", [False, True], ids=["deadline", "close"])
def test_a_flood_of_messages_neither_holds_a_transfer_past_its_deadline_nor_close(
        tmp_path, closing):
    """While more came than a wake-up reads, nothing expired: a load waited out the
    whole flood (the engine's step with it), and close() outlived its wait, its thread
    and ZeroMQ context left behind; each message logged a WARNING (40,000 a second)."""
    import subprocess
    import sys

    path = str(tmp_path / "flood.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, path, "8"], env=env,
                               stdout=subprocess.PIPE, text=True)
    dones: list[m.Done] = []
    try:
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "ready"
        c = Connection(path, on_done=dones.append, transfer_timeout=0.3)
        assert c.wait_up(5)
        t0 = time.monotonic()
        assert c.send(m.Transfer(c.next_req(), 1, m.Direction.LOAD, pack_u32([0]),
                                 pack_u32([0])))
        time.sleep(0.2)  # the flood has begun
        if closing:
            c.close()
            assert time.monotonic() - t0 < 0.2 + CLOSE_WAIT_S + 1.5
            assert not c._thread.is_alive()
        else:
            assert wait_for(lambda: dones, 6)
            assert time.monotonic() - t0 < 0.3 + GRACE_S + 1.5, time.monotonic() - t0
            assert dones[0].code == m.Code.EXPIRED
            c.close()
        assert len(dones) == 1
    finally:
        flooder.kill()
        flooder.wait(10)


def test_a_reply_larger_than_any_kvd_sends_is_not_taken(tmp_path):
    """A 256 MiB reply was read whole (600 MiB of the engine's memory at its peak)."""
    def answer(msg):
        return m.encode(m.StatsOk(msg.req, b"x" * (m.MAX_MESSAGE_BYTES + 1)))

    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, answer)
    c = Connection(path, timeout=2)
    try:
        assert c.wait_up(5)
        with pytest.raises((Timeout, Unavailable)):
            c.request(m.Stats(c.next_req()), timeout=2)
    finally:
        c.close()
        stop.set()
        t.join(5)


_PROBE = textwrap.dedent("""
    import sys
    from kvd_client import Connection
    c = Connection(sys.argv[1], timeout=2)
    print("UP" if c.wait_up(5) else "DOWN", flush=True)
    c.close()
""")


def test_a_client_on_another_monotonic_clock_runs_without_kvd(daemon):
    """Transfer deadlines are CLOCK_MONOTONIC times, which a process in another time
    namespace reads offset: ahead, the daemon copied into an engine's blocks after it
    had given up on the load and reused them; behind, every Transfer ended EXPIRED. The
    HelloOk says the daemon's clock; a client whose round trip does not bracket it
    stays down (and fails open) instead."""
    if subprocess.run(["unshare", "--time", "--fork", "true"], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("no time namespaces here (unshare --time needs CAP_SYS_ADMIN)")
    behind = int(min(time.monotonic() / 2, 20_000))  # (a clock cannot go below 0)
    for offset, up in ((0, True), (100_000, False), (-behind, False)):
        if offset == -behind and behind < 2:
            continue
        r = subprocess.run(["unshare", "--time", "--fork", f"--monotonic={offset}",
                            sys.executable, "-c", _PROBE, daemon.socket],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.stdout.strip() == ("UP" if up else "DOWN"), (offset, r.stdout, r.stderr)
        assert ("CLOCK_MONOTONIC is about" in r.stderr) != up, r.stderr
