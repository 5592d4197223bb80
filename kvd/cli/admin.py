"""kvdctl's connection to the daemon: synchronous, one request at a time, and precise
about *why* a request failed.

Why not ``kvd_client.Connection``: that one is built for engines, so it fails open
(a refused handshake just looks "down" and is retried in the background). An operator
needs the opposite: tell "nothing is listening" (exit 3) from "you may not" (exit 1)
from "kvd said no" (exit 1), in words that say what to do.

    AdminError            exit code in ``.exit_code``
    ├── Unreachable       3: no socket, nothing answering, or no answer in time
    ├── Refused           1: socket permissions or FORBIDDEN
    ├── Failed            1: any other error reply (``.code``)
    └── NotKvd            1: the peer answers, but not as kvd does
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from typing import Any

import msgspec
import zmq

from kvd_proto import messages as m

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3


class AdminError(Exception):
    exit_code = EXIT_FAIL


class Unreachable(AdminError):
    exit_code = EXIT_DOWN


class Refused(AdminError):
    pass


class Failed(AdminError):
    def __init__(self, code: m.Code, message: str) -> None:
        super().__init__(f"kvd refused the request: {m.Code(code).name}: {message}")
        self.code = m.Code(code)


class NotKvd(AdminError):
    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"the socket at {path} does not answer as kvd does ({why}): "
                         "another service, or a kvd of another version?")


# What each admin request is answered with (an Error aside).
_REPLIES: dict[type, type] = {m.Hello: m.HelloOk, m.Stats: m.StatsOk,
                              m.GetConfig: m.ConfigOk, m.Evict: m.Ok, m.Flush: m.Ok,
                              m.Reload: m.Reloaded}


def check_socket(path: str) -> None:
    """Fail fast with a useful message before ZeroMQ silently retries forever."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise Unreachable(f"kvd is not running: no socket at {path} "
                          "(start it with `systemctl start kvd`, or pass --socket)") from None
    except PermissionError:
        raise Refused(f"permission denied reaching {path}: the directory is not "
                      "accessible to you (join the kvd group)") from None
    except OSError as e:  # a file as a directory, a symlink loop, a name too long
        raise Unreachable(f"cannot reach a socket at {path}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise Unreachable(f"{path} is not a socket")
    if not os.access(path, os.R_OK | os.W_OK):
        raise Refused(f"permission denied on {path}: connecting needs write access "
                      "(join the socket's group, usually kvd, or run as root)")


class AdminClient:
    """A DEALER socket that has said Hello; ``request`` returns the reply or raises."""

    def __init__(self, path: str, timeout: float = 3.0, name: str = "kvdctl") -> None:
        self.path = path
        self.timeout = timeout
        self.patience = 0.0  # for ``request``'s reply: see ``_roundtrip``
        self.name = name
        self._req = 0
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self.daemon_pid = 0

    def _open(self) -> None:
        check_socket(self.path)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        try:
            self._sock.connect(f"ipc://{self.path}")
        except zmq.ZMQError as e:  # (a path longer than a unix socket's name can be)
            raise Unreachable(f"cannot connect to {self.path}: {e}") from None
        hello = self._roundtrip(m.Hello(self._next(), m.PROTOCOL_VERSION, os.getpid(),
                                        self.name))
        assert isinstance(hello, m.HelloOk)
        if hello.version != m.PROTOCOL_VERSION:
            raise NotKvd(self.path, f"it speaks protocol {hello.version}, this kvdctl "
                                    f"{m.PROTOCOL_VERSION}")
        self.daemon_pid = hello.daemon_pid

    def connect(self) -> None:
        """Say Hello now (``request`` does it on first use)."""
        if self._sock is None:
            self._open()

    def _next(self) -> int:
        self._req += 1
        return self._req

    def _roundtrip(self, msg: m.Request, patience: float = 0.0) -> m.Reply:
        """The reply to ``msg``, within ``timeout``; or within ``patience`` in all while
        kvd answers a Ping within ``timeout`` each time the wait reaches that."""
        sock = self._sock
        assert sock is not None
        sock.send(m.encode(msg))
        start = time.monotonic()
        deadline = start + self.timeout  # for the reply, whatever else comes
        last = start + max(self.timeout, patience)
        ping = 0  # a Ping asked while the reply takes long: is kvd still there?
        alive = False  # a Ping was answered: only the reply is late
        what = type(msg).__name__
        while True:
            if not sock.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))):
                if deadline < last and not ping:
                    ping = self._next()
                    sock.send(m.encode(m.Ping(ping)))
                    deadline = min(last, time.monotonic() + self.timeout)
                    continue
                if alive and not ping:
                    raise Unreachable(f"kvd on {self.path} is alive but did not answer "
                                      f"{what} in {patience:g}s")
                raise Unreachable(f"kvd is not answering on {self.path} "
                                  f"(no reply in {self.timeout:g}s; stale socket or "
                                  "hung daemon? see `systemctl status kvd`)")
            try:
                reply = m.decode_reply(sock.recv())
            except msgspec.DecodeError as e:
                raise NotKvd(self.path, f"undecodable reply: {e}") from None
            if ping and reply.req == ping:
                if isinstance(reply, m.Error):  # (NOT_REGISTERED: another kvd run)
                    raise Unreachable(f"kvd on {self.path} forgot this client while "
                                      f"{what} was under way (restarted?): its outcome "
                                      f"is unknown ({reply.message})")
                ping, alive = 0, True
                deadline = min(last, time.monotonic() + self.timeout)
                continue
            if reply.req != msg.req:
                continue  # a late answer to an earlier request
            if isinstance(reply, m.Error):
                if reply.code == m.Code.FORBIDDEN:
                    raise Refused(f"access refused by kvd: {reply.message}")
                raise Failed(reply.code, reply.message)
            want = _REPLIES.get(type(msg))
            if want is not None and not isinstance(reply, want):
                raise NotKvd(self.path, f"{type(msg).__name__} answered with "
                                        f"{type(reply).__name__}")
            return reply

    def request(self, make: type[m.Request] | object, *args: object) -> m.Reply:
        """``request(m.Evict, 3)`` -> the reply to ``Evict(req, 3)``. Reconnects once
        when the daemon forgot this client (it restarted, e.g. during ``top``)."""
        for attempt in (0, 1):
            if self._sock is None:
                self._open()
            try:
                return self._roundtrip(make(self._next(), *args),  # type: ignore[operator]
                                       self.patience)
            except Failed as e:
                if e.code != m.Code.NOT_REGISTERED or attempt:
                    raise
                self.close()
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_status(client: AdminClient) -> dict[str, Any]:
    """The daemon's status document (what ``kvdctl status --json`` prints)."""
    reply = client.request(m.Stats)
    assert isinstance(reply, m.StatsOk)
    doc = document(client, reply.status)
    missing = {"pool", "counters", "blocks", "clients", "tenants"} - doc.keys()
    if missing:
        raise NotKvd(client.path, f"its status lacks {', '.join(sorted(missing))}")
    return doc


def document(client: AdminClient, blob: bytes | str) -> dict[str, Any]:
    """A JSON object from a reply, or NotKvd."""
    try:
        doc = json.loads(blob)
    except ValueError as e:
        raise NotKvd(client.path, f"a reply that is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise NotKvd(client.path, "a reply that is not a JSON object")
    return doc
