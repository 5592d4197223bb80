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
connection's first handshake (``_await_connection``); later, while kvd is unreachable,
lookups miss at once.

The reply's lease pins the hit blocks in the daemon until the load completed or the
request went away (Release), or it lapses (``lease_ms``). A request loads from kvd at
most once: after a load (good or failed) its lookups miss, which is what keeps a failed
load (recomputed by vLLM) from being retried forever.

Stores cost no round trip: ``prepare_store`` sends an Allocate under a fresh ticket and
returns; the workers' Transfers name the ticket one step later, and the daemon copies
the blocks whose keys got a slot (keys it holds already are skipped).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvd_client.connection import Connection
from kvd_client.errors import KvdClientError
from kvd_client.vllm.failopen import Boundary
from kvd_client.vllm.fingerprint import EngineFacts, root_hash_matches
from kvd_client.vllm.options import KvdOptions, KvdSlots, skip_store
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, unpack_u32

log = logging.getLogger("vllm.kvd_client")  # under vLLM's logging config
MISS, HIT, HIT_PENDING, RETRY = (LookupResult.MISS, LookupResult.HIT,
                                 LookupResult.HIT_PENDING, LookupResult.RETRY)
COLLECT, WAIT, ANSWERED = "collect", "wait", "answered"
MAX_ASKED_AGAIN = 2  # per request: a scan past the reply's keys may ask anew this often


@dataclass(eq=False)
class _Req:
    """One request's lookup state (scheduler thread only)."""

    ctx: ReqContext
    first_seen: float
    phase: str = COLLECT
    keys: dict[bytes, None] = field(default_factory=dict)  # the scan being collected
    sent: list[bytes] = field(default_factory=list)
    future: Future | None = None
    deadline: float = 0.0
    hits: dict[bytes, int] = field(default_factory=dict)  # key -> slot (leased)
    pending: frozenset[bytes] = frozenset()
    answered: frozenset[bytes] = frozenset()  # keys the reply speaks for (hits, pending, first miss)
    asked_again: int = 0  # new Lookups for keys past an earlier reply
    gave_up: bool = False  # no usable reply (deadline, error): the rest is a miss
    lease: int = 0
    lease_until: float = 0.0
    epoch: int = 0  # the connection's registration the Lookup went out on
    instance: str = ""
    refresh: bool = False  # answered HIT_PENDING: ask again at the end of the step
    served: bool = False  # the current reply answered a HIT (its lease was live then)
    loaded: bool = False


@dataclass(frozen=True, slots=True)
class _LastStored:
    """A request's last stored key and its end token (ReqContext state)."""

    key: bytes
    end: int | None


