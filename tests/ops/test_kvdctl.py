"""kvdctl against a real daemon: every command, its --json schema, and the exit codes
(0 ok, 1 unhealthy/refused/error, 2 usage, 3 unreachable)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvd.cli import ctl
from kvd.cli.admin import AdminClient, Unreachable
from kvd_client import Connection
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32
from tests.daemon.workers import Spec, Worker, fingerprint

KVDCTL = [sys.executable, "-m", "kvd.cli.ctl"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = ctl.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str):
    rc, out, _ = run(capsys, *argv, "--json")
    assert rc == 0, out
    return json.loads(out)


@pytest.fixture
def busy_daemon(daemon_factory):
    """A daemon holding 8 READY blocks of one tenant, with a scheduler still connected."""
    d = daemon_factory("--metrics-port", "0")
    spec = Spec(d.socket)
    sched = Connection(d.socket, name="sched", register=m.Register(0, fingerprint(spec), -1))
    assert sched.wait_up(10)
    w = Worker(spec)
    ks = [f"k{i}".encode().ljust(36, b"\0") for i in range(8)]
    r = sched.request(m.Allocate(sched.next_req(), ks))
    assert w.store(1, range(8), unpack_u32(r.slots))[1] == 0
    w.close()
    yield d
    sched.close()


def test_every_command_with_json(busy_daemon, capsys):
    s = ("--socket", busy_daemon.socket)
    st = run_json(capsys, *s, "status")
    for key, kind in {"pid": int, "instance": str, "uptime_s": float, "policy": str,
                      "phase": str, "pool": dict, "blocks": dict, "clients": list,
                      "tenants": list, "counters": dict, "transfers": dict, "metrics": str}.items():
        assert isinstance(st[key], kind), key
    assert st["phase"] == "serving" and st["blocks"]["ready"] == 8
    if st["policy"] == "adaptive":  # the default says which expert it follows
        assert st["policy_state"]["leader"] in st["policy_state"]["weights"]
        assert 0 < st["policy_state"]["sample_rate"] <= 1

    tenants = run_json(capsys, *s, "tenants")["tenants"]
    assert len(tenants) == 1
    assert set(tenants[0]) >= {"id", "model", "tp_size", "slot_bytes", "blocks", "bytes",
                               "clients", "digest"}
    worker = Worker(Spec(busy_daemon.socket))  # an engine's worker, rank 0
    try:
        clients = run_json(capsys, *s, "clients")["clients"]
        rc, out, _ = run(capsys, *s, "status")
    finally:
        worker.close()
    sched = next(c for c in clients if c["name"] == "sched")
    assert set(sched) >= {"id", "pid", "name", "tenant", "rank", "inflight", "requests",
                          "kind"}
    # Engines told apart from kvdctl's own connection.
    kinds = {c["name"]: c["kind"] for c in clients}
    assert kinds["sched"] == "scheduler" and kinds["worker-r0"] == "worker0", clients
    assert kinds["kvdctl"] == "admin", clients
    assert "scheduler 1" in out and "worker0 1" in out and "admin " in out, out

    cfg = run_json(capsys, *s, "config")
    assert cfg["socket"] == {"value": busy_daemon.socket, "origin": "flag"}
    assert cfg["stop_timeout_ms"] == {"value": 10_000, "origin": "default"}
    assert all(set(v) == {"value", "origin"} for v in cfg.values())

    health = run_json(capsys, *s, "health")
    assert health["healthy"] is True and health["state"] == "ok"

    lines = run(capsys, *s, "top", "--json", "--iterations", "2", "--interval", "0.1")
    assert lines[0] == 0
    rows = [json.loads(x) for x in lines[1].splitlines()]
    assert len(rows) == 2 and {"lookups_per_s", "hit_rate", "pool_used_bytes"} <= set(rows[1])

    assert run_json(capsys, *s, "evict", "--tenant", str(tenants[0]["id"])) == {
        "evicted_blocks": 8}
    assert run_json(capsys, *s, "flush") == {"evicted_blocks": 0, "kept_blocks": 0}
    assert run_json(capsys, *s, "evict", "--all") == {"evicted_blocks": 0}


def test_human_output(busy_daemon, capsys):
    s = ("--socket", busy_daemon.socket)
    rc, out, _ = run(capsys, *s, "status")
    assert rc == 0 and "pool" in out and "ready 8" in out
    assert "policy adaptive for " in out and "(leading: arc)" in out  # ARC leads first
    rc, out, _ = run(capsys, *s, "tenants")
    assert out.splitlines()[0].split()[:3] == ["TENANT", "MODEL", "TP"] and "tiny" in out
    rc, out, _ = run(capsys, *s, "clients")
    assert out.startswith("CLIENT") and "sched" in out
    rc, out, _ = run(capsys, *s, "config")
    assert out.startswith("KEY") and "pool_size" in out and "flag" in out
    rc, out, _ = run(capsys, *s, "health")
    assert rc == 0 and out.startswith("ok: serving") and out.count("\n") == 1
    rc, out, _ = run(capsys, *s, "top", "--iterations", "1")
    assert rc == 0 and "lookups/s" in out and "TENANT" in out
    rc, out, _ = run(capsys, *s, "flush")
    assert rc == 0 and out == "flushed 8 blocks; 0 in use kept\n"


def test_names_from_clients_cannot_forge_rows_or_drive_the_terminal(daemon, capsys):
    """A model or client name with a newline or an escape sequence went to the
    operator's terminal as it was: a forged row in ``tenants``, a screen cleared."""
    model = "tiny\nTENANT 9 admin-approved\x1b]0;title\x07\x1b[2J"
    spec = Spec(daemon.socket, model=model)
    sched = Connection(daemon.socket, name="sched\x1b[31m\r", timeout=10,
                       register=m.Register(0, fingerprint(spec), -1))
    try:
        assert sched.wait_up(10)
        for command in ("tenants", "clients", "top"):
            argv = ("--socket", daemon.socket, command) + (
                ("--iterations", "1") if command == "top" else ())
            rc, out, _ = run(capsys, *argv)
            assert rc == 0 and "\x1b" not in out and "\x07" not in out and "\r" not in out
            assert "tiny\\nTENANT 9" in out or command == "clients", out
            assert "sched\\x1b[31m\\r" in out or command == "tenants", out
            # every row is a header or starts with an id: none made up by a name
            assert not [ln for ln in out.splitlines() if ln.startswith("TENANT 9")], out
        rc, out, _ = run(capsys, "--socket", daemon.socket, "tenants")
        assert len(out.splitlines()) == 2, out  # the header and the one tenant
        rc, out, _ = run(capsys, "--socket", daemon.socket, "tenants", "--json")
        assert json.loads(out)["tenants"][0]["model"] == model  # JSON keeps it exact
    finally:
        sched.close()


