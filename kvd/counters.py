"""The daemon's request and transfer counters, as the status document reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd_proto import messages as m


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    failed_transfers: int = 0
    expired_transfers: int = 0
    unclaimed_blocks: int = 0  # slots of stores not every rank made, given back (tickets)
    corrupt_blocks: int = 0
    lookups: int = 0  # Lookups answered (a BUSY refusal is an error, not a lookup)
    lookup_keys: int = 0  # blocks they asked for, hit or not
    stalled_lookups: int = 0  # answered as misses while copies were overdue
    quota_cut_keys: int = 0  # keys of Allocates past the pending-store quota: no slot
    lookup_tokens: int = 0  # blocks asked for x the tenant's block_tokens
    hit_tokens: int = 0
    by_code: dict[str, int] = field(default_factory=dict)  # errors by Code name

    def error(self, code: m.Code) -> None:
        self.errors += 1
        name = m.Code(code).name
        self.by_code[name] = self.by_code.get(name, 0) + 1
