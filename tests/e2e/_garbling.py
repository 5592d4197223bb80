"""A test-only kvd spec whose worker garbles the blocks of every load it is told
succeeded, and reports that load failed. Identical tokens then prove that vLLM
recomputed those blocks instead of using them (a failed load must never be consumed).

Loaded by the engine like any out-of-tree spec:
``{"spec_name": "GarblingSpec", "spec_module_path": "_garbling"}``.
"""

from __future__ import annotations

import torch

from kvd_client.vllm.spec import KvdOffloadingSpec, _tp_rank
from kvd_client.vllm.worker import KvdWorker
from kvd_proto import messages as m


class GarblingWorker(KvdWorker):
    def _on_done(self, done: m.Done) -> None:
        """The blocks are garbled before the failure can be seen, as a torn copy writes
        them before its Done: garbling any later could hit blocks vLLM has recomputed."""
        with self._cond:
            job = self._jobs.get(done.event)
        if job is not None and job.load and done.code == m.Code.OK:
            idx = torch.as_tensor(job.block_ids, dtype=torch.long,
                                  device=self.tensors[0].device)
            for t in self.tensors:
                t[idx] = 77
            done = m.Done(done.req, done.event, m.Code.TRANSFER_FAILED, "garbled (test)")
        super()._on_done(done)


class GarblingSpec(KvdOffloadingSpec):
    def get_worker(self, kv_caches):  # type: ignore[no-untyped-def, override]
        if self._worker is None:
            self._worker = GarblingWorker(self.options, self.fingerprint, kv_caches,
                                          rank=_tp_rank(self.config))
        return self._worker
