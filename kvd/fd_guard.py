"""Descriptors running out: the socket is hidden before ZeroMQ's accept finds none left.

ZeroMQ aborts the process when an accept on its ipc listener fails with EMFILE (it
takes that for a bug, not a condition), and each client connection holds a descriptor:
connections alone (many engines, a client that leaks them, a local flood) could end the
daemon, and every engine's cache with it. Near the limit the socket file is renamed
away: a new client finds no socket and runs without kvd, as when kvd is down (ZeroMQ
clients connect by themselves once it is back), while the connected ones go on. Once
enough descriptors are free again, the file gets its name back, the same listener
behind it.

Checked at each tick and at each Hello (a client that connects says Hello first); a
flood of connections that never say Hello, faster than a tick, can still outrun it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import resource
import socket
import stat

from kvd.inode import Identity, identity, identity_of, unlink_if

log = logging.getLogger("kvd.server")

MIN_LIMIT = 64  # below, no headroom is worth keeping (the start warns of the limit)
EXACT_EVERY = 4  # ticks between exact counts (a listing of every descriptor: ~9 ms at
# 15,000) while the cheap probe reads below the show mark, and while hidden
_HIDDEN = re.compile(r"([0-9]{1,20})-([0-9]{1,10})")  # pid namespace, pid


def lowest_free_fd(limit: int) -> int:
    """The lowest free descriptor: every one below it is in use (the kernel hands out
    the lowest), so at least that many are (a lower bound: closed ones leave holes);
    ``limit`` when none is free, 0 when it cannot tell."""
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return limit if e.errno in (errno.EMFILE, errno.ENFILE) else 0
    os.close(fd)
    return fd


def fds_in_use(limit: int) -> int:
    """Exactly; the cheap lower bound where /proc cannot be listed (a sandbox)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return limit
        return lowest_free_fd(limit)


def listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except (BlockingIOError, TimeoutError):  # a full backlog (EAGAIN), or slow: someone's
        return True
    except OSError:  # refused (stale), gone, no socket on that path: free to take
        return False
    finally:
        probe.close()


