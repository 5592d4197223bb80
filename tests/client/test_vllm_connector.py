"""kvd's vLLM manager and worker against a real daemon, without an engine.

The manager is driven the way vLLM 0.32's scheduler drives it (a key-by-key scan that
goes on after RETRY and stops at the first MISS, ``on_schedule_end`` once per step), with
vLLM's own ReqContext; the worker gets CPU tensors shaped like vLLM's canonical KV caches.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import types

import numpy as np
import pytest
import zmq

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
)

from kvd.events import BlockStored, decode  # noqa: E402
from kvd_client.vllm import UnsupportedVllmVersion, check_vllm_version  # noqa: E402
from kvd_client.vllm.fingerprint import (  # noqa: E402
    EngineFacts,
    LayoutError,
    make_fingerprint,
    split_pages,
)
from kvd_client.vllm.failopen import Boundary  # noqa: E402
from kvd_client.vllm.idle import IdleFlush  # noqa: E402
from kvd_client.vllm.manager import KvdManager  # noqa: E402
from kvd_client.vllm.spec import KvdOptions, KvdSlots  # noqa: E402
from kvd_client.vllm.worker import KvdWorker, _HostPath  # noqa: E402
from kvd_proto.ids import NO_SLOT  # noqa: E402
from kvd_proto import messages as m  # noqa: E402
from kvd_proto.messages import HostRegion  # noqa: E402
from tests.waiting import child_exit, wait_for  # noqa: E402

HIT, MISS, RETRY, PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                             LookupResult.HIT_PENDING)
PAGE = 4096
NUM_BLOCKS = 32
FACTS = EngineFacts(model="tiny", model_dtype="bfloat16", kv_dtype="bfloat16",
                    block_tokens=128, tp_size=1, pp_size=1, block_bytes=2 * PAGE,
                    num_layers=2, hash_algo="sha256", engine_id="engine-1")
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def keys_for(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(36, b".") for i in range(n)]


def request(req_id: str, keys: list[bytes]) -> ReqContext:
    ctx = ReqContext(req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 128)
    return ctx


def scan(mgr: KvdManager, ctx: ReqContext, keys: list[bytes]) -> list[LookupResult]:
    """vLLM's prefix scan: on after RETRY, stop at MISS."""
    out = []
    for k in keys:
        out.append(mgr.lookup(k, ctx))
        if out[-1] == MISS:
            break
    return out


def answer(mgr: KvdManager, ctx: ReqContext, keys: list[bytes], timeout: float = 5):
    """Scan once per 'step' until the answer is not deferred any more."""
    deadline = time.monotonic() + timeout
    while True:
        res = scan(mgr, ctx, keys)
        mgr.on_schedule_end(END)
        if RETRY not in res or time.monotonic() > deadline:
            return res
        time.sleep(0.002)


def options(socket: str, **kw) -> KvdOptions:
    return KvdOptions(socket=socket, call_timeout_ms=1000, **kw)


def kv_caches() -> tuple[CanonicalKVCaches, torch.Tensor]:
    """Two layers, views of one allocation, like vLLM on CPU."""
    storage = torch.randint(-128, 127, (2, NUM_BLOCKS, PAGE), dtype=torch.int8)
    tensors = [CanonicalKVCacheTensor(storage[i], PAGE) for i in range(2)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[]), storage


def gpu(block_ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])


@pytest.fixture
def engine_side(daemon):
    fp = make_fingerprint(FACTS, b"root")
    caches, storage = kv_caches()
    mgr = KvdManager(options(daemon.socket), fp, FACTS)
    worker = KvdWorker(options(daemon.socket), fp, caches, rank=0)
    assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)
    yield mgr, worker, storage
    mgr.shutdown()
    worker.shutdown()


def store(mgr, worker, keys, blocks, job_id: int) -> None:
    ctx = request(f"store-{job_id}", keys)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(keys, ctx)
    assert out.keys_to_store == keys
    assert worker.submit_store(job_id, gpu(blocks), out.store_spec)
    worker.wait({job_id})
    assert [r.job_id for r in worker.get_finished()] == [job_id]
    mgr.on_request_finished(ctx)


def hit(mgr, worker, tag: str, req_id: str, n: int = 3) -> tuple[list[bytes], ReqContext]:
    """``n`` blocks stored, then a request whose Lookup hits all of them (leased)."""
    keys = keys_for(tag, n)
    store(mgr, worker, keys, list(range(1, n + 1)), job_id=0)
    ctx = request(req_id, keys)
    mgr.on_new_request(ctx)
    assert answer(mgr, ctx, keys) == [HIT] * n
    return keys, ctx


