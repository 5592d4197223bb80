"""The disk tier: blocks the RAM pool let go of, kept in one slot file, restart-safe.

One data file of exactly ``size`` bytes, carved by the pool's ``Allocator``: a slot holds
a ``BlockHeader`` and the payload, rounded up to 4 KiB, so the block sizes of several
tenants coexist as size classes. The index lives in memory and in a journal
(kvd/journal.py's framing, this module's records); eviction is a registry policy.

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
from itertools import islice, takewhile
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from kvd.core.allocator import Allocator, AllocatorError
from kvd.core.eviction import SCAN
from kvd.core.policies.base import DEFAULT_POLICY, make_policy
from kvd.errors import BreakerOpen, ConfigError, TierError
from kvd.tiers.base import HEADER_BYTES, BlockHeader, Tier, TierBlock
from kvd.tiers.disk_files import open_files, reopen_data, reserve, sync_dir, undo_open
from kvd.tiers.disk_journal import DiskDrop, DiskHeader, DiskPut, replay
from kvd.tiers.vectored import PAGE, pad, vectored

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


def _scoped(ns: bytes, key: bytes) -> bytes:
    """The index's key: length-prefixed, so no (ns, key) pair aliases another."""
    return len(ns).to_bytes(2, "little") + ns + key


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


# A file too small for extents of eight pool extents still gets this many, where each
# holds a largest block: several block sizes (tenants) then share it.
MIN_EXTENTS = 4