def _pid_namespace() -> int:
    """Names of hidden sockets carry it: a pid is only known alive in its namespace
    (two containers sharing the socket's directory, both daemons pid 1)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class FdGuard:
    """Hides the socket at ``path`` (bound as ``bound``: device, inode) while
    descriptors run short; ``hidden`` tells the socket's own re-binding to wait."""

    def __init__(self, path: str) -> None:
        self.path = path
        head, self._name = os.path.split(path)
        self._dir = head or "."
        self._ns = _pid_namespace()
        self.hidden_path = os.path.join(self._dir,
                                        f".{self._name}.{self._ns}-{os.getpid()}.full")
        self.hidden = False
        self._ticks = 0
        self._said = ""  # the last failure logged (each reason once)

    @staticmethod
    def marks() -> tuple[int, int, int] | None:
        """(limit, hide at, show again below) descriptors; None when too few to guard."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY or limit < MIN_LIMIT:
            return None
        headroom = max(limit // 8, 16)
        return limit, limit - headroom, limit - 2 * headroom

    def check(self, bound: Identity | None, tick: bool = False) -> None:
        """At each Hello (a cheap lower bound) and each tick (an exact count every
        ``EXACT_EVERY`` ticks, and every tick once the probe reads past the show mark).
        Never raises: the guard must not stop the housekeeping or a Hello."""
        try:
            self._check(bound, tick)
        except Exception:  # noqa: BLE001
            log.exception("descriptor guard failed")

    def _check(self, bound: Identity | None, tick: bool) -> None:
        if bound is None:
            return
        marks = self.marks()
        if marks is None:  # a limit lowered below any headroom: no guard, so shown
            if self.hidden and tick:
                limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                self._show(bound, fds_in_use(limit), limit)
            return
        limit, high, low = marks
        if self.hidden:  # holes below make the cheap probe read low: count exactly
            if tick:
                self._ticks += 1
                if self._ticks >= EXACT_EVERY:
                    self._ticks = 0
                    if (used := fds_in_use(limit)) < low:
                        self._show(bound, used, limit)
            return
        used = lowest_free_fd(limit)
        if used < high and tick:
            self._ticks += 1
            if self._ticks >= EXACT_EVERY or used >= low:
                self._ticks = 0
                used = fds_in_use(limit)
        if used >= high:
            self._hide(bound, used, limit, low)

    def recount(self) -> None:
        """Count exactly at the next tick (a socket was bound again meanwhile)."""
        self._ticks = EXACT_EVERY

    def _say(self, why: str, message: str, *args: object) -> None:
        if why != self._said:
            log.error(message, *args)
        self._said = why

    def _hide(self, bound: Identity, used: int, limit: int, low: int) -> None:
        try:
            ident = identity_of(self.path)
            if ident == bound:
                os.rename(self.path, self.hidden_path)
        except FileNotFoundError:
            ident = None
        except OSError as e:
            self._say(f"hide: {e.strerror}", "%d of %d descriptors in use, and the socket "
                      "%s cannot be hidden (%s): a connection finding none left would end "
                      "the daemon", used, limit, self.path, e.strerror)
            return
        if ident is None:  # removed: the tick binds it again (then hides it)
            self.recount()
            return
        if ident != bound:  # not this daemon's socket any more
            return
        self.hidden, self._said, self._ticks = True, "", 0
        log.error("%d of %d descriptors in use: the socket %s is hidden until fewer than "
                  "%d are (new clients run without kvd; connected ones go on). Raise "
                  "LimitNOFILE, or find who holds the connections: kvdctl --socket %s "
                  "clients", used, limit, self.path, low, self.hidden_path)

    def _show(self, bound: Identity, used: int, limit: int,
              retake: bool = True) -> None:
        try:
            if identity_of(self.hidden_path) != bound:  # not ours: nothing to show; bound
                raise FileNotFoundError  # again
            os.link(self.hidden_path, self.path)
        except FileExistsError:
            try:
                st = os.stat(self.path)
                ours = identity(st) == bound  # linked back by hand: shown
                stale = not ours and stat.S_ISSOCK(st.st_mode) and not listening(self.path)
            except OSError:
                ours = stale = False
            if stale and retake:  # nobody listens (a daemon that died there): ours again
                try:
                    unlink_if(self.path, identity(st))  # the one probed, not a new one
                except OSError as e:
                    self._say(f"show: stale {e.strerror}", "cannot remove the stale socket "
                              "%s: %s", self.path, e.strerror)
                    return
                return self._show(bound, used, limit, retake=False)
            if not ours:  # another file (another daemon's socket): stay where we are
                self._say("show: taken", "the socket %s was taken while hidden: this "
                          "daemon is reachable at %s only", self.path, self.hidden_path)
                return
        except FileNotFoundError:  # the hidden name removed: the tick binds it again
            pass
        except OSError as e:
            self._say(f"show: {e.strerror}", "cannot show the socket %s again: %s",
                      self.path, e.strerror)
            return
        else:
            log.warning("%d of %d descriptors in use: the socket %s accepts clients "
                        "again", used, limit, self.path)
        self.unlink_hidden(bound)
        self.hidden, self._said = False, ""

    def unlink_hidden(self, bound: Identity | None) -> None:
        with contextlib.suppress(OSError):
            unlink_if(self.hidden_path, bound)

    def sweep(self) -> None:
        """Hidden names that daemons of this pid namespace, killed while hiding, left
        (their pid is gone); other namespaces' are theirs to sweep."""
        prefix, uid = f".{self._name}.", os.getuid()
        try:
            names = [n for n in os.listdir(self._dir)
                     if n.startswith(prefix) and n.endswith(".full")]
        except OSError:
            return
        for name in names:
            m = _HIDDEN.fullmatch(name[len(prefix):-len(".full")])
            if m is None or int(m.group(1)) != self._ns or not self._ns:
                continue
            path = os.path.join(self._dir, name)
            try:
                st = os.lstat(path)
                if not (stat.S_ISSOCK(st.st_mode) and st.st_uid == uid):
                    continue
                os.kill(int(m.group(2)), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except (OSError, ValueError, OverflowError):
                continue
