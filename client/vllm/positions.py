"""Where a request's keys sit in it: what a Lookup and an Allocate tell the daemon.

A Lookup names the depth of its first key (its block's index in the request); an
Allocate also names the request's length, the key before its first one (the parent the
KV events give it) and whether its keys are consecutive blocks. All of it comes from
the end token of each key that vLLM's scheduler records in the request's
``ReqContext``. Apart from the manager because it is arithmetic on that record only,
with no state of the manager's.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import ReqContext


@dataclass(frozen=True, slots=True)
class _LastStored:
    """A request's last stored key and its end token (ReqContext state)."""

    key: bytes
    end: int | None


class Positions:
    """Reads a request's recorded key positions, in blocks of ``tokens_per_key``."""

    def __init__(self, tokens_per_key: int) -> None:
        self.tokens_per_key = tokens_per_key

    def depth(self, ctx: ReqContext, key: bytes) -> int:
        pos = ctx.get_offload_key_position(key)  # end token of the key's block
        return max(0, pos // self.tokens_per_key - 1) if pos else 0

    def chain(self, ctx: ReqContext, keys: list[bytes], depth: int) -> tuple[bytes, bool]:
        """For the KV events: the request's key before ``keys[0]`` (b"" at the chain's
        start or when unknown), as vLLM's own events name it, and whether ``keys`` are
        consecutive blocks (vLLM skips some in a sliding-window group). From the end
        positions vLLM's scheduler recorded; the previous store's last key is tried
        first, so a prompt stored in parts does not search the request each time."""
        positions = getattr(ctx, "_offload_key_positions", None)
        if not isinstance(positions, dict):
            return b"", len(keys) == 1
        step = self.tokens_per_key
        ends = [positions.get(k) for k in keys]
        chained = None not in ends and all(b - a == step for a, b in zip(ends, ends[1:]))
        last = None
        if hasattr(ctx, "set_state"):
            last = ctx.get_state(_LastStored)
            ctx.set_state(_LastStored(keys[-1], ends[-1]))
        start = ends[0]
        if depth == 0 or start is None:
            return b"", chained
        if last is not None and last.end == start - step and last.key in positions:
            return last.key, chained
        order = list(positions)
        try:
            i = order.index(keys[0])
        except ValueError:
            return b"", chained
        if i and positions[order[i - 1]] == start - step:
            return order[i - 1], chained
        return b"", chained

    def length(self, ctx: ReqContext) -> int:
        """Blocks of the request so far (0: unknown). vLLM's scheduler records the end
        token of every key of the request in order, not only of those stored this step:
        a prompt stored in parts (chunked prefill) names its whole length in each part.
        The last recorded is the furthest (O(1); the daemon never takes less than the
        part's own end)."""
        positions = getattr(ctx, "_offload_key_positions", None)
        if not isinstance(positions, dict) or not positions:
            return 0
        return int(next(reversed(positions.values()))) // self.tokens_per_key
