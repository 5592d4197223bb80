"""Warm restart: rebuild the index from the journal and the kept pool file.

Every committed block is checked against the xxh3 of each TP rank's share recorded at
commit time; a block that fails (torn by a kill, or corrupted) is dropped, never served.
The journal is then rewritten as a compact snapshot of what was restored, and again in
the background whenever it grows to several times the live block count.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvd.core.allocator import AllocatorError
from kvd.core.index import Index
from kvd.core.snapshot import copy_live_blocks, restore_blocks
from kvd.core.tenants import Tenant, Tenants
from kvd.engines.base import checksums
from kvd.errors import ConfigError
from kvd.gc_pause import collector_paused
from kvd.journal import Commit, Drop, Header, Journal, Record, Replay, TenantRec, replay

log = logging.getLogger("kvd.persist")
COMPACT_MIN_RECORDS = 50_000
CLOSE_WAIT_S = 30.0  # how long a stop waits for a compaction's snapshot to be written
RETRY_S = 30.0  # after a failed journal write, the next try at a full snapshot


@dataclass
class Recovery:
    records: int = 0
    restored: int = 0
    corrupt: int = 0
    unplaceable: int = 0
    seconds: float = 0.0
    discarded: str = ""  # why an old journal was not used
    errors: int = 0  # journal writes that failed (records lost until the next snapshot)
    # Tenants the journal named that this run did not keep (id -> model): its blocks
    # were discarded, or it held none and went at the tenant limit. Routers still hold
    # what the last run announced on their topics, which the opening batch must clear.
    not_kept: dict[int, str] = field(default_factory=dict)


class Persistence:
    def __init__(self, path: str, header: Header) -> None:
        self.header = header
        self.path = path
        self.recovery = Recovery()
        self._compacting: threading.Thread | None = None
        self._backlog: list[Record] | None = None
        self._failed = ""  # why the compaction thread's snapshot failed
        # Records were lost (a write failed): a snapshot writes the whole state again.
        self._dirty = False
        self._retry_at = 0.0
        self.journal: Journal | None = None
        self._lock_fd = _lock(path)  # one daemon per journal (the pool file has its own)

    # ------------------------------------------------------------ start
    def recover(self, index: Index, tenants: Tenants, pool: np.ndarray, reused: bool) -> Recovery:
        """Restore verified blocks into ``index``; then start a fresh compact journal."""
        with collector_paused():
            return self._recover(index, tenants, pool, reused)

    def _recover(self, index: Index, tenants: Tenants, pool: np.ndarray,
                 reused: bool) -> Recovery:
        t0 = time.monotonic()
        rec = self.recovery
        try:
            rp = replay(self.path)
        except OSError as e:  # the daemon starts all the same, with an empty pool
            rp = Replay(None, {}, {}, 0)
            rec.discarded = f"journal unreadable: {e.strerror or e}"
        rec.records = rp.records
        if rp.skipped_bytes:  # a kill's torn tail, or damage: what follows is not used
            log.warning("journal %s: the last %d bytes are not intact records and are "
                        "ignored", self.path, rp.skipped_bytes)
        if rp.header is None and rp.records:
            rec.discarded = "journal has no header"
        elif rp.header is not None and rp.header != self.header:
            rec.discarded = f"pool geometry changed ({rp.header} -> {self.header})"
        elif rp.blocks and not reused:
            rec.discarded = "pool file was recreated (missing or resized)"
        if rec.discarded:
            log.warning("not restoring the pool: %s", rec.discarded)
        else:
            self._restore(index, tenants, pool, rp)
        rec.not_kept = {t.id: t.model for t in rp.tenants.values()
                        if tenants.get(t.id) is None}
        index.events.clear()  # the snapshot below already says all of it
        try:
            self.journal = Journal(self.path)
            self.journal.rewrite(self.snapshot(index, tenants))
        except OSError as e:
            # Serving beats persisting: a stale journal left behind restores only
            # blocks whose bytes still match their checksums.
            log.error("cannot write the journal %s (%s): serving without persistence "
                      "until the next start", self.path, e.strerror or e)
            rec.errors += 1
            if self.journal is not None:
                self.journal.close()
            self.journal = None
        rec.seconds = time.monotonic() - t0
        if rp.records:
            log.info("restored %d blocks from the journal (%d corrupt dropped, %d not "
                     "placeable) in %.2fs", rec.restored, rec.corrupt, rec.unplaceable,
                     rec.seconds)
        return rec

    def _restore(self, index: Index, tenants: Tenants, pool: np.ndarray, rp) -> None:
        rec = self.recovery
        by_id: dict[int, Tenant] = {}
        for t in rp.tenants.values():
            try:  # a record kvd never writes (another writer's): its blocks stay out
                by_id[t.id] = tenants.restore(t.id, t.digest, model=t.model,
                                              tp_size=t.tp_size,
                                              rank_page_bytes=tuple(t.rank_page_bytes),
                                              block_tokens=t.block_tokens)
            except (ValueError, OverflowError, TypeError) as e:
                log.warning("journal %s names tenant %r that kvd cannot make (%s): its "
                            "blocks are not restored", self.path, t.id, e)
        alloc = index.allocator
        of_tenant: dict[int, list] = {}  # one pass, not one per tenant (up to 1,024)
        for b in rp.blocks.values():
            of_tenant.setdefault(b.tenant, []).append(b)
        for tenant_id, t in by_id.items():
            blocks = of_tenant.get(tenant_id)
            if not blocks:
                continue
            slots = np.array([b.slot for b in blocks], dtype=np.int64)
            ok = (slots >= 0) & (slots < alloc.max_slots)
            base = np.zeros(len(slots), dtype=np.int64)
            base[ok] = alloc.offsets(slots[ok], t.slot_bytes)
            good = ok.tolist()
            for r in range(t.tp_size):
                offs = np.clip(base + r * t.rank_bytes, 0, len(pool) - t.rank_bytes)
                got = checksums(pool, offs, t.rank_bytes)
                for i, (g, b) in enumerate(zip(got, blocks)):
                    if len(b.checksums) <= r or b.checksums[r] != g:
                        good[i] = False
            rec.corrupt += good.count(False)
            keys = set(t.prefix + b.key for b in blocks) & index.entries.keys()
            blocks = [b for b, g in zip(blocks, good) if g]
            if keys:  # a key held already (another slot's record): not claimed
                placed = len(blocks)
                blocks = [b for b in blocks if t.prefix + b.key not in keys]
                rec.unplaceable += placed - len(blocks)
            try:  # all of the tenant's slots at once: a claim apiece searched a list
                claimed = alloc.claim_many([b.slot for b in blocks], t.slot_bytes)
            except AllocatorError:  # its size no longer fits the pool's geometry
                claimed = [False] * len(blocks)
            mine = [b for b, c in zip(blocks, claimed) if c]
            took = restore_blocks(index, t, [b.key for b in mine], [b.slot for b in mine],
                                  [b.depth for b in mine], [b.checksums for b in mine],
                                  [b.parent or None for b in mine])
            gone = [b.slot for b, ok in zip(mine, took) if not ok]
            alloc.free_many(gone)  # a key restored already (at another slot): this goes
            rec.restored += len(mine) - len(gone)
            rec.unplaceable += len(blocks) - len(mine) + len(gone)
        # Tenants dropped at the tenant limit leave no record (their blocks' evictions
        # do): past the limit, those left without a block go again, oldest first.
        over = len(tenants) - tenants.max_tenants
        for t in sorted(by_id.values(), key=lambda t: t.id):
            if over <= 0:
                break
            if not t.blocks:
                tenants.drop(t)
                over -= 1

    def snapshot(self, index: Index, tenants: Tenants) -> list[Record]:
        return list(self._snapshot_later(index, tenants)())

    def _snapshot_later(self, index: Index,
                        tenants: Tenants) -> Callable[[], Iterator[Record]]:
        """The snapshot as of now, its records made one by one, on any thread, by the
        function returned (written as they come: few alive at once)."""
        head: list[Record] = [self.header, *map(_tenant_rec, tenants)]
        blocks = copy_live_blocks(index)

        def records() -> Iterator[Record]:
            yield from head
            for tid, key, slot, depth, sums, parent in blocks():
                yield Commit(tid, key, slot, depth, sums, parent or b"")
        return records

    # ------------------------------------------------------------ running
    def tenant_added(self, t: Tenant) -> None:
        """A new tenant, or one whose record changed (its block_tokens learned)."""
        self._write([_tenant_rec(t)])

    def tenant_dropped(self) -> None:
        """A tenant gave up its place (the tenant limit): the journal still names it, and
        a restart under a higher limit would bring it back; the next tick rewrites it."""
        self._dirty = True

    def drain(self, index: Index) -> None:
        """Write the index's queued commits and drops (before any reply goes out)."""
        if not index.events:
            return
        events, index.events = index.events, []
        log.debug("journal: %d records", len(events))
        self._write([Commit(e[1], e[2], e[3], e[4], list(e[5]), e[6] or b"")
                     if e[0] == "commit" else Drop(e[1]) for e in events])

    def _write(self, records: list[Record]) -> None:
        if self.journal is None:
            return
        if self._backlog is not None:  # a snapshot being written gets them after it
            self._backlog.extend(records)
        try:
            self.journal.append(records)
        except OSError as e:
            # The index change stands (the checksums keep a restart from restoring a
            # block whose record went missing); the next snapshot writes them again.
            self._broken(f"journal append failed: {e.strerror or e}")

    def _broken(self, why: str) -> None:
        self.recovery.errors += 1
        self._dirty = True
        self._retry_at = time.monotonic() + RETRY_S
        if self.recovery.errors == 1 or self.recovery.errors % 1000 == 0:
            log.error("%s (%d journal errors so far); a full snapshot is retried in %.0fs",
                      why, self.recovery.errors, RETRY_S)

    def maybe_compact(self, index: Index, tenants: Tenants) -> None:
        """Rewrite the journal in a thread once it holds many more records than blocks,
        or once a failed write lost records."""
        j = self.journal
        if j is None or self._compacting is not None or time.monotonic() < self._retry_at:
            return
        if not self._dirty and j.records < max(COMPACT_MIN_RECORDS, 4 * index.ready_blocks):
            if not j.gone():
                return
            log.warning("journal %s was removed; writing it again", j.path)
        # The tables are copied on the loop (consistent); the records are made and
        # written on the thread.
        snap = self._snapshot_later(index, tenants)
        self._dirty = False
        self._backlog = []
        # The objects alive now are left out of the garbage collector's full passes
        # until the snapshot is written: the thread's records set those off, and each
        # one read every object (0.3-0.5 s holding the loop at a million blocks; 25 ms
        # this way). Refcounting frees them as ever; a cycle among them waits.
        gc.freeze()
        self._compacting = threading.Thread(target=self._compact, args=(snap,),
                                            name="kvd-compact", daemon=True)
        try:
            self._compacting.start()
        except BaseException:  # (no thread to be had: nothing to wait for)
            self._compacting = self._backlog = None
            gc.unfreeze()
            raise

    def _compact(self, snap: Callable[[], Iterator[Record]]) -> None:
        try:
            assert self.journal is not None
            self.journal.write_snapshot(snap())
        except OSError as e:
            self._failed = e.strerror or str(e)
        except Exception as e:  # noqa: BLE001 - no swap of a snapshot never written
            log.exception("journal snapshot failed")
            self._failed = repr(e)

    def finish_compaction(self) -> None:
        """On the loop: when the snapshot is written, add what came meanwhile and swap."""
        t = self._compacting
        if t is None or t.is_alive():
            return
        self._compacting = None
        gc.unfreeze()
        backlog, self._backlog = self._backlog or [], None
        assert self.journal is not None
        failed, self._failed = self._failed, ""
        if not failed:
            try:
                self.journal.swap_snapshot(backlog)
                log.info("journal compacted to %d bytes", self.journal.bytes)
                return
            except OSError as e:
                failed = e.strerror or str(e)
        self._broken(f"journal compaction failed: {failed}")

    def close(self) -> None:
        if self._compacting is not None:
            self._compacting.join(timeout=CLOSE_WAIT_S)
            self.finish_compaction()
            if self._compacting is not None:  # a write stuck past the wait: given up
                gc.unfreeze()
        if self.journal is not None:
            self.journal.close()
        if self._lock_fd is not None:  # removed while held: see _lock
            try:
                os.unlink(self.path + ".lock")
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


def _lock(path: str) -> int | None:
    """Hold ``<journal>.lock`` for the daemon's life: two daemons (with two pools) on
    one journal_path would restore each other's blocks, or drop their own. A lock that
    cannot be made (a read-only directory) is not a reason to stop: the journal's own
    writes then fail, and the daemon serves without persistence. The holder removes
    the file when it closes; so a lock is only taken on the file the path still names
    (else another daemon may have locked a newer one)."""
    lock = path + ".lock"
    for _ in range(10):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("cannot create %s (%s): not locked", lock, e.strerror or e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd)
            now = os.stat(lock)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(f"journal_path {path} is in use by another kvd; give "
                                  "each daemon its own") from None
            if e.errno == errno.ENOENT:  # removed by its last holder meanwhile
                continue
            log.warning("cannot lock %s (%s)", lock, e.strerror or e)
            return None
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return fd
        os.close(fd)  # a stale file: its holder removed it and another took its place
    log.warning("cannot lock %s: it keeps being replaced", lock)
    return None


def _tenant_rec(t: Tenant) -> TenantRec:
    return TenantRec(t.id, t.digest, t.model, t.tp_size, list(t.rank_page_bytes),
                     t.block_tokens)
