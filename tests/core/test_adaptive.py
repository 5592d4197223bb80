"""The adaptive default: miniature simulations and following the best expert."""

from __future__ import annotations

import random
from itertools import islice

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd.core.allocator import Allocator
from kvd.core.index import NO_SLOT, Index
from kvd.core.policies import make_policy
from kvd.core.policies.adaptive import AdaptivePolicy, Z, challenger
from kvd.core.policies.arc import ARCPolicy
from kvd.core.policies.base import _REGISTRY, EvictionPolicy
from kvd.core.policies.lru import LRUPolicy
from kvd.core.policies.shadow import MINI, key_hash, sample_shift
from kvd.core.tenants import Tenants

SLOT = 4096


def _replay(policy: EvictionPolicy, requests: list[list[bytes]], splits: list | None = None
            ) -> int:
    """Prefix hits of ``requests`` through an Index, as the simulator counts them.
    ``splits`` collects the requests whose stored blocks a cached key split in two."""
    capacity = policy.capacity
    tenant = Tenants().get_or_create("t", model="m", tp_size=1, rank_page_bytes=(SLOT,))
    index = Index(Allocator(capacity * SLOT, SLOT, SLOT), policy)
    for i, keys in enumerate(requests):
        hits = index.lookup(tenant, keys)[0]
        if hits < len(keys):
            res = index.allocate(tenant, keys[hits:], depth=hits)
            got = [s for s in res.slots if s != NO_SLOT]
            if splits is not None and NO_SLOT in res.slots[:len(got) + 1]:
                splits.append(i)
            index.store_done(np.array(got, np.int64), 0)
    index.flush()  # the policy hears of the last hits
    return index.counters.hit_blocks


def _only(name: str) -> type[AdaptivePolicy]:
    return type(f"Only{name}", (AdaptivePolicy,), {"experts": (name,)})


TRACES = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
                  min_size=1, max_size=60)


def _keys(trace: list[list[int]]) -> list[list[bytes]]:
    return [[h.to_bytes(8, "little") for h in r] for r in trace]


@pytest.mark.parametrize("name", ["lru", "arc", "chain"])
@settings(max_examples=30, deadline=None)
@given(trace=TRACES, capacity=st.integers(1, 16))
def test_with_one_expert_it_decides_as_that_expert(name: str, trace: list[list[int]],
                                                   capacity: int) -> None:
    requests = _keys(trace)
    assert _replay(_only(name)(capacity), requests) == _replay(make_policy(name, capacity),
                                                               requests)


SHORT = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True),
                min_size=1, max_size=60)


@pytest.mark.parametrize("name", ["lru", "arc", "chain"])
@settings(max_examples=60, deadline=None)
@given(trace=SHORT, capacity=st.integers(8, 16))
def test_at_full_sampling_the_miniature_simulation_is_exact(
        name: str, trace: list[list[int]], capacity: int) -> None:
    """Below 2 * MINI blocks every key is sampled, and a shadow of the leading policy
    then replays exactly what the live cache does: it scores the live hit count. (Where
    one request's new blocks outnumber the room, the index and the shadow make room in
    slightly different orders; requests here fit twice over. A cached key amid a
    request's missed blocks splits its store in two runs, which the shadow replays one
    after the other while the index made room for both at once: such traces are left
    out.)"""
    policy = _only(name)(capacity)
    assert policy._shift == 0
    splits: list[int] = []
    hits = _replay(policy, _keys(trace), splits)
    assume(not splits)
    assert policy._shadows[0].hits == hits


def test_the_sample_rate_leaves_a_miniature_cache_of_at_least_mini_blocks() -> None:
    for capacity in (1, 100, 2 * MINI - 1, 2 * MINI, 5000, 80_000, 10**6):
        shift = sample_shift(capacity)
        assert capacity >> shift >= min(capacity, MINI)
        assert shift == 0 or capacity >> (shift + 1) < MINI


def test_the_sample_is_the_same_in_every_process() -> None:
    # crc32, not hash(): bytes hashes are salted per process.
    assert key_hash(b"\x00" * 8) == 0x6522DF69
    assert key_hash((1, 2)) == hash((1, 2)) & 0xFFFFFFFF


# ---------------------------------------------------------------- it follows the best
def _chat(requests: int, rng: random.Random) -> list[list[bytes]]:
    """Multi-turn chat with short turns: recency is what matters (LRU's home ground)."""
    fresh = iter(range(10**9))
    convs: list[list[int]] = []
    out = []
    for _ in range(requests):
        if not convs or rng.random() < 0.3:
            convs.append([next(fresh)])
            c = len(convs) - 1
        else:
            c = len(convs) - 1 - min(len(convs) - 1, int(rng.expovariate(1 / 30)))
        turn = convs[c] + [next(fresh) for _ in range(rng.randint(1, 4))]
        convs[c] = turn + [next(fresh)]
        out.append([h.to_bytes(8, "little") for h in turn])
    return out