class KvdManager(OffloadingManager):
    def __init__(self, options: KvdOptions, fingerprint: m.Fingerprint, facts: EngineFacts,
                 *, connection: Connection | None = None) -> None:
        self.options = options
        self.fingerprint = fingerprint
        self.facts = facts
        self.tokens_per_key = facts.block_tokens
        self.boundary = Boundary("scheduler")
        self.conn = connection or Connection(
            options.socket, name=f"vllm-scheduler:{facts.engine_id}",
            timeout=options.call_timeout_ms / 1000,
            register=m.Register(0, fingerprint, rank=-1))
        self.disabled = ""  # why kvd is off for this engine ("" = on)
        self._root_checked = False
        self._reqs: dict[str, _Req] = {}
        self._ended_loading: dict[str, _Req] = {}  # ended with a load out (``_end``)
        self._to_send: list[_Req] = []  # scans collected this step
        self._refresh: list[_Req] = []  # answered HIT_PENDING this step
        self._waiting = 0  # Lookups in flight
        self._abandoned: list[Future] = []
        self._wait_left = options.lookup_wait_ms / 1000  # this step's budget for replies
        self._arrived: ReqContext | None = None  # the request vLLM announced last
        self._connecting: dict[str, float] = {}  # req -> first seen, before the first handshake
        self._connect_gave_up = False
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
                if not self._await_connection(ctx.req_id, now):
                    self.boundary.count("lookup.unavailable")  # breaker open: miss at once
                    return MISS
                if not self.conn.up:
                    return RETRY
            st = self._reqs[ctx.req_id] = _Req(ctx, now)
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
                self._spend_wait(lambda left: wait_futures((future,), timeout=left))
            if st.future.done():
                self._absorb(st)
            elif now >= st.deadline:
                self.boundary.note("lookup", "deadline", f"no Lookup reply in "
                                   f"{self.options.lookup_timeout_ms} ms; serving as a miss")
                self._abandon(st)
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
                self._release(st)
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

    def _await_connection(self, req_id: str, now: float) -> bool:
        """Whether a request should wait for the first handshake instead of missing.

        An engine's first requests can come while its connection is still being set up
        (the handshake takes a few round trips, longer on a busy machine): their blocks
        may well be in kvd, so they wait for it like for a Lookup reply, within this
        step's wait budget, then RETRY until ``lookup_timeout_ms``. Only before the first
        registration and only while a daemon is answering: a daemon that is not there, or
        a connection lost later, misses at once. Once one request waited in vain, the
        next ones do not.
        """
        if self.conn.epoch or self._connect_gave_up or not self.conn.handshaking:
            return False
        first = self._connecting.setdefault(req_id, now)
        if now - first >= self.options.lookup_timeout_ms / 1000:
            self._connect_gave_up = True
            self.boundary.note("lookup", "connecting", f"kvd did not complete the handshake "
                               f"in {self.options.lookup_timeout_ms} ms; serving as a miss")
            return False
        self._spend_wait(self.conn.wait_up)
        return True

    def _spend_wait(self, wait: Callable[[float], object]) -> None:
        """Wait for something on its way, out of this step's ``lookup_wait_ms`` budget."""
        if self._wait_left > 0:
            started = time.monotonic()
            wait(self._wait_left)
            self._wait_left -= time.monotonic() - started

    def _ask_again(self, st: _Req, key: bytes) -> LookupResult:
        self._release(st)
        st.asked_again += 1
        st.phase, st.keys, st.answered = COLLECT, {key: None}, frozenset()
        self._to_send.append(st)
        return RETRY

    def _absorb(self, st: _Req) -> None:
        assert st.future is not None
        fut, st.future, st.phase = st.future, None, ANSWERED
        st.hits, st.pending, st.gave_up = {}, frozenset(), True
        self._waiting -= 1
        try:
            reply = fut.result(0)
        except KvdClientError as e:
            self.boundary.note("lookup", "error", e)
            return
        if not isinstance(reply, m.LookupOk):
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
            if reply.lease and self.conn.up:
                self.conn.submit(m.Release(self.conn.next_req(), reply.lease))
            return
        st.gave_up = False
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
        st = self._reqs[req_id] = _Req(ctx, time.monotonic())
        self._send_lookup(st, keys)
        self.boundary.count("lookup.prefetched")

    def _send_lookup(self, st: _Req, keys: list[bytes]) -> None:
        now = time.monotonic()
        st.sent, st.keys, st.refresh, st.served = keys, {}, False, False
        st.instance, st.epoch = self.conn.instance, self.conn.epoch
        st.future = self.conn.submit(m.Lookup(self.conn.next_req(), keys,
                                              lease_ms=self.options.lease_ms,
                                              depth=self._depth(st.ctx, keys[0])))
        st.phase = WAIT
        self._waiting += 1
        st.deadline = now + self.options.lookup_timeout_ms / 1000
        # Keep a margin: a lease that lapses under a load could hand out a reused slot.
        st.lease_until = now + self.options.lease_ms / 1000 * 0.8
        self.boundary.count("lookup.sent")

    def _depth(self, ctx: ReqContext, key: bytes) -> int:
        pos = ctx.get_offload_key_position(key)  # end token of the key's block
        return max(0, pos // self.tokens_per_key - 1) if pos else 0

    def _chain(self, ctx: ReqContext, keys: list[bytes], depth: int) -> tuple[bytes, bool]:
        """For the KV events: the request's key before ``keys[0]`` (b"" at the chain's
        start or when unknown), as vLLM's own events name it, and whether ``keys`` are
        consecutive blocks (vLLM skips some in a sliding-window group). From the end
        positions vLLM's scheduler recorded; the previous store's last key is tried
        first, so a prompt stored in parts does not search the request each time."""
        positions = getattr(ctx, "_offload_key_positions", None)
        if not isinstance(positions, dict):
            return b"", len(keys) == 1
        step = self.tokens_per_key
        ends = [positions.get(k) for k in keys]
        chained = None not in ends and all(b - a == step for a, b in zip(ends, ends[1:]))
        last = None
        if hasattr(ctx, "set_state"):
            last = ctx.get_state(_LastStored)
            ctx.set_state(_LastStored(keys[-1], ends[-1]))
        start = ends[0]
        if depth == 0 or start is None:
            return b"", chained
        if last is not None and last.end == start - step and last.key in positions:
            return last.key, chained
        order = list(positions)
        try:
            i = order.index(keys[0])
        except ValueError:
            return b"", chained
        if i and positions[order[i - 1]] == start - step:
            return order[i - 1], chained
        return b"", chained

    def _length(self, ctx: ReqContext) -> int:
        """Blocks of the request so far (0: unknown). vLLM's scheduler records the end
        token of every key of the request in order, not only of those stored this step:
        a prompt stored in parts (chunked prefill) names its whole length in each part.
        The last recorded is the furthest (O(1); the daemon never takes less than the
        part's own end)."""
        positions = getattr(ctx, "_offload_key_positions", None)
        if not isinstance(positions, dict) or not positions:
            return 0
        return int(next(reversed(positions.values()))) // self.tokens_per_key

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.boundary.guard("on_schedule_end", lambda: None,
                            lambda: self._schedule_end(context.preempted_req_ids))

    def _schedule_end(self, preempted: Collection[str] = ()) -> None:
        self._wait_left = self.options.lookup_wait_ms / 1000
        # A preempted request lost its blocks and is scanned again from its start: it
        # looks up anew (a request that loaded misses after that, so that a load that
        # failed is not tried again and again; preemption is not that).
        for req_id in preempted:
            st = self._reqs.pop(req_id, None)
            if st is not None:
                self._drop(st)
        to_send, self._to_send = self._to_send, []
        for st in to_send:
            if st.phase == COLLECT and st.keys and self._reqs.get(st.ctx.req_id) is st:
                self._send_lookup(st, list(st.keys))
        refresh, self._refresh = self._refresh, []
        for st in refresh:  # blocks were being stored: ask again
            if st.phase == ANSWERED and self._reqs.get(st.ctx.req_id) is st:
                self._release(st)
                self._send_lookup(st, st.sent)
            st.refresh = False
        self._reap_abandoned()
        if self._ended_loading:  # (see _end)
            now, ended = time.monotonic(), self._ended_loading
            for req in [r for r, s in ended.items() if s.lease_until <= now]:
                self._release(ended.pop(req))

    def has_pending_work(self) -> bool:
        # _abandoned: replies still to come whose leases must be released (an idle
        # engine takes no step otherwise, and they stay pinned until they lapse)
        return bool(self._to_send or self._refresh or self._waiting or self._abandoned)

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
              or self._ended_loading.pop(req_context.req_id, None))
        if st is not None:
            self.boundary.guard("complete_load", lambda: None, lambda: self._release(st))

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
        depth = self._depth(ctx, keys[0])
        parent, chained = self._chain(ctx, keys, depth)
        fut = self.conn.submit(m.Allocate(self.conn.next_req(), keys, depth=depth,
                                          pending_ms=self.options.pending_ms, ticket=ticket,
                                          length=self._length(ctx), parent=parent,
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
        self._connecting.pop(req_context.req_id, None)
        st = self._reqs.pop(req_context.req_id, None)
        if st is not None:
            self.boundary.guard("on_request_finished", lambda: None, lambda: self._end(st))
            # vLLM calls this after on_schedule_end: a reply already in (a request that
            # never scanned, e.g. its prompt cached in the engine) is released now
            self.boundary.guard("on_request_finished", lambda: None, self._reap_abandoned)

    def reset_cache(self) -> None:
        self.boundary.guard("reset_cache", lambda: None, self._drop_all)

    def shutdown(self) -> None:
        self.boundary.guard("shutdown", lambda: None, self._drop_all)
        counts = dict(sorted(self.boundary.counts.items()))
        log.info("kvd scheduler side: %s; connection: %s", counts, self.conn.stats)
        self.conn.close()

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
                self._drop(st)
        self._reap_abandoned()

    def _end(self, st: _Req) -> None:
        """A request ended. One whose load was handed to the workers keeps its lease until
        that load's complete_load, which vLLM still calls after the end (an aborted
        request's load leaves in the very step that ends it): released now, the load's
        Transfer would find the lease gone and fail. Kept at most until the lease's own
        margin runs out (``_schedule_end``), should complete_load never come."""
        if st.loaded and st.lease and st.future is None and st.lease_until > time.monotonic():
            self._ended_loading[st.ctx.req_id] = st
        else:
            self._drop(st)

    def _drop(self, st: _Req) -> None:
        self._release(st)
        if st.future is not None:
            self._abandon(st)

    def _release(self, st: _Req) -> None:
        lease, st.lease, st.hits, st.pending = st.lease, 0, {}, frozenset()
        if lease and self.conn.up and st.instance == self.conn.instance:
            self.conn.submit(m.Release(self.conn.next_req(), lease))  # fire and forget

    def _abandon(self, st: _Req) -> None:
        assert st.future is not None
        self._abandoned.append(st.future)
        self._waiting -= 1
        st.future = None
        st.hits, st.pending = {}, frozenset()

    def _reap_abandoned(self) -> None:
        """Release the leases of Lookup replies that came after their request gave up."""
        keep = []
        for fut in self._abandoned:
            if not fut.done():
                keep.append(fut)
                continue
            try:
                reply = fut.result(0)
            except Exception:  # noqa: BLE001 - nothing was leased
                continue
            if isinstance(reply, m.LookupOk) and reply.lease and self.conn.up:
                self.conn.submit(m.Release(self.conn.next_req(), reply.lease))
        self._abandoned = keep
