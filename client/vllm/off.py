"""What an engine runs when kvd is off for it: vLLM serves on, without offloading.

kvd turns itself off for an engine whose layout it cannot serve (``LayoutError``:
pipeline or prefill context parallelism, several KV-cache groups, chunks of several
blocks) or, per worker, whose memory no data path can copy. Refusing to start would stop
the engine; these answer every hook safely instead: no hits, no stores, a load (never
asked for) failed so that vLLM recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)

from kvd_client.vllm.failopen import Boundary
from kvd_client.vllm.options import skip_store

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config


class ManagerOff(OffloadingManager):
    """The scheduler side with kvd off: every block a miss, nothing stored."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.disabled = why
        self.boundary = Boundary("scheduler")

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[Any], req_context: ReqContext) -> Any:
        raise AssertionError("kvd is off: no block was a hit, so none is loaded")

    def prepare_store(self, keys: Collection[Any],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        self.boundary.count("store.skipped.offload_off")
        return skip_store("")

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        log.info("kvd scheduler: offloading was off (%s): %s", self.why,
                 dict(sorted(self.boundary.counts.items())))


class OffloadOff(OffloadingWorker):
    """No offloading: stores are skipped, loads fail (vLLM recomputes), counted."""

    def __init__(self, rank: int, why: str) -> None:
        self.rank = rank
        self.why = why
        self.boundary = Boundary(f"worker{rank}")
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.boundary.count("store.skipped.offload_off")
        self._finished.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        self.boundary.count("load.skipped.offload_off")
        self._load_errors.update(np.asarray(dst_spec.block_ids).tolist())
        self._finished.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        log.info("kvd worker rank %d: offloading was off (%s): %s", self.rank, self.why,
                 dict(sorted(self.boundary.counts.items())))