def test_lookup_batches_leases_and_loads_once(engine_side, daemon):
    mgr, worker, storage = engine_side
    keys = keys_for("a", 4)
    ctx = request("r1-abc", keys)
    mgr.on_new_request(ctx)
    assert scan(mgr, ctx, keys) == [RETRY] * 4  # first scan: collect, do not block
    lookups = daemon.status()["counters"]["lookups"]
    assert answer(mgr, ctx, keys) == [MISS]
    assert daemon.status()["counters"]["lookups"] == lookups + 1  # one batched Lookup

    store(mgr, worker, keys, [1, 2, 3, 4], job_id=0)
    stored = daemon.status()["counters"]["stored_blocks"]
    again = mgr.prepare_store(keys, request("dup", keys))  # no round trip: a ticket
    assert worker.submit_store(9, gpu([5, 6, 7, 8]), again.store_spec)
    worker.wait({9})
    assert [r.job_id for r in worker.get_finished()] == [9]
    assert daemon.status()["counters"]["stored_blocks"] == stored  # nothing stored twice

    ctx2 = request("r2-abc", keys + keys_for("z", 1))
    mgr.on_new_request(ctx2)
    assert answer(mgr, ctx2, keys + keys_for("z", 1)) == [HIT] * 4 + [MISS]
    assert daemon.status()["blocks"]["leases"] == 1
    spec = mgr.prepare_load(keys, ctx2)
    storage[:, 10:14] = 0
    assert worker.submit_load(1, spec, gpu([10, 11, 12, 13]))
    worker.wait({1, 999})  # 999 was never submitted: ignored
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert worker.take_load_errors() == set()
    assert torch.equal(storage[:, 10:14], storage[:, 1:5])
    mgr.complete_load(keys, ctx2)
    assert scan(mgr, ctx2, keys) == [MISS]  # a request loads from kvd at most once
    deadline = time.monotonic() + 5
    while daemon.status()["blocks"]["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.status()["blocks"]["leases"] == 0  # released after the load


def test_a_preempted_request_that_loaded_looks_up_again(engine_side):
    """A request loads from kvd once; preempted, it lost its blocks and its KV is
    recomputed in full unless it may ask kvd again (memory is tight exactly then)."""
    mgr, worker, _ = engine_side
    keys, ctx = hit(mgr, worker, "p", "r-pre")
    spec = mgr.prepare_load(keys, ctx)
    assert worker.submit_load(1, spec, gpu([10, 11, 12]))
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    mgr.complete_load(keys, ctx)
    assert scan(mgr, ctx, keys) == [MISS]  # not preempted: once
    mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=("r-pre",)))
    assert answer(mgr, ctx, keys) == [HIT] * 3
    assert mgr.prepare_load(keys, ctx).lease


def test_lease_released_when_request_finishes(engine_side, daemon):
    mgr, worker, _ = engine_side
    keys, ctx = hit(mgr, worker, "b", "r3")
    assert daemon.status()["blocks"]["leases"] == 1
    mgr.on_request_finished(ctx)
    time.sleep(0.2)
    assert daemon.status()["blocks"]["leases"] == 0


def test_a_load_handed_out_before_its_request_ended_keeps_its_lease(engine_side, daemon):
    """vLLM ends an aborted request in the very step that hands its load to the workers,
    and calls complete_load after the end. Released at the end, the lease was gone when
    the load's Transfer came: the load failed EXPIRED, counted as a kvd error."""
    mgr, worker, storage = engine_side
    keys, ctx = hit(mgr, worker, "end", "r-aborted")
    spec = mgr.prepare_load(keys, ctx)
    mgr.on_request_finished(ctx)  # aborted: ends in the step that sends its load
    time.sleep(0.2)  # (a Release would have reached the daemon by now)
    assert daemon.status()["blocks"]["leases"] == 1
    storage[:, 20:23] = 0
    assert worker.submit_load(1, spec, gpu([20, 21, 22]))
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert torch.equal(storage[:, 20:23], storage[:, 1:4])
    mgr.complete_load(keys, ctx)
    assert wait_leases(daemon, 0) == 0


def test_an_ended_request_whose_load_never_completes_gives_its_lease_back(daemon):
    """Kept for a complete_load that never comes, the lease goes back once its margin ran
    out (at the next step's end), not at the connection's close."""
    fp = make_fingerprint(FACTS, b"root")
    caches, _ = kv_caches()
    mgr = KvdManager(options(daemon.socket, lease_ms=4000), fp, FACTS)
    worker = KvdWorker(options(daemon.socket), fp, caches, rank=0)
    try:
        assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)
        keys, ctx = hit(mgr, worker, "never", "r-lost", n=2)
        mgr.prepare_load(keys, ctx)
        mgr.on_request_finished(ctx)
        assert wait_leases(daemon, 1) == 1
        mgr.on_schedule_end(END)
        assert mgr.leases.ended_loading  # its margin (0.8 of the lease) still runs
        time.sleep(3.3)
        mgr.on_schedule_end(END)
        assert not mgr.leases.ended_loading and wait_leases(daemon, 0) == 0
    finally:
        mgr.shutdown()
        worker.shutdown()


def wait_leases(daemon, n: int, timeout: float = 5) -> int:
    deadline = time.monotonic() + timeout
    while (leases := daemon.status()["blocks"]["leases"]) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return leases


def test_leases_released_on_reset_cache_and_shutdown(engine_side, daemon):
    mgr, worker, _ = engine_side
    keys = keys_for("g", 3)
    store(mgr, worker, keys, [1, 2, 3], job_id=0)
    for name in ("r7", "r8"):
        ctx = request(name, keys)
        mgr.on_new_request(ctx)
        assert answer(mgr, ctx, keys) == [HIT] * 3
    assert wait_leases(daemon, 2) == 2
    loading = request("r6", keys)  # its load is handed to the workers when the reset comes
    mgr.on_new_request(loading)
    assert answer(mgr, loading, keys) == [HIT] * 3
    assert (mgr.prepare_load(keys, loading).slots != NO_SLOT).all()
    assert wait_leases(daemon, 3) == 3
    mgr.reset_cache()  # vLLM drops its prefix cache and the connector's state
    assert wait_leases(daemon, 1) == 1  # not the load's: its slots must stay these keys'
    mgr.complete_load(keys, loading)  # vLLM finishes the jobs in flight across a reset
    assert wait_leases(daemon, 0) == 0
    ctx = request("r9", keys)
    mgr.on_new_request(ctx)
    assert answer(mgr, ctx, keys) == [HIT] * 3
    assert wait_leases(daemon, 1) == 1
    mgr.shutdown()  # the engine stops with a request still holding its lease
    assert wait_leases(daemon, 0) == 0


