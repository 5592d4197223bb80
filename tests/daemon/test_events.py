"""KV events for fleet routers, against a real daemon and real ZeroMQ sockets: vLLM's
framing and layout, sequence numbers, replay, flush, eviction and a stuck subscriber."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd.admin import EVICT_PART
from kvd.cli import ctl
from kvd.cli.admin import AdminClient, Unreachable
from kvd.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode
from kvd_client import Connection
from kvd_client.errors import RemoteError
from kvd_proto import messages as m
from kvd_proto.ids import NO_SLOT, unpack_u32
from tests.daemon.workers import Spec, Worker, fingerprint
from tests.waiting import wait_for

EVENTS = ("--events-endpoint", "tcp://127.0.0.1:0",
          "--events-replay-endpoint", "tcp://127.0.0.1:0")
TOPIC = b"kv@node-a@tiny"


def key(i: int, group: int = 0) -> bytes:
    """An OffloadKey as vLLM builds it: a 32-byte block hash + 4-byte big-endian group."""
    return hashlib.sha256(str(i).encode()).digest() + group.to_bytes(4, "big")


def published(k: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` of the key's block hash (the default)."""
    return int.from_bytes(k[:-4], "big") & (2**64 - 1)


class Sub:
    """A SUB socket on the daemon's event endpoint."""

    def __init__(self, endpoint: str, rcvhwm: int = 0, rcvbuf: int = -1) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf > 0:
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(endpoint)
        self._held: list[bytes] | None = None  # the batch ``quiet`` saw, for ``recv``
        time.sleep(0.3)  # the subscription reaches the publisher (slow joiner)

    def recv(self, timeout: float = 5.0, heartbeats: bool = False) -> tuple[bytes, int, bytes]:
        """The next batch; heartbeats (no events: this subscription's, say) are skipped
        unless asked for."""
        while True:
            if self._held is not None:
                frames, self._held = self._held, None
            else:
                assert self.sock.poll(int(timeout * 1000)), "no event batch arrived"
                frames = self.sock.recv_multipart()
            topic, seq, payload = frames
            assert len(seq) == 8
            if heartbeats or decode(payload).events:
                return topic, int.from_bytes(seq, "big"), payload

    def quiet(self, timeout: float = 0.3) -> bool:
        """No batch but heartbeats for ``timeout``. A batch that ends the wait is kept
        for the next ``recv`` (``while not sub.quiet(): sub.recv()`` lost every other
        batch, and waited in vain for one more when their number was odd)."""
        if self._held is not None:
            return False
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return True
            frames = self.sock.recv_multipart()
            if decode(frames[2]).events:
                self._held = frames
                return False
        return True

    def close(self) -> None:
        self.sock.close(linger=0)


class Engine:
    """A scheduler connection and one worker process of the test tenant."""

    def __init__(self, socket: str) -> None:
        self.spec = Spec(socket)
        self.sched = Connection(socket, name="sched",
                                register=m.Register(0, fingerprint(self.spec), -1))
        assert self.sched.wait_up(10)
        self.worker = Worker(self.spec)
        self.event = 0

    def store(self, keys: list[bytes], depth: int = 0, parent: bytes = b"",
              chained: bool = True) -> m.Allocated:
        r = self.sched.request(m.Allocate(self.sched.next_req(), keys, depth=depth,
                                          parent=parent, chained=chained))
        pairs = [(i % self.spec.num_blocks, s) for i, s in enumerate(unpack_u32(r.slots))
                 if s != NO_SLOT]
        if pairs:
            self.event += 1
            blocks, slots = zip(*pairs)
            assert self.worker.store(self.event, blocks, slots)[1] == 0
        return r

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


@pytest.fixture
def events_daemon(daemon_factory):
    d = daemon_factory(*EVENTS, start=False)
    d.env["KVD_EVENTS_NODE"] = "node-a"
    return d.start()


def endpoints(d) -> tuple[str, str]:
    ev = d.status()["events"]
    assert ev["enabled"]
    return ev["endpoint"], ev["replay_endpoint"]


def test_framing_sequence_and_layout(events_daemon):
    pub, _ = endpoints(events_daemon)
    sub = Sub(pub)
    eng = Engine(events_daemon.socket)
    base = events_daemon.status()["events"]["next_seq"]
    assert base > 1_700_000_000 * 10**6  # the start time in µs: above any earlier run's
    try:
        ks = [key(i) for i in range(6)]
        eng.store(ks[:4])
        topic, seq, payload = sub.recv()
        assert (topic, seq) == (TOPIC, base)
        # vLLM's layout: an array [ts, events, dp rank (none: kvd is no DP rank)];
        # each event a map tagged by "type".
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float)
        assert raw[2] is None
        # A daemon's first batch on a topic opens with AllBlocksCleared: a router drops
        # what an earlier daemon on this node announced (it kept nothing of it).
        assert [e["type"] for e in raw[1]] == ["AllBlocksCleared", "BlockStored"]
        cleared, ev = decode(payload).events
        assert cleared == AllBlocksCleared()
        assert ev == BlockStored(block_hashes=[published(k) for k in ks[:4]],
                                 parent_block_hash=None, token_ids=[], block_size=16,
                                 lora_id=None, medium="CPU", lora_name=None, group_idx=0)
        # Keys already held are skipped; the new run's parent is the key before it.
        eng.store(ks, depth=0)
        topic, seq, payload = sub.recv()
        (ev,) = decode(payload).events
        assert seq == base + 1 and ev.block_hashes == [published(k) for k in ks[4:]]
        assert ev.parent_block_hash == published(ks[3])
        assert sub.quiet()  # one batch per loop iteration, not one per block
        st = events_daemon.status()["events"]
        assert st["batches"] == 2 and st["next_seq"] == base + 2
        assert st["dropped_batches"] == 0
    finally:
        eng.close()
        sub.close()


