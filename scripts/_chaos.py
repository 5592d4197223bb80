"""Building blocks of the chaos runs (scripts/chaos_*.py and tests/daemon/test_chaos.py).

Block contents are a pure function of the block's key, so any process can tell a
correct block from a corrupt one without shared state.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time

import numpy as np
import xxhash

from kvd_client import Connection, KvdClientError, host_regions
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32

PAGE = 16384
FP = m.Fingerprint(model="chaos", dtype="bf16", kv_dtype="bf16", block_tokens=16, tp_size=1,
                   rank_page_bytes=[PAGE], hash_algo="sha256", root_hash=b"chaos")


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little")) + (0).to_bytes(4, "big")


def content(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


class Waiter:
    """Collects Done events pushed to a connection."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.done: dict[int, m.Done] = {}

    def __call__(self, d: m.Done) -> None:
        with self.cv:
            self.done[d.event] = d
            self.cv.notify_all()

    def wait(self, event: int, timeout: float) -> m.Done | None:
        with self.cv:
            self.cv.wait_for(lambda: event in self.done, timeout)
            return self.done.pop(event, None)


class Client:
    """One process's scheduler + worker connections over private KV memory."""

    def __init__(self, socket: str, blocks: int = 256, timeout: float = 2.0) -> None:
        self.mem = np.zeros((blocks, PAGE), dtype=np.uint8)
        self.waiter = Waiter()
        self.sched = Connection(socket, name="chaos-sched", timeout=timeout,
                                register=m.Register(0, FP, -1))
        self.worker = Connection(socket, name="chaos-worker", timeout=timeout,
                                 on_done=self.waiter,
                                 register=m.Register(0, FP, 0, host_regions([self.mem])))
        self.event = 0

    def up(self, timeout: float) -> bool:
        return self.sched.wait_up(timeout) and self.worker.wait_up(timeout)

    def store(self, ids: list[int], timeout: float = 20) -> list[int]:
        """Store blocks ``ids``; returns the ids now committed (Done OK)."""
        for j, i in enumerate(ids):
            self.mem[j] = content(i)
        r = self.sched.request(m.Allocate(self.sched.next_req(), [key_of(i) for i in ids]))
        slots = unpack_u32(r.slots)
        new = [j for j in range(r.allocated) if slots[j] != NO_SLOT]
        if not new:
            return []
        self.event += 1
        ok = self.worker.send(m.Transfer(self.worker.next_req(), self.event,
                                         m.Direction.STORE, pack_u32(new),
                                         pack_u32(slots[new])))
        d = self.waiter.wait(self.event, timeout) if ok else None
        return [ids[j] for j in new] if d is not None and d.code == m.Code.OK else []

    def verify(self, ids: list[int], timeout: float = 20) -> tuple[int, int]:
        """Load blocks ``ids``; returns (hits, corrupt) — corrupt must always be 0."""
        hit = self.sched.request(m.Lookup(self.sched.next_req(), [key_of(i) for i in ids]))
        if not hit.hits:
            return 0, 0
        self.mem[:hit.hits] = 0
        self.event += 1
        self.worker.send(m.Transfer(self.worker.next_req(), self.event, m.Direction.LOAD,
                                    pack_u32(range(hit.hits)), hit.slots))
        d = self.waiter.wait(self.event, timeout)
        self.sched.request(m.Release(self.sched.next_req(), hit.lease))
        if d is None or d.code != m.Code.OK:
            return 0, 0  # nothing was loaded: nothing to be wrong
        corrupt = sum(1 for j, i in enumerate(ids[:hit.hits])
                      if not np.array_equal(self.mem[j], content(i)))
        return hit.hits, corrupt

    def verify_each(self, ids: list[int], timeout: float = 20) -> tuple[int, int]:
        """Like ``verify`` for ids that are not one prefix chain: a Lookup per id,
        then one load per memory-full of hits. Returns (hits, corrupt)."""
        hits = corrupt = 0
        rows = len(self.mem)
        for lo in range(0, len(ids), rows):
            part = ids[lo:lo + rows]
            found, slots, leases = [], [], []
            for i in part:
                r = self.sched.request(m.Lookup(self.sched.next_req(), [key_of(i)]))
                if r.hits:
                    found.append(i)
                    slots.append(int(unpack_u32(r.slots)[0]))
                    leases.append(r.lease)
            if not found:
                continue
            self.mem[:len(found)] = 0
            self.event += 1
            self.worker.send(m.Transfer(self.worker.next_req(), self.event,
                                        m.Direction.LOAD, pack_u32(range(len(found))),
                                        pack_u32(slots)))
            d = self.waiter.wait(self.event, timeout)
            for lease in leases:
                self.sched.request(m.Release(self.sched.next_req(), lease))
            if d is None or d.code != m.Code.OK:
                continue
            hits += len(found)
            corrupt += sum(1 for j, i in enumerate(found)
                           if not np.array_equal(self.mem[j], content(i)))
        return hits, corrupt

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


