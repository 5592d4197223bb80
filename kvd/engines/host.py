"""Host data path: cross-memory attach (process_vm_readv / process_vm_writev).

The daemon reads a client's pages straight into pool slots (store) and writes pool
slots straight into the client's pages (load). iovec arrays come from numpy, at most
IOV_MAX entries per system call. A job is cut into chunks that the worker threads
share, so one large transfer uses every copy thread.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvd.engines.base import (STOP_S, CopyJob, DoneCallback, TransferEngine, checksum_after,
                              expired, late, verify_then)
from kvd_client.runs import coalesce, split_long
from kvd.errors import TransferError
from kvd_proto.messages import Code, Direction

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
CHUNK_BYTES = 4 * 1024 * 1024  # split jobs so threads share big transfers

_libc = ctypes.CDLL(None, use_errno=True)
_vm_readv = _libc.process_vm_readv
_vm_writev = _libc.process_vm_writev
for _f in (_vm_readv, _vm_writev):
    _f.restype = ctypes.c_ssize_t
    _f.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]


def vm_copy(direction: Direction, pid: int, pool: np.ndarray, remote: np.ndarray,
            lengths: np.ndarray, deadline: float = math.inf) -> int:
    """Copy one batch (any size) between this process's pool and ``pid``; returns bytes.

    ``deadline`` (time.monotonic()) is checked right before each system call, so what
    separates the check from the copy is a few Python operations, not the array work.
    Raises TransferError with a code saying why (permission, process gone, bad address,
    deadline passed).
    """
    fn = _vm_readv if direction == Direction.STORE else _vm_writev
    n = len(lengths)
    local = np.empty((n, 2), dtype=np.uint64)
    local[:, 0] = pool
    local[:, 1] = lengths
    far = np.empty((n, 2), dtype=np.uint64)
    far[:, 0] = remote
    far[:, 1] = lengths
    done = 0
    for lo in range(0, n, IOV_MAX):
        hi = min(n, lo + IOV_MAX)
        want = int(lengths[lo:hi].sum())
        if time.monotonic() > deadline:
            raise TransferError(f"deadline passed before the copy of {want} bytes could "
                                f"start ({done} bytes of this chunk copied)", Code.EXPIRED)
        got = fn(pid, local[lo:].ctypes.data, hi - lo, far[lo:].ctypes.data, hi - lo, 0)
        if got < 0:
            raise _os_error(ctypes.get_errno(), pid)
        if got != want:
            # A partial copy means part of the remote range is not mapped.
            raise TransferError(
                f"short copy with pid {pid}: {got} of {want} bytes (unmapped client memory?)",
                Code.TRANSFER_FAILED,
            )
        done += got
    return done


def check_owner(pid: int, uid: int) -> None:
    """Refuse to copy with ``pid`` unless ``uid`` could do it itself. The daemon copies
    with CAP_SYS_PTRACE, which passes the kernel's own checks; and the pid is where the
    client's socket was opened, which may since have exec'd another program (a setuid
    one) or been handed to another process. The files in ``/proc/<pid>/`` belong to the
    process's effective uid while it is dumpable, and to root once it is not (a setuid
    exec, a setuid() without an exec, a prctl): owned by ``uid``, it is a process ``uid``
    may debug (the directory itself may keep its first owner). Root may copy with any.
    Checked before and after every copy call: a store that read across an exec is not
    kept; a load's write in that window is the one gap left (a complete guard would
    copy with the client's own credentials)."""
    if uid == 0:
        return
    try:
        owner = os.stat(f"/proc/{pid}/status").st_uid
    except FileNotFoundError:
        raise _os_error(errno.ESRCH, pid) from None
    except OSError as e:  # /proc mounted with hidepid, say: no copy we cannot vouch for
        raise TransferError(f"cannot look at process {pid} in /proc ({e.strerror}): kvd "
                            "copies only with a process it can check", Code.PERMISSION) from None
    if owner != uid:
        if _exited(pid):  # a zombie's files are root's too: gone, not foreign
            raise _os_error(errno.ESRCH, pid)
        raise TransferError(
            f"process {pid} is not one uid {uid} may access (its /proc entry belongs to uid "
            f"{owner}: another user's process, or one that is not dumpable, e.g. setuid): "
            "kvd copies only with the client's own process", Code.PERMISSION)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _os_error(err: int, pid: int) -> TransferError:
    if err == errno.EPERM:
        return TransferError(
            f"no permission to access the memory of pid {pid}: the client must run as the "
            "daemon's user or call prctl(PR_SET_PTRACER, daemon_pid) (kvd_client does), "
            "and the daemon needs CAP_SYS_PTRACE where Yama ptrace_scope is 2",
            Code.PERMISSION,
        )
    if err == errno.ESRCH:
        return TransferError(f"client process {pid} is gone", Code.CLIENT_GONE)
    if err == errno.EFAULT:
        return TransferError(f"bad address in the memory of pid {pid} (or in the pool, if "
                             "its file was cut)", Code.TRANSFER_FAILED)
    return TransferError(f"copy with pid {pid} failed: {os.strerror(err)}", Code.TRANSFER_FAILED)