def test_a_store_that_goes_on_from_held_blocks_names_its_parent(events_daemon):
    """A turn that goes on from stored blocks (a new Allocate at depth > 0) announces
    the parent its sender named, as vLLM's own events do; without one it has none."""
    pub, _ = endpoints(events_daemon)
    sub = Sub(pub)
    eng = Engine(events_daemon.socket)
    try:
        ks = [key(i) for i in range(8)]
        eng.store(ks[:4])
        sub.recv()
        eng.store(ks[4:6], depth=4, parent=ks[3])
        (ev,) = decode(sub.recv()[2]).events
        assert ev.block_hashes == [published(k) for k in ks[4:6]]
        assert ev.parent_block_hash == published(ks[3])
        eng.store(ks[6:], depth=6)  # a sender that does not say
        (ev,) = decode(sub.recv()[2]).events
        assert ev.block_hashes == [published(k) for k in ks[6:]]
        assert ev.parent_block_hash is None
        # Keys that are not consecutive blocks: none is the next one's parent.
        gappy = [key(i) for i in (20, 22)]
        eng.store(gappy, depth=8, parent=ks[7], chained=False)
        assert chain_stored(decode(sub.recv()[2]).events) == [
            ([published(gappy[0])], published(ks[7])), ([published(gappy[1])], None)]
        eng.store([key(30)], depth=10, parent=b"short")  # unlike a key: unknown
        assert chain_stored(decode(sub.recv()[2]).events) == [([published(key(30))], None)]
        with pytest.raises(RemoteError) as bad:  # typed, and nothing allocated
            eng.store([key(9)], depth=8, parent=b"p" * 2000)
        assert bad.value.code == m.Code.BAD_REQUEST
        assert events_daemon.status()["blocks"]["pending"] == 0
    finally:
        eng.close()
        sub.close()


def chain_stored(events) -> list[tuple[list[int], int | None]]:
    return [(e.block_hashes, e.parent_block_hash) for e in events if isinstance(e, BlockStored)]


def test_blocks_announced_again_keep_their_parents(daemon_factory):
    """After a flush (the blocks kept) and after a warm restart (the journal's), each
    chain is announced again as it was stored: parents first, each block's parent the
    one it had, so a router's prefix tree gets the same chain back."""
    d = daemon_factory(*EVENTS, start=False)
    d.env.update({"KVD_EVENTS_NODE": "node-a", "KVD_PERSIST": "true"})
    d.start()
    ks = [key(i) for i in range(4)]
    eng = Engine(d.socket)
    try:
        eng.store(ks[:2])
        eng.store(ks[2:], depth=2, parent=ks[1])
        sub = Sub(endpoints(d)[0])
        # A lease keeps the second part through a flush: it comes back with its parent.
        lk = eng.sched.request(m.Lookup(eng.sched.next_req(), ks[2:], depth=2,
                                        lease_ms=30_000))
        assert lk.hits == 2
        assert ctl.main(["--socket", d.socket, "flush"]) == 0
        events = decode(sub.recv()[2]).events
        assert events[0] == AllBlocksCleared()
        assert chain_stored(events) == [([published(k) for k in ks[2:]], published(ks[1]))]
        sizes = {e.block_size for e in events if isinstance(e, BlockStored)}
        assert len(sizes) == 1 and 0 not in sizes
        eng.sched.request(m.Release(eng.sched.next_req(), lk.lease))
        sub.close()
        eng.store(ks[:2])  # the whole chain again, in two parts
        eng.store(ks[2:], depth=2, parent=ks[1])
        other = [key(i) for i in range(10, 13)]  # and another chain beside it
        eng.store(other)
    finally:
        eng.close()
    d.kill()  # (its journal as appended, not a clean stop's snapshot)
    d.start()  # its first batch (before anyone subscribed): from the replay buffer
    batches = replay(endpoints(d)[1], 0)
    assert batches
    events = decode(batches[0][2]).events
    assert events[0] == AllBlocksCleared()
    assert sorted(chain_stored(events)) == sorted([  # one event per chain
        ([published(k) for k in ks], None), ([published(k) for k in other], None)])
    # With the tokens per block the engine registered (they were 0 until it came back).
    assert {e.block_size for e in events if isinstance(e, BlockStored)} == sizes


