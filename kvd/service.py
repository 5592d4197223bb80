"""Turns requests into core operations; hands Transfers to ``kvd.transfers``.

Runs on the event loop only (no locks). ``handle`` answers every request at once,
except Transfer, which ``Transfers`` ends with exactly one Done. Every input is
validated; a bad one gets a typed Error (a Transfer: a Done) and changes nothing.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

import msgspec
import numpy as np

from kvd.access import ACCESS_KEYS, Access, Peer
from kvd.config import Config
from kvd.core.allocator import Allocator, AllocatorError
from kvd.core.index import PENDING, READY, Index
from kvd.core.states import NO_SLOT
from kvd.core.policies import DEFAULT_POLICY, make_policy
from kvd.core.tenants import Tenant, TenantError, Tenants, fingerprint_digest
from kvd.engines.base import TransferEngine
from kvd.errors import BadIds, KvdError, NotRegistered, RequestError
from kvd.events import TenantInfo
from kvd.journal import Header
from kvd.persist import Persistence
from kvd.pool import Pool
from kvd.publisher import KvEvents
from kvd.registration import MAX_NAME, attach_memory, check_register
from kvd.status import Sources, status_document
from kvd.tiers.tiering import TierCounters, Tiering
from kvd.transfers import Client, Counters, Transfers, own_slots
from kvd_proto import messages as m
from kvd_proto.ids import pack_u32, unpack_u32

log = logging.getLogger("kvd.service")
# Sizes no engine comes near (see kvd.registration): a key is kept for its block's life.
MAX_KEY = 1024  # bytes of one block key (vLLM's are 36)
MAX_DEPTH = (1 << 32) - 1  # a block's position in its request, as tier headers keep it
# Ticks further apart than this mean the daemon did not run (SIGSTOP, a frozen VM, a
# starved CPU): the time beyond it is not held against its clients' silence.
AWAY_S = 1.0
Send = Callable[[bytes, m.Reply], None]



def new_index(config: Config) -> Index:
    """The pool's index and policy. The policy is built for ``max_slots`` (blocks of
    ``min_slot_bytes``) and sized to the model's blocks once they are known."""
    alloc = Allocator(config.pool_size, config.extent_size, config.min_slot_bytes)
    policy = make_policy(config.policy or DEFAULT_POLICY, alloc.max_slots)
    return Index(alloc, policy, record=config.persist or bool(config.events_endpoint),
                 first_lease=1 + (int.from_bytes(os.urandom(6), "little") << 7))

