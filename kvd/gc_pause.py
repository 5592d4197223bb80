"""The cyclic garbage collector held off during a start's bulk work.

A full collection reads every tracked object. While a start restores a million blocks,
the objects it makes set off one full collection after another: about half of a
1M-block ``--persist`` start (22 s; 11 s with the collector off). Reference counting
frees garbage as ever; only cycles wait. One full pass at the end (before serving) then
leaves the next one far off: it comes once the tracked objects grow by a quarter.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
            gc.collect()
