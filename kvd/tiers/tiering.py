"""Moving blocks between the RAM pool and the tiers below it, off the event loop.

The loop decides what moves and where (slots, pins, queues); each tier has a reader and
a writer thread that do the I/O and report back through ``post`` (the loop's
``call_soon_threadsafe``). Nothing here is on an engine's path, and nothing waits for a
tier without a deadline.

Down. A READY block the pool evicts for room is copied out of its slot at once (the same
Allocate hands the slot out again) and queued for the disk tier: demotion. A block that
becomes READY is queued for the remote tier with its slot pinned until it is written:
write-behind, so other nodes see it while this one still holds it. Each tier's queue is
bounded in bytes; what does not fit is dropped and counted.

Up. A Lookup whose RAM run ends early asks the tiers for the leading run of the keys
after it: the disk tier answers from memory; the remote tier is probed on its reader
thread and the Lookup's reply waits at most ``remote_lookup_ms`` for it (a run found
later still comes up, for the next Lookup of that prefix). A found run
gets PENDING slots, pinned, that the reader thread fills and verifies; the reply counts
them as ``pending``, so the engine asks again and loads them from RAM once READY. A
failed read gives the slots up: the engine's next Lookup reads a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash
from kvd_proto import messages as m

from kvd.config import Config
from kvd.core.index import Index
from kvd.core.states import NO_SLOT
from kvd.core.tenants import Tenant
from kvd.engines.base import checksums
from kvd.errors import BreakerOpen, TierError
from kvd.tiers.base import Tier, TierBlock, make_tier
from kvd.tiers.disk_index import extent_for

log = logging.getLogger("kvd.tiers")
Post = Callable[..., None]  # loop.call_soon_threadsafe
PROMOTER = 0  # the owner of promotion slots in the index (clients start at 1)
PROMOTE_S = 30.0  # a promotion's slots are given up if its read has not ended by then
# Remote probes queued at once: a slow cluster (answering within its timeout, so the
# breaker stays closed) must not queue one per missed Lookup without end.
MAX_PROBES = 64


@dataclass
class TierCounters:
    demoted_blocks: int = 0  # handed to the disk tier and kept there
    demote_dropped: int = 0  # evicted READY blocks that did not go down (queue full, error)
    written_behind_blocks: int = 0  # written to the remote tier
    write_behind_dropped: int = 0
    disk_hit_blocks: int = 0  # promoted from the disk tier, READY in RAM
    remote_hit_blocks: int = 0  # promoted from the remote tier, READY in RAM
    promote_failed: int = 0  # promotion slots given up (missing, corrupt, tier error)
    probe_timeouts: int = 0  # Lookups answered before the remote tier did
    probes_skipped: int = 0  # Lookups not asked of the remote tier: MAX_PROBES in flight
    tier_errors: int = 0
    corrupt_held_back: int = 0  # failed their checksum on the way down: never sent

    @property
    def promoted_blocks(self) -> int:
        return self.disk_hit_blocks + self.remote_hit_blocks

    def values(self) -> dict[str, int]:
        return {**asdict(self), "promoted_blocks": self.promoted_blocks}


class _Worker:
    """One thread running a tier's jobs in order; results go back to the loop."""

    def __init__(self, name: str, post: Post) -> None:
        self.post = post
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.queued_bytes = 0  # loop-side bookkeeping: added on submit, taken on done
        self.closed = False  # results that come back later are dropped (the loop's
        # objects they would touch, the journal and the tiers' clients, are closed)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, work: Callable[[], Any], done: Callable[[Any, Exception | None], None],
               nbytes: int = 0) -> None:
        self.queued_bytes += nbytes
        self.jobs.put((work, done, nbytes))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            work, done, nbytes = job
            try:
                result, error = work(), None
            except Exception as e:
                if not isinstance(e, TierError) and not self.closed:  # (closed: its
                    log.exception("tier job failed")  # tier's client went under it)
                result, error = None, e
            self.post(self._finish, done, result, error, nbytes)

    def _finish(self, done: Callable, result: Any, error: Exception | None,
                nbytes: int) -> None:
        self.queued_bytes -= nbytes
        if not self.closed:
            done(result, error)

    def close(self, timeout: float) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)
        self.closed = True


