"""The service object: all daemon state, and each request dispatched to its handler.

Runs on the event loop only (no locks). ``handle`` answers every request at once,
except Transfer, which ``Transfers`` ends with exactly one Done. Every input is
validated; a bad one gets a typed Error (a Transfer: a Done) and changes nothing.
Handlers live by concern in ``kvd.handshake`` (Hello, Register), ``kvd.leases``
(Lookup, Release), ``kvd.stores`` (Allocate, Abort) and ``kvd.admin`` (kvdctl).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

import msgspec
import numpy as np

from kvd.access import Peer
from kvd.admin import AdminRequests, Eviction
from kvd.clients import Client
from kvd.config import Config
from kvd.core.allocator import Allocator
from kvd.core.index import PENDING, READY, Index
from kvd.core.policies import DEFAULT_POLICY, make_policy
from kvd.core.snapshot import live_blocks
from kvd.core.tenants import Tenants
from kvd.counters import Counters
from kvd.engines.base import TransferEngine
from kvd.errors import KvdError, NotRegistered, RequestError
from kvd.events import TenantInfo, held_commits
from kvd.handshake import HandshakeRequests
from kvd.journal import Header
from kvd.leases import LeaseRequests
from kvd.persist import Persistence
from kvd.pool import Pool
from kvd.publisher import KvEvents
from kvd.status import Sources, status_document
from kvd.stores import StoreRequests
from kvd.tiers.tiering import TierCounters, Tiering
from kvd.transfers import Send, Transfers
from kvd_proto import messages as m

log = logging.getLogger("kvd.service")
# Ticks further apart than this mean the daemon did not run (SIGSTOP, a frozen VM, a
# starved CPU): the time beyond it is not held against its clients' silence.
AWAY_S = 1.0


def new_index(config: Config) -> Index:
    """The pool's index and policy. The policy is built for ``max_slots`` (blocks of
    ``min_slot_bytes``) and sized to the model's blocks once they are known."""
    alloc = Allocator(config.pool_size, config.extent_size, config.min_slot_bytes)
    policy = make_policy(config.policy or DEFAULT_POLICY, alloc.max_slots)
    return Index(alloc, policy, record=config.persist or bool(config.events_endpoint),
                 first_lease=1 + (int.from_bytes(os.urandom(6), "little") << 7))


