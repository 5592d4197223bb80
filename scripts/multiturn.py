"""The multi-turn workload of ``bench_multiturn.py``: conversations, arrivals, a router.

Pure and deterministic (no vLLM, no clock): the suite tests it, the benchmark drives
engines with it. A conversation is a shared system prompt and ``turns`` user messages;
each turn's prompt is the whole history so far (system prompt, every earlier user
message and every earlier answer of the model) plus the new message, as a chat client
sends it. Prompts are token ids, so the history a turn resends is exactly the tokens
the engine saw and produced (its prefix blocks hash the same).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    """The knobs of the workload (the benchmark's flags)."""

    conversations: int = 8
    turns: int = 4
    system_tokens: int = 1024  # shared by every conversation
    user_tokens: int = 300  # a new user message, +-30 %
    answer_tokens: int = 64  # generated per turn (ignore_eos: exactly this many)
    vocab: int = 2048
    seed: int = 0


@dataclass
class Conversation:
    """One conversation's messages; ``history`` grows as its turns are answered."""

    index: int
    user: list[list[int]]  # the user message of each turn
    history: list[int] = field(default_factory=list)
    turn: int = 0  # the next turn to send

    @property
    def done(self) -> bool:
        return self.turn >= len(self.user)

    def prompt(self) -> list[int]:
        """The next turn's prompt: the whole history, then the new user message."""
        return self.history + self.user[self.turn]

    def answered(self, answer: list[int]) -> None:
        """The model answered the current turn: it joins the history."""
        self.history = self.prompt() + list(answer)
        self.turn += 1


def conversations(shape: Shape) -> list[Conversation]:
    """The conversations of ``shape``, the same for the same seed."""
    rng = random.Random(shape.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    system = tokens(shape.system_tokens)
    out = []
    for c in range(shape.conversations):
        users = [tokens(max(1, round(shape.user_tokens * rng.uniform(0.7, 1.3))))
                 for _ in range(shape.turns)]
        out.append(Conversation(c, users, history=list(system)))
    return out


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Open loop: the start times (s) of ``n`` conversations, Poisson at ``rate``/s."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class RoundRobin:
    """Sends each request (each turn) to the next engine in turn: a conversation's next
    turn often lands on an engine that did not serve the previous one."""

    def __init__(self, engines: int) -> None:
        if engines < 1:
            raise ValueError("a router needs at least one engine")
        self.engines = engines
        self._next = 0

    def pick(self) -> int:
        i = self._next
        self._next = (i + 1) % self.engines
        return i
