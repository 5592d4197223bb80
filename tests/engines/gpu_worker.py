"""A GPU worker process for the hardware tests: KV tensors from torch's caching
allocator, exported to a real daemon and driven the way ``kvd_client.vllm`` drives them.

vLLM's CUDA build does not run here, so this harness stands in for its worker: it
allocates the KV cache as vLLM's GPU model runner does (one ``int8`` buffer per layer,
viewed as ``(2, num_blocks, block_tokens, heads, head_dim)`` bf16: FlashAttention's
layout, K and V one tensor each; or the packed cross-layer layout, one buffer whose
block holds every layer), describes it with ``kvd_client.cuda.gpu_tensors``, and then
does what ``CudaPath`` and ``KvdWorker`` do: ``export_regions`` and an ``EventRing``
in the Register; per store an event recorded on the compute stream (torch's current
stream), or a stream synchronisation when the ring is used up; a ``Transfer`` naming
it; the ring entry freed on ``EventWaited`` or the ``Done``. With ``client_copy`` it
does what ``ClientCopyPath`` does instead (registers ``client_copy`` and copies with
``ClientCopier``). Allocations made before the KV cache, and layers of 1 MiB sharing
the caching allocator's 2 MiB segments (a packed buffer of a few MiB: a 20 MiB one), put
most tensors at a non-zero offset inside their allocation.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass

HEADS, HEAD_DIM = 2, 64  # bf16: one token is 256 bytes per K or V


@dataclass
class GpuSpec:
    socket: str
    layout: str = "layers"  # or "packed" (cross-layer: one buffer, every layer per block)
    layers: int = 3
    num_blocks: int = 64
    block_tokens: int = 32  # a K or V page of 8 KiB
    seed: int | None = 1  # None: zeros
    ring: int = 8
    model: str = "gpu-harness"
    client_copy: bool = False
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF for this process


def page_bytes(spec: GpuSpec) -> list[int]:
    """The fingerprint's pages: one per K or V of a layer, or one per packed block."""
    kv = spec.block_tokens * HEADS * HEAD_DIM * 2
    return [kv * 2 * spec.layers] if spec.layout == "packed" else [kv] * (2 * spec.layers)


def fingerprint(spec: GpuSpec):
    from kvd_proto import messages as m

    return m.Fingerprint(model=f"{spec.model}-{spec.layout}", dtype="bfloat16",
                         kv_dtype="bfloat16", block_tokens=spec.block_tokens, tp_size=1,
                         rank_page_bytes=page_bytes(spec), hash_algo="sha256",
                         root_hash=b"root")


class _Kv:
    """The KV tensors (kept alive here), their byte views and kvd's description."""

    def __init__(self, spec: GpuSpec) -> None:
        import torch
        from kvd_client.cuda import gpu_tensors

        shape = (spec.num_blocks, spec.block_tokens, HEADS, HEAD_DIM)
        per_block = spec.block_tokens * HEADS * HEAD_DIM * 2
        # Earlier allocations (small and large pools): the KV buffers land at offsets.
        self.keep = [torch.empty(n, dtype=torch.uint8, device="cuda")
                     for n in (1000, (2 << 20) + 512)]
        self.views = []  # uint8, block first: what a digest and a fill walk
        self.described = []
        if spec.layout == "packed":
            raw = torch.zeros(spec.num_blocks * 2 * spec.layers * per_block, dtype=torch.int8,
                              device="cuda")
            t = raw.view(torch.bfloat16).view(spec.num_blocks, spec.layers, 2, *shape[1:])
            self.keep.append(raw)
            self.views.append(t.view(spec.num_blocks, -1).view(torch.uint8))
            self.described += gpu_tensors(t, block_dim=0)
        else:
            for _ in range(spec.layers):
                raw = torch.zeros(2 * spec.num_blocks * per_block, dtype=torch.int8,
                                  device="cuda")
                t = raw.view(torch.bfloat16).view(2, *shape)
                self.keep.append(raw)
                self.views += [t[i].reshape(spec.num_blocks, -1).view(torch.uint8)
                               for i in range(2)]
                self.described += gpu_tensors(t, block_dim=1)
        # Load every kernel a store uses now: CUDA loads a kernel lazily at its first
        # launch, and that waits for the work already queued (a long _sleep).
        self.views[0][0].fill_(0)
        torch.cuda._sleep(1)
        if spec.seed is not None:
            g = torch.Generator(device="cuda").manual_seed(spec.seed)
            for v in self.views:
                v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda",
                                      generator=g))
        torch.cuda.synchronize()

    def digest(self, blocks: list[int]) -> str:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long, device="cuda")
        rows = torch.cat([v.index_select(0, idx) for v in self.views], dim=1)
        return hashlib.sha256(rows.cpu().numpy().tobytes()).hexdigest()

    def write(self, blocks: list[int], value: int) -> None:
        """Enqueue writes of ``value`` into the blocks on the current stream."""
        for b in blocks:
            for v in self.views:
                v[b].fill_(value)


