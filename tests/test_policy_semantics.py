"""scripts/policy_semantics.py: the textbook policies it sets beside kvd's classes."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from make_trace import SHAPES
from policy_semantics import (
    KvdOneAtATime,
    TextbookARC,
    TextbookLRU,
    TextbookS3FIFO,
    one_at_a_time,
)

from kvd.sim import make_trace


def _trace():
    rows = SHAPES["mix"](600, random.Random(3))
    return make_trace(rows[0] if isinstance(rows, tuple) else rows)


def test_textbook_and_kvd_lru_agree_and_arc_keeps_its_bounds() -> None:
    trace = _trace()
    lru = one_at_a_time(trace, TextbookLRU(300))
    assert 0 < lru < 1
    assert one_at_a_time(trace, KvdOneAtATime("lru", 300)) == lru
    arc = TextbookARC(300)
    one_at_a_time(trace, arc)
    assert len(arc.t1) + len(arc.t2) <= 300
    assert len(arc.t1) + len(arc.b1) <= 300
    assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 600


def test_textbook_s3fifo_keeps_its_queues_and_promotes_by_its_rule() -> None:
    trace = _trace()
    for after in (1, 2):
        s3 = TextbookS3FIFO(300, after)
        assert 0 < one_at_a_time(trace, s3) < 1
        assert len(s3.freq) <= 300 and set(s3.freq) == set(s3.small) | set(s3.main)
        assert len(s3.ghost) <= s3.ghost_cap and not set(s3.ghost) & set(s3.freq)
    s3 = TextbookS3FIFO(4, 2)
    for k in (b"a", b"b", b"c", b"d"):  # first fill: the small FIFO takes none past 1
        s3.miss(k)
    s3.hit(b"a")
    s3.hit(b"a")
    s3.miss(b"e")  # evicts: the small FIFO's a, reused twice, is promoted instead
    assert b"a" in s3.main and len(s3.freq) == 4


def test_admission_bound_models_kvds_lru_and_its_oracles_order() -> None:
    from admission_bound import classes, lru_admit

    from kvd.sim import NEVER, next_uses, replay

    trace = _trace()
    nxt = next_uses(trace)
    cap = 300
    plain = lru_admit(trace, cap, lambda i: True)
    # admitting everything is kvd's own lru under the prefix protocol, hit for hit
    assert round(plain, 6) == replay(trace, cap, "lru").hit_fraction
    # declining exactly the blocks never referenced again loses no hit and frees room
    assert lru_admit(trace, cap, lambda i: nxt[i] != NEVER) >= plain
    # declining the blocks that are referenced again loses them all
    assert lru_admit(trace, cap, lambda i: nxt[i] == NEVER) < plain
    cls = classes(trace)
    assert len(cls) == trace.block_refs
    assert {c[1] for c in cls} <= set(range(5))
