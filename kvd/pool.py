"""The pool: one shared-memory file mapped by the daemon.

Copies address it by absolute pointer (``base``), so it is mapped once for the life
of the daemon. Its memory is reserved (fallocate): a full /dev/shm is an error at start,
not a SIGBUS later. Pages are faulted in up front (MADV_POPULATE_WRITE, falling back to
a same-value write per page, which keeps a persisted pool's bytes) so the first stores
do not pay for page faults; mlock is optional.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import resource
import stat

import numpy as np

from kvd.errors import ConfigError
from kvd.inode import identity

log = logging.getLogger("kvd.pool")
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)


def touch_pages(array: np.ndarray) -> None:
    """Write-fault every page of ``array`` without changing a byte (``|= 0``): a kept
    pool (warm restart) holds data, so the fallback prefault must not zero it."""
    view = array[:: mmap.PAGESIZE]
    np.bitwise_or(view, 0, out=view)


def _reserve(fd: int, path: str, size: int) -> bool:
    """Give the pool its memory now (False: its filesystem cannot). A shared-memory file
    is sparse: a page its filesystem has no room for (a container's 64 MiB /dev/shm)
    would kill the daemon with SIGBUS at the first copy into it, or at the prefault."""
    try:
        os.posix_fallocate(fd, 0, size)
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            log.warning("pool file %s: its filesystem cannot reserve space (%s); a full "
                        "filesystem will stop the daemon with SIGBUS", path, e.strerror)
            return False
        free = os.statvfs(path)
        raise ConfigError(
            f"cannot reserve {size >> 20} MiB for pool file {path}: {e.strerror} "
            f"({free.f_bavail * free.f_frsize >> 20} MiB free there; lower pool_size or "
            "give the filesystem more room, e.g. a container's --shm-size)") from None


TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
RAMFS_MAGIC = 0x858458F6


def _on(fd: int, *magics: int) -> bool:
    """Whether the file is in a filesystem of one of these types."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first (a long, or an
    if _libc.fstatfs(fd, buf) != 0:  # unsigned int on s390x)
        return False
    kind = {ctypes.c_long.from_buffer(buf).value, ctypes.c_uint.from_buffer(buf).value}
    return not kind.isdisjoint(magics)


def _on_tmpfs(fd: int) -> bool:
    """Whether the file is in a tmpfs (/dev/shm), where a reserved file's block count is
    its size for as long as nobody frees its pages (a compressing filesystem's is not)."""
    return _on(fd, TMPFS_MAGIC)


def _open(path: str) -> tuple[int, str]:
    """The pool file, and what this start made ('' when it was there: a pool a crash
    or a warm restart left). One already there is taken only if it is a regular file
    of this uid: /dev/null, a FIFO or another user's file are refused untouched, and
    not even opened (a failed start removed what it could not size: it once took
    /dev/null with it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        _mark(fd)
        return fd, path
    except FileExistsError:
        pass
    try:
        st = os.stat(path)
    except FileNotFoundError:  # a link to a file gone (a hugetlbfs after a reboot)
        target = os.path.realpath(path)
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        _mark(fd)
        return fd, target
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
           f"belongs to uid {st.st_uid}" if st.st_uid != os.geteuid() else "")
    if why:
        raise ConfigError(f"pool file {path} {why}: kvd leaves it alone; give pool_path "
                          "a path of its own")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    if identity(os.fstat(fd)) != identity(st):  # replaced between the two calls
        os.close(fd)
        raise ConfigError(f"pool file {path} was replaced while kvd opened it")
    return fd, ""


MARK = "user.kvd.pool"  # on the files kvd makes: a disk file of the pool's size is kvd's


def _mark(fd: int) -> None:
    with contextlib.suppress(OSError):  # (a tmpfs may take no user xattrs: not needed)
        os.setxattr(fd, MARK, b"1")


def _marked(fd: int) -> bool:
    try:
        return os.getxattr(fd, MARK) == b"1"
    except OSError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Pool:
    def __init__(self, path: str, size: int, *, prefault: bool = True, lock: bool = False,
                 keep: bool = False):
        """``keep``: reuse the file's contents (a warm restart) when its size matches."""
        self.path = path
        self.size = size
        self.keep = keep
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd, made = _open(path)
        except OSError as e:
            raise ConfigError(f"cannot open pool file {path}: {e.strerror}") from None
        try:
            # Held for the daemon's life: a second daemon on the same file would empty
            # (or share) the pool under the first one's index and serve wrong bytes.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"pool file {path} is in use by another kvd; give each daemon "
                              "its own pool_path") from None
        self._fd = fd
        self.reused = False
        try:
            found = os.fstat(fd).st_size
            self.reused = keep and found == size
            if (found and not keep and not _marked(fd)
                    and not _on(fd, TMPFS_MAGIC, HUGETLBFS_MAGIC, RAMFS_MAGIC)):
                raise ConfigError(f"pool file {path} holds {found} bytes on a disk "
                                  "filesystem and is no pool kvd made: kvd will not empty "
                                  "it; remove it, or give pool_path another path")
            if not self.reused:
                os.ftruncate(fd, 0)  # stale bytes of another geometry never survive
            os.ftruncate(fd, size)
            self.reserved = _reserve(fd, path, size)
            self._counted = self.reserved and _on_tmpfs(fd)  # (see ``damage``)
            try:
                self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # the file has its room: the address space has not
                raise ConfigError(
                    f"cannot map pool file {path} ({size} bytes): {e.strerror}"
                    + (" (the process's address-space limit, ulimit -v / LimitAS, "
                       "is below what it needs with the pool)" if e.errno == errno.ENOMEM
                       and resource.getrlimit(resource.RLIMIT_AS)[0]
                       != resource.RLIM_INFINITY else "")
                ) from None
        except (OSError, ConfigError) as e:
            if made:  # made by this start, and empty: nothing of anyone's is lost
                _unlink(made)
            os.close(fd)
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"cannot size pool file {path} to {size} bytes: {e.strerror} "
                "(is /dev/shm large enough?)"
            ) from None
        except BaseException:  # e.g. a stop during start-up: ours and empty, so gone
            if made:
                _unlink(made)
            os.close(fd)
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.base = self.array.ctypes.data
        try:
            if prefault:
                self._prefault()
            self.locked = lock and self._mlock()
        except BaseException:  # e.g. a stop during a long prefault: leave nothing
            self.close()
            raise

    def damage(self) -> str:
        """Why the file may no longer hold what was copied into it ('' when it does):
        another process cut it (the daemon's own reads past its end are SIGBUS, the copy
        calls' EFAULT), or punched a hole in it or cut it and grew it again (its pages
        read as zeros). Reserved in a tmpfs, the file has every page allocated, so a
        lost page shows in its block count: one fstat, not a walk of the file."""
        try:
            st = os.fstat(self._fd)
        except OSError:
            return ""
        if st.st_size < self.size:
            return "was cut short"
        if self._counted and st.st_blocks * 512 < self.size:
            return "lost part of its memory (a hole punched in it, or cut and grown again)"
        return ""

    def removed(self) -> bool:
        """Whether the file was unlinked (a clean-up of /dev/shm): its memory serves on,
        but no restart finds it."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return False

    def reserve_again(self) -> str:
        """After ``damage``: the file back to its size, its pages allocated again (their
        bytes zero); why it could not be ('' when it was)."""
        try:
            if os.fstat(self._fd).st_size < self.size:
                os.ftruncate(self._fd, self.size)
            if self.reserved:
                os.posix_fallocate(self._fd, 0, self.size)
        except OSError as e:
            return f"cannot reserve it again: {e.strerror}"
        return ""

    def _unlink_own(self) -> None:
        """Remove the pool's file, not another one the path leads to now (a link
        pointed elsewhere, or a file made there after this one was removed)."""
        try:
            if identity(os.stat(self.path)) == identity(os.fstat(self._fd)):
                _unlink(os.path.realpath(self.path))
        except OSError:
            pass

    def _prefault(self) -> None:
        rc = _libc.madvise(ctypes.c_void_p(self.base), ctypes.c_size_t(self.size),
                           MADV_POPULATE_WRITE)
        if rc != 0:  # kernels before 5.14: touch every page instead
            touch_pages(self.array)

    def _mlock(self) -> bool:
        if _libc.mlock(ctypes.c_void_p(self.base), ctypes.c_size_t(self.size)) == 0:
            return True
        log.warning("pool not locked in RAM: mlock failed (%s); raise LimitMEMLOCK",
                    os.strerror(ctypes.get_errno()))
        return False

    def close(self, unlink: bool | None = None, mapping: bool = True) -> None:
        """Unmap (without ``mapping``: left to the process's exit, for copies that may
        still run into it), then remove the file unless it is kept."""
        self.array = None  # type: ignore[assignment]
        try:
            if mapping:
                self._mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process
        if unlink is None:
            unlink = not self.keep
        if unlink:  # the file itself (pool_path may be a link to it, kept), if the
            self._unlink_own()  # path still leads to it
        if self._fd >= 0:  # after the unlink: a daemon that locks the path next is not
            os.close(self._fd)  # the one whose file goes
            self._fd = -1