class FairQueue:
    """Chunks by client, served round-robin (FIFO within a client): one client's large
    transfer takes turns with the other clients' jobs instead of holding every copy
    thread until it is through, past their deadlines. Threads block on a SimpleQueue of
    tokens, one per chunk (a Condition's wake-ups cost the data path ~5 %)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[int, deque[_Chunk]] = {}
        self._turns: deque[int] = deque()  # clients with chunks waiting, in serving order
        self._tokens: queue.SimpleQueue[bool] = queue.SimpleQueue()  # False: stop

    def put(self, key: int, chunks: list[_Chunk]) -> None:
        with self._lock:
            q = self._by.get(key)
            if q is None:
                q = self._by[key] = deque()
                self._turns.append(key)
            q.extend(chunks)
        for _ in chunks:
            self._tokens.put(True)

    def get(self) -> _Chunk | None:
        """The next client's next chunk; None at a stop marker (or once ``left`` took
        what was queued)."""
        if not self._tokens.get():
            return None
        with self._lock:
            if not self._turns:
                return None
            key = self._turns.popleft()
            q = self._by[key]
            chunk = q.popleft()
            if q:
                self._turns.append(key)
            else:
                del self._by[key]
            return chunk

    def stop(self, threads: int) -> None:
        """One stop marker per thread, behind what is queued now."""
        for _ in range(threads):
            self._tokens.put(False)

    def left(self) -> list[_Chunk]:
        """Take what no thread took (after ``stop``)."""
        with self._lock:
            out = [c for q in self._by.values() for c in q]
            self._by.clear()
            self._turns.clear()
            return out


@dataclass(eq=False)
class _Chunk:
    job: CopyJob
    lo: int
    hi: int
    state: _JobState


@dataclass(eq=False)
class _JobState:
    remaining: int
    started: float
    error: Exception | None = None
    bounds: list[tuple[int, int]] | None = None  # chunks held back until verified


class HostEngine(TransferEngine):
    name = "host"

    def __init__(self, on_done: DoneCallback, threads: int = 2,
                 pool: np.ndarray | None = None, nice: int = 0) -> None:
        super().__init__(on_done)
        self.pool = pool  # the daemon's pool mapping, for checksums
        self.nice = nice
        self._q = FairQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvd-copy-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: CopyJob) -> None:
        # Merged runs are cut again at CHUNK_BYTES: consecutive blocks in consecutive
        # slots would otherwise make one copy call of any size, its deadline checked once.
        pool, remote, lengths = split_long(*coalesce(job.pool, job.remote, job.lengths),
                                           CHUNK_BYTES)
        job.pool, job.remote, job.lengths = pool, remote, lengths
        # Cut into chunks of about CHUNK_BYTES (never more than IOV_MAX segments).
        csum = np.cumsum(lengths)
        total = int(csum[-1]) if len(csum) else 0
        cuts = [0]
        if total > CHUNK_BYTES:
            marks = np.arange(CHUNK_BYTES, total, CHUNK_BYTES, dtype=np.uint64)
            cuts += [int(c) for c in np.unique(np.searchsorted(csum, marks, side="right"))
                     if 0 < c < len(lengths)]
        cuts.append(len(lengths))
        bounds = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            bounds += [(a, min(hi, a + IOV_MAX)) for a in range(lo, hi, IOV_MAX)]
        if not bounds:
            bounds = [(0, 0)]
        state = _JobState(len(bounds), time.perf_counter())
        if job.checksum is not None and job.checksum.expected is not None:
            # Verify on a copy thread first (never on the loop); copies follow if clean.
            state.remaining, state.bounds, bounds = 1, bounds, [(-1, -1)]
        with self._lock:
            if self._closed:
                self.on_done(job, TransferError("daemon is stopping", Code.ABORTED), 0.0)
                return
            self._q.put(job.client, [_Chunk(job, lo, hi, state) for lo, hi in bounds])

    def _run(self) -> None:
        if self.nice:
            # Copies share the node's cores with the engines: let a busy engine win the
            # core (an idle one, waiting for its load, leaves the core to the copy).
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass
        while True:
            chunk = self._q.get()
            if chunk is None:
                return
            job, st = chunk.job, chunk.state
            # Never start a copy (nor a load's verification) past the deadline.
            err: Exception | None = st.error or expired(job)
            if err is None and chunk.lo < 0:  # the verification step of a load
                try:
                    err = verify_then(job, self.pool)
                except Exception as e:  # noqa: BLE001 - the job still gets its one Done
                    err = e
                if err is None and st.bounds:
                    with self._lock:
                        st.remaining += len(st.bounds)
                    self._q.put(job.client, [_Chunk(job, lo, hi, st) for lo, hi in st.bounds])
            elif err is None and chunk.hi > chunk.lo:
                try:
                    if job.uid >= 0:
                        check_owner(job.pid, job.uid)
                    vm_copy(job.direction, job.pid, job.pool[chunk.lo:chunk.hi],
                            job.remote[chunk.lo:chunk.hi], job.lengths[chunk.lo:chunk.hi],
                            job.deadline)
                    if job.uid >= 0:  # an exec during the copy: a store read is not kept
                        check_owner(job.pid, job.uid)
                except Exception as e:  # noqa: BLE001 - reported to the client as Done
                    err = e
            with self._lock:
                if err is not None and st.error is None:
                    st.error = err
                st.remaining -= 1
                last = st.remaining == 0
            if last:
                if st.error is None and job.direction == Direction.STORE:
                    st.error = late(job)  # read after its client gave up: not trusted
                    if st.error is None:
                        try:
                            checksum_after(job, self.pool)
                        except Exception as e:  # noqa: BLE001 - reported as its Done
                            st.error = e
                self.on_done(job, st.error, time.perf_counter() - st.started)

    def close(self, timeout: float = STOP_S) -> bool:
        with self._lock:
            self._closed = True
        self._q.stop(len(self._threads))  # threads take what is queued, then end
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        settled = not any(t.is_alive() for t in self._threads)
        # Chunks no thread took in time: their jobs still get their one Done (a job with
        # a chunk on a thread still copying is ended by that thread instead).
        ended: set[int] = set()
        for chunk in self._q.left():
            if id(chunk.state) not in ended:
                ended.add(id(chunk.state))
                self.on_done(chunk.job, TransferError("daemon is stopping", Code.ABORTED),
                             time.perf_counter() - chunk.state.started)
        return settled
