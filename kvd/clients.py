"""One connection's record: who it is, its tenant and registered memory, what it has in
flight. The service makes it at Hello; the transfer path reads it. Event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvd.core.tenants import Tenant
from kvd.engines.base import TransferEngine


@dataclass(eq=False)
class Client:
    id: int
    identity: bytes
    pid: int
    name: str = ""
    hello_pid: int = 0  # the pid the client says it has (differs across PID namespaces)
    peer_pid: int = 0  # the pid the kernel reports for the socket's peer (0: it did not)
    address: str = ""  # the connection's credentials at Hello (``access.peer_address``)
    parked_bytes: int = 0  # of its Transfers waiting for their Allocate (kvd.transfers)
    tenant: Tenant | None = None
    rank: int = -1
    engine: TransferEngine | None = None
    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    strides: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    num_blocks: int = 0
    inflight: int = 0
    gone: bool = False
    # It said Bye and reads on until its Transfers' Dones came (its close waits for
    # them): those still go out, the rest of its replies do not.
    said_bye: bool = False
    requests: int = 0
    uid: int = -1
    gid: int = -1
    admin: bool = False
    last_seen: float = 0.0

    @property
    def kind(self) -> str:
        """What the connection is, for operators: an engine's scheduler, one of its
        workers (by rank), or a connection without a tenant (kvdctl, or an engine still
        in its handshake)."""
        if self.tenant is None:
            return "admin" if self.name.startswith("kvdctl") else "unregistered"
        return "scheduler" if self.rank < 0 else f"worker{self.rank}"

