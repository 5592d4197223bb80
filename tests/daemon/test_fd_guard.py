"""Descriptors running out: ZeroMQ aborts the process when an accept finds none left, so
the daemon hides its socket before that (a hunt ended a daemon with a hard limit of 64
at its 42nd client)."""

from __future__ import annotations

import os
import resource
import socket
import time

import zmq

from kvd import fd_guard as fd_guard_module
from kvd.fd_guard import EXACT_EVERY, FdGuard, fds_in_use, listening
from kvd.inode import identity_of, unlink_if
from kvd_client import Connection
from kvd_proto import messages as m
from tests.waiting import in_child, wait_for

LIMIT = 128  # the guard hides the socket at 112 descriptors in use, shows it below 96


def _fresh_descriptors() -> None:
    """In a forked child: only 0-2 open, the limit LIMIT (the counts below exact)."""
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def _bound(path: str) -> tuple[socket.socket, tuple[int, int], FdGuard]:
    """A listening unix socket at ``path``, its (device, inode), and a guard for it."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    st = os.stat(path)
    return listener, (st.st_dev, st.st_ino), FdGuard(path)


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


def test_a_shown_socket_is_hidden_again_in_time_despite_holes(tmp_path):
    """The Hello probe (the lowest free descriptor) reads low while closed connections
    left holes below newer ones: after a show, the socket was hidden again only at 124
    of 128 descriptors, where a few more accepts abort the daemon. The tick counts."""
    path = str(tmp_path / "kvd.sock")

    def rehidden_in_time() -> bool:
        _fresh_descriptors()
        listener, bound, guard = _bound(path)
        conns: list[int] = []
        while not guard.hidden:  # connections, each with its Hello
            conns.append(os.open("/dev/null", os.O_RDONLY))
            guard.check(bound)
        conns += [os.open("/dev/null", os.O_RDONLY) for _ in range(12)]  # on their way
        for fd in conns[:40]:  # early clients leave
            os.close(fd)
        del conns[:40]
        for _ in range(EXACT_EVERY):  # counted within a second
            guard.check(bound, tick=True)
        if guard.hidden or not os.path.exists(path):
            return False
        while not guard.hidden:  # new clients fill the holes; a tick per client
            conns.append(os.open("/dev/null", os.O_RDONLY))
            guard.check(bound)
            guard.check(bound, tick=True)
        # Hidden at the tick that passed the mark: past the show mark it counts each one.
        return fds_in_use(LIMIT) <= LIMIT - 16 + 1 and not os.path.exists(path)

    assert in_child(rehidden_in_time, 30) == 0


def test_hidden_names_of_daemons_gone_are_swept(tmp_path):
    """Only this pid namespace's names of dead pids, sockets of this uid: another
    container sharing the directory may hide its live socket under the same pid."""
    ns = os.stat("/proc/self/ns/pid").st_ino
    path = str(tmp_path / "kvd.sock")
    gone = f".kvd.sock.{ns}-4194999.full"  # above any pid_max: no such process
    kept = [f".kvd.sock.{ns}-{os.getppid()}.full",  # alive
            f".kvd.sock.{ns + 1}-4194999.full",  # another namespace's
            ".kvd.sock.\u00b2.full", f".kvd.sock.{ns}-99999999999.full",  # odd names
            ".kvd.sock.4194999.full"]
    socks = []
    for name in [gone, *kept]:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(tmp_path / name))
        socks.append(s)
    (tmp_path / f".kvd.sock.{ns}-4194998.full").write_text("not a socket")
    FdGuard(path).sweep()
    assert {p.name for p in tmp_path.iterdir()} == {*kept, f".kvd.sock.{ns}-4194998.full"}
    for s in socks:
        s.close()


def test_a_guard_without_proc_does_not_hide_for_good(tmp_path, monkeypatch):
    """/proc unreadable (a sandbox): the exact count read as every descriptor in use,
    and the socket was hidden at the first count and never shown again."""
    path = str(tmp_path / "kvd.sock")
    listener, bound, guard = _bound(path)
    real = os.listdir

    def no_proc(where="."):
        if str(where).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory")
        return real(where)

    monkeypatch.setattr(os, "listdir", no_proc)
    for _ in range(3 * EXACT_EVERY):
        guard.check(bound, tick=True)
    assert not guard.hidden and os.path.exists(path)
    listener.close()


def test_a_path_taken_while_hidden_is_left_to_its_owner_unless_nobody_listens(tmp_path):
    """Another daemon bound the path while this one hid: it stays hidden (reachable at
    its hidden name). Once that one died leaving its socket file, the file is stale:
    this daemon's socket takes the path back (it stayed hidden for good)."""
    path = str(tmp_path / "kvd.sock")

    def taken_back() -> bool:
        _fresh_descriptors()
        mine, bound, guard = _bound(path)
        held = []
        while not guard.hidden:
            held.append(os.open("/dev/null", os.O_RDONLY))
            guard.check(bound)
        other = socket.socket(socket.AF_UNIX)
        other.bind(path)
        other.listen()
        for fd in held:
            os.close(fd)
        for _ in range(2 * EXACT_EVERY):
            guard.check(bound, tick=True)
        if not (guard.hidden and os.path.exists(guard.hidden_path)):
            return False
        other.close()  # its file stays: nobody listens on it
        for _ in range(2 * EXACT_EVERY):
            guard.check(bound, tick=True)
        st = os.stat(path)
        return (not guard.hidden and (st.st_dev, st.st_ino) == bound
                and not os.path.exists(guard.hidden_path))

    assert in_child(taken_back, 30) == 0