def test_kvdctl_events_escapes_a_topic_named_after_a_clients_model():
    from kvd.cli.tail import _text
    from kvd.events import AllBlocksCleared

    line = _text("kv@node@tiny\n2026 fake\x1b[2J", 7, AllBlocksCleared())
    assert line == "kv@node@tiny\\n2026 fake\\x1b[2J #7 AllBlocksCleared"


def test_error_reply_exits_1(busy_daemon, capsys):
    rc, _, err = run(capsys, "--socket", busy_daemon.socket, "evict", "--tenant", "999")
    assert rc == 1 and "no tenant 999" in err


def test_daemon_down_exits_3_with_a_clear_message(tmp_path, capsys):
    missing = str(tmp_path / "nobody.sock")
    for cmd in ("status", "tenants", "clients", "top", "evict --all", "flush", "config"):
        rc, out, err = run(capsys, "--socket", missing, *cmd.split())
        assert rc == 3 and out == "" and f"kvd is not running: no socket at {missing}" in err
    rc, out, _ = run(capsys, "--socket", missing, "health")
    assert rc == 3 and out.startswith("down: ") and out.count("\n") == 1
    health = json.loads(run(capsys, "--socket", missing, "health", "--json")[1])
    assert health == {"healthy": False, "state": "down", "reason": health["reason"]}


def test_stale_socket_exits_3_after_the_timeout(tmp_path, capsys):
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # a socket file nobody listens on: a daemon killed with -9
        t0 = time.monotonic()
        rc, _, err = run(capsys, "--socket", path, "--timeout", "0.5", "status")
    assert rc == 3 and "not answering" in err and time.monotonic() - t0 < 5


