"""Allocate and Abort: slots held PENDING for a store until every rank's copy is in.

Part of ``kvd.service.Service`` (event loop only); the annotations name the service
state these handlers use.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvd.clients import Client
from kvd.config import Config
from kvd.core.index import PENDING, Index
from kvd.core.states import NO_SLOT
from kvd.core.tenants import Tenant
from kvd.counters import Counters
from kvd.copy_jobs import own_slots
from kvd.errors import BadIds, KvdError, RequestError
from kvd.request_limits import MAX_KEY, check_ids, check_keys
from kvd.transfers import Transfers
from kvd_proto import messages as m


class StoreRequests:
    config: Config
    counters: Counters
    index: Index
    transfers: Transfers
    clients: dict[bytes, Client]
    clock: Callable[[], float]
    commit: Callable[[], None]
    pool_fault: str

    def _allocate(self, client: Client, tenant: Tenant, msg: m.Allocate) -> m.Reply:
        if msg.ticket and self.transfers.ticket_in_use(tenant, msg.ticket):
            raise RequestError(f"ticket {msg.ticket} is in use; pick another")
        now = self.clock()
        pending_s = min(max(msg.pending_ms, 1), self.config.max_pending_ms) / 1000
        try:
            check_keys(msg.keys, msg.depth, msg.length, self.config.max_keys_per_request)
            if len(msg.parent) > MAX_KEY:
                raise RequestError(f"a parent key is longer than {MAX_KEY} bytes")
            if missing := self._ranks_missing(tenant):
                raise KvdError(f"no worker of this model is registered as rank"
                               f"{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
                               ": nobody would copy the "
                               "blocks (was its Register refused?); stores are skipped",
                               m.Code.BUSY)
            if self.transfers.stalled:  # its copy would not run; the engine holds the blocks
                raise KvdError("copies are overdue (the copy path is stuck): stores are "
                               "refused until they end", m.Code.BUSY)
            if self.pool_fault:  # what it stored would be dropped at the next tick
                raise KvdError(f"the pool file {self.pool_fault}: stores are refused until "
                               "it is whole again", m.Code.BUSY)
            # Three quarters of the pool at most per tenant, whatever its connections:
            # a scheduler that never stores (or several of one fingerprint) must not
            # hold every slot PENDING, evicting every tenant's blocks.
            pending = self.index.pending.by_owner
            share = max(1, self.index.allocator.total_slots(tenant.slot_bytes) * 3 // 4)
            room = min(self.config.max_pending_blocks - pending.get(client.id, 0),
                       share - sum(pending.get(c, 0) for c in tenant.clients))
            cut = msg.keys[max(room, 0):]  # (those held or being stored need no slot)
            self.counters.quota_cut_keys += len(cut) - self.index.known(tenant.id, cut)
            if room <= 0:
                raise KvdError(f"pending-store quota reached (max_pending_blocks "
                               f"{self.config.max_pending_blocks} per connection, 3/4 of the "
                               f"pool, {share} blocks, per tenant); finish or abort stores "
                               "first", m.Code.BUSY)
        except KvdError:
            if msg.ticket:  # the workers' stores by it end at once, copying nothing,
                # instead of waiting for an allocation that will never come
                self.transfers.add_ticket(tenant, msg.ticket,
                                          np.full(len(msg.keys), NO_SLOT, dtype=np.uint32),
                                          now + pending_s)
            raise
        # Only the first `room` keys may get slots (keys already stored take none).
        res = self.index.allocate(tenant, msg.keys[:room], owner=client.id, depth=msg.depth,
                                  length=msg.length, now=now, pending_s=pending_s,
                                  # a parent unlike the keys is not one of them: unknown
                                  parent=(msg.parent if msg.keys
                                          and len(msg.parent) == len(msg.keys[0]) else None),
                                  chained=msg.chained)
        # What this evicted is copied down (and journaled) before a Transfer that
        # overtook the Allocate starts writing into the slots: add_ticket runs it now.
        self.commit()
        if msg.ticket:  # the rest of the keys get no slot: their blocks are skipped
            slots = np.full(len(msg.keys), NO_SLOT, dtype=np.uint32)
            slots[:len(res.slots)] = res.slots
            self.transfers.add_ticket(tenant, msg.ticket, slots, now + pending_s)
        slots = np.array(res.slots, dtype=np.uint32)
        gens = np.zeros(len(slots), dtype=np.uint32)
        got = slots != NO_SLOT
        gens[got] = self.index.gen[slots[got].astype(np.int64)]
        return m.Allocated(msg.req, slots.tobytes(), res.evicted, res.allocated,
                           gens.tobytes())

    def _ranks_missing(self, tenant: Tenant) -> list[int]:
        """Ranks no client of ``tenant`` registered memory for. Until each has one, no
        block can be stored whole: slots allocated now would only evict other blocks
        and wait out their pending time (a scheduler whose workers were refused)."""
        have = {c.rank for c in self.clients.values() if c.tenant is tenant}
        return [r for r in range(tenant.tp_size) if r not in have]

    def _abort(self, client: Client, tenant: Tenant, msg: m.Abort) -> m.Reply:
        check_ids(msg.slots, self.config.max_keys_per_request)
        slots = own_slots(self.index, tenant, msg.slots, PENDING)
        if not self.index.pending.allocated_by(slots, client.id):
            raise BadIds("a slot of this Abort was allocated by another connection")
        return m.Ok(msg.req, self.index.abort(slots))
