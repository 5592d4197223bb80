"""The tiers below the pool: promotion bandwidth and the TTFT of a prompt served from them.

1. Promotion GB/s through a real daemon: blocks stored by a client process, pushed to
   the tier (disk: evicted from a pool that holds one set; remote: written behind by a
   second daemon), then looked up until READY in RAM — from the first Lookup to the
   one that hits them all. Baselines measured in the same run on the same bytes: a plain
   ``preadv`` of the disk tier's slot file in block-sized reads, and plain pipelined
   redis-py GETs of the same values. Both tiers' data sit in the page cache / the
   cluster's memory, as they would for a hot block.
2. TTFT of a reused ~8k-token prompt on a real vLLM engine (the bench_vllm.py model):
   stored, pushed out of RAM (disk: evicted by other prompts; remote: the daemon is
   killed and its pool removed, then a fresh daemon without it comes up), then served
   from the tier, against the same prompt loaded from RAM and an unseen prompt
   recomputed, in the same engine run.

The remote tier needs a cluster: ``--remote redis://HOST:PORT[,...]``, else a 3-master
cluster of the local ``redis-server`` is started on loopback ports for the run.

    .venv/bin/python scripts/bench_tiers.py [--sizes 64K,256K,1M] [--repeat 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import numpy as np
from _bench import DaemonProc, emit, finish_engine, start_engine
from _model import build_tiny_model
from kvd_client import Connection
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32

from kvd.config import parse_size
from tests.daemon.workers import Spec, Worker, fingerprint

MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64,
         "intermediate": 1536, "vocab": 2048, "max_positions": 16384}  # bench_vllm.py's
PROMPT_TOKENS = 8000


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(36, b"\0") for i in range(n)]


def scheduler(d: DaemonProc, spec: Spec) -> Connection:
    c = Connection(d.socket, name="bench-sched", register=m.Register(0, fingerprint(spec), -1))
    assert c.wait_up(10)
    return c


def store(d: DaemonProc, spec: Spec, ks: list[bytes]) -> None:
    sched, w = scheduler(d, spec), Worker(spec)
    try:
        r = sched.request(m.Allocate(sched.next_req(), ks), 30)
        assert isinstance(r, m.Allocated) and r.allocated == len(ks), r
        assert w.store(1, range(len(ks)), unpack_u32(r.slots))[1] == 0
    finally:
        w.close()
        sched.close()


def wait_counter(d: DaemonProc, key: str, at_least: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        if st["counters"][key] >= at_least:
            return st
        if time.monotonic() > deadline:
            raise SystemExit(f"{key} stayed at {st['counters'][key]} < {at_least}")
        time.sleep(0.05)


def drained(d: DaemonProc, tier: str, quiet_s: float = 0.0, timeout: float = 120) -> dict:
    """Every block evicted so far went down to disk, or every block stored so far was
    written to the cluster (or was dropped, counted), and no store arrived for
    ``quiet_s``: an engine's stores trail the end of its request."""
    deadline = time.monotonic() + timeout
    sent, dropped, of = (("demoted_blocks", "demote_dropped", "evicted_blocks")
                         if tier == "disk" else
                         ("written_behind_blocks", "write_behind_dropped", "stored_blocks"))
    last, since = -1, time.monotonic()
    while True:
        c = d.status()["counters"]
        if c["stored_blocks"] != last:
            last, since = c["stored_blocks"], time.monotonic()
        # Blocks promoted from a tier count as stored, but are not written back.
        todo = c[of] - (c["promoted_blocks"] if tier == "remote" else 0)
        if todo and c[sent] + c[dropped] >= todo and time.monotonic() - since >= quiet_s:
            return c
        if time.monotonic() > deadline:
            raise SystemExit(f"demotion did not drain: {c}")
        time.sleep(0.05)


