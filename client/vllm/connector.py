"""KvdConnector: vLLM's OffloadingConnector with kvd's spec, chosen by itself.

Users write ``"kv_connector": "KvdConnector", "kv_connector_module_path":
"kvd_client.vllm"``. Before vLLM's constructor runs, the connector names kvd's spec in
the extra config (the same dict vLLM's spec factory reads, one copy per process) and
adds what the spec cannot see on its own (hash algorithm, model dtype, the model's
revision and download directory, the settings that change its KV: ``config_digest``).
It switches ``kv_load_failure_policy`` to "recompute" when the user left vLLM's default
"fail" (the scheduler reads it right after building the connector) and reports the
worker's failed loads through ``get_block_ids_with_load_errors``, so vLLM recomputes
those tokens.
It also hands each arriving request's keys to the manager, whose Lookup then goes out
before the request's first scheduling pass instead of parking it for a step.

Synchronous loads (``sync_loads``, vLLM 0.32; 0.33 has its own): vLLM's offloading
connector loads a hit asynchronously, so the request computes only in the step after its
load was reported, and on CPU the load is sent only after the step's (synchronous)
forward pass: two whole steps of waiting for a copy of a few milliseconds. Here a hit is
scheduled in the step that loads it: the scheduler answers ``load_async=False``, the
metadata names those jobs, and the worker waits for them (short deadline) before the
forward pass. A failed one is reported like any failed load; vLLM then drops that
request's output of the step and recomputes from the first failed block. What the
request (or one sharing its blocks) computed in that step is stored only one step later,
once the load's outcome is known, and after a failure the blocks computed on it leave
vLLM's prefix cache. Not with several batches in flight (async scheduling, pipeline
parallel): there a step is scheduled before the previous one's outcome.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_offload.base import make_offload_key

from kvd_client.vllm.fingerprint import config_digest
from kvd_client.vllm.idle import IdleFlush
from kvd_client.vllm.options import KvdOptions
from kvd_client.vllm.version import check_vllm_version, vllm_minor

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config
SPEC_NAME = "KvdOffloadingSpec"
SPEC_MODULE = "kvd_client.vllm"


def request_keys(scheduler: object, request: object) -> list[bytes]:
    """The request's offload keys, in block order, as vLLM's scheduler will make them
    (one KV-cache group: kvd refuses several)."""
    (group,) = scheduler.config.kv_group_configs  # type: ignore[attr-defined]
    step = group.hashes_per_chunk
    hashes = request.block_hashes[step - 1::step]  # type: ignore[attr-defined]
    return [make_offload_key(h, group.group_idx) for h in hashes]


def prepare_config(vllm_config: object) -> None:
    """Point vLLM's spec factory at kvd and fill in the fingerprint's missing facts."""
    check_vllm_version()
    ktc = vllm_config.kv_transfer_config  # type: ignore[attr-defined]
    extra = ktc.kv_connector_extra_config
    extra.setdefault("spec_name", SPEC_NAME)
    extra.setdefault("spec_module_path", SPEC_MODULE)
    extra.setdefault("kvd_hash_algo",
                     vllm_config.cache_config.prefix_caching_hash_algo)  # type: ignore[attr-defined]
    extra.setdefault("kvd_model_dtype",
                     str(vllm_config.model_config.dtype).removeprefix("torch."))  # type: ignore[attr-defined]
    extra.setdefault("kvd_model_revision",
                     getattr(vllm_config.model_config, "revision", None))  # type: ignore[attr-defined]
    extra.setdefault("kvd_download_dir",
                     getattr(getattr(vllm_config, "load_config", None), "download_dir", None))
    extra.setdefault("kvd_config_digest", config_digest(vllm_config))
    keep = extra.get("keep_load_failure_policy") in (True, "true", "1", 1)
    if ktc.kv_load_failure_policy == "fail" and not keep:
        ktc.kv_load_failure_policy = "recompute"
        log.info("kvd: kv_load_failure_policy set to \"recompute\" (was vLLM's default "
                 "\"fail\"): a block kvd fails to load is recomputed, the request goes on")


def sync_loads_on(vllm_config: object, options: KvdOptions) -> bool:
    """Whether this engine's hits load before the forward pass of the step they join.
    Not with several batches in flight (async scheduling, pipeline parallel): the next
    step is scheduled before this one's outcome, and the bookkeeping below is per step."""
    if vllm_minor() != (0, 32) or options.sync_loads == "off":
        return False
    if getattr(vllm_config, "max_concurrent_batches", 1) > 1:
        return False
    device = vllm_config.device_config.device_type  # type: ignore[attr-defined]
    return options.sync_loads == "on" or device == "cpu"


