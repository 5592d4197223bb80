"""The disk tier's journal records, what a journal says is held, and the journal as the
tier keeps it.

The records share ``kvd/journal.py``'s framing: a header with the file's geometry, then
a Put per block written and synced, a Drop per slot given up. A Put or Drop of a slot
ends what that slot held before. ``JournalKeeper`` is the tier's side of the file: its
appends, under a lock of their own, and its compactions, which write a snapshot of the
index while reads go on and carry over the Drops appended meanwhile; at a start, it
reads back which blocks the journal names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from kvd.journal import Journal, read_records
from kvd.tiers.disk_files import sync_dir

log = logging.getLogger("kvd.tiers.disk")

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


class JournalKeeper:
    """The disk tier's journal: ``lock`` guards the journal and its appends."""

    def __init__(self, journal: Journal, geometry: DiskHeader, path: str, sync: bool) -> None:
        self.journal, self.geometry, self.path, self.sync = journal, geometry, path, sync
        self.lock = threading.Lock()
        self.backlog: list[Any] | None = None  # appended while a snapshot is written
        self.records = 0  # records in the journal file

    def replay(self, reused: bool) -> tuple[dict[int, DiskPut], str]:
        """The blocks the journal names (``replay``'s), or none and why: with ``reused``
        False, the data file is not the one the journal describes."""
        skipped: list[int] = []
        live, why = replay(self.journal.path, self.geometry, skipped)
        if sum(skipped):  # a kill's torn tail, or damage: the blocks named after it are lost
            log.warning("disk tier %s: the last %d bytes of its journal are not intact "
                        "records and are ignored", self.path, sum(skipped))
        if live and not reused:
            why = "the data file is missing or was resized"
        if why:
            log.warning("disk tier %s: starting empty: %s", self.path, why)
            live = {}
        return live, why

    def append(self, records: Sequence[Any]) -> None:
        """Journal ``records`` (never under the tier's ``_lock``: the write may stall)."""
        if records:
            with self.lock:
                self.journal.append(records)
                self.records += len(records)
                if self.backlog is not None:
                    self.backlog.extend(records)

    def compact(self, lock: threading.Lock, held: dict[bytes, DiskPut]) -> None:
        """Rewrite the journal as the live Puts (``held``, the tier's index, in recency
        order, read under its ``lock``). The snapshot is written without ``lock``, so
        reads go on; a Drop they append is carried over."""
        with self.lock:  # first: a Drop of a block missing from the snapshot is kept
            self.backlog = []
        with lock:
            snap: list[Any] = [self.geometry, *held.values()]
        try:
            self.journal.write_snapshot(snap)
        except BaseException:
            with self.lock:
                self.backlog = None
            raise
        with self.lock:
            backlog, self.backlog = self.backlog or [], None
            self.journal.swap_snapshot(backlog)
            self.records = len(snap) + len(backlog)
        if self.sync:
            sync_dir(self.path)
