"""A file's identity (device, inode), and removals that take only the file meant.

The socket and pool paths are names another process may reuse at any moment (a second
daemon binding a removed socket's path, an operator's cleanup, a link pointed
elsewhere): kvd renames or removes a file only while the path still leads to the one it
made, checked by identity first.
"""

from __future__ import annotations

import os

Identity = tuple[int, int]


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino


def identity_of(path: str) -> Identity | None:
    """The identity of the file ``path`` leads to, None when it leads to none."""
    try:
        return identity(os.stat(path))
    except FileNotFoundError:
        return None


def unlink_if(path: str, ident: Identity | None) -> bool:
    """Remove ``path`` if it still leads to ``ident``; whether it did. Errors other than
    the path being gone are raised (the caller says what could not be removed)."""
    if ident is None or identity_of(path) != ident:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