def promote_seconds(d: DaemonProc, spec: Spec, ks: list[bytes]) -> float:
    """From the first Lookup to the one that finds every key READY in RAM, asking again
    every 2 ms, as an engine's scheduler steps do. Each ask is a Lookup of every key
    that the daemon's loop answers while the tier's reader fills the slots: asking
    every 0.5 ms (~560 Lookups) made a 1 MiB-block promotion from the cluster about a
    third slower than asking every 10 ms."""
    sched = scheduler(d, spec)
    try:
        t0 = time.perf_counter()
        while True:
            r = sched.request(m.Lookup(sched.next_req(), ks, lease_ms=0), 30)
            if r.hits == len(ks):
                return time.perf_counter() - t0
            if not r.pending:
                raise SystemExit(f"promotion stopped at {r.hits} of {len(ks)} blocks")
            time.sleep(0.002)
    finally:
        sched.close()


def disk_bandwidth(block: int, n: int, rounds: int) -> dict:
    """Promotion from the disk tier vs a plain read of the same slot-file bytes."""
    pages = (block // 2, block - block // 2)
    spec = Spec("", pages=pages, num_blocks=n)
    pool = max(n * block * 5 // 4, 4 << 20)
    extent = 1 << max(20, (block * 2 - 1).bit_length())
    pool = (pool + extent - 1) // extent * extent
    out: dict = {"tier": "disk", "block_bytes": block, "blocks": n, "promote_gbs": [],
                 "baseline_gbs": []}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-disk-") as tmp:
        d = DaemonProc("--pool-size", str(pool), "--extent-size", str(extent),
                       "--disk-path", tmp, "--disk-size", str(4 * pool),
                       "--policy", "lru",  # the set stored first is the one pushed out
                       "--log-level", "warning")
        d.start()
        try:
            spec.socket = d.socket
            for r in range(rounds):
                ks = keys(n, f"d{r}-")
                store(d, spec, ks)
                for j in range(2):  # two more sets push this one out of the pool,
                    store(d, spec, keys(n, f"d{r}-push{j}-"))
                    drained(d, "disk")  # at disk speed: a full queue drops, counted
                secs = promote_seconds(d, spec, ks)
                out["promote_gbs"].append(n * block / secs / 1e9)
                out["baseline_gbs"].append(plain_read_gbs(Path(tmp) / "kvd-disk.slots",
                                                          block, n))
        finally:
            d.cleanup()
    return summarize(out)


def plain_read_gbs(path: Path, block: int, n: int) -> float:
    """A plain read of as many bytes from the slot file (page cache), in 1 MiB
    ``preadv`` calls into one buffer: the best a reader of that file can do."""
    total = n * block
    buf = np.empty(total, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunk = 1 << 20
        offs = [(off, off % max(chunk, size - chunk)) for off in range(0, total, chunk)]
        for at, off in offs:  # untimed: into the page cache, as the demoted blocks are
            os.preadv(fd, [buf[at:at + chunk]], off)
        t0 = time.perf_counter()
        for at, off in offs:
            os.preadv(fd, [buf[at:at + chunk]], off)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def remote_bandwidth(url: str, block: int, n: int, rounds: int) -> dict:
    """Promotion from the cluster (written behind by node A, promoted on node B) vs
    plain pipelined GETs of the same values."""

    pages = (block // 2, block - block // 2)
    spec = Spec("", pages=pages, num_blocks=n)
    pool = max(n * block * 3, 4 << 20)
    extent = 1 << max(20, (block * 2 - 1).bit_length())
    pool = (pool + extent - 1) // extent * extent
    args = ("--pool-size", str(pool), "--extent-size", str(extent), "--remote", url,
            "--log-level", "warning")
    a, b = DaemonProc(*args), DaemonProc(*args)
    out: dict = {"tier": "remote", "block_bytes": block, "blocks": n, "promote_gbs": [],
                 "baseline_gbs": []}
    a.start()
    b.start()
    client = _redis_client(url)
    try:
        for r in range(rounds):
            ks = keys(n, f"rm{r}-{os.getpid()}-")
            spec.socket = a.socket
            before = a.status()["counters"]["written_behind_blocks"]
            store(a, spec, ks)
            st = wait_counter(a, "written_behind_blocks", before + n)
            spec.socket = b.socket
            secs = promote_seconds(b, spec, ks)
            out["promote_gbs"].append(n * block / secs / 1e9)
            ns = st["tenants"][0]["digest"].encode()
            names = [b"kvd:" + ns + b":" + k for k in ks]
            t0 = time.perf_counter()
            got = 0
            batch = max(1, min(64, (4 << 20) // block))  # the tier's own batch limits
            for i in range(0, n, batch):
                pipe = client.pipeline(transaction=False)
                for name in names[i:i + batch]:
                    pipe.get(name)
                got += sum(len(v or b"") for v in pipe.execute())
            out["baseline_gbs"].append(got / (time.perf_counter() - t0) / 1e9)
    finally:
        client.close()
        a.cleanup()
        b.cleanup()
    return summarize(out)


def _redis_client(url: str):
    import redis

    first = url.split(",")[0]
    try:
        c = redis.RedisCluster.from_url(first)
        c.ping()
        return c
    except redis.exceptions.RedisClusterException:
        return redis.Redis.from_url(first)


def summarize(row: dict) -> dict:
    ratios = [p / b for p, b in zip(row["promote_gbs"], row["baseline_gbs"])]
    row.update(promote_median=statistics.median(row["promote_gbs"]),
               baseline_median=statistics.median(row["baseline_gbs"]),
               ratio_min=min(ratios), ratio_max=max(ratios),
               ratio_median=statistics.median(ratios))
    return row


# ---------------------------------------------------------------- TTFT on vLLM
def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, MODEL["vocab"], n).tolist()


def gen(ids: list[int]) -> dict:
    return {"op": "generate", "prompt_token_ids": ids, "max_tokens": 1}


def ttft(tier: str, url: str, repeat: int) -> dict:
    """One engine; per repeat: store R, push it out of RAM onto the tier, then time R
    from the tier, R from RAM, and an unseen prompt (recompute)."""
    model = build_tiny_model(REPO / ".e2e-cache" / "bench-llama", **MODEL)
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-ttft-"))
    # A prompt's KV is 8 layers x 2 x 4 heads x 64 x 2 B x 8000 tokens = 62.5 MiB (62
    # blocks of 128 tokens); three fill prompts push all of R out of a 128 MiB pool.
    args = ["--pool-size", "128M", "--extent-size", "64M", "--log-level", "warning"]
    # LRU: the reused prompt, stored first, is what the fill prompts push out.
    args += (["--disk-path", str(tmp / "disk"), "--disk-size", "1G", "--policy", "lru"]
             if tier == "disk" else ["--remote", url])
    d = DaemonProc(*args)
    d.start()
    steps: list[dict] = [gen(prompt(0, 512))]  # warm-up
    for i in range(repeat):
        reused = prompt(1000 + i)
        # vLLM stores a request's last blocks at the engine's next step: a short
        # request makes that step (an idle engine would hold them back).
        steps += [gen(reused), gen(prompt(5000 + i, 16))]
        if tier == "disk":
            steps += [gen(prompt(2000 + 10 * i + j)) for j in range(3)]
        steps += [{"op": "touch", "path": str(tmp / f"stored-{i}")},
                  {"op": "wait_file", "path": str(tmp / f"ready-{i}"), "timeout": 600},
                  {"op": "reset_prefix_cache"}, gen(reused),  # from the tier
                  {"op": "reset_prefix_cache"}, gen(reused),  # from RAM
                  gen(prompt(3000 + i))]  # recompute
    config = {"model": str(model), "llm": {"max_model_len": PROMPT_TOKENS + 64},
              "kv_transfer_config": {
                  "kv_connector": "KvdConnector", "kv_connector_module_path": "kvd_client.vllm",
                  "kv_role": "kv_both",
                  "kv_connector_extra_config": {"socket": d.socket, "pending_wait_ms": 5000}},
              "steps": steps}
    log = tmp / "engine.log"
    proc = start_engine(config, log)
    dropped = 0  # blocks that did not reach the tier (counted by the daemon)
    try:
        for i in range(repeat):
            while not (tmp / f"stored-{i}").exists():
                if proc.poll() is not None:
                    raise SystemExit(log.read_text()[-3000:])
                time.sleep(0.05)
            c = drained(d, tier, quiet_s=3.0)
            dropped += c["demote_dropped" if tier == "disk" else "write_behind_dropped"]
            # disk: a reboot (the RAM pool goes, the disk tier stays); remote: another
            # node (the cluster is all it shares).
            d.kill()
            os.unlink(d.pool_path)
            d.start()
            time.sleep(2.0)  # the engine's client reconnects and registers again
            (tmp / f"ready-{i}").touch()
        results = finish_engine(proc, log, timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
        d.cleanup()
    gens = [r for r in results if r.get("op") == "generate"][1:]
    per = 6 if tier == "disk" else 3
    rows = []
    for i in range(repeat):
        g = gens[i * (per + 2):(i + 1) * (per + 2)]
        from_tier, from_ram, recompute = g[-3], g[-2], g[-1]
        rows.append({"tier_s": from_tier["elapsed_s"], "ram_s": from_ram["elapsed_s"],
                     "recompute_s": recompute["elapsed_s"],
                     "tier_cached": from_tier["num_cached_tokens"],
                     "ram_cached": from_ram["num_cached_tokens"]})
    med = {k: statistics.median(r[k] for r in rows) for k in ("tier_s", "ram_s", "recompute_s")}
    return {"tier": tier, "samples": rows, **med, "dropped_blocks": dropped,
            "tier_vs_recompute": [r["tier_s"] / r["recompute_s"] for r in rows],
            "tier_vs_ram": [r["tier_s"] / r["ram_s"] for r in rows]}


def local_cluster():
    from tests.redis_servers import RedisCluster

    return RedisCluster(tempfile.mkdtemp(prefix="kvd-bench-redis-"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,256K,1M", help="block sizes for part 1")
    p.add_argument("--blocks", type=int, default=256, help="blocks per promotion")
    p.add_argument("--rounds", type=int, default=3, help="promotions per size")
    p.add_argument("--repeat", type=int, default=3, help="TTFT samples per tier")
    p.add_argument("--remote", help="redis://HOST:PORT[,...] (default: a local cluster)")
    p.add_argument("--ttft-tiers", default="disk,remote", help="tiers for part 2")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    cluster = None if args.remote else local_cluster()
    url = args.remote or cluster.url
    out: dict = {}
    try:
        if not args.skip_bandwidth:
            rows = []
            for size in [parse_size(s) for s in args.sizes.split(",")]:
                rows.append(disk_bandwidth(size, args.blocks, args.rounds))
                rows.append(remote_bandwidth(url, size, args.blocks, args.rounds))
            out["bandwidth"] = rows
            emit(rows, [("tier", "tier", "s"), ("block_bytes", "block B", "d"),
                        ("promote_median", "promote GB/s", ".2f"),
                        ("baseline_median", "plain GB/s", ".2f"),
                        ("ratio_median", "ratio", ".2f"), ("ratio_min", "min", ".2f"),
                        ("ratio_max", "max", ".2f")], False,
                 {"baseline": "disk: 1 MiB preadv calls of the slot file (page cache); "
                                      "remote: redis-py pipelined GETs of the same values"})
        if not args.skip_ttft:
            out["ttft"] = [ttft(t, url, args.repeat) for t in args.ttft_tiers.split(",")]
            for t in out["ttft"]:
                print(f"TTFT {PROMPT_TOKENS} tokens from {t['tier']} (median of "
                      f"{args.repeat}): {t['tier_s'] * 1000:.0f} ms; from RAM "
                      f"{t['ram_s'] * 1000:.0f} ms; recompute {t['recompute_s'] * 1000:.0f} ms;"
                      " tier/recompute " + " ".join(f"{x:.3f}" for x in t["tier_vs_recompute"])
                      + "; tier/RAM " + " ".join(f"{x:.2f}" for x in t["tier_vs_ram"])
                      + "; cached from the tier " + " ".join(
                          str(r["tier_cached"]) for r in t["samples"])
                      + f"; dropped on the way down {t['dropped_blocks']}")
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