class Service:
    def __init__(self, config: Config, pool: Pool, engines: dict[str, TransferEngine],
                 send: Send, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.engines = engines
        self.send = send
        self.clock = clock
        # Set by the shell: start a reload, then call the answer with its outcome.
        self.reloader: Callable[[Callable[[m.Code, str], None]], None] | None = None
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
            self.kv_events.clear(self._held(), self.persist.recovery.not_kept
                                 if self.persist is not None else None)
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

    def _held(self) -> list[tuple]:
        """Every READY block as a commit tuple, for the event stream: chain by chain,
        each block after its parent (depth first, so a chain stays one BlockStored)."""
        blocks = self.index.live_blocks()
        held = {(b[0], b[1]) for b in blocks}
        children: dict[tuple[int, bytes], list[tuple]] = {}
        roots = []
        for b in sorted(blocks, key=lambda b: b[3]):
            if b[5] is not None and (b[0], b[5]) in held:
                children.setdefault((b[0], b[5]), []).append(b)
            else:
                roots.append(b)
        out = []
        stack = roots[::-1]
        while stack:
            b = stack.pop()
            out.append(("commit", *b))
            stack.extend(children.get((b[0], b[1]), ())[::-1])
        if len(out) < len(blocks):  # parents in a cycle (a raw client's): still announced
            seen = {(c[1], c[2]) for c in out}
            out += [("commit", *b) for b in blocks if (b[0], b[1]) not in seen]
        return out

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
                return self._admin(msg)
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
                self._check_ids(msg.slots)
                slots = own_slots(self.index, tenant, msg.slots, PENDING)
                if not self.index.allocated_by(slots, client.id):
                    raise BadIds("a slot of this Abort was allocated by another connection")
                return m.Ok(msg.req, self.index.abort(slots))
            raise RequestError(f"unexpected message {type(msg).__name__}")
        except KvdError as e:
            self.counters.error(e.code)
            return m.Error(msg.req, e.code, str(e))

    def error(self, req: int, code: m.Code, message: str) -> m.Error:
        self.counters.error(code)
        return m.Error(req, code, message)

    def _reload(self, identity: bytes, req: int) -> None:
        """kvdctl reload: answered once the configuration is read and applied or refused
        (the lifecycle's reload, as on SIGHUP)."""
        if self.reloader is None:
            raise RequestError("this daemon cannot reload (no configuration source)")

        def answer(code: m.Code, summary: str) -> None:  # (not a protocol error: uncounted)
            self.send(identity, m.Reloaded(req, summary) if code == m.Code.OK
                      else m.Error(req, code, summary))

        self.reloader(answer)

    def _admin(self, msg: m.Evict | m.Flush | m.GetConfig) -> m.Reply:
        """Operator requests (kvdctl); they need a Hello, not a tenant."""
        if isinstance(msg, m.GetConfig):
            values = msgspec.json.encode(self.config)
            return m.ConfigOk(msg.req, values, dict(self.origins))
        tenant = -1 if isinstance(msg, m.Flush) else msg.tenant
        target = None if tenant == -1 else self.tenants.get(tenant)
        if tenant != -1 and target is None:
            raise RequestError(f"no tenant {tenant}")
        n = self.index.evict_tenant(target)
        if target is None and self.kv_events is not None:
            self.commit()
            self.kv_events.clear(self._held())
        log.info("admin %s: evicted %d blocks", type(msg).__name__.lower(), n)
        return m.Ok(msg.req, n)

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: the new config's live keys apply from the next request on (the
        lifecycle decides which keys are live; parts that cache a value refresh here)."""
        old, self.config = self.config, config
        self.transfers.config = config
        self.tenants.max_tenants = config.max_tenants
        if any(getattr(old, k) != getattr(config, k) for k in ACCESS_KEYS):
            self._recheck_access()

    def _recheck_access(self) -> None:
        """Apply changed access rules to the clients already connected: one whose uid
        (or group) is no longer allowed is forgotten as if it went away (its leases and
        stores released; its next request is told to Hello, which is refused), and
        admin rights follow ``admin_uids``. Only when those rules changed: a group
        membership is read from /proc, which a reload of another key must not risk."""
        access = self.access
        for client in list(self.clients.values()):
            peer = Peer(client.peer_pid, client.uid, client.gid)
            if not access.allowed(peer):
                log.warning("uid %d (pid %d) is no longer allowed: dropping client %d",
                            client.uid, client.pid, client.id)
                self.client_gone(client.identity, "no longer allowed")
            else:
                client.admin = access.admin(peer)

    # ------------------------------------------------------------ handshake
    @property
    def access(self) -> Access:
        """Built from the current config (a SIGHUP reload replaces the config)."""
        if getattr(self, "_access_for", None) is not self.config:
            self._access, self._access_for = Access(self.config), self.config
        return self._access

    def _hello(self, identity: bytes, peer: Peer, msg: m.Hello) -> m.Reply:
        if not self.access.allowed(peer):
            log.warning("refused a connection from uid %d (pid %d)", peer.uid, peer.pid)
            raise KvdError(f"uid {peer.uid} may not use this kvd: not in allowed_uids or "
                           "allowed_groups", m.Code.FORBIDDEN)
        if msg.version != m.PROTOCOL_VERSION:
            raise KvdError(
                f"protocol version mismatch: client speaks {msg.version}, "
                f"daemon speaks {m.PROTOCOL_VERSION}; upgrade the older side",
                m.Code.VERSION_MISMATCH,
            )
        if identity in self.clients:  # its Transfers' Dones would be lost with it
            raise RequestError("this connection said Hello already; a new session needs "
                               "a new connection")
        client = Client(self._next_client, identity, peer.pid or msg.pid, msg.name[:MAX_NAME],
                        msg.pid,
                        peer_pid=peer.pid, address=peer.address, uid=peer.uid, gid=peer.gid,
                        admin=self.access.admin(peer),
                        last_seen=self.clock())
        self._next_client += 1
        self.clients[identity] = client
        if self.on_client is not None:
            self.on_client(client)
        return m.HelloOk(msg.req, m.PROTOCOL_VERSION, os.getpid(), self.instance, client.id,
                         peer.pid,  # 0 when the kernel did not say: the client cannot tell
                         time.monotonic_ns())

    def _register(self, client: Client, msg: m.Register) -> m.Reply:
        fp = msg.fingerprint
        check_register(client, msg)  # before the tenant exists: a refusal leaves nothing
        pages = fp.rank_page_bytes
        digest = fingerprint_digest(msgspec.structs.asdict(fp))
        try:
            self.index.allocator.check_slot_bytes(sum(pages) * fp.tp_size)
        except AllocatorError as e:
            raise RequestError(str(e)) from None
        if msg.rank >= 0:
            # Before a tenant is made or another dropped to make room for it: a Register
            # refused for its memory changes nothing.
            attach_memory(self.engines, client, tuple(pages), msg)
        try:
            tenant = self.tenants.find(digest)
            if tenant is None:
                self._make_room_for_a_tenant()
                tenant = self.tenants.create(
                    digest, model=fp.model, tp_size=fp.tp_size, rank_page_bytes=tuple(pages),
                    block_tokens=fp.block_tokens)
                if self.persist is not None:
                    self.persist.tenant_added(tenant)
        except TenantError as e:
            if client.engine is not None:  # what attach opened closes with the refusal
                client.engine.detach(client.id)
                client.engine = None
            raise RequestError(str(e)) from None
        client.tenant, client.rank = tenant, msg.rank
        if tenant.block_tokens != fp.block_tokens:  # restored from an older journal
            tenant.block_tokens = fp.block_tokens
            if self.persist is not None:
                self.persist.tenant_added(tenant)
        tenant.clients.add(client.id)
        log.info("client %d (pid %d, %s) joined tenant %d (%s) as rank %d%s", client.id,
                 client.pid, client.name or "-", tenant.id, tenant.model, msg.rank,
                 f", copying itself: {msg.client_copy_reason}" if msg.client_copy else "")
        if not msg.client_copy:
            return m.Registered(msg.req, tenant.id, tenant.slot_bytes, tenant.rank_bytes)
        alloc = self.index.allocator
        return m.Registered(msg.req, tenant.id, tenant.slot_bytes, tenant.rank_bytes,
                            self.pool.path, alloc.extent_bytes, alloc.slots_per_extent_max)

    def _make_room_for_a_tenant(self) -> None:
        """At the tenant limit a tenant no client uses gives up its place (and its blocks
        in RAM): engines restarted with new fingerprints (a random root hash without
        PYTHONHASHSEED, new weights) must not be refused for good. Its blocks could
        only serve an engine of the same fingerprint, which then gets a new tenant; the
        tiers find theirs again by the fingerprint's digest."""
        for t, n in self.tenants.make_room(self.index.evict_tenant):
            self.index.forget(t)
            if self.persist is not None:
                self.persist.tenant_dropped()
            log.info("tenant %d (%s), without clients, dropped with %d blocks: the tenant "
                     "limit (%d) is reached", t.id, t.model, n, self.tenants.max_tenants)

    # ------------------------------------------------------------ index
    def _check_keys(self, keys: list[bytes], depth: int, length: int = 0) -> None:
        if not (0 <= depth and depth + len(keys) <= MAX_DEPTH and 0 <= length <= MAX_DEPTH):
            raise RequestError(f"depth {depth} / length {length} with {len(keys)} keys: "
                               f"positions must lie in 0..{MAX_DEPTH}")
        if len(keys) > self.config.max_keys_per_request:
            raise RequestError(f"{len(keys)} keys in one request; at most "
                               f"{self.config.max_keys_per_request}")
        if keys and max(map(len, keys)) > MAX_KEY:
            raise RequestError(f"a key is longer than {MAX_KEY} bytes")

    def _lookup(self, client: Client, tenant: Tenant, msg: m.Lookup) -> m.Reply:
        self._check_keys(msg.keys, msg.depth)
        stalled = self.transfers.stalled  # a hit's load would wait out its deadline
        room = self.config.max_leased_blocks - self.index.leased_by.get(client.id, 0)
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

    def _allocate(self, client: Client, tenant: Tenant, msg: m.Allocate) -> m.Reply:
        if msg.ticket and self.transfers.ticket_in_use(tenant, msg.ticket):
            raise RequestError(f"ticket {msg.ticket} is in use; pick another")
        now = self.clock()
        pending_s = min(max(msg.pending_ms, 1), self.config.max_pending_ms) / 1000
        try:
            self._check_keys(msg.keys, msg.depth, msg.length)
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
            pending = self.index.pending_by
            share = max(1, self.index.allocator.total_slots(tenant.slot_bytes) * 3 // 4)
            room = min(self.config.max_pending_blocks - pending.get(client.id, 0),
                       share - sum(pending.get(c, 0) for c in tenant.clients))
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

    def _release(self, client: Client, msg: m.Release) -> m.Reply:
        if self.index.lease_owner(msg.lease) not in (None, client.id):
            raise BadIds(f"lease {msg.lease} belongs to another client")
        slots = None
        if msg.slots:
            self._check_ids(msg.slots)
            try:
                slots = unpack_u32(msg.slots).astype(np.int64)
            except ValueError as e:
                raise BadIds(str(e)) from None
        return m.Ok(msg.req, int(self.index.release(msg.lease, slots=slots)))

    def _check_ids(self, packed: bytes) -> None:
        """Slot ids a request names are capped as a Transfer's are (4 M ids were 0.2 s of
        the loop's time)."""
        if len(packed) > 4 * self.config.max_keys_per_request:
            raise BadIds(f"{len(packed) // 4} slot ids in one request; at most "
                         f"{self.config.max_keys_per_request}")

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

