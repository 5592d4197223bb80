"""Lookup and Release: a hit run is leased to its client until it loads it or lets go.

Part of ``kvd.service.Service`` (event loop only); the annotations name the service
state these handlers use.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvd.clients import Client
from kvd.config import Config
from kvd.core.index import Index
from kvd.core.tenants import Tenant
from kvd.counters import Counters
from kvd.errors import BadIds, KvdError
from kvd.request_limits import check_ids, check_keys
from kvd.tiers.tiering import Tiering
from kvd.transfers import Send, Transfers
from kvd_proto import messages as m
from kvd_proto.ids import pack_u32, unpack_u32


class LeaseRequests:
    config: Config
    index: Index
    counters: Counters
    transfers: Transfers
    tiering: Tiering | None
    clock: Callable[[], float]
    send: Send

    def _lookup(self, client: Client, tenant: Tenant, msg: m.Lookup) -> m.Reply:
        check_keys(msg.keys, msg.depth, 0, self.config.max_keys_per_request)
        stalled = self.transfers.stalled  # a hit's load would wait out its deadline
        room = self.config.max_leased_blocks - self.index.leases.by_owner.get(client.id, 0)
        if room <= 0 and not stalled:
            raise KvdError(f"lease quota of {self.config.max_leased_blocks} blocks reached; "
                           "release leases first", m.Code.BUSY)
        # Every key asked counts, once, here (the hit ratio's denominator): the keys past
        # the lease quota and all of a stalled lookup's are asked and missed.
        counters, tokens = self.counters, tenant.block_tokens
        counters.lookups += 1
        counters.lookup_keys += len(msg.keys)
        counters.lookup_tokens += len(msg.keys) * tokens
        if stalled:
            counters.stalled_lookups += 1
            return m.LookupOk(msg.req, 0, b"", 0, 0)
        # The hit run is leased, so it ends where the quota does: a longer request gets
        # the hits that fit (its tail is computed), not a refusal.
        keys = msg.keys if len(msg.keys) <= room else msg.keys[:room]
        # Hits are always leased (1 ms at least): a load names the lease, and one whose
        # lease is gone is refused, as its slots may hold other blocks by then.
        lease_s = min(max(msg.lease_ms, 1), self.config.max_lease_ms) / 1000
        hits, slots, lease, pending = self.index.lookup(
            tenant, keys, owner=client.id, depth=msg.depth, now=self.clock(),
            lease_s=lease_s)
        counters.hit_tokens += hits * tokens
        reply = m.LookupOk(msg.req, hits, pack_u32(slots), lease, pending)
        if self.tiering is not None and hits + pending < len(keys):
            identity = client.identity
            return self.tiering.lookup(tenant, keys, msg.depth, reply,
                                       lambda r: self.send(identity, r))
        return reply

    def _release(self, client: Client, msg: m.Release) -> m.Reply:
        if self.index.leases.owner(msg.lease) not in (None, client.id):
            raise BadIds(f"lease {msg.lease} belongs to another client")
        slots = None
        if msg.slots:
            check_ids(msg.slots, self.config.max_keys_per_request)
            try:
                slots = unpack_u32(msg.slots).astype(np.int64)
            except ValueError as e:
                raise BadIds(str(e)) from None
        return m.Ok(msg.req, int(self.index.release(msg.lease, slots=slots)))