def fake_daemon(path: str, reply) -> threading.Thread:
    """A ROUTER answering one Hello with ``reply(req)``, then going away."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")

    def serve() -> None:
        if sock.poll(5000):
            ident, data = sock.recv_multipart()
            msg = m.decode_request(data)
            sock.send_multipart([ident, m.encode(reply(msg.req))])
        time.sleep(0.2)
        sock.close(linger=0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_access_refused_exits_1(tmp_path, capsys):
    path = str(tmp_path / "forbidden.sock")
    t = fake_daemon(path, lambda req: m.Error(req, m.Code.FORBIDDEN,
                                              "uid 1000 may not use this kvd"))
    rc, out, _ = run(capsys, "--socket", path, "health")
    t.join(5)
    assert rc == 1 and out == "unhealthy: access refused by kvd: uid 1000 may not use this kvd\n"


def not_kvd(path: str, answer) -> tuple[threading.Thread, threading.Event]:
    """A ROUTER that answers each message with ``answer(request)`` (bytes; None: no
    answer): another ZeroMQ service, or a kvd of another version, at kvdctl's socket
    path."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if sock.poll(50):
                ident, data = sock.recv_multipart()
                reply = answer(m.decode_request(data))
                if reply is not None:  # (None: not answered)
                    sock.send_multipart([ident, reply])
        sock.close(linger=0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t, done


def run_against(tmp_path, capsys, answer, *argv: str) -> tuple[int, str, str]:
    """kvdctl run against a peer answering with ``answer`` (see ``not_kvd``)."""
    path = str(tmp_path / "other.sock")
    t, done = not_kvd(path, answer)
    try:
        return run(capsys, "--socket", path, "--timeout", "2", *argv)
    finally:
        done.set()
        t.join(5)


def _hello_then(other):
    def answer(msg):
        if isinstance(msg, m.Hello):
            return m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, os.getpid(), "x", 1))
        return m.encode(other(msg.req))
    return answer


def _waiting_on(tmp_path, ping_reply, timeout: float, patience: float = 0.0):
    """kvdctl's Flush against a peer that answers the Hello, never the Flush, and Pings
    with ``ping_reply(req)`` (None: not at all): the Unreachable raised, and what the
    peer was sent."""
    seen: list[str] = []

    def answer(msg):
        seen.append(type(msg).__name__)
        if isinstance(msg, m.Hello):
            return m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION, os.getpid(), "x", 1))
        if isinstance(msg, m.Ping) and ping_reply(msg.req) is not None:
            return m.encode(ping_reply(msg.req))
        return None

    path = str(tmp_path / "slow.sock")
    t, done = not_kvd(path, answer)
    try:
        with AdminClient(path, timeout) as c:
            c.connect()
            c.patience = patience
            with pytest.raises(Unreachable) as e:
                c.request(m.Flush)
        time.sleep(0.1)  # (a Ping sent as it gave up would be in by now)
        return e.value, seen
    finally:
        done.set()
        t.join(5)


def test_a_request_not_answered_is_given_up_after_one_timeout_without_a_ping(tmp_path):
    """The wait woke a fraction of a millisecond early (poll rounds down), and a plain
    request pinged and waited a second --timeout: every kvdctl command against a hung
    kvd took twice its --timeout."""
    err, seen = _waiting_on(tmp_path, lambda req: m.Ok(req), 0.3)
    assert seen == ["Hello", "Flush"] and "not answering" in str(err)


def test_a_long_wait_ends_at_once_when_kvd_forgot_kvdctl(tmp_path):
    """A kvd restarted under a long wait answers the Ping NOT_REGISTERED: the answer
    will never come (it waited all of --wait / 120 s, then blamed a hung daemon)."""
    t0 = time.monotonic()
    err, seen = _waiting_on(tmp_path, lambda req: m.Error(req, m.Code.NOT_REGISTERED,
                                                          "send Hello first"), 0.2, 30.0)
    assert "forgot this client while Flush was under way" in str(err)
    assert seen == ["Hello", "Flush", "Ping"] and time.monotonic() - t0 < 10


def test_a_long_wait_that_runs_out_says_kvd_is_alive(tmp_path):
    err, seen = _waiting_on(tmp_path, lambda req: m.Ok(req), 0.2, 0.7)
    assert "alive but did not answer Flush in 0.7s" in str(err)
    assert seen[:2] == ["Hello", "Flush"] and set(seen[2:]) == {"Ping"} and len(seen) >= 4


