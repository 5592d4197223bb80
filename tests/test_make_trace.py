"""The generated trace shapes (scripts/make_trace.py) the policy tables are measured on:
what a shape claims must hold, or the tables judge the policies on something else."""

from __future__ import annotations

import json
import random
import statistics
import sys
from itertools import pairwise
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from make_trace import SHAPES, main

from kvd.sim import load_trace, make_trace, replay


def apart(a: int, b: int) -> float:
    return max(a, b) / min(a, b)  # waits are >= 1


def _rows(shape: str, n: int, seed: int) -> list[list[int]]:
    got = SHAPES[shape](n, random.Random(seed))
    return got[0] if isinstance(got, tuple) else got


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_ids_are_prefix_hashes(shape: str) -> None:
    """Equal ids are equal prefixes: each id always follows the same id. Then an
    unlimited cache hits every reference but the first of each id, as the prefix rule
    would not allow if an id could follow different prefixes."""
    rows = _rows(shape, 600, 7)
    parent: dict[int, int] = {}
    for r in rows:
        for before, h in pairwise([-1, *r]):
            assert parent.setdefault(h, before) == before, f"id {h} follows two prefixes"
    refs = sum(map(len, rows))
    distinct = len({h for r in rows for h in r})
    unlimited = replay(make_trace(rows), distinct + 1, "lru")
    assert unlimited.hit_blocks == refs - distinct


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_seed_gives_the_same_trace(shape: str) -> None:
    assert _rows(shape, 300, 3) == _rows(shape, 300, 3)
    assert _rows(shape, 300, 3) != _rows(shape, 300, 4)


def test_paced_conversations_keep_their_pace() -> None:
    """A conversation's waits between turns are alike (a user's own pace), and they
    spread over orders of magnitude across conversations."""
    rows = _rows("paced", 6000, 1)
    seen: dict[int, list[int]] = {}  # a conversation is named by its first block
    for i, r in enumerate(rows):
        seen.setdefault(r[0], []).append(i)
    waits = [[b - a for a, b in pairwise(t)] for t in seen.values() if len(t) >= 3]
    assert len(waits) > 100
    # How far apart two waits are, as a factor: two of one conversation, or the first
    # waits of two conversations.
    same = statistics.median(apart(w[0], w[1]) for w in waits)
    other = statistics.median(apart(a[0], b[0]) for a, b in pairwise(waits))
    assert same * 1.5 < other
    firsts = sorted(w[0] for w in waits)
    assert firsts[len(firsts) * 9 // 10] > 10 * firsts[len(firsts) // 10]


def test_written_file_is_a_mooncake_trace(tmp_path: Path) -> None:
    out = tmp_path / "paced.jsonl"
    assert main(["paced", str(out), "--requests", "200", "--seed", "2"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 200
    assert all(x["input_length"] == 512 * len(x["hash_ids"]) for x in lines)
    assert load_trace(str(out)).block_refs == sum(len(x["hash_ids"]) for x in lines)


def test_repeat_resends_about_half_of_its_requests_verbatim() -> None:
    rows = _rows("repeat", 4000, 1)
    seen: set[tuple[int, ...]] = set()
    again = 0
    for r in rows:
        again += tuple(r) in seen
        seen.add(tuple(r))
    assert 0.4 < again / len(rows) < 0.6


def test_longdocs_are_long_and_a_third_are_asked_about_once() -> None:
    rows = _rows("longdocs", 600, 1)
    assert min(map(len, rows)) > 100
    firsts: dict[int, int] = {}
    for r in rows:  # a document is named by its first block
        firsts[r[0]] = firsts.get(r[0], 0) + 1
    once = sum(1 for n in firsts.values() if n == 1)
    assert 0.25 < once / len(rows) < 0.4
    assert len(firsts) - once <= 20  # the reused ones: a small, fixed set


@pytest.mark.parametrize("n", [1, 5, 100, 6001])
def test_mix_writes_the_requests_asked_for(n: int) -> None:
    rows, stamps = SHAPES["mix"](n, random.Random(3))
    assert len(rows) == len(stamps) == n  # (n // 6 of each shape: 96 of 100, none of 5)


@pytest.mark.parametrize("argv, why", [
    (["chat", "{dir}/t.jsonl", "--requests", "0"], "at least 1"),
    (["chat", "{dir}/missing/t.jsonl", "--requests", "5"], "cannot write"),
    (["chat", "{dir}", "--requests", "5"], "cannot write"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, argv, why) -> None:
    with pytest.raises(SystemExit) as e:
        main([a.format(dir=tmp_path) for a in argv])
    assert e.value.code == 2 and why in capsys.readouterr().err
