"""The data path of the service: Transfer requests into copy jobs, and their Done.

Part of ``Service`` (same loop, same state; split out to keep each file one concept):
a Transfer is checked (slots of the sender's tenant in the right state, block ids
within its registered memory), turned into address arrays with numpy and handed to a
copy engine; ``copy_done`` publishes READY (or drops a failed store) and pushes Done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd.config import Config
from kvd.core.index import PENDING, READY, Index
from kvd.core.states import NO_SLOT
from kvd.core.tenants import Tenant
from kvd.core.tickets import Tickets
from kvd.engines.base import CopyJob, TransferEngine
from kvd.errors import BadIds, KvdError, NotRegistered, RequestError
from kvd.persist import Persistence
from kvd.pool import Pool
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

log = logging.getLogger("kvd.service")
TICKET_WAIT_S = 2.0  # how long a Transfer waits for the Allocate whose ticket it names


@dataclass(eq=False)
class Client:
    id: int
    identity: bytes
    pid: int
    name: str = ""
    hello_pid: int = 0  # the pid the client says it has (differs across PID namespaces)
    tenant: Tenant | None = None
    rank: int = -1
    engine: TransferEngine | None = None
    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    strides: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    num_blocks: int = 0
    inflight: int = 0
    gone: bool = False
    requests: int = 0
    uid: int = -1
    admin: bool = False
    last_seen: float = 0.0


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    failed_transfers: int = 0
    corrupt_blocks: int = 0
    lookup_tokens: int = 0  # blocks asked for x the tenant's block_tokens
    hit_tokens: int = 0
    by_code: dict[str, int] = field(default_factory=dict)  # errors by Code name


class TransferPath:
    """Mixed into ``Service``, which owns these."""

    config: Config
    pool: Pool
    index: Index
    tickets: Tickets[tuple[Client, m.Transfer]]
    persist: Persistence | None
    counters: Counters
    inflight: int
    send: Callable[[bytes, m.Reply], None]
    clock: Callable[[], float]
    _count_error: Callable[[m.Code], None]

    def _own_slots(self, tenant: Tenant, packed: bytes | np.ndarray, state: int) -> np.ndarray:
        """Slot ids (from the wire, or a ticket), checked: in range, this tenant's, in
        ``state``."""
        try:
            ids = unpack_u32(packed) if isinstance(packed, bytes) else packed
        except ValueError as e:
            raise BadIds(str(e)) from None
        slots = ids.astype(np.int64)
        if slots.size and int(slots.max()) >= self.index.allocator.max_slots:
            raise BadIds(f"slot id {int(slots.max())} out of range")
        bad = (self.index.tenant_of[slots] != tenant.id) | (self.index.state[slots] != state)
        if bad.any():
            s = int(slots[np.argmax(bad)])
            want = "PENDING" if state == PENDING else "READY"
            raise BadIds(f"slot {s} is not a {want} slot of this tenant")
        return slots

    def _transfer(self, client: Client, msg: m.Transfer) -> m.Reply | None:
        tenant = client.tenant
        if tenant is None or client.engine is None:
            raise NotRegistered("register memory (Register with a rank) before a Transfer")
        if msg.direction not in (m.Direction.STORE, m.Direction.LOAD):
            raise RequestError(f"bad direction {msg.direction}")
        state = PENDING if msg.direction == m.Direction.STORE else READY
        try:
            blocks = unpack_u32(msg.block_ids).astype(np.uint64)
        except ValueError as e:
            raise BadIds(str(e)) from None
        if msg.ticket:
            if msg.direction != m.Direction.STORE or msg.slots:
                raise BadIds("a ticket stands for the slots of a store; send one or the other")
            ticketed = self.tickets.take(tenant.id, msg.ticket)
            if ticketed is None:  # its Allocate is still on the way (another connection)
                self.tickets.park(tenant.id, msg.ticket, (client, msg),
                                  self.clock() + TICKET_WAIT_S)
                return None
            blocks, ticketed = _ticket_blocks(msg.ticket, blocks, ticketed)
            if not ticketed.size:  # kvd holds every block already: nothing to copy
                return m.Done(msg.req, msg.event)
            slots = self._own_slots(tenant, ticketed, state)
        else:
            slots = self._own_slots(tenant, msg.slots, state)
        if len(blocks) != len(slots):
            raise BadIds(f"{len(blocks)} block ids for {len(slots)} slots")
        if blocks.size and int(blocks.max()) >= client.num_blocks:
            raise BadIds(f"block id {int(blocks.max())} beyond the registered "
                         f"{client.num_blocks} blocks")
        if msg.direction == m.Direction.STORE and slots.size:
            done = (self.index.rank_mask[slots] >> np.uint64(client.rank)) & np.uint64(1)
            if done.any():
                raise BadIds(f"rank {client.rank} already stored slot {int(slots[np.argmax(done)])}")
        alloc = self.index.allocator
        slot_off = alloc.offsets(slots, tenant.slot_bytes).astype(np.uint64)
        page_off = np.array(tenant.page_offsets, dtype=np.uint64)
        rank_off = np.uint64(max(client.rank, 0) * tenant.rank_bytes)
        pool = (np.uint64(self.pool.base) + rank_off + slot_off[:, None] + page_off[None, :])
        remote = client.bases[None, :] + blocks[:, None] * client.strides[None, :]
        lengths = np.broadcast_to(client.pages, remote.shape)
        job = CopyJob(client.id, msg.event, msg.req, msg.direction, client.pid,
                      pool.ravel(), remote.ravel(), lengths.ravel().copy(), slots,
                      msg.cuda_event)
        job.context["client"] = client
        if self.config.checksums:
            share = (slot_off + rank_off).astype(np.int64)
            if msg.direction == m.Direction.STORE:
                job.context["sum"] = (share, tenant.rank_bytes)
            elif self.config.verify_on_load:
                sums = self.index.checksums
                r = max(client.rank, 0)
                expect = [sums.get(s, [0] * (r + 1))[r] for s in slots.tolist()]
                job.context["verify"] = (share, tenant.rank_bytes, expect)
        self.index.pin(slots)
        client.inflight += 1
        self.inflight += 1
        client.engine.submit(job)
        return None

    def _dispatch_transfer(self, client: Client, msg: m.Transfer) -> m.Reply | None:
        """A parked Transfer, run now: errors become its Done, as in ``_dispatch``."""
        try:
            return self._transfer(client, msg)
        except KvdError as e:
            self._count_error(e.code)
            return m.Done(msg.req, msg.event, e.code, str(e))

    def copy_done(self, job: CopyJob, error: Exception | None, seconds: float) -> None:
        """On the loop: unpin, publish READY, push Done."""
        client: Client = job.context["client"]
        self.index.unpin(job.slots)
        nblocks = len(job.slots)
        if error is None and job.direction == m.Direction.STORE:
            self.index.store_done(job.slots, client.rank, job.context.get("checksums"))
            self.counters.stored_bytes += job.nbytes
        elif error is None:
            self.counters.loaded_blocks += nblocks
            self.counters.loaded_bytes += job.nbytes
        else:
            self.counters.failed_transfers += 1
            if job.direction == m.Direction.STORE:
                self.index.abort(job.slots)  # never READY: every rank must succeed
            corrupt = job.context.get("corrupt")
            if corrupt:
                self.counters.corrupt_blocks += len(corrupt)
                self.index.discard([int(job.slots[i]) for i in corrupt])
            log.warning("transfer %d of client %d failed: %s", job.event, job.client, error)
        if self.persist is not None:
            self.persist.drain(self.index)  # a commit is journaled before its Done
        client.inflight -= 1
        self.inflight -= 1
        if error is None:
            done = m.Done(job.req, job.event, m.Code.OK, "", job.nbytes, seconds)
        else:
            code = error.code if isinstance(error, KvdError) else m.Code.TRANSFER_FAILED
            done = m.Done(job.req, job.event, code, str(error), 0, seconds)
            self._count_error(code)
        if not client.gone:
            self.send(client.identity, done)
        elif client.inflight == 0 and client.engine is not None:
            client.engine.detach(client.id)

def _ticket_blocks(ticket: int, blocks: np.ndarray,
                   slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A store by ticket: the blocks whose keys got a slot, and those slots."""
    if len(blocks) != len(slots):
        raise BadIds(f"{len(blocks)} block ids for the {len(slots)} keys of ticket {ticket}")
    keep = slots != NO_SLOT
    return blocks[keep], slots[keep]
