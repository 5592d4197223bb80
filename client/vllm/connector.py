"""KvdConnector: vLLM's OffloadingConnector with kvd's spec, chosen by itself.

Users write ``"kv_connector": "KvdConnector", "kv_connector_module_path":
"kvd_client.vllm"``. Before vLLM's constructor runs, the connector names kvd's spec in
the extra config (the same dict vLLM's spec factory reads, one copy per process) and
adds what the spec cannot see on its own (hash algorithm, model dtype, the model's
revision). It switches
``kv_load_failure_policy`` to "recompute" when the user left vLLM's default "fail" (the
scheduler reads it right after building the connector) and reports the worker's failed
loads through ``get_block_ids_with_load_errors``, so vLLM recomputes those tokens.
It also hands each arriving request's keys to the manager, whose Lookup then goes out
before the request's first scheduling pass instead of parking it for a step.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import make_offload_key

from kvd_client.vllm.version import check_vllm_version

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
    keep = extra.get("keep_load_failure_policy") in (True, "true", "1", 1)
    if ktc.kv_load_failure_policy == "fail" and not keep:
        ktc.kv_load_failure_policy = "recompute"
        log.info("kvd: kv_load_failure_policy set to \"recompute\" (was vLLM's default "
                 "\"fail\"): a block kvd fails to load is recomputed, the request goes on")


class KvdConnector(OffloadingConnector):
    reports_kvd_load_errors = True  # the worker need not patch this connector

    def __init__(self, vllm_config, role, kv_cache_config) -> None:  # type: ignore[no-untyped-def]
        prepare_config(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)

    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        super().on_new_request(request)
        manager = getattr(self.connector_scheduler, "manager", None)
        prefetch = getattr(manager, "prefetch", None)
        if prefetch is None or getattr(request, "skip_reading_prefix_cache", False):
            return
        manager.boundary.guard(
            "prefetch", lambda: None,
            lambda: prefetch(request.request_id, request_keys(self.connector_scheduler, request)))

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        take = getattr(worker, "take_load_errors", None)
        return take() if take is not None else set()