def test_a_limit_lowered_below_the_guard_shows_the_socket(tmp_path):
    path = str(tmp_path / "kvd.sock")

    def shown() -> bool:
        _fresh_descriptors()
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        listener, bound, guard = _bound(path)
        held = []
        while not guard.hidden:
            held.append(os.open("/dev/null", os.O_RDONLY))
            guard.check(bound)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, hard))  # no guard below 64
        guard.check(bound, tick=True)
        return not guard.hidden and os.path.exists(path)

    assert in_child(shown, 30) == 0


def test_past_the_show_mark_every_tick_counts(tmp_path):
    """Between the marks a tick's count decides: every tick counts there, not one in
    EXACT_EVERY (a burst between two counts would pass the hide mark unseen)."""
    from kvd import fd_guard

    path = str(tmp_path / "kvd.sock")

    def counted() -> bool:
        _fresh_descriptors()
        listener, bound, guard = _bound(path)
        held = []
        while fds_in_use(LIMIT) < LIMIT - 28:  # past the show mark (96), below 112
            held.append(os.open("/dev/null", os.O_RDONLY))
        calls = []
        real = fd_guard.fds_in_use
        fd_guard.fds_in_use = lambda limit: calls.append(1) or real(limit)
        for _ in range(EXACT_EVERY - 1):
            guard.check(bound, tick=True)
        return len(calls) == EXACT_EVERY - 1 and not guard.hidden

    assert in_child(counted, 30) == 0


def test_a_listener_with_a_full_backlog_is_alive(tmp_path):
    """The probe's connect fails at once with EAGAIN on a listener whose queue is full
    (a daemon stopped or flooded): it was taken for stale, and its socket removed."""
    path = str(tmp_path / "busy.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(0)
    queued = []
    for _ in range(8):  # never accepted: the queue fills
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:
            pass
        queued.append(s)
    assert listening(path)
    listener.close()
    assert not listening(path)  # refused: stale
    for s in queued:
        s.close()


def test_a_stale_socket_that_cannot_be_removed_is_tried_once(tmp_path, monkeypatch):
    """Its unlink refused (a sticky directory, another owner): the take-back called
    itself until RecursionError, a traceback at every count."""
    path = str(tmp_path / "kvd.sock")
    mine, bound, guard = _bound(path)
    os.rename(path, guard.hidden_path)
    guard.hidden = True
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # stale: nobody listens
    real = os.unlink

    def refuse(p, *a, **k):
        if str(p) == path:
            raise PermissionError(1, "Operation not permitted")
        return real(p, *a, **k)

    monkeypatch.setattr(os, "unlink", refuse)
    probes = []
    monkeypatch.setattr(fd_guard_module, "listening",
                        lambda p: probes.append(p) or False)
    guard._show(bound, 10, LIMIT)
    assert guard.hidden and len(probes) == 1 and os.path.exists(guard.hidden_path)
    mine.close()


def test_unlink_if_removes_only_the_file_it_was_given(tmp_path):
    """The socket's removal at a stop, the hidden name's, and a stale socket's take-back
    all go through it: a file put at the path since (another daemon's socket) stays."""
    path = str(tmp_path / "kvd.sock")
    (tmp_path / "kvd.sock").write_bytes(b"ours")
    ours = identity_of(path)
    (tmp_path / "new").write_bytes(b"theirs")  # made before ours goes: another inode
    os.replace(tmp_path / "new", path)
    assert ours is not None and identity_of(path) != ours
    assert not unlink_if(path, ours) and os.path.exists(path)
    assert not unlink_if(path, None) and os.path.exists(path)
    assert unlink_if(path, identity_of(path)) and not os.path.exists(path)
    assert identity_of(path) is None and not unlink_if(path, ours)
