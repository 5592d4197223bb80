"""The transfer-engine interface.

An engine copies between a client's memory and pool slots on its own threads. It never
touches the index: the event loop builds a ``CopyJob`` (address arrays made with numpy),
hands it over, and gets exactly one completion back through ``on_done``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvd.errors import TransferError
from kvd_proto.messages import Code, Direction, Register


@dataclass(eq=False)
class CopyJob:
    """One Transfer: ``lengths[i]`` bytes between ``pool[i]`` and ``remote[i]``."""

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
    context: dict = field(default_factory=dict)  # engine-private (e.g. device, streams)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


# on_done(job, error or None, seconds); called on an engine thread: must be thread-safe.
DoneCallback = Callable[[CopyJob, "Exception | None", float], None]


class TransferEngine(ABC):
    """Contract: ``submit`` returns at once; every submitted job completes exactly once
    through ``on_done`` (with an error when it failed or the engine closed); ``close``
    waits for in-flight copies and completes queued ones with an error."""

    name: str

    def __init__(self, on_done: DoneCallback) -> None:
        self.on_done = on_done

    def attach(self, client: int, pid: int, reg: Register) -> list[int]:
        """Open a registering client's memory; returns each region's base address
        (what ``CopyJob.remote`` is computed from). Raises KvdError to refuse."""
        return [r.base for r in reg.host_regions]

    def detach(self, client: int) -> None:
        """The client is gone and its copies drained: close what ``attach`` opened."""

    @abstractmethod
    def submit(self, job: CopyJob) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def checksums(pool: np.ndarray, offsets: np.ndarray, length: int) -> list[int]:
    """xxh3-64 of ``length`` pool bytes at each offset (one hash call per block: the
    hash itself is the work, there is nothing to vectorize)."""
    h = xxhash.xxh3_64_intdigest
    return [h(pool[o:o + length]) for o in offsets.tolist()]


def verify_then(job: CopyJob, pool: np.ndarray | None) -> Exception | None:
    """Before a load: compare each slot's share with its recorded checksum."""
    spec = job.context.get("verify")
    if spec is None or pool is None:
        return None
    offsets, length, expected = spec
    got = checksums(pool, offsets, length)
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if e and g != e]
    if not bad:
        return None
    job.context["corrupt"] = bad
    return TransferError(f"{len(bad)} of {len(got)} blocks failed their checksum; "
                         "they were dropped from the pool", Code.CHECKSUM)


def checksum_after(job: CopyJob, pool: np.ndarray | None) -> None:
    """After a store: record the checksum of every slot share just written."""
    spec = job.context.get("sum")
    if spec is not None and pool is not None:
        offsets, length = spec
        job.context["checksums"] = checksums(pool, offsets, length)
