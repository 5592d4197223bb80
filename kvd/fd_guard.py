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
import resource
import stat

log = logging.getLogger("kvd.server")

MIN_LIMIT = 64  # below, no headroom is worth keeping (the start warns of the limit)


EXACT_EVERY = 8  # ticks between exact counts while fewer than half are in use


def lowest_free_fd(limit: int) -> int:
    """The lowest free descriptor: every one below it is in use (the kernel hands out
    the lowest), so at least that many are (a lower bound: closed ones leave holes);
    ``limit`` when none is free."""
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return limit
        raise
    os.close(fd)
    return fd


def fds_in_use(limit: int) -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError:
        return limit


class FdGuard:
    """Hides the socket at ``path`` (bound as ``bound``: device, inode) while
    descriptors run short; ``hidden`` tells the socket's own re-binding to wait."""

    def __init__(self, path: str) -> None:
        self.path = path
        head, self._name = os.path.split(path)
        self._dir = head or "."
        self.hidden_path = os.path.join(self._dir, f".{self._name}.{os.getpid()}.full")
        self.hidden = False
        self._ticks = 0
        self._said = ""  # the last hiding failure logged (each reason once)

    @staticmethod
    def marks() -> tuple[int, int, int] | None:
        """(limit, hide at, show again below) descriptors; None when too few to guard."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY or limit < MIN_LIMIT:
            return None
        headroom = max(limit // 8, 16)
        return limit, limit - headroom, limit - 2 * headroom

    def check(self, bound: tuple[int, int] | None, tick: bool = False) -> None:
        """At each Hello (a cheap lower bound) and each tick (an exact count, every
        ``EXACT_EVERY`` ticks while well below the limit: it lists every descriptor).
        Never raises: the guard must not stop the housekeeping or a Hello."""
        try:
            self._check(bound, tick)
        except Exception:  # noqa: BLE001
            log.exception("descriptor guard failed")

    def _check(self, bound: tuple[int, int] | None, tick: bool) -> None:
        marks = self.marks()
        if bound is None or marks is None:
            return
        limit, high, low = marks
        if self.hidden:  # holes below make the cheap probe read low: count exactly
            if tick and (used := fds_in_use(limit)) < low:
                self._show(bound, used, limit)
            return
        used = lowest_free_fd(limit)
        if used < high and tick:
            self._ticks += 1
            if self._ticks >= EXACT_EVERY or used >= limit // 2:
                self._ticks = 0
                used = fds_in_use(limit)
        if used >= high:
            self._hide(bound, used, limit, low)

    def _hide(self, bound: tuple[int, int], used: int, limit: int, low: int) -> None:
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) != bound:  # not this daemon's socket any more
                return
            os.rename(self.path, self.hidden_path)
        except FileNotFoundError:  # removed: the tick binds it again (then hides it)
            return
        except OSError as e:
            if e.strerror != self._said:
                log.error("%d of %d descriptors in use, and the socket %s cannot be "
                          "hidden (%s): a connection finding none left would end the "
                          "daemon", used, limit, self.path, e.strerror)
            self._said = e.strerror or ""
            return
        self.hidden, self._said = True, ""
        log.error("%d of %d descriptors in use: the socket %s is hidden until fewer than "
                  "%d are (new clients run without kvd; connected ones go on). Raise "
                  "LimitNOFILE, or find who holds the connections: kvdctl --socket %s "
                  "clients", used, limit, self.path, low, self.hidden_path)

    def _show(self, bound: tuple[int, int], used: int, limit: int) -> None:
        try:
            st = os.stat(self.hidden_path)
            if (st.st_dev, st.st_ino) != bound:  # not ours: nothing to show; bound again
                raise FileNotFoundError
            os.link(self.hidden_path, self.path)
        except FileExistsError:  # a file there since (another daemon's socket): left
            log.error("the socket %s was taken while hidden: this daemon keeps its "
                      "connected clients only", self.path)
        except FileNotFoundError:  # the hidden name removed: the tick binds it again
            pass
        except OSError as e:
            log.error("cannot show the socket %s again: %s", self.path, e.strerror)
            return
        else:
            log.warning("%d of %d descriptors in use: the socket %s accepts clients "
                        "again", used, limit, self.path)
        self.unlink_hidden(bound)
        self.hidden = False

    def unlink_hidden(self, bound: tuple[int, int] | None) -> None:
        try:
            st = os.stat(self.hidden_path)
            if (st.st_dev, st.st_ino) == bound:
                os.unlink(self.hidden_path)
        except OSError:
            pass

    def sweep(self) -> None:
        """Hidden names a daemon killed while hiding left (their pid is gone)."""
        prefix, uid = f".{self._name}.", os.getuid()
        try:
            names = [n for n in os.listdir(self._dir)
                     if n.startswith(prefix) and n.endswith(".full")]
        except OSError:
            return
        for name in names:
            pid = name[len(prefix):-len(".full")]
            path = os.path.join(self._dir, name)
            try:
                st = os.lstat(path)
                if not (pid.isdigit() and stat.S_ISSOCK(st.st_mode) and st.st_uid == uid):
                    continue
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError:
                continue
