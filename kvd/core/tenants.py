"""Tenants: engines whose blocks are interchangeable share one namespace.

A tenant is named by a digest of its fingerprint (model, dtypes, per-rank KV layout,
block tokens, TP size, hash algorithm and root hash). Different fingerprints never see
each other's blocks because every index key is prefixed with the tenant id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any


# Ids are 4 bytes on the wire and in keys; the next new one follows the largest.
MAX_TENANT_ID = 1 << 31


class TenantError(ValueError):
    """A fingerprint that cannot be served (bad sizes, too many tenants)."""


def fingerprint_digest(fields: dict[str, Any]) -> str:
    """Stable digest of a fingerprint's fields (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(fields):
        value = fields[name]
        h.update(name.encode())
        h.update(b"=")
        h.update(value if isinstance(value, bytes) else repr(value).encode())
        h.update(b";")
    return h.hexdigest()[:16]


# Index keys are the tenant's 4-byte prefix + the client's key; this strips the prefix
# (mapped over many keys in C).
unscoped = itemgetter(slice(4, None))


@dataclass
class Tenant:
    id: int
    digest: str
    model: str
    tp_size: int
    rank_page_bytes: tuple[int, ...]
    prefix: bytes = b""
    rank_bytes: int = 0
    slot_bytes: int = 0
    page_offsets: tuple[int, ...] = ()  # offset of each tensor's page inside a rank's share
    blocks: int = 0  # READY blocks held
    full_mask: int = 0  # all ranks stored
    clients: set[int] = field(default_factory=set)
    idle_since: float = 0.0  # when its last client left (0: restored, never joined)
    block_tokens: int = 0  # tokens per block (part of the fingerprint; KV events, counters)
    dropped: bool = False  # forgotten (tenant limit): work still in flight for it lapses

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.tp_size > 64:
            raise TenantError(f"tensor-parallel size {self.tp_size} not in 1..64")
        if not self.rank_page_bytes or min(self.rank_page_bytes) <= 0:
            raise TenantError("a fingerprint needs positive page sizes for every tensor")
        self.prefix = self.id.to_bytes(4, "little")
        self.rank_bytes = sum(self.rank_page_bytes)
        self.slot_bytes = self.rank_bytes * self.tp_size
        offs, acc = [], 0
        for p in self.rank_page_bytes:
            offs.append(acc)
            acc += p
        self.page_offsets = tuple(offs)
        self.full_mask = (1 << self.tp_size) - 1


class Tenants:
    """Fingerprint digest -> Tenant; ids are small integers, never reused in a run."""

    def __init__(self, max_tenants: int = 1024) -> None:
        self._by_digest: dict[str, Tenant] = {}
        self._by_id: dict[int, Tenant] = {}
        self._next = 1
        self.max_tenants = max_tenants

    def find(self, digest: str) -> Tenant | None:
        return self._by_digest.get(digest)

    def create(self, digest: str, *, model: str, tp_size: int,
               rank_page_bytes: tuple[int, ...], block_tokens: int = 0) -> Tenant:
        if len(self._by_id) >= self.max_tenants:
            raise TenantError(f"tenant limit ({self.max_tenants}) reached: every tenant "
                              "has a client or blocks held by a transfer")
        t = Tenant(self._next, digest, model, tp_size, tuple(rank_page_bytes),
                   block_tokens=block_tokens)
        self._next += 1
        self._by_digest[digest] = t
        self._by_id[t.id] = t
        return t

    def get_or_create(
        self, digest: str, *, model: str, tp_size: int, rank_page_bytes: tuple[int, ...]
    ) -> Tenant:
        return self.find(digest) or self.create(
            digest, model=model, tp_size=tp_size, rank_page_bytes=rank_page_bytes)

    def drop(self, tenant: Tenant) -> None:
        """Forget a tenant (its id is not reused: what is left of it is never found)."""
        tenant.dropped = True
        self._by_id.pop(tenant.id, None)
        if self._by_digest.get(tenant.digest) is tenant:
            del self._by_digest[tenant.digest]

    def idle(self) -> list[Tenant]:
        """Tenants without clients: those holding no block first, then the longest idle."""
        return sorted((t for t in self._by_id.values() if not t.clients),
                      key=lambda t: (t.blocks > 0, t.idle_since, t.id))

    def make_room(self, evict: Callable[[Tenant], int]) -> list[tuple[Tenant, int]]:
        """At the limit, drop idle tenants until one more fits; ``evict`` frees a
        tenant's blocks (returns how many). A tenant with a block still held (leased,
        being copied) stays; its tier reads in flight lapse (``Tenant.dropped``).
        Returns (tenant, blocks evicted) per tenant dropped."""
        dropped: list[tuple[Tenant, int]] = []
        if len(self._by_id) < self.max_tenants:
            return dropped
        for t in self.idle():
            n = evict(t) if t.blocks else 0
            if t.blocks == 0:
                self.drop(t)
                dropped.append((t, n))
                if len(self._by_id) < self.max_tenants:
                    break
        return dropped

    def restore(self, tenant_id: int, digest: str, *, model: str, tp_size: int,
                rank_page_bytes: tuple[int, ...], block_tokens: int = 0) -> Tenant:
        """Recreate a tenant with the id it had before a restart."""
        if not 0 <= tenant_id < MAX_TENANT_ID:  # (ids count up from 1: a journal's are)
            raise TenantError(f"tenant id {tenant_id} out of range")
        t = Tenant(tenant_id, digest, model, tp_size, tuple(rank_page_bytes),
                   block_tokens=block_tokens)
        old = self._by_digest.get(digest)
        if old is None or old.id < tenant_id:  # one dropped and made again: the newer
            self._by_digest[digest] = t
        self._by_id[tenant_id] = t
        self._next = max(self._next, tenant_id + 1)
        return t

    def get(self, tenant_id: int) -> Tenant | None:
        return self._by_id.get(tenant_id)

    def __iter__(self):
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)