def test_steps_longer_than_the_lease_make_a_miss_not_a_request_parked_for_ever(engine_side,
                                                                              daemon):
    """Each reply is read a step after it was asked for; with steps longer than the
    lease, every reply is found lapsed. Before, the request was asked about again and
    answered RETRY at every step, for ever; now it misses after a few (and vLLM
    computes it), its leases released."""
    writer, worker, _ = engine_side
    keys = keys_for("l", 3)
    store(writer, worker, keys, [1, 2, 3], job_id=0)
    mgr = KvdManager(options(daemon.socket, lease_ms=100), writer.fingerprint, FACTS)
    assert mgr.conn.wait_up(10)
    ctx = request("r30", keys)
    mgr.on_new_request(ctx)
    seen = []
    for _ in range(10):
        seen.append(scan(mgr, ctx, keys))
        mgr.on_schedule_end(END)
        if seen[-1] == [MISS]:
            break
        time.sleep(0.15)  # the step's forward pass: longer than 0.8 x the lease
    assert seen[-1] == [MISS] and len(seen) <= 8, seen  # 4 here: 3 asks, then a miss
    assert all(set(res) == {RETRY} for res in seen[:-1]), seen
    mgr.on_request_finished(ctx)
    assert wait_leases(daemon, 0) == 0
    mgr.shutdown()


def test_a_reply_nobody_scanned_is_released_when_its_request_ends(engine_side, daemon):
    """A request whose prompt vLLM holds itself is never scanned: the Lookup sent on its
    arrival leases blocks that nothing loads. Its end releases them at once, not at the
    next step (an idle engine takes none), and no work is left pending."""
    writer, worker, _ = engine_side
    keys = keys_for("u", 3)
    store(writer, worker, keys, [1, 2, 3], job_id=0)
    mgr = KvdManager(options(daemon.socket), writer.fingerprint, FACTS)
    assert mgr.conn.wait_up(10)
    ctx = request("r31", keys)
    mgr.on_new_request(ctx)
    mgr.prefetch("r31", keys)
    assert wait_leases(daemon, 1) == 1  # its reply is in
    assert wait_for(lambda: mgr._reqs["r31"].future.done(), 5)
    assert mgr.has_pending_work()
    mgr.on_request_finished(ctx)  # no scan, no on_schedule_end
    assert wait_leases(daemon, 0) == 0
    assert not mgr.has_pending_work()
    mgr.shutdown()


def test_lookup_sent_on_arrival_answers_the_first_scan(engine_side, daemon):
    """KvdConnector hands over a request's keys as it arrives: the first scan answers
    from the reply (no RETRY, so vLLM schedules the request in this very step)."""
    writer, worker, _ = engine_side
    keys = keys_for("p", 4)
    store(writer, worker, keys[:3], [1, 2, 3], job_id=0)
    # A budget no loaded test machine exceeds: this test is about the answer, not speed.
    mgr = KvdManager(options(daemon.socket, lookup_wait_ms=5000), writer.fingerprint, FACTS)
    assert mgr.conn.wait_up(10)
    ctx = request("r10", keys)
    mgr.on_new_request(ctx)
    mgr.prefetch("r10", keys)
    assert scan(mgr, ctx, keys) == [HIT, HIT, HIT, MISS]
    assert mgr.boundary.counts["lookup.prefetched"] == 1

    new = keys_for("q", 3)  # nobody has these: a miss, also at once
    fresh = request("r11", new)
    mgr.on_new_request(fresh)
    mgr.prefetch("r11", new)
    assert scan(mgr, fresh, new) == [MISS]
    assert daemon.status()["counters"]["lookups"] == 2
    mgr.shutdown()


def test_scan_past_the_arrival_reply_asks_again(engine_side):
    """vLLM holds the first blocks itself and starts its scan at key 2; kvd has keys 2-3
    but not 0, so the arrival reply (a run from key 0) cannot speak for them."""
    mgr, worker, _ = engine_side
    keys = keys_for("s", 4)
    store(mgr, worker, keys[2:], [1, 2], job_id=0)
    ctx = request("r12", keys)
    mgr.on_new_request(ctx)
    mgr.prefetch("r12", keys)
    assert answer(mgr, ctx, keys[2:]) == [HIT, HIT]


def test_no_reply_within_the_step_budget_parks_the_request(daemon):
    mgr = KvdManager(options(daemon.socket, lookup_wait_ms=50),
                     make_fingerprint(FACTS, b"root"), FACTS)
    try:
        assert mgr.conn.wait_up(10)
        reqs = [(f"r{i}", keys_for(f"t{i}", 2)) for i in range(3)]
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            for name, keys in reqs:
                ctx = request(name, keys)
                mgr.on_new_request(ctx)
                mgr.prefetch(name, keys)
                assert scan(mgr, ctx, keys) == [RETRY, RETRY]
            stalled = time.perf_counter() - t0
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert 0.045 < stalled < 0.12  # one budget for the whole step, not one per request
    finally:
        mgr.shutdown()


def test_store_in_flight_is_hit_pending_then_hit(engine_side):
    mgr, worker, _ = engine_side
    keys = keys_for("c", 2)
    writer = request("writer", keys)
    mgr.on_new_request(writer)
    out = mgr.prepare_store(keys, writer)
    reader = request("reader", keys)
    mgr.on_new_request(reader)
    assert answer(mgr, reader, keys) == [PENDING, PENDING]  # vLLM defers the request
    worker.submit_store(7, gpu([5, 6]), out.store_spec)
    worker.wait({7})
    deadline = time.monotonic() + 5
    while (res := answer(mgr, reader, keys)) == [PENDING, PENDING]:  # asked every step
        assert time.monotonic() < deadline
    assert res == [HIT, HIT]


def test_unanswered_lookup_is_a_miss_after_the_deadline(daemon):
    mgr = KvdManager(options(daemon.socket, lookup_timeout_ms=200),
                     make_fingerprint(FACTS, b"root"), FACTS)
    try:
        assert mgr.conn.wait_up(10)
        keys = keys_for("d", 2)
        ctx = request("r4", keys)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            assert scan(mgr, ctx, keys) == [RETRY, RETRY]
            mgr.on_schedule_end(END)
            assert scan(mgr, ctx, keys) == [RETRY, RETRY]
            time.sleep(0.25)
            assert scan(mgr, ctx, keys) == [MISS]
            t0 = time.perf_counter()
            mgr.prepare_store(keys, ctx)  # an Allocate under a ticket: nothing to wait for
            assert time.perf_counter() - t0 < 0.1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert mgr.boundary.counts["lookup.deadline"] == 1
    finally:
        mgr.shutdown()


