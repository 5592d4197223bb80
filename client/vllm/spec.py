"""KvdOffloadingSpec: plugs kvd into vLLM's OffloadingConnector.

vLLM builds the spec in every process from the ``OffloadingConfig`` alone (no vLLM
config), asks it for the scheduler-side manager (``get_manager``) or, in each worker, for
the worker (``get_worker``). Options come from ``kv_connector_extra_config`` (see
``KvdOptions``); unknown ``kvd``-free keys belong to vLLM and are left alone.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import OffloadingSpec

from kvd_client.vllm.fingerprint import (
    EngineFacts,
    LayoutError,
    compute_root_hash,
    facts_from_config,
    make_fingerprint,
    root_seed,
)
from kvd_client.vllm.options import KvdOptions, KvdSlots, default_socket
from kvd_client.vllm.version import check_vllm_version
from kvd_client.vllm.weights import weights_stamp
from kvd_proto.messages import Fingerprint

__all__ = ["KvdOffloadingSpec", "KvdOptions", "KvdSlots", "default_socket"]

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config


class KvdOffloadingSpec(OffloadingSpec):
    def __init__(self, config: object, *args: object, **kwargs: object) -> None:
        check_vllm_version()
        super().__init__(config)  # type: ignore[arg-type]
        self.options = KvdOptions.from_extra(self.extra_config)
        self.facts: EngineFacts = facts_from_config(config, self.extra_config)
        self._fingerprint: Fingerprint | None = None
        self._refusal = ""
        self._manager = None
        self._worker = None

    @property
    def fingerprint(self) -> Fingerprint:
        """Built on first use: vLLM's hash helpers are imported lazily, and the weights
        are on disk by then on both sides (the manager and the worker are asked for
        after the model is loaded; a worker's spec is built before a download ends)."""
        if self._fingerprint is None:
            root = compute_root_hash(self.facts.hash_algo, self.facts.engine_id)
            version = self.extra_config.get("kvd_model_version")
            private = False
            if version is None:
                version = weights_stamp(self.facts.model,
                                        self.extra_config.get("kvd_model_revision"),
                                        self.extra_config.get("kvd_download_dir"))
                # Weights not named: shared by their name alone, an engine of the same
                # name with other weights (updated in place, another revision) would
                # load this one's KV. Kept to this engine run instead.
                private = not version
                if private:
                    log.warning(
                        "kvd: the weights of %s were not found to stamp them: kvd hits "
                        "stay within this engine run (no sharing across engines or "
                        "restarts). Set kvd_model_version in kv_connector_extra_config "
                        "to name the weights yourself.", self.facts.model)
            self._fingerprint = make_fingerprint(self.facts, root, str(version), private)
        return self._fingerprint

    def _refused(self) -> str:
        """Why kvd cannot serve this engine's layout ("" when it can), logged once: the
        engine then serves without offloading rather than not starting."""
        try:
            self.fingerprint  # noqa: B018 - built here to catch its refusal
        except LayoutError as e:
            if not self._refusal:
                log.error("kvd is off for this engine: %s", e)
            self._refusal = str(e) or "layout"
        return self._refusal

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
            from kvd_client.vllm.off import ManagerOff  # noqa: PLC0415

            if why := self._refused():
                self._manager = ManagerOff(why)
                return self._manager
            self.warn_if_private_root()
            self._manager = KvdManager(self.options, self.fingerprint, self.facts)
        return self._manager

    def get_worker(self, kv_caches):  # type: ignore[override]
        """The worker; never raises for memory the daemon cannot copy or a layout kvd
        refuses: the worker then copies its loads itself, or runs without offloading
        (logged once, counted)."""
        if self._worker is None:
            from kvd_client.vllm.off import OffloadOff  # noqa: PLC0415
            from kvd_client.vllm.worker import (  # noqa: PLC0415
                KvdWorker,
                _report_load_errors_through,
                data_path_for,
            )

            rank = _tp_rank(self.config)
            path = self._refused() or data_path_for([t.tensor for t in kv_caches.tensors])
            if not isinstance(path, str):
                try:
                    self._worker = KvdWorker(self.options, self.fingerprint, kv_caches,
                                             rank=rank, path=path, spec=self)
                except LayoutError as e:  # its tensors are not the fingerprint's pages
                    log.error("kvd is off for worker rank %d: %s", rank, e)
                    path.close()
                    path = str(e) or "layout"
                else:
                    if path.kind == "client_copy":
                        self._worker.boundary.count("data_path.client_copy")
            if isinstance(path, str):
                self._worker = OffloadOff(rank, path)
                self._worker.boundary.count("data_path.off")
                _report_load_errors_through(self._worker, self)
        return self._worker


def _tp_rank(config: object) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank  # noqa: PLC0415

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (tests): the global rank is the TP rank
        return int(config.parallel.rank) % max(1, int(config.parallel.tp_size))  # type: ignore[attr-defined]
