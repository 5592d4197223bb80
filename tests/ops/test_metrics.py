"""The Prometheus endpoint after real traffic agrees with `kvdctl status --json`."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvd.cli import ctl
from kvd.metrics import COUNTERS, LoopSnapshot, Metrics
from kvd_client import Connection
from kvd_proto import messages as m
from kvd_proto.ids import unpack_u32
from tests.daemon.workers import Spec, Worker, fingerprint
from tests.waiting import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}{i:05d}".encode().ljust(36, b"\0") for i in range(n)]


def status_json(d, capsys) -> dict:
    assert ctl.main(["--socket", d.socket, "status", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_counters_match_kvdctl_status_after_real_traffic(daemon_factory, capsys):
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    spec = Spec(d.socket)
    sched = Connection(d.socket, name="sched", register=m.Register(0, fingerprint(spec), -1))
    assert sched.wait_up(10)
    w = Worker(spec)
    try:
        ks = keys(12, "a")
        r = sched.request(m.Allocate(sched.next_req(), ks))
        assert w.store(1, range(12), unpack_u32(r.slots))[1] == 0
        hit = sched.request(m.Lookup(sched.next_req(), ks + keys(4, "miss")))
        assert hit.hits == 12
        assert w.load(2, range(20, 32), unpack_u32(hit.slots))[1] == 0
        assert w.load(3, [1], [10**6])[1] == m.Code.BAD_IDS  # one error by code
        sched.request(m.Release(sched.next_req(), hit.lease))
    finally:
        w.close()
        sched.close()

    st = status_json(d, capsys)
    got = scrape(port)
    c = st["counters"]
    assert c["stored_blocks"] == 12 and c["loaded_blocks"] == 12 and c["hit_blocks"] == 12
    for name, key, _ in COUNTERS:
        if key != "requests":  # kvdctl's own requests land between the two reads
            assert got[(name + "_total", ())] == c[key], name
    assert got[("kvd_missed_blocks_total", ())] == c["lookup_keys"] - c["hit_blocks"] == 4
    assert got[("kvd_hit_tokens_total", ())] == 12 * 16  # the workers' block_tokens
    assert got[("kvd_missed_tokens_total", ())] == 4 * 16
    assert got[("kvd_errors_total", (("code", "BAD_IDS"),))] == c["errors_by_code"]["BAD_IDS"]
    assert got[("kvd_pool_capacity_bytes", ())] == st["pool"]["capacity_bytes"]
    assert got[("kvd_pool_used_bytes", ())] == st["pool"]["used_bytes"]
    assert got[("kvd_blocks", (("state", "ready"),))] == st["blocks"]["ready"] == 12
    t = st["tenants"][0]
    labels = (("model", t["model"]), ("tenant", str(t["id"])))
    assert got[("kvd_tenant_used_bytes", labels)] == t["bytes"] > 0
    assert got[("kvd_tenant_blocks", labels)] == 12
    assert got[("kvd_phase", (("phase", "serving"),))] == 1
    # One latency observation per transfer, by direction and outcome.
    assert got[("kvd_transfer_seconds_count", (("direction", "store"), ("outcome", "ok")))] == 1
    assert got[("kvd_transfer_seconds_count", (("direction", "load"), ("outcome", "ok")))] == 1
    assert got[("kvd_status_age_seconds", ())] < 1.0
    assert st["metrics"] == f"http://127.0.0.1:{port}/metrics"
    assert d.stop() == 0


def test_a_scrape_of_named_metrics_gets_kvds(daemon_factory):
    """``/metrics?name[]=...`` (a scraper asking for a few series) got none of the
    status collector's: only the transfer histogram answered a filter."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    url = (f"http://127.0.0.1:{port}/metrics?name[]=kvd_status_age_seconds"
           "&name[]=kvd_requests_total&name[]=kvd_transfer_seconds_count")
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert {"kvd_status_age_seconds", "kvd_requests_total"} <= names, text
    assert not any(n.startswith("kvd_pool") for n in names)  # filtered: only those asked
    assert d.proc.poll() is None


def test_port_zero_disables_the_endpoint(daemon_factory, capsys):
    d = daemon_factory("--metrics-port", "0")
    assert status_json(d, capsys)["metrics"] == ""
    assert "metrics on" not in d.logs()


