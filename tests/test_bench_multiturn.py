"""The multi-turn benchmark's workload generator and router (scripts/multiturn.py): what
the benchmark sends must be what it says, whatever the timings."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from multiturn import RoundRobin, Shape, arrivals, conversations  # noqa: E402


def test_each_turn_resends_the_whole_history_then_a_new_message():
    shape = Shape(conversations=3, turns=3, system_tokens=50, user_tokens=20, seed=4)
    convs = conversations(shape)
    system = convs[0].history
    assert len(system) == 50 and all(c.history == system for c in convs)  # shared
    c = convs[1]
    first = c.prompt()
    assert first[:50] == system and first[50:] == c.user[0]
    c.answered([7, 8, 9])
    second = c.prompt()
    assert second[:len(first)] == first  # the history is resent as it was
    assert second[len(first):len(first) + 3] == [7, 8, 9]  # with the model's answer
    assert second[len(first) + 3:] == c.user[1] and c.user[1] != c.user[0]
    c.answered([1])
    c.answered([2])
    assert c.done and c.turn == 3


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    a = conversations(Shape(conversations=4, turns=2, seed=1))
    b = conversations(Shape(conversations=4, turns=2, seed=1))
    c = conversations(Shape(conversations=4, turns=2, seed=2))
    assert [x.user for x in a] == [x.user for x in b] and a[0].history == b[0].history
    assert [x.user for x in a] != [x.user for x in c]
    lengths = [len(u) for x in a for u in x.user]
    assert all(210 <= n <= 390 for n in lengths)  # 300 tokens +-30 %


def test_round_robin_alternates_between_engines():
    r = RoundRobin(2)
    assert [r.pick() for _ in range(5)] == [0, 1, 0, 1, 0]
    one = RoundRobin(1)
    assert [one.pick() for _ in range(3)] == [0, 0, 0]


def test_open_loop_arrivals_are_ordered_and_keep_the_rate():
    ts = arrivals(2000, rate=4.0, seed=3)
    assert ts[0] == 0.0 and all(a <= b for a, b in zip(ts, ts[1:]))
    assert 3.6 < len(ts) / ts[-1] < 4.4
    assert arrivals(10, 4.0, seed=3) == ts[:10]


def test_ratios_cover_the_groups_whose_configurations_ran():
    """``--configs`` may run a few configurations: their ratios are still reported."""
    from bench_multiturn import ratios  # noqa: PLC0415 - imports the e2e harness

    def config(tokens: float, ttft_after: float = 0.0) -> dict:
        return {"tokens_per_s": tokens, "requests_per_s": tokens / 1000,
                "ttft_p50_ms": 1e6 / tokens, "ttft_mean_ms": 2e6 / tokens,
                "ttft_p50_after_restart_ms": ttft_after}

    by = {"restart-off": config(2000, 1600), "restart-kvd": config(3000, 800),
          "single-off": config(2500)}
    assert ratios(by) == {"restart": {"throughput_ratio": 1.5,
                                      "ttft_p50_after_restart_ratio": 0.5}}
    by["single-kvd"] = config(5000)
    assert ratios(by)["single"] == {"throughput_ratio": 2.0, "request_rate_ratio": 2.0,
                                    "ttft_p50_ratio": 0.5, "ttft_mean_ratio": 0.5}
    assert set(ratios(by)) == {"restart", "single"}
