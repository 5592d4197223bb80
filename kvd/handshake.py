"""Hello and Register: who may connect, and which tenant (model fingerprint) a
connection joins, with its memory opened for copies.

Part of ``kvd.service.Service`` (event loop only); the annotations name the service
state these handlers use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import msgspec

from kvd.access import Access, Peer
from kvd.clients import Client
from kvd.config import Config
from kvd.core.allocator import AllocatorError
from kvd.core.index import Index
from kvd.core.tenants import TenantError, Tenants, fingerprint_digest
from kvd.engines.base import TransferEngine
from kvd.errors import KvdError, RequestError
from kvd.persist import Persistence
from kvd.pool import Pool
from kvd.registration import MAX_NAME, attach_memory, check_register
from kvd_proto import messages as m

log = logging.getLogger("kvd.service")  # handlers log as the service


class HandshakeRequests:
    config: Config
    index: Index
    tenants: Tenants
    pool: Pool
    engines: dict[str, TransferEngine]
    persist: Persistence | None
    clients: dict[bytes, Client]
    instance: str
    clock: Callable[[], float]
    on_client: Callable[[Client], None] | None
    _next_client: int

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
