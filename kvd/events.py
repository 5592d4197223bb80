"""KV events in vLLM's wire format: what kvd's RAM pool holds, for fleet routers.

Why a mirror of vLLM's types instead of an import: the daemon never imports vLLM (a
test checks the layers). These Structs have vLLM 0.32's layout in
``vllm.distributed.kv_events`` field for field (``KVEventBatch`` array-like; events
tagged by class name, omitting defaults), so vLLM's own decoder and every router that
reads vLLM's events (llm-d's KV-cache indexer, Dynamo) decode kvd's batches unchanged;
a test decodes them with vLLM's ``KVEventBatch``.

What is published for a block (kvd's key = vLLM's OffloadKey: block hash + 4-byte
big-endian KV-cache group index):

- ``block_hashes``: the key's block hash as vLLM publishes it: by default the low 64
  bits as an int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), else the raw
  bytes (``events_int_hashes = false``). When kvd's block spans several vLLM blocks
  (``blocks_per_chunk`` > 1) the key is the chunk's last vLLM block hash, and that is
  the one published, as vLLM's own offloading events do.
- ``parent_block_hash``: the previous block of the same chain when kvd knows it
  (stored by the same Allocate, or named by it: ``Allocate.parent``); None for a
  chain's first block and when unknown.
- ``token_ids``: empty (the wire carries hashes only); ``block_size``: the tenant's
  tokens per kvd block (0 when no engine of it registered since a restart);
  ``medium``: "CPU" (the RAM pool).

This module is pure (no sockets, no clock): ``kvd.publisher`` sends what it builds.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import eq
from typing import Any, Union

import msgspec
import numpy as np

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"  # a disk tier's blocks, once there is one
DEFAULT_TOPIC = "kv@{node}@{model}"
Hash = Union[int, bytes]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch off the wire (kvdctl events, tests)."""
    return _decoder.decode(payload)


@dataclass(frozen=True)
class TenantInfo:
    """What a topic and a BlockStored say about a tenant."""

    model: str
    block_size: int  # tokens per kvd block; 0 when unknown


def node_name(configured: str) -> str:
    return configured or socket.gethostname()


def topic_for(template: str, node: str, tenant_id: int, model: str) -> bytes:
    """``kv@{node}@{model}`` by default: llm-d's topic shape (pod id = the node)."""
    return template.format(node=node, model=model, tenant=tenant_id).encode()


# ---------------------------------------------------------------- hashes
def _split(keys: Sequence[bytes]) -> tuple[list[bytes], list[int]]:
    """(block hashes, group indices) of OffloadKeys, with numpy when the lengths agree."""
    n = len(keys)
    width = len(keys[0]) if n else 0
    if n and width > 4 and all(map(width.__eq__, map(len, keys))):
        rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, width)
        groups = rows[:, width - 4:].copy().view(">u4").ravel().tolist()
        return [k[:-4] for k in keys], groups
    return [k[:-4] for k in keys], [int.from_bytes(k[-4:], "big") for k in keys]