def test_a_router_back_after_a_warm_restart_is_told_of_the_gap_while_the_daemon_idles(
        daemon_factory):
    """The restarted daemon's opening batch (AllBlocksCleared and the journal's blocks)
    left before the router came back; the daemon stays idle. The router's subscription
    gets a heartbeat, whose sequence shows the gap, and the router replays the opening
    batch (before: nothing came until an engine stored again)."""
    d = daemon_factory(*EVENTS, start=False)
    d.env.update({"KVD_EVENTS_NODE": "node-a", "KVD_PERSIST": "true"})
    d.start()
    ks = [key(i) for i in range(3)]
    sub = Sub(endpoints(d)[0])
    eng = Engine(d.socket)
    try:
        eng.store(ks)
        _, last, _ = sub.recv()
    finally:
        eng.close()
        sub.close()
    d.kill()
    d.start()
    pub, rep = endpoints(d)
    assert wait_for(lambda: d.status()["events"]["batches"] >= 1, 10)  # the opening one
    sub = Sub(pub)  # the router is back, later
    try:
        _, seq, payload = sub.recv(heartbeats=True)
        assert decode(payload).events == [] and seq > last + 1
        opening = decode(replay(rep, last + 1)[0][2]).events  # what the router does
        assert opening[0] == AllBlocksCleared()
        assert chain_stored(opening) == [([published(k) for k in ks], None)]
        assert d.status()["events"]["heartbeats"] >= 1
    finally:
        sub.close()


@pytest.mark.parametrize("change", ["pool file lost", "pool resized"])
def test_a_restart_that_keeps_none_of_the_journals_blocks_clears_their_topics(
        daemon_factory, change):
    """With --persist, a restart that cannot use the journal (the pool file went with a
    reboot; the pool was resized) keeps no tenant, so its opening batch went to no
    topic: routers kept advertising the last run's blocks while the daemon idled."""
    d = daemon_factory(*EVENTS, start=False)
    d.env.update({"KVD_EVENTS_NODE": "node-a", "KVD_PERSIST": "true"})
    d.start()
    sub = Sub(endpoints(d)[0])
    eng = Engine(d.socket)
    try:
        eng.store([key(i) for i in range(3)])
        _, last, _ = sub.recv()
    finally:
        eng.close()
        sub.close()
    d.stop()
    if change == "pool file lost":
        os.unlink(d.pool_path)
    else:
        i = d.args.index("--pool-size")
        d.args[i + 1] = "32M"
    d.start()
    pub, rep = endpoints(d)
    assert wait_for(lambda: d.status()["events"]["batches"] >= 1, 10)
    assert d.status()["blocks"]["ready"] == 0
    sub = Sub(pub)
    try:
        _, seq, payload = sub.recv(heartbeats=True)  # the topic is this run's too now
        assert decode(payload).events == [] and seq > last + 1
        topic, _, opening = replay(rep, last + 1)[0]
        assert topic == TOPIC and decode(opening).events == [AllBlocksCleared()]
    finally:
        sub.close()


def test_every_router_that_joins_gets_a_heartbeat_and_a_flood_of_joins_few(events_daemon):
    """A second router on a topic already followed is told too (XPUB shows duplicate
    subscriptions); subscriptions in a loop get at most one heartbeat a second."""
    pub, _ = endpoints(events_daemon)
    eng = Engine(events_daemon.socket)
    first = Sub(pub)
    try:
        eng.store([key(1)])
        first.recv()
        second = Sub(pub)
        try:
            _, _, payload = second.recv(heartbeats=True)
            assert decode(payload).events == []
        finally:
            second.close()
        before = events_daemon.status()["events"]["heartbeats"]
        started = time.monotonic()
        for _ in range(50):
            first.sock.setsockopt(zmq.UNSUBSCRIBE, b"kv@")
            first.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
            time.sleep(0.02)
        time.sleep(0.3)
        sent = events_daemon.status()["events"]["heartbeats"] - before
        assert 1 <= sent <= time.monotonic() - started + 2
    finally:
        eng.close()
        first.close()


def test_blocks_promoted_from_disk_name_the_block_before_them(daemon_factory, tmp_path):
    d = daemon_factory(*EVENTS, "--pool-size", "2M", "--extent-size", "1M",  # 170 blocks
                       "--policy", "lru", "--disk-path", str(tmp_path / "disk"),
                       "--disk-size", "8M")
    ks = [key(i) for i in range(4)]
    eng = Engine(d.socket)
    sub = Sub(endpoints(d)[0])
    try:
        eng.store(ks[:2])
        eng.store(ks[2:], depth=2, parent=ks[1])
        for part in range(4):  # others push the chain out of RAM, down to the disk
            eng.store([key(1000 + 64 * part + i) for i in range(64)])
        st = d.wait_counter("demoted_blocks", 4)
        assert d.status()["blocks"]["ready"] <= 170
        assert st["counters"]["demoted_blocks"] >= 4
        eng.store(ks[:2])  # the first two back in RAM; the rest only on disk
        while not sub.quiet(0.3):
            sub.recv()
        r = eng.sched.request(m.Lookup(eng.sched.next_req(), ks))
        assert (r.hits, r.pending) == (2, 2)  # the last two come up from the disk
        promoted = [c for _ in range(3) if not sub.quiet(1.0)
                    for c in chain_stored(decode(sub.recv()[2]).events)]
        assert promoted == [([published(k) for k in ks[2:]], published(ks[1]))]
    finally:
        eng.close()
        sub.close()


