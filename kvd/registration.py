"""What a Register must satisfy, and how a client's memory is opened for its data path.

Both run before the daemon changes anything for the Register: a refused one leaves no
tenant and no attached memory behind. Runs on the event loop.
"""

from __future__ import annotations

import os

import numpy as np

from kvd.clients import Client
from kvd.engines.base import TransferEngine
from kvd.engines.host import check_owner
from kvd.errors import KvdError, RequestError
from kvd_proto import messages as m

# Sizes no engine comes near: a message that does would cost the loop seconds and the
# daemon memory it keeps (a tenant is kept for the run).
MAX_TENSORS = 4096  # rank_page_bytes entries of one fingerprint
MAX_BLOCK_TOKENS = 1 << 20  # tokens per block (vLLM's are 16 to a few thousand)
MAX_NAME = 1024  # bytes of a fingerprint's names, or a client's name


def check_register(client: Client, msg: m.Register) -> None:
    """Refuse a Register that no tenant could be made for, or from this client."""
    fp = msg.fingerprint
    if client.tenant is not None:
        raise RequestError("already registered; open a new connection to re-register")
    if not 1 <= fp.tp_size <= 64:  # a block's ranks are bits of one uint64
        raise RequestError(f"tp_size {fp.tp_size} not in 1..64")
    if not 0 <= fp.pp_rank < 1024 or not -1 <= msg.rank < fp.tp_size:
        raise RequestError(f"rank {msg.rank} not in -1..{fp.tp_size - 1}")
    if not 1 <= fp.block_tokens <= MAX_BLOCK_TOKENS:
        raise RequestError(f"block_tokens {fp.block_tokens} not in 1..{MAX_BLOCK_TOKENS}")
    pages = fp.rank_page_bytes
    if not 0 < len(pages) <= MAX_TENSORS or min(pages) <= 0:
        raise RequestError(f"a fingerprint needs 1..{MAX_TENSORS} page sizes above 0")
    if max(len(fp.model), len(fp.dtype), len(fp.kv_dtype), len(fp.hash_algo),
           len(fp.root_hash), len(fp.extra)) > MAX_NAME:
        raise RequestError(f"a fingerprint field is longer than {MAX_NAME}")
    if msg.client_copy and client.uid not in (os.getuid(), 0):
        # It writes the pool file itself: only who can open that file (0600, ours)
        # may say it did; anyone else would publish what the slots held before.
        raise KvdError(f"uid {client.uid} cannot open the pool file: no client-side "
                       "copies (share the daemon's uid)", m.Code.PERMISSION)


def attach_memory(engines: dict[str, TransferEngine], client: Client,
                  pages: tuple[int, ...], msg: m.Register) -> None:
    """Pick the data path from what the client registered and open its memory;
    ``pages``: the fingerprint's bytes per block of each tensor."""
    kind = "client_copy" if msg.client_copy else "cuda" if msg.cuda_regions else "host"
    if kind == "host" and client.peer_pid <= 0:
        # The pid would be the client's word: copying another process's memory by it
        # (or, across PID namespaces, some other process of that number) is refused.
        raise KvdError(
            f"the kernel did not name the client's process (it says pid {client.hello_pid}; "
            "another PID namespace?): the host data path copies by pid and needs one the "
            "kernel vouches for. Fix: run the engine in the daemon's PID namespace "
            "(docker --pid=host, Kubernetes hostPID: true)", m.Code.PERMISSION)
    if kind == "host":  # the process at that pid is one the client's uid may access
        check_owner(client.peer_pid, client.uid)
    engine = engines.get(kind)
    if engine is None:
        raise RequestError(f"this daemon has no {kind} data path"
                           + (" (no usable CUDA device)" if kind == "cuda" else ""))
    if kind == "client_copy":
        client.engine = engine
        client.bases = np.zeros(len(pages), dtype=np.uint64)
        client.strides = np.array(pages, dtype=np.uint64)
        client.pages = np.array(pages, dtype=np.uint64)
        client.num_blocks = 2**31  # the client addresses its own memory
        return
    if kind == "cuda":
        from kvd.engines.cuda import refuse_foreign_pid_namespace

        refuse_foreign_pid_namespace(client.hello_pid, client.peer_pid)
    regions = msg.cuda_regions or msg.host_regions
    if len(regions) != len(pages):
        raise RequestError(
            f"{len(regions)} memory regions for a fingerprint of {len(pages)} tensors",
            m.Code.SIZE_MISMATCH)
    for r, page in zip(regions, pages):
        if r.num_blocks <= 0:
            raise RequestError(f"a memory region of {r.num_blocks} blocks: it has none",
                               m.Code.SIZE_MISMATCH)
        if kind == "host" and not (0 < r.base and r.base + (
                r.num_blocks - 1) * r.stride + r.page_bytes <= 1 << 64):
            raise RequestError(f"host region at {r.base:#x} of {r.num_blocks} blocks "
                               "is not inside the address space", m.Code.SIZE_MISMATCH)
        if r.page_bytes != page or r.stride < r.page_bytes:
            raise RequestError(
                f"region page {r.page_bytes} B / stride {r.stride} B / "
                f"{r.num_blocks} blocks does not match the fingerprint's {page} B pages",
                m.Code.SIZE_MISMATCH)
    bases = engine.attach(client.id, client.pid, msg)
    client.engine = engine
    client.bases = np.array(bases, dtype=np.uint64)
    client.strides = np.array([r.stride for r in regions], dtype=np.uint64)
    client.pages = np.array([r.page_bytes for r in regions], dtype=np.uint64)
    client.num_blocks = min(r.num_blocks for r in regions)