def test_a_busy_port_is_logged_not_fatal(daemon_factory, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        d = daemon_factory("--metrics-port", str(s.getsockname()[1]))
        assert status_json(d, capsys)["phase"] == "serving"
    assert "metrics endpoint not started" in d.logs()


def test_registry_is_injected_and_survives_an_unanswering_loop():
    registry = CollectorRegistry()
    doc = {"counters": {"lookup_keys": 10, "hit_blocks": 4, "errors_by_code": {"BUSY": 2}},
           "pool": {"capacity_bytes": 100, "used_bytes": 50}, "tenants": [], "clients": []}
    metrics = Metrics(lambda: (doc, 3.5), registry)
    metrics.observe_transfer("load", True, 0.002)
    text = generate_latest(registry).decode()
    assert "kvd_missed_blocks_total 6.0" in text
    assert 'kvd_errors_total{code="BUSY"} 2.0' in text
    assert "kvd_status_age_seconds 3.5" in text
    assert 'kvd_transfer_seconds_bucket{direction="load",le="0.0025",outcome="ok"} 1.0' in text
    empty = Metrics(lambda: ({}, float("inf")), CollectorRegistry())  # no document yet
    assert "kvd_status_age_seconds +Inf" in generate_latest(empty.registry).decode()


def test_an_ipv6_endpoint_is_named_by_a_url_that_works():
    """``metrics_addr = "::1"`` was reported as http://::1:PORT/metrics (no URL)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    metrics = Metrics(lambda: ({}, 0.0), CollectorRegistry())
    port = free_port()
    address = metrics.serve("::1", port)
    try:
        assert address == f"http://[::1]:{port}/metrics"
        with urllib.request.urlopen(address, timeout=10) as r:
            assert b"kvd_status_age_seconds" in r.read()
    finally:
        metrics.close()


def test_an_empty_address_serves_on_every_interface():
    """``metrics_addr = ""`` passes the config check (every interface) but reached
    prometheus-client as is, which cannot bind it: no endpoint, a log line only."""
    metrics = Metrics(lambda: ({}, 0.0), CollectorRegistry())
    port = free_port()
    address = metrics.serve("", port)
    try:
        assert address == f"http://0.0.0.0:{port}/metrics"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"kvd_status_age_seconds" in r.read()
    finally:
        metrics.close()


def test_idle_connections_neither_pile_up_threads_nor_stay(monkeypatch, capfd):
    """Each connection to the endpoint held a thread for as long as it stayed open, with
    no bound: idle or trickling connections piled threads up in the daemon."""
    import threading
    import time

    from kvd import metrics as km

    monkeypatch.setattr(km, "HTTP_CONNECTIONS", 4)
    monkeypatch.setattr(km._Handler, "timeout", 2.0)
    metrics = Metrics(lambda: ({}, 0.0), CollectorRegistry())
    port = free_port()
    address = metrics.serve("127.0.0.1", port)
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        assert wait_for(lambda: threading.active_count() == threads + 4, 1.5)
        with socket.create_connection(("127.0.0.1", port)) as extra:  # a fifth: closed
            extra.settimeout(5)
            assert extra.recv(1) == b""
        for s in idle:  # each closed by the server once its read waited 2 s
            s.settimeout(10)
            assert s.recv(1) == b""
        deadline = time.monotonic() + 5
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() == threads
        with urllib.request.urlopen(address, timeout=10) as r:  # served as before
            assert b"kvd_status_age_seconds" in r.read()
        assert "Traceback" not in capfd.readouterr().err  # (timeouts printed them)
    finally:
        for s in idle:
            s.close()
        metrics.close()


def test_snapshot_falls_back_when_the_loop_does_not_run():
    loop = asyncio.new_event_loop()  # never run: like a hung event loop
    snap = LoopSnapshot(loop, lambda: {"taken": True}, timeout=0.1)
    assert snap.get() == ({}, float("inf"))
    loop.close()  # and a closed one (the daemon exiting) does not raise either
    assert snap.get() == ({}, float("inf"))


def test_an_endpoint_out_of_descriptors_does_not_spin():
    """An accept that found no descriptor left (event subscribers held them all) left
    the listener readable, and the metrics thread retried at once: a second core
    spinning as long as descriptors stayed short."""
    import os
    import resource
    import time

    from kvd.metrics import _serve
    from tests.waiting import in_child

    def calm() -> bool:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        server = _serve("127.0.0.1", 0, CollectorRegistry())
        port = server.server_address[1]
        go_r, go_w = os.pipe()
        if os.fork() == 0:  # the scraper, with descriptors of its own
            os.read(go_r, 1)
            held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            time.sleep(3)
            del held
            os._exit(0)
        filler = []
        while True:
            try:
                filler.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        os.write(go_w, b"x")
        time.sleep(0.3)
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.5)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return cpu < 0.5

    assert in_child(calm, 30) == 0