def test_raw_hashes_and_topic_template(daemon_factory):
    d = daemon_factory("--events-endpoint", "tcp://127.0.0.1:0", start=False)
    d.env.update(KVD_EVENTS_INT_HASHES="false", KVD_EVENTS_TOPIC="kvd/{node}/{tenant}",
                 KVD_EVENTS_NODE="n1")
    d.start()
    sub = Sub(endpoints(d)[0])
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"kvd/")
    eng = Engine(d.socket)
    try:
        eng.store([key(1), key(2, group=3)])
        topic, _, payload = sub.recv()
        events = decode(payload).events
        assert topic == b"kvd/n1/1"
        # A group change starts a new event; hashes travel as the raw bytes.
        assert events[0] == AllBlocksCleared()  # the daemon's first batch on this topic
        assert [(e.block_hashes, e.group_idx) for e in events[1:]] == [
            ([key(1)[:-4]], 0), ([key(2)[:-4]], 3)]
    finally:
        eng.close()
        sub.close()


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: send the start sequence; read until the -1 marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "replay did not finish"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert topic == b"" and payload == b""
                return out
            out.append((topic, n, payload))
    finally:
        sock.close(linger=0)


def test_replay_returns_missed_batches(events_daemon):
    pub, rep = endpoints(events_daemon)
    eng = Engine(events_daemon.socket)
    sub = Sub(pub)
    base = events_daemon.status()["events"]["next_seq"]
    try:
        live = []
        for i in range(3):
            eng.store([key(10 * i + j) for j in range(3)])
            live.append(sub.recv())
        assert [s for _, s, _ in live] == [base, base + 1, base + 2]
        assert replay(rep, base + 1) == live[1:]  # byte for byte, topic and seq included
        assert replay(rep, base) == live == replay(rep, 0)  # from before: all kept
        assert replay(rep, base + 3) == []
        assert events_daemon.status()["events"]["replay_requests"] == 4
    finally:
        eng.close()
        sub.close()


def test_bad_or_greedy_replay_requests_cannot_stall_the_daemon(events_daemon):
    """Requests from past the end or of garbage, and many from a requester that never
    reads, are answered or dropped while the daemon goes on serving; a good request
    queued behind them is answered."""
    pub, rep = endpoints(events_daemon)
    eng = Engine(events_daemon.socket)
    sub = Sub(pub)
    ctx = zmq.Context.instance()
    greedy = ctx.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.connect(rep)
    junk = ctx.socket(zmq.DEALER)
    junk.setsockopt(zmq.LINGER, 0)
    junk.connect(rep)
    try:
        eng.store([key(1), key(2)])
        live = [sub.recv()]
        assert replay(rep, 2**62) == []  # past the end: just the end marker
        junk.send_multipart([b"", b"\xff" * 8])  # -1: from the oldest kept
        frames = []
        while not frames or frames[-1][2] != b"\xff" * 8:
            assert junk.poll(5000), "no answer to a request of -1"
            frames.append(junk.recv_multipart())
        assert [f[1:] for f in frames[:-1]] == [[t, s.to_bytes(8, "big"), p]
                                                 for t, s, p in live]
        for _ in range(200):  # never read: cut short at the requester's queue limit
            greedy.send_multipart([b"", (0).to_bytes(8, "big")])
        junk.send_multipart([b"", b"not eight bytes"])
        junk.send_multipart([b"x", b"y", b"z", b"w"])
        t0 = time.monotonic()
        eng.store([key(3)])  # the daemon still serves
        assert time.monotonic() - t0 < 5
        assert replay(rep, 0)[:1] == live
        st = events_daemon.status()["events"]
        assert st["bad_replay_requests"] == 2
    finally:
        for s in (greedy, junk):
            s.close(linger=0)
        eng.close()
        sub.close()


def test_a_daemon_that_stops_without_persistence_clears_what_it_announced(events_daemon):
    pub, _ = endpoints(events_daemon)
    eng = Engine(events_daemon.socket)
    sub = Sub(pub)
    try:
        eng.store([key(1), key(2)])
        first = decode(sub.recv()[2]).events
        assert isinstance(first[-1], BlockStored)
        eng.close()
        assert events_daemon.stop() == 0  # its pool goes with it
        topic, _, payload = sub.recv()
        assert topic == TOPIC and decode(payload).events == [AllBlocksCleared()]
    finally:
        sub.close()


