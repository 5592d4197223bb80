"""Worker side: an OffloadingWorker whose copies the daemon does.

The worker registers its KV memory once (``Register`` with its TP rank, replayed by the
connection on every reconnect), then turns each ``submit_store`` / ``submit_load`` into
one ``Transfer`` whose ``event`` is vLLM's job id. The daemon's ``Done`` events (or the
ones the connection synthesizes for transfers lost with the daemon) arrive on the
connection's I/O thread and are queued for ``get_finished``.

vLLM 0.32 kills the engine on ``TransferResult(success=False)`` or a ``submit_*``
returning False, so every job reports success; what failed is handled here:

- a failed or skipped store simply never becomes READY in the daemon;
- a failed load leaves its engine block ids in ``take_load_errors`` (reported to vLLM via
  ``get_block_ids_with_load_errors``, which recomputes those tokens).

The data path follows the tensors' device: host memory (vLLM on CPU) is read and written
by the daemon with process_vm_readv/writev; CUDA memory is exported with IPC handles and
stores are ordered after the forward pass by an interprocess event (kvd_client.cuda);
memory the daemon cannot open is copied here (loads) by ``ClientCopyPath``
(kvd_client.vllm.cuda_paths).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvd_client.connection import Connection
from kvd_client.errors import KvdClientError
from kvd_client.memory import host_regions
from kvd_client.vllm.cuda_paths import ClientCopyPath, CudaPath, cuda_data_path
from kvd_client.vllm.failopen import Boundary
from kvd_client.vllm.fingerprint import split_pages
from kvd_client.vllm.options import KvdOptions, KvdSlots
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config
_LIVE: weakref.WeakSet[KvdWorker] = weakref.WeakSet()  # for a fork's child


class _HostPath:
    """vLLM on CPU: the daemon copies with cross-memory attach; nothing to order."""

    kind = "host"

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.regions = host_regions(tensors)

    def register(self, fp: m.Fingerprint, rank: int) -> m.Register:
        return m.Register(0, fp, rank=rank,
                          host_regions=split_pages(self.regions, fp.rank_page_bytes))

    def order_event(self, job: int) -> int:
        return -1

    def before_send(self, load: bool, blocks: np.ndarray, slots: np.ndarray,
                    conn: Connection) -> str:
        return ""

    def event_done(self, index: int, job: int) -> None:
        return

    def close(self) -> None:
        return


def data_path_for(tensors: Sequence[Any]) -> _HostPath | CudaPath | ClientCopyPath | str:
    """The tensors' data path; a str says why this worker runs without offloading
    (GPU paths and their fallbacks: kvd_client.vllm.cuda_paths)."""
    device = getattr(getattr(tensors[0], "device", None), "type", "cpu")
    if device != "cuda":
        return _HostPath(tensors)
    from kvd_client.cuda import gpu_tensors  # noqa: PLC0415 - CUDA stays lazy

    try:
        described = [g for t in tensors for g in gpu_tensors(t)]
    except ValueError as e:  # a layout kvd cannot describe: serve without offloading
        return f"the KV tensors cannot be described for kvd: {e}"
    return cuda_data_path(described)


@dataclass(slots=True)
class _Job:
    load: bool
    block_ids: np.ndarray
    cuda_event: int


class KvdWorker(OffloadingWorker):
    def __init__(self, options: KvdOptions, fingerprint: m.Fingerprint,
                 kv_caches: CanonicalKVCaches, *, rank: int,
                 path: _HostPath | CudaPath | ClientCopyPath | None = None,
                 spec: object = None) -> None:
        """``path``: the data path get_worker chose (its fallbacks); else the tensors'.
        ``spec``: the OffloadingSpec it serves (inside a MultiConnector, the connector
        running it reports this worker's failed loads)."""
        self.options = options
        self.rank = rank
        self.boundary = Boundary(f"worker{rank}")
        self.tensors = [t.tensor for t in kv_caches.tensors]
        chosen = path if path is not None else data_path_for(self.tensors)
        if isinstance(chosen, str):
            raise KvdClientError(chosen)
        self.path = chosen
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # submitted, Done not yet seen
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()
        self._expedited: set[int] = set()  # loads the forward pass waits for
        self.conn = Connection(
            options.socket, name=f"vllm-worker{rank}", timeout=options.call_timeout_ms / 1000,
            transfer_timeout=options.transfer_timeout_ms / 1000,
            register=self.path.register(fingerprint, rank), on_done=self._on_done,
            on_event_waited=lambda ev: self.path.event_done(ev.cuda_event, ev.event))
        log.info("kvd worker rank %d: %s data path, %d KV tensors, socket %s", rank,
                 self.path.kind, len(self.tensors), options.socket)
        _report_load_errors_through(self, spec)
        _LIVE.add(self)

    def _forked(self) -> None:
        """In a fork's child: the connection is closed there (``Connection._forked``),
        so no Done comes for the parent's jobs; the daemon copies into the parent's
        memory, never the child's. They end here (a load as failed: the child's copy
        of its blocks was not written), and the lock is new: the parent's may have
        been held by its I/O thread, which the child lacks."""
        self._cond = threading.Condition()
        jobs, self._jobs = self._jobs, {}
        for job_id, job in jobs.items():
            if job.load:
                self._load_errors.update(job.block_ids.tolist())
            self._finished.append(TransferResult(job_id, True))

    # ------------------------------------------------------------ submit
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        self.boundary.guard("submit_store", lambda: self._complete(job_id),
                            lambda: self._submit(job_id, False, src_spec, dst_spec))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """``expedited`` (vLLM 0.33 sync loads; KvdConnector's on 0.32, see ``expedite``):
        the forward pass waits for it (``wait`` follows), so its deadline is short."""
        if expedited:
            self._expedited.add(job_id)
        self.boundary.guard("submit_load", lambda: self._fail_load(job_id, dst_spec.block_ids),
                            lambda: self._submit(job_id, True, dst_spec, src_spec))
        return True

    def _submit(self, job_id: int, load: bool, gpu: GPULoadStoreSpec,
                slots_spec: LoadStoreSpec) -> None:
        blocks = np.asarray(gpu.block_ids, dtype=np.int64)
        expedited = job_id in self._expedited  # one submitter at a time (see IdleFlush)
        self._expedited.discard(job_id)
        why = _unusable(slots_spec, blocks, self.conn) or self.path.before_send(
            load, blocks, slots_spec.slots, self.conn)  # type: ignore[union-attr]
        if why:
            self.boundary.count(f"{'load' if load else 'store'}.skipped.{why}")
            return self._fail_load(job_id, blocks) if load else self._complete(job_id)
        assert isinstance(slots_spec, KvdSlots)
        # Stores copy after the forward pass that computed the blocks; loads write after
        # what vLLM queued on its stream before (it may zero the blocks there).
        cuda_event = self.path.order_event(job_id)
        with self._cond:
            self._jobs[job_id] = _Job(load, blocks, cuda_event)
        # 0: the connection stamps its transfer_timeout.
        deadline = (time.monotonic_ns() + self.options.sync_load_timeout_ms * 1_000_000
                    if expedited else 0)
        # The instance is checked again as it goes out (on the connection's thread): a
        # daemon restarted since the check above must not get these slots.
        sent = self.conn.send(m.Transfer(self.conn.next_req(), job_id,
                                         m.Direction.LOAD if load else m.Direction.STORE,
                                         pack_u32(blocks), pack_u32(slots_spec.slots),
                                         cuda_event, slots_spec.ticket,
                                         lease=slots_spec.lease, deadline_ns=deadline),
                              instance=slots_spec.instance)
        if not sent:  # went down in between: nothing will answer
            self._on_done(m.Done(0, job_id, m.Code.CLIENT_GONE, "kvd not connected"))

    # ------------------------------------------------------------ completions
    def _on_done(self, done: m.Done) -> None:
        """Any thread (mostly the connection's I/O thread)."""
        with self._cond:
            job = self._jobs.pop(done.event, None)
            if job is None:
                return  # unknown or already completed
            ok = done.code == m.Code.OK
            if job.load and not ok:
                self._load_errors.update(job.block_ids.tolist())
            self._finished.append(TransferResult(
                done.event, True, done.nbytes if ok else None, done.seconds if ok else None))
            self._cond.notify_all()
        self.path.event_done(job.cuda_event, done.event)
        if not ok:
            kind = "load" if job.load else "store"
            self.boundary.note(f"{kind}_transfer", m.Code(done.code).name.lower(),
                               done.message or "failed")

    def _complete(self, job_id: int) -> None:
        with self._cond:
            self._jobs.pop(job_id, None)
            self._finished.append(TransferResult(job_id, True))
            self._cond.notify_all()

    def _fail_load(self, job_id: int, block_ids: Any) -> None:
        with self._cond:
            self._load_errors.update(np.asarray(block_ids).tolist())
        self._complete(job_id)

    def expedite(self, job_ids: set[int]) -> None:
        """The next loads among ``job_ids`` are waited for before the forward pass (vLLM
        0.32 passes no ``expedited`` flag; KvdConnector says so before submitting)."""
        self._expedited.update(job_ids)

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs we know of in ``job_ids`` completed (unknown ids: ignored).

        Bounded: the connection ends a Transfer without Done once the daemon can no
        longer copy it (its deadline plus grace); ``limit`` only guards against a bug."""
        limit = (time.monotonic() + self.options.transfer_timeout_ms / 1000
                 + m.EXPIRY_GRACE_NS / 1e9 + 5)
        with self._cond:
            while any(j in self._jobs for j in job_ids):
                left = limit - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            stuck = [j for j in job_ids if j in self._jobs]
        if stuck:  # past every deadline: kvd copies nothing for them any more
            log.error("kvd: jobs %s got no completion past their deadline", stuck)
        for j in stuck:
            self._on_done(m.Done(0, j, m.Code.EXPIRED, "no Done from kvd"))

    def take_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (for vLLM's recompute)."""
        with self._cond:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        log.info("kvd worker rank %d: %s; connection: %s", self.rank,
                 dict(sorted(self.boundary.counts.items())), self.conn.stats)
        # First the jobs in flight (bounded by their deadlines): until their Done the
        # daemon may still write into this memory, which may be reused after we return.
        # Then the path, while the connection still delivers the daemon's EventWaited
        # and Done: a CUDA path keeps its events until the daemon passed every wait on
        # them (bounded). Dones made up here below confirm nothing to the daemon's GPU.
        with self._cond:
            inflight = set(self._jobs)
        try:
            self.boundary.guard("shutdown", lambda: None, lambda: self.wait(inflight))
            self.boundary.guard("shutdown", lambda: None, self.path.close)
        finally:
            self.conn.close()
            with self._cond:
                jobs = list(self._jobs)
            for j in jobs:
                self._on_done(m.Done(0, j, m.Code.CLIENT_GONE, "worker shut down"))


def _report_load_errors_through(worker: KvdWorker, spec: object = None) -> None:
    """Loaded as a plain OffloadingConnector spec, nobody would tell vLLM which loads
    failed (it would compute on garbage): lend that connector our load-error report.
    Inside a MultiConnector only the sub-connector running ``spec`` gets it (the
    others report their own failed loads)."""
    try:
        from vllm.distributed.kv_transfer import (  # noqa: PLC0415
            get_kv_transfer_group,
            has_kv_transfer_group,
        )
    except ImportError:
        return
    if not has_kv_transfer_group():
        return  # not inside an engine (tests)
    connector = get_kv_transfer_group()
    subs = getattr(connector, "sub_connectors", None)
    if subs is not None or spec is not None:
        runs_spec = [c for c in (subs if subs is not None else [connector])
                     if getattr(getattr(c, "connector_worker", None), "spec", None) is spec]
        if len(runs_spec) != 1:
            if subs is not None:  # never take another connector's report over
                log.warning("kvd: no sub-connector of %s runs kvd; failed loads are not "
                            "reported to vLLM (use KvdConnector)", type(connector).__name__)
                return
        else:
            connector = runs_spec[0]
    if getattr(type(connector), "reports_kvd_load_errors", False):
        return  # KvdConnector does it itself
    connector.get_block_ids_with_load_errors = worker.take_load_errors  # type: ignore[method-assign]
    log.info("kvd: reporting failed loads through %s; use KvdConnector to also get "
             "kv_load_failure_policy=recompute set for you", type(connector).__name__)


def _unusable(spec: LoadStoreSpec, blocks: np.ndarray, conn: Connection) -> str:
    """Why a job cannot be sent as is ("" when it can)."""
    if not isinstance(spec, KvdSlots):
        return "foreign_spec"
    if spec.ticket:  # a store: the daemon holds the slots
        if len(spec.slots) or not len(blocks):
            return "length" if len(spec.slots) else "empty"
    elif len(spec.slots) == 0 or len(spec.slots) != len(blocks):
        return "empty" if len(spec.slots) == 0 else "length"
    if blocks.size and (blocks.min() < 0 or blocks.max() >= NO_SLOT):  # not a block id
        return "block_ids"
    if not conn.up:
        return "unavailable"
    if spec.instance != conn.instance:  # slots of another daemon run: never touch them
        return "stale_instance"
    if (spec.slots == NO_SLOT).any():
        return "no_slot"
    return ""


def _after_fork_in_child() -> None:
    for worker in list(_LIVE):
        worker._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