@dataclass(eq=False)
class _Probe:
    """A Lookup whose reply waits for the remote tier's answer (or its deadline)."""

    tenant: Tenant
    keys: list[bytes]  # the keys to ask the remote tier about
    depth: int
    reply: m.LookupOk
    send: Callable[[m.LookupOk], None]
    answered: bool = False
    parent: bytes | None = None  # the key before keys[0], when the Lookup named it


class Tiering:
    """The tiers of one daemon (``disk`` and/or ``remote``) and the blocks moving
    between them and the pool. Loop-only, but for what its workers run."""

    def __init__(self, config: Config, index: Index, pool: np.ndarray, post: Post,
                 call_later: Callable[[float, Callable[[], None]], Any],
                 clock: Callable[[], float],
                 committed: Callable[[], None] | None = None) -> None:
        self.config, self.index, self.pool = config, index, pool
        self.call_later, self.clock = call_later, clock
        # The index's queued changes out (to the tiers, the journal, the KV events): the
        # service's hook, which calls after_changes; alone, just after_changes.
        self.committed = committed or self.after_changes
        self.counters = TierCounters()
        self.probes = 0  # remote probes queued or running
        self.tiers: dict[str, Tier] = {}
        if config.disk_path:
            self.tiers["disk"] = make_tier(
                "disk", path=config.disk_path, size=config.disk_size,
                policy=config.disk_policy,
                extent_size=extent_for(config.extent_size, config.disk_size),
                min_slot_bytes=config.min_slot_bytes)
        if config.remote:
            self.tiers["remote"] = make_tier(
                "redis", urls=config.remote, ttl_s=config.remote_ttl_s,
                timeout_ms=config.remote_timeout_ms)
        self.readers = {n: _Worker(f"kvd-{n}-read", post) for n in self.tiers}
        self.writers = {n: _Worker(f"kvd-{n}-write", post) for n in self.tiers}
        for name, tier in self.tiers.items():  # e.g. the cluster's topology, before a Lookup
            self.readers[name].submit(tier.connect, lambda _, err, name=name: (
                self._tier_error(name, err) if err is not None else None))
        index.demoted = [] if "disk" in self.tiers else None
        index.fresh = [] if "remote" in self.tiers else None

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    # ------------------------------------------------------------ slots as buffers
    def _views(self, slots: np.ndarray, slot_bytes: int) -> list[np.ndarray]:
        """One writable view of the pool per slot (for a tier's reads and writes)."""
        offs = self.index.allocator.offsets(slots, slot_bytes).tolist()
        pool = self.pool
        return [pool[o:o + slot_bytes] for o in offs]

    def _gather(self, slots: list[int], slot_bytes: int) -> np.ndarray:
        """A copy of these slots' bytes, one row per slot (one numpy call)."""
        alloc = self.index.allocator
        per = min(alloc.extent_bytes // slot_bytes, alloc.slots_per_extent_max)
        blocks = self.pool[:alloc.n_extents * alloc.extent_bytes].reshape(
            alloc.n_extents, alloc.extent_bytes)[:, :per * slot_bytes].reshape(
            alloc.n_extents, per, slot_bytes)
        e, i = np.divmod(np.asarray(slots, dtype=np.int64), alloc.slots_per_extent_max)
        return blocks[e, i]

    # ------------------------------------------------------------ down
    def after_changes(self) -> None:
        """Queue what the index's last calls sent down (evictions, new READY blocks);
        called before the reply of every request and after every finished Transfer."""
        ix = self.index
        if ix.demoted:
            demoted, ix.demoted = ix.demoted, []
            for tenants, keys, slots, depths, sums in demoted:
                self._demote(tenants, keys, slots, depths, sums)
        if ix.fresh:
            fresh, ix.fresh = ix.fresh, []
            for tenant, keys, slots, depth in fresh:
                self._write_behind(tenant, keys, slots, depth)

    def _demote(self, tenants: list[Tenant], keys: list[bytes], slots: list[int],
                depths: list[int], sums: list[list[int] | None]) -> None:
        first = tenants[0]
        if all(t is first for t in tenants):  # one tenant, the usual case
            self._demote_one(first, keys, slots, depths, sums)
            return
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(tenants):  # Tenant is unhashable: group by identity
            groups.setdefault(id(t), []).append(i)
        for pick in groups.values():
            self._demote_one(tenants[pick[0]], [keys[i] for i in pick],
                             [slots[i] for i in pick], [depths[i] for i in pick],
                             [sums[i] for i in pick])

    def _fit(self, worker: _Worker, n: int, slot_bytes: int, bound: int) -> int:
        """How many of ``n`` blocks ``worker``'s queue takes now: those that fit under
        ``bound`` bytes, and one at least when it is empty, so a batch (or a block)
        larger than the bound still goes down in part instead of never."""
        room = max(0, bound - worker.queued_bytes) // slot_bytes
        return min(n, max(room, 0 if worker.queued_bytes else 1))

    @property
    def pin_bound(self) -> int:
        """Bytes write-behind may keep pinned: its slots wait for a slow or stalled
        cluster, and a queue bound larger than the pool let it pin every slot, so
        stores got no room until the breaker opened (or for good, while it crawled)."""
        return min(self.config.tier_queue_bytes, self.pool.nbytes // 4)

    def _demote_one(self, tenant: Tenant, keys: list[bytes], slots: list[int],
                    depths: list[int], sums: list[list[int] | None]) -> None:
        worker, tier = self.writers["disk"], self.tiers["disk"]
        fit = self._fit(worker, len(slots), tenant.slot_bytes, self.config.tier_queue_bytes)
        if fit < len(slots):  # victims come least valuable first: the last ones go down
            self.counters.demote_dropped += len(slots) - fit
            if not fit:
                return
            cut = len(slots) - fit
            keys, slots, depths, sums = keys[cut:], slots[cut:], depths[cut:], sums[cut:]
        nbytes = len(slots) * tenant.slot_bytes
        rows = self._gather(slots, tenant.slot_bytes)  # a copy: the slots are reused
        blocks = [TierBlock(k, d, row) for k, d, row in zip(keys, depths, rows)]
        ns, rank_bytes = tenant.digest.encode(), tenant.rank_bytes
        worker.submit(lambda: _put_intact(tier, ns, blocks, sums, rank_bytes),
                      lambda res, err: self._demoted(len(blocks), res, err), nbytes)

    def _demoted(self, n: int, result: tuple[int, list[int]] | None,
                 error: Exception | None) -> None:
        if error is not None:
            self._tier_error("disk", error)
        kept, bad = result if result is not None else (0, [])
        self._held_back(bad)
        self.counters.demoted_blocks += kept
        self.counters.demote_dropped += n - kept

    def _write_behind(self, tenant: Tenant, keys: list[bytes], slots: list[int],
                      depth: int) -> None:
        worker = self.writers["remote"]
        fit = self._fit(worker, len(slots), tenant.slot_bytes, self.pin_bound)
        if fit < len(slots):  # a run's head is what a later prefix match needs
            self.counters.write_behind_dropped += len(slots) - fit
            if not fit:
                return
            keys, slots = keys[:fit], slots[:fit]
        nbytes = len(slots) * tenant.slot_bytes
        arr = np.array(slots, dtype=np.int64)
        self.index.pin(arr)  # the bytes stay put until written
        sums = list(map(self.index.checksums.get, slots))
        views = self._views(arr, tenant.slot_bytes)
        blocks = [TierBlock(k, depth + i, v) for i, (k, v) in enumerate(zip(keys, views))]
        ns, tier, rank_bytes = tenant.digest.encode(), self.tiers["remote"], tenant.rank_bytes
        worker.submit(lambda: _put_intact(tier, ns, blocks, sums, rank_bytes),
                      lambda res, err: self._written(arr, res, err), nbytes)

    def _written(self, slots: np.ndarray, result: tuple[int, list[int]] | None,
                 error: Exception | None) -> None:
        if error is not None:
            self._tier_error("remote", error)
        kept, bad = result if result is not None else (0, [])
        if bad:  # corrupt in RAM too: gone from the pool (freed once unpinned)
            self.index.discard([int(slots[i]) for i in bad])
        self.index.unpin(slots)
        if bad:
            self.committed()  # the discard is journaled and announced now
        self._held_back(bad)
        self.counters.written_behind_blocks += kept
        self.counters.write_behind_dropped += len(slots) - kept

    def _held_back(self, bad: list[int]) -> None:
        if bad:
            self.counters.corrupt_held_back += len(bad)
            log.warning("%d blocks failed their checksum in the pool on the way down a "
                        "tier; not sent", len(bad))

    # ------------------------------------------------------------ up
    def lookup(self, tenant: Tenant, keys: list[bytes], depth: int, reply: m.LookupOk,
               send: Callable[[m.LookupOk], None]) -> m.LookupOk | None:
        """After a Lookup's RAM run (``reply``) ended early: promote the leading run of
        the keys after it from the tiers. Returns the reply to send now, or None when
        it waits for the remote tier (``send`` sends it then)."""
        start = reply.hits + reply.pending
        rest = list(keys[start:start + self.config.promote_max_blocks])
        if not rest or reply.pending:
            return reply
        found = 0
        disk = self.tiers.get("disk")
        if disk is not None:
            run = disk.contains(tenant.digest.encode(), rest, tenant.slot_bytes)
            if run:
                found = self._promote("disk", tenant, rest[:run], depth + start,
                                      keys[start - 1] if start else None)
                if found < run:  # no room for all: no point asking further
                    return _with_pending(reply, found)
        remote = self.tiers.get("remote")
        if remote is None or found == len(rest) or remote.status().get("state") == "open":
            return _with_pending(reply, found)
        if self.probes >= MAX_PROBES:
            self.counters.probes_skipped += 1
            return _with_pending(reply, found)
        self.probes += 1
        probe = _Probe(tenant, rest[found:], depth + start + found,
                       _with_pending(reply, found), send,
                       parent=keys[start + found - 1] if start + found else None)
        ns = tenant.digest.encode()
        nbytes = tenant.slot_bytes
        self.readers["remote"].submit(lambda: remote.contains(ns, probe.keys, nbytes),
                                      lambda run, err: self._probed(probe, run, err))
        if not self.config.remote_lookup_ms:  # never wait: the run comes up for the next one
            probe.answered = True
            return probe.reply
        self.call_later(self.config.remote_lookup_ms / 1000, lambda: self._probe_late(probe))
        return None

    def _probed(self, probe: _Probe, run: int | None, error: Exception | None) -> None:
        self.probes -= 1
        if error is not None:
            self._tier_error("remote", error)
            run = 0
        if probe.tenant.dropped and run:  # (the tenant limit) while the cluster was asked
            self.counters.promote_failed += run
            run = 0
        got = (self._promote("remote", probe.tenant, probe.keys[:run], probe.depth,
                             probe.parent) if run else 0)
        if not probe.answered:
            probe.answered = True
            probe.send(_with_pending(probe.reply, probe.reply.pending + got))
        # else the Lookup went without it; the blocks still come up, for the next one

    def _probe_late(self, probe: _Probe) -> None:
        if not probe.answered:
            probe.answered = True
            self.counters.probe_timeouts += 1
            probe.send(probe.reply)

    def _promote(self, name: str, tenant: Tenant, keys: list[bytes], depth: int,
                 parent: bytes | None = None) -> int:
        """PENDING, pinned slots for the leading ``keys`` that find room, filled by the
        tier's reader; returns how many. ``parent``: the key before them (KV events)."""
        ix = self.index
        res = ix.allocate(tenant, keys, owner=PROMOTER, depth=depth, now=self.clock(),
                          pending_s=PROMOTE_S, parent=parent)
        self.committed()  # what this evicted goes down (and is journaled) before the read
        got = res.slots
        n = got.index(NO_SLOT) if NO_SLOT in got else len(got)
        if n < len(got):  # a key stored meanwhile: only the run before it comes up
            later = np.array([s for s in got[n:] if s != NO_SLOT], dtype=np.int64)
            ix.abort(later)
        if not n:
            return 0
        slots = np.array(got[:n], dtype=np.int64)
        ix.pin(slots)
        outs = self._views(slots, tenant.slot_bytes)
        tier, ns = self.tiers[name], tenant.digest.encode()
        sums = self.config.checksums

        def read() -> tuple[int, list[list[int]]]:
            ok = tier.get_into(ns, keys[:n], outs)
            if not sums or not ok:
                return ok, []
            offs = ix.allocator.offsets(slots[:ok], tenant.slot_bytes)
            return ok, [checksums(self.pool, offs + r * tenant.rank_bytes, tenant.rank_bytes)
                        for r in range(tenant.tp_size)]

        self.readers[name].submit(read, lambda res, err: self._promoted(
            name, tenant, slots, res, err), n * tenant.slot_bytes)
        return n

    def _promoted(self, name: str, tenant: Tenant, slots: np.ndarray,
                  result: tuple[int, list[list[int]]] | None, error: Exception | None) -> None:
        ix = self.index
        if error is not None:
            self._tier_error(name, error)
        ok, sums = result if result is not None else (0, [])
        if tenant.dropped:  # while the tier read: its blocks would belong to no tenant
            ok = 0
        # Still pinned here: a slot the index gave up meanwhile (expired) is FREE, not
        # reused, so store_done passes it over; unpinning frees it afterwards.
        ready = 0  # what came up: a read that ended after its slots expired brings none
        if ok:
            fresh, ix.fresh = ix.fresh, None  # it came from a tier: not written back
            try:
                for rank in range(tenant.tp_size):
                    ready += ix.store_done(slots[:ok], rank, sums[rank] if sums else None)
            finally:
                ix.fresh = fresh
        if ok < len(slots):
            ix.abort(slots[ok:])
        ix.unpin(slots)
        setattr(self.counters, f"{name}_hit_blocks",
                getattr(self.counters, f"{name}_hit_blocks") + ready)
        self.counters.promote_failed += len(slots) - ready
        # Journaled and announced now (BlockStored), not at the next tick up to 0.25 s
        # later: a router would send the next turn elsewhere meanwhile.
        self.committed()

    # ------------------------------------------------------------ operations
    def _tier_error(self, name: str, error: Exception) -> None:
        if isinstance(error, BreakerOpen):  # no call made: its failures were counted
            return
        self.counters.tier_errors += 1
        log.warning("%s tier: %s", name, error)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, tier in self.tiers.items():
            st = tier.status()
            st["queued_bytes"] = (self.writers[name].queued_bytes
                                  + self.readers[name].queued_bytes)
            out[name] = st
        return out

    def counter_values(self) -> dict[str, int]:
        return self.counters.values()

    def close(self, timeout: float = 10.0) -> None:
        """Let queued writes finish (up to ``timeout`` in all), then close the tiers."""
        end = time.monotonic() + timeout
        for worker in (*self.writers.values(), *self.readers.values()):
            worker.close(max(0.0, end - time.monotonic()))
        for tier in self.tiers.values():
            try:
                tier.close(max(0.0, end - time.monotonic()))
            except Exception:
                log.exception("closing a tier failed")


def _put_intact(tier: Tier, ns: bytes, blocks: list[TierBlock],
                sums: list[list[int] | None], rank_bytes: int) -> tuple[int, list[int]]:
    """Put the blocks whose bytes still hash to the checksums recorded when they were
    stored (a block without them passes): a corruption in the pool must not go down
    under a fresh, valid header. (blocks the tier holds, indexes of those held back)."""
    h = xxhash.xxh3_64_intdigest
    bad = [i for i, (b, s) in enumerate(zip(blocks, sums)) if s and any(
        e and h(b.data[r * rank_bytes:(r + 1) * rank_bytes]) != e for r, e in enumerate(s))]
    if bad:
        skip = set(bad)
        blocks = [b for i, b in enumerate(blocks) if i not in skip]
    return (tier.put(ns, blocks) if blocks else 0), bad


def _with_pending(reply: m.LookupOk, pending: int) -> m.LookupOk:
    if pending == reply.pending:
        return reply
    return m.LookupOk(reply.req, reply.hits, reply.slots, reply.lease, pending)