def test_flush_publishes_all_blocks_cleared(events_daemon, capsys):
    pub, _ = endpoints(events_daemon)
    eng = Engine(events_daemon.socket)
    sub = Sub(pub)
    try:
        ks = [key(i) for i in range(4)]
        eng.store(ks)
        sub.recv()
        # A lease keeps two blocks through the flush: they are announced again.
        lk = eng.sched.request(m.Lookup(eng.sched.next_req(), ks[:2], lease_ms=30_000))
        assert lk.hits == 2
        assert ctl.main(["--socket", events_daemon.socket, "flush"]) == 0
        topic, _, payload = sub.recv()
        events = decode(payload).events
        assert topic == TOPIC and events[0] == AllBlocksCleared()
        assert sorted(h for e in events[1:] for h in e.block_hashes) == sorted(
            published(k) for k in ks[:2])
        assert all(isinstance(e, BlockStored) for e in events[1:])
        eng.sched.request(m.Release(eng.sched.next_req(), lk.lease))
        assert ctl.main(["--socket", events_daemon.socket, "flush"]) == 0
        assert decode(sub.recv()[2]).events == [AllBlocksCleared()]
    finally:
        eng.close()
        sub.close()
        capsys.readouterr()


def test_eviction_publishes_block_removed(daemon_factory, capsys):
    d = daemon_factory(*EVENTS, "--pool-size", "2M", "--extent-size", "1M")
    sub = Sub(endpoints(d)[0])
    eng = Engine(d.socket)
    try:
        first = [key(i) for i in range(100)]
        eng.store(first)
        sub.recv()
        r = eng.store([key(i) for i in range(100, 200)])  # ~170 slots: evicts the oldest
        assert r.evicted
        # Evicted at Allocate, stored when the copy is done: two loop iterations.
        events = decode(sub.recv()[2]).events + decode(sub.recv()[2]).events
        assert sub.quiet()
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert sorted(removed) == sorted(published(k) for k in r.evicted)
        assert all(e.medium == "CPU" for e in events if isinstance(e, BlockRemoved))
        assert set(stored) == {published(key(i)) for i in range(100, 200)}
        # Admin eviction of the tenant removes the rest (``--all`` is a flush).
        assert ctl.main(["--socket", d.socket, "evict", "--tenant", "1"]) == 0
        (ev,) = decode(sub.recv()[2]).events
        assert isinstance(ev, BlockRemoved) and len(ev.block_hashes) == d.status()[
            "counters"]["evicted_blocks"] - len(r.evicted)
    finally:
        eng.close()
        sub.close()
        capsys.readouterr()


class _OtherLayout(Engine):
    """A second tenant of the same model (another page layout, as another TP size)."""

    def __init__(self, socket: str) -> None:
        self.spec = Spec(socket, pages=(4096, 4096))
        self.sched = Connection(socket, name="sched2",
                                register=m.Register(0, fingerprint(self.spec), -1))
        assert self.sched.wait_up(10)
        self.worker = Worker(self.spec)
        self.event = 0


def _sharing_a_topic(d) -> tuple[Sub, Engine, _OtherLayout, list[bytes], list[bytes]]:
    """Two tenants of one model (so one topic): A stores ``both + only_a``, B ``both``;
    their batches read."""
    sub = Sub(endpoints(d)[0])
    a, b = Engine(d.socket), _OtherLayout(d.socket)
    both, only_a = [key(i) for i in range(4)], [key(i) for i in range(4, 6)]
    a.store(both + only_a)
    b.store(both)
    while not sub.quiet():
        sub.recv()
    return sub, a, b, both, only_a


def test_a_block_another_tenant_on_the_topic_holds_is_not_said_removed(
        events_daemon, capsys):
    """Two tenants of one model share the default topic. Evicting one of them told
    routers the node had lost blocks the other still served; now only what no tenant
    on the topic holds any more is removed."""
    sub, a, b, both, only_a = _sharing_a_topic(events_daemon)
    try:
        tenants = events_daemon.status()["tenants"]
        tid_a = next(t["id"] for t in tenants if t["slot_bytes"] == sum(a.spec.pages))
        assert ctl.main(["--socket", events_daemon.socket, "evict", "--tenant",
                         str(tid_a)]) == 0
        topic, _, payload = sub.recv()
        removed = [h for e in decode(payload).events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes]
        assert topic == TOPIC and sorted(removed) == sorted(published(k) for k in only_a)
        held = b.sched.request(m.Lookup(b.sched.next_req(), both))
        assert held.hits == 4
        b.sched.request(m.Release(b.sched.next_req(), held.lease))  # evictable again
        tid_b = next(t["id"] for t in events_daemon.status()["tenants"] if t["id"] != tid_a)
        assert ctl.main(["--socket", events_daemon.socket, "evict", "--tenant",
                         str(tid_b)]) == 0
        removed = [h for e in decode(sub.recv()[2]).events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes]
        assert sorted(removed) == sorted(published(k) for k in both)  # the last holder
    finally:
        a.close()
        b.close()
        sub.close()
        capsys.readouterr()