def _docs_and_noise(requests: int, rng: random.Random) -> list[list[bytes]]:
    """Long documents asked about again and again amid a stream of one-off prompts:
    recency keeps the noise, a policy that values long reused chains keeps the docs."""
    fresh = iter(range(10**9))
    docs = [[next(fresh) for _ in range(40)] for _ in range(12)]
    out = []
    for _ in range(requests):
        if rng.random() < 0.35:
            d = docs[rng.randrange(len(docs))]
            out.append(d + [next(fresh)])
        else:
            out.append([next(fresh) for _ in range(rng.randint(2, 30))])
    return [[h.to_bytes(8, "little") for h in r] for r in out]


@pytest.mark.parametrize("make, capacity, winner",
                         [(_chat, 200, "lru"), (_docs_and_noise, 400, "arc")])
def test_it_ends_up_following_the_expert_that_wins(make, capacity: int, winner: str) -> None:
    """Two experts, and a trace each clearly wins: the leader is that one, and the live
    cache scores about what the winner scores alone."""
    trace = make(4000, random.Random(3))
    alone = {n: _replay(make_policy(n, capacity), trace) for n in ("lru", "arc")}
    refs = sum(map(len, trace))
    assert max(alone, key=alone.__getitem__) == winner  # the trace is what it claims
    # (3 % until 2026-11-29; an Allocate no longer evicting its own held keys brought
    # _chat's LRU/ARC gap at 200 blocks from 3.9 % to 2.1 %: still a clear winner.)
    assert abs(alone["lru"] - alone["arc"]) > 0.02 * refs
    policy = type("LruOrArc", (AdaptivePolicy,), {"experts": ("lru", "arc")})(capacity)
    hits = _replay(policy, trace)
    assert policy.leader == winner
    assert hits >= alone[winner] - 0.01 * refs


OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(1, 30)),
    st.tuples(st.just("hit"), st.integers(0, 200), st.integers(1, 30)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
    st.tuples(st.just("remove"), st.integers(0, 200)),
    st.tuples(st.just("evicted"), st.integers(0, 200), st.integers(1, 5)),
    st.tuples(st.just("resize"), st.sampled_from([1000, 4096, 20_000]))), max_size=60)


@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_a_hits_sample_is_the_held_keys_whose_hash_is_sampled(ops: list[tuple]) -> None:
    """A hit's sampled keys come from a set kept at insert and eviction, not from
    hashing every touched key again: through stores, hits, evictions (the policy's and
    the index's) and removals that set is exactly the held keys under the rate, stored
    since the last new capacity (a new rate, with fresh shadows)."""
    policy = AdaptivePolicy(4096)
    held: list[bytes] = []
    since: set[bytes] = set()  # stored since the last resize
    fresh = iter(range(10**9))
    for op in ops:
        if op[0] == "store":
            keys = [next(fresh).to_bytes(8, "little") for _ in range(op[1])]
            policy.insert_many(keys, 0, len(keys))
            held += keys
            since.update(keys)
        elif op[0] == "hit" and held:
            lo = op[1] % len(held)
            policy.touch(held[lo:lo + op[2]], lo)
        elif op[0] == "evict" and held:
            gone = set(policy.evict(min(op[1], len(held))))
            held = [k for k in held if k not in gone]
        elif op[0] == "remove" and held:
            policy.remove(held.pop(op[1] % len(held)))
        elif op[0] == "evicted" and held:  # the index evicted these keys itself
            lo = op[1] % len(held)
            gone_keys, held = held[lo:lo + op[2]], held[:lo] + held[lo + op[2]:]
            policy.evicted_many(gone_keys)
        elif op[0] == "resize":
            policy.set_capacity(op[1])
            since.clear()
        policy.victims()  # replays deferred stores into the sample
        assert sorted(policy.victims()) == sorted(held)
        expected = ({k for k in held if k in since and key_hash(k) < policy._limit}
                    if policy._shift else set())
        assert policy._held_sample == expected


# ---------------------------------------------------------------- switching honestly
def _evidence(calls: list[tuple[int, int]]) -> tuple[list[float], list[list[float]]]:
    """Scores and per-call products of two experts (leader 0, challenger 1)."""
    scores = [float(sum(c[0] for c in calls)), float(sum(c[1] for c in calls))]
    products = [[float(sum(c[i] * c[j] for c in calls)) for j in (0, 1)] for i in (0, 1)]
    return scores, products


HITS = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.integers(0, 50), max_size=40), edge=st.integers(0, 3),
       at=st.integers(0, 39))
def test_experts_that_hit_alike_do_not_trade_places(calls: list[int], edge: int,
                                                    at: int) -> None:
    """Equal hits call by call never hand the lead over, however many; neither does an
    edge made in a single call (one event, however large, is not a trend)."""
    pairs = [(h, h + (edge if i == at else 0)) for i, h in enumerate(calls)]
    scores, products = _evidence(pairs)
    assert challenger(scores, [1.0, 1.0], products, lead=0) == 0