def test_a_reply_given_up_on_in_a_daemon_stall_goes_back_without_a_step(engine_side, daemon):
    """A request gave up on its Lookup while the daemon was stalled; the reply it sent on
    waking leased the hits for nobody. The lease goes back as the reply comes, with no
    scheduler step: the manager held such replies for its next step and said it had
    work pending meanwhile, so an idle engine stepped, empty, until they came (up to
    the call's expiry: seconds) or held their leases until one did."""
    writer, worker, _ = engine_side
    keys = keys_for("z", 3)
    store(writer, worker, keys, [1, 2, 3], job_id=0)
    mgr = KvdManager(options(daemon.socket, lookup_timeout_ms=200), writer.fingerprint, FACTS)
    try:
        assert mgr.conn.wait_up(10)
        ctx = request("r41", keys)
        mgr.on_new_request(ctx)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            assert set(scan(mgr, ctx, keys)) == {RETRY}
            mgr.on_schedule_end(END)
            time.sleep(0.25)
            assert scan(mgr, ctx, keys) == [MISS]
            assert not mgr.has_pending_work()  # nothing for an idle engine to step for
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert wait_for(lambda: mgr.conn.stats.late_leases == 1, 5)
        assert wait_leases(daemon, 0) == 0  # (no step since)
    finally:
        mgr.shutdown()


def test_a_lookup_sent_after_a_reconnect_belongs_to_the_new_run(daemon_factory):
    """The manager took the connection's daemon run and registration before sending a
    Lookup: a reconnect in between sent it to the new run while the request took its
    lease for the old one's, so the hits were thrown away as stale and the lease was
    never released (30 s pinned)."""
    d = daemon_factory("--persist")  # (the new run has the blocks too)
    fp = make_fingerprint(FACTS, b"root")
    caches, _storage = kv_caches()
    # (the restart happens inside the request's Lookup wait: seconds on a loaded machine)
    mgr = KvdManager(options(d.socket, lookup_timeout_ms=60_000), fp, FACTS)
    worker = KvdWorker(options(d.socket), fp, caches, rank=0)
    try:
        assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)
        keys = keys_for("rc", 3)
        store(mgr, worker, keys, [1, 2, 3], job_id=0)
        first, submit = mgr.conn.instance, mgr.conn.submit

        def reconnecting_first(msg, _wait: float = 0.0):
            if isinstance(msg, m.Lookup):
                mgr.conn.submit = submit  # (once)
                d.restart()
                assert wait_for(lambda: mgr.conn.up and mgr.conn.instance != first, 10)
            return submit(msg, _wait)

        mgr.conn.submit = reconnecting_first
        ctx = request("r42", keys)
        mgr.on_new_request(ctx)
        assert answer(mgr, ctx, keys) == [HIT] * 3
        assert mgr.boundary.counts.get("lookup.sent") == 1  # not asked again
        mgr.on_request_finished(ctx)
        assert wait_leases(d, 0) == 0
    finally:
        mgr.shutdown()
        worker.shutdown()


def test_without_a_daemon_everything_degrades_at_once(tmp_path):
    fp = make_fingerprint(FACTS, b"root")
    sock = str(tmp_path / "absent.sock")
    mgr = KvdManager(options(sock), fp, FACTS)
    caches, _ = kv_caches()
    worker = KvdWorker(options(sock), fp, caches, rank=0)
    try:
        keys = keys_for("e", 2)
        ctx = request("r5", keys)
        t0 = time.perf_counter()
        assert scan(mgr, ctx, keys) == [MISS]  # no RETRY round while the breaker is open
        assert mgr.prepare_store(keys, ctx).keys_to_store == []
        slots = KvdSlots(np.array([0, 1]), "gone")
        assert worker.submit_store(3, gpu([1, 2]), slots)
        assert worker.submit_load(4, slots, gpu([3, 4]))
        worker.wait({3, 4})
        assert time.perf_counter() - t0 < 1
        assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [
            (3, True), (4, True)]
        assert worker.take_load_errors() == {3, 4}  # vLLM recomputes these blocks
    finally:
        mgr.shutdown()
        worker.shutdown()


def test_hits_from_a_connection_since_replaced_are_never_loaded(engine_side, daemon):
    """The daemon stopped answering (paused), the scheduler's connection was given up
    and a new one registered: the daemon drops the old identity's leases, so their
    slots may hold other keys. Hits from before are not loaded; the scan asks again."""
    mgr, worker, _ = engine_side
    keys = keys_for("e", 2)
    store(mgr, worker, keys, [1, 2], job_id=0)
    ctx = request("r7", keys)
    mgr.on_new_request(ctx)
    assert answer(mgr, ctx, keys) == [HIT, HIT]
    epoch = mgr.conn.epoch
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while mgr.conn.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not mgr.conn.up
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert mgr.conn.wait_up(10) and mgr.conn.epoch == epoch + 1
    assert (mgr.prepare_load(keys, ctx).slots == NO_SLOT).all()  # a failed load: recompute
    ctx2 = request("r8", keys)
    mgr.on_new_request(ctx2)
    assert answer(mgr, ctx2, keys) == [HIT, HIT]  # asked anew, on the new connection
    assert (mgr.prepare_load(keys, ctx2).slots != NO_SLOT).all()


def test_slots_of_a_previous_daemon_run_are_never_used(engine_side, daemon):
    mgr, worker, storage = engine_side
    keys = keys_for("f", 2)
    ctx = request("r6", keys)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(keys, ctx)
    daemon.restart()
    assert worker.conn.wait_up(10)
    deadline = time.monotonic() + 10
    while worker.conn.instance == out.store_spec.instance and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.submit_store(8, gpu([1, 2]), out.store_spec)
    worker.wait({8})
    assert [r.job_id for r in worker.get_finished()] == [8]  # completed, as a skip
    assert daemon.status()["counters"]["stored_blocks"] == 0


