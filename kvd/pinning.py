"""Pinning the pool for DMA: ``cudaHostRegister`` in chunks, on a background thread.

Why chunks: one registration of 512 GiB or more fails on recent drivers, and vLLM
registers at most 64 GiB per call. Why a thread: registration costs ~0.1 s per GiB, so a
large pool takes tens of seconds, during which the daemon already serves; ``ready`` tells
the CUDA engine which pool ranges it may copy with yet (a copy into a range not
registered would be pageable, which is synchronous for the submitting thread), so until
then those jobs miss. Why tolerate failure: pinning is a bandwidth optimisation; when it
fails (RLIMIT_MEMLOCK, no driver, container limits) the daemon reports it and serves the
rest unpinned. Chunks registered before a failure stay registered: part of the pool is
still fast.

Registrations are ``cudaHostRegisterPortable`` so every GPU's context sees the pool as
pinned, and are made in the primary context of the first GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

from kvd_client.cudart import CudaApi, CudaUnavailable

log = logging.getLogger("kvd.pinning")
MAX_CHUNK_BYTES = 64 << 30
State = Literal["idle", "running", "done", "failed", "unavailable", "released"]


def chunks(base: int, nbytes: int, chunk_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(address, length)`` pieces of at most ``chunk_bytes`` covering the range."""
    step = max(1, min(chunk_bytes, MAX_CHUNK_BYTES))
    return [(base + off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


class PoolPinner:
    """Registers ``[base, base + nbytes)`` chunk by chunk; ``status()`` reports progress.

    Lifecycle: ``start()`` once (returns at once), ``status()`` any time from any thread,
    ``release()`` at shutdown, after the copy engines closed (unregisters what was
    registered, exactly once per chunk).
    """

    def __init__(self, base: int, nbytes: int, api: CudaApi | None = None,
                 *, chunk_bytes: int = MAX_CHUNK_BYTES, device: int = 0) -> None:
        self.base = base
        self.nbytes = nbytes
        self._api_source = api
        self._api: CudaApi | None = None
        self._chunks = chunks(base, nbytes, chunk_bytes)
        self._device = device
        self._lock = threading.Lock()
        self._done: list[tuple[int, int]] = []
        self._pinned_end = base  # chunks are registered in order: [base, end) is pinned
        self._state: State = "idle"
        self._error = ""
        self._started = 0.0
        self._seconds = 0.0
        self._thread: threading.Thread | None = None
        self._ctx = 0
        self._finished = threading.Event()
        self._cancel = threading.Event()  # release() came: no more chunks

    def start(self) -> None:
        """Begin registering on a background thread (no-op when already started)."""
        with self._lock:
            if self._state != "idle":
                return
            self._state = "running"
            self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvd-pin", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True when registration finished (done, failed or unavailable) in time."""
        return self._finished.wait(timeout)

    def ready(self, lo: int, hi: int) -> bool:
        """May GPU copies touching ``[lo, hi)`` of the pool be issued now? Yes once that
        range is registered, or once registration ended without reaching it (failed or
        unavailable: it is served unpinned from then on); no while it is still coming."""
        if hi <= self._pinned_end and lo >= self.base:
            return True
        return self._finished.is_set()

    def _resolve(self) -> CudaApi:
        """The injected seam, or the real driver (loaded here, on the pinning thread)."""
        if self._api_source is not None:
            return self._api_source
        from kvd_client.cudart import load  # noqa: PLC0415 - CUDA stays lazy

        return load()

    def _run(self) -> None:
        try:
            try:
                api = self._resolve()
                self._ctx = api.retain_primary_context(self._device)
                self._api = api  # from here on, release() owes a context release
                api.set_current_context(self._ctx)
            except CudaUnavailable as e:
                self._end("unavailable", str(e))
                return
            except Exception as e:  # noqa: BLE001 - any failure: serve unpinned
                self._end("failed", f"cannot set up CUDA for pinning: {e}")
                return
            for ptr, n in self._chunks:
                if self._cancel.is_set():  # a stop: the rest would only be unregistered
                    log.info("pool pinning stopped by the daemon's stop")
                    return
                try:
                    api.host_register(ptr, n)
                except Exception as e:  # noqa: BLE001 - serve unpinned, say why
                    api.clear_last_error()  # or the latched error surfaces in a later call
                    self._end("failed", f"cudaHostRegister of {n} bytes at offset "
                                        f"{ptr - self.base} failed: {e}; serving the rest of "
                                        "the pool unpinned (raise LimitMEMLOCK?)")
                    return
                with self._lock:
                    self._done.append((ptr, n))
                    self._pinned_end = ptr + n
            self._end("done", "")
        finally:
            self._finished.set()

    def _end(self, state: State, error: str) -> None:
        with self._lock:
            self._state = state
            self._error = error
            self._seconds = time.monotonic() - self._started
        if error:
            log.warning("pool not pinned: %s", error)
        else:
            log.info("pool pinned: %d bytes in %.1f s", self.nbytes, self._seconds)

    def status(self) -> dict[str, object]:
        """Progress for the daemon's status document (JSON-ready)."""
        with self._lock:
            pinned = sum(n for _, n in self._done)
            running = self._state == "running"
            return {
                "state": self._state,
                "pinned_bytes": pinned,
                "total_bytes": self.nbytes,
                "chunks_done": len(self._done),
                "chunks_total": len(self._chunks),
                "fraction": pinned / self.nbytes if self.nbytes else 1.0,
                "seconds": (time.monotonic() - self._started) if running else self._seconds,
                "error": self._error,
            }

    def release(self, timeout: float = 10.0) -> None:
        """Unregister every registered chunk. A registration still running stops after
        its chunk (a 64 GiB chunk takes seconds); one that does not end within
        ``timeout`` keeps everything registered: the process's exit releases it."""
        self._cancel.set()
        if self._thread is not None and not self._finished.wait(timeout):
            log.warning("pool pinning did not stop within %.0fs; left to the exit", timeout)
            return
        with self._lock:
            done, self._done = self._done, []
            self._pinned_end = self.base
            if self._state != "idle":
                self._state = "released"
        api, self._api = self._api, None
        if api is None:
            return
        try:
            api.set_current_context(self._ctx)  # release() runs on the caller's thread
        except Exception as e:  # noqa: BLE001 - shutting down: log and go on
            log.warning("cannot make the pinning context current: %s", e)
        for ptr, _ in done:
            try:
                api.host_unregister(ptr)
            except Exception as e:  # noqa: BLE001 - shutting down: log and go on
                log.warning("cudaHostUnregister at offset %d: %s", ptr - self.base, e)
        try:
            api.release_primary_context(self._device)
        except Exception as e:  # noqa: BLE001
            log.warning("releasing the pinning context: %s", e)
