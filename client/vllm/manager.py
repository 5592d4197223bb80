"""Scheduler side: an OffloadingManager that asks kvd, never stalling the scheduler.

vLLM calls ``lookup`` key by key inside ``schedule()`` and keeps scanning on ``RETRY``.
One batched ``Lookup`` per request answers them all. KvdConnector sends it as the
request arrives (``prefetch``), so the reply is usually in before the request's first
scan; a scan may wait for a reply still on its way, at most ``lookup_wait_ms`` per
scheduler step in all. Without that head start (the plain OffloadingConnector path),
the first scan answers RETRY for every key and collects them, and the Lookup goes out
at the end of the step (``on_schedule_end``). Scans then answer from the reply: HIT
for the leased run, HIT_PENDING for blocks still being stored, MISS for the key after
them. A reply that does not come within ``lookup_timeout_ms`` is a miss: vLLM itself
would park the request forever. An engine's first requests wait the same way for the
connection's first handshake (``LookupWait.await_connection``); later, while kvd is
unreachable, lookups miss at once.

The reply's lease pins the hit blocks in the daemon until the load completed or the
request went away (Release), or it lapses (``lease_ms``). A request loads from kvd at
most once: after a load (good or failed) its lookups miss, which is what keeps a failed
load (recomputed by vLLM) from being retried forever.

Stores cost no round trip: ``prepare_store`` sends an Allocate under a fresh ticket and
returns; the workers' Transfers name the ticket one step later, and the daemon copies
the blocks whose keys got a slot (keys it holds already are skipped).

Beside this module: ``request_state`` (a request's lookup state, and its lease's release
when it ends), ``lookup_wait`` (the per-step wait budget) and ``positions`` (the depth,
chain and length that Lookups and Allocates name).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Collection
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvd_client.bookkeeping import Call
from kvd_client.connection import Connection
from kvd_client.errors import KvdClientError
from kvd_client.vllm.failopen import Boundary
from kvd_client.vllm.fingerprint import EngineFacts, root_hash_matches
from kvd_client.vllm.lookup_wait import LookupWait
from kvd_client.vllm.options import KvdOptions, KvdSlots, skip_store
from kvd_client.vllm.positions import Positions
from kvd_client.vllm.request_state import ANSWERED, COLLECT, WAIT, Leases, ReqState
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, unpack_u32

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config
MISS, HIT, HIT_PENDING, RETRY = (LookupResult.MISS, LookupResult.HIT,
                                 LookupResult.HIT_PENDING, LookupResult.RETRY)
MAX_ASKED_AGAIN = 2  # per request: a scan past the reply's keys may ask anew this often


class KvdManager(OffloadingManager):
    def __init__(self, options: KvdOptions, fingerprint: m.Fingerprint, facts: EngineFacts,
                 *, connection: Connection | None = None) -> None:
        self.options = options
        self.fingerprint = fingerprint
        self.facts = facts
        self.tokens_per_key = facts.block_tokens
        self.positions = Positions(facts.block_tokens)
        self.boundary = Boundary("scheduler")
        self.conn = connection or Connection(
            options.socket, name=f"vllm-scheduler:{facts.engine_id}",
            timeout=options.call_timeout_ms / 1000,
            register=m.Register(0, fingerprint, rank=-1))
        self.leases = Leases(self.conn)
        self.lookup_wait = LookupWait(self.conn, options, self.boundary)
        self.disabled = ""  # why kvd is off for this engine ("" = on)
        self._root_checked = False
        self._reqs: dict[str, ReqState] = {}
        self._to_send: list[ReqState] = []  # scans collected this step
        self._refresh: list[ReqState] = []  # answered HIT_PENDING this step
        self._arrived: ReqContext | None = None  # the request vLLM announced last
        # Allocate tickets: unique within the tenant (engines sharing it pick at random).
        self._tickets = itertools.count(int.from_bytes(os.urandom(4), "little") << 31 | 1)

    # ------------------------------------------------------------ lookups
    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return self.boundary.guard("lookup", lambda: MISS,
                                   lambda: self._lookup(key, req_context))

    def _lookup(self, key: bytes, ctx: ReqContext) -> LookupResult:
        if self.disabled:
            return MISS
        now = time.monotonic()
        st = self._reqs.get(ctx.req_id)
        if st is None:
            if not self.conn.up:
                if not self.lookup_wait.await_connection(ctx.req_id, now):
                    self.boundary.count("lookup.unavailable")  # breaker open: miss at once
                    return MISS
                if not self.conn.up:
                    return RETRY
            st = self._reqs[ctx.req_id] = ReqState(ctx, now)
            self._to_send.append(st)
        if st.loaded:
            return MISS
        if st.phase == COLLECT:
            st.keys[key] = None
            return RETRY
        if st.phase == WAIT:
            assert st.future is not None
            if not st.future.done():  # a reply on its way beats a parked step
                future = st.future
                self.lookup_wait.spend_wait(lambda left: wait_futures((future,), timeout=left))
            if st.future.done():
                self._absorb(st)
            elif now >= st.deadline:
                self.boundary.note("lookup", "deadline", f"no Lookup reply in "
                                   f"{self.options.lookup_timeout_ms} ms; serving as a miss")
                self.leases.abandon(st)
                st.phase, st.gave_up = ANSWERED, True
            else:
                return RETRY
        # The lease may lapse before a load, or belong to a connection since replaced
        # (the daemon drops its leases; their slots may hold other keys): ask again.
        # Replies found lapsed before they answered a single scan (a step longer than
        # the lease) are asked again only so often: the request then misses instead of
        # waiting for ever.
        if st.hits and (now >= st.lease_until or st.epoch != self.conn.epoch):
            if not st.served and st.asked_again >= MAX_ASKED_AGAIN:
                self.leases.release(st)
                st.gave_up = True
                return MISS
            return self._ask_again(st, key)
        if key in st.hits:
            st.served = True
            return HIT
        if key in st.pending and now - st.first_seen < self.options.pending_wait_ms / 1000:
            if not st.refresh:
                st.refresh = True
                self._refresh.append(st)
            return HIT_PENDING
        if st.gave_up or key in st.answered or st.asked_again >= MAX_ASKED_AGAIN:
            return MISS
        # The scan starts past what the reply speaks for (vLLM holds those blocks
        # itself, kvd does not): ask about the keys from here.
        return self._ask_again(st, key)

    def _ask_again(self, st: ReqState, key: bytes) -> LookupResult:
        self.leases.release(st)
        st.asked_again += 1
        st.phase, st.keys, st.answered = COLLECT, {key: None}, frozenset()
        self._to_send.append(st)
        return RETRY

    def _absorb(self, st: ReqState) -> None:
        assert st.future is not None
        fut, st.future, st.phase = st.future, None, ANSWERED
        st.hits, st.pending, st.gave_up = {}, frozenset(), True
        self.leases.waiting -= 1
        try:
            reply = fut.result(0)
        except KvdClientError as e:
            self.boundary.note("lookup", "error", e)
            return
        if not isinstance(reply, m.LookupOk):  # no kvd's answer: a miss
            self.boundary.note("lookup", "bad reply", type(reply).__name__)
            return
        try:
            slots = unpack_u32(reply.slots).tolist()
        except ValueError:  # a torn length: fails the check below, its lease released
            slots = []
        if not (0 <= reply.hits <= len(slots) and 0 <= reply.pending
                and reply.hits + reply.pending <= len(st.sent)):  # no kvd's answer: a miss
            # (hits=-1 sliced the keys from the end: hits on keys kvd never named)
            self.boundary.note("lookup", "bad reply", f"{reply.hits} hits, {reply.pending} "
                               f"pending, {len(slots)} slots for {len(st.sent)} keys")
            if reply.lease and self.conn.up and isinstance(fut, Call) \
                    and fut.run == self.conn.instance:  # (another run's ids mean others)
                self.conn.submit(m.Release(self.conn.next_req(), reply.lease))
            return
        st.gave_up = False
        if isinstance(fut, Call) and fut.run:  # where it went, not where it was to go
            st.instance, st.epoch = fut.run, fut.epoch
        st.hits = dict(zip(st.sent[:reply.hits], slots))
        st.pending = frozenset(st.sent[reply.hits:reply.hits + reply.pending])
        st.answered = frozenset(st.sent[:reply.hits + reply.pending + 1])
        st.lease = reply.lease
        self.boundary.count("lookup.hit_blocks", reply.hits)

    def prefetch(self, req_id: str, keys: list[bytes]) -> None:
        """A request arrived with these keys (its blocks in order): look them up now.
        Called from KvdConnector's ``on_new_request`` hook, which guards it."""
        if self.disabled or not keys or req_id in self._reqs or not self.conn.up:
            return
        arrived, self._arrived = self._arrived, None
        ctx = arrived if arrived is not None and arrived.req_id == req_id else ReqContext(req_id)
        st = self._reqs[req_id] = ReqState(ctx, time.monotonic())
        self._send_lookup(st, keys)
        self.boundary.count("lookup.prefetched")

    def _send_lookup(self, st: ReqState, keys: list[bytes]) -> None:
        now = time.monotonic()
        st.sent, st.keys, st.refresh, st.served = keys, {}, False, False
        st.instance, st.epoch = self.conn.instance, self.conn.epoch
        st.future = self.conn.submit(m.Lookup(self.conn.next_req(), keys,
                                              lease_ms=self.options.lease_ms,
                                              depth=self.positions.depth(st.ctx, keys[0])))
        st.phase = WAIT
        self.leases.waiting += 1
        st.deadline = now + self.options.lookup_timeout_ms / 1000
        # Keep a margin: a lease that lapses under a load could hand out a reused slot.
        st.lease_until = now + self.options.lease_ms / 1000 * 0.8
        self.boundary.count("lookup.sent")

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.boundary.guard("on_schedule_end", lambda: None,
                            lambda: self._schedule_end(context.preempted_req_ids))

    def _schedule_end(self, preempted: Collection[str] = ()) -> None:
        self.lookup_wait.new_step()
        # A preempted request lost its blocks and is scanned again from its start: it
        # looks up anew (a request that loaded misses after that, so that a load that
        # failed is not tried again and again; preemption is not that).
        for req_id in preempted:
            st = self._reqs.pop(req_id, None)
            if st is not None:
                self.leases.drop(st)
        to_send, self._to_send = self._to_send, []
        for st in to_send:
            if st.phase == COLLECT and st.keys and self._reqs.get(st.ctx.req_id) is st:
                self._send_lookup(st, list(st.keys))
        refresh, self._refresh = self._refresh, []
        for st in refresh:  # blocks were being stored: ask again
            if st.phase == ANSWERED and self._reqs.get(st.ctx.req_id) is st:
                self.leases.release(st)
                self._send_lookup(st, st.sent)
            st.refresh = False
        if self.leases.ended_loading:  # (see Leases.end)
            now, ended = time.monotonic(), self.leases.ended_loading
            for req in [r for r, s in ended.items() if s.lease_until <= now]:
                self.leases.release(ended.pop(req))

    def has_pending_work(self) -> bool:
        return bool(self._to_send or self._refresh or self.leases.waiting)

    # ------------------------------------------------------------ loads
    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> KvdSlots:
        keys = list(keys)
        # Cannot fail in vLLM's eyes: on a bug, slots nobody has make the load fail, and
        # vLLM recomputes.
        return self.boundary.guard(
            "prepare_load", lambda: KvdSlots(np.full(len(keys), NO_SLOT), ""),
            lambda: self._prepare_load(keys, req_context))

    def _prepare_load(self, keys: list[bytes], req_context: ReqContext) -> KvdSlots:
        st = self._reqs.get(req_context.req_id)
        hits = st.hits if st is not None and st.epoch == self.conn.epoch else {}
        slots = np.array([hits.get(k, NO_SLOT) for k in keys], dtype=np.uint32)
        if st is not None:
            st.loaded = True
        self.boundary.count("load.blocks", len(keys))
        # A NO_SLOT (cannot happen unless vLLM asks for keys it was not told about) makes
        # the worker fail the job, and vLLM recomputes: prepare_load itself cannot fail.
        if st is None:
            return KvdSlots(slots, "")
        return KvdSlots(slots, st.instance, lease=st.lease)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        st = (self._reqs.get(req_context.req_id)
              or self.leases.ended_loading.pop(req_context.req_id, None))
        if st is not None:
            self.boundary.guard("complete_load", lambda: None, lambda: self.leases.release(st))

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        return  # recency is the daemon's: lookups and stores carry depth

    # ------------------------------------------------------------ stores
    def prepare_store(self, keys: Collection[bytes],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        return self.boundary.guard("prepare_store", lambda: skip_store(self.conn.instance),
                                   lambda: self._prepare_store(keys, req_context))

    def _prepare_store(self, keys: list[bytes], ctx: ReqContext) -> PrepareStoreOutput:
        if self.disabled or not keys:
            return skip_store("")
        if not self.conn.up:
            self.boundary.count("store.unavailable")
            return skip_store("")
        # No round trip here: the slots stay with the daemon under the ticket, and the
        # workers name it one step later, when vLLM submits the store.
        ticket = next(self._tickets)
        depth = self.positions.depth(ctx, keys[0])
        parent, chained = self.positions.chain(ctx, keys, depth)
        fut = self.conn.submit(m.Allocate(self.conn.next_req(), keys, depth=depth,
                                          pending_ms=self.options.pending_ms, ticket=ticket,
                                          length=self.positions.length(ctx), parent=parent,
                                          chained=chained))
        fut.add_done_callback(self._count_allocated)
        return PrepareStoreOutput(keys_to_store=keys,
                                  store_spec=KvdSlots(np.zeros(0), self.conn.instance, ticket),
                                  evicted_keys=[])

    def _count_allocated(self, fut: Future) -> None:
        """On the I/O thread: what the daemon made of a ticketed Allocate."""
        try:
            reply = fut.result(0)
        except KvdClientError as e:  # the workers' Transfers fail too: the store is skipped
            self.boundary.note("prepare_store", "allocate", e)
            return
        try:
            if not isinstance(reply, m.Allocated):
                raise ValueError(f"a {type(reply).__name__}")
            slots = unpack_u32(reply.slots)
        except ValueError as e:  # no kvd's answer (the workers' Transfers fail with it)
            self.boundary.note("prepare_store", "bad reply", e)  # (a traceback each, before)
            return
        self.boundary.count("store.blocks", int((slots != NO_SLOT).sum()))
        self.boundary.count("store.present", int((slots == NO_SLOT).sum()))
        if reply.allocated < len(slots):
            self.boundary.count("store.no_space", len(slots) - reply.allocated)

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext,
                       success: bool = True) -> None:
        return  # the daemon publishes a block once every rank stored it

    # ------------------------------------------------------------ lifecycle
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._arrived = req_context  # for a prefetch that follows at once
        if not self._root_checked:
            self.boundary.guard("on_new_request", lambda: None, self._check_root)
        return RequestOffloadingContext()

    def _check_root(self) -> None:
        ok = root_hash_matches(self.fingerprint.root_hash, self.facts.hash_algo)
        if ok is None:
            return
        self._root_checked = True
        if not ok:
            self.disabled = "root hash mismatch"
            log.error("kvd disabled for this engine: vLLM's root block hash (NONE_HASH) is "
                      "not the one derived for prefix_caching_hash_algo=%s; use "
                      "KvdConnector or set \"hash_algo\" in kv_connector_extra_config",
                      self.facts.hash_algo)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.lookup_wait.forget(req_context.req_id)
        st = self._reqs.pop(req_context.req_id, None)
        if st is not None:
            self.boundary.guard("on_request_finished", lambda: None, lambda: self.leases.end(st))

    def reset_cache(self) -> None:
        self.boundary.guard("reset_cache", lambda: None, self._drop_all)

    def shutdown(self) -> None:
        self.boundary.guard("shutdown", lambda: None, self._drop_all)
        counts = dict(sorted(self.boundary.counts.items()))
        log.info("kvd scheduler side: %s; connection: %s", counts, self.conn.stats)
        self.boundary.guard("shutdown", lambda: None, self.conn.close)

    def take_events(self):  # type: ignore[override]
        return ()

    # ------------------------------------------------------------ helpers
    def _drop_all(self) -> None:
        # A load already handed to the workers keeps its lease until complete_load or
        # the request's end (vLLM lets the jobs in flight finish across a reset): freed
        # now, its slots could take other blocks before the workers' Transfer arrives.
        reqs = self._reqs
        self._reqs = {r: st for r, st in reqs.items() if st.loaded and st.lease}
        self._to_send, self._refresh = [], []
        for r, st in reqs.items():
            if r not in self._reqs:
                self.leases.drop(st)
