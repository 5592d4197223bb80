"""The index journal: what a restarted daemon needs to serve the pool it left behind.

An append-only file of framed records: ``u32 length | u64 xxh3 | msgpack payload``. A
torn tail (the daemon was killed mid-write) fails its checksum and ends the replay;
everything before it stands. Records:

- Header: the pool geometry; a journal for another geometry is ignored.
- TenantRec: tenant ids are stable across restarts.
- Commit: a block became READY (key, slot, depth, one xxh3 per TP rank's share).
- Drop: a READY block left the pool (evicted, flushed, failed verification).

Ordering is what makes kill -9 safe: a Drop is written before the Allocate reply that
hands the slot out again, and a Commit only after every rank's bytes are in the pool
(a MAP_SHARED file, so they survive the process). Writes are plain ``os.write`` calls:
page cache survives a killed process; ``fsync`` is for the compacted snapshot only.

The framing and ``Journal`` take any msgspec Struct: the disk tier (kvd/tiers/disk.py)
keeps its own journal of its own record types, read with ``read_records(path, decoder)``.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar, overload

import msgspec
import xxhash

_FRAME = struct.Struct("<IQ")
MAX_RECORD = 1 << 20
SNAPSHOT_CHUNK = 65536  # records framed and written at a time by write_snapshot


class Header(msgspec.Struct, array_like=True, tag="h"):
    pool_size: int
    extent_size: int
    min_slot_bytes: int
    version: int = 1


class TenantRec(msgspec.Struct, array_like=True, tag="t"):
    id: int
    digest: str
    model: str
    tp_size: int
    rank_page_bytes: list[int]
    block_tokens: int = 0  # added later (0: unknown until an engine registers)


class Commit(msgspec.Struct, array_like=True, tag="c"):
    tenant: int
    key: bytes
    slot: int
    depth: int
    checksums: list[int]
    parent: bytes = b""  # the key before it in its chain (b"": unknown); added later


class Drop(msgspec.Struct, array_like=True, tag="d"):
    slot: int


Record = Header | TenantRec | Commit | Drop
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Record)
T = TypeVar("T")


def frame(rec: msgspec.Struct) -> bytes:
    """One framed record; any msgspec Struct (other journals bring their own types)."""
    payload = _enc.encode(rec)
    return _FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


@overload
def read_records(path: str, *, skipped: list[int] | None = None) -> Iterator[Record]: ...
@overload
def read_records(path: str, decoder: msgspec.msgpack.Decoder[T], *,
                 skipped: list[int] | None = None) -> Iterator[T]: ...
def read_records(path: str, decoder: msgspec.msgpack.Decoder | None = None, *,
                 skipped: list[int] | None = None) -> Iterator:
    """Every intact record, in order; stops at a torn or corrupt frame (and appends
    the bytes left unread from there to ``skipped``, when given).
    ``decoder`` reads another journal's record types (default: this module's)."""
    dec = _dec if decoder is None else decoder
    try:
        with open(_open_regular(path, os.O_RDONLY), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    pos = 0
    while pos + _FRAME.size <= len(data):
        length, check = _FRAME.unpack_from(data, pos)
        start = pos + _FRAME.size
        payload = data[start:start + length]
        if length > MAX_RECORD or len(payload) < length:
            break
        if xxhash.xxh3_64_intdigest(payload) != check:
            break
        try:
            rec = dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            break
        yield rec
        pos = start + length
    if skipped is not None and pos < len(data):
        skipped.append(len(data) - pos)


@dataclass
class LiveBlock:
    tenant: int
    key: bytes
    slot: int
    depth: int
    checksums: list[int]
    parent: bytes = b""


@dataclass
class Replay:
    header: Header | None
    tenants: dict[int, TenantRec]
    blocks: dict[int, LiveBlock]  # slot -> block, in commit order
    records: int
    skipped_bytes: int = 0  # after the last intact record (a torn tail, or corruption)


def replay(path: str) -> Replay:
    """Fold the journal into the live state it describes."""
    header: Header | None = None
    tenants: dict[int, TenantRec] = {}
    blocks: dict[int, LiveBlock] = {}
    n = 0
    skipped: list[int] = []
    for rec in read_records(path, skipped=skipped):
        n += 1
        if isinstance(rec, Commit):
            blocks.pop(rec.slot, None)  # re-insert: keeps commit order
            blocks[rec.slot] = LiveBlock(rec.tenant, rec.key, rec.slot, rec.depth,
                                         rec.checksums, rec.parent)
        elif isinstance(rec, Drop):
            blocks.pop(rec.slot, None)
        elif isinstance(rec, TenantRec):
            tenants[rec.id] = rec
        elif isinstance(rec, Header):
            if header is not None and rec != header:
                break  # a second geometry: nothing after it can be trusted
            header = rec
    return Replay(header, tenants, blocks, n, sum(skipped))


class Journal:
    """Appends records; ``rewrite`` replaces the file with a compact snapshot."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = _open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.records = 0
        self.bytes = os.fstat(self._fd).st_size

    def append(self, records: Sequence[msgspec.Struct]) -> None:
        if not records:
            return
        buf = b"".join([frame(r) for r in records])
        n = os.write(self._fd, buf)  # one write: a kill leaves at most one torn tail
        if n != len(buf):  # a full disk: no torn frame may sit between good ones
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - n)
            raise OSError(errno.ENOSPC, f"journal {self.path}: {n} of {len(buf)} bytes "
                                        "written")
        self.bytes += len(buf)
        self.records += len(records)

    def gone(self) -> bool:
        """Whether the file was removed under us (an operator, a clean-up job): appends
        then go to an inode no restart will read."""
        return os.fstat(self._fd).st_nlink == 0

    def rewrite(self, records: Iterable[msgspec.Struct]) -> None:
        """Atomically replace the journal with ``records``."""
        self.write_snapshot(records)
        self.swap_snapshot([])

    def write_snapshot(self, records: Iterable[msgspec.Struct]) -> None:
        """Write a snapshot beside the journal (any thread; the journal stays in use).
        On an error the snapshot is removed and the journal stays as it was. Framed
        and written ``SNAPSHOT_CHUNK`` records at a time, so that an iterator's records
        die young: a million alive at once set off full garbage collections, each
        holding every thread (the event loop) for up to half a second."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        size = 0
        try:
            it = iter(records)
            while chunk := list(islice(it, SNAPSHOT_CHUNK)):
                data = b"".join([frame(r) for r in chunk])
                _write_all(fd, data, tmp)
                size += len(data)
            os.fsync(fd)
        except BaseException:  # (an iterator's own error too: no snapshot left behind)
            _discard(tmp)
            raise
        finally:
            os.close(fd)
        self._snapshot_bytes = size

    def swap_snapshot(self, backlog: Sequence[msgspec.Struct]) -> None:
        """Append what was journaled since the snapshot, then make it the journal.
        On an error the snapshot is removed and the journal stays as it was."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        tail = b"".join([frame(r) for r in backlog])
        try:
            _write_all(fd, tail, tmp)
            os.rename(tmp, self.path)  # atomic: a kill sees the old or the new journal
        except OSError:
            os.close(fd)
            _discard(tmp)
            raise
        os.close(self._fd)
        self._fd = fd
        self.bytes = self._snapshot_bytes + len(tail)
        self.records = len(backlog)

    def sync(self) -> None:
        """Make what was appended survive a reboot (appends alone survive a kill)."""
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _open_regular(path: str, flags: int) -> int:
    """Open a journal that must be a regular file: a FIFO put in its place would hold
    the daemon's start (or its event loop) in ``open`` until a peer came."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno != errno.ENXIO:  # a FIFO without a reader, opened to write
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def _write_all(fd: int, data: bytes, path: str) -> None:
    """One write of all of ``data``; a short one (a full disk) is an error, not a cut."""
    if data and os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, f"{path}: short write (disk full?)")


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
