"""Throw malformed and hostile messages at a real daemon; it must answer every one.

Kinds: random bytes, truncated frames, extra frames, wrong protocol versions, bad
fingerprints, valid structs with wrong ids, another tenant's slots, huge arrays. The
fuzzing client is registered (so deep validation runs); a legitimate tenant stores
blocks first and must still load them intact at the end. The daemon's RSS is sampled
to show memory does not grow without bound.

    python scripts/fuzz_daemon.py --count 100000 [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import DaemonProc, emit, rss_bytes  # noqa: E402
from _chaos import Client  # noqa: E402

from kvd_proto import messages as m  # noqa: E402
from kvd_proto.ids import pack_u32, unpack_u32  # noqa: E402

FP_B = m.Fingerprint("fuzz", "bf16", "bf16", 16, 1, [4096], "sha256", b"fuzz")


class Fuzzer:
    def __init__(self, socket: str, seed: int, foreign_slots: list[int]) -> None:
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        self.endpoint = f"ipc://{socket}"
        self.sock = self.ctx.socket(zmq.DEALER)
        self.mem = np.zeros((64, 4096), dtype=np.uint8)
        self.foreign = foreign_slots
        self.req = 1
        self.kinds: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.unanswered = 0
        self.lost: list[tuple[str, bytes]] = []

    def ask(self, frames: list[bytes], timeout_ms: int = 5000) -> m.Reply | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(timeout_ms):
            self.unanswered += 1
            return None
        data = self.sock.recv()
        try:
            return m.decode_reply(data)
        except Exception:  # noqa: BLE001 - an undecodable reply is a failure too
            self.replies["undecodable"] += 1
            return None

    def register(self) -> None:
        """A new session on a new connection (a second Hello on one is refused)."""
        self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        r1 = self.ask([m.encode(m.Hello(self.next(), m.PROTOCOL_VERSION, 0, "fuzz"))])
        region = m.HostRegion(self.mem.ctypes.data, 64, 4096, 4096)
        r2 = self.ask([m.encode(m.Register(self.next(), FP_B, 0, [region]))])
        assert isinstance(r1, m.HelloOk) and isinstance(r2, m.Registered), (r1, r2)

    def next(self) -> int:
        self.req += 1
        return self.req

    def ids(self, n: int, hi: int) -> bytes:
        return pack_u32([self.rng.randrange(hi) for _ in range(n)])

    def message(self) -> tuple[str, list[bytes]]:
        rng, req = self.rng, self.next()
        kind = rng.choice(["bytes", "truncated", "frames", "version", "fingerprint",
                           "transfer", "foreign", "lookup", "release", "abort", "huge",
                           "allocate", "torn_ids"])
        if kind == "bytes":
            return kind, [rng.randbytes(rng.randrange(0, 200))]
        if kind == "truncated":
            full = m.encode(m.Lookup(req, [rng.randbytes(36) for _ in range(4)]))
            return kind, [full[:rng.randrange(0, len(full))]]
        if kind == "frames":
            return kind, [m.encode(m.Ping(req)), rng.randbytes(8)]
        if kind == "version":
            return kind, [m.encode(m.Hello(req, rng.choice([0, 2, 99, 2**31]), 0, "v"))]
        if kind == "fingerprint":
            bad = m.Fingerprint("x", "", "", rng.randrange(-5, 5), rng.randrange(-2, 100),
                                [rng.randrange(-9, 10**12)], "h", b"")
            return kind, [m.encode(m.Register(req, bad, rng.randrange(-3, 3)))]
        if kind == "transfer":
            n = rng.randrange(0, 50)
            return kind, [m.encode(m.Transfer(req, req, rng.choice([0, 1]),
                                              self.ids(n, 2**32), self.ids(n, 2**32)))]
        if kind == "foreign":
            slots = pack_u32(self.foreign[:8])
            return kind, [m.encode(m.Transfer(req, req, m.Direction.LOAD,
                                              pack_u32(range(len(self.foreign[:8]))), slots))]
        if kind == "lookup":
            return kind, [m.encode(m.Lookup(req, [rng.randbytes(rng.randrange(0, 64))
                                                  for _ in range(rng.randrange(0, 20))],
                                            rng.randrange(-10, 10**9)))]
        if kind == "release":
            return kind, [m.encode(m.Release(req, rng.randrange(0, 2**62)))]
        if kind == "abort":
            return kind, [m.encode(m.Abort(req, self.ids(rng.randrange(0, 20), 2**20)))]
        if kind == "allocate":
            keys = [rng.randbytes(36) for _ in range(rng.randrange(0, 8))]
            return kind, [m.encode(m.Allocate(req, keys, rng.randrange(-5, 5),
                                              rng.randrange(-10, 10**7),
                                              parent=rng.randbytes(rng.choice((0, 3, 36, 2000))),
                                              chained=rng.random() < 0.5))]
        if kind == "torn_ids":
            return kind, [m.encode(m.Transfer(req, req, 1, b"\x01\x02\x03", b"\x04"))]
        # huge: too many keys, or a million ids
        if rng.random() < 0.5:
            return kind, [m.encode(m.Lookup(req, [b"k"] * 70_000))]
        return kind, [m.encode(m.Transfer(req, req, 0, self.ids(1, 10) * 1_000_000,
                                          self.ids(1, 10) * 1_000_000))]

    def run(self, count: int) -> None:
        self.register()
        for _ in range(count):
            kind, frames = self.message()
            self.kinds[kind] += 1
            before = self.unanswered
            reply = self.ask(frames)
            if self.unanswered > before:
                self.lost.append((kind, frames[0][:40]))
            if reply is not None:
                self.replies[type(reply).__name__] += 1
            if kind in ("version", "fingerprint") or (
                    isinstance(reply, m.Error) and reply.code == m.Code.NOT_REGISTERED):
                self.register()  # keep the deep checks reachable

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def fuzz(socket: str, pid: int, count: int, seed: int) -> dict:
    legit = Client(socket, blocks=64)
    assert legit.up(10)
    ids = list(range(1000, 1032))
    stored = legit.store(ids)
    assert stored == ids, "legitimate store failed"
    hit = legit.sched.request(m.Lookup(legit.sched.next_req(),
                                       [__import__("_chaos").key_of(i) for i in ids], 0))
    foreign = unpack_u32(hit.slots).tolist()
    f = Fuzzer(socket, seed, foreign)
    f.run(min(count, 2000))
    rss0 = rss_bytes(pid)
    t0 = time.monotonic()
    f.run(max(0, count - 2000))
    seconds = time.monotonic() - t0
    rss1 = rss_bytes(pid)
    f.close()
    if f.lost:
        print("unanswered:", f.lost[:10], file=sys.stderr)
    hits, corrupt = legit.verify(ids)
    legit.close()
    return {"messages": sum(f.kinds.values()), "unanswered": f.unanswered,
            "replies": dict(f.replies), "kinds": dict(f.kinds),
            "rss_after_warmup_mb": round(rss0 / 2**20, 1),
            "rss_end_mb": round(rss1 / 2**20, 1),
            "rss_growth_mb": round((rss1 - rss0) / 2**20, 1),
            "msgs_per_s": round(max(0, count - 2000) / seconds) if seconds else 0,
            "legit_blocks_intact": hits == len(ids) and corrupt == 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    d = DaemonProc("--pool-size", "256M", "--extent-size", "16M", "--log-level", "error")
    try:
        d.start()
        res = fuzz(d.socket, d.pid, args.count, args.seed)
        res["daemon_alive"] = d.proc is not None and d.proc.poll() is None
    finally:
        d.cleanup()
    rows = [{"kind": k, "count": v} for k, v in sorted(res.pop("kinds").items())]
    emit(rows, [("kind", "kind", "s"), ("count", "sent", "d")], args.json, res)
    ok = res["unanswered"] == 0 and res["daemon_alive"] and res["legit_blocks_intact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