def test_a_tenant_dropped_at_the_limit_does_not_remove_what_another_on_its_topic_holds(
        daemon_factory, tmp_path):
    """As above, when the idle tenant is dropped with its blocks at the tenant limit: it
    is gone from the tenants by the time its drops are published, and the check that
    looked for its topic's other tenants only among those present found none."""
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("max_tenants = 2\n")
    d = daemon_factory(*EVENTS, "--config", str(cfg), start=False)
    d.env["KVD_EVENTS_NODE"] = "node-a"
    d.start()
    sub, a, b, both, only_a = _sharing_a_topic(d)
    third = None
    try:
        a.close()  # tenant A idles, holding its blocks
        third = Connection(d.socket, name="third", register=m.Register(
            0, fingerprint(Spec(d.socket, model="other")), -1))
        assert third.wait_up(10)  # at the limit: A goes, with its blocks
        assert wait_for(lambda: "dropped with" in d.logs(), 10)
        removed: list[int] = []
        while not sub.quiet(1.0):  # every batch until a second of quiet
            removed += [h for e in decode(sub.recv()[2]).events
                        if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert sorted(removed) == sorted(published(k) for k in only_a)
        assert b.sched.request(m.Lookup(b.sched.next_req(), both)).hits == 4
    finally:
        b.close()
        if third is not None:
            third.close()
        sub.close()


def test_stuck_subscriber_does_not_slow_stores(daemon_factory, tmp_path):
    # ipc: small socket buffers, so a subscriber that never reads is full soon.
    d = daemon_factory("--events-endpoint", f"ipc://{tmp_path}/events.ipc",
                       "--events-hwm", "2", "--pool-size", "16M", "--extent-size", "1M")
    pub, _ = endpoints(d)
    first = d.status()["events"]["next_seq"]
    stuck = Sub(pub, rcvhwm=1, rcvbuf=4096)  # connected, never reads
    healthy = Sub(pub)
    got: list[int] = []
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if healthy.sock.poll(100):
                got.append(int.from_bytes(healthy.sock.recv_multipart()[1], "big"))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    eng = Engine(d.socket)
    try:
        worst = 0.0
        after = 0  # stores once the stuck subscriber's queue was full
        for i in range(300):  # each store evicts and stores 512 blocks: ~5 KiB batches
            t0 = time.monotonic()
            eng.store([key(512 * i + j) for j in range(512)])
            worst = max(worst, time.monotonic() - t0)
            if i >= 10 and d.status()["events"]["dropped_batches"]:
                after += 1
                if after == 30:
                    break
        st = d.status()["events"]
        assert st["dropped_batches"] > 0, "the stuck subscriber never filled its queue"
        # A publisher that blocked on the full subscriber would stall the loop here
        # (each store waits for its Done): 30 more stores go through after it filled.
        assert after == 30, st
        # (A publisher that blocked would hold a store until its timeout: this bound is
        # loose for a loaded machine, not a figure.)
        assert worst < 10.0, f"a store took {worst:.2f} s with a stuck subscriber"
        time.sleep(0.5)
        # The healthy subscriber missed nothing once it had joined: every sequence, in
        # order (on a loaded machine its subscription may reach the daemon after the
        # first batches, which it then does not see).
        assert got and got[0] >= first
        assert got == list(range(got[0], st["next_seq"]))
    finally:
        stop.set()
        reader.join(5)
        eng.close()
        stuck.close()
        healthy.close()


def test_off_by_default(daemon):
    assert daemon.status()["events"] == {"enabled": False}


def test_metrics_count_batches(daemon_factory):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(*EVENTS, "--metrics-port", str(port))
    eng = Engine(d.socket)
    try:
        eng.store([key(1)])
        time.sleep(0.3)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvd_event_batches_total 1.0" in text
        assert b"kvd_event_batches_dropped_total 0.0" in text
    finally:
        eng.close()


def test_batch_decodes_as_mirror_type():
    """The mirror types round-trip (the e2e test decodes with vLLM's own)."""
    b = KVEventBatch(1.5, [AllBlocksCleared(), BlockRemoved([1, 2], "CPU", 0)])
    assert decode(msgspec.msgpack.encode(b)) == b


def test_kvdctl_events_follows_the_stream(events_daemon, capsys):
    import json

    s = ["--socket", events_daemon.socket]
    results: list[int] = []
    t = threading.Thread(target=lambda: results.append(
        ctl.main([*s, "events", "--json", "--count", "2"])))
    t.start()
    time.sleep(0.8)  # subscribed before the first batch
    eng = Engine(events_daemon.socket)
    try:
        eng.store([key(1), key(2)])
        assert ctl.main([*s, "flush"]) == 0
        t.join(10)
        assert results == [0]
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()
                 if x.startswith("{\"topic")]
        base = lines[0]["seq"]
        assert [(x["topic"], x["seq"], x["missed"]) for x in lines] == [
            (TOPIC.decode(), base, 0), (TOPIC.decode(), base + 1, 0)]
        assert lines[0]["events"][0] == {"type": "AllBlocksCleared"}  # first on its topic
        stored = lines[0]["events"][1]
        assert stored["type"] == "BlockStored"
        assert stored["block_hashes"] == [published(key(1)), published(key(2))]
        assert lines[1]["events"] == [{"type": "AllBlocksCleared"}]
    finally:
        eng.close()