def test_split_pages_describes_tensors_in_fingerprint_pages():
    one = [HostRegion(1000, 8, 8192, 8192)]
    assert split_pages(one, [4096, 4096]) == [HostRegion(1000, 8, 8192, 4096),
                                              HostRegion(5096, 8, 8192, 4096)]
    two = [HostRegion(0, 8, 4096, 4096), HostRegion(1 << 20, 8, 4096, 4096)]
    assert split_pages(two, [4096, 4096]) == two
    with pytest.raises(LayoutError):
        split_pages(two, [8192])


def test_slots_spec_pickles_small():
    spec = KvdSlots(np.arange(7), "instance", lease=1 << 50)
    back = pickle.loads(pickle.dumps(spec, pickle.HIGHEST_PROTOCOL))
    assert back.slots.tolist() == list(range(7)) and back.instance == "instance"
    assert back.lease == 1 << 50 and back.ticket == 0
    assert len(pickle.dumps(spec, pickle.HIGHEST_PROTOCOL)) < 200


def test_unsupported_vllm_version_is_refused():
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.1")
    with pytest.raises(UnsupportedVllmVersion, match="0.32 and 0.33.*0.31.2"):
        check_vllm_version("0.31.2")


def test_root_hash_is_vllms_or_engine_private(monkeypatch):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from kvd_client.vllm.fingerprint import compute_root_hash

    # Put back afterwards: managers made by later tests check their root against it.
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", getattr(kv_cache_utils, "NONE_HASH", None),
                        raising=False)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    assert compute_root_hash("sha256", "e1") == bytes(kv_cache_utils.NONE_HASH)
    # xxhash draws a random root per process unless PYTHONHASHSEED is set:
    assert compute_root_hash("xxhash", "e1", environ={}) == b"engine:e1"
    seeded = compute_root_hash("xxhash", "e1", environ={"PYTHONHASHSEED": "7"})
    assert seeded == compute_root_hash("xxhash", "e2", environ={"PYTHONHASHSEED": "7"})
    assert seeded != compute_root_hash("xxhash", "e1", environ={"PYTHONHASHSEED": "8"})


def test_worker_shutdown_closes_its_data_path_while_the_daemon_can_still_confirm(daemon):
    """A CUDA path's ring may destroy its events only once the daemon confirmed its waits,
    which arrive over the connection: the path closes before the connection does, and
    not after Dones the worker made up itself."""
    seen: dict[str, object] = {}

    class Path(_HostPath):
        def close(self) -> None:
            seen["conn_up"] = worker.conn.up
            seen["jobs_open"] = sorted(worker._jobs)

    fp = make_fingerprint(FACTS, b"root")
    caches, _ = kv_caches()
    worker = KvdWorker(options(daemon.socket), fp, caches, rank=0,
                       path=Path([t.tensor for t in caches.tensors]))
    assert worker.conn.wait_up(10)
    worker.shutdown()
    assert seen == {"conn_up": True, "jobs_open": []}


def test_the_worker_names_the_transfer_whose_event_the_daemon_waited_for(daemon):
    """A data path's events are freed per transfer: the worker hands the path the job
    it records an event for, and the same job with its EventWaited and its Done."""
    calls: list[tuple] = []

    class Path(_HostPath):
        def order_event(self, job: int) -> int:
            calls.append(("order", job))
            return -1

        def event_done(self, index: int, job: int) -> None:
            calls.append(("done", index, job))

    fp = make_fingerprint(FACTS, b"root")
    caches, _ = kv_caches()
    mgr = KvdManager(options(daemon.socket), fp, FACTS)
    worker = KvdWorker(options(daemon.socket), fp, caches, rank=0,
                       path=Path([t.tensor for t in caches.tensors]))
    try:
        assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)
        store(mgr, worker, keys_for("ev", 2), [1, 2], job_id=41)
        worker.conn.on_event_waited(m.EventWaited(0, 41, 3))  # as a GPU daemon sends it
        assert calls == [("order", 41), ("done", -1, 41), ("done", 3, 41)]
    finally:
        mgr.shutdown()
        worker.shutdown()


def stored_then_hit(mgr, worker, tag: str) -> KvdSlots:
    """Blocks 1 and 2 stored under two keys, looked up by a new request: its load spec."""
    keys = keys_for(tag, 2)
    store(mgr, worker, keys, [1, 2], job_id=0)
    ctx = request(f"r-{tag}", keys)
    mgr.on_new_request(ctx)
    assert answer(mgr, ctx, keys) == [HIT, HIT]
    return mgr.prepare_load(keys, ctx)


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_a_block_id_no_uint32_holds_fails_the_load_as_skipped_not_as_a_bug(engine_side, bad):
    """Packing it raised inside the worker: counted and logged (with a traceback) as a
    bug of kvd's, where it is an id no engine block has."""
    mgr, worker, _ = engine_side
    spec = stored_then_hit(mgr, worker, f"bad{bad}")
    target = gpu([0, 1])
    target.block_ids = np.array([0, bad])
    assert worker.submit_load(9, spec, target)
    assert [r.job_id for r in worker.get_finished()] == [9]
    assert worker.take_load_errors() == {0, bad}
    assert worker.boundary.counts["load.skipped.block_ids"] == 1
    assert not any(k.endswith(".bug") for k in worker.boundary.counts)


