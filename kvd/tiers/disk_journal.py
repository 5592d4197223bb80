"""The disk tier's journal records, and what a journal says is held.

The records share ``kvd/journal.py``'s framing: a header with the file's geometry, then
a Put per block written and synced, a Drop per slot given up. A Put or Drop of a slot
ends what that slot held before.
"""

from __future__ import annotations

import msgspec

from kvd.journal import read_records

VERSION = 1


class DiskHeader(msgspec.Struct, array_like=True, frozen=True, tag="H"):
    """The geometry the journal's slots refer to; another one makes them meaningless."""

    size: int
    extent_size: int
    min_slot_bytes: int
    version: int = VERSION


class DiskPut(msgspec.Struct, array_like=True, frozen=True, tag="P"):
    """A block written and synced; also the index's entry for it."""

    ns: bytes
    key: bytes
    slot: int
    slot_bytes: int
    length: int
    checksum: int
    depth: int


class DiskDrop(msgspec.Struct, array_like=True, frozen=True, tag="D"):
    slot: int


_DECODER = msgspec.msgpack.Decoder(DiskHeader | DiskPut | DiskDrop)


def replay(path: str, geometry: DiskHeader,
           skipped: list[int] | None = None) -> tuple[dict[int, DiskPut], str]:
    """The live blocks the journal at ``path`` names (slot -> block, in journal order),
    or why it cannot be used under ``geometry``. ``skipped`` gets the bytes after the
    last intact record (a torn tail, or damage), as ``read_records`` says them."""
    records = read_records(path, _DECODER, skipped=skipped)
    first = next(records, None)
    if first is None:
        return {}, ""
    if first != geometry:
        return {}, (f"the geometry changed ({first} -> {geometry})"
                    if isinstance(first, DiskHeader) else "the journal has no header")
    live: dict[int, DiskPut] = {}
    for rec in records:
        if isinstance(rec, DiskPut | DiskDrop):
            live.pop(rec.slot, None)  # a Put or Drop of a slot ends what it held
            if isinstance(rec, DiskPut):
                live[rec.slot] = rec
        elif rec != geometry:
            break  # a second geometry: nothing after it can be trusted
    return live, ""
