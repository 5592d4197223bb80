"""From a Transfer to its engine's copy job: the slots it may touch, checked, and the
address arrays the engine copies between (numpy, no per-block loop).

Functions of the index and the sender's registered memory, no state of their own:
``kvd.transfers`` calls them on the loop and owns the job once it is built.
"""

from __future__ import annotations

import math

import numpy as np

from kvd.clients import Client
from kvd.config import Config
from kvd.core.index import PENDING, READY, Index
from kvd.core.states import FREE
from kvd.core.tenants import Tenant
from kvd.engines.base import ChecksumSpec, CopyJob
from kvd.errors import BadIds, KvdError, RequestError
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

# Copy segments (blocks x registered tensors) of one Transfer: its address arrays are
# built on the loop, about 0.1 s per million (an engine's largest step is well below).
MAX_SEGMENTS = 1 << 22


def own_slots(index: Index, tenant: Tenant, packed: bytes | np.ndarray,
              state: int) -> np.ndarray:
    """Slot ids (from the wire, or a ticket), checked: in range, ``tenant``'s, in
    ``state``."""
    try:
        ids = unpack_u32(packed) if isinstance(packed, bytes) else packed
    except ValueError as e:
        raise BadIds(str(e)) from None
    slots = ids.astype(np.int64)
    if slots.size and int(slots.max()) >= index.allocator.max_slots:
        raise BadIds(f"slot id {int(slots.max())} out of range")
    if slots.size > 1:  # (a load naming one slot 65,536 times would copy 256 GiB)
        ordered = np.sort(slots)  # a quarter of np.unique's cost on a Transfer's ids
        if (ordered[1:] == ordered[:-1]).any():
            raise BadIds("a slot is named twice in one transfer")
    bad = (index.tenant_of[slots] != tenant.id) | (index.state[slots] != state)
    if bad.any():
        s = int(slots[np.argmax(bad)])
        want = "PENDING" if state == PENDING else "READY"
        raise BadIds(f"slot {s} is not a {want} slot of this tenant")
    return slots


def named_slots(index: Index, tenant: Tenant, msg: m.Transfer, store: bool) -> np.ndarray:
    """The slots a Transfer names (not by ticket), checked: a store's still its
    allocation's (``gens``), a load's under its lease."""
    lease = 0 if store else msg.lease
    if lease and lease not in index.leases:  # said before its slots' state:
        raise _lease_gone(lease)  # they may be free or hold others by now
    try:
        slots = own_slots(index, tenant, msg.slots, PENDING if store else READY)
    except BadIds:
        if store:
            _check_ended(index, tenant, msg.slots, msg.gens)
        raise
    if store:
        _check_gens(index, slots, msg.gens)
    if lease and not index.leases.holds(lease, slots):
        raise _lease_gone(lease)
    return slots


def check_blocks(client: Client, blocks: np.ndarray, slots: np.ndarray) -> None:
    """The sender's block ids: one per slot, inside its registered memory, and few
    enough copy segments for the loop to build."""
    if len(blocks) != len(slots):
        raise BadIds(f"{len(blocks)} block ids for {len(slots)} slots")
    if len(blocks) * len(client.bases) > MAX_SEGMENTS:
        raise RequestError(f"{len(blocks)} blocks of {len(client.bases)} tensors are "
                           f"over {MAX_SEGMENTS} copy segments for one Transfer; "
                           "send fewer blocks per Transfer")
    if blocks.size and int(blocks.max()) >= client.num_blocks:
        raise BadIds(f"block id {int(blocks.max())} beyond the registered "
                     f"{client.num_blocks} blocks")


def build_job(config: Config, index: Index, pool_base: int, client: Client, tenant: Tenant,
              msg: m.Transfer, blocks: np.ndarray, slots: np.ndarray) -> CopyJob:
    """Address arrays (numpy, no per-block loop) for the engine."""
    slot_off = index.allocator.offsets(slots, tenant.slot_bytes).astype(np.uint64)
    page_off = np.array(tenant.page_offsets, dtype=np.uint64)
    rank_off = np.uint64(max(client.rank, 0) * tenant.rank_bytes)
    pool = np.uint64(pool_base) + rank_off + slot_off[:, None] + page_off[None, :]
    remote = client.bases[None, :] + blocks[:, None] * client.strides[None, :]
    lengths = np.broadcast_to(client.pages, remote.shape)
    deadline = msg.deadline_ns / 1e9 if msg.deadline_ns else math.inf
    job = CopyJob(client.id, msg.event, msg.req, msg.direction, client.pid, pool.ravel(),
                  remote.ravel(), lengths.ravel().copy(), slots, msg.cuda_event,
                  deadline, uid=client.uid)
    if config.checksums:
        share = (slot_off + rank_off).astype(np.int64)
        if msg.direction == m.Direction.STORE:
            job.checksum = ChecksumSpec(share, tenant.rank_bytes)
        elif config.verify_on_load:
            sums, r = index.checksums, max(client.rank, 0)
            expect = [sums.get(s, [0] * (r + 1))[r] for s in slots.tolist()]
            job.checksum = ChecksumSpec(share, tenant.rank_bytes, expect)
    return job


def _check_gens(index: Index, slots: np.ndarray, packed: bytes) -> None:
    """A slot-named store names the allocation it was given (``Allocated.gens``):
    the same slot id, given up and handed out again since, belongs to another key
    now. Without gens (an older client) the sender is trusted on it."""
    if not packed:
        return
    try:
        gens = unpack_u32(packed)
    except ValueError as e:
        raise BadIds(str(e)) from None
    if len(gens) != len(slots):
        raise BadIds(f"{len(gens)} gens for {len(slots)} slots")
    moved = index.gen[slots] != gens
    if moved.any():
        raise KvdError(f"slot {int(slots[np.argmax(moved)])} was given up and handed out "
                       "again since its Allocate: the store would land in another "
                       "block", m.Code.EXPIRED)


def _check_ended(index: Index, tenant: Tenant, packed: bytes, packed_gens: bytes) -> None:
    """A store refused for its slots' state: EXPIRED when its gens show that their
    allocation ended meanwhile (its pending time passed or it was given up: the slot
    is free now, or this tenant's again), as ``_check_gens`` says when the tenant
    has it pending again; BAD_IDS ("fix the caller") otherwise: gens never handed
    out, and another tenant's slots, whose state this tenant must not learn."""
    try:
        slots = unpack_u32(packed).astype(np.int64)
        gens = unpack_u32(packed_gens)
    except ValueError:
        return
    if not len(slots) or len(gens) != len(slots) \
            or int(slots.max()) >= index.allocator.max_slots:
        return
    gen, state = index.gen[slots], index.state[slots]
    if ((gens == 0) | (gens > gen)).any() \
            or ((state != FREE) & (index.tenant_of[slots] != tenant.id)).any():
        return
    ended = (gens < gen) | (state == FREE)
    if ended.any():
        raise KvdError(f"slot {int(slots[np.argmax(ended)])}'s allocation ended before "
                       "this store (its pending time passed, or it was given up)",
                       m.Code.EXPIRED)


def _lease_gone(lease: int) -> KvdError:
    return KvdError(f"lease {lease} of this load is gone (lapsed, released, or of another "
                    "kvd run): its slots may hold other blocks", m.Code.EXPIRED)