def test_a_load_whose_lease_is_gone_fails_and_is_recomputed(engine_side, daemon):
    """prepare_load hands the lease to the workers with the slots; once it is gone
    (released, lapsed, dropped) the daemon refuses the load, which vLLM recomputes."""
    mgr, worker, storage = engine_side
    spec = stored_then_hit(mgr, worker, "gone")
    assert spec.lease == mgr._reqs["r-gone"].lease > 0
    mgr.conn.request(m.Release(mgr.conn.next_req(), spec.lease))  # lapsed, say
    storage[:, 20:22] = 0
    assert worker.submit_load(5, spec, gpu([20, 21]))
    worker.wait({5})
    assert [r.job_id for r in worker.get_finished()] == [5]
    assert worker.take_load_errors() == {20, 21}  # vLLM recomputes them
    assert not storage[:, 20:22].any()  # nothing copied


def test_worker_shutdown_waits_for_the_copies_into_its_memory(engine_side, daemon):
    """Until their Done the daemon may write into the engine's memory: shutdown returns
    only after it (bounded by the deadline), not at once with made-up failures."""
    import threading

    mgr, worker, storage = engine_side
    spec = stored_then_hit(mgr, worker, "sd")
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert worker.submit_load(6, spec, gpu([24, 25]))
        t = threading.Thread(target=worker.shutdown)
        t.start()
        t.join(0.5)
        assert t.is_alive()  # waiting for the daemon's Done
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    t.join(10)
    assert not t.is_alive()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(6, True)]
    assert worker.take_load_errors() == set()
    assert torch.equal(storage[:, 24:26], storage[:, 1:3])


def test_a_fork_child_of_a_worker_ends_the_parents_jobs_and_never_blocks(engine_side, daemon):
    """Forked while a load was in flight and another thread held the worker's lock (as
    its I/O thread does delivering a Done): the child's get_finished blocked on that
    lock for ever, and its shutdown waited out the parent's deadlines for Dones that
    cannot come there. The child ends the parent's jobs at once, a load as failed (the
    daemon writes into the parent's memory, not the child's); the parent goes on."""
    import threading

    mgr, worker, storage = engine_side
    spec = stored_then_hit(mgr, worker, "fork")
    storage[:, 26:28] = 0
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with worker._cond:
            held.set()
            release.wait(10)

    daemon.proc.send_signal(signal.SIGSTOP)
    t = threading.Thread(target=hold)
    try:
        assert worker.submit_load(7, spec, gpu([26, 27]))
        t.start()
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: no pytest from here on, only an exit code
            code = 1
            try:
                finished = [(r.job_id, r.success) for r in worker.get_finished()]
                errors = worker.take_load_errors()
                worker.shutdown()
                code = 0 if (finished, errors) == ([(7, True)], {26, 27}) else 3
            finally:
                os._exit(code)
        assert child_exit(pid, 5) == 0  # None: it hung; 3: the jobs were not ended
    finally:
        release.set()
        daemon.proc.send_signal(signal.SIGCONT)
        t.join()
    worker.wait({7})  # the parent's load: copied by the daemon, once
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, True)]
    assert worker.take_load_errors() == set()
    assert torch.equal(storage[:, 26:28], storage[:, 1:3])


def test_in_a_multiconnector_only_kvds_connector_reports_its_load_errors(monkeypatch):
    """Another connector's failed loads stay its own: kvd lends its report only to the
    sub-connector that runs its spec."""
    from types import SimpleNamespace

    from vllm.distributed import kv_transfer

    from kvd_client.vllm import worker as worker_mod

    spec = object()
    other_errors = {7, 8}
    ours = SimpleNamespace(connector_worker=SimpleNamespace(spec=spec),
                           get_block_ids_with_load_errors=lambda: set())
    other = SimpleNamespace(connector_worker=SimpleNamespace(spec=object()),
                            get_block_ids_with_load_errors=lambda: other_errors)
    multi = SimpleNamespace(sub_connectors=[other, ours],
                            get_block_ids_with_load_errors=lambda: other_errors)
    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: multi)
    failed = SimpleNamespace(take_load_errors=lambda: {1})
    worker_mod._report_load_errors_through(failed, spec)
    assert ours.get_block_ids_with_load_errors() == {1}
    assert other.get_block_ids_with_load_errors() == {7, 8}
    assert multi.get_block_ids_with_load_errors() == {7, 8}  # aggregates its subs itself


def test_a_prompt_stored_in_parts_names_its_whole_length(engine_side, monkeypatch):
    """vLLM's chunked prefill stores a long prompt a step's blocks at a time; each
    Allocate names the request's length (vLLM has recorded every key's position), so
    the daemon's policy keeps the parts one run."""
    mgr, _, _ = engine_side
    sent: list[m.Request] = []
    submit = mgr.conn.submit
    monkeypatch.setattr(mgr.conn, "submit", lambda msg: sent.append(msg) or submit(msg))
    keys = keys_for("chunked", 12)
    ctx = request("chunked", keys)
    mgr.prepare_store(keys[:4], ctx)
    mgr.prepare_store(keys[4:8], ctx)
    allocs = [msg for msg in sent if isinstance(msg, m.Allocate)]
    assert [(a.depth, a.length) for a in allocs] == [(0, 12), (4, 12)]
    mgr.on_request_finished(ctx)


class SlowHandshake:
    """A relay in front of a real daemon that holds every HelloOk for ``delay`` seconds
    (for good with None): the daemon as an engine starting on a busy machine sees it."""

    def __init__(self, daemon_socket: str, path: str, delay: float | None) -> None:
        import threading

        import zmq

        self.path, self.delay, self._zmq = path, delay, zmq
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.bind(f"ipc://{path}")
        self.daemon = f"ipc://{daemon_socket}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        backs: dict[bytes, zmq.Socket] = {}
        held: list[tuple[float, bytes, bytes]] = []
        while not self.stop.is_set():
            events = dict(poller.poll(5))
            if self.front in events:
                ident, data = self.front.recv_multipart()
                if ident not in backs:
                    backs[ident] = self.ctx.socket(zmq.DEALER)
                    backs[ident].connect(self.daemon)
                    poller.register(backs[ident], zmq.POLLIN)
                backs[ident].send(data)
            for ident, back in backs.items():
                if back in events:
                    data = back.recv()
                    if isinstance(m.decode_reply(data), m.HelloOk):
                        if self.delay is None:
                            continue
                        held.append((time.monotonic() + self.delay, ident, data))
                    else:
                        self.front.send_multipart([ident, data])
            now = time.monotonic()
            for item in [h for h in held if h[0] <= now]:
                held.remove(item)
                self.front.send_multipart([item[1], item[2]])
        for sock in (self.front, *backs.values()):
            sock.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.term()


