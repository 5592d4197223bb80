"""``kvdctl events``: follow the daemon's KV event stream live (a tail for operators).

Subscribes like any router would (the endpoint comes from the daemon's status, so
``--socket`` is all it needs) and prints one line per event, or with ``--json`` one
object per batch. A jump in the sequence numbers is reported: that subscriber missed
batches (a router would ask the replay socket for them). The sequence is the daemon's,
shared by its topics, so with ``--topic`` no gap is told (``"missed": null``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec
import zmq

from kvd.cli.admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, AdminClient, fetch_status
from kvd.cli.render import printable
from kvd.events import BlockRemoved, BlockStored, decode

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "[::]": "[::1]"}


def add_parser(sub: Any) -> None:
    e = sub.add_parser("events", help="follow the KV event stream (what fleet routers see) "
                                      "until Ctrl-C",
                       description="follow the KV event stream (what fleet routers see)")
    e.add_argument("--json", action="store_true", help="one JSON object per batch")
    e.add_argument("--endpoint", help="subscribe here instead of the daemon's endpoint")
    e.add_argument("--topic", default="", help="only topics starting with this")
    e.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)


def connectable(endpoint: str) -> str:
    """A bound address as a subscriber on this node reaches it."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        return f"tcp://{_WILDCARDS.get(host, host)}:{port}"
    return endpoint


def _hash(h: int | bytes | None) -> Any:
    return h.hex() if isinstance(h, bytes) else h


def _text(topic: str, seq: int, ev: Any) -> str:
    name, topic = type(ev).__name__, printable(topic)  # (a topic names a client's model)
    if isinstance(ev, BlockStored):
        parent = "" if ev.parent_block_hash is None else f" parent {_hash(ev.parent_block_hash)}"
        return (f"{topic} #{seq} {name} {len(ev.block_hashes)} blocks ({ev.medium}, "
                f"{ev.block_size} tokens each, group {ev.group_idx}){parent}: "
                f"{_hash(ev.block_hashes[0])}..")
    if isinstance(ev, BlockRemoved):
        return (f"{topic} #{seq} {name} {len(ev.block_hashes)} blocks ({ev.medium}): "
                f"{_hash(ev.block_hashes[0])}..")
    return f"{topic} #{seq} {name}"


def run(args: argparse.Namespace, client: AdminClient) -> int:
    endpoint = args.endpoint
    if not endpoint:
        with client as c:
            ev = fetch_status(c).get("events", {})
        if not ev.get("enabled"):
            print("kvdctl: kvd publishes no KV events: set events_endpoint "
                  "(--events-endpoint) in its configuration", file=sys.stderr)
            return EXIT_FAIL
        endpoint = connectable(ev["endpoint"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode(errors="surrogateescape"))
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:  # a malformed --endpoint: say so, not a traceback
        sock.close()
        ctx.term()
        print(f"kvdctl: cannot subscribe to {endpoint!r}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not args.json:
        print(f"following {endpoint} (Ctrl-C to stop)", flush=True)
    n, last = 0, -1
    try:
        while not args.count or n < args.count:
            if not sock.poll(1000):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:
                continue
            topic, seq = frames[0].decode(errors="replace"), int.from_bytes(frames[1], "big")
            try:
                batch = decode(frames[2])
            except msgspec.DecodeError as e:  # another publisher's (or version's) payload
                print(f"kvdctl: a batch on {topic!r} (seq {seq}) is not a KV event batch: "
                      f"{e}", file=sys.stderr)
                return EXIT_FAIL
            # The sequence is the daemon's, across its topics: with a topic filter a jump
            # may be other topics' batches, so gaps are told only for the whole stream.
            gap = (seq - last - 1 if last >= 0 and seq > last + 1 else 0) \
                if not args.topic else None
            last = seq
            if not batch.events:  # a heartbeat: it says only where the sequence is
                continue
            n += 1
            if args.json:
                events = [msgspec.to_builtins(e, builtin_types=(bytes,)) for e in batch.events]
                print(json.dumps({"topic": topic, "seq": seq, "ts": batch.ts, "missed": gap,
                                  "events": events}, default=_hash), flush=True)
                continue
            stamp = time.strftime("%H:%M:%S", time.localtime(batch.ts))
            if gap:
                print(f"{stamp} missed {gap} batches (a router would replay them)")
            for ev in batch.events:
                print(f"{stamp} {_text(topic, seq, ev)}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(linger=0)
        ctx.term()
    return EXIT_OK