def test_kvdctl_events_neither_prints_nor_counts_heartbeats(events_daemon, capsys):
    """Its own subscription, on a topic already spoken on, brings a heartbeat."""
    import json

    s = ["--socket", events_daemon.socket]
    eng = Engine(events_daemon.socket)
    results: list[int] = []
    t = threading.Thread(target=lambda: results.append(
        ctl.main([*s, "events", "--json", "--count", "1"])))
    try:
        eng.store([key(1)])
        t.start()
        assert wait_for(lambda: events_daemon.status()["events"]["heartbeats"] >= 1, 10)
        eng.store([key(2)])
        t.join(10)
        assert results == [0]
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()
                 if x.startswith("{\"topic")]
        assert len(lines) == 1 and lines[0]["missed"] == 0
        assert [e["block_hashes"] for e in lines[0]["events"]] == [[published(key(2))]]
    finally:
        eng.close()


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://nohost", "tcp://127.0.0.1:notaport"])
def test_kvdctl_events_refuses_a_malformed_endpoint_in_one_line(endpoint, capsys):
    """It printed libzmq's traceback and exited 1, as a failure of the daemon would."""
    assert ctl.main(["--socket", "/nonexistent/kvd.sock", "events",
                     "--endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdctl: cannot subscribe to") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_kvdctl_events_when_off(daemon, capsys):
    assert ctl.main(["--socket", daemon.socket, "events"]) == 1
    assert "events_endpoint" in capsys.readouterr().err


def _oversized_subscriber(endpoint: str, out) -> None:
    """In a forked child: subscribe with a megabyte, report whether kvd hung up. It
    leaves with ``os._exit``: libzmq frees a subscriber's subscription trie
    recursively, and a megabyte-deep one overflows the stack (a client-side bug)."""
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.XSUB)
    monitor = hostile.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    hostile.connect(endpoint)
    hostile.send(b"\x01kv@" + b"x" * (1 << 20))
    dropped = bool(monitor.poll(5000)) and \
        recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    out.send(dropped)
    os._exit(0)


def test_an_oversized_subscription_drops_its_subscriber_not_the_stream(events_daemon):
    """A subscription is a topic prefix; a peer sending a megabyte for one is cut off
    (nothing of it is kept), and the stream goes on for everyone else."""
    pub, _ = endpoints(events_daemon)
    sub = Sub(pub)
    eng = Engine(events_daemon.socket)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_oversized_subscriber, args=(pub, child))
    try:
        p.start()
        assert parent.poll(20), "the subscriber reported nothing"
        assert parent.recv() is True, "kvd kept a megabyte subscription"
        eng.store([key(41)])
        topic, _, _ = sub.recv()
        assert topic.startswith(b"kv@")
    finally:
        p.join(10)
        eng.close()
        sub.close()


def test_replays_are_sent_a_bounded_number_of_batches_per_loop_pass():
    """Each replay request was answered whole within one pass of the loop, eight per
    pass: 40 requesters of a 2,700-batch buffer held the daemon's Ping 1.2 s. Now a
    pass sends at most REPLAY_BATCHES_PER_PASS batches of the replays under way, in
    turns, and every requester still gets all it asked for, in order, then the end
    marker. (The publisher and real ZeroMQ sockets; the test plays the loop.)"""
    from kvd.publisher import REPLAY_BATCHES_PER_PASS, Publisher

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=5000)
    pub.publish([(b"kv@t", b"p%d" % i, 1) for i in range(3000)])
    first = pub.seq - 3000
    ctx = zmq.Context.instance()
    peers = []
    try:
        for _ in range(20):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.replay_endpoint)
            peers.append(s)
        for i, s in enumerate(peers):  # from the start, or from its middle
            s.send_multipart([b"", (0 if i % 2 else first + 1500).to_bytes(8, "big")])
        passes, more, end = 0, True, time.monotonic() + 30
        while pub.counters.replay_requests < 20 or more:
            before = pub.counters.replayed_batches
            more = pub.service_replay()  # every pass is counted and bounded
            assert pub.counters.replayed_batches - before <= REPLAY_BATCHES_PER_PASS
            passes += 1
            assert time.monotonic() < end, "the replays did not finish"
        assert pub.counters.replayed_batches == 10 * 3000 + 10 * 1500
        assert passes >= pub.counters.replayed_batches // REPLAY_BATCHES_PER_PASS
        for i, s in enumerate(peers):
            got = []
            while True:
                assert s.poll(5000), "no end marker"
                _, topic, seq, payload = s.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                got.append((int.from_bytes(seq, "big"), payload))
            start = 0 if i % 2 else 1500
            assert got == [(first + j, b"p%d" % j) for j in range(start, 3000)]
    finally:
        for s in peers:
            s.close(linger=0)
        pub.close()


