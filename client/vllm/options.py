"""What the user sets (``KvdOptions``) and what a job carries (``KvdSlots``, or
``skip_store``: nothing to store).

Kept apart from the spec so that the manager and the worker, which the spec builds,
import them without importing the spec back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec, PrepareStoreOutput


def default_socket() -> str:
    """The daemon's default socket (same rule as ``kvd serve``)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(run, "kvd") if run else f"/tmp/kvd-{os.getuid()}"
    return os.path.join(base, "kvd.sock")


@dataclass(frozen=True)
class KvdOptions:
    """``kv_connector_extra_config`` keys read by kvd (all optional)."""

    socket: str = ""  # "" = $KVD_SOCKET, else the daemon's default socket
    lookup_timeout_ms: int = 300  # a Lookup not answered by then is a miss
    lookup_wait_ms: float = 2.0  # per scheduler step: wait this long for replies in flight
    lease_ms: int = 30_000  # how long hit blocks stay pinned for the load
    pending_wait_ms: int = 1_000  # how long a request waits for blocks still being stored
    pending_ms: int = 60_000  # an allocated slot not stored by then is dropped
    call_timeout_ms: int = 2_000  # connection liveness: pings, handshake
    # A Transfer's deadline: the daemon starts no copy for it later than this after it
    # was sent; without a Done, the job fails once this plus the protocol's grace passed.
    transfer_timeout_ms: int = 5_000
    # Loads that run before the step's forward pass (the request computes in the step
    # its hit is loaded, instead of waiting for the next ones): "auto" = on for engines
    # on CPU, where a step is long and a load short; "on"; "off" (vLLM's async loads).
    sync_loads: str = "auto"
    # A synchronous load's deadline: the forward pass waits for it at most this plus
    # the protocol's grace, then computes those tokens instead.
    sync_load_timeout_ms: int = 500
    keep_load_failure_policy: bool = False  # keep vLLM's "fail" instead of "recompute"

    def __post_init__(self) -> None:
        if self.sync_loads not in ("auto", "on", "off"):
            raise ValueError(f"kvd: sync_loads must be \"auto\", \"on\" or \"off\", "
                             f"not {self.sync_loads!r}")

    @classmethod
    def from_extra(cls, extra: dict) -> KvdOptions:
        known = {f.name: f for f in fields(cls)}
        kw = {}
        for key, value in extra.items():
            if key in known:
                typ = type(getattr(cls, key))
                kw[key] = typ(value) if typ is not bool else value in (True, "true", "1", 1)
        opts = cls(**kw)
        if not opts.socket:
            opts = cls(**{**kw, "socket": os.environ.get("KVD_SOCKET") or default_socket()})
        return opts


class KvdSlots(LoadStoreSpec):
    """Pool slots of one job, picklable and small (it rides in every SchedulerOutput).

    ``instance`` is the daemon run the slots belong to: a worker connected to another
    run (the daemon restarted in between) must not use them. A store carries the
    ``ticket`` of its Allocate instead of slots: the daemon knows them. A load carries
    the ``lease`` that pins its slots: the daemon refuses the load once it is gone.
    """

    __slots__ = ("slots", "instance", "ticket", "lease")

    def __init__(self, slots: np.ndarray, instance: str, ticket: int = 0,
                 lease: int = 0) -> None:
        self.slots = np.ascontiguousarray(slots, dtype=np.uint32)
        self.instance = instance
        self.ticket = ticket
        self.lease = lease

    def __getstate__(self) -> tuple[bytes, str, int, int]:
        return self.slots.tobytes(), self.instance, self.ticket, self.lease

    def __setstate__(self, state: tuple) -> None:
        self.slots = np.frombuffer(state[0], dtype=np.uint32)
        self.instance, self.ticket = state[1], state[2]
        self.lease = state[3] if len(state) > 3 else 0

    def __repr__(self) -> str:
        return f"KvdSlots({self.slots.tolist()}, {self.instance[:8]}, ticket={self.ticket})"


def skip_store(instance: str) -> PrepareStoreOutput:
    """Store nothing, quietly: vLLM moves on (None would retry the same keys every step,
    counted and logged as an allocation failure)."""
    return PrepareStoreOutput(keys_to_store=[], store_spec=KvdSlots(np.zeros(0), instance),
                              evicted_keys=[])
