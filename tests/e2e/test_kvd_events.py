"""kvd's KV events against a real vLLM engine publishing its own: same hashes, same format.

The engine stores a prompt through kvd with vLLM's own KV events on; the test follows
kvd's stream live, fetches vLLM's batches through vLLM's replay socket, and decodes both
with vLLM's own ``KVEventBatch`` (in a subprocess, so vLLM stays out of pytest).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import zmq
from _model import long_prompt
from conftest import kvd_transfer_config, wait_for

from kvd.cli import ctl

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128
PROMPT = long_prompt(800)  # ~1000 tokens: 7 full blocks
NEXT_TURN = PROMPT + " " + long_prompt(300, variant=1)  # goes on from PROMPT's blocks

DECODE = """
import base64, json, sys
from vllm.distributed.kv_events import KVEventBatch
import msgspec
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for p in json.load(sys.stdin):
    b = dec.decode(base64.b64decode(p))
    out.append([[type(e).__name__, getattr(e, "block_hashes", None),
                 getattr(e, "parent_block_hash", None), getattr(e, "medium", None),
                 getattr(e, "block_size", None)] for e in b.events])
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_decode(payloads: list[bytes]) -> list[list[list]]:
    """Each payload decoded by vLLM's own ``KVEventBatch``: [[type, hashes, parent,
    medium, block_size] per event] per batch."""
    proc = subprocess.run([sys.executable, "-c", DECODE], capture_output=True, text=True,
                          input=json.dumps([base64.b64encode(p).decode() for p in payloads]),
                          timeout=180, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replay(endpoint: str) -> list[bytes]:
    """Every batch a publisher still buffers (vLLM's replay protocol, from seq 0)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(10_000), "replay did not finish"
            _, _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append(payload)
    finally:
        sock.close(linger=0)


def test_kvd_publishes_vllms_hashes(tiny_model, daemon_factory, start_engine, tmp_path,
                                    capsys):
    d = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0",
                       "--events-replay-endpoint", "tcp://127.0.0.1:0")
    ev = d.status()["events"]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ev["endpoint"])
    vllm_replay = f"tcp://127.0.0.1:{free_port()}"
    stored, collected = tmp_path / "stored", tmp_path / "collected"
    engine = start_engine({
        "model": str(tiny_model), "kv_transfer_config": kvd_transfer_config(d.socket),
        # As vllm serve runs it: the engine steps until its requests' leases and stores
        # are settled (in-process, an idle engine keeps the next turn's lease on the first
        # turn's blocks until it steps again, and the evict below would keep them).
        "multiprocessing": True,
        "llm": {"kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": vllm_replay,
            "topic": "vllm"}},
        "steps": [{"op": "generate", "prompt": PROMPT, "max_tokens": 4},
                  {"op": "sleep", "seconds": 0.5},  # the stores complete
                  {"op": "generate", "prompt": NEXT_TURN, "max_tokens": 4},
                  {"op": "sleep", "seconds": 0.5},
                  {"op": "touch", "path": str(stored)},
                  {"op": "wait_file", "path": str(collected), "timeout": 300}]})
    try:
        wait_for(stored, engine)
        deadline = time.monotonic() + 10
        kvd_batches: list[tuple[bytes, bytes]] = []
        while time.monotonic() < deadline and len(kvd_batches) < 2:  # one per turn
            if sub.poll(200):
                topic, _, payload = sub.recv_multipart()
                kvd_batches.append((topic, payload))
        assert len(kvd_batches) == 2, "kvd did not publish both turns"
        theirs = replay(vllm_replay)
        tenant = d.status()["tenants"][0]["id"]
        assert ctl.main(["--socket", d.socket, "evict", "--tenant", str(tenant)]) == 0
        assert sub.poll(5000)
        kvd_batches.append(tuple(sub.recv_multipart()[::2]))
        assert ctl.main(["--socket", d.socket, "flush"]) == 0
        assert sub.poll(5000)
        kvd_batches.append(tuple(sub.recv_multipart()[::2]))
    finally:
        collected.touch()
        run = engine.wait(check=False)
        sub.close(linger=0)
        capsys.readouterr()

    topic = kvd_batches[0][0].decode()
    assert topic.startswith("kv@") and topic.endswith("@" + str(tiny_model))
    ours = vllm_decode([p for _, p in kvd_batches])
    vllm_events = [e for batch in vllm_decode(theirs) for e in batch]
    vllm_stored = [h for name, hs, *_ in vllm_events if name == "BlockStored" for h in hs]

    # A daemon's first batch on a topic opens with AllBlocksCleared (routers drop what an
    # earlier daemon on this node announced), then what the engine stored.
    cleared, stored_ev = ours[0]
    assert cleared == ["AllBlocksCleared", None, None, None, None]
    name, hashes, parent, medium, block_size = stored_ev
    assert (name, parent, medium, block_size) == ("BlockStored", None, "CPU", BLOCK_TOKENS)
    assert len(hashes) == run.generations[0]["prompt_len"] // BLOCK_TOKENS  # full blocks
    # The very hashes vLLM's own KV events publish for the same blocks, in order.
    assert hashes == vllm_stored[:len(hashes)]
    # The next turn's new blocks go on from the first turn's: the same parent as vLLM's
    # own event for them (the first turn's last full block).
    (turn,) = ours[1]
    assert turn[0] == "BlockStored" and turn[1] and turn[2] == hashes[-1]
    theirs_turn = [e for e in vllm_events if e[0] == "BlockStored" and turn[1][0] in e[1]]
    assert theirs_turn and theirs_turn[0][2] == turn[2]
    assert theirs_turn[0][1][theirs_turn[0][1].index(turn[1][0]):][:len(turn[1])] == turn[1]
    (removed,) = ours[2]
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(hashes + turn[1])
    assert ours[3] == [["AllBlocksCleared", None, None, None, None]]
