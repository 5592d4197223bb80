"""The daemon's socket file: bound with its permissions, bound again if removed while
serving, and removed at the stop only while it is still this daemon's.

Owns the file's identity (``bound``) and the descriptor guard that hides the file while
descriptors run short (kvd/fd_guard.py).
"""

from __future__ import annotations

import logging
import os
import stat

import zmq

from kvd.config import Config
from kvd.errors import ConfigError
from kvd.fd_guard import FdGuard, listening
from kvd.inode import Identity, identity, unlink_if

log = logging.getLogger("kvd.server")


class SocketFile:
    def __init__(self, config: Config) -> None:
        self.path = config.socket
        self.mode = config.socket_mode
        self.group = config.socket_group
        self.bound: Identity | None = None  # the socket file this daemon bound
        self._rebind_error = ""  # why the removed socket could not be bound again
        self.fd_guard = FdGuard(config.socket)  # hides it while descriptors run short

    def guard(self, tick: bool = False) -> None:
        """One descriptor more may be in use (a connection): hide the file if near the
        limit, show it again once there is room (see ``FdGuard.check``)."""
        self.fd_guard.check(self.bound, tick=tick)

    def unlink(self) -> None:
        """Remove the socket file this daemon bound, and only it: once the path was
        removed and another daemon bound it, that one's clients must still find it."""
        unlink_if(self.path, self.bound)
        self.fd_guard.unlink_hidden(self.bound)

    def check(self, sock: zmq.Socket) -> None:
        """The socket file removed while serving (a cleanup of the directory, a careless
        rm): clients connected go on, but a restarted engine or kvdctl finds nothing
        and runs without kvd. Bound again, as a removed journal is written again; a
        path another daemon has bound since is left to it. The old listener keeps its
        descriptor (one per removal): unbinding it would drop the connected clients."""
        if self.bound is None or self.fd_guard.hidden or os.path.lexists(self.path):
            self._rebind_error = ""
            return
        try:
            self.bind(sock)
        except (ConfigError, OSError) as e:
            if str(e) != self._rebind_error:
                log.error("socket %s was removed and cannot be bound again: %s",
                          self.path, e)
            self._rebind_error = str(e)
            return
        self._rebind_error = ""
        self.fd_guard.recount()  # bound with no count: the next tick counts
        log.warning("socket %s was removed while serving: bound again (clients "
                    "connected before were not affected)", self.path)

    def bind(self, sock: zmq.Socket) -> None:
        path = self.path
        directory = os.path.dirname(path) or "."
        try:
            os.makedirs(directory, mode=0o770, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the socket's directory {directory}: "
                              f"{e.strerror}") from None
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigError(f"{path} exists and is not a socket")
            # Asked again: another kvd may have bound it while this one made its pool.
            if listening(path):
                raise ConfigError(f"another kvd is listening at {path} (it started while "
                                  "this one prepared its pool); stop it or give this one "
                                  "another socket")
            os.unlink(path)  # a stale socket of a dead daemon
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot bind {path}: {e}") from None
        self.bound = identity(os.stat(path))
        os.chmod(path, self.mode)
        if self.group:
            import grp

            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group: no group {self.group!r}") from None
            os.chown(path, -1, gid)
            os.chown(directory, -1, gid)
        self.fd_guard.sweep()  # names a daemon killed while hiding its socket left
