"""Leases: looked-up blocks held for a load, by id, until released or past a deadline.

The table keeps only the books (ids, slots, deadlines, blocks per owner); the ``Index``
pins and unpins the slots, so a slot's pins count every lease and copy on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.core.owners import OwnerCounts


@dataclass
class Lease:
    id: int
    owner: int
    slots: np.ndarray
    deadline: float


class LeaseTable:
    def __init__(self, first_id: int) -> None:
        self._leases: dict[int, Lease] = {}
        # Ids count from ``first_id``: the shell starts each daemon run somewhere else,
        # so a lease id of an earlier run names nothing in this one.
        self._next = first_id
        self.by_owner = OwnerCounts()  # owner -> blocks under its leases (quotas)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def owner(self, lease_id: int) -> int | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else lease.owner

    def holds(self, lease_id: int, slots: np.ndarray) -> bool:
        """Whether the lease is live and holds every one of ``slots``."""
        lease = self._leases.get(lease_id)
        return lease is not None and bool(np.isin(slots, lease.slots).all())

    def open(self, owner: int, slots: np.ndarray, deadline: float) -> int:
        """A new lease on ``slots`` (already pinned by the caller); returns its id."""
        lease = self._next
        self._next += 1
        self.by_owner.add(owner, len(slots))
        self._leases[lease] = Lease(lease, owner, slots, deadline)
        return lease

    def shrink(self, lease: Lease, slots: np.ndarray) -> np.ndarray | None:
        """Take ``slots`` out of the lease and return those it held, or None when that
        would leave it empty (the caller closes it instead)."""
        drop = np.isin(lease.slots, slots)
        if drop.all():
            return None
        gone, lease.slots = lease.slots[drop], lease.slots[~drop]
        self.by_owner.add(lease.owner, -len(gone))
        return gone

    def close(self, lease_id: int) -> Lease:
        lease = self._leases.pop(lease_id)
        self.by_owner.add(lease.owner, -len(lease.slots))
        return lease

    def expired(self, now: float) -> list[int]:
        return [lid for lid, lease in self._leases.items() if lease.deadline <= now]

    def of_owner(self, owner: int) -> list[int]:
        return [lid for lid, lease in self._leases.items() if lease.owner == owner]
