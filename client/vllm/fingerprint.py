"""The tenant fingerprint of a vLLM engine, computed identically on both sides.

The scheduler side and every worker must register the *same* fingerprint, or the worker's
Transfers would name slots of another tenant. Neither side sees everything: the spec gets
only vLLM's ``OffloadingConfig`` (no hash algorithm, no root hash, no per-tensor pages),
workers are built before ``NONE_HASH`` exists and multiprocess workers never see it. So
the fingerprint is derived from what both have:

- model, KV dtype, block tokens, TP size, the per-block bytes and layer count: from the
  ``OffloadingConfig``; the model dtype and hash algorithm: from extra-config keys that
  ``KvdConnector`` fills in from the vLLM config (or the user, on the standard path);
- the root hash: recomputed the way vLLM derives ``NONE_HASH`` when its seed is fixed
  (sha256 / sha256_cbor, or ``PYTHONHASHSEED`` set); with xxhash and no
  ``PYTHONHASHSEED`` the root is random per engine, so the engine id stands in for it
  (a tenant private to this engine run: no hits across restarts or engines);
- rank_page_bytes: the block's bytes split evenly over the layers; a worker describes its
  tensors in exactly those pages (``split_pages``), whatever its physical layout;
- what changes the KV of the same weights and tokens without showing in the files
  (online quantization, ``hf_overrides`` such as another RoPE base or scaling): a digest
  that ``KvdConnector`` fills in (``config_digest``); the weights' own stamp is added by
  the spec (``kvd_client.vllm.weights``).

The scheduler checks the recomputed root against vLLM's real ``NONE_HASH`` at the first
request (``root_hash_matches``) and turns kvd off for the engine if they differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from typing import TypeVar

import msgspec

from kvd_proto.messages import CudaRegion, Fingerprint, HostRegion

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config
R = TypeVar("R", HostRegion, CudaRegion)

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vllm/v1/core/kv_cache_utils.py
CRYPTO_ALGOS = frozenset({"sha256", "sha256_cbor"})
UNNAMED = "unnamed"  # config_digest: settings that change the KV but cannot be named


class LayoutError(ValueError):
    """The worker's KV tensors cannot be described in the fingerprint's pages."""


@dataclass(frozen=True)
class EngineFacts:
    """What the fingerprint is made of, gathered from the OffloadingConfig + extra config."""

    model: str
    model_dtype: str
    kv_dtype: str
    block_tokens: int
    tp_size: int
    pp_size: int
    block_bytes: int  # one block on one worker, all layers
    num_layers: int
    hash_algo: str
    engine_id: str
    num_groups: int = 1
    pcp_size: int = 1  # prefill context parallel: ranks holding other tokens of a block
    blocks_per_chunk: int = 1
    config_digest: str = ""  # see ``config_digest``


def facts_from_config(config: object, extra: dict) -> EngineFacts:
    """EngineFacts of a vLLM ``OffloadingConfig`` (0.32 / 0.33 field names)."""
    groups = config.groups  # type: ignore[attr-defined]
    layers = {name for g in groups for name in g.layer_names}
    kv_dtype = str(config.model.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    return EngineFacts(
        model=str(config.model.name),  # type: ignore[attr-defined]
        model_dtype=str(extra.get("kvd_model_dtype") or kv_dtype),
        kv_dtype=kv_dtype,
        block_tokens=int(groups[0].tokens_per_block * config.cache.blocks_per_chunk),  # type: ignore[attr-defined]
        tp_size=int(config.parallel.tp_size),  # type: ignore[attr-defined]
        pp_size=int(config.parallel.pp_size),  # type: ignore[attr-defined]
        block_bytes=int(config.worker_kv_bytes_per_block),  # type: ignore[attr-defined]
        num_layers=max(1, len(layers)),
        hash_algo=str(extra.get("kvd_hash_algo") or extra.get("hash_algo") or "sha256"),
        engine_id=str(config.engine_id),  # type: ignore[attr-defined]
        num_groups=len(groups),
        pcp_size=int(getattr(config.parallel, "pcp_size", 1) or 1),  # type: ignore[attr-defined]
        blocks_per_chunk=int(config.cache.blocks_per_chunk),  # type: ignore[attr-defined]
        config_digest=str(extra.get("kvd_config_digest") or ""),
    )


def config_digest(vllm_config: object) -> str:
    """16 hex digits naming the engine settings that change the KV of the same weights
    and tokens but are not in the model's files: online quantization, ``hf_overrides``
    (another RoPE base or scaling changes every stored key) and the layers an fp8 KV
    cache leaves unquantized. "" when none is set, so engines without them keep their
    tenant; ``UNNAMED`` when they cannot be named (overrides given as a function, or with
    values that are not plain JSON): the engine's blocks are then its own. Only settings
    that are the same in every process of the engine: the scheduler and the workers must
    agree."""
    mc = getattr(vllm_config, "model_config", None)
    facts: dict[str, str] = {}
    quant = getattr(mc, "quantization", None)
    if quant:
        facts["quantization"] = str(quant)
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):  # its name says nothing of what it does
        return UNNAMED
    if overrides:
        try:
            facts["hf_overrides"] = json.dumps(overrides, sort_keys=True, allow_nan=True)
        except (TypeError, ValueError):  # a set, an object, keys of mixed types
            return UNNAMED
    skipped = getattr(getattr(vllm_config, "cache_config", None),
                      "kv_cache_dtype_skip_layers", None)
    if skipped:  # which layers keep the model dtype: the same bytes per block either way
        facts["kv_cache_dtype_skip_layers"] = json.dumps(sorted(map(str, skipped)))
    if not facts:
        return ""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def root_seed(hash_algo: str, environ: dict | os._Environ = os.environ) -> str | None:
    """vLLM's NONE_HASH seed when it is the same in every process, else None (random)."""
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return DEFAULT_NONE_HASH_SEED if hash_algo in CRYPTO_ALGOS else None


