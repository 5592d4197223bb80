"""The index as a restart sees it: its READY blocks written out, and put back.

Functions over an ``Index`` (kvd/core/index.py), kept apart from its hot paths: the
journal's snapshot reads every READY block, and a warm restart restores them one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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


def restore_blocks(ix: Table, tenant: Tenant, keys: Sequence[bytes], slots: Sequence[int],
                   depths: Sequence[int], checksums: Sequence[list[int]],
                   parents: Sequence[bytes | None]) -> list[bool]:
    """Put back READY blocks found in the pool after a restart (verified; their slots
    claimed by the caller, who frees those this answers False: a key held already, or
    named twice here, where the first wins). In one batch, the policy told a run of
    consecutive depths at a time: one block at a time took ~24 us a block (25 s for a
    million at a start)."""
    pfx, entries = tenant.prefix, ix.entries
    first: dict[bytes, int] = {}  # key -> its place, of the keys put back
    for i, key in enumerate(keys):
        if key not in first and pfx + key not in entries:
            first[key] = i
    took = [False] * len(keys)
    if not first:
        return took
    places = list(first.values())
    for i in places:
        took[i] = True
    got = [slots[i] for i in places]
    plain = list(first)
    scoped = [pfx + key for key in plain]
    entries.update(zip(scoped, got))
    ix._spaces.setdefault(tenant.id, {}).update(zip(plain, got))
    ix._ready.setdefault(tenant.id, {}).update(zip(plain, got))
    ix._slot_key.update(zip(got, scoped))
    ix._slot_tenant.update(dict.fromkeys(got, tenant))
    arr = np.array(got, dtype=np.int64)
    ix.state[arr] = READY
    ix.tenant_of[arr] = tenant.id
    ix.rank_mask[arr] = tenant.full_mask
    ix._depth[arr] = [depths[i] for i in places]
    ix.checksums.update((slots[i], list(checksums[i])) for i in places)
    ix.parents.update((slots[i], parents[i]) for i in places)
    tenant.blocks += len(places)
    ix.allocator.fit(ix.policy, ix._capacity_bound)
    start = 0
    for end in range(1, len(places) + 1):  # runs of consecutive depths, in order
        if end == len(places) or depths[places[end]] != depths[places[end - 1]] + 1:
            ix.policy.insert_many(scoped[start:end], depths[places[start]])
            start = end
    return took
