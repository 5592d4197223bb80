"""The copy engines transfers run on, and the pinner that registers the pool with the
GPU: made at start-up, closed at the stop.

Engines report on their own threads, through the ``done`` and ``waited`` callbacks the
server gives them (which hand each report to the loop).
"""

from __future__ import annotations

import logging

import numpy as np

from kvd.config import Config
from kvd.engines.base import DoneCallback, TransferEngine
from kvd.engines.client_copy import ClientCopyEngine
from kvd.engines.cuda import CudaEngine, WaitedCallback, gpu_path
from kvd.engines.host import HostEngine
from kvd.pinning import PoolPinner

log = logging.getLogger("kvd.server")


class DataPaths:
    def __init__(self) -> None:
        self.engines: dict[str, TransferEngine] = {}  # by name: host, client_copy, cuda
        self.pinner: PoolPinner | None = None

    def start(self, config: Config, pool: np.ndarray, done: DoneCallback,
              waited: WaitedCallback) -> None:
        self.engines = {
            "host": HostEngine(done, threads=config.copy_threads, nice=config.copy_nice,
                               pool=pool),
            "client_copy": ClientCopyEngine(done, pool),
        }
        if config.cuda:
            self._start_cuda(pool, done, waited)

    def _start_cuda(self, pool: np.ndarray, done: DoneCallback,
                    waited: WaitedCallback) -> None:
        from kvd_client.cudart import CudaUnavailable, CudaVersionMismatch, load

        try:
            api = load()
        except CudaVersionMismatch as e:  # a GPU node with the wrong install: say so loudly
            log.warning("GPU data path off: %s", e)
            return
        except CudaUnavailable as e:
            log.info("no GPU data path: %s", e)
            return
        self.engines["cuda"], self.pinner = gpu_path(done, api, pool, on_waited=waited)
        self.pinner.start()  # registers the pool in the background; unpinned until then

    def status(self) -> dict:
        cuda = self.engines.get("cuda")
        return {"pinning": self.pinner.status() if self.pinner else {"state": "unavailable"},
                "data_paths": sorted(self.engines),
                **({"cuda": cuda.stats()} if isinstance(cuda, CudaEngine) else {})}

    def close(self) -> bool:
        """Close every engine; False when copies were still in flight after their wait:
        those keep the pool pinned and mapped (the exit ends them; unregistering or
        unmapping memory under a DMA would not)."""
        settled = True
        for engine in self.engines.values():  # each closes, settled or not
            settled = engine.close() and settled
        if not settled:
            log.error("copies still in flight at the stop: the pool stays mapped until exit")
        elif self.pinner is not None:
            self.pinner.release()
        return settled