# ---------------------------------------------------------------- kill a client


def _doomed_client(socket: str, ready) -> None:
    """Lease, allocate and start a large store, then say so and wait to be killed."""
    c = Client(socket, blocks=1024)
    c.up(10)
    c.sched.request(m.Lookup(c.sched.next_req(), [key_of(i) for i in range(64)]))
    base = int.from_bytes(os.urandom(4), "little") << 20
    ids = list(range(base, base + 1024))
    r = c.sched.request(m.Allocate(c.sched.next_req(), [key_of(i) for i in ids]))
    slots = unpack_u32(r.slots)[:r.allocated]
    c.worker.send(m.Transfer(c.worker.next_req(), 1, m.Direction.STORE,
                             pack_u32(range(len(slots))), pack_u32(slots)))
    ready.set()
    time.sleep(60)


def kill_clients(socket: str, rounds: int, status) -> list[dict]:
    """Kill -9 a client mid-transfer ``rounds`` times; returns leaks seen after each."""
    ctx = mp.get_context("spawn")
    out = []
    for _ in range(rounds):
        ready = ctx.Event()
        p = ctx.Process(target=_doomed_client, args=(socket, ready), daemon=True)
        p.start()
        ready.wait(60)
        p.kill()
        p.join(10)
        t0 = time.monotonic()
        while True:
            st = status()
            b = st["blocks"]
            leaked = b["pending"] + b["pinned"] + b["leases"]
            if leaked == 0 or time.monotonic() - t0 > 5:
                break
            time.sleep(0.05)
        out.append({"released_s": time.monotonic() - t0, "pending": b["pending"],
                    "pinned": b["pinned"], "leases": b["leases"],
                    "used_bytes": st["pool"]["used_bytes"],
                    "ready_bytes": sum(t["bytes"] for t in st["tenants"])})
    return out


# ---------------------------------------------------------------- kill the daemon


def _writer(socket: str, start: int, committed: mp.Queue, stop, rate: float,
            hold=None) -> None:
    """Store new blocks in batches of 32 (at most ``rate`` blocks/s, so the pool never
    has to evict) until told to stop, standing still while ``hold`` is set (the checks
    run then: their time must not fill the pool); report each committed batch."""
    c = Client(socket, timeout=1.0)
    i = start
    t0 = time.monotonic()
    while not stop.is_set():
        if hold is not None and hold.is_set():
            time.sleep(0.01)
            start, t0 = i, time.monotonic()  # the rate counts from the end of the hold
            continue
        if (i - start) > rate * (time.monotonic() - t0):
            time.sleep(0.01)
            continue
        if not c.sched.up:
            c.sched.wait_up(0.2)
            continue
        ids = list(range(i, i + 32))
        i += 32
        try:
            done = c.store(ids, timeout=5)
        except KvdClientError:
            continue
        if done:
            committed.put(done)
    c.close()


def drain(q: mp.Queue) -> list[list[int]]:
    out: list[list[int]] = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def kill_daemon(d, rounds: int, writers: int = 2, min_s: float = 0.3, max_s: float = 1.5,
                seed: int = 0, rate: float = 1000.0) -> list[dict]:
    """Kill -9 a persistent daemon ``rounds`` times while writers store real blocks;
    after each restart every block reported committed must be back and intact."""
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(seed)
    committed_q: mp.Queue = ctx.Queue()
    stop, hold = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_writer,
                         args=(d.socket, (w + 1) << 32, committed_q, stop, rate, hold),
                         daemon=True) for w in range(writers)]
    for p in procs:
        p.start()
    committed: list[list[int]] = []
    out = []
    try:
        for _ in range(rounds):
            time.sleep(float(rng.uniform(min_s, max_s)))
            d.kill()
            time.sleep(0.2)  # Dones already on their way are counted
            committed += drain(committed_q)
            t0 = time.monotonic()
            hold.set()  # writers stand still while the restored blocks are checked
            d.start()
            restart_s = time.monotonic() - t0
            st = d.status()
            v = Client(d.socket, blocks=64)
            v.up(10)
            hits = corrupt = 0
            for batch in committed:  # each batch is one prefix chain
                h, c = v.verify(batch)
                hits, corrupt = hits + h, corrupt + c
            v.close()
            hold.clear()
            total = sum(len(b) for b in committed)
            out.append({"committed": total, "restored": hits, "missing": total - hits,
                        "corrupt_loaded": corrupt, "restart_s": restart_s,
                        "ready_after_restart": st["blocks"]["ready"],
                        "evicted": st["counters"]["evicted_blocks"]})
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out