def extent_for(pool_extent: int, size: int) -> int:
    """The disk tier's extent under a pool of ``pool_extent``: a block as large as a pool
    extent fits with its header; slots of header and payload leave at most about an
    eighth of an extent unused (extents of the pool's size could leave half); and the
    extents tile the file. A file of fewer than eight pool extents gets up to
    ``MIN_EXTENTS`` smaller ones (down to a pool extent and a header), at the cost of
    more rounding for blocks near a pool extent's size: an extent holds one block size,
    and a file of one extent held one tenant's block size at a time, each put of the
    other size wiping it."""
    n = max(1, size // (8 * pool_extent + PAGE),
            min(MIN_EXTENTS, size // (pool_extent + PAGE)))
    return size // n // PAGE * PAGE


class DiskTier(Tier):
    """Blocks in one slot file on a local disk, found again after a restart.

    ``_lock`` guards the index, allocator, policy and counters and is never held across
    I/O; ``_jlock`` guards the journal and its appends; ``_put_lock`` makes puts, journal
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
            self._bound = self.policy.capacity  # see Allocator.fit
        except ValueError as e:  # AllocatorError included
            raise ConfigError(f"disk tier at {path}: {e}") from None
        self.geometry = DiskHeader(size, extent_size, min_slot_bytes)
        self._lock = threading.Lock()
        self._jlock = threading.Lock()
        self._put_lock = threading.Lock()
        self.clock: Callable[[], float] = time.monotonic
        self._off_until = 0.0  # the tier is off (a fault) until then
        self._compact_after = 0.0  # no journal rewrite before then (one failed)
        self._faults = 0  # consecutive
        self.last_error = ""
        self._entries: dict[bytes, DiskPut] = {}  # scoped key -> block; order: recency
        self._slot_key: dict[int, bytes] = {}  # slot -> scoped key, of every held block
        self._backlog: list[Any] | None = None  # appended while a snapshot is written
        self._records = 0  # records in the journal file
        self._closed = False
        self.counts = dict.fromkeys(("written_blocks", "read_blocks", "evicted_blocks",
                                     "corrupt_blocks", "declined_blocks",
                                     "unreadable_blocks", "bad_slots"), 0)
        opened = open_files(path, size)
        self._fd, self.journal = opened.fd, opened.journal
        try:
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
        skipped: list[int] = []
        live, why = replay(self.journal.path, self.geometry, skipped)
        if sum(skipped):  # a kill's torn tail, or damage: the blocks named after it are lost
            log.warning("disk tier %s: the last %d bytes of its journal are not intact "
                        "records and are ignored", self.path, sum(skipped))
        if live and not reused:
            why = "the data file is missing or was resized"
        if why:
            log.warning("disk tier %s: starting empty: %s", self.path, why)
            live = {}
        if why or not reused:
            os.ftruncate(self._fd, 0)  # drop old bytes (sparse again), then size it
            os.ftruncate(self._fd, self.size)
        for rec in live.values():  # in journal order
            key = _scoped(rec.ns, rec.key)
            try:
                ok = (key not in self._entries and rec.slot_bytes == self._slot_bytes(
                    rec.length) and self.allocator.claim(rec.slot, rec.slot_bytes))
            except AllocatorError:
                ok = False
            if ok:
                self.allocator.fit(self.policy, self._bound)
                self._hold(key, rec)
        if len(self._entries) < len(live):
            log.warning("disk tier %s: %d journaled blocks do not fit the geometry",
                        self.path, len(live) - len(self._entries))
        return len(self._entries)

    def _slot_bytes(self, length: int) -> int:
        need = max(HEADER_BYTES + length, self.allocator.min_slot_bytes)
        return -(-need // PAGE) * PAGE

    def _offsets(self, slots: list[int], sizes: np.ndarray) -> np.ndarray:
        """Byte offsets of slots of any size classes (one numpy call per class)."""
        out = np.array(slots, dtype=np.int64)
        for slot_bytes in set(sizes.tolist()):
            mask = sizes == slot_bytes
            out[mask] = self.allocator.offsets(out[mask], slot_bytes)
        return out

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

    def _append(self, records: Sequence[Any]) -> None:
        """Journal ``records`` (never under ``_lock``: the write may stall)."""
        if records:
            with self._jlock:
                self.journal.append(records)
                self._records += len(records)
                if self._backlog is not None:
                    self._backlog.extend(records)

    # ------------------------------------------------------------ index (under _lock)

    def _drop(self, keys: Sequence[bytes]) -> list[int]:
        """Take keys the policy already let go of out of the index; their slots."""
        slots = [self._entries.pop(k).slot for k in keys]
        deque(map(self._slot_key.pop, slots), maxlen=0)
        self.allocator.free_many(slots)
        return slots

    def _hold(self, key: bytes, put: DiskPut) -> None:
        self._entries[key] = put
        self._slot_key[put.slot] = key
        self.policy.insert(key, put.depth)

    def _empty_extents(self, slot_bytes: int, n: int,
                       colder: list[int] | None = None) -> list[int]:
        """Room for ``n`` slots of ``slot_bytes`` by emptying whole extents of other
        sizes, fewest blocks first (the least lost per extent freed), as the RAM
        evictor does: evicting in policy order until an extent happened to empty took,
        where each extent held one recent block, nearly the whole tier. An extent with
        a slot set aside (a bad sector) never empties and is passed over. With
        ``colder`` (other sizes' blocks before the caller's own victims): only extents
        all of whose blocks are among them, coldest first (``Evictor._empty_extents``)."""
        alloc, slot_key = self.allocator, self._slot_key
        short = n - alloc.free_slots(slot_bytes)
        if short <= 0:
            return []
        need = -(-short // alloc.per_extent(slot_bytes))
        spm = alloc.slots_per_extent_max
        keys: list[bytes] = []
        for e in (alloc.other_extents(slot_bytes) if colder is None
                  else sorted(alloc.whole_extents(colder, need))):
            per = alloc.per_extent(alloc.slot_bytes_of(e * spm) or slot_bytes)
            held = list(filter(None, map(slot_key.get, range(e * spm, e * spm + per))))
            if len(held) != alloc.used_in(e):
                continue
            keys += held
            need -= 1
            if not need:
                break
        deque(map(self.policy.remove, keys), maxlen=0)  # not its victims: its own order
        return self._drop(keys)

    def _own_victims(self, slot_bytes: int, n: int, limit: int | None,
                     colder: list[int] | None = None) -> list[bytes]:
        """The policy's first ``n`` victims of ``slot_bytes``, among its first ``limit``
        (None: all). ``colder`` gets the slots of the other sizes' blocks met before the
        last of them (as the RAM evictor's ``_victims``)."""
        entries = self._entries
        keys: list[bytes] = []
        ahead: list[int] = []
        for k in islice(self.policy.victims(), limit if n > 0 else 0):
            entry = entries[k]
            if entry.slot_bytes != slot_bytes:
                ahead.append(entry.slot)
                continue
            keys.append(k)
            if colder is not None:
                colder += ahead
                ahead.clear()
            if len(keys) == n:
                break
        return keys

    def _evict_own(self, slot_bytes: int, n: int, limit: int | None) -> list[int]:
        keys = self._own_victims(slot_bytes, n, limit)
        self.policy.evicted_many(keys)
        return self._drop(keys)

    def _make_room(self, slot_bytes: int, n: int) -> list[int]:
        """Evict until ``n`` slots of ``slot_bytes`` are free: blocks of that size first,
        then whole extents of other sizes, then any in policy order (a last resort).
        Returns the slots freed."""
        alloc, policy = self.allocator, self.policy
        short = n - alloc.free_slots(slot_bytes)
        if short <= 0:
            return []
        if alloc.size_classes == 1:  # every block has this size
            freed = self._drop(policy.evict(short))
        else:  # as the RAM evictor does: whole extents of other sizes colder than its
            # own first victims, then those victims (looking only so deep), then other
            # sizes' emptiest extents
            colder: list[int] = []
            own = self._own_victims(slot_bytes, short, SCAN + 4 * short, colder)
            freed = self._empty_extents(slot_bytes, n, colder) if colder else []
            own = own[:max(0, n - alloc.free_slots(slot_bytes))]
            policy.evicted_many(own)
            freed += self._drop(own)
            freed += self._empty_extents(slot_bytes, n)
            if (short := n - alloc.free_slots(slot_bytes)) > 0:  # too few emptied
                freed += self._evict_own(slot_bytes, short, None)
        while alloc.free_slots(slot_bytes) < n and (keys := list(islice(policy.victims(),
                                                                        64))):
            policy.evicted_many(keys)
            freed += self._drop(keys)
        self.counts["evicted_blocks"] += len(freed)
        return freed

    # ------------------------------------------------------------ Tier
    def contains(self, ns: bytes, keys: Sequence[bytes], nbytes: int = 0) -> int:
        """The leading run of ``keys`` held, made the most recent: a promotion reads it
        next, and the blocks its room in RAM sends down must not evict it first."""
        # (sizes unchecked: the tier wrote each entry, of its tenant's one block size)
        with self._lock:
            if self._off():  # a promotion now would fail, and evict for it first
                return 0
            run = list(takewhile(self._entries.__contains__, (_scoped(ns, k) for k in keys)))
            if run:
                self._touch(run)
        return len(run)

    def _touch(self, keys: list[bytes]) -> None:
        """A use of held ``keys`` (under ``_lock``)."""
        entries = self._entries
        self.policy.touch(keys, entries[keys[0]].depth)
        for k in keys:  # most recent last: a compaction keeps the order
            entries[k] = entries.pop(k)

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
                    if (k := _scoped(ns, b.key)) not in self._entries:
                        todo.setdefault(k, b)
            staged: dict[int, list[_Staged]] = {}  # by slot size; checksums lock-free
            declined = 0
            for k, b in todo.items():
                view = memoryview(b.data).cast("B")
                slot_bytes = self._slot_bytes(view.nbytes)
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
            keys = list(self._entries)
            deque(map(self.policy.remove, keys), maxlen=0)
            self._drop(keys)
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
                self.allocator.fit(self.policy, self._bound)
                dropped += self._make_room(slot_bytes, len(items))
                got = self.allocator.alloc_many(slot_bytes, len(items))
                placed += items[:len(got)]
                slots += got
            self.counts["declined_blocks"] += (declined + sum(map(len, staged.values()))
                                               - len(placed))
        # Only this put (under _put_lock) can take the slots just freed: their Drops
        # reach the journal before the slots are written.
        stage = "journal"  # what failed, if something does: the journal or the data
        try:
            self._append([DiskDrop(s) for s in dropped])
            if not placed:
                return 0
            sizes = np.array([w.slot_bytes for w in placed], dtype=np.int64)
            iovs = [[w.head, w.view, *pad(w.slot_bytes - HEADER_BYTES - w.view.nbytes)]
                    for w in placed]
            stage = "data"
            if not all(vectored(os.pwritev, self._fd, iovs, self._offsets(slots, sizes),
                                 sizes)):  # no error, fewer bytes: the filesystem filled
                raise OSError(errno.ENOSPC, "short write (the filesystem is full?)")
            if self.sync:
                os.fdatasync(self._fd)
            stage = "journal"
            puts = [DiskPut(ns, w.block.key, s, w.slot_bytes, w.view.nbytes, w.checksum,
                            w.block.depth) for w, s in zip(placed, slots)]
            self._append(puts)
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
                self._hold(w.scoped, p)
            self.counts["written_blocks"] += len(puts)
            compact = (self._records > max(self.compact_min_records, 4 * len(self._entries))
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
                e = self._entries.get(_scoped(ns, key))
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
        full = vectored(os.preadv, self._fd, iovs,
                        self._offsets([e.slot for e in run], sizes), sizes, isolate_errors=True)
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
            entries = self._entries
            if bad is not None and entries.get(k := _scoped(ns, bad.key)) is bad:
                # Still the block we read (not evicted and reused meanwhile): gone. Its
                # slot is freed once its Drop is journaled (a corrupt block), or set
                # aside (unreadable: a put would take it again).
                self.policy.remove(k)
                del entries[k]
                del self._slot_key[bad.slot]
                gone = bad.slot
                self.counts[why] += 1
                if why == "unreadable_blocks":
                    self.counts["bad_slots"] += 1
            elif bad is None:
                self._faults = 0
            self.counts["read_blocks"] += ok
        if gone is not None:
            try:
                self._append([DiskDrop(gone)])
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
        """Rewrite the journal as the live Puts (in recency order). The snapshot is
        written without ``_lock``, so reads go on; a Drop they append is carried over."""
        with self._jlock:  # first: a Drop of a block missing from the snapshot is kept
            self._backlog = []
        with self._lock:
            snap: list[Any] = [self.geometry, *self._entries.values()]
        try:
            self.journal.write_snapshot(snap)
        except BaseException:
            with self._jlock:
                self._backlog = None
            raise
        with self._jlock:
            backlog, self._backlog = self._backlog or [], None
            self.journal.swap_snapshot(backlog)
            self._records = len(snap) + len(backlog)
        if self.sync:
            sync_dir(self.path)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"disk tier {self.path} is closed")

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"path": self.path, "state": "open" if self._off() else "closed",
                    "blocks": len(self._entries),
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
                    self._entries.clear()
                    self._slot_key.clear()
                with self._jlock:
                    self.journal.close()
                os.close(self._fd)
                done.set()
