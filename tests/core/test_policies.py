"""Eviction policies: the registry, the ABC contract, and each policy's invariants."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd.core.allocator import Allocator
from kvd.core.index import NO_SLOT, PENDING, READY, Index
from kvd.core.policies import DEFAULT_POLICY, EvictionPolicy, make_policy, policy_names
from kvd.core.policies.arc import ARCPolicy
from kvd.core.policies.base import _REGISTRY
from kvd.core.policies.chain import ChainPolicy
from kvd.core.policies.s3fifo import MAX_FREQ, S3FIFOPolicy
from kvd.core.tenants import Tenants

NAMES = policy_names()
SLOT = 4096


def test_every_registered_name_imports_and_satisfies_the_abc() -> None:
    assert {"lru", "arc", "s3fifo", "chain"} <= set(NAMES)
    assert DEFAULT_POLICY in NAMES
    for name in NAMES:
        module, _, cls = _REGISTRY[name].partition(":")
        klass = getattr(importlib.import_module(module), cls)
        assert issubclass(klass, EvictionPolicy) and klass.name == name
        policy = make_policy(name, 8)
        assert len(policy) == 0 and list(policy.victims()) == []


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: .*lru"):
        make_policy("nope", 8)


# ---------------------------------------------------------------- the bare contract
# An op: ("insert", chain, length) stores a new chain; ("touch", i) hits the leading
# run of live chain i; ("evict", n) evicts n victims; ("remove", i) drops one block.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(1, 6)),
        st.tuples(st.just("touch"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(1, 5)),
        st.tuples(st.just("remove"), st.integers(0, 50)),
    ),
    max_size=60,
)


def _check_shape(policy: EvictionPolicy, live: set[bytes]) -> None:
    order = list(policy.victims())
    assert len(order) == len(set(order)) == len(policy) == len(live)
    assert set(order) == live
    assert list(policy.victims()) == order  # victims() changes nothing


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_victims_are_exactly_the_inserted_keys(name: str, ops: list, capacity: int) -> None:
    policy = make_policy(name, capacity)
    live: set[bytes] = set()
    chains: list[list[bytes]] = []
    fresh = iter(range(10**6))
    for op, arg in ops:
        if op == "insert":
            chain = [next(fresh).to_bytes(8, "little") for _ in range(arg)]
            for depth, key in enumerate(chain):
                policy.insert(key, depth, length=len(chain))
            live.update(chain)
            chains.append(chain)
        elif op == "touch" and chains:
            chain = chains[arg % len(chains)]
            run = []
            for key in chain:
                if key not in live:
                    break
                run.append(key)
            if run:
                policy.touch(run, 0)
        elif op == "evict":
            for key in list(policy.victims())[:arg]:
                policy.evicted(key)
                live.discard(key)
        elif op == "remove" and live:
            key = sorted(live)[arg % len(live)]
            policy.remove(key)
            live.discard(key)
        _check_shape(policy, live)
        _check_invariants(policy)


def _check_invariants(policy: EvictionPolicy) -> None:
    if isinstance(policy, ARCPolicy):
        t1, t2, b1, b2 = map(set, (policy.t1, policy.t2, policy.b1, policy.b2))
        assert not (t1 & t2) and not (b1 & b2)
        assert not ((t1 | t2) & (b1 | b2)), "a resident key is also a ghost"
        assert len(b1) <= policy.capacity and len(b2) <= policy.capacity
        assert 0.0 <= policy.target_t1 <= policy.capacity
    if isinstance(policy, S3FIFOPolicy):
        small, main, ghost = set(policy.small), set(policy.main), set(policy.ghost)
        assert not (small & main) and small | main == set(policy.freq)
        assert not (ghost & (small | main))
        assert len(ghost) <= policy.ghost_cap
        assert all(0 <= f <= MAX_FREQ for f in policy.freq.values())


# ---------------------------------------------------------------- through the Index
def _index(name: str, capacity: int) -> tuple[Index, object]:
    tenant = Tenants().get_or_create("t", model="m", tp_size=1, rank_page_bytes=(SLOT,))
    index = Index(Allocator(capacity * SLOT, SLOT, SLOT), make_policy(name, capacity))
    return index, tenant


IDX_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "stage", "finish", "lease", "release"]),
        st.integers(0, 7),  # which chain
        st.integers(1, 5),  # how many blocks
    ),
    max_size=50,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(ops=IDX_OPS, capacity=st.integers(2, 10))
def test_capacity_pins_and_pending_are_respected(name: str, ops: list, capacity: int) -> None:
    """Stores never exceed capacity; leased and PENDING blocks are never evicted."""
    index, tenant = _index(name, capacity)
    chains = [[(c * 100 + d).to_bytes(8, "little") for d in range(5)] for c in range(8)]
    staged: list[np.ndarray] = []  # PENDING stores not finished yet
    leases: list[tuple[int, list[bytes]]] = []
    for op, c, n in ops:
        keys = chains[c][:n]
        if op in ("store", "stage"):
            hits = index.lookup(tenant, keys)[0]
            res = index.allocate(tenant, keys[hits:], depth=hits)
            slots = np.array([s for s in res.slots if s != NO_SLOT], dtype=np.int64)
            if op == "store":
                index.store_done(slots, 0)
            else:
                staged.append(slots)
        elif op == "finish" and staged:
            index.store_done(staged.pop(0), 0)
        elif op == "lease":
            hits, _, lease, _ = index.lookup(tenant, keys, lease_s=60.0)
            if lease:
                leases.append((lease, keys[:hits]))
        elif op == "release" and leases:
            index.release(leases.pop(0)[0])
        assert index.ready_blocks + index.pending_blocks <= capacity
        assert len(index.policy) == index.ready_blocks
        for _, held in leases:
            assert all(index.contains(tenant, k) == READY for k in held)
        for slots in staged:
            assert all(index.state[s] == PENDING for s in slots.tolist())


def test_lru_keeps_the_head_of_a_hit_prefix_longest() -> None:
    """vLLM's LRU order: a hit prefix is touched tail to head, so tails go first."""
    policy = make_policy("lru", 8)
    keys = [bytes([i]) for i in range(4)]
    for d, k in enumerate(keys):
        policy.insert(k, d)
    policy.touch(keys[:3], 0)
    assert list(policy.victims()) == [keys[3], keys[2], keys[1], keys[0]]


