"""Generate synthetic Mooncake-format traces of other workload shapes, reproducibly.

    .venv/bin/python scripts/make_trace.py SHAPE OUT.jsonl [--requests N] [--seed S]

``chat``: multi-turn conversations (Zipf-popular, each on one of a few shared system
prompts); a turn re-sends the whole history plus a new question, so a hit is the last
turn's prefix, and some conversations are resumed much later. ``sysprompt``: many
short one-shot requests behind a few Zipf-popular system prompts, with occasional
long documents that are asked about again later. ``docqa``: long documents, each asked
many questions over a while, popular ones again much later. ``agent``: agent loops
whose tool outputs grow the context step after step, several loops interleaved.
``bursty``: chat sessions that send a burst of turns, go idle for a long while, and
come back. ``convo``: conversations as in real chat logs (no shared prompt,
long answers, heavy-tailed waits between turns). ``paced``: conversations that come
back after long waits, each at its user's own pace (a next wait is like the last), many
of them a single turn: few references hit even an unlimited cache. ``longdocs``: a few
hundred requests on long documents (100-1,000 blocks), a third of them one-off ones:
few events to learn from, and a recency policy flushes the reused ones. ``repeat``:
half the requests re-send an earlier request verbatim (popular ones, or recent ones),
the rest are new, behind a few shared prompts. ``mix``: chat, sysprompt, docqa, agent,
bursty and convo interleaved in time, each in its own id space (as separate tenants
would be). Block ids are prefix hashes (equal ids = equal prefix), 512-token blocks,
as in the Mooncake release; ``timestamp`` is in ms. The policies are judged on traces
they were not tuned on; these are such shapes.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random


class _Chains:
    """Prefix-hash ids: a block's id names its content and everything before it."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def extend(self, prefix: list[int], contents: list[object]) -> list[int]:
        out = list(prefix)
        for c in contents:
            parent = out[-1] if out else -1
            out.append(self._ids.setdefault((parent, c), len(self._ids)))
        return out


