"""A client process with private KV memory, driven by commands over a queue.

Each worker registers as one TP rank of a tenant, fills its memory from a seed (or
zeros), and runs stores/loads through the real daemon on request.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
from dataclasses import dataclass

import numpy as np


@dataclass
class Spec:
    socket: str
    model: str = "tiny"
    tp_size: int = 1
    rank: int = 0
    pages: tuple[int, ...] = (8192, 4096)
    num_blocks: int = 64
    seed: int | None = 1  # None: zeros


def fingerprint(spec: Spec):
    from kvd_proto import messages as m

    return m.Fingerprint(model=spec.model, dtype="bfloat16", kv_dtype="bfloat16",
                         block_tokens=16, tp_size=spec.tp_size,
                         rank_page_bytes=list(spec.pages), hash_algo="sha256",
                         root_hash=b"root")


def make_memory(spec: Spec) -> list[np.ndarray]:
    rng = np.random.default_rng(None if spec.seed is None else spec.seed * 1000 + spec.rank)
    out = []
    for page in spec.pages:
        if spec.seed is None:
            out.append(np.zeros((spec.num_blocks, page), dtype=np.uint8))
        else:
            out.append(rng.integers(0, 256, (spec.num_blocks, page), dtype=np.uint8))
    return out


def digest(mem: list[np.ndarray], blocks: list[int]) -> str:
    h = hashlib.sha256()
    for b in blocks:
        for t in mem:
            h.update(t[b].tobytes())
    return h.hexdigest()


def _main(spec: Spec, cmds: mp.Queue, results: mp.Queue) -> None:
    from kvd_client import Connection, host_regions
    from kvd_proto import messages as m
    from kvd_proto.ids import pack_u32

    mem = make_memory(spec)
    dones: dict[int, m.Done] = {}
    cv = threading.Condition()

    def on_done(d: m.Done) -> None:
        with cv:
            dones[d.event] = d
            cv.notify_all()

    reg = m.Register(0, fingerprint(spec), spec.rank, host_regions(mem))
    conn = Connection(spec.socket, name=f"worker-r{spec.rank}", on_done=on_done,
                      register=reg)
    results.put(("up", conn.wait_up(10)))
    while True:
        cmd = cmds.get()
        op = cmd[0]
        if op == "exit":
            conn.close()
            results.put(("bye",))
            return
        if op == "digest":
            results.put(("digest", digest(mem, cmd[1])))
        elif op == "raw":  # ("raw", MessageClass, fields): the reply or the error
            try:
                results.put(("reply", conn.request(cmd[1](req=conn.next_req(), **cmd[2]), 5)))
            except Exception as e:  # noqa: BLE001
                results.put(("error", e))
        elif op in ("store", "load", "send"):  # send: a store, without waiting for Done
            _, event, blocks, slots, ticket, *lease = cmd
            direction = m.Direction.LOAD if op == "load" else m.Direction.STORE
            sent = conn.send(m.Transfer(conn.next_req(), event, direction,
                                        pack_u32(blocks), pack_u32(slots), ticket=ticket,
                                        lease=lease[0] if lease else 0))
            if op == "send":
                results.put(("sent", sent))
                continue
            _wait_done(results, cv, dones, event, sent)
        elif op == "wait":
            _wait_done(results, cv, dones, cmd[1], True)


def _wait_done(results, cv, dones, event: int, sent: bool) -> None:
    with cv:
        ok = sent and cv.wait_for(lambda: event in dones, timeout=20)
    d = dones.get(event)
    results.put(("done", int(d.code) if ok and d else -1, d.message if d else "",
                 d.nbytes if d else 0))


class Worker:
    def __init__(self, spec: Spec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.cmds: mp.Queue = ctx.Queue()
        self.results: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=_main, args=(spec, self.cmds, self.results),
                                daemon=True)
        self.proc.start()
        tag, up = self.results.get(timeout=60)
        assert tag == "up" and up, "worker could not reach kvd"

    def call(self, *cmd, timeout: float = 30):
        self.cmds.put(cmd)
        return self.results.get(timeout=timeout)

    def store(self, event: int, blocks, slots, ticket: int = 0):
        return self.call("store", event, list(blocks), list(slots), ticket)

    def send_store(self, event: int, blocks, ticket: int) -> bool:
        """A store by ticket, sent without waiting; ``wait`` gets its Done."""
        return self.call("send", event, list(blocks), [], ticket)[1]

    def wait(self, event: int):
        return self.call("wait", event)

    def load(self, event: int, blocks, slots, lease: int = 0):
        return self.call("load", event, list(blocks), list(slots), 0, lease)

    def digest(self, blocks) -> str:
        return self.call("digest", list(blocks))[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:  # noqa: BLE001
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
