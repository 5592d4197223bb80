"""The worker's GPU data paths, and what it falls back to when the daemon cannot copy.

- ``CudaPath``: the daemon copies (IPC-exported memory, an event ring ordering stores
  after the forward pass).
- ``ClientCopyPath``: the memory cannot be exported (expandable segments, sleep mode,
  another cuMemCreate allocator): this process copies with ``ClientCopier``. Loads only:
  a store names a ticket whose slots only the daemon knows, so stores are skipped (the
  daemon gives their pending slots back when no rank stored with the ticket within
  10 s) and this engine reads what others stored.
- a reason (``str``) from ``cuda_data_path``: no CUDA usable here (no bindings, bindings
  of another CUDA major, no device): the worker runs without offloading (``kvd_client.vllm.off.OffloadOff``).

vLLM must start and serve in every case: refusals are typed (``KvdClientError``) and end
here, with one log line; the caller counts which path was taken.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvd_client.cuda import (ClientCopier, CudaExportRefused, EventRing, GpuTensor,
                             export_regions)
from kvd_client.cudart import load
from kvd_client.errors import KvdClientError
from kvd_client.vllm.fingerprint import split_pages
from kvd_proto import messages as m

if TYPE_CHECKING:
    from kvd_client.connection import Connection
    from kvd_client.cudart import CudaApi

log = logging.getLogger("vllm.kvd_client")


def compute_stream() -> int:
    """The stream vLLM computes on in this thread (torch's current stream)."""
    import torch  # noqa: PLC0415 - only the CUDA paths need it

    return int(torch.cuda.current_stream().cuda_stream)


class CudaPath:
    """GPU KV: IPC-exported regions plus an event ring ordering the daemon's copies
    after the compute stream (stores after the forward pass, loads after what came
    before them)."""

    kind = "cuda"

    def __init__(self, gpu: Sequence[GpuTensor], api: CudaApi) -> None:
        self.api = api
        self.regions = export_regions(gpu, api)
        self.ring = EventRing(api=api)

    def register(self, fp: m.Fingerprint, rank: int) -> m.Register:
        return m.Register(0, fp, rank=rank,
                          cuda_regions=split_pages(self.regions, fp.rank_page_bytes),
                          cuda_event_handles=self.ring.handles)

    def order_event(self, job: int) -> int:
        """An event recorded now on the compute stream: the daemon's copy of ``job``
        waits for it on the GPU."""
        stream = compute_stream()
        index = self.ring.record_next(stream, job)
        if index is None:  # every event still awaited by the daemon: order by syncing
            self.api.stream_synchronize(stream)
            return -1
        return index

    def before_send(self, load: bool, blocks: np.ndarray, slots: np.ndarray,
                    conn: Connection) -> str:
        return ""

    def event_done(self, index: int, job: int) -> None:
        if index >= 0:
            self.ring.waited(index, job)

    def close(self) -> None:
        self.ring.close()  # waits (bounded) until the daemon passed its waits


class ClientCopyPath:
    """The daemon cannot open this memory: loads are copied here, stores skipped."""

    kind = "client_copy"

    def __init__(self, gpu: Sequence[GpuTensor], why: str, api: CudaApi) -> None:
        self.gpu, self.why, self.api = list(gpu), why, api
        self.stream = api.stream_create()  # non-blocking; never the legacy default stream
        self._order = api.event_create()  # the compute stream's point a load waits for
        self._rank = 0
        self._pieces: list[GpuTensor] = []
        self._copier: ClientCopier | None = None
        self._for: m.Registered | None = None

    def register(self, fp: m.Fingerprint, rank: int) -> m.Register:
        self._rank = rank
        as_regions = [m.HostRegion(t.ptr, t.num_blocks, t.stride, t.page_bytes)
                      for t in self.gpu]
        self._pieces = [GpuTensor(r.base, r.num_blocks, r.stride, r.page_bytes)
                        for r in split_pages(as_regions, fp.rank_page_bytes)]
        return m.Register(0, fp, rank=rank, client_copy=True, client_copy_reason=self.why)

    def order_event(self, job: int) -> int:
        return -1  # loads are ordered here (before_send), stores are skipped

    def before_send(self, load: bool, blocks: np.ndarray, slots: np.ndarray,
                    conn: Connection) -> str:
        """Copy a load's slots into the GPU blocks now (the Transfer reports it); a
        store is skipped: its reason ("client_copy"), or "" to send the Transfer."""
        if not load:
            return "client_copy"
        copier = self._copier_for(conn.registered)
        if copier is None:
            return "unavailable"
        # After what vLLM queued on its stream before the load (it may zero the blocks).
        self.api.event_record(self._order, compute_stream())
        self.api.stream_wait_event(self.stream, self._order)
        copier.wait(copier.start(m.Direction.LOAD, blocks, slots))
        if conn.registered is not self._for:  # the daemon restarted during the copy:
            return "stale_instance"  # its slots may have held other blocks by then
        return ""

    def _copier_for(self, reg: m.Registered | None) -> ClientCopier | None:
        """One copier per daemon run (its pool file and layout come with Registered)."""
        if reg is None or not reg.pool_path:
            return None
        if reg is not self._for:
            if self._copier is not None:
                self._copier.close()
            self._copier, self._for = None, reg
            self._copier = ClientCopier(reg, self._rank, self._pieces, self.stream, self.api)
        return self._copier

    def event_done(self, index: int, job: int) -> None:
        return

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        self.api.event_destroy(self._order)
        self.api.stream_destroy(self.stream)


def cuda_data_path(gpu: Sequence[GpuTensor], api: CudaApi | None = None
                   ) -> CudaPath | ClientCopyPath | str:
    """The daemon-copy path; where the daemon cannot copy, the client copy; where CUDA
    itself is not usable, the reason to run without offloading. One log line says which
    and why."""
    try:
        api = api if api is not None else load()
    except KvdClientError as e:  # CudaUnavailable: no bindings, wrong major, no device
        log.warning("kvd: offloading is off for this worker: %s", e)
        return str(e)
    try:
        return CudaPath(gpu, api)
    except CudaExportRefused as e:
        why = e.reason
    except (KvdClientError, ValueError) as e:  # a CUDA call failed, or odd tensors
        why = str(e)
    try:
        path = ClientCopyPath(gpu, why, api)
    except KvdClientError as e:
        log.warning("kvd: offloading is off for this worker: %s; no client-side copy "
                    "either: %s", why, e)
        return f"{why}; {e}"
    log.warning("kvd: the daemon cannot copy this worker's KV cache (%s); this worker "
                "copies its loads itself and skips stores", why)
    return path