def test_a_ping_not_answered_in_a_long_wait_is_a_hung_kvd(tmp_path):
    t0 = time.monotonic()
    err, seen = _waiting_on(tmp_path, lambda req: None, 0.2, 30.0)
    assert "not answering" in str(err) and seen == ["Hello", "Flush", "Ping"]
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("answer,command,why", [
    (lambda msg: b"\x93\xa5junk", "status", "undecodable reply"),
    (lambda msg: m.encode(m.StatsOk(msg.req, b"{}")), "status", "Hello answered with StatsOk"),
    (_hello_then(lambda req: m.StatsOk(req, b"not json")), "status", "not JSON"),
    (_hello_then(lambda req: m.StatsOk(req, b"[1]")), "clients", "not a JSON object"),
    (_hello_then(lambda req: m.StatsOk(req, b"{}")), "health", "its status lacks"),
    (_hello_then(lambda req: m.ConfigOk(req, b"null", {})), "config", "not a JSON object"),
    (_hello_then(lambda req: m.Ok(req, 0)), "status", "Stats answered with Ok"),
    (lambda msg: m.encode(m.HelloOk(msg.req, m.PROTOCOL_VERSION + 1, os.getpid(), "x", 1)),
     "status", f"it speaks protocol {m.PROTOCOL_VERSION + 1}"),
])
def test_a_peer_that_is_not_kvd_is_one_line_and_exit_1(tmp_path, capsys, answer, command,
                                                       why):
    """Each was a traceback (an assert, a KeyError, a JSON error) from kvdctl."""
    rc, out, err = run_against(tmp_path, capsys, answer, command)
    text = (out + err).strip()
    assert rc == 1 and "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "does not answer as kvd does" in text and why in text, text


