"""The interface of a tier below the RAM pool, its registry, and the block header.

A tier keeps blocks the pool let go of (disk) or shares them with other nodes (remote).
It only ever holds whole, checksummed blocks: every value starts with a ``BlockHeader``
naming its tenant namespace, key and length and carrying the payload's xxh3, so a torn,
stale, corrupt or foreign value reads as a miss, never as a block.
"""

from __future__ import annotations

import importlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import xxhash

from kvd.errors import TierError  # noqa: F401 - re-exported for tier modules

MAGIC = b"KVT1"
HEADER_BYTES = 128  # fixed, so a payload starts at the same offset in every value
_FIXED = struct.Struct("<4sIQIHH")  # magic, payload length, xxh3, depth, ns len, key len


@dataclass(frozen=True, slots=True)
class BlockHeader:
    ns: bytes  # the tenant's fingerprint digest
    key: bytes  # the block's key (vLLM's OffloadKey bytes)
    length: int  # payload bytes
    checksum: int  # xxh3-64 of the payload
    depth: int = 0  # position in its request's prefix chain (for the tier's policy)

    def pack(self) -> bytes:
        """ValueError (never struct.error) when a field does not fit the header: a tier
        declines that block and keeps the rest of its batch."""
        try:
            fixed = _FIXED.pack(MAGIC, self.length, self.checksum, self.depth, len(self.ns),
                                len(self.key))
        except struct.error as e:
            raise ValueError(f"block header: {e}") from None
        head = fixed + self.ns + self.key
        if len(head) > HEADER_BYTES:
            raise ValueError(f"namespace + key of {len(self.ns) + len(self.key)} bytes do "
                             f"not fit a {HEADER_BYTES}-byte header")
        return head.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def of(cls, ns: bytes, key: bytes, payload: Any, depth: int = 0) -> BlockHeader:
        """The header of ``payload`` (any buffer), its checksum computed here."""
        view = memoryview(payload).cast("B")
        return cls(ns, key, view.nbytes, xxhash.xxh3_64_intdigest(view), depth)

    @classmethod
    def unpack(cls, data: Any) -> BlockHeader | None:
        """The header at the start of ``data``; None when it is not one."""
        view = memoryview(data).cast("B")
        if view.nbytes < HEADER_BYTES:
            return None
        magic, length, checksum, depth, ns_len, key_len = _FIXED.unpack_from(view)
        end = _FIXED.size + ns_len + key_len
        if magic != MAGIC or end > HEADER_BYTES:
            return None
        ns = bytes(view[_FIXED.size:_FIXED.size + ns_len])
        return cls(ns, bytes(view[_FIXED.size + ns_len:end]), length, checksum, depth)

    def matches(self, ns: bytes, key: bytes, payload: Any) -> bool:
        """Whether ``payload`` is this header's block for (ns, key), bytes intact."""
        view = memoryview(payload).cast("B")
        return (self.ns == ns and self.key == key and self.length == view.nbytes
                and xxhash.xxh3_64_intdigest(view) == self.checksum)


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One block on its way down: its key, chain depth and bytes (a buffer the caller
    keeps alive and unchanged until ``put`` returns)."""

    key: bytes
    depth: int
    data: Any


class Tier(ABC):
    """A store of whole blocks below the RAM pool.

    Contract:
    - Blocks are named by (``ns``, key): ``ns`` is the tenant's fingerprint digest, so
      engines of one model and settings share blocks, and no other engine sees them.
    - Every method but ``contains`` on a ``local`` tier may block (disk I/O, network):
      the daemon calls them from the tier's own threads, never from its event loop. A
      tier must allow one thread in ``put`` while another is in ``get_into``.
    - ``put(ns, blocks)`` stores what it can and returns how many it kept; it may
      decline blocks (full of pinned work, too large, admission) and never stores a
      block it cannot read back verified.
    - ``contains(ns, keys, nbytes)`` is the length of the leading run of ``keys`` the
      tier holds, as far as it knows (a hint: ``get_into`` may still miss). Where it
      sees sizes, a block that is not ``nbytes`` long (when given) ends the run: the
      daemon makes room for a run before reading it, so a promise it cannot keep
      costs good blocks in RAM. It counts as the run's use: a tier that evicts keeps
      the run from the demotions that the room for it sends down before the read.
    - ``get_into(ns, keys, outs)`` reads the leading run of ``keys`` into ``outs`` (one
      writable buffer per key, of the block's exact length) and returns how many
      leading blocks it read *verified* (header and xxh3). A missing, corrupt, foreign
      or wrong-sized value ends the run; a corrupt one is forgotten.
    - Errors that make the tier unusable raise ``TierError``; one bad block never does.
    - ``connect()`` gets ready ahead of the first request (on a tier thread, once, at
      start); a failure there is counted, never fatal: the next call tries again.
    - ``status()`` is a JSON-able dict with at least ``blocks`` and ``bytes`` where the
      tier knows them; ``close()`` flushes what must survive and releases resources.
    """

    name: ClassVar[str]
    local: ClassVar[bool] = False  # contains() is an in-memory lookup, safe on the loop

    @abstractmethod
    def put(self, ns: bytes, blocks: Sequence[TierBlock]) -> int: ...

    @abstractmethod
    def contains(self, ns: bytes, keys: Sequence[bytes], nbytes: int = 0) -> int: ...

    @abstractmethod
    def get_into(self, ns: bytes, keys: Sequence[bytes], outs: Sequence[Any]) -> int: ...

    @abstractmethod
    def status(self) -> dict[str, Any]: ...

    def connect(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        """Release what the tier holds, waiting at most ``timeout`` seconds (None: the
        tier's own bound) for work in flight: a stop must not hang on a stalled tier."""


# name -> "module:Class", imported lazily (the remote tier imports its client library).
_REGISTRY: dict[str, str] = {
    "disk": "kvd.tiers.disk:DiskTier",
    "redis": "kvd.tiers.remote:RedisTier",
}


def register_tier(name: str, target: str) -> None:
    _REGISTRY[name] = target


def make_tier(name: str, **options: Any) -> Tier:
    """Build a tier by registry name; ValueError names the known ones."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(sorted(_REGISTRY))}") \
            from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
