"""The probation policy learns which classes of stored runs are reused."""

from __future__ import annotations

from kvd.core.policies.probation import ProbationPolicy, class_of


def test_a_class_never_reused_enters_on_probation_and_goes_first():
    p = ProbationPolicy(capacity=10_000)
    # Requests without a cached prefix store 8-block runs that come back (touched);
    # requests behind a cached prefix store 4-block tails that never do.
    for i in range(200):
        hot = [("hot", i, j) for j in range(8)]
        p.insert_many(hot, depth=0, length=8)
        p.touch(hot, depth=0)
        p.insert_many([("tail", i, j) for j in range(4)], depth=4, length=8)
    assert p.cold(class_of(4, 8)) and not p.cold(class_of(0, 8))
    p.insert_many([("new-hot", j) for j in range(8)], depth=0, length=8)
    p.insert_many([("new-tail", j) for j in range(4)], depth=4, length=8)
    first = [k for k, _ in zip(p.victims(), range(4))]
    # The old tails were inserted on probation too: they and the new tail go before any
    # hot block, however recent the tails are.
    assert all(k[0] in ("tail", "new-tail") for k in first)
    hot_rank = next(i for i, k in enumerate(p.victims()) if k[0] in ("hot", "new-hot"))
    assert hot_rank >= 4 * 200 - 4 * 10  # (a few early tails went in before learning)


def test_a_hit_promotes_out_of_probation_and_an_eviction_is_remembered():
    p = ProbationPolicy(capacity=100)
    for i in range(50):
        p.insert_many([("t", i)], depth=3, length=4)
    p.insert_many([("x", 0), ("x", 1)], depth=3, length=4)
    p.touch([("x", 0)], depth=3)  # reused: leaves probation for the main order
    victims = list(p.victims())
    assert victims[-1] == ("x", 0) and len(victims) == len(p) == 52
    p.evicted_many([("x", 1)])
    before = p.rate(class_of(3, 4))
    p.insert_many([("x", 1)], depth=3, length=4)  # stored again after its eviction
    assert p.rate(class_of(3, 4)) > before