def _zipf(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def chat(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    prompts = [ch.extend([], [("sys", p, i) for i in range(rng.randint(2, 8))])
               for p in range(8)]
    convs: list[list[int]] = []
    out = []
    for r in range(n):
        if not convs or rng.random() < 0.3:  # a new conversation
            convs.append(prompts[_zipf(rng, len(prompts), 1.0)])
            c = len(convs) - 1
        else:  # resume one: recent ones far more often, old ones now and then
            c = len(convs) - 1 - min(len(convs) - 1, int(rng.expovariate(1 / 20)))
        turn = ch.extend(convs[c], [("turn", r, i) for i in range(rng.randint(1, 6))])
        convs[c] = ch.extend(turn, [("answer", r)])  # the reply joins the history
        out.append(turn)
    return out


def sysprompt(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    prompts = [ch.extend([], [("sys", p, i) for i in range(rng.randint(4, 16))])
               for p in range(50)]
    docs: list[list[int]] = []
    out = []
    for r in range(n):
        head = prompts[_zipf(rng, len(prompts), 1.1)]
        if rng.random() < 0.15:  # a document: new, or one asked about before
            if docs and rng.random() < 0.6:
                head = docs[_zipf(rng, len(docs), 0.8) if rng.random() < 0.5
                            else rng.randrange(len(docs))]
            else:
                head = ch.extend(head, [("doc", r, i) for i in range(rng.randint(20, 120))])
                docs.insert(0, head)
        out.append(ch.extend(head, [("q", r, i) for i in range(rng.randint(1, 4))]))
    return out


def docqa(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    sys_ = ch.extend([], [("sys", i) for i in range(2)])
    docs: list[list[int]] = []
    active: list[int] = []  # documents being asked about now
    out = []
    for r in range(n):
        if not active or rng.random() < 0.12:
            if docs and rng.random() < 0.3:  # an old document comes back
                active.append(_zipf(rng, len(docs), 1.0))
            else:
                docs.insert(0, ch.extend(sys_, [("doc", r, i)
                                                 for i in range(rng.randint(16, 160))]))
                active = [a + 1 for a in active] + [0]
            del active[:-24]  # a couple of dozen documents at once
        d = docs[rng.choice(active)]
        out.append(ch.extend(d, [("q", r, i) for i in range(rng.randint(1, 3))]))
    return out


def agent(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    tools = ch.extend([], [("tools", i) for i in range(6)])  # shared system + tool specs
    loops: list[tuple[list[int], int]] = []  # context, steps left
    out = []
    for r in range(n):
        if len(loops) < 8 or (len(loops) < 48 and rng.random() < 0.15):
            loops.append((ch.extend(tools, [("task", r, i) for i in range(rng.randint(1, 4))]),
                          rng.randint(4, 40)))
        i = rng.randrange(len(loops))
        ctx, left = loops[i]
        out.append(ctx)
        # the model's step and a tool output that grows as the loop goes on
        grow = 1 + min(int(rng.expovariate(1 / 3)) + len(ctx) // 40, 24)
        ctx = ch.extend(ctx, [("step", r, j) for j in range(grow)])
        if left <= 1 or len(ctx) > 400:
            loops.pop(i)
        else:
            loops[i] = (ctx, left - 1)
    return out


def bursty(n: int, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Returns rows and their timestamps (ms): sessions idle for minutes to hours."""
    ch = _Chains()
    sys_ = ch.extend([], [("sys", i) for i in range(3)])
    sessions: list[list[int]] = []
    wake: list[float] = []  # when each session sends its next burst
    events: list[tuple[float, int]] = []
    out, stamps = [], []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(1 / 400.0)  # a new session every ~0.4 s
        sessions.append(sys_)
        wake.append(t)
        events = [(w, i) for i, w in enumerate(wake) if w <= t]
        for w, i in sorted(events):
            for _ in range(rng.randint(1, 6)):  # a burst of turns
                turn = ch.extend(sessions[i], [("t", len(out), j)
                                               for j in range(rng.randint(1, 4))])
                sessions[i] = ch.extend(turn, [("a", len(out))])
                out.append(turn)
                stamps.append(int(w))
                w += rng.uniform(2_000, 20_000)
            # idle: mostly minutes, sometimes an hour, sometimes never again
            wake[i] = (float("inf") if rng.random() < 0.3
                       else w + rng.expovariate(1 / (300_000 if rng.random() < 0.8
                                                     else 3_600_000)))
    order = sorted(range(len(out)), key=stamps.__getitem__)[:n]
    return [out[i] for i in order], [stamps[i] for i in order]


def convo(n: int, rng: random.Random) -> list[list[int]]:
    """Multi-turn conversations as in real chat logs: no shared system prompt, long
    answers join the history, a few openings paste a document, and the wait before the
    next turn is heavy-tailed (most reply at once, some come back hours later)."""
    ch = _Chains()
    convs: list[list[int]] = []
    due: list[tuple[int, int]] = []  # (request number of the next turn, conversation)
    out = []
    for r in range(n):
        if due and due[0][0] <= r:
            _, c = due.pop(0)
        else:
            first = rng.randint(1, 3) if rng.random() < 0.85 else rng.randint(8, 60)
            convs.append(ch.extend([], [("open", r, i) for i in range(first)]))
            c = len(convs) - 1
        turn = ch.extend(convs[c], [("q", r, i) for i in range(rng.randint(1, 2))])
        convs[c] = ch.extend(turn, [("a", r, i) for i in range(rng.randint(1, 4))])
        out.append(turn)
        if rng.random() < 0.75:  # another turn, after a Pareto-distributed wait
            at = r + 1 + int(rng.paretovariate(0.7) * 5)
            due.append((at, c))
            due.sort()
    return out


def paced(n: int, rng: random.Random) -> list[list[int]]:
    """Conversations whose users each keep their own pace: the wait before a next turn
    is the user's typical wait (log-normal over users, from seconds to hours: a median
    of ~150 requests, often thousands) times a small jitter, so a conversation that
    came back quickly tends to again. Most open with a short prompt, some paste a
    document; 45 % stop after any turn. Reuse distances are mostly longer than a small
    cache, so recency alone finds little, while an unlimited cache hits about half."""
    ch = _Chains()
    convs: list[list[int]] = []
    pace: list[float] = []
    due: list[tuple[int, int]] = []  # heap of (request number of the next turn, conv)
    out = []
    for r in range(n):
        if due and due[0][0] <= r:
            _, c = heapq.heappop(due)
        else:
            first = rng.randint(2, 12) if rng.random() < 0.7 else rng.randint(12, 80)
            convs.append(ch.extend([], [("open", r, i) for i in range(first)]))
            pace.append(rng.lognormvariate(5.0, 1.2))
            c = len(convs) - 1
        turn = ch.extend(convs[c], [("q", r, i) for i in range(rng.randint(1, 6))])
        convs[c] = ch.extend(turn, [("a", r, i) for i in range(rng.randint(0, 2))])
        out.append(turn)
        if rng.random() < 0.55:
            heapq.heappush(due, (r + 1 + int(pace[c] * rng.lognormvariate(0, 0.5)), c))
    return out


def mix(n: int, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Each shape's own requests (``n`` in all, shared out), interleaved by each shape's
    own clock scaled to one span (ties in shape order), ids kept apart per shape."""
    parts = [chat, sysprompt, docqa, agent, bursty, convo]  # not paced: mix stays as it was
    rows: list[tuple[float, list[int]]] = []
    base = 0
    for k, shape in enumerate(parts):
        got = shape(n // len(parts) + (k < n % len(parts)), random.Random(rng.random()))
        ids, stamps = got if isinstance(got, tuple) else (got, None)
        span = max(stamps) if stamps else len(ids)
        top = 0
        for j, r in enumerate(ids):
            at = (stamps[j] if stamps else j) / max(span, 1)
            rows.append((at + 1e-9 * k, [base + h for h in r]))
            top = max(top, max(r, default=0))
        base += top + 1
    rows.sort(key=lambda x: x[0])
    return [r for _, r in rows], [int(a * 100 * n) for a, _ in rows]


def longdocs(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    docs = [ch.extend([], [("doc", d, i) for i in range(rng.randint(100, 1000))])
            for d in range(20)]
    out = []
    for r in range(n):
        if rng.random() < 0.33:  # a one-off document
            doc = ch.extend([], [("once", r, i) for i in range(rng.randint(100, 1000))])
        else:
            doc = docs[_zipf(rng, len(docs), 1.0)]
        out.append(ch.extend(doc, [("q", r, i) for i in range(rng.randint(1, 4))]))
    return out


def repeat(n: int, rng: random.Random) -> list[list[int]]:
    ch = _Chains()
    prompts = [ch.extend([], [("sys", p, i) for i in range(rng.randint(2, 12))])
               for p in range(10)]
    popular = list(itertools.accumulate(1.0 / (i + 1) ** 1.1 for i in range(5000)))  # Zipf
    pool: list[list[int]] = []
    out = []
    for r in range(n):
        if pool and rng.random() < 0.5:  # verbatim again: a popular one or a recent one
            if rng.random() < 0.5:  # the oldest are the most popular
                k = min(len(pool), len(popular))
                req = pool[bisect.bisect_left(popular, rng.random() * popular[k - 1], 0, k - 1)]
            else:
                req = pool[-1 - min(len(pool) - 1, int(rng.expovariate(1 / 200)))]
        else:
            size = max(1, min(400, round(rng.lognormvariate(math.log(15), 1.0))))
            req = ch.extend(prompts[_zipf(rng, len(prompts), 1.0)],
                            [("r", r, i) for i in range(size)])
            pool.append(req)
        out.append(req)
    return out


SHAPES = {"chat": chat, "convo": convo, "sysprompt": sysprompt, "docqa": docqa, "agent": agent,
          "bursty": bursty, "paced": paced, "longdocs": longdocs, "repeat": repeat,
          "mix": mix}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: at least 1")
    got = SHAPES[args.shape](args.requests, random.Random(args.seed))
    rows, stamps = got if isinstance(got, tuple) else (got, [i * 100 for i in range(len(got))])
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            for ids, at in zip(rows, stamps):
                f.write(json.dumps({"timestamp": at, "input_length": 512 * len(ids),
                                    "output_length": 64, "hash_ids": ids}) + "\n")
    except OSError as e:
        ap.exit(2, f"make_trace.py: cannot write {args.out}: {e.strerror or e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