def test_ipc_endpoints_are_removed_at_the_stop(daemon_factory, tmp_path):
    """Their socket files stayed after every stop (and a failed start), as litter."""
    pub, rep = tmp_path / "ev.sock", tmp_path / "rep.sock"
    d = daemon_factory("--events-endpoint", f"ipc://{pub}",
                       "--events-replay-endpoint", f"ipc://{rep}")
    assert pub.is_socket() and rep.is_socket()
    sub = Sub(f"ipc://{pub}")  # and it serves there
    eng = Engine(d.socket)
    try:
        eng.store([key(1)])
        assert sub.recv()[0].startswith(b"kv@")
    finally:
        eng.close()
        sub.close()
    assert d.stop() == 0
    assert not pub.exists() and not rep.exists()


class _SmallPages(Engine):
    """A tenant of small blocks, so that a pool holds many of them."""

    def __init__(self, socket: str, page: int = 2048) -> None:
        self.spec = Spec(socket, model="small", pages=(page, page))
        self.sched = Connection(socket, name="small",
                                register=m.Register(0, fingerprint(self.spec), -1))
        assert self.sched.wait_up(10)
        self.worker = Worker(self.spec)
        self.event = 0


def test_a_flush_of_many_blocks_goes_in_parts_and_ends_with_all_cleared(daemon_factory,
                                                                        capsys):
    """A flush larger than one part (``kvd.admin.EVICT_PART``) is answered after its last
    part, with every block counted, and routers are told the node holds nothing."""
    n = 2 * EVICT_PART + 100
    d = daemon_factory(*EVENTS, "--pool-size", f"{(n * 4096 >> 20) + 8}M",
                       "--extent-size", "1M")
    sub = Sub(endpoints(d)[0])
    eng = _SmallPages(d.socket)
    try:
        for i in range(0, n, 4096):  # (at most 3/4 of the pool is pending at once)
            ks = [key(j) for j in range(i, min(n, i + 4096))]
            assert NO_SLOT not in unpack_u32(eng.store(ks).slots)
        assert d.status()["blocks"]["ready"] == n
        while not sub.quiet():
            sub.recv()
        assert ctl.main(["--socket", d.socket, "flush", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["evicted_blocks"] == n
        last = []
        while not sub.quiet(1.0):
            last = decode(sub.recv()[2]).events
        assert last == [AllBlocksCleared()]
        assert d.status()["blocks"]["ready"] == 0
    finally:
        eng.close()
        sub.close()
        capsys.readouterr()


def _filled(daemon_factory, n: int, *args: str):
    """A daemon holding ``n`` blocks of 256 bytes."""
    d = daemon_factory(*args, "--pool-size", f"{(n * 256 >> 20) + 8}M", "--extent-size",
                       "1M", env={"KVD_MIN_SLOT_BYTES": "256"})
    eng = _SmallPages(d.socket, page=128)
    try:
        for i in range(0, n, 8192):
            ks = [key(j) for j in range(i, min(n, i + 8192))]
            assert NO_SLOT not in unpack_u32(eng.store(ks).slots)
    finally:
        eng.close()
    assert d.status()["blocks"]["ready"] == n
    return d


def test_kvdctl_waits_for_an_eviction_past_its_timeout_while_kvd_answers(daemon_factory,
                                                                          capsys):
    """An eviction in parts may take longer than --timeout (here about 0.5 s against
    0.2): kvdctl waits on while kvd answers its pings (within --timeout each), and gives
    up on a hung kvd at once."""
    n = 12 * EVICT_PART
    d = _filled(daemon_factory, n)
    assert ctl.main(["--socket", d.socket, "--timeout", "0.2", "flush", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted_blocks"] == n
    with AdminClient(d.socket, 0.3) as c:
        c.connect()
        ctl._evicting(c)  # (as kvdctl evict/flush wait: up to 120 s)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(Unreachable):
                c.request(m.Flush)
            assert time.monotonic() - t0 < 2.0  # its ping unanswered, not 120 s
        finally:
            d.proc.send_signal(signal.SIGCONT)


def test_a_stop_during_a_flush_in_parts_finishes_it_and_answers(daemon_factory, capsys):
    """SIGTERM while a flush went in parts: the flush's next parts ran after the journal
    and the event stream had closed (``journal append failed: Bad file descriptor``,
    ``publishing KV events failed``), and kvdctl waited for an answer that never came."""
    n = 12 * EVICT_PART
    d = _filled(daemon_factory, n, *EVENTS, "--persist")
    out: dict[str, object] = {}

    def flush() -> None:
        with AdminClient(d.socket, 60.0) as c:
            out["reply"] = c.request(m.Flush)

    asking = threading.Thread(target=flush, daemon=True)
    asking.start()
    assert wait_for(lambda: d.status()["blocks"]["ready"] < n, 10)
    d.proc.send_signal(signal.SIGTERM)
    asking.join(30)
    reply = out.get("reply")
    assert isinstance(reply, m.Ok) and reply.count == n, out
    assert d.proc.wait(30) == 0
    after = d.logs().split("kvd stopped", 1)[1]
    assert "ERROR" not in after and "Traceback" not in after, after[-3000:]
