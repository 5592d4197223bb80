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

from kvd_proto.messages import Direction, Register


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