@dataclass
class KvdConnectorMetadata(OffloadingConnectorMetadata):
    sync_load_jobs: frozenset[int] = field(default_factory=frozenset)


class KvdConnector(OffloadingConnector):
    reports_kvd_load_errors = True  # the worker need not patch this connector

    def __init__(self, vllm_config, role, kv_cache_config) -> None:  # type: ignore[no-untyped-def]
        prepare_config(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        options = KvdOptions.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._sync_loads = sync_loads_on(vllm_config, options)
        self._block_tokens = vllm_config.cache_config.block_size
        # Scheduler side, for the step being scheduled: hits answered load_async=False
        # -> the local hit they extend (tokens); the engine blocks they load into.
        self._sync_reqs: dict[str, int] = {}
        self._loading_blocks: set[int] = set()
        # The step scheduled last: requests whose KV depends on its synchronous loads.
        self._depends: set[str] = set()
        self._sync_waited: set[str] = set()  # worker: their requests, until get_finished
        self._idle_flush: IdleFlush | None = None  # worker, host memory: see kvd_client.vllm.idle
        self._idle_checked = False

    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        super().on_new_request(request)
        manager = getattr(self.connector_scheduler, "manager", None)
        prefetch = getattr(manager, "prefetch", None)
        if prefetch is None or getattr(request, "skip_reading_prefix_cache", False):
            return
        manager.boundary.guard(
            "prefetch", lambda: None,
            lambda: prefetch(request.request_id, request_keys(self.connector_scheduler, request)))

    def shutdown(self) -> None:
        """vLLM defers each step's stores to the start of the next step, and its worker
        drops the deferred ones at shutdown: the blocks of an engine's last step never
        reached kvd, so the engine restarted in its place recomputed them. They go out
        here; the worker's shutdown then waits for them (the KV cache is still there)."""
        if self._idle_flush is not None:
            self._idle_flush.close()
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        deferred = getattr(cw, "_unsubmitted_store_jobs", None)
        if worker is not None and deferred:
            for job_id, src, dst in deferred:  # as vLLM submits them (kvd's never raise)
                worker.submit_store(job_id, src, dst)
            deferred.clear()
        super().shutdown()

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        take = getattr(worker, "take_load_errors", None)
        return take() if take is not None else set()

    # ------------------------------------------------ synchronous loads: scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        hits, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens,
                                                              *args, **kwargs)
        if not self._sync_loads:
            return hits, load_async
        self._sync_reqs.pop(request.request_id, None)
        # A hit of the whole prompt stays async: vLLM recomputes its last token only
        # on that path.
        if hits and load_async and num_computed_tokens + hits < request.num_tokens:
            self._sync_reqs[request.request_id] = num_computed_tokens
            return hits, False
        return hits, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        local = self._sync_reqs.get(request.request_id)
        if local is not None and num_external_tokens:
            # vLLM 0.32's offloading scheduler loads into the blocks past the local hit
            # that are not cached yet: an async load's blocks are cached only once it
            # ended, a synchronous load's at allocation. Show it the async view.
            start, end = local // self._block_tokens, -(-(local + num_external_tokens)
                                                          // self._block_tokens)
            self._loading_blocks.update(b.block_id for g in blocks.blocks for b in g[start:end])
            blocks = _uncached(blocks, start, end)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):  # type: ignore[no-untyped-def]
        if not self._sync_loads:
            return super().build_connector_meta(scheduler_output)
        # What a request computes in this step on top of a synchronous load may be wrong
        # if the load fails (vLLM then recomputes it; nothing withdraws a store): vLLM
        # stores none of it this step, but next step, once the load's outcome is known.
        # That covers the loading requests and those sharing their blocks through the
        # prefix cache (a sync load's blocks are cached at allocation).
        depends = set(self._sync_reqs)
        if self._loading_blocks and self._kv_cache_manager is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                if req_id not in depends and any(
                        not self._loading_blocks.isdisjoint(group)
                        for group in self._kv_cache_manager.get_block_ids(req_id)):
                    depends.add(req_id)
        view = scheduler_output
        if depends:
            view = replace(scheduler_output, num_scheduled_tokens={
                r: n for r, n in scheduler_output.num_scheduled_tokens.items()
                if r not in depends})
        meta = super().build_connector_meta(view)
        sync = frozenset(job for job, t in meta.load_jobs.items() if t.req_id in self._sync_reqs)
        self._sync_reqs.clear()
        self._loading_blocks.clear()
        self._depends = depends
        if meta.load_jobs:
            # Also the async ones (a whole-prompt hit) go out before the forward pass,
            # not after it: on CPU that pass is synchronous and takes the whole step.
            scheduler_output.has_sync_kv_loads = True
        return KvdConnectorMetadata(meta.load_jobs, meta.store_jobs, meta.jobs_to_flush,
                                    sync_load_jobs=sync)

    def update_connector_output(self, connector_output) -> None:  # type: ignore[no-untyped-def]
        """After a failed synchronous load, vLLM (recompute policy) keeps the failed
        blocks, and those computed on them, in its prefix cache until it recomputes
        them: a request preempted meanwhile, or another one, would hit them. Evicted."""
        super().update_connector_output(connector_output)
        depends, self._depends = self._depends, set()
        bad = connector_output.invalid_block_ids
        if not (bad and depends) or self._kv_cache_manager is None:
            return
        evict: set[int] = set()
        for req_id in depends:
            for group in self._kv_cache_manager.get_block_ids(req_id):
                first = next((i for i, b in enumerate(group) if b in bad), None)
                if first is not None:
                    evict.update(group[first:])
        if evict:
            self._kv_cache_manager.evict_blocks(evict)

    # ------------------------------------------------ worker side: deferred stores
    def _step(self) -> AbstractContextManager[None]:
        """A worker hook that may touch vLLM's deferred stores (see ``IdleFlush``)."""
        return self._idle_flush.step() if self._idle_flush is not None else nullcontext()

    def handle_preemptions(self, kv_connector_metadata) -> None:  # type: ignore[no-untyped-def]
        with self._step():
            super().handle_preemptions(kv_connector_metadata)

    def wait_for_save(self) -> None:
        if not self._idle_checked:  # the worker exists once the KV caches are registered
            cw = self.connector_worker
            worker = cw.worker if cw is not None else None
            if worker is not None:
                self._idle_checked = True
                # vLLM 0.32: the deferred list and the hooks that touch it are as read
                # there (0.33 has no CPU build, and host memory is CPU engines).
                if (vllm_minor() == (0, 32)
                        and getattr(getattr(worker, "path", None), "kind", None) == "host"):
                    self._idle_flush = IdleFlush(cw)
        with self._step():
            super().wait_for_save()

    # ------------------------------------------------ synchronous loads: worker side
    def start_load_kv(self, forward_context, **kwargs) -> None:  # type: ignore[no-untyped-def]
        with self._step():
            self._start_load_kv(forward_context, **kwargs)

    def _start_load_kv(self, forward_context, **kwargs) -> None:  # type: ignore[no-untyped-def]
        meta = self._connector_metadata
        sync = getattr(meta, "sync_load_jobs", frozenset())
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        expedite = getattr(worker, "expedite", None)
        if sync and expedite is not None:
            expedite(set(sync))
            worker.boundary.count("load.sync", len(sync))  # type: ignore[union-attr]
        super().start_load_kv(forward_context, **kwargs)
        if sync:
            # Bounded: each job ends by its deadline plus grace (a failed one is a
            # load error, recomputed by vLLM).
            worker.wait(set(sync))  # type: ignore[union-attr]
            self._sync_waited.update(meta.load_jobs[j].req_id for j in sync)  # type: ignore[union-attr]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """A synchronous load's request is running, not waiting for its KV: vLLM must not
        hear of it as received (it asserts such a request finished)."""
        sending, recving = super().get_finished(finished_req_ids)
        if self._sync_waited:
            recving -= self._sync_waited
            self._sync_waited.clear()
        return sending, recving


@dataclass(slots=True)
class _Uncached:
    """A block as an async load's allocation leaves it: not in the prefix cache yet."""

    block_id: int
    is_null: bool
    block_hash: None = None


def _uncached(blocks: KVCacheBlocks, start: int, end: int) -> KVCacheBlocks:
    return KVCacheBlocks(tuple(
        [*group[:start], *(_Uncached(b.block_id, b.is_null) for b in group[start:end]),
         *group[end:]] for group in blocks.blocks))

