"""Batched ``preadv``/``pwritev`` over a file of slots: a batch of blocks costs a
syscall per run of adjacent slots, not one per block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

PAGE = 4096
IOV_MAX = 1024  # iovecs per preadv/pwritev (Linux's UIO_MAXIOV)
PER_CALL = IOV_MAX // 3  # a block takes a header, its payload and its padding
MAX_CALL_BYTES = 1 << 30  # Linux moves at most ~2 GiB per call
_ZEROS = memoryview(bytes(PAGE))  # padding to a slot's end: under a page, mostly


def pad(n: int, into: memoryview = _ZEROS) -> list[Any]:
    """The buffer that fills a slot after its payload (none when it ends exactly)."""
    return [] if not n else [into[:n] if n <= len(into) else bytearray(n)]


def vectored(call: Callable[[int, list[Any], int], int], fd: int, iovs: list[list[Any]],
             offsets: np.ndarray, sizes: np.ndarray, isolate_errors: bool = False
             ) -> list[bool]:
    """``preadv``/``pwritev`` of each slot's buffers (``iovs[i]``, ``sizes[i]`` bytes at
    ``offsets[i]``), adjacent slots in one call: a batch costs a syscall per run of the
    file, not per block. Returns which slots were moved whole; a short call stops. With
    ``isolate_errors`` a failed or short call is tried again a slot at a time, so only
    the slots that fail alone (a bad sector) are left out, and the rest go on."""
    order = np.argsort(offsets, kind="stable")
    o, s = offsets[order], sizes[order]
    follows = np.append(o[1:] == o[:-1] + s[:-1], False).tolist()  # n+1 right after n
    size, at = s.tolist(), sizes.tolist()
    done = [False] * len(iovs)
    run: list[int] = []
    nbytes = 0
    for n, i in enumerate(order.tolist()):
        run.append(i)
        nbytes += size[n]
        if follows[n] and len(run) < PER_CALL and nbytes + size[n + 1] <= MAX_CALL_BYTES:
            continue
        if not _move(call, fd, iovs, offsets, at, run, done, isolate_errors):
            if not isolate_errors:
                return done
            for k in run:
                if not done[k]:
                    _move(call, fd, iovs, offsets, at, [k], done, True)
        run, nbytes = [], 0
    return done


def _move(call: Callable[[int, list[Any], int], int], fd: int, iovs: list[list[Any]],
          offsets: np.ndarray, at: list[int], run: list[int], done: list[bool],
          tolerant: bool) -> bool:
    """One call for a run of adjacent slots, marking those moved whole; False when it
    came up short (or, ``tolerant``, failed)."""
    try:
        got = call(fd, [b for k in run for b in iovs[k]], int(offsets[run[0]]))
    except OSError:
        if not tolerant:
            raise
        return False
    for k in run:
        got -= at[k]
        if got < 0:
            return False
        done[k] = True
    return True
