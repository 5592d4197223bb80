"""A Transfer's whole life in the daemon, from its arrival to its one Done.

``Transfers`` owns it: ``accept`` checks a Transfer (slots of the sender's tenant in the
right state, block ids inside its registered memory, a ticket's slots, the deadline);
``kvd.copy_jobs`` builds the copy job, handed to the client's engine; ``complete`` (on
the loop, once per job) publishes READY or gives a failed store up and pushes the Done.
``done`` builds every Done the daemon sends. Exactly once, decided here: a Transfer
ends by ``accept`` answering at once, by ``complete``, or by its parked ticket expiring.

Deadlines: a Transfer names the last CLOCK_MONOTONIC instant at which a copy may start.
One that arrives late (a daemon paused, a backlog) ends EXPIRED without touching memory;
an engine checks the deadline again before each copy; a gone client's jobs get their
deadline cut to now, so nothing more of them is copied.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import numpy as np

from kvd.clients import Client
from kvd.config import Config
from kvd.copy_jobs import build_job, check_blocks, named_slots, own_slots
from kvd.core.index import PENDING, Index
from kvd.core.states import NO_SLOT
from kvd.core.tenants import Tenant
from kvd.core.tickets import TicketError, Tickets
from kvd.counters import Counters
from kvd.engines.base import CopyJob, expired
from kvd.errors import BadIds, KvdError, NotRegistered, RequestError
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

log = logging.getLogger("kvd.transfers")
TICKET_WAIT_S = 2.0  # how long a Transfer waits for the Allocate whose ticket it names
# What one connection's Transfers may hold waiting for their Allocates (block ids plus a
# message's own size): a worker parks a step's stores at most, a few hundred KiB.
MAX_PARKED_BYTES = 4 << 20
PARKED_OVERHEAD = 256
Send = Callable[[bytes, m.Reply], None]


class Transfers:
    """A Transfer's whole life, from the socket (``handle``) to its one Done: checks,
    tickets, the copy job, expiry, completion. ``clients`` is the service's table of
    connections (read here, never changed); ``stopping`` says new work gets BUSY."""

    def __init__(self, config: Config, index: Index, pool_base: int, send: Send,
                 clock: Callable[[], float], counters: Counters,
                 committed: Callable[[], None] = lambda: None,
                 clients: Mapping[bytes, Client] | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.config = config  # replaced by the service on a reload
        self.index = index
        self.pool_base = pool_base
        self.send = send
        self.clock = clock  # CLOCK_MONOTONIC seconds, the clock of Transfer deadlines
        self.counters = counters
        self.committed = committed  # journal what the index changed, before the Done
        self.clients: Mapping[bytes, Client] = clients if clients is not None else {}
        self.stopping = stopping
        self.tickets: Tickets[tuple[Client, m.Transfer]] = Tickets()
        self.owners: dict[CopyJob, Client] = {}  # jobs inside an engine
        # Per slot, the ranks whose store into it is being copied: a second one by the
        # same rank would still write after the first made the block READY.
        self.writing = np.zeros(index.allocator.max_slots, dtype=np.uint64)
        self.on_finished: Callable[[m.Direction, bool, float], None] = lambda *a: None
        # Copies in an engine past their deadline and its grace, at the last tick: their
        # clients gave up on them, and an engine that lets them run over is stuck.
        self.overdue = 0
        # The ticket the Transfer being accepted took its turn of: its slots and gens.
        self._claimed: tuple[np.ndarray, np.ndarray | None] | None = None

    @property
    def stalled(self) -> bool:
        """Whether the copy path is stuck (a hung copy thread, a GPU event that never
        completes): a hit would then hold each step of an engine that loads it up to
        the load's deadline, for as long as it lasts, so lookups miss instead."""
        return self.overdue > 0

    @property
    def inflight(self) -> int:
        return len(self.owners)

    # ------------------------------------------------------------ the one Done
    def done(self, client: Client, msg: m.Transfer | CopyJob, error: Exception | None = None,
             nbytes: int = 0, seconds: float = 0.0) -> m.Done:
        """Build (and count) the Done that ends ``msg``; the caller sends it."""
        if error is None:
            return m.Done(msg.req, msg.event, m.Code.OK, "", nbytes, seconds)
        code = error.code if isinstance(error, KvdError) else m.Code.TRANSFER_FAILED
        self.counters.error(code)
        if code == m.Code.EXPIRED:
            self.counters.expired_transfers += 1
        return m.Done(msg.req, msg.event, code, str(error), 0, seconds)

    def _push(self, client: Client, reply: m.Done | m.EventWaited) -> None:
        if not client.gone or (client.said_bye and isinstance(reply, m.Done)):
            self.send(client.identity, reply)

    # ------------------------------------------------------------ accept
    def handle(self, identity: bytes, msg: m.Transfer) -> m.Reply | None:
        """A Transfer from the socket: its Done now (refused, expired, nothing to copy),
        or None when ``complete`` (or a ticket's arrival) answers later. An Error only
        when no client is known by ``identity`` (it never said Hello)."""
        self.counters.requests += 1
        client = self.clients.get(identity)
        if client is None:
            self.counters.error(m.Code.NOT_REGISTERED)
            return m.Error(msg.req, m.Code.NOT_REGISTERED,
                           "send Hello first (the daemon may have restarted)")
        client.requests += 1
        client.last_seen = self.clock()
        try:
            if self.stopping():
                raise KvdError("kvd is stopping; retry once it is back", m.Code.BUSY)
            reply = self.accept(client, msg)
        except KvdError as e:
            reply = self.done(client, msg, e)
        except Exception as e:  # noqa: BLE001 - an internal error still ends it once
            log.exception("internal error on a Transfer")
            reply = self.done(client, msg, KvdError(f"internal error: {e}"))
        try:
            self.committed()  # what accepting changed, journaled before the reply leaves
        except Exception:  # noqa: BLE001 - a Transfer handed to an engine keeps its Done
            log.exception("writing the journal / KV events failed")
            self.counters.error(m.Code.INTERNAL)
        return reply

    def accept(self, client: Client, msg: m.Transfer) -> m.Done | None:
        """A Transfer arrived: its Done now (refused, expired, nothing to copy), or None
        when a copy job runs (``complete`` answers) or it waits for its ticket."""
        self._claimed = None
        try:
            return self._accept(client, msg)
        except KvdError as e:
            if self._claimed is not None:  # refused after it took its ticket's turn
                self._give_back(*self._claimed)
            return self.done(client, msg, e)
        except Exception as e:  # noqa: BLE001 - a bug still ends it once; and parked
            # Transfers released by an Allocate must each get theirs, not lose the rest
            log.exception("internal error on a Transfer")
            return self.done(client, msg, KvdError(f"internal error: {e}"))

    def _accept(self, client: Client, msg: m.Transfer) -> m.Done | None:
        tenant = client.tenant
        if tenant is None or client.engine is None:
            raise NotRegistered("register memory (Register with a rank) before a Transfer")
        if msg.direction not in (m.Direction.STORE, m.Direction.LOAD):
            raise RequestError(f"bad direction {msg.direction}")
        if msg.deadline_ns < 0:
            raise RequestError(f"bad deadline {msg.deadline_ns}")
        store = msg.direction == m.Direction.STORE
        if len(msg.block_ids) > 4 * self.config.max_keys_per_request:  # arrays scale with it
            raise BadIds(f"{len(msg.block_ids) // 4} blocks in one Transfer; at most "
                         f"{self.config.max_keys_per_request}")
        try:
            blocks = unpack_u32(msg.block_ids).astype(np.uint64)
        except ValueError as e:
            raise BadIds(str(e)) from None
        if msg.ticket:
            if not store or msg.slots:
                raise BadIds("a ticket stands for the slots of a store; send one or the other")
            try:
                claimed = self.tickets.claim(tenant.id, msg.ticket, client.rank,
                                             self.clock())
            except TicketError as e:
                raise BadIds(str(e)) from None
            if claimed is None:  # its Allocate is still on the way (another connection)
                cost = _parked_cost(msg)
                if client.parked_bytes + cost > MAX_PARKED_BYTES:
                    raise KvdError("too many of this connection's Transfers wait for their "
                                   "Allocate already; retry", m.Code.BUSY)
                until = self.clock() + TICKET_WAIT_S
                if msg.deadline_ns:
                    until = min(until, msg.deadline_ns / 1e9)
                self.tickets.park(tenant.id, msg.ticket, (client, msg), until)
                client.parked_bytes += cost
                return None
            ticketed, gens = claimed
            self._claimed = claimed
            if len(blocks) != len(ticketed):
                raise BadIds(f"{len(blocks)} block ids for the {len(ticketed)} keys of "
                             f"ticket {msg.ticket}")
            keep = ticketed != NO_SLOT
            if gens is not None and keep.any():  # given up and handed out again since
                keep[keep] = self.index.gen[ticketed[keep].astype(np.int64)] == gens[keep]
            blocks, ticketed = blocks[keep], ticketed[keep]
            if not ticketed.size:  # kvd holds every block already: nothing to copy
                return self.done(client, msg)
            slots = own_slots(self.index, tenant, ticketed, PENDING)
        else:
            slots = named_slots(self.index, tenant, msg, store)
        check_blocks(client, blocks, slots)
        if store and slots.size:
            done = ((self.index.rank_mask[slots] | self.writing[slots])
                    >> np.uint64(client.rank)) & np.uint64(1)
            if done.any():
                raise BadIds(f"rank {client.rank} already stored (or is storing) slot "
                             f"{int(slots[np.argmax(done)])}")
        job = build_job(self.config, self.index, self.pool_base, client, tenant, msg, blocks,
                        slots)
        if store and slots.size:  # cleared by _settle, which every accepted job reaches
            self.writing[slots] |= np.uint64(1 << client.rank)
        self.index.pin(slots)
        self.owners[job] = client
        client.inflight += 1
        late = expired(job, self.clock())
        if late is not None:  # arrived after its deadline (e.g. the daemon was paused)
            self.complete(job, late, 0.0)
            return None
        try:
            client.engine.submit(job)
        except Exception as e:  # noqa: BLE001 - an engine bug still ends the job once
            log.exception("engine %s refused transfer %d", client.engine.name, job.event)
            self.complete(job, KvdError(f"internal error: {e}"), 0.0)
        return None

    def _give_back(self, ticketed: np.ndarray, gens: np.ndarray | None) -> None:
        """A rank's store by ticket was refused: those blocks can never be whole (every
        rank must store), so the slots still the ticket's go back now, not at their
        pending time (the rank's turn is taken: its retry is refused too)."""
        live = ticketed != NO_SLOT
        held = ticketed[live].astype(np.int64)
        if gens is not None:
            held = held[self.index.gen[held] == gens[live]]
        self.index.abort(held)

    # ------------------------------------------------------------ tickets
    def ticket_in_use(self, tenant: Tenant, ticket: int) -> bool:
        return self.tickets.holds(tenant.id, ticket)

    def add_ticket(self, tenant: Tenant, ticket: int, slots: np.ndarray,
                   until: float) -> None:
        """An Allocate's slots under its ticket; Transfers that overtook it run now."""
        valid = slots != NO_SLOT
        gens = np.zeros(len(slots), dtype=np.uint32)
        gens[valid] = self.index.gen[slots[valid].astype(np.int64)]
        claim_s = self.config.store_claim_ms / 1000
        for sender, transfer in self.tickets.add(tenant.id, ticket, slots, tenant.tp_size,
                                                 until, gens, claim_by=self.clock() + claim_s,
                                                 claim_s=claim_s):
            sender.parked_bytes -= _parked_cost(transfer)
            if not sender.gone:
                reply = self.accept(sender, transfer)
                if reply is not None:
                    self._push(sender, reply)

    # ------------------------------------------------------------ complete
    def complete(self, job: CopyJob, error: Exception | None, seconds: float) -> None:
        """On the loop, once per job: unpin, publish READY or give the store up, Done."""
        client = self.owners.pop(job)
        client.inflight -= 1
        try:
            error = self._settle(client, job, error)
        except Exception as e:  # noqa: BLE001 - the client must still get its one Done
            log.exception("completing transfer %d failed", job.event)
            error = KvdError(f"internal error: {e}")
        if error is None:
            done = self.done(client, job, None, job.nbytes, seconds)
        else:
            done = self.done(client, job, error, seconds=seconds)
        self.on_finished(job.direction, error is None, seconds)
        self._push(client, done)
        if client.gone and client.inflight == 0 and client.engine is not None:
            client.engine.detach(client.id)

    def _settle(self, client: Client, job: CopyJob,
                error: Exception | None) -> Exception | None:
        """Publish or give up what the job copied; the error its Done reports."""
        self.index.unpin(job.slots)
        if job.direction == m.Direction.STORE and job.slots.size:
            self.writing[job.slots] &= ~np.uint64(1 << client.rank)
            if error is None and client.gone:  # it may have reused the memory meanwhile
                error = KvdError("its client left while it was copied: not stored",
                                 m.Code.CLIENT_GONE)
        if error is None and job.direction == m.Direction.STORE:
            # Slots given up while their bytes were copied (the allocation expired, was
            # aborted, or its owner left) store nothing: the Done must not say OK.
            lost = int(np.count_nonzero(self.index.state[job.slots] != PENDING))
            self.index.store_done(job.slots, client.rank, job.checksums)
            self.counters.stored_bytes += job.nbytes
            if lost:
                self.counters.failed_transfers += 1
                error = KvdError(f"{lost} of {len(job.slots)} blocks were given up while "
                                 "they were copied (their allocation expired or was "
                                 "aborted): not stored", m.Code.ABORTED)
        elif error is None:
            self.counters.loaded_blocks += len(job.slots)
            self.counters.loaded_bytes += job.nbytes
        else:
            self.counters.failed_transfers += 1
            if job.direction == m.Direction.STORE:
                self.index.abort(job.slots)  # never READY: every rank must succeed
            if job.corrupt:
                self.counters.corrupt_blocks += len(job.corrupt)
                self.index.discard([int(job.slots[i]) for i in job.corrupt])
            log.warning("transfer %d of client %d failed: %s", job.event, job.client, error)
        self.committed()  # a commit is journaled before its Done leaves
        return error

    def event_waited(self, job: CopyJob) -> None:
        """On the loop: the transfer's wait on its CUDA event passed; the worker may
        record that event again (always before the job's Done)."""
        client = self.owners.get(job)
        if client is not None:
            self._push(client, m.EventWaited(job.req, job.event, job.cuda_event))

    # ------------------------------------------------------------ ending early
    def expire(self, now: float) -> None:
        """Tick: parked Transfers whose ticket never came (or whose deadline passed);
        tickets not every rank stored with in time give their slots back; whether copies
        are overdue."""
        overdue = sum(1 for job in self.owners if job.give_up < now)
        if bool(overdue) != self.stalled:
            if overdue:
                log.warning("%d copies are past their deadline and grace and not ended: the "
                            "copy path is stuck; lookups miss and stores are refused until "
                            "they end", overdue)
            else:
                log.warning("overdue copies ended: lookups and stores are served again")
        self.overdue = overdue
        for slots, gens in self.tickets.unclaimed(now):
            live = slots != NO_SLOT
            held = slots[live].astype(np.int64)
            same = self.index.gen[held] == gens[live]  # not handed out again since
            n = self.index.abort(held[same])
            self.counters.unclaimed_blocks += n
            if n:
                log.info("%d slots of a store not every rank's worker made given back", n)
        for client, msg in self.tickets.expire(now):
            client.parked_bytes -= _parked_cost(msg)
            if client.gone:
                continue
            if msg.deadline_ns and now > msg.deadline_ns / 1e9:
                err: KvdError = KvdError("deadline passed while waiting for the Allocate of "
                                         f"ticket {msg.ticket}", m.Code.EXPIRED)
            else:
                err = BadIds(f"no allocation under ticket {msg.ticket} (never made, expired, "
                             "or every rank stored with it already)")
            self._push(client, self.done(client, msg, err))

    def end_parked(self) -> None:
        """Stopping: Transfers still waiting for their ticket's Allocate end now (a
        stopping daemon answers Allocates BUSY, and its ticks end)."""
        for client, msg in self.tickets.expire(math.inf):
            client.parked_bytes -= _parked_cost(msg)
            if not client.gone:
                self._push(client, self.done(client, msg, KvdError(
                    "kvd is stopping; retry once it is back", m.Code.BUSY)))

    def cancel(self, client: Client) -> None:
        """The client is gone: copy nothing more for it (engines see the deadline, and
        its Transfers still waiting for their Allocate end now)."""
        now = self.clock()
        for job, owner in self.owners.items():
            if owner is client:
                job.deadline = min(job.deadline, now)
        for sender, msg in self.tickets.unpark(lambda item: item[0] is client):
            sender.parked_bytes -= _parked_cost(msg)
            self._push(sender, self.done(sender, msg, KvdError(
                "its client left before the Allocate of its ticket came", m.Code.CLIENT_GONE)))


def _parked_cost(msg: m.Transfer) -> int:
    return len(msg.block_ids) + PARKED_OVERHEAD