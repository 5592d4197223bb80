"""Copy runs: address arrays shared by every copy path (the daemon's engines and the
client's own copier), kept out of the wire package, which holds messages and ids only."""

from __future__ import annotations

import numpy as np


def coalesce(
    pool: np.ndarray, remote: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbours that are contiguous on both sides (fewer, larger copies)."""
    if len(lengths) < 2:
        return pool, remote, lengths
    ends_p = pool[:-1] + lengths[:-1]
    ends_r = remote[:-1] + lengths[:-1]
    starts = np.concatenate(([True], (ends_p != pool[1:]) | (ends_r != remote[1:])))
    if starts.all():
        return pool, remote, lengths
    idx = np.flatnonzero(starts)
    return pool[idx], remote[idx], np.add.reduceat(lengths, idx)


def split_long(
    pool: np.ndarray, remote: np.ndarray, lengths: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs longer than ``limit`` bytes into pieces of ``limit`` (the last shorter):
    a copy's deadline is checked per piece, so no single copy call is unbounded."""
    if not len(lengths) or int(lengths.max()) <= limit:
        return pool, remote, lengths
    step = np.uint64(limit)
    pieces = (lengths + step - np.uint64(1)) // step
    counts = pieces.astype(np.int64)
    idx = np.repeat(np.arange(len(lengths)), counts)
    first = np.cumsum(pieces) - pieces  # each run's first piece
    off = (np.arange(len(idx), dtype=np.uint64) - np.repeat(first, counts)) * step
    return pool[idx] + off, remote[idx] + off, np.minimum(lengths[idx] - off, step)