def _main(spec: GpuSpec, cmds: mp.Queue, results: mp.Queue) -> None:
    if spec.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = spec.alloc_conf
    try:
        _serve(spec, cmds, results)
    except BaseException:  # noqa: BLE001 - the test shows it
        results.put(("crashed", traceback.format_exc()))


def _serve(spec: GpuSpec, cmds: mp.Queue, results: mp.Queue) -> None:
    import msgspec
    import numpy as np
    import torch
    from kvd_client import Connection
    from kvd_client.cuda import (
        ClientCopier,
        CudaExportRefused,
        EventRing,
        export_regions,
    )
    from kvd_client.cudart import load
    from kvd_proto import messages as m
    from kvd_proto.ids import pack_u32

    torch.cuda.init()
    api = load()
    kv = _Kv(spec)
    ring: EventRing | None = None
    info: dict = {}
    ranges = [api.address_range(t.ptr) for t in kv.described]
    info["offsets"] = [t.ptr - base for t, (base, _) in zip(kv.described, ranges)]
    info["allocations"] = len({base for base, _ in ranges})
    info["ipc_capable"] = [api.legacy_ipc_capable(t.ptr) for t in kv.described]
    if spec.client_copy:
        reg = m.Register(0, fingerprint(spec), 0, client_copy=True,
                         client_copy_reason="gpu harness")
        try:  # what ClientCopyPath falls back from: the export is refused
            export_regions(kv.described, api)
            info["refused"] = ""
        except CudaExportRefused as e:
            info["refused"] = e.reason
    else:
        regions = export_regions(kv.described, api)
        ring = EventRing(spec.ring, api)
        reg = m.Register(0, fingerprint(spec), 0, cuda_regions=regions,
                         cuda_event_handles=ring.handles)
    dones: dict[int, tuple[m.Done, float]] = {}
    cv = threading.Condition()
    pending_events: dict[int, int] = {}

    def on_done(d: m.Done) -> None:
        with cv:
            dones[d.event] = (d, time.monotonic())
            ev = pending_events.pop(d.event, -1)
            cv.notify_all()
        if ring is not None and ev >= 0:
            ring.waited(ev)

    def on_waited(w: m.EventWaited) -> None:
        if ring is not None:
            ring.waited(w.cuda_event)

    conn = Connection(spec.socket, name="gpu-worker", on_done=on_done,
                      on_event_waited=on_waited)
    results.put(("up", conn.wait_up(20), info))
    stream = api.stream_create() if spec.client_copy else 0
    copier: ClientCopier | None = None
    sent_at: dict[int, float] = {}
    while True:
        cmd = cmds.get()
        op = cmd[0]
        if op == "exit":
            if copier is not None:
                copier.close()
            if ring is not None:
                ring.close()
            conn.close()
            results.put(("bye",))
            return
        try:
            if op == "register":  # ("register", overrun_blocks)
                bad = reg
                if cmd[1]:
                    r0 = reg.cuda_regions[0]
                    bad = msgspec.structs.replace(reg, cuda_regions=[
                        msgspec.structs.replace(r0, num_blocks=r0.num_blocks + cmd[1]),
                        *reg.cuda_regions[1:]])
                try:
                    got = conn.register(bad, 20) if not cmd[1] else \
                        conn.request(msgspec.structs.replace(bad, req=conn.next_req()), 20)
                except Exception as e:  # noqa: BLE001 - the test reads it
                    results.put(("error", type(e).__name__, str(e)))
                    continue
                if spec.client_copy and conn.registered is not None and copier is None:
                    copier = ClientCopier(conn.registered, 0, kv.described, stream, api)
                results.put(("registered", got))
            elif op == "digest":
                results.put(("digest", kv.digest(cmd[1])))
            elif op == "fill":  # ("fill", blocks, value): synchronously
                kv.write(cmd[1], cmd[2])
                torch.cuda.synchronize()
                results.put(("filled",))
            elif op in ("store", "load"):
                # ("store", event, blocks, slots, sleep_s, value, wait, lease)
                _, event, blocks, slots, sleep_s, value, wait, lease = cmd
                load_ = op == "load"
                cuda_event = -1
                if load_ and copier is not None:  # ClientCopyPath.before_send
                    copier.wait(copier.start(m.Direction.LOAD, np.array(blocks),
                                             np.array(slots)))
                elif not load_ and copier is not None:
                    torch.cuda.synchronize()
                    copier.wait(copier.start(m.Direction.STORE, np.array(blocks),
                                             np.array(slots)))
                else:
                    if sleep_s:  # a long "forward pass" whose end writes the blocks
                        torch.cuda._sleep(int(sleep_s * _cycles_per_second()))
                    if value is not None:
                        kv.write(blocks, value)
                    # CudaPath.order_event, for stores and loads alike: record on the
                    # compute stream, else synchronise it.
                    s = torch.cuda.current_stream()
                    idx = ring.record_next(int(s.cuda_stream))  # type: ignore[union-attr]
                    if idx is None:
                        s.synchronize()
                        idx = -1
                    cuda_event = idx
                with cv:
                    pending_events[event] = cuda_event
                sent_at[event] = time.monotonic()
                sent = conn.send(m.Transfer(conn.next_req(), event,
                                            m.Direction.LOAD if load_ else m.Direction.STORE,
                                            pack_u32(blocks), pack_u32(slots), cuda_event,
                                            lease=lease))
                if not wait:
                    results.put(("sent", sent, cuda_event))
                    continue
                results.put(_wait(cv, dones, event, sent, sent_at))
            elif op == "wait":
                results.put(_wait(cv, dones, cmd[1], True, sent_at))
            elif op == "ring":
                results.put(("ring", ring.in_use() if ring else 0,
                             ring.exhausted if ring else 0))
            elif op == "cuda_ok":  # no sticky error in this process's context
                torch.cuda.synchronize()
                results.put(("cuda_ok", int(torch.ones(4, device="cuda").sum().item())))
            else:
                results.put(("error", "BadCommand", op))
        except Exception:  # noqa: BLE001 - the test shows it
            results.put(("error", "Exception", traceback.format_exc()))