def compute_root_hash(hash_algo: str, engine_id: str,
                      environ: dict | os._Environ = os.environ) -> bytes:
    """NONE_HASH as vLLM derives it, or an engine-private stand-in when it is random."""
    seed = root_seed(hash_algo, environ)
    if seed is None:
        return b"engine:" + engine_id.encode()
    from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415 - vLLM only here

    return bytes(get_hash_fn_by_name(hash_algo)(seed))


def root_hash_matches(expected: bytes, hash_algo: str) -> bool | None:
    """Whether vLLM's NONE_HASH equals ``expected``; None while it is not set yet."""
    if root_seed(hash_algo) is None:
        return True  # engine-private root: nothing to compare
    from vllm.v1.core import kv_cache_utils  # noqa: PLC0415 - read lazily, it is set late

    actual = getattr(kv_cache_utils, "NONE_HASH", None)
    if actual is None:
        return None
    return bytes(actual) == expected


def rank_pages(facts: EngineFacts) -> list[int]:
    """The fingerprint's per-tensor page bytes: the block split evenly over the layers."""
    n = facts.num_layers
    if facts.block_bytes % n:
        return [facts.block_bytes]
    return [facts.block_bytes // n] * n


def make_fingerprint(facts: EngineFacts, root: bytes, model_version: str = "",
                     private: bool = False) -> Fingerprint:
    """``model_version`` names the weights (``weights.weights_stamp``): engines of one
    model name with other weights are other tenants. ``private``: a tenant of this
    engine run alone (the weights could not be named; sharing might serve another
    model's KV)."""
    if facts.pp_size != 1:
        raise LayoutError("kvd does not support pipeline parallelism yet (pp_size > 1)")
    if facts.pcp_size != 1:
        raise LayoutError("kvd does not support prefill context parallelism (pcp_size > 1):"
                          " its ranks hold other tokens of a block under one TP rank")
    if facts.blocks_per_chunk != 1:
        raise LayoutError("kvd stores one vLLM block per key (blocks_per_chunk "
                          f"{facts.blocks_per_chunk}; leave the offloading block_size unset)")
    if facts.num_groups != 1:
        raise LayoutError("kvd supports models with one KV-cache group only "
                          f"(this one has {facts.num_groups}: hybrid / sliding window)")
    if facts.block_bytes <= 0:
        raise LayoutError("vLLM reported no KV bytes per block")
    return Fingerprint(
        model=facts.model,
        dtype=facts.model_dtype,
        kv_dtype=facts.kv_dtype,
        block_tokens=facts.block_tokens,
        tp_size=facts.tp_size,
        rank_page_bytes=rank_pages(facts),
        hash_algo=facts.hash_algo,
        root_hash=root,
        pp_rank=0,
        extra="".join(("vllm-offloading/1",
                       f";weights={model_version}" if model_version else "",
                       f";config={facts.config_digest}" if facts.config_digest else "",
                       f";engine={facts.engine_id}"
                       if private or facts.config_digest == UNNAMED else "")),
    )


def _piece(r: R, off: int, page: int) -> R:
    if isinstance(r, HostRegion):
        return msgspec.structs.replace(r, base=r.base + off, page_bytes=page)
    return msgspec.structs.replace(r, offset=r.offset + off, page_bytes=page)


def split_pages(regions: Sequence[R], pages: Sequence[int]) -> list[R]:
    """Describe ``regions`` (the worker's real tensors) as consecutive pieces of ``pages``.

    A tensor whose page holds several fingerprint pages is split by offset (same stride);
    a fingerprint page may not straddle two tensors. Raises LayoutError otherwise.
    """
    out: list[R] = []
    want = list(pages)
    i = 0
    for r in regions:
        off = 0
        while off < r.page_bytes:
            if i >= len(want) or off + want[i] > r.page_bytes:
                raise LayoutError(
                    f"KV tensors with pages {[x.page_bytes for x in regions]} B cannot be "
                    f"described as the fingerprint's pages {list(pages)} B")
            out.append(_piece(r, off, want[i]))
            off += want[i]
            i += 1
    if i != len(want):
        raise LayoutError(f"KV tensors hold {sum(x.page_bytes for x in regions)} B per "
                          f"block, the fingerprint {sum(pages)} B")
    return out
