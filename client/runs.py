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