def test_an_engine_starting_hits_while_its_handshake_is_under_way(engine_side, daemon,
                                                                   tmp_path):
    """A (re)started engine's first request can come before its connection is up: it
    waits for the handshake (RETRY, like for a Lookup reply) and loads, rather than
    recomputing blocks kvd holds."""
    mgr, worker, _ = engine_side
    keys = keys_for("restart", 3)
    store(mgr, worker, keys, [1, 2, 3], job_id=1)
    relay = SlowHandshake(daemon.socket, str(tmp_path / "slow.sock"), delay=0.15)
    fresh = KvdManager(options(relay.path), make_fingerprint(FACTS, b"root"), FACTS)
    try:
        assert wait_for(lambda: fresh.conn.handshaking, 5)
        ctx = request("first", keys)
        fresh.on_new_request(ctx)
        assert scan(fresh, ctx, keys) == [RETRY] * 3  # not a miss
        assert answer(fresh, ctx, keys) == [HIT] * 3
        assert "lookup.unavailable" not in fresh.boundary.counts
    finally:
        fresh.shutdown()
        relay.close()


def test_a_handshake_that_never_ends_costs_one_request_the_deadline(tmp_path, daemon):
    relay = SlowHandshake(daemon.socket, str(tmp_path / "hung.sock"), delay=None)
    fresh = KvdManager(options(relay.path, lookup_timeout_ms=200),
                       make_fingerprint(FACTS, b"root"), FACTS)
    try:
        assert wait_for(lambda: fresh.conn.handshaking, 5)
        first, second = keys_for("h1", 2), keys_for("h2", 2)
        ctx = request("first", first)
        t0 = time.monotonic()
        assert answer(fresh, ctx, first) == [MISS]
        assert 0.2 <= time.monotonic() - t0 < 1
        ctx2 = request("second", second)
        assert scan(fresh, ctx2, second) == [MISS]  # at once: no RETRY round
        assert fresh.boundary.counts["lookup.connecting"] == 1
    finally:
        fresh.shutdown()
        relay.close()


def test_an_expedited_load_ends_by_its_own_short_deadline(daemon):
    """A load the forward pass waits for (vLLM 0.33's ``expedited``, KvdConnector's
    synchronous loads via ``expedite``) carries ``sync_load_timeout_ms`` as its deadline:
    with the daemon paused, the wait ends after it plus the grace, not after
    ``transfer_timeout_ms``, and the blocks are reported for recompute."""
    fp = make_fingerprint(FACTS, b"root")
    caches, storage = kv_caches()
    opts = options(daemon.socket, transfer_timeout_ms=20_000, sync_load_timeout_ms=200)
    mgr, worker = KvdManager(opts, fp, FACTS), KvdWorker(opts, fp, caches, rank=0)
    try:
        assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)
        spec = stored_then_hit(mgr, worker, "sync")
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            worker.expedite({7})
            assert worker.submit_load(7, spec, gpu([30, 31]))
            started = time.monotonic()
            worker.wait({7})
            waited = time.monotonic() - started
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert waited < 0.2 + m.EXPIRY_GRACE_NS / 1e9 + 1.5, waited  # not the 20 s one
        assert [r.job_id for r in worker.get_finished()] == [7]
        assert worker.take_load_errors() == {30, 31}
        assert not worker._expedited  # noqa: SLF001 - nothing left behind
    finally:
        mgr.shutdown()
        worker.shutdown()


def test_sync_loads_option_refuses_unknown_values():
    assert KvdOptions.from_extra({"socket": "s", "sync_loads": "off"}).sync_loads == "off"
    with pytest.raises(ValueError, match="sync_loads"):
        KvdOptions.from_extra({"socket": "s", "sync_loads": "yes"})


# ------------------------------------------------ an idle in-process engine's last stores
def deferred_store(mgr, tag: str, job_id: int, blocks: list[int]):
    """A store as vLLM's worker defers it to the next step: (job, source, destination)."""
    keys = keys_for(tag, len(blocks))
    ctx = request(f"{tag}-{job_id}", keys)
    mgr.on_new_request(ctx)
    return (job_id, gpu(blocks), mgr.prepare_store(keys, ctx).store_spec), keys


def test_idle_flush_submits_the_deferred_stores_once_no_step_came(engine_side, daemon):
    """vLLM's connector worker (here just the two attributes IdleFlush reads) holds the
    last step's stores; with no step after it, they go to the daemon from the flush
    thread, once, and the list is emptied as vLLM's own submission empties it."""
    mgr, worker, _ = engine_side
    job, keys = deferred_store(mgr, "idle", 41, [3, 4])
    cw = types.SimpleNamespace(worker=worker, _unsubmitted_store_jobs=[job])
    flush = IdleFlush(cw, idle_s=0.05)
    try:
        with flush.step():  # the step that deferred them
            pass
        assert wait_for(lambda: worker.boundary.counts["store.idle_flushed"] == 1, 5)
        worker.wait({41})
        assert [r.job_id for r in worker.get_finished()] == [41]
        assert cw._unsubmitted_store_jobs == []
        assert wait_for(lambda: daemon.status()["counters"]["stored_blocks"] == len(keys), 5)
    finally:
        flush.close()


