"""The disk tier: blocks the RAM pool let go of, kept in one slot file, restart-safe.

One data file of exactly ``size`` bytes, carved by the pool's ``Allocator``: a slot holds
a ``BlockHeader`` and the payload, rounded up to 4 KiB, so the block sizes of several
tenants coexist as size classes. The index (disk_index.py) lives in memory and in a
journal (kvd/journal.py's framing, disk_journal.py's records); eviction is a registry
policy.

A put's order makes a kill -9 and a reboot alike leave a journal naming only blocks it
may serve: (1) the Drops of the blocks evicted for room are appended before their slots
are written; (2) the blocks are written and ``fdatasync``ed; (3) then their Puts are
appended and the journal ``fsync``ed. A reboot may lose appends not yet synced: a lost
Put forgets a block; a lost Drop leaves a key naming a slot that now holds another
block, which the header check makes a miss. Data is verified on read, never at start.

The event loop asks ``contains`` and ``status``: they take ``_lock`` only, which is never
held across file I/O, so a stalled disk (a frozen filesystem, a hung device) costs
demotions and promotions, never the loop. A failing disk (EIO, ENOSPC, read-only) turns
the tier off for ``FAULT_COOLDOWN_S`` at a time: no evictions for writes that would fail,
no promotions that would be read in vain.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import takewhile
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.policies.base import DEFAULT_POLICY, make_policy
from kvd.errors import BreakerOpen, ConfigError, TierError
from kvd.gc_pause import collector_paused
from kvd.tiers.base import HEADER_BYTES, BlockHeader, Tier, TierBlock
from kvd.tiers.disk_files import open_files, reopen_data, reserve, undo_open
from kvd.tiers.disk_index import DiskIndex, scoped
from kvd.tiers.disk_journal import DiskDrop, DiskHeader, DiskPut, JournalKeeper
from kvd.tiers.vectored import pad, vectored

log = logging.getLogger("kvd.tiers.disk")

FAULT_COOLDOWN_S = 5.0  # after a failed read or write, the tier is off this long
CLOSE_WAIT_S = 10.0  # how long close() waits for a write in flight (a stalled disk)
COMPACT_RETRY_S = 30.0  # after a journal rewrite failed, the next try


class _Staged(NamedTuple):
    scoped: bytes
    block: TierBlock
    view: memoryview
    head: bytes
    checksum: int
    slot_bytes: int


F = TypeVar("F", bound=Callable[..., Any])


def _io_errors(method: F) -> F:
    """An ``OSError`` of the files (ENOSPC, EIO) leaves the tier as a ``TierError``."""
    @functools.wraps(method)
    def wrapped(self: DiskTier, *args: Any) -> Any:
        try:
            return method(self, *args)
        except OSError as e:
            raise TierError(f"disk tier {self.path}: {e}") from e
    return cast(F, wrapped)


class DiskTier(Tier):
    """Blocks in one slot file on a local disk, found again after a restart.

    ``_lock`` guards the index, allocator, policy and counters and is never held across
    I/O; ``keeper.lock`` guards the journal and its appends; ``_put_lock`` makes puts, journal
    fsyncs and compactions one at a time, so a reader goes on while a put writes. A
    reader may see its slot reused by a concurrent put: the header check makes that a
    miss. A slot a reader drops is freed only after its Drop is appended.
    """

    name = "disk"
    local = True
    compact_min_records = 1024  # below this, the journal is never rewritten while open

    def __init__(self, path: str, size: int, policy: str = "", extent_size: int = 64 << 20,
                 min_slot_bytes: int = 4096, sync: bool = True) -> None:
        self.path, self.size, self.sync = path, size, sync
        try:
            self.allocator = Allocator(size, extent_size, min_slot_bytes)
            self.policy = make_policy(policy or DEFAULT_POLICY, self.allocator.max_slots)
        except ValueError as e:  # AllocatorError included
            raise ConfigError(f"disk tier at {path}: {e}") from None
        self.index = DiskIndex(self.allocator, self.policy)
        self.geometry = DiskHeader(size, extent_size, min_slot_bytes)
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self.clock: Callable[[], float] = time.monotonic
        self._off_until = 0.0  # the tier is off (a fault) until then
        self._compact_after = 0.0  # no journal rewrite before then (one failed)
        self._faults = 0  # consecutive
        self.last_error = ""
        self._closed = False
        self.counts = dict.fromkeys(("written_blocks", "read_blocks", "evicted_blocks",
                                     "corrupt_blocks", "declined_blocks",
                                     "unreadable_blocks", "bad_slots"), 0)
        opened = open_files(path, size)
        self._fd, self.journal = opened.fd, opened.journal
        self.keeper = JournalKeeper(self.journal, self.geometry, path, sync)
        try:
            with collector_paused():  # (a start with half a million blocks on disk)
                self.restored_blocks = self._restore(opened.reused)
            reserve(self._fd, size, path)
        except (ConfigError, OSError) as e:
            undo_open(opened, path)
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"disk tier: cannot size or restore {path}: {e}") from None
        try:
            self._compact()
        except OSError as e:  # serving beats a tidy journal: appends go on, or fail then
            # (the journal as it was still names every block: reads are served at once)
            log.error("disk tier %s: cannot rewrite its journal at start: %s", path, e)
            self.last_error = str(e)
            self._compact_after = self.clock() + COMPACT_RETRY_S

    # ------------------------------------------------------------ restart
    def _restore(self, reused: bool) -> int:
        """Rebuild the index from the journal, or start empty (truncating the file)."""
        live, why = self.keeper.replay(reused)
        if why or not reused:
            os.ftruncate(self._fd, 0)  # drop old bytes (sparse again), then size it
            os.ftruncate(self._fd, self.size)
        self.index.restore(live)
        if len(self.index.entries) < len(live):
            log.warning("disk tier %s: %d journaled blocks do not fit the geometry",
                        self.path, len(live) - len(self.index.entries))
        return len(self.index.entries)

    # ------------------------------------------------------------ faults
    def _fault(self, error: OSError) -> None:
        """A failed read or write: the tier is off for a while (no work that would fail)."""
        with self._lock:
            self._faults += 1
            self._off_until = self.clock() + FAULT_COOLDOWN_S
            self.last_error = str(error)
        log.warning("disk tier %s: %s; off for %.0fs", self.path, error, FAULT_COOLDOWN_S)

    def _off(self) -> bool:
        """Whether the tier is off after a fault (under ``_lock``)."""
        return self.clock() < self._off_until

    # ------------------------------------------------------------ Tier
    def contains(self, ns: bytes, keys: Sequence[bytes], nbytes: int = 0) -> int:
        """The leading run of ``keys`` held, made the most recent: a promotion reads it
        next, and the blocks its room in RAM sends down must not evict it first."""
        # (sizes unchecked: the tier wrote each entry, of its tenant's one block size)
        with self._lock:
            if self._off():  # a promotion now would fail, and evict for it first
                return 0
            run = list(takewhile(self.index.entries.__contains__,
                                 (scoped(ns, k) for k in keys)))
            if run:
                self.index.touch(run)
        return len(run)

    @_io_errors
    def put(self, ns: bytes, blocks: Sequence[TierBlock]) -> int:
        """Store the blocks not held yet, evicting for room; returns how many the tier
        holds now (those already held included). Declines a block whose slot would not
        fit an extent, or more blocks of one size than the file has slots for."""
        with self._put_lock:
            with self._lock:
                self._check_open()
                if self._off():  # it would evict good blocks for writes that fail
                    raise BreakerOpen(f"disk tier {self.path}: off after a fault "
                                      f"({self.last_error})")
            if os.fstat(self._fd).st_nlink == 0:
                self._renew()
            with self._lock:
                todo: dict[bytes, TierBlock] = {}
                for b in blocks:
                    if (k := scoped(ns, b.key)) not in self.index.entries:
                        todo.setdefault(k, b)
            staged: dict[int, list[_Staged]] = {}  # by slot size; checksums lock-free
            declined = 0
            for k, b in todo.items():
                view = memoryview(b.data).cast("B")
                slot_bytes = self.index.slot_bytes(view.nbytes)
                try:
                    if slot_bytes > self.allocator.extent_bytes:
                        raise ValueError("larger than an extent")
                    h = BlockHeader.of(ns, b.key, view, b.depth)
                    staged.setdefault(slot_bytes, []).append(
                        _Staged(k, b, view, h.pack(), h.checksum, slot_bytes))
                except ValueError:  # too large, or a key that does not fit a header
                    declined += 1
            return len(blocks) - len(todo) + self._store(ns, staged, declined)

    def _renew(self) -> None:
        """The slot file was removed (an operator, a clean-up job): its blocks live on
        only in an inode no restart finds, and its lock no longer keeps a second daemon
        out of the directory. A new empty file takes its place (at the same descriptor:
        a read in flight gets the old bytes or a header mismatch), the blocks are
        dropped and the journal starts again. Under ``_put_lock``."""
        try:
            fd = reopen_data(self.path, self.size)
        except OSError as e:
            error = OSError(e.errno, "its slot file was removed, and a new one cannot be "
                                     f"made: {e.strerror}")
            if e.errno != errno.EEXIST:
                self._fault(error)  # (a full disk: tried again after the cooldown)
                raise error from None
            with self._lock:  # another daemon's files now: off until a restart
                self._off_until = math.inf
                self.last_error = str(error)
            log.error("disk tier %s: %s; the tier is off until kvd restarts", self.path,
                      error)
            raise error from None
        with self._lock:
            keys = list(self.index.entries)
            deque(map(self.policy.remove, keys), maxlen=0)
            self.index.drop(keys)
            os.dup2(fd, self._fd, inheritable=False)
            os.close(fd)
            self.last_error = "its slot file was removed"
        log.error("disk tier %s: its slot file was removed; a new one is in use, and the "
                  "%d blocks of the old one are dropped", self.path, len(keys))
        self._compact()

    def _store(self, ns: bytes, staged: dict[int, list[_Staged]], declined: int) -> int:
        placed: list[_Staged] = []
        slots: list[int] = []
        with self._lock:
            dropped: list[int] = []
            for slot_bytes, items in staged.items():
                items = items[:self.allocator.total_slots(slot_bytes)]
                self.allocator.fit(self.policy, self.index.bound, keep=slot_bytes)
                freed = self.index.make_room(slot_bytes, len(items))
                self.counts["evicted_blocks"] += len(freed)
                dropped += freed
                got = self.allocator.alloc_many(slot_bytes, len(items))
                placed += items[:len(got)]
                slots += got
            self.counts["declined_blocks"] += (declined + sum(map(len, staged.values()))
                                               - len(placed))
        # Only this put (under _put_lock) can take the slots just freed: their Drops
        # reach the journal before the slots are written.
        stage = "journal"  # what failed, if something does: the journal or the data
        try:
            self.keeper.append([DiskDrop(s) for s in dropped])
            if not placed:
                return 0
            sizes = np.array([w.slot_bytes for w in placed], dtype=np.int64)
            iovs = [[w.head, w.view, *pad(w.slot_bytes - HEADER_BYTES - w.view.nbytes)]
                    for w in placed]
            stage = "data"
            if not all(vectored(os.pwritev, self._fd, iovs, self.index.offsets(slots, sizes),
                                 sizes)):  # no error, fewer bytes: the filesystem filled
                raise OSError(errno.ENOSPC, "short write (the filesystem is full?)")
            if self.sync:
                os.fdatasync(self._fd)
            stage = "journal"
            puts = [DiskPut(ns, w.block.key, s, w.slot_bytes, w.view.nbytes, w.checksum,
                            w.block.depth) for w, s in zip(placed, slots)]
            self.keeper.append(puts)
        except OSError as e:
            with self._lock:
                if e.errno == errno.EIO and stage == "data":  # bad sectors: set aside,
                    self.counts["bad_slots"] += len(slots)  # or the next put takes them
                else:  # a full or read-only filesystem, a journal that failed: reusable
                    self.allocator.free_many(slots)
            self._fault(e)
            raise
        with self._lock:
            self._faults = 0
            for w, p in zip(placed, puts):
                self.index.hold(w.scoped, p)
            self.counts["written_blocks"] += len(puts)
            compact = (self.keeper.records > max(self.compact_min_records,
                                                 4 * len(self.index.entries))
                       and self.clock() >= self._compact_after)
        try:
            if self.sync:
                self.journal.sync()
            if not compact and self.clock() >= self._compact_after and self.journal.gone():
                log.warning("disk tier %s: its journal was removed; writing it again",
                            self.path)
                compact = True
            if compact:
                self._compact()
        except OSError as e:  # the blocks are written and held; a restart may miss them
            log.warning("disk tier %s: journal: %s", self.path, e)
            if compact:  # not a full snapshot per put while the disk refuses them
                self._compact_after = self.clock() + COMPACT_RETRY_S
        return len(puts)

    @_io_errors
    def get_into(self, ns: bytes, keys: Sequence[bytes], outs: Sequence[Any]) -> int:
        """Read the leading run of held ``keys`` into ``outs``, each verified against
        its header; a block that fails is forgotten and ends the run."""
        with self._lock:
            self._check_open()
            if self._off():
                raise BreakerOpen(f"disk tier {self.path}: off after a fault "
                                  f"({self.last_error})")
            run: list[DiskPut] = []
            for key, out in zip(keys, outs):
                e = self.index.entries.get(scoped(ns, key))
                if e is None or memoryview(out).nbytes != e.length:
                    break
                run.append(e)
        if not run:
            return 0
        views = [memoryview(o).cast("B") for o in outs[:len(run)]]
        heads = [memoryview(bytearray(HEADER_BYTES)) for _ in run]
        pads = [e.slot_bytes - HEADER_BYTES - e.length for e in run]
        scratch = memoryview(bytearray(max(pads)))  # the padding lands here
        iovs = [[h, v, *pad(p, scratch)] for h, v, p in zip(heads, views, pads)]
        sizes = np.array([e.slot_bytes for e in run], dtype=np.int64)
        offsets = self.index.offsets([e.slot for e in run], sizes)
        full = vectored(os.preadv, self._fd, iovs, offsets, sizes, isolate_errors=True)
        ok, bad, why = 0, None, "corrupt_blocks"
        for e, whole, head, view in zip(run, full, heads, views):
            if not whole:  # an I/O error (a bad sector): as unusable as a corrupt block
                bad, why = e, "unreadable_blocks"
                break
            h = BlockHeader.unpack(head)
            if h is None or not h.matches(ns, e.key, view):
                bad = e
                break
            ok += 1
        gone = None  # the slot of the block that failed, if still the one read
        with self._lock:
            entries = self.index.entries
            if bad is not None and entries.get(k := scoped(ns, bad.key)) is bad:
                # Still the block we read (not evicted and reused meanwhile): gone. Its
                # slot is freed once its Drop is journaled (a corrupt block), or set
                # aside (unreadable: a put would take it again).
                self.policy.remove(k)
                del entries[k]
                del self.index.slot_key[bad.slot]
                gone = bad.slot
                self.counts[why] += 1
                if why == "unreadable_blocks":
                    self.counts["bad_slots"] += 1
            elif bad is None:
                self._faults = 0
            self.counts["read_blocks"] += ok
        if gone is not None:
            try:
                self.keeper.append([DiskDrop(gone)])
            except OSError as e:  # the header check still makes it a miss after a restart
                self._fault(e)
            if why == "corrupt_blocks":
                with self._lock:
                    self.allocator.free_many([gone])
        if why == "unreadable_blocks" and bad is not None:
            self._fault(OSError(errno.EIO, f"unreadable block at slot {bad.slot}"))
        return ok

    # ------------------------------------------------------------ upkeep
    def _compact(self) -> None:
        """Rewrite the journal as the index holds it (``JournalKeeper.compact``)."""
        self.keeper.compact(self._lock, self.index.entries)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"disk tier {self.path} is closed")

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"path": self.path, "state": "open" if self._off() else "closed",
                    "blocks": len(self.index.entries),
                    "bytes": self.allocator.used_bytes,
                    "capacity_bytes": self.allocator.capacity_bytes,
                    "restored_blocks": self.restored_blocks, **self.counts,
                    "consecutive_failures": self._faults, "last_error": self.last_error}

    def close(self, timeout: float | None = None) -> None:
        """Sync, compact the journal, release the files; a second call does nothing.
        A disk that does not let a write (or this sync) finish within ``timeout``
        (CLOSE_WAIT_S at most) keeps its files open: the process exits all the same,
        the journal as it was."""
        wait = CLOSE_WAIT_S if timeout is None else min(timeout, CLOSE_WAIT_S)
        done = threading.Event()
        closer = threading.Thread(target=self._close, args=(done,), daemon=True,
                                  name="kvd-disk-close")
        closer.start()
        if not done.wait(wait):
            with self._lock:
                self._closed = True
            log.error("disk tier %s: I/O did not finish within %.1fs; closing without it",
                      self.path, wait)

    def _close(self, done: threading.Event) -> None:
        with self._put_lock:
            if self._closed:
                done.set()
                return
            try:
                if os.fstat(self._fd).st_nlink == 0:  # the path may be another daemon's
                    raise OSError(errno.ENOENT, "its slot file was removed; its journal "
                                                "is left as it is")
                if self.sync:
                    os.fdatasync(self._fd)
                    self.journal.sync()
                self._compact()
            except OSError as e:
                log.warning("disk tier %s: closing: %s", self.path, e)
            finally:
                with self._lock:
                    self._closed = True
                    self.index.entries.clear()
                    self.index.slot_key.clear()
                with self.keeper.lock:
                    self.journal.close()
                os.close(self._fd)
                done.set()
