"""The index as a restart sees it: its READY blocks written out, and put back.

Functions over an ``Index`` (kvd/core/index.py), kept apart from its hot paths: the
journal's snapshot reads every READY block, and a warm restart restores them one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.policies.base import EvictionPolicy
from kvd.core.states import READY
from kvd.core.tenants import Tenant

# (tenant id, key, slot, depth, per-rank checksums, parent key | None)
LiveBlock = tuple[int, bytes, int, int, list[int], bytes | None]


class Table(Protocol):
    """What a snapshot reads and a restore updates of its ``Index``. A protocol, so that
    this module does not import the index back."""

    policy: EvictionPolicy
    allocator: Allocator
    entries: dict[bytes, int]
    state: np.ndarray
    tenant_of: np.ndarray
    rank_mask: np.ndarray
    checksums: dict[int, list[int]]
    parents: dict[int, bytes | None]
    _capacity_bound: int
    _depth: np.ndarray
    _slot_key: dict[int, bytes]
    _slot_tenant: dict[int, Tenant]
    _ready: dict[int, dict[bytes, int]]
    _spaces: dict[int, dict[bytes, int]]


def live_blocks(ix: Table) -> list[LiveBlock]:
    """Every READY block, for a snapshot (in the order the policy learned them: a
    restart restores it)."""
    return list(copy_live_blocks(ix)())


def copy_live_blocks(ix: Table) -> Callable[[], Iterator[LiveBlock]]:
    """``live_blocks`` as of now, made later (one by one, few alive at once) by the
    function returned, on any thread: only the tables are copied now (at C speed),
    where making the tuples held the loop about 7 us a block (a journal compaction at
    a million blocks: seconds). A READY block's checksum list is never changed in
    place."""
    slot_key, tenant_of = dict(ix._slot_key), dict(ix._slot_tenant)
    ready, depth = ix.state == READY, ix._depth.copy()
    sums, parents = dict(ix.checksums), dict(ix.parents)

    def made() -> Iterator[LiveBlock]:
        sums_of, parent_of = sums.get, parents.get
        is_ready, depths = ready.tolist(), depth.tolist()
        return ((tenant_of[slot].id, key[4:], slot, depths[slot], sums_of(slot, []),
                 parent_of(slot))
                for slot, key in slot_key.items() if is_ready[slot])
    return made


def restore_block(ix: Table, tenant: Tenant, key: bytes, slot: int, depth: int,
                  checksums: list[int], parent: bytes | None = None,
                  claimed: bool = False) -> bool:
    """Put back a READY block found in the pool after a restart (already verified).
    False when the slot cannot be claimed (geometry changed, or already taken), or the
    key is held already. ``claimed``: the caller claimed the slot (and frees it if this
    says False)."""
    if tenant.prefix + key in ix.entries:
        return False
    if not claimed and not ix.allocator.claim(slot, tenant.slot_bytes):
        return False
    scoped = tenant.prefix + key
    ix.entries[scoped] = slot
    ix._spaces.setdefault(tenant.id, {})[key] = slot
    ix._ready.setdefault(tenant.id, {})[key] = slot
    ix._slot_key[slot] = scoped
    ix._slot_tenant[slot] = tenant
    ix.state[slot] = READY
    ix.tenant_of[slot] = tenant.id
    ix.rank_mask[slot] = tenant.full_mask
    ix._depth[slot] = depth
    ix.checksums[slot] = list(checksums)
    ix.parents[slot] = parent
    tenant.blocks += 1
    ix.allocator.fit(ix.policy, ix._capacity_bound)
    ix.policy.insert(scoped, depth)
    return True
