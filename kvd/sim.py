"""Trace replay through the daemon's own Index and eviction policies.

Each request of a Mooncake-format trace is replayed as the daemon sees it: look up the
leading run of its blocks (those are the hits), then allocate and store the rest. The
same ``Index``, ``Allocator`` and policy classes as the daemon run here, so a figure
from the simulator is a figure about the shipped code. ``belady`` is the offline
optimum for reference: it evicts the block whose next reference is farthest away.
"""

from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import math
import os
import stat
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import IO

import numpy as np

from kvd.core.allocator import Allocator
from kvd.core.index import NO_SLOT, Index
from kvd.core.policies.base import EvictionPolicy, Key, make_policy
from kvd.core.policies.heap import KeyHeap
from kvd.core.tenants import Tenants

SLOT_BYTES = 4096  # the simulator moves no bytes; one minimal slot per block
EXTENT_SLOTS = 256  # at most, per extent: many, as in the daemon (64 MiB extents)
BELADY = "belady"
MAX_LINE = 64 << 20  # characters in one trace line (a request of millions of blocks)
NEVER = 1 << 62


class TraceError(ValueError):
    """The trace cannot be replayed (empty, not JSON lines, no ``hash_ids``); the
    message names the file and the line."""


@dataclass(frozen=True)
class Trace:
    """Requests as lists of 8-byte keys, plus their flat hash ids for Belady and their
    timestamps (ms; the request's position when the trace has none)."""

    requests: list[list[bytes]]
    hash_ids: list[list[int]]
    timestamps: list[float] = field(default_factory=list)

    @property
    def block_refs(self) -> int:
        return sum(map(len, self.requests))

    @cached_property
    def distinct_blocks(self) -> int:
        """A pool this large never evicts: a larger one gives the same replay."""
        return max(1, len({h for r in self.hash_ids for h in r}))

    def split(self) -> int:
        """The first request of the second half by time: warm up on what comes before
        it (and tune on it), report on what comes after."""
        ts = self.timestamps or list(range(len(self.requests)))
        if not ts:
            return 0
        mid = ts[0] / 2 + ts[-1] / 2  # (their sum may overflow a float)
        return next((i for i, t in enumerate(ts) if t >= mid and i > 0), len(ts))


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    requests: int
    block_refs: int
    hit_blocks: int
    hit_fraction: float
    evicted_blocks: int
    seconds: float
    stored_blocks: int = 0  # write traffic: blocks copied into the cache
    counted_from: int = 0  # requests before this one warmed the cache, uncounted

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def make_trace(hash_ids: Sequence[Sequence[int]],
               timestamps: Sequence[float] | None = None) -> Trace:
    ids = [list(map(int, r)) for r in hash_ids]
    return Trace([[h.to_bytes(8, "little") for h in r] for r in ids], ids,
                 list(timestamps) if timestamps is not None else [])


def _open_bytes(path: str) -> IO[bytes]:
    """The trace's bytes, decompressed: a file (gzip-compressed or not) or, for ``-``,
    standard input."""
    raw: IO[bytes]
    if path == "-":  # whole: a pipe's first read may be one byte, too few to tell gzip by
        data = sys.stdin.buffer.read()
        raw, head = io.BytesIO(data), data[:2]
    else:
        file = open(path, "rb")  # noqa: SIM115 - closed by the caller's ``with``
        raw, head = file, file.peek(2)[:2]
    if head == b"\x1f\x8b":
        raw = gzip.GzipFile(fileobj=raw)  # type: ignore[assignment]
    return raw


def _open(path: str) -> IO[str]:
    """The trace as text (a UTF-8 BOM allowed)."""
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig")