class Service(HandshakeRequests, LeaseRequests, StoreRequests, AdminRequests):
    """The daemon's state, owned by the event loop; the bases hold its handlers."""

    def __init__(self, config: Config, pool: Pool, engines: dict[str, TransferEngine],
                 send: Send, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.engines = engines
        self.send = send
        self.clock = clock
        # Set by the shell: start a reload, then call the answer with its outcome.
        self.reloader: Callable[[Callable[[m.Code, str], None]], None] | None = None
        # Set by the shell: call a function soon, on the event loop (None: work that
        # would go in parts is done at once).
        self.later: Callable[[Callable[[], None]], object] | None = None
        self.evictions: dict[Eviction, None] = {}
        self.instance = uuid.uuid4().hex
        self.started = time.monotonic()
        self._last_tick = clock()
        self.index = new_index(config)
        self.policy_name = self.index.policy.name
        self.tenants = Tenants(config.max_tenants)
        self.persist: Persistence | None = None
        if config.persist:
            self.persist = Persistence(config.journal, Header(
                config.pool_size, config.extent_size, config.min_slot_bytes))
            self.persist.recover(self.index, self.tenants, pool.array, pool.reused)
        self.kv_events: KvEvents | None = None  # fleet routing (kvd.publisher)
        if config.events_endpoint:
            self.kv_events = KvEvents(
                config.events_endpoint, config.events_replay_endpoint,
                topic=config.events_topic, node=config.events_node, hwm=config.events_hwm,
                int_hashes=config.events_int_hashes, info=self._tenant_info,
                tenants=lambda: [t.id for t in self.tenants], holds=self.index.holds)
            # A (re)start: what it holds now, and the topics of tenants it did not keep.
            not_kept = self.persist.recovery.not_kept if self.persist is not None else None
            self.kv_events.clear(held_commits(live_blocks(self.index)), not_kept)
        self.clients: dict[bytes, Client] = {}
        self.counters = Counters()
        self.transfers = Transfers(config, self.index, pool.base, send, clock, self.counters,
                                   committed=self.commit, clients=self.clients,
                                   stopping=lambda: self.stopping)
        self.tiering: Tiering | None = None  # set by the server when tiers are configured
        self._next_client = 1
        self.on_client = None  # set by the server: watch a new client's pid
        self.extra_status: Callable[[], dict] = dict  # the shell adds what it owns
        self.origins: dict[str, str] = {}  # config key -> where its value came from
        self.stopping = False  # set on SIGTERM: new work is refused with BUSY
        self.pool_fault = ""  # why the pool file is not whole ('' when it is)
        self._pool_removed = False  # said once: an unlinked pool file is not found again

    # ------------------------------------------------------------ dispatch
    def handle(self, identity: bytes, peer: Peer, msg: m.Request) -> m.Reply | None:
        """Any request; a Transfer goes to its owner, ``transfers`` (the server hands
        Transfers there itself: the data path does not pass through here)."""
        if isinstance(msg, m.Transfer):
            return self.transfers.handle(identity, msg)
        reply = self._dispatch(identity, peer, msg)
        self.commit()  # journaled before the reply leaves
        return reply

    @property
    def inflight(self) -> int:
        """Transfers inside an engine, not completed yet."""
        return self.transfers.inflight

    def commit(self) -> None:
        """The index's queued changes go to the journal, the KV event stream and the
        tiers (evicted blocks are copied out before the reply hands their slots out)."""
        if self.tiering is not None:
            self.tiering.after_changes()
        if self.kv_events is not None and self.index.events:
            self.kv_events.add(self.index.events)
            if self.persist is None:
                self.index.events = []
        if self.persist is not None:
            self.persist.drain(self.index)

    def _tenant_info(self, tenant_id: int) -> TenantInfo:
        t = self.tenants.get(tenant_id)
        return TenantInfo(t.model if t else "", t.block_tokens if t else 0)

    def _dispatch(self, identity: bytes, peer: Peer, msg: m.Request) -> m.Reply | None:
        self.counters.requests += 1
        try:
            if isinstance(msg, m.Hello):
                return self._hello(identity, peer, msg)
            if isinstance(msg, m.Bye):  # not answered: the client is gone
                if (leaving := self.clients.get(identity)) is not None:
                    leaving.said_bye = True  # its close waits for its Transfers' Dones
                self.client_gone(identity, "said bye")
                return None
            client = self.clients.get(identity)
            if client is None:
                raise NotRegistered("send Hello first (the daemon may have restarted)")
            client.requests += 1
            client.last_seen = self.clock()
            if self.stopping and isinstance(msg, (m.Register, m.Lookup, m.Allocate)):
                raise KvdError("kvd is stopping; retry once it is back", m.Code.BUSY)
            if isinstance(msg, m.Ping):
                return m.Ok(msg.req)
            if isinstance(msg, m.Stats):
                return m.StatsOk(msg.req, msgspec.json.encode(self.status()))
            if isinstance(msg, m.Register):
                return self._register(client, msg)
            if isinstance(msg, (m.Evict, m.Flush, m.GetConfig, m.Reload)):
                if not client.admin:
                    raise KvdError(f"uid {client.uid} may not {type(msg).__name__.lower()}: "
                                   "not in admin_uids", m.Code.FORBIDDEN)
                if isinstance(msg, m.Reload):
                    return self._reload(identity, msg.req)
                return self._admin(identity, msg)
            tenant = client.tenant
            if tenant is None:
                raise NotRegistered("send Register first")
            if isinstance(msg, m.Lookup):
                return self._lookup(client, tenant, msg)
            if isinstance(msg, m.Allocate):
                return self._allocate(client, tenant, msg)
            if isinstance(msg, m.Release):
                return self._release(client, msg)
            if isinstance(msg, m.Abort):
                return self._abort(client, tenant, msg)
            raise RequestError(f"unexpected message {type(msg).__name__}")
        except KvdError as e:
            self.counters.error(e.code)
            return m.Error(msg.req, e.code, str(e))

    def error(self, req: int, code: m.Code, message: str) -> m.Error:
        self.counters.error(code)
        return m.Error(req, code, message)

    # ------------------------------------------------------------ housekeeping
    def idle(self) -> None:
        """Work deferred until the replies of a burst are out (policy touches)."""
        self.index.flush()
        if self.kv_events is not None:
            self.kv_events.flush()

    def tick(self) -> None:
        now = self.clock()
        self.index.expire(now)
        self.transfers.expire(now)
        limit = self.config.client_timeout_ms / 1000
        away, self._last_tick = now - self._last_tick - AWAY_S, now
        if away > 0:  # the daemon itself was stopped or starved: that silence is its own,
            for c in self.clients.values():  # and their pings wait unread in the socket
                c.last_seen += away
        for identity in [i for i, c in self.clients.items() if now - c.last_seen > limit]:
            log.warning("client %d (pid %d) silent for %.1fs: dropped",
                        self.clients[identity].id, self.clients[identity].pid, limit)
            self.client_gone(identity)
        self._check_pool()
        self.commit()
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.persist is not None:
            self.persist.finish_compaction()
            self.persist.maybe_compact(self.index, self.tenants)

    def _check_pool(self) -> None:
        """Another process cut the pool file or punched a hole in it: the blocks may have
        lost their bytes, so none is served again (their loads would copy zeros, or fail
        as the client's bad address). Every block goes, stores in flight too; the file is
        made whole again."""
        if not self._pool_removed and self.pool.removed():
            self._pool_removed = True
            if self.persist is not None:
                log.error("pool file %s was removed: its blocks are still served, but the "
                          "next start will not find them (persistence is lost)",
                          self.pool.path)
            else:
                log.warning("pool file %s was removed: kvd serves on from its memory, "
                            "which is freed when kvd stops", self.pool.path)
        why = self.pool.damage()
        if not why:
            if self.pool_fault:  # (whole again by some other hand)
                log.warning("pool file %s is whole again: stores are taken again",
                            self.pool.path)
            self.pool_fault = ""
            return
        state = self.index.state
        dropped = self.index.discard(np.flatnonzero(state == READY).tolist())
        dropped += self.index.abort(np.flatnonzero(state == PENDING))
        if failed := self.pool.reserve_again():
            why = f"{why}; {failed}"
        whole = not self.pool.damage()
        if not self.pool_fault:  # once per fault (stores are refused meanwhile)
            log.error("pool file %s %s: its blocks may have lost their bytes; %d blocks "
                      "dropped; %s", self.pool.path, why, dropped,
                      "it is whole again" if whole else
                      "stores are refused until it is whole again")
        elif whole:
            log.warning("pool file %s is whole again: stores are taken again",
                        self.pool.path)
        self.pool_fault = "" if whole else why

    def client_gone(self, identity: bytes, why: str = "gone") -> None:
        client = self.clients.pop(identity, None)
        if client is None:
            return
        client.gone = True
        self.transfers.cancel(client)
        leases, pending = self.index.drop_owner(client.id)
        if client.tenant is not None:
            client.tenant.clients.discard(client.id)
            client.tenant.idle_since = self.clock()
        if client.engine is not None:  # fails what is queued; closes after the copies
            client.engine.detach(client.id)
        log.info("client %d (pid %d) %s: released %d leases, %d pending blocks",
                 client.id, client.pid, why, leases, pending)

    def client_by_pid(self, pid: int) -> list[bytes]:
        return [c.identity for c in self.clients.values() if c.pid == pid]

    def status(self) -> dict:
        events = self.kv_events.status() if self.kv_events else {"enabled": False}
        tiers = self.tiering.status() if self.tiering else {}
        doc = status_document(Sources(
            self.instance, self.started, self.policy_name, self.pool, self.index,
            self.tenants, self.clients.values(), self.counters, self.inflight, self.persist,
            {"events": events, "tiers": tiers, **self.extra_status()},
            self.transfers.overdue))
        tc = self.tiering.counter_values() if self.tiering else TierCounters().values()
        doc["counters"].update(tc)
        doc["pool"]["fault"] = self.pool_fault
        return doc
