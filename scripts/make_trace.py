"""Generate synthetic Mooncake-format traces of other workload shapes, reproducibly.

    .venv/bin/python scripts/make_trace.py {chat,sysprompt} OUT.jsonl [--requests N] [--seed S]

``chat``: multi-turn conversations (Zipf-popular, each on one of a few shared system
prompts); a turn re-sends the whole history plus a new question, so a hit is the last
turn's prefix, and some conversations are resumed much later. ``sysprompt``: many
short one-shot requests behind a few Zipf-popular system prompts, with occasional
long documents that are asked about again later. Block ids are prefix hashes (equal
ids = equal prefix), 512-token blocks, as in the Mooncake release. The policies are
judged on traces they were not tuned on; these are two such shapes.
"""

from __future__ import annotations

import argparse
import json
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


SHAPES = {"chat": chat, "sysprompt": sysprompt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rows = SHAPES[args.shape](args.requests, random.Random(args.seed))
    with open(args.out, "w", encoding="utf-8") as f:
        for i, ids in enumerate(rows):
            f.write(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids),
                                "output_length": 64, "hash_ids": ids}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