def _ints(hashes: Sequence[bytes]) -> list[Hash]:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits, big-endian."""
    n = len(hashes)
    width = len(hashes[0]) if n else 0
    if n and width >= 8 and all(map(width.__eq__, map(len, hashes))):
        rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, width)
        return rows[:, width - 8:].copy().view(">u8").ravel().tolist()
    return [int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF for h in hashes]


# ---------------------------------------------------------------- batches
class BatchBuilder:
    """Turns one loop iteration's index events into one KVEventBatch per tenant.

    Input: the core's tuples (``("commit", tenant, key, slot, depth, sums, parent)``,
    ``("drop", slot, tenant, key)``) and the shell's ``("clear", kept)`` marker (a flush:
    what came before it is superseded by AllBlocksCleared plus the blocks kept).
    """

    def __init__(self, int_hashes: bool = True, medium: str = MEDIUM_CPU) -> None:
        self.int_hashes = int_hashes
        self.medium = medium

    def convert(self, hashes: Sequence[bytes]) -> list[Hash]:
        return _ints(hashes) if self.int_hashes else list(hashes)

    def build(self, events: Sequence[tuple], info: Callable[[int], TenantInfo],
              tenants: Iterable[int]) -> dict[int, list[Event]]:
        """tenant id -> its events, in order (tenants without events are left out)."""
        out: dict[int, list[Event]] = {}
        clears = [i for i, e in enumerate(events) if e[0] == "clear"]
        if clears:  # a flush: start from AllBlocksCleared on every tenant's topic
            last = clears[-1]
            kept, events = events[last][1], events[last + 1:]
            for tid in tenants:
                out[tid] = [AllBlocksCleared()]
            self._stored(list(kept), info, out)
        commits = [e for e in events if e[0] == "commit"]
        if len(commits) == len(events):
            self._stored(commits, info, out)
            return out
        # Mixed: keep the order (a block stored then evicted in one iteration).
        start = 0
        kinds = [e[0] for e in events]
        while start < len(events):
            end = start + 1
            while end < len(events) and kinds[end] == kinds[start]:
                end += 1
            part = events[start:end]
            if kinds[start] == "commit":
                self._stored(part, info, out)
            else:
                self._removed(part, out)
            start = end
        return out

    def _stored(self, commits: list[tuple], info: Callable[[int], TenantInfo],
                out: dict[int, list[Event]]) -> None:
        """One BlockStored per chain run: same tenant and group, each block's parent
        the block before it."""
        if not commits:
            return
        tids = [c[1] for c in commits]
        keys = [c[2] for c in commits]
        parents = [c[6] if len(c) > 6 else None for c in commits]
        hashes, groups = _split(keys)
        conv = self.convert(hashes)
        # A run breaks where the tenant or group changes or the parent is not the
        # previous key (all compared in C).
        same = np.ones(len(commits), dtype=bool)
        same[0] = False
        if len(commits) > 1:
            same[1:] = (np.array(list(map(eq, parents[1:], keys[:-1])), dtype=bool)
                        & (np.array(tids[1:]) == np.array(tids[:-1]))
                        & (np.array(groups[1:]) == np.array(groups[:-1])))
        starts = np.flatnonzero(~same).tolist() + [len(commits)]
        for a, b in zip(starts, starts[1:]):
            tid, parent = tids[a], parents[a]
            t = info(tid)
            out.setdefault(tid, []).append(BlockStored(
                block_hashes=conv[a:b],
                parent_block_hash=None if parent is None else self.convert([parent[:-4]])[0],
                token_ids=[], block_size=t.block_size, lora_id=None, medium=self.medium,
                lora_name=None, group_idx=groups[a]))

    def _removed(self, drops: list[tuple], out: dict[int, list[Event]]) -> None:
        """One BlockRemoved per tenant and group."""
        tids = [d[2] for d in drops]
        hashes, groups = _split([d[3] for d in drops])
        conv = self.convert(hashes)
        if tids.count(tids[0]) == len(tids) and groups.count(groups[0]) == len(groups):
            out.setdefault(tids[0], []).append(
                BlockRemoved(block_hashes=conv, medium=self.medium, group_idx=groups[0]))
            return
        by: dict[tuple[int, int], list[Hash]] = {}
        for tid, g, h in zip(tids, groups, conv):
            by.setdefault((tid, g), []).append(h)
        for (tid, g), hs in by.items():
            out.setdefault(tid, []).append(
                BlockRemoved(block_hashes=hs, medium=self.medium, group_idx=g))


def held_commits(blocks: Sequence[tuple]) -> list[tuple]:
    """The READY blocks (``snapshot.live_blocks``) as commit tuples, for a (re)start or a
    flush to announce: chain by chain, each block after its parent (depth first, so a
    chain stays one BlockStored)."""
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