def test_a_config_file_nested_too_deeply_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "deep.toml"
    f.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    assert ctl.main(["--config", str(f), "status"]) == 2  # was a RecursionError
    assert "nested too deeply" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["evict"], ["evict", "--all", "--tenant", "1"], ["bogus"]):
        with pytest.raises(SystemExit) as e:
            ctl.main(argv)
        assert e.value.code == 2
    assert ctl.main(["--config", "/nonexistent/kvd.toml", "status"]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    for command in ("events", "health"):  # events raised a traceback (exit 1)
        assert ctl.main(["--config", "/nonexistent/kvd.toml", command]) == 2
    # -1 is "every tenant" on the wire; negative or NaN times hung or raised.
    for argv in (["evict", "--tenant", "-1"], ["evict", "--tenant", "1" + "0" * 20],
                 ["--timeout", "nan", "status"], ["--timeout", "-1", "status"],
                 ["top", "--interval", "-1"], ["top", "--interval", "0"]):
        with pytest.raises(SystemExit) as e:
            ctl.main(argv)
        assert e.value.code == 2, argv


def test_the_config_file_gives_kvdctl_its_socket_only(tmp_path, capsys, monkeypatch):
    """kvdctl validated the whole daemon config without the daemon's environment: a
    file whose disk_size came from the daemon's environment made it exit 2."""
    f = tmp_path / "kvd.toml"
    f.write_text(f'socket = "{tmp_path}/kvd.sock"\ndisk_path = "{tmp_path}/d"\n')
    monkeypatch.delenv("KVD_SOCKET", raising=False)
    code, out, err = run(capsys, "--config", str(f), "--timeout", "0.2", "health")
    assert code == 3 and str(tmp_path / "kvd.sock") in out + err


def test_socket_comes_from_the_config_file(busy_daemon, tmp_path, capsys, monkeypatch):
    f = tmp_path / "kvd.toml"
    f.write_text(f'socket = "{busy_daemon.socket}"\n')
    monkeypatch.delenv("KVD_SOCKET", raising=False)
    assert run(capsys, "--config", str(f), "health")[0] == 0
    monkeypatch.setenv("KVD_SOCKET", busy_daemon.socket)
    assert run(capsys, "health")[0] == 0


def test_entry_point_health_is_one_line_and_top_quits_on_ctrl_c(busy_daemon):
    p = subprocess.run([*KVDCTL, "--socket", busy_daemon.socket, "health"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.count("\n") == 1 and p.stderr == ""
    # Ctrl-C as at a terminal: a runner that started us in the background (SIGINT
    # ignored, inherited) must not make the child ignore it too.
    top = subprocess.Popen([*KVDCTL, "--socket", busy_daemon.socket, "top"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(2.0)
    top.send_signal(signal.SIGINT)
    out, err = top.communicate(timeout=10)
    assert top.returncode == 0, err
    assert out.count("Ctrl-C quits") >= 2 and "Traceback" not in err
    assert "\x1b[" not in out  # not a terminal: no screen clearing
    busy_daemon.stop()
    p = subprocess.run([*KVDCTL, "--socket", busy_daemon.socket, "health"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 3 and p.stdout.startswith("down: ")


def test_health_is_unhealthy_while_a_gpu_context_is_lost_and_live_stays_ok():
    st = {"phase": "serving", "pid": 1, "blocks": {"ready": 3}, "clients": [],
          "pool": {"capacity_bytes": 1 << 20, "used_bytes": 0},
          "cuda": {"gpus": 2, "lost_gpus": 0}}
    assert ctl.health_of(st)[0]
    st["cuda"]["lost_gpus"] = 1
    ok, why = ctl.health_of(st)
    assert not ok and "restart kvd" in why
    assert ctl.health_of(st, live=True)[0]


def test_health_is_unhealthy_while_the_pool_file_is_not_whole():
    st = {"phase": "serving", "pid": 1, "blocks": {"ready": 0}, "clients": [],
          "pool": {"capacity_bytes": 1 << 20, "used_bytes": 0, "fault": ""}}
    assert ctl.health_of(st)[0]
    st["pool"]["fault"] = "was cut to 0 of its 1048576 bytes; reserving it again failed"
    ok, why = ctl.health_of(st)
    assert not ok and why.startswith("the pool file was cut to 0")
    assert ctl.health_of(st, live=True)[0]


BAD_DOC = json.dumps({"pool": {}, "counters": {}, "blocks": {}, "clients": [{}],
                      "tenants": [{}]}).encode()  # the top keys, none of what is in them
BAD_STATUS = _hello_then(lambda req: m.StatsOk(req, BAD_DOC))


@pytest.mark.parametrize("command", ["status", "tenants", "clients", "health", "flush"])
def test_a_status_of_another_shape_is_one_line_and_exit_1(tmp_path, capsys, command):
    """A kvd of another version answers with the keys kvdctl looks for, not what is in
    them: a KeyError or TypeError traceback from the rendering."""
    rc, out, err = run_against(tmp_path, capsys, BAD_STATUS, command)
    text = (out + err).strip()
    assert rc == 1 and "Traceback" not in text and len(text.splitlines()) == 1, text


def test_status_json_prints_a_status_of_another_shape_as_it_came(tmp_path, capsys):
    rc, out, _ = run_against(tmp_path, capsys, BAD_STATUS, "status", "--json")
    assert rc == 0 and json.loads(out) == json.loads(BAD_DOC)


def test_replies_to_other_requests_do_not_hold_kvdctl_past_its_timeout(tmp_path, capsys):
    """The wait for the reply started again at each message that was not it: a peer
    sending such messages every 200 ms held kvdctl (and a health probe) for ever."""
    path = str(tmp_path / "chatty.sock")
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    done = threading.Event()

    def serve() -> None:
        ident = None
        while not done.is_set():
            if sock.poll(200):
                ident, data = sock.recv_multipart()
                msg = m.decode_request(data)
                if isinstance(msg, m.Hello):
                    sock.send_multipart([ident, m.encode(m.HelloOk(
                        msg.req, m.PROTOCOL_VERSION, os.getpid(), "x", 1))])
            elif ident is not None:
                sock.send_multipart([ident, m.encode(m.Ok(999_999, 0))])
        sock.close(linger=0)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        rc, _, err = run(capsys, "--socket", path, "--timeout", "1", "status")
        took = time.monotonic() - t0
    finally:
        done.set()
        t.join(5)
    assert rc == 3 and "not answering" in err and took < 4, (rc, err, took)


@pytest.mark.parametrize("make", [
    lambda d: (d / "file").write_text("") or str(d / "file" / "kvd.sock"),  # ENOTDIR
    lambda d: os.symlink("loop", d / "loop") or str(d / "loop"),  # ELOOP
    lambda d: str(d / ("x" * 300)),  # ENAMETOOLONG
])
def test_a_socket_path_that_cannot_be_one_is_one_line_and_exit_3(tmp_path, capsys, make):
    rc, out, err = run(capsys, "--socket", make(tmp_path), "health")
    text = (out + err).strip()
    assert rc == 3 and "Traceback" not in text and len(text.splitlines()) == 1, text


def test_a_socket_path_longer_than_a_socket_name_is_one_line_and_exit_3(tmp_path, capsys):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    path = str(deep / "kvd.sock")
    cwd = os.getcwd()
    os.chdir(deep)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind("kvd.sock")  # (bound by a relative name: the full one is too long)
            s.listen()
            rc, out, err = run(capsys, "--socket", path, "--timeout", "1", "status")
    finally:
        os.chdir(cwd)
    text = (out + err).strip()
    assert rc == 3 and "Traceback" not in text and len(text.splitlines()) == 1, text


def test_a_reader_that_leaves_early_is_no_traceback(daemon):
    """`kvdctl status --json | head -c1`, the reader gone before the output: a
    BrokenPipeError traceback, exit 1."""
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails with EPIPE
    try:
        got = subprocess.run([sys.executable, "-m", "kvd.cli.ctl", "--socket", daemon.socket,
                              "status", "--json"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    finally:
        os.close(write)
    assert got.returncode == 0 and got.stderr == "", got.stderr