def _stamp(t: object) -> float:
    """A line's timestamp; NaN when it is none that requests can be ordered by (not a
    number, or not a finite one: 1e309 and Infinity included). An integer stays one:
    as a float, stamps in nanoseconds (above 2**53) would collapse and lose their order."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return math.nan
    try:
        stamp = float(t)
    except OverflowError:
        return math.nan
    if not math.isfinite(stamp):
        return math.nan
    return t  # (an int orders exactly, and among floats as its value)


def _first_bad_utf8_line(path: str) -> int:
    """The line of a file's first byte that is not UTF-8 (0: unknown, e.g. stdin): the
    text reader decodes ahead of the line it hands out, so its own count is early."""
    if path == "-":  # (read already)
        return 0
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO's writer is gone: read once
            return 0
        with _open_bytes(path) as raw:
            decoder = codecs.getincrementaldecoder("utf-8")()
            for n, line in enumerate(raw, 1):
                try:
                    decoder.decode(line)
                except UnicodeDecodeError:
                    return n
    except (OSError, EOFError, zlib.error):
        return 0
    return 0


def load_trace(path: str) -> Trace:
    """Read one JSON object per line, keeping each request's ``hash_ids`` (and its
    ``timestamp`` when every line has one; requests are then replayed in time order).
    TraceError names the first bad line."""
    ids: list[list[int]] = []
    stamps: list[float] = []
    n = 0
    try:
        with _open(path) as f:
            for n, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), ""), 1):
                if len(line) > MAX_LINE and not line.endswith("\n"):  # /dev/zero, say
                    raise TraceError(f"{path}:{n}: a line of over {MAX_LINE >> 20} Mi "
                                     "characters: not a Mooncake trace")
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise TypeError("a line is one JSON object")
                    hashes = row["hash_ids"]
                    if not isinstance(hashes, list) or not all(
                            isinstance(h, int) and not isinstance(h, bool)
                            and 0 <= h < 1 << 64 for h in hashes):
                        raise TypeError("hash_ids must be a list of integers in [0, 2**64)")
                except (ValueError, KeyError, TypeError, RecursionError) as e:
                    what = ("no hash_ids" if isinstance(e, KeyError) else
                            "nested too deeply" if isinstance(e, RecursionError) else
                            str(e).splitlines()[0])
                    raise TraceError(f"{path}:{n}: not a Mooncake trace line ({what})") \
                        from None
                ids.append(hashes)
                stamps.append(_stamp(row.get("timestamp")))
    except MemoryError:
        raise TraceError(f"{path}: the trace does not fit in memory ({n} lines read)") \
            from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
        why = (f"not UTF-8 text (line {_first_bad_utf8_line(path) or f'near {n + 1}'})"
               if isinstance(e, UnicodeDecodeError) else
               f"not gzip data ({e})" if isinstance(e, zlib.error) else
               getattr(e, "strerror", None) or str(e) or type(e).__name__)
        raise TraceError(f"{path}: cannot read the trace: {why}") from None
    if not ids:
        raise TraceError(f"{path}: the trace is empty (no request lines)")
    if not any(ids):
        raise TraceError(f"{path}: the trace names no block (every hash_ids is empty)")
    if any(math.isnan(t) for t in stamps):  # a line without a numeric timestamp: file order
        return make_trace(ids)
    if any(a > b for a, b in itertools.pairwise(stamps)):  # arrival order (a stable sort)
        order = sorted(range(len(ids)), key=stamps.__getitem__)
        ids, stamps = [ids[i] for i in order], [stamps[i] for i in order]
    return make_trace(ids, stamps)


class BeladyPolicy(EvictionPolicy):
    """Offline optimum: evict the block referenced again farthest in the future.

    Needs the future, so it lives here and not in the daemon's registry. The
    simulator calls ``begin(offset)`` before each request; a key at ``depth`` of that
    request is reference number ``offset + depth`` of the flattened trace.
    """

    name = BELADY

    def __init__(self, capacity: int, next_use: Sequence[int]) -> None:
        super().__init__(capacity)
        self._next_use = next_use
        self._offset = 0
        self._heap = KeyHeap()  # priority: minus the next use, farthest first

    def begin(self, offset: int) -> None:
        self._offset = offset

    def insert(self, key: Key, depth: int = 0, length: int = 0) -> None:
        self._heap.push(key, -self._next_use[self._offset + depth])

    def touch(self, keys: Sequence[Key], depth: int = 0) -> None:
        base, push, nxt = self._offset + depth, self._heap.push, self._next_use
        for i, key in enumerate(keys):
            push(key, -nxt[base + i])

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def victims(self) -> Iterator[Key]:
        return self._heap.ordered()

    def __len__(self) -> int:
        return len(self._heap)


def next_uses(trace: Trace) -> list[int]:
    """For each reference of the flattened trace, the position of the next one in a
    later request: an id repeated within a request has one slot, inserted at its first
    place, and its repeat there is no future use (Belady kept such a block for ever)."""
    nxt = [NEVER] * trace.block_refs
    later: dict[int, int] = {}  # id -> its first position in the requests after this one
    pos = len(nxt)
    for r in reversed(trace.hash_ids):
        pos -= len(r)
        for i, h in enumerate(r):
            nxt[pos + i] = later.get(h, NEVER)
        for i in range(len(r) - 1, -1, -1):
            later[r[i]] = pos + i
    return nxt


def replay(trace: Trace, capacity: int, policy: str, eager: bool = False,
           count_from: int = 0,
           progress: Callable[[int, int], None] | None = None,
           chunk: int = 0) -> SimResult:
    """Replay ``trace`` through a fresh Index of ``capacity`` blocks. ``eager`` tells
    the policy about each lookup's hits at once (the index defers them; a test checks
    that this changes nothing). Requests before ``count_from`` only warm the cache:
    the figures count the rest. ``progress(done, total)`` is called now and then.
    ``chunk``: store each request's missed blocks in parts of that many blocks, as
    vLLM's chunked prefill does (each part one Allocate naming the request's length)."""
    tenants = Tenants()
    tenant = tenants.get_or_create("sim", model="sim", tp_size=1, rank_page_bytes=(SLOT_BYTES,))
    pol: EvictionPolicy
    if policy == BELADY:
        pol = BeladyPolicy(capacity, next_uses(trace))
        begin = pol.begin
    else:
        pol = make_policy(policy, capacity)
        begin = None
    index = Index(_allocator(min(capacity, trace.distinct_blocks)), pol)
    lookup, allocate, store_done = index.lookup, index.allocate, index.store_done
    # The index defers telling the policy about hits to its next mutating call, which
    # changes no decision (the calls reach the policy in the same order), but Belady
    # reads the simulator's cursor, so it must hear them while ``begin`` still points
    # at the request that made them: a full hit makes no mutating call.
    flush = index.flush if begin is not None or eager else None
    offset = 0
    total = len(trace.requests)
    base = (0, 0, 0, 0)  # refs, hits, stores, evictions before count_from
    every = max(1, total // 200) if progress is not None else total + 1
    c = index.counters
    t0 = time.perf_counter()
    for n, keys in enumerate(trace.requests):
        if n == count_from and n:
            base = (offset, c.hit_blocks, c.stored_blocks, c.evicted_blocks)
        if n % every == 0 and progress is not None:
            progress(n, total)
        if begin is not None:
            begin(offset)
        offset += len(keys)
        hits = lookup(tenant, keys)[0]
        if flush is not None:
            flush()
        if hits == len(keys):
            continue
        step = chunk or len(keys)
        for lo in range(hits, len(keys), step):
            slots = allocate(tenant, keys[lo:lo + step], depth=lo, length=len(keys)).slots
            if NO_SLOT in slots:
                slots = [s for s in slots if s != NO_SLOT]
            if slots:
                store_done(np.array(slots, dtype=np.int64), 0)
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress(total, total)
    if count_from >= total and total:
        base = (offset, c.hit_blocks, c.stored_blocks, c.evicted_blocks)
    refs = offset - base[0]
    hit = c.hit_blocks - base[1]
    return SimResult(
        policy=policy,
        capacity=capacity,
        requests=total - min(count_from, total),
        block_refs=refs,
        hit_blocks=hit,
        hit_fraction=round(hit / refs, 6) if refs else 0.0,
        evicted_blocks=c.evicted_blocks - base[3],
        seconds=round(seconds, 4),
        stored_blocks=c.stored_blocks - base[2],
        counted_from=min(count_from, total),
    )


def _allocator(slots: int) -> Allocator:
    """A pool of exactly ``slots`` free slots: whole extents, and the extra slots of
    the last one taken for good. With one size class the geometry changes no
    decision, only the speed."""
    per = min(EXTENT_SLOTS, slots)
    extents = -(-slots // per)
    alloc = Allocator(extents * per * SLOT_BYTES, per * SLOT_BYTES, SLOT_BYTES)
    surplus = extents * per - slots
    if surplus:
        assert len(alloc.alloc_many(SLOT_BYTES, surplus)) == surplus
    return alloc


def sweep(trace: Trace, capacities: Sequence[int], policies: Sequence[str]) -> list[SimResult]:
    return [replay(trace, c, p) for p in policies for c in capacities]
