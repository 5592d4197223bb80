"""KvdOffloadingSpec: plugs kvd into vLLM's OffloadingConnector.

vLLM builds the spec in every process from the ``OffloadingConfig`` alone (no vLLM
config), asks it for the scheduler-side manager (``get_manager``) or, in each worker, for
the worker (``get_worker``). Options come from ``kv_connector_extra_config`` (see
``KvdOptions``); unknown ``kvd``-free keys belong to vLLM and are left alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadingSpec

from kvd_client.vllm.fingerprint import (
    EngineFacts,
    compute_root_hash,
    facts_from_config,
    make_fingerprint,
    root_seed,
)
from kvd_proto.messages import Fingerprint

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config


def default_socket() -> str:
    """The daemon's default socket (same rule as ``kvd serve``)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(run, "kvd") if run else f"/tmp/kvd-{os.getuid()}"
    return os.path.join(base, "kvd.sock")


@dataclass(frozen=True)
class KvdOptions:
    """``kv_connector_extra_config`` keys read by kvd (all optional)."""

    socket: str = ""  # "" = $KVD_SOCKET, else the daemon's default socket
    lookup_timeout_ms: int = 300  # a Lookup not answered by then is a miss
    lookup_wait_ms: float = 2.0  # per scheduler step: wait this long for replies in flight
    lease_ms: int = 30_000  # how long hit blocks stay pinned for the load
    pending_wait_ms: int = 1_000  # how long a request waits for blocks still being stored
    pending_ms: int = 60_000  # an allocated slot not stored by then is dropped
    call_timeout_ms: int = 2_000  # connection liveness: pings, handshake
    transfer_timeout_ms: int = 30_000  # a Transfer without Done by then is failed
    keep_load_failure_policy: bool = False  # keep vLLM's "fail" instead of "recompute"
    fail_loads_for_test: bool = False  # TEST ONLY: garble and fail every load

    @classmethod
    def from_extra(cls, extra: dict) -> KvdOptions:
        known = {f.name: f for f in fields(cls)}
        kw = {}
        for key, value in extra.items():
            if key in known:
                typ = type(getattr(cls, key))
                kw[key] = typ(value) if typ is not bool else value in (True, "true", "1", 1)
        opts = cls(**kw)
        if not opts.socket:
            opts = cls(**{**kw, "socket": os.environ.get("KVD_SOCKET") or default_socket()})
        return opts


class KvdSlots(LoadStoreSpec):
    """Pool slots of one job, picklable and small (it rides in every SchedulerOutput).

    ``instance`` is the daemon run the slots belong to: a worker connected to another
    run (the daemon restarted in between) must not use them. A store carries the
    ``ticket`` of its Allocate instead of slots: the daemon knows them.
    """

    __slots__ = ("slots", "instance", "ticket")

    def __init__(self, slots: np.ndarray, instance: str, ticket: int = 0) -> None:
        self.slots = np.ascontiguousarray(slots, dtype=np.uint32)
        self.instance = instance
        self.ticket = ticket

    def __getstate__(self) -> tuple[bytes, str, int]:
        return self.slots.tobytes(), self.instance, self.ticket

    def __setstate__(self, state: tuple[bytes, str, int]) -> None:
        self.slots = np.frombuffer(state[0], dtype=np.uint32)
        self.instance, self.ticket = state[1], state[2]

    def __repr__(self) -> str:
        return f"KvdSlots({self.slots.tolist()}, {self.instance[:8]}, ticket={self.ticket})"


class KvdOffloadingSpec(OffloadingSpec):
    def __init__(self, config: object, *args: object, **kwargs: object) -> None:
        from kvd_client.vllm import check_vllm_version  # noqa: PLC0415 - avoid a cycle

        check_vllm_version()
        super().__init__(config)  # type: ignore[arg-type]
        self.options = KvdOptions.from_extra(self.extra_config)
        self.facts: EngineFacts = facts_from_config(config, self.extra_config)
        self._fingerprint: Fingerprint | None = None
        self._manager = None
        self._worker = None

    @property
    def fingerprint(self) -> Fingerprint:
        """Built on first use: vLLM's hash helpers are imported lazily."""
        if self._fingerprint is None:
            root = compute_root_hash(self.facts.hash_algo, self.facts.engine_id)
            self._fingerprint = make_fingerprint(self.facts, root)
        return self._fingerprint

    def warn_if_private_root(self) -> None:
        if root_seed(self.facts.hash_algo) is None:
            log.warning(
                "kvd: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives every engine "
                "a random root hash: kvd hits stay within this engine run and will not "
                "survive restarts or be shared. Set PYTHONHASHSEED (the same on every "
                "engine) or use sha256.", self.facts.hash_algo)

    def get_manager(self):  # type: ignore[override]
        if self._manager is None:
            from kvd_client.vllm.manager import KvdManager  # noqa: PLC0415

            self.warn_if_private_root()
            self._manager = KvdManager(self.options, self.fingerprint, self.facts)
        return self._manager

    def get_worker(self, kv_caches):  # type: ignore[override]
        if self._worker is None:
            from kvd_client.vllm.worker import KvdWorker  # noqa: PLC0415

            self._worker = KvdWorker(self.options, self.fingerprint, kv_caches,
                                     rank=_tp_rank(self.config))
        return self._worker


def _tp_rank(config: object) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank  # noqa: PLC0415

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (tests): the global rank is the TP rank
        return int(config.parallel.rank) % max(1, int(config.parallel.tp_size))  # type: ignore[attr-defined]