def test_a_step_within_the_idle_time_leaves_the_stores_to_vllm(engine_side):
    mgr, worker, _ = engine_side
    job, _ = deferred_store(mgr, "busy", 42, [5])
    cw = types.SimpleNamespace(worker=worker, _unsubmitted_store_jobs=[job])
    flush = IdleFlush(cw, idle_s=0.3)
    try:
        with flush.step():
            pass
        with flush.step():  # the next step: vLLM submits them itself
            for job_id, src, dst in cw._unsubmitted_store_jobs:
                worker.submit_store(job_id, src, dst)
            cw._unsubmitted_store_jobs.clear()
        worker.wait({42})
        time.sleep(0.5)
        assert worker.boundary.counts["store.idle_flushed"] == 0
        assert [r.job_id for r in worker.get_finished()] == [42]  # one Done: sent once
    finally:
        flush.close()


def _forked_while_held(held_by_other, in_child) -> None:
    """Fork while another thread is inside ``held_by_other()`` (a context manager); the
    child runs ``in_child()`` and must end (not hang on what the other thread held)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held_by_other():
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit code
        try:
            in_child()
        finally:
            os._exit(0)
    try:
        assert child_exit(pid, 10) == 0  # None: it hung on the lock
    finally:
        release.set()
        t.join()


def test_a_fork_child_never_blocks_on_a_boundary_lock_the_parent_held():
    """The parent's I/O thread counts under a boundary's lock (an Allocate reply, a
    Done): forked at that moment, every hook in the child hung on it."""
    boundary = Boundary("scheduler")

    def in_child() -> None:
        boundary.count("lookup.unavailable")
        boundary.note("lookup", "unavailable")

    _forked_while_held(lambda: boundary._lock, in_child)


def test_a_fork_child_of_an_engine_never_blocks_on_the_flush_lock():
    """Forked while another thread held the lock: the child's hooks and close go on."""
    cw = types.SimpleNamespace(worker=None, _unsubmitted_store_jobs=[])
    flush = IdleFlush(cw, idle_s=60)

    def in_child() -> None:
        with flush.step():
            pass
        flush.close()

    try:
        _forked_while_held(flush.step, in_child)
    finally:
        flush.close()


# ------------------------------------------------ KV events: what a store says of its chain
def test_stores_name_their_parent_and_whether_their_keys_are_consecutive(daemon_factory):
    """The manager's Allocate names the request's key before the first one stored (a
    prompt stored in two parts: the second part's parent is the first part's last key)
    and says when vLLM skipped blocks in between (no key is then the next one's parent);
    what the daemon publishes shows both."""
    d = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(d.status()["events"]["endpoint"])
    time.sleep(0.3)  # the subscription reaches the publisher
    fp = make_fingerprint(FACTS, b"root")
    mgr = KvdManager(options(d.socket), fp, FACTS)
    worker = KvdWorker(options(d.socket), fp, kv_caches()[0], rank=0)
    assert mgr.conn.wait_up(10) and worker.conn.wait_up(10)

    def stored(keys: list[bytes], ctx: ReqContext, job_id: int) -> list[tuple]:
        out = mgr.prepare_store(keys, ctx)
        assert worker.submit_store(job_id, gpu(list(range(len(keys)))), out.store_spec)
        worker.wait({job_id})
        assert sub.poll(5000)
        batch = decode(sub.recv_multipart()[2])
        return [(e.block_hashes, e.parent_block_hash) for e in batch.events
                if isinstance(e, BlockStored)]

    def h(k: bytes) -> int:
        return int.from_bytes(k[:-4], "big") & (2**64 - 1)

    try:
        keys = keys_for("chain", 7)
        ctx = request("chain", keys)
        mgr.on_new_request(ctx)
        assert stored(keys[:3], ctx, 1) == [([h(k) for k in keys[:3]], None)]
        assert stored(keys[3:5], ctx, 2) == [([h(k) for k in keys[3:5]], h(keys[2]))]
        other = request("other", keys)  # a new request: found by searching its keys
        mgr.on_new_request(other)
        assert stored(keys[5:6], other, 3) == [([h(keys[5])], h(keys[4]))]
        gap = keys_for("gap", 4)
        gappy = request("gappy", gap)
        mgr.on_new_request(gappy)
        assert stored([gap[1], gap[3]], gappy, 4) == [  # vLLM skipped gap[2]
            ([h(gap[1])], h(gap[0])), ([h(gap[3])], None)]
    finally:
        mgr.shutdown()
        worker.shutdown()
        sub.close(linger=0)


@pytest.mark.parametrize("hits, pending, slots", [
    (-1, 0, 8), (0, -2, 8), (5, 0, 8), (2, 2, 8), (1, 0, 5),  # (5: a torn length)
    (None, 0, 0)])  # (an answer of another kind: was a miss nobody counted)
def test_a_lookup_answer_no_kvd_gives_is_a_miss(tmp_path, hits, pending, slots):
    """hits=-1 sliced the keys from the end: vLLM was told HIT for keys the daemon never
    named (and a torn Allocated logged a traceback per store)."""
    from tests.client.test_connection import misbehaving_daemon

    def answer_(msg):
        if isinstance(msg, m.Lookup) and hits is None:
            return m.encode(m.Ok(msg.req))
        if isinstance(msg, m.Lookup):
            return m.encode(m.LookupOk(msg.req, hits, b"\0" * slots, 7, pending))
        return m.encode(m.Ok(msg.req))  # an Allocate's answer of the wrong kind

    path = str(tmp_path / "fake.sock")
    t, stop = misbehaving_daemon(path, answer_)
    mgr = KvdManager(options(path), make_fingerprint(FACTS, b"root"), FACTS)
    try:
        assert mgr.conn.wait_up(10)
        keys = keys_for("bad", 3)
        ctx = request("r-bad", keys)
        assert answer(mgr, ctx, keys) == [MISS]
        assert mgr.boundary.counts["lookup.bad reply"] == 1
        mgr.prepare_store(keys, ctx)
        assert wait_for(lambda: mgr.boundary.counts["prepare_store.bad reply"] == 1, 5)
    finally:
        mgr.shutdown()
        stop.set()
        t.join(5)
