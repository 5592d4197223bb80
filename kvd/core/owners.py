"""Blocks counted per owner (a client), for its quotas."""

from __future__ import annotations


class OwnerCounts(dict[int, int]):
    """owner -> blocks; an owner leaves the map at zero, so it holds only owners with
    blocks (``not counts``: nobody has any)."""

    def add(self, owner: int, delta: int) -> None:
        n = self.get(owner, 0) + delta
        if n:
            self[owner] = n
        else:
            self.pop(owner, None)