_CYCLES: list[float] = []


def _cycles_per_second() -> float:
    """The GPU clock for torch.cuda._sleep, measured once (a spin of known cycles)."""
    import torch

    if not _CYCLES:
        torch.cuda._sleep(400_000_000)  # the clock rises under load: measure after it
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(200_000_000)
        torch.cuda.synchronize()
        _CYCLES.append(200_000_000 / (time.perf_counter() - t0))
    return _CYCLES[0]


def _wait(cv, dones, event: int, sent: bool, sent_at: dict) -> tuple:
    with cv:
        ok = sent and cv.wait_for(lambda: event in dones, timeout=30)
    if not ok:
        return ("done", -1, "no Done", 0, 0.0)
    d, at = dones[event]
    return ("done", int(d.code), d.message, d.nbytes, at - sent_at[event])


class GpuWorker:
    def __init__(self, spec: GpuSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.cmds: mp.Queue = ctx.Queue()
        self.results: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=_main, args=(spec, self.cmds, self.results),
                                daemon=True)
        self.proc.start()
        try:
            got = self.results.get(timeout=120)
            assert got[0] == "up" and got[1], f"GPU worker did not come up: {got}"
        except BaseException:
            self.proc.kill()
            self.proc.join(5)
            raise
        self.info = got[2]

    def call(self, *cmd, timeout: float = 60):
        self.cmds.put(cmd)
        got = self.results.get(timeout=timeout)
        assert got[0] != "crashed", got[1]
        return got

    def register(self, overrun: int = 0):
        return self.call("register", overrun)

    def store(self, event: int, blocks, slots, *, sleep_s: float = 0.0,
              value: int | None = None, wait: bool = True):
        return self.call("store", event, list(blocks), list(slots), sleep_s, value, wait, 0)

    def load(self, event: int, blocks, slots, lease: int = 0):
        return self.call("load", event, list(blocks), list(slots), 0.0, None, True, lease)

    def wait(self, event: int):
        return self.call("wait", event)

    def digest(self, blocks) -> str:
        return self.call("digest", list(blocks))[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except Exception:  # noqa: BLE001, S110 - it is killed below
                pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(20)
