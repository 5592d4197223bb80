"""The transfer-engine interface.

An engine copies between a client's memory and pool slots on its own threads. It never
touches the index: the event loop builds a ``CopyJob`` (address arrays made with numpy),
hands it over, and gets exactly one completion back through ``on_done``.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvd.errors import TransferError
from kvd_proto.messages import EXPIRY_GRACE_NS, Code, Direction, Register


@dataclass(frozen=True, slots=True)
class ChecksumSpec:
    """Where a job's slot shares sit in the pool: ``offsets[i]`` is block i's share,
    ``length`` bytes long. A store hashes them after its copy; a load with ``expected``
    compares them before its copy (0 in ``expected``: nothing recorded, not checked)."""

    offsets: np.ndarray
    length: int
    expected: list[int] | None = None


@dataclass(eq=False)
class CopyJob:
    """One Transfer: ``lengths[i]`` bytes between ``pool[i]`` and ``remote[i]``.

    ``deadline`` (``time.monotonic()`` seconds, i.e. CLOCK_MONOTONIC) is the last moment
    an engine may start a copy for it; ``give_up`` the moment its client may reuse the
    memory (deadline plus the protocol's grace): a store whose copy ends later than that
    read bytes the client may already have overwritten, and must not commit them."""

    client: int
    event: int
    req: int
    direction: Direction
    pid: int
    pool: np.ndarray  # uint64 addresses in the daemon's pool mapping
    remote: np.ndarray  # uint64 addresses in the client (host or device)
    lengths: np.ndarray  # uint64
    slots: np.ndarray  # the pool slots involved (pinned while the job runs)
    cuda_event: int = -1
    deadline: float = math.inf
    checksum: ChecksumSpec | None = None  # store: hash after; load: verify before
    checksums: list[int] | None = None  # set by the engine after a store
    corrupt: list[int] | None = None  # set by ``verify_then``: job indexes of bad blocks
    uid: int = -1  # the client's uid (the kernel's word): host copies check ``pid`` is its

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @property
    def give_up(self) -> float:
        return self.deadline + EXPIRY_GRACE_NS / 1e9


def expired(job: CopyJob, now: float | None = None) -> TransferError | None:
    """The error that ends ``job`` when its deadline passed (checked before every copy)."""
    now = time.monotonic() if now is None else now
    if now <= job.deadline:
        return None
    return TransferError(f"deadline passed {now - job.deadline:.3f}s before a copy could "
                         "start; no copy was started after it (parts copied before it may "
                         "have landed)", Code.EXPIRED)


def late(job: CopyJob, now: float | None = None) -> TransferError | None:
    """After a store's copy: an error when it ended past ``give_up`` (the client may have
    reused its blocks while we read them, so the bytes are not trusted)."""
    now = time.monotonic() if now is None else now
    if job.direction != Direction.STORE or now <= job.give_up:
        return None
    return TransferError(f"store copy ended {now - job.give_up:.3f}s after its client "
                         "could give it up; not committed", Code.EXPIRED)


# How long close() waits for copies still in flight, all steps together: the stop has
# already waited stop_timeout_ms for transfers, and systemd's TimeoutStopSec is 30 s.
STOP_S = 5.0
# on_done(job, error or None, seconds); called on an engine thread: must be thread-safe.
DoneCallback = Callable[[CopyJob, "Exception | None", float], None]


class TransferEngine(ABC):
    """Contract: ``submit`` returns at once; every submitted job completes exactly once
    through ``on_done`` (with an error when it failed or the engine closed); ``close``
    completes queued jobs with an error and waits (``timeout`` in all) for copies in
    flight: False when some may still run, and the pool must then stay mapped (and
    pinned) until the process exits.

    Deadlines: an engine checks ``expired(job)`` right before it starts each copy (each
    system call, each enqueue on a stream, each chunk of a split job) and ends the job
    with that error instead of copying; a store whose last copy ended after
    ``job.give_up`` ends with ``late(job)``. So a client that has waited past
    ``give_up`` may reuse its memory: nothing more is read from or written into it."""

    name: str

    def __init__(self, on_done: DoneCallback) -> None:
        self.on_done = on_done

    def attach(self, client: int, pid: int, reg: Register) -> list[int]:
        """Open a registering client's memory; returns each region's base address
        (what ``CopyJob.remote`` is computed from). Raises KvdError to refuse."""
        return [r.base for r in reg.host_regions]

    def detach(self, client: int) -> None:
        """The client is gone: fail what is queued for it and close what ``attach``
        opened once its copies in flight drained. Called as soon as the client is gone,
        copies in flight or not, and maybe again once they drained (idempotent)."""

    @abstractmethod
    def submit(self, job: CopyJob) -> None: ...

    @abstractmethod
    def close(self, timeout: float = STOP_S) -> bool: ...


def checksums(pool: np.ndarray, offsets: np.ndarray, length: int) -> list[int]:
    """xxh3-64 of ``length`` pool bytes at each offset (one hash call per block: the
    hash itself is the work, there is nothing to vectorize)."""
    h = xxhash.xxh3_64_intdigest
    return [h(pool[o:o + length]) for o in offsets.tolist()]


def verify_then(job: CopyJob, pool: np.ndarray | None) -> Exception | None:
    """Before a load: compare each slot's share with its recorded checksum."""
    spec = job.checksum
    if spec is None or spec.expected is None or pool is None:
        return None
    got = checksums(pool, spec.offsets, spec.length)
    bad = [i for i, (g, e) in enumerate(zip(got, spec.expected)) if e and g != e]
    if not bad:
        return None
    job.corrupt = bad
    return TransferError(f"{len(bad)} of {len(got)} blocks failed their checksum; "
                         "they were dropped from the pool", Code.CHECKSUM)


def checksum_after(job: CopyJob, pool: np.ndarray | None) -> None:
    """After a store: record the checksum of every slot share just written."""
    spec = job.checksum
    if spec is not None and spec.expected is None and pool is not None:
        job.checksums = checksums(pool, spec.offsets, spec.length)