def test_chain_evicts_a_chain_tail_before_its_head() -> None:
    policy = make_policy("chain", 8)
    keys = [bytes([i]) for i in range(4)]
    for d, k in enumerate(keys):
        policy.insert(k, d, length=4)
    assert list(policy.victims()) == keys[::-1]
    policy.touch(keys[:2], 0)  # hit blocks outlive never-hit ones
    assert list(policy.victims())[:2] == [keys[3], keys[2]]


# ---------------------------------------------------------------- batch calls
RUNS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 4),
                          st.booleans(), st.integers(0, 3)),
                min_size=1, max_size=20)  # (depth, run length, victims to evict after,
#                                            store evicted keys again, keys removed after)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(runs=RUNS, capacity=st.integers(2, 12))
def test_batch_calls_equal_the_single_calls(
        name: str, runs: list, capacity: int) -> None:
    """The batch calls the index makes (insert_many, evict, remove_many) decide exactly
    as the one-key calls (insert, victims + evicted, remove) would."""
    batch, single = make_policy(name, capacity), make_policy(name, capacity)
    fresh = iter(range(10**6))
    evicted: list[bytes] = []  # stored again, they return from the ghost lists
    for depth, n, evict, again, removed in runs:
        keys = [evicted.pop() if again and evicted and i % 2 == 0
                else next(fresh).to_bytes(8, "little") for i in range(n)]
        batch.insert_many(keys, depth, depth + n)
        for i, key in enumerate(keys):
            single.insert(key, depth + i, depth + n)
        assert list(batch.victims()) == list(single.victims())
        gone = list(batch.victims())[:evict]
        if evict % 2:
            assert batch.evict(evict) == gone
        else:
            batch.evicted_many(gone)
        for key in gone:
            single.evicted(key)
        evicted.extend(gone)
        assert list(batch.victims()) == list(single.victims())
        # A flush's keys: the newest held, one of them twice, and one not held.
        flushed = list(batch.victims())[len(list(batch.victims())) - removed:]
        flushed += flushed[:1] + [next(fresh).to_bytes(8, "little")]
        batch.remove_many(flushed)
        for key in flushed:
            single.remove(key)
        batch.remove_many([])  # (a tenant with nothing to evict): as no call at all
        assert list(batch.victims()) == list(single.victims())
        assert batch.describe() == single.describe()
        if len(gone) < len(list(batch.victims())):  # a hit on the oldest live chain
            run = list(batch.victims())[-2:]
            batch.touch(run, 0)
            single.touch(run, 0)


def test_runheap_offers_each_key_once_even_if_pushed_twice() -> None:
    from kvd.core.policies.runheap import RunHeap

    heap = RunHeap()
    heap.push_run([b"a", b"b", b"a"], 1.0)
    heap.push_run([b"c"], 0.5)
    heap.push_run([b"b"], 0.1)  # moves b to an earlier entry
    assert list(heap.ordered()) == [b"b", b"c", b"a"]
    assert heap.discard_many([b"c", b"a"]) == 1.0 and list(heap.ordered()) == [b"b"]


# ---------------------------------------------------------------- chain adapts
def _chat_like(requests: int, seed: int) -> list[list[bytes]]:
    """Multi-turn chat: each turn re-sends its conversation's history plus a short new
    question; recent conversations resume far more often than old ones."""
    import random

    rng = random.Random(seed)
    fresh = iter(range(10**9))
    sysprompt = [next(fresh) for _ in range(4)]
    convs: list[list[int]] = []
    out = []
    for _ in range(requests):
        if not convs or rng.random() < 0.3:
            convs.append(list(sysprompt))
            c = len(convs) - 1
        else:
            c = len(convs) - 1 - min(len(convs) - 1, int(rng.expovariate(1 / 20)))
        turn = convs[c] + [next(fresh) for _ in range(rng.randint(1, 6))]
        convs[c] = turn + [next(fresh)]
        out.append([h.to_bytes(8, "little") for h in turn])
    return out


