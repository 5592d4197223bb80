"""Sizes and counts a Lookup, Allocate, Release or Abort may name, checked before the
index sees them (a Register's are in ``kvd.registration``). No engine comes near them:
they bound what one message costs the loop, and a key is kept for its block's life.
"""

from __future__ import annotations

from kvd.errors import BadIds, RequestError

MAX_KEY = 1024  # bytes of one block key (vLLM's are 36)
MAX_DEPTH = (1 << 32) - 1  # a block's position in its request, as tier headers keep it


def check_keys(keys: list[bytes], depth: int, length: int, max_keys: int) -> None:
    if not (0 <= depth and depth + len(keys) <= MAX_DEPTH and 0 <= length <= MAX_DEPTH):
        raise RequestError(f"depth {depth} / length {length} with {len(keys)} keys: "
                           f"positions must lie in 0..{MAX_DEPTH}")
    if len(keys) > max_keys:
        raise RequestError(f"{len(keys)} keys in one request; at most {max_keys}")
    if keys and max(map(len, keys)) > MAX_KEY:
        raise RequestError(f"a key is longer than {MAX_KEY} bytes")


def check_ids(packed: bytes, max_keys: int) -> None:
    """Slot ids a request names are capped as a Transfer's are (4 M ids were 0.2 s of
    the loop's time)."""
    if len(packed) > 4 * max_keys:
        raise BadIds(f"{len(packed) // 4} slot ids in one request; at most {max_keys}")
