"""Access control with a real second uid (a throwaway user made for the test)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import uuid

import pytest

from kvd_client import RemoteError
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32
from tests.daemon.test_integration import allocate, keys, lookup, scheduler
from tests.daemon.workers import Spec, Worker
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd to create a throwaway user")


@pytest.fixture
def other_user():
    name = f"kvdt{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                    name], check=True, capture_output=True)
    import pwd

    pw = pwd.getpwnam(name)
    yield pw.pw_uid, pw.pw_gid
    subprocess.run(["userdel", name], check=False, capture_output=True)


def _as_user(uid: int, gid: int, socket: str, requests: list, out) -> None:
    """In a forked child: drop to ``uid`` and send raw requests; report the replies."""
    import zmq

    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{socket}")
        replies = []
        for msg in requests:
            if msg is WAIT:  # the test does something meanwhile, then says go
                out.send(("waiting", replies))
                out.recv()
                continue
            s.send(m.encode(msg))
            replies.append(m.decode_reply(s.recv()) if s.poll(5000) else None)
        out.send(("ok", replies))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.send(("error", repr(e)))


WAIT = object()  # in ``requests``: the child waits there, keeping its connection open


def ask_as(uid: int, gid: int, socket: str, requests: list, meanwhile=None):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_as_user, args=(uid, gid, socket, requests, child))
    p.start()
    assert parent.poll(20), "child did not answer"
    result = parent.recv()
    if result[0] == "waiting":
        meanwhile(result[1])
        parent.send("go")
        assert parent.poll(20), "child did not answer"
        result = parent.recv()
    p.join(10)
    assert result[0] == "ok", result
    return result[1]


def reachable_daemon(daemon_factory, env: dict[str, str] | None = None):
    """A daemon whose socket sits where another uid can traverse to it (pytest's
    tmp dirs are private to root)."""
    d = daemon_factory(start=False)
    d.socket = f"/tmp/kvd-sec-{uuid.uuid4().hex[:8]}/kvd.sock"
    d.env = env or {}
    return d.start()


def open_socket(daemon) -> None:
    # Let the other uid reach the socket file, so the daemon's own check is what refuses.
    os.chmod(os.path.dirname(daemon.socket), 0o777)
    os.chmod(daemon.socket, 0o777)


def hello(req: int = 1) -> m.Hello:
    return m.Hello(req, m.PROTOCOL_VERSION, 0, "other-uid")


def test_a_second_uid_is_refused(daemon_factory, other_user):
    uid, gid = other_user
    daemon = reachable_daemon(daemon_factory)
    open_socket(daemon)
    [reply] = ask_as(uid, gid, daemon.socket, [hello()])
    assert isinstance(reply, m.Error) and reply.code == m.Code.FORBIDDEN
    assert str(uid) in reply.message
    assert daemon.status()["clients"] == [] or all(
        c["name"] != "other-uid" for c in daemon.status()["clients"])


def test_socket_permissions_keep_other_users_out(daemon_factory, other_user):
    uid, gid = other_user
    daemon = reachable_daemon(daemon_factory)
    os.chmod(os.path.dirname(daemon.socket), 0o755)  # the directory is not the guard here
    mode = os.stat(daemon.socket).st_mode & 0o777
    assert mode & 0o007 == 0, oct(mode)  # no access for "other"
    replies = ask_as(uid, gid, daemon.socket, [hello()])
    assert replies == [None]  # cannot even connect


def test_allowed_but_not_admin(daemon_factory, other_user):
    uid, gid = other_user
    d = reachable_daemon(daemon_factory, {"KVD_ALLOWED_UIDS": str(uid)})
    open_socket(d)
    ok, evict, flush = ask_as(uid, gid, d.socket, [hello(1), m.Evict(2, -1), m.Flush(3)])
    assert isinstance(ok, m.HelloOk)
    assert isinstance(evict, m.Error) and evict.code == m.Code.FORBIDDEN
    assert isinstance(flush, m.Error) and flush.code == m.Code.FORBIDDEN


def test_a_reload_that_revokes_a_uid_drops_its_live_connection(daemon_factory, other_user,
                                                               tmp_path):
    """A uid taken out of ``allowed_uids`` by SIGHUP kept its open connection (access
    was checked at Hello only) until it reconnected."""
    uid, gid = other_user
    f = tmp_path / "kvd.toml"
    f.write_text(f"allowed_uids = [{uid}]\n")
    d = daemon_factory("--config", str(f), start=False)
    d.socket = f"/tmp/kvd-sec-{uuid.uuid4().hex[:8]}/kvd.sock"
    d.start()
    open_socket(d)

    def revoke(before: list) -> None:
        assert isinstance(before[0], m.HelloOk)
        assert any(c["name"] == "other-uid" for c in d.status()["clients"])
        f.write_text("allowed_uids = []\n")
        os.kill(d.pid, signal.SIGHUP)
        assert wait_for(lambda: all(c["name"] != "other-uid"
                                    for c in d.status()["clients"]), 10), d.logs()[-2000:]

    _, after, again = ask_as(uid, gid, d.socket, [hello(1), WAIT, m.Ping(2), hello(3)],
                             meanwhile=revoke)
    assert isinstance(after, m.Error) and after.code == m.Code.NOT_REGISTERED
    assert isinstance(again, m.Error) and again.code == m.Code.FORBIDDEN
    assert "no longer allowed" in d.logs()


def test_a_client_cannot_read_another_tenants_slot(daemon):
    # Same uid, other tenant: slot ids of tenant one are refused for tenant two.
    one = Spec(daemon.socket, model="one", pages=(4096,))
    two = Spec(daemon.socket, model="two", pages=(4096,), seed=None)
    s1 = scheduler(daemon, one)
    w1, w2 = Worker(one), Worker(two)
    try:
        slots = allocate(s1, keys(2))
        assert w1.store(1, range(2), slots)[1] == 0
        lookup(s1, keys(2))
        done = w2.load(2, range(2), slots)
        assert done[1] == m.Code.BAD_IDS
        reply = w2.call("raw", m.Abort, {"slots": b"".join(int(s).to_bytes(4, "little")
                                                           for s in slots)})
        assert reply[0] == "error" and "BAD_IDS" in str(reply[1])
        assert lookup(s1, keys(2)).hits == 2
    finally:
        w1.close()
        w2.close()
        s1.close()


def test_quota_on_pending_stores(daemon_factory):
    d = daemon_factory(env={"KVD_MAX_PENDING_BLOCKS": "5", "KVD_MAX_LEASED_BLOCKS": "3"})
    spec = Spec(d.socket, pages=(4096,))
    s, worker = scheduler(d, spec), Worker(spec)
    try:
        r = s.request(m.Allocate(s.next_req(), keys(8)))
        assert r.allocated == 5
        with pytest.raises(RemoteError) as e:
            s.request(m.Allocate(s.next_req(), keys(2, "x")))
        assert e.value.code == m.Code.BUSY
    finally:
        worker.close()
        s.close()


def test_quota_on_leased_blocks(daemon_factory):
    """A Lookup of more keys than the quota was refused BUSY ("release leases first")
    with no lease held, so with max_leased_blocks set a long prompt never hit: the hit
    run now ends where the quota does."""
    d = daemon_factory(env={"KVD_MAX_LEASED_BLOCKS": "3"})
    spec = Spec(d.socket, pages=(4096,))
    s, worker = scheduler(d, spec), Worker(spec)
    try:
        assert worker.store(1, range(5), allocate(s, keys(5)))[1] == 0
        assert s.request(m.Lookup(s.next_req(), keys(20, "miss"))).hits == 0
        first = s.request(m.Lookup(s.next_req(), keys(5)))
        assert first.hits == 3 and len(unpack_u32(first.slots)) == 3
        with pytest.raises(RemoteError) as e:  # three held: none left
            s.request(m.Lookup(s.next_req(), keys(1)))
        assert e.value.code == m.Code.BUSY and "release leases" in e.value.message
        s.request(m.Release(s.next_req(), first.lease))
        again = s.request(m.Lookup(s.next_req(), keys(2)))
        assert again.hits == 2
        assert s.request(m.Lookup(s.next_req(), keys(5))).hits == 1  # what is left
        assert d.status()["blocks"]["pinned"] == 2  # key 0 under both leases
        # Every key asked counts as asked (the status's and metrics' hit ratio), the
        # ones past the quota as missed.
        counters = d.status()["counters"]
        assert counters["lookup_keys"] == 20 + 5 + 2 + 5  # (the refused one is none)
    finally:
        worker.close()
        s.close()


def test_oversized_messages_get_a_typed_error(daemon_factory):
    import zmq

    d = daemon_factory(env={"KVD_MAX_MESSAGE_BYTES": "65536"})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{d.socket}")
    s.send(m.encode(m.Lookup(41, [b"k" * 36] * 3000)))  # ~120 KB
    assert s.poll(5000)
    r = m.decode_reply(s.recv())
    assert isinstance(r, m.Error) and r.code == m.Code.BAD_REQUEST and r.req == 41
    assert "max_message_bytes" in r.message
    s.close()
    ctx.term()


def test_a_hung_client_is_dropped_after_its_heartbeats_stop(daemon_factory):
    import signal
    import time

    d = daemon_factory(env={"KVD_CLIENT_TIMEOUT_MS": "1500"})
    spec = Spec(d.socket, pages=(4096,))
    s = scheduler(d, spec)
    w = Worker(spec)
    try:
        slots = allocate(s, keys(2))
        assert w.store(1, range(2), slots)[1] == 0
        hung = Worker(spec)
        assert hung.call("raw", m.Lookup, {"keys": keys(2)})[1].hits == 2
        hung.call("raw", m.Allocate, {"keys": keys(2, "h")})
        assert d.status()["blocks"]["pinned"] == 2
        os.kill(hung.proc.pid, signal.SIGSTOP)  # alive (its pid stays), but silent
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            b = d.status()["blocks"]
            if b["pinned"] == 0 and b["pending"] == 0:
                break
            time.sleep(0.1)
        assert (b["pinned"], b["pending"]) == (0, 0)
        os.kill(hung.proc.pid, signal.SIGCONT)
        hung.kill()
    finally:
        w.close()
        s.close()


def _register_as(uid: int, gid: int, socket: str, dumpable: bool, out) -> None:
    """In a forked child: drop to ``uid``, dumpable or not (as after a setuid exec),
    and register host memory; report the reply."""
    import ctypes

    import numpy as np
    import zmq

    from tests.daemon.workers import Spec, fingerprint

    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        # setuid() without an exec leaves a process not dumpable; an engine exec'd as
        # its user is (PR_SET_DUMPABLE, 4).
        assert ctypes.CDLL(None, use_errno=True).prctl(4, int(dumpable), 0, 0, 0) == 0
        buf = np.zeros(4 * 4096, np.uint8)
        s = zmq.Context().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{socket}")
        region = m.HostRegion(buf.ctypes.data, 4, 4096, 4096)
        replies = []
        for msg in (hello(1), m.Register(2, fingerprint(Spec(socket, pages=(4096,))), 0,
                                         [region])):
            s.send(m.encode(msg))
            replies.append(m.decode_reply(s.recv()) if s.poll(5000) else None)
        out.send(("ok", replies))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.send(("error", repr(e)))


@pytest.mark.parametrize("dumpable", [True, False])
def test_memory_of_a_process_its_uid_may_not_access_is_never_copied(daemon_factory,
                                                                     other_user, dumpable):
    """The daemon copies with CAP_SYS_PTRACE, past the kernel's checks, at the pid where
    the client's socket was opened: exec'ing a setuid program there (not dumpable, not
    the client's to debug) made kvd read and write that program's memory for it."""
    uid, gid = other_user
    d = reachable_daemon(daemon_factory, {"KVD_ALLOWED_UIDS": str(uid)})
    open_socket(d)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_register_as, args=(uid, gid, d.socket, dumpable, child))
    p.start()
    assert parent.poll(20), "child did not answer"
    result = parent.recv()
    p.join(10)
    assert result[0] == "ok", result
    hello_ok, reply = result[1]
    assert isinstance(hello_ok, m.HelloOk)
    if dumpable:
        assert isinstance(reply, m.Registered), reply
    else:
        assert isinstance(reply, m.Error) and reply.code == m.Code.PERMISSION, reply
        assert "not dumpable" in reply.message


def test_the_copy_threads_check_the_process_before_every_copy():
    """Registered, a client's process may exec a setuid program later: each copy checks
    the process is still one the client's uid may access."""
    import threading

    import numpy as np

    from kvd.engines.base import CopyJob
    from kvd.engines.host import HostEngine

    done: dict[int, Exception | None] = {}
    finished = threading.Event()

    def on_done(job: CopyJob, error: Exception | None, seconds: float) -> None:
        done[job.event] = error
        if len(done) == 2:
            finished.set()

    src, dst = np.full(4096, 7, np.uint8), np.zeros(4096, np.uint8)
    engine = HostEngine(on_done, threads=1)
    try:
        for event, uid in ((1, 12345), (2, os.geteuid())):  # /proc/self/* is root's
            engine.submit(CopyJob(1, event, event, m.Direction.LOAD, os.getpid(),
                                  np.array([src.ctypes.data], np.uint64),
                                  np.array([dst.ctypes.data], np.uint64),
                                  np.array([4096], np.uint64), np.arange(1), uid=uid))
            assert wait_for(lambda: event in done, 10)
            if event == 1:
                assert not dst.any()  # nothing copied
        assert getattr(done[1], "code", None) == m.Code.PERMISSION
        assert done[2] is None and (dst == 7).all()
    finally:
        engine.close()


def test_a_client_process_that_exited_is_gone_not_foreign():
    """An exited, unreaped process's /proc files are root's, as a setuid one's are: its
    copies end CLIENT_GONE (as the system call's ESRCH said before), not PERMISSION."""
    from kvd.engines.host import check_owner
    from kvd.errors import TransferError

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        assert wait_for(lambda: open(f"/proc/{pid}/stat", "rb").read().rpartition(b")")[2]
                        .split()[0] == b"Z", 5)
        with pytest.raises(TransferError) as e:
            check_owner(pid, 12345)
        assert e.value.code == m.Code.CLIENT_GONE
        with pytest.raises(TransferError) as e:
            check_owner(os.getpid(), 12345)  # alive, and root's: not that uid's
        assert e.value.code == m.Code.PERMISSION
    finally:
        os.waitpid(pid, 0)


def test_a_copy_during_which_the_process_changed_hands_fails(monkeypatch):
    """The process may exec a setuid program between the check and the copy call: it is
    checked again after the copy, so a store that read such a process is not kept."""
    import threading

    import numpy as np

    from kvd.engines import host
    from kvd.engines.base import CopyJob

    copy, copied = host.vm_copy, threading.Event()

    def copy_then_exec(*args, **kwargs) -> int:
        n = copy(*args, **kwargs)
        copied.set()  # from here on the process is another user's
        return n

    real_check = host.check_owner

    def check(pid: int, uid: int) -> None:  # ours until the copy, another uid's after
        if copied.is_set():
            real_check(pid, 12345)

    monkeypatch.setattr(host, "vm_copy", copy_then_exec)
    monkeypatch.setattr(host, "check_owner", check)
    done: list = []
    src, dst = np.full(4096, 7, np.uint8), np.zeros(4096, np.uint8)
    engine = host.HostEngine(lambda job, error, s: done.append(error), threads=1)
    try:
        engine.submit(CopyJob(1, 1, 1, m.Direction.STORE, os.getpid(),
                              np.array([dst.ctypes.data], np.uint64),
                              np.array([src.ctypes.data], np.uint64),
                              np.array([4096], np.uint64), np.arange(1), uid=12345))
        assert wait_for(lambda: done, 10)
        assert copied.is_set() and getattr(done[0], "code", None) == m.Code.PERMISSION
    finally:
        engine.close()
