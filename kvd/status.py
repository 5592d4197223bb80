"""The status document: what ``kvdctl status --json``, metrics and STATUS= lines read.

Built on the loop from ``Sources``, the few parts of the daemon's state it reads; the
schema only grows (keys are added, never renamed), like the wire.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvd.clients import Client
from kvd.core.index import Index
from kvd.core.tenants import Tenants
from kvd.counters import Counters
from kvd.persist import Persistence
from kvd.pool import Pool
from kvd_proto import messages as m


@dataclass(frozen=True)
class Sources:
    """What the status document is built from (read on the loop, never kept)."""

    instance: str
    started: float  # time.monotonic() at start: uptime stays true when the clock is set
    policy_name: str
    pool: Pool
    index: Index
    tenants: Tenants
    clients: Iterable[Client]
    counters: Counters
    inflight: int
    persist: Persistence | None
    extra: dict[str, Any]  # what the shell adds (pinning, data paths, lifecycle)
    overdue: int = 0  # copies past their deadline and grace, not ended (a stuck path)


def status_document(svc: Sources) -> dict:
    ix, alloc = svc.index, svc.index.allocator
    c = ix.counters
    return {
        "version": m.PROTOCOL_VERSION,
        "instance": svc.instance,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - svc.started, 3),
        "policy": svc.policy_name,
        "policy_state": ix.policy.describe(),
        "pool": {
            "path": svc.pool.path,
            "capacity_bytes": alloc.capacity_bytes,
            "used_bytes": alloc.used_bytes,
            "extent_bytes": alloc.extent_bytes,
            "locked": svc.pool.locked,
        },
        "blocks": {"ready": ix.ready_blocks, "pending": ix.pending_blocks,
                   "pinned": ix.pinned_blocks, "leases": len(ix.leases),
                   "capacity": ix.policy.capacity},  # what the policy is sized for
        "clients": [
            {"id": cl.id, "pid": cl.pid, "name": cl.name, "kind": cl.kind, "rank": cl.rank,
             "tenant": cl.tenant.id if cl.tenant else None, "inflight": cl.inflight,
             "requests": cl.requests}
            for cl in svc.clients
        ],
        "tenants": [
            {"id": t.id, "digest": t.digest, "model": t.model, "tp_size": t.tp_size,
             "slot_bytes": t.slot_bytes, "blocks": t.blocks,
             "bytes": t.blocks * t.slot_bytes, "clients": len(t.clients)}
            for t in svc.tenants
        ],
        "transfers": {"inflight": svc.inflight, "overdue": svc.overdue},
        "persistence": _persistence(svc),
        **svc.extra,
        "counters": {
            "requests": svc.counters.requests, "errors": svc.counters.errors,
            "lookups": svc.counters.lookups, "lookup_keys": svc.counters.lookup_keys,
            "hit_blocks": c.hit_blocks, "stored_blocks": c.stored_blocks,
            "stored_bytes": svc.counters.stored_bytes,
            "loaded_blocks": svc.counters.loaded_blocks,
            "loaded_bytes": svc.counters.loaded_bytes,
            "evicted_blocks": c.evicted_blocks, "evicted_bytes": c.evicted_bytes,
            "failed_stores": c.failed_stores,
            "failed_transfers": svc.counters.failed_transfers,
            "expired_transfers": svc.counters.expired_transfers,
            "unclaimed_blocks": svc.counters.unclaimed_blocks,
            "corrupt_blocks": svc.counters.corrupt_blocks,
            "stalled_lookups": svc.counters.stalled_lookups,
            "quota_cut_keys": svc.counters.quota_cut_keys,
            "expired_leases": c.expired_leases, "expired_pending": c.expired_pending,
            "no_space": c.no_space,
            "lookup_tokens": svc.counters.lookup_tokens,
            "hit_tokens": svc.counters.hit_tokens,
            "errors_by_code": dict(svc.counters.by_code),
        },
    }


def _persistence(svc: Sources) -> dict:
    p = svc.persist
    if p is None:
        return {"enabled": False}
    r = p.recovery
    return {"enabled": True, "journal": p.path,
            "journal_bytes": p.journal.bytes if p.journal else 0,
            "restored_blocks": r.restored, "corrupt_dropped": r.corrupt,
            "unplaceable": r.unplaceable, "restore_s": round(r.seconds, 3),
            "discarded": r.discarded, "journal_errors": r.errors}
