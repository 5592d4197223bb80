"""The disk tier's two files: opening and locking them, reserving the slot file's space,
and giving back what a start that failed took."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import NamedTuple

from kvd.errors import ConfigError
from kvd.journal import Journal

DATA_FILE = "kvd-disk.slots"
JOURNAL_FILE = "kvd-disk.journal"


class Opened(NamedTuple):
    fd: int  # the slot file, locked
    journal: Journal
    reused: bool  # the slot file already had the configured size
    existed: tuple[bool, bool]  # the slot file, the journal, before this start


def open_files(path: str, size: int) -> Opened:
    """Open (or create) the slot file under an exclusive lock (one daemon per file), and
    the journal beside it."""
    data = os.path.join(path, DATA_FILE)
    existed = os.path.exists(data), os.path.exists(os.path.join(path, JOURNAL_FILE))
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(data, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ConfigError(f"disk tier: cannot {'open' if existed[0] else 'create'} "
                          f"{data}: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        reused = os.fstat(fd).st_size == size
        journal = Journal(os.path.join(path, JOURNAL_FILE))
    except OSError as e:
        os.close(fd)
        busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        raise ConfigError(f"disk tier: {data} is in use by another process" if busy
                          else f"disk tier: cannot open {e.filename or data}: "
                          f"{e.strerror or e}") from None
    return Opened(fd, journal, reused, existed)


def reopen_data(path: str, size: int) -> int:
    """A new slot file in place of one removed while open, locked and reserved as at a
    start. Only where no file is: one there now is another daemon's (running, or
    stopped), and is left alone. ``OSError`` (EEXIST then; ENOSPC...) when not made."""
    os.makedirs(path, exist_ok=True)  # the whole directory may have gone
    data = os.path.join(path, DATA_FILE)
    try:
        fd = os.open(data, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise OSError(errno.EEXIST, "another file has taken its path (another daemon's?)",
                      data) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (taken between the two calls: not ours to remove)
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, size)
        _allocate(fd, size)
    except OSError:
        with contextlib.suppress(OSError):  # made here, empty: the next try makes it
            os.unlink(data)  # again (unlinked while locked: nobody else's file goes)
        os.close(fd)
        raise
    return fd


def _allocate(fd: int, size: int) -> None:
    """Allocate the whole file; filesystems without fallocate keep it sparse."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def reserve(fd: int, size: int, path: str) -> None:
    """Allocate the whole file now: a disk without room for it refuses the start, not a
    write hours later."""
    try:
        _allocate(fd, size)
    except OSError as e:
        raise ConfigError(f"disk tier: cannot reserve {size} bytes in "
                          f"{path}: {e.strerror}") from None


def undo_open(opened: Opened, path: str) -> None:
    """A start that failed gives back what it took: a reservation that failed part way
    keeps what it got (tens of GB on a nearly full disk), and files it made."""
    if not opened.reused:  # held nothing of value: the restore emptied it
        try:
            os.ftruncate(opened.fd, 0)
        except OSError:
            pass
    opened.journal.close()
    os.close(opened.fd)
    for made, name in zip(opened.existed, (DATA_FILE, JOURNAL_FILE)):
        if not made:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass


def sync_dir(path: str) -> None:
    """Make a rename in ``path`` survive a reboot."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