def _hits(policy: EvictionPolicy, requests: list[list[bytes]]) -> int:
    capacity = policy.capacity
    tenant = Tenants().get_or_create("t", model="m", tp_size=1, rank_page_bytes=(SLOT,))
    index = Index(Allocator(capacity * SLOT, 50 * SLOT, SLOT), policy)
    for keys in requests:
        hits = index.lookup(tenant, keys)[0]
        if hits < len(keys):
            res = index.allocate(tenant, keys[hits:], depth=hits)
            index.store_done(np.array([s for s in res.slots if s != NO_SLOT], np.int64), 0)
    return index.counters.hit_blocks


def test_chain_learns_recency_on_chat() -> None:
    """On chat the length prior is wrong (a short conversation's next turn matters as
    much as a long document): the ghosts turn it down, closing most of the gap to LRU
    that the fixed prior leaves."""
    from kvd.core.policies.chain import ChainPolicy

    class Frozen(ChainPolicy):
        step = 0.0

    trace = _chat_like(3000, seed=7)
    lru = _hits(make_policy("lru", 500), trace)
    frozen = _hits(Frozen(500), trace)
    adaptive = _hits(make_policy(DEFAULT_POLICY, 500), trace)
    assert adaptive > frozen
    assert lru - adaptive < 0.5 * (lru - frozen)


def test_chain_survives_runs_longer_than_its_averaging_window():
    """Regression: runs longer than the averaging window overshot the running mean
    chain length to exactly zero (two Allocates of 8,192 keys did it in the daemon)."""
    from kvd.core.policies.chain import MEAN_WINDOW

    p = make_policy("chain", 1000)
    n = 2 * MEAN_WINDOW
    for run in range(4):
        p.insert_many([(run, i) for i in range(10)], 0, n)
    assert p._mean_len > 0 and len(p) == 40


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(20, 120), warm=st.lists(st.tuples(st.integers(1, 12),
                                                                st.integers(0, 5)),
                                                      min_size=4, max_size=40),
       drop=st.integers(0, 6), extra=st.integers(1, 12))
def test_s3fifo_batch_eviction_decides_as_one_eviction_per_insert(
        capacity: int, warm: list, drop: int, extra: int) -> None:
    """The index evicts a request's worth of blocks before their inserts (they become
    READY later). S3-FIFO must choose those victims as its one-at-a-time algorithm
    would, an eviction before each insert: its small queue keeps its share, rather
    than the main queue paying for the whole batch. (For new keys: a key back from
    the ghost goes to the main queue, which a batch cannot know in advance.)"""
    one, batch = S3FIFOPolicy(capacity), S3FIFOPolicy(capacity)
    fresh = iter(range(10**6))

    def put(policy: S3FIFOPolicy, key: bytes) -> list[bytes]:
        gone = policy.evict(1) if len(policy) >= capacity else []
        policy.insert(key)
        return gone

    inserted = 0
    for size, hits in itertools.islice(itertools.cycle(warm), 10**6):
        if inserted > 3 * capacity:  # past the first fill: the queues at their shares
            break
        inserted += size
        keys = [next(fresh).to_bytes(8, "little") for _ in range(size)]
        for key in keys:
            put(one, key), put(batch, key)
        live = list(one.freq)
        for i in range(hits):
            key = live[(i * 7919) % len(live)]
            one.touch([key]), batch.touch([key])
    # the same history for both
    for key in list(one.small)[:drop]:  # free room (a failed checksum, a flush)
        one.remove(key), batch.remove(key)
    assert list(one.victims()) == list(batch.victims())
    new = [next(fresh).to_bytes(8, "little") for _ in range(capacity - len(batch) + extra)]
    one_by_one = [k for key in new for k in put(one, key)]
    assume(not set(one_by_one) & set(new))  # a batch cannot evict its own keys
    assert batch.evict(extra) == one_by_one


def test_chain_keeps_a_request_stored_in_parts_one_run() -> None:
    """vLLM's chunked prefill stores a long prompt in parts, one per step, with other
    requests' stores between them; each part names the request's length. The parts
    must make the run a whole store makes: same kind, same priority."""
    def keys(tag: str, n: int) -> list[bytes]:
        return [f"{tag}{i}".encode() for i in range(n)]

    hit, doc, other = keys("h", 4), keys("d", 8), keys("o", 6)
    whole, parts = ChainPolicy(100), ChainPolicy(100)
    for p in (whole, parts):
        p.insert_many(hit, 0, 4)
        p.touch(hit, 0)  # a hit, then its chain goes on: the next turn
    whole.insert_many(doc, 4, 12)
    whole.insert_many(other, 0, 6)
    parts.insert_many(doc[:3], 4, 12)
    parts.insert_many(other, 0, 6)  # another request's store in between
    parts.insert_many(doc[3:6], 7, 12)
    parts.insert_many(doc[6:], 10, 12)
    assert parts._kind == whole._kind
    assert list(parts.victims()) == list(whole.victims())
