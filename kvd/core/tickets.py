"""Allocations kept under a client-chosen ticket until every rank stored with them.

vLLM's scheduler asks for slots right before the step that computes the blocks, and its
workers store one step later. With a ticket, the scheduler sends its Allocate and moves
on; each worker's Transfer names the ticket and the daemon supplies the slots. A ticket
lives until every rank of the tenant used it, or until its slots' pending deadline.

Scheduler and workers talk to the daemon over separate connections, so a Transfer can
overtake its Allocate: it waits here (``park``) until the Allocate comes or a deadline
passes.

A ticket no rank has stored with by its ``claim_by`` is given up (``unclaimed``): its
workers skipped the store (they copy for themselves, run without offloading, or lost
the daemon), and its PENDING slots would otherwise hold the blocks from every other
engine (their Lookups wait on them, their stores find them present) until the pending
deadline, a minute by default. So is one that some ranks stored with and the others
not within the same time after the first: the ranks of one engine store in the same
step, and one that never comes (its worker was refused, while another engine's worker
of that rank made the tenant look whole) would leave the blocks unfinished as long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from kvd.core.states import NO_SLOT

T = TypeVar("T")


class TicketError(ValueError):
    """A ticket that is in use already, unknown, expired or used up."""


@dataclass(eq=False)
class _Ticket:
    slots: np.ndarray  # one per Allocate key; NO_SLOT where nothing is to be stored
    ranks_left: int
    deadline: float
    gens: np.ndarray | None = None  # the slots' allocation numbers when handed out
    claimed: int = 0  # a bit per rank that stored with it
    claim_by: float = float("inf")  # given up then if not every rank stored with it
    claim_s: float = float("inf")  # the other ranks' time after the first one's store
    touched: bool = False  # some rank stored with it


@dataclass(eq=False)
class Tickets(Generic[T]):
    """``T`` is whatever the shell parks (a Transfer and its sender); opaque here."""

    _held: dict[tuple[int, int], _Ticket] = field(default_factory=dict)
    _parked: dict[tuple[int, int], list[tuple[float, T]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def parked(self) -> int:
        return sum(len(v) for v in self._parked.values())

    def holds(self, tenant: int, ticket: int) -> bool:
        return (tenant, ticket) in self._held

    def add(self, tenant: int, ticket: int, slots: np.ndarray, ranks: int,
            deadline: float, gens: np.ndarray | None = None,
            claim_by: float = float("inf"), claim_s: float = float("inf")) -> list[T]:
        """Keep ``slots`` (and their allocation numbers, ``gens``) under the ticket;
        returns the Transfers that came first (they claim it at once). The first rank
        must store by ``claim_by``, the others within ``claim_s`` of it."""
        key = (tenant, ticket)
        if key in self._held:
            raise TicketError(f"ticket {ticket} is in use; pick another")
        slots = np.array(slots, dtype=np.uint32)
        if not (slots != NO_SLOT).any():  # nothing to store: no arrays kept (a client
            # asking again and again at a full pool must not grow the daemon)
            slots, gens = np.broadcast_to(np.uint32(NO_SLOT), slots.shape), None
        self._held[key] = _Ticket(slots, max(1, ranks), deadline, gens,
                                  claim_by=min(claim_by, deadline), claim_s=claim_s)
        return [item for _, item in self._parked.pop(key, ())]

    def take(self, tenant: int, ticket: int) -> np.ndarray | None:
        """The ticket's slots for one rank's store (the last rank retires the ticket);
        None while the ticket is not known (park the Transfer)."""
        got = self.claim(tenant, ticket)
        return None if got is None else got[0]

    def claim(self, tenant: int, ticket: int, rank: int = -1,
              now: float | None = None) -> tuple[np.ndarray, np.ndarray | None] | None:
        """``take``, with the allocation numbers the slots had when the ticket was added:
        a slot given up and handed out again since must not receive this store.
        TicketError when ``rank`` (if known, >= 0) claimed it before: a rank's second
        store must not use up another rank's turn. The first claim at ``now`` starts
        the other ranks' ``claim_s``."""
        held = self._held.get((tenant, ticket))
        if held is None:
            return None
        if rank >= 0:
            if held.claimed >> rank & 1:
                raise TicketError(f"rank {rank} stored with ticket {ticket} already")
            held.claimed |= 1 << rank
        if not held.touched and now is not None:
            held.claim_by = min(now + held.claim_s, held.deadline)
        held.touched = True
        held.ranks_left -= 1
        if held.ranks_left == 0:
            del self._held[(tenant, ticket)]
        return held.slots, held.gens

    def unclaimed(self, now: float) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Give up the tickets not every rank stored with by their ``claim_by``: their
        slots and allocation numbers, for the caller to abort those still the ticket's
        (no block of a ticket still held is whole)."""
        late = [k for k, t in self._held.items() if t.claim_by <= now]
        out = []
        for k in late:
            t = self._held.pop(k)
            if t.gens is not None:  # (slots all NO_SLOT otherwise: nothing to abort)
                out.append((t.slots, t.gens))
        return out

    def park(self, tenant: int, ticket: int, item: T, deadline: float) -> None:
        self._parked.setdefault((tenant, ticket), []).append((deadline, item))

    def unpark(self, which: Callable[[T], bool]) -> list[T]:
        """Take out the parked items ``which`` selects (a sender that left)."""
        return self._take(lambda deadline, item: which(item))

    def expire(self, now: float) -> list[T]:
        """Drop tickets past their deadline (their PENDING slots expire in the index);
        returns parked items whose Allocate never came."""
        for k in [k for k, t in self._held.items() if t.deadline <= now]:
            del self._held[k]
        return self._take(lambda deadline, item: deadline <= now)

    def _take(self, taken: Callable[[float, T], bool]) -> list[T]:
        out: list[T] = []
        for k, items in list(self._parked.items()):
            keep = []
            for d, item in items:
                if taken(d, item):
                    out.append(item)
                else:
                    keep.append((d, item))
            if keep:
                self._parked[k] = keep
            else:
                del self._parked[k]
        return out