@settings(max_examples=200, deadline=None)
@given(base=st.lists(st.integers(0, 50), min_size=1, max_size=40), edge=st.integers(1, 5),
       scale=st.integers(1, 8))
def test_a_steady_edge_takes_the_lead_after_a_few_calls_at_any_sample_rate(
        base: list[int], edge: int, scale: int) -> None:
    """A challenger one to five hits ahead in every call leads once the calls outnumber
    Z squared; sampling more keys (every hit count times ``scale``) changes nothing."""
    pairs = [(h * scale, (h + edge) * scale) for h in base]
    scores, products = _evidence(pairs)
    expect = 1 if len(base) > Z * Z else 0
    assert challenger(scores, [1.0, 1.0], products, lead=0) == expect


def test_a_challenger_weighed_down_by_its_live_record_does_not_lead() -> None:
    pairs = [(10, 12)] * 20  # ahead by 20% in every call
    scores, products = _evidence(pairs)
    assert challenger(scores, [1.0, 1.0], products, lead=0) == 1
    assert challenger(scores, [1.0, 0.8], products, lead=0) == 0  # its live hits: 0.8


class _TwoFaced(LRUPolicy):
    """LRU in a miniature, most-recently-used-first at full size: a policy whose
    miniature simulation promises what the live cache never gets."""

    name = "twofaced"

    def victims(self):
        return iter(self._order) if self.capacity < 8 * MINI else reversed(self._order)

    def evict(self, n: int) -> list:
        keys = list(islice(self.victims(), n))
        self.evicted_many(keys)
        return keys


def test_an_expert_whose_miniature_overpromises_loses_the_lead_to_its_live_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-faced expert leads first and its shadow scores exactly as LRU's: only
    the live cache's hits under it tell them apart, and they hand the lead to LRU
    (without them the tie would keep it)."""
    monkeypatch.setitem(_REGISTRY, "twofaced", f"{__name__}:_TwoFaced")  # this test's only
    capacity = 8 * MINI
    trace = _chat(30_000, random.Random(5))
    policy = type("Honest", (AdaptivePolicy,), {"experts": ("twofaced", "lru")})(capacity)
    assert policy._shift > 0
    hits = _replay(policy, trace)
    refs = sum(map(len, trace))
    assert policy.leader == "lru"
    alone = {n: _replay(make_policy(n, capacity), trace) for n in ("lru", "twofaced")}
    assert alone["twofaced"] < alone["lru"] - 0.05 * refs  # the live face is worse
    # The lead passes once a few capacities were stored under it: most of the edge.
    assert hits - alone["twofaced"] > 0.8 * (alone["lru"] - alone["twofaced"])


# ---------------------------------------------------------------- a new leader's state
class _Handovers(AdaptivePolicy):
    """LRU first, then ARC; at each handover to ARC records ARC's live T1 target
    before and after it, and its miniature's, scaled to the live capacity."""

    experts = ("lru", "arc")

    def _choose(self) -> None:
        lead, live, mini = self.lead, self._live[1], self._shadows[1].policy
        before = live.target_t1
        super()._choose()
        if self.lead != lead and self.leader == "arc":
            self.handovers.append((before, live.target_t1,
                                   mini.target_t1 * live.capacity / mini.capacity))


@pytest.mark.parametrize("seed", [1, 3])
def test_arc_takes_the_lead_with_the_split_its_miniature_learned(seed: int) -> None:
    """While LRU led, the live ARC's ghost lists held LRU's victims, and their returns
    set its T1 target; its miniature adapted on its own victims. Chat (LRU's ground),
    then documents amid noise (ARC's): at the handover ARC's split is the miniature's,
    which here is far from the one LRU's victims had made."""
    rng = random.Random(seed)
    chat = _chat(3000, rng)
    docs = [[b"D" + k for k in r] for r in _docs_and_noise(3000, rng)]
    policy = _Handovers(1000)
    policy.handovers = []
    _replay(policy, chat + docs)
    assert policy.handovers and policy.leader == "arc"
    for _, after, learned in policy.handovers:
        assert after == pytest.approx(min(learned, 1000.0))
    # The scenario is what it claims: the split LRU's victims made was far off.
    assert max(abs(before - learned) for before, _, learned in policy.handovers) > 100


def test_arc_scales_its_miniatures_split_to_its_own_capacity() -> None:
    mini, live = ARCPolicy(100), ARCPolicy(800)
    mini.target_t1, live.target_t1 = 30.0, 700.0
    live.lead_from(mini)
    assert live.target_t1 == pytest.approx(240.0)
    mini.target_t1 = 100.0
    live.lead_from(mini)
    assert live.target_t1 == pytest.approx(800.0)
    live.lead_from(LRUPolicy(100))  # another class: nothing to learn from
    assert live.target_t1 == pytest.approx(800.0)
