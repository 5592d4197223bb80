"""Operator requests (kvdctl: Evict, Flush, GetConfig, Reload) and a reload applied to
the running service, connected clients' access included. They need a Hello, not a tenant.

Part of ``kvd.service.Service`` (event loop only); the annotations name the service
state these handlers use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import numpy as np

from kvd.access import ACCESS_KEYS, Access, Peer
from kvd.clients import Client
from kvd.config import Config
from kvd.core.index import Index
from kvd.core.snapshot import live_blocks
from kvd.core.tenants import Tenant, Tenants
from kvd.errors import RequestError
from kvd.events import held_commits
from kvd.publisher import KvEvents
from kvd.transfers import Send, Transfers
from kvd_proto import messages as m

log = logging.getLogger("kvd.service")  # handlers log as the service
# Blocks an admin eviction drops in one turn of the event loop (about 40 ms on 2 cores):
# a million at once held every engine's requests two seconds.
EVICT_PART = 16384


@dataclass(eq=False)
class Eviction:
    """An admin eviction under way, in parts: whom to answer, and what is left."""

    identity: bytes
    msg: m.Evict | m.Flush
    target: Tenant | None
    slots: np.ndarray  # the slots its next parts look at
    evicted: int = 0


class AdminRequests:
    config: Config
    index: Index
    tenants: Tenants
    transfers: Transfers
    clients: dict[bytes, Client]
    kv_events: KvEvents | None
    origins: dict[str, str]
    send: Send
    reloader: Callable[[Callable[[m.Code, str], None]], None] | None
    access: Access
    commit: Callable[[], None]
    client_gone: Callable[[bytes, str], None]
    later: Callable[[Callable[[], None]], object] | None
    error: Callable[[int, m.Code, str], m.Error]
    evictions: dict[Eviction, None]  # admin evictions under way (in parts), in order

    def _reload(self, identity: bytes, req: int) -> None:
        """kvdctl reload: answered once the configuration is read and applied or refused
        (the lifecycle's reload, as on SIGHUP)."""
        if self.reloader is None:
            raise RequestError("this daemon cannot reload (no configuration source)")

        def answer(code: m.Code, summary: str) -> None:  # (not a protocol error: uncounted)
            self.send(identity, m.Reloaded(req, summary) if code == m.Code.OK
                      else m.Error(req, code, summary))

        self.reloader(answer)

    def _admin(self, identity: bytes, msg: m.Evict | m.Flush | m.GetConfig) -> m.Reply | None:
        """Operator requests (kvdctl); they need a Hello, not a tenant. An eviction of
        more than ``EVICT_PART`` blocks goes in parts, requests served in between, and is
        answered after its last part (None here)."""
        if isinstance(msg, m.GetConfig):
            values = msgspec.json.encode(self.config)
            return m.ConfigOk(msg.req, values, dict(self.origins))
        tenant = -1 if isinstance(msg, m.Flush) else msg.tenant
        target = None if tenant == -1 else self.tenants.get(tenant)
        if tenant != -1 and target is None:
            raise RequestError(f"no tenant {tenant}")
        slots = self.index.evictable(target)
        if self.later is None or len(slots) <= EVICT_PART:
            return self._evicted(msg, target, self.index.evict_slots(slots, target))
        ev = Eviction(identity, msg, target, slots)
        self.evictions[ev] = None
        self._evict_part(ev)
        return None

    def _evict_part(self, ev: Eviction, part: int | None = None) -> None:
        """One part of an admin eviction (``part`` blocks: ``EVICT_PART`` by default);
        the next is called soon, after the requests that came meanwhile; the last
        answers. One finished already (``finish_evictions``) is not taken up again."""
        if ev not in self.evictions:
            return
        n = EVICT_PART if part is None else part
        try:
            ev.evicted += self.index.evict_slots(ev.slots[:n], ev.target)
            ev.slots = ev.slots[n:]
            if len(ev.slots):
                self.commit()
                assert self.later is not None
                self.later(partial(self._evict_part, ev))
                return
            reply: m.Reply = self._evicted(ev.msg, ev.target, ev.evicted)
            self.commit()
        except Exception as e:  # noqa: BLE001 - answered, never left waiting
            log.exception("admin %s failed", type(ev.msg).__name__.lower())
            reply = self.error(ev.msg.req, m.Code.INTERNAL,
                               f"{type(ev.msg).__name__} failed: {e}")
        self.evictions.pop(ev, None)
        self.send(ev.identity, reply)

    def finish_evictions(self) -> None:
        """The daemon stops: the evictions under way finish now, in one piece, and are
        answered before the journal, the event stream and the socket close (their next
        parts would come after)."""
        for ev in list(self.evictions):
            self._evict_part(ev, len(ev.slots))

    def _evicted(self, msg: m.Evict | m.Flush, target: Tenant | None, n: int) -> m.Ok:
        if target is None and self.kv_events is not None:
            self.commit()
            self.kv_events.clear(held_commits(live_blocks(self.index)))
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
