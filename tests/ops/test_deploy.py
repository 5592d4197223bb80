"""Every file in deploy/ parses, and says what a real systemd or Kubernetes needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from kvd.config import Config, load
from kvd.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "kvd.service"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax, strictly: sections, Key=value, repeated keys kept in order,
    backslash continuations; anything else is an error."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    lines = iter(text.splitlines())
    for n, line in enumerate(lines, 1):
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines)
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        if s.startswith("["):
            assert re.fullmatch(r"\[[A-Za-z]+\]", s), f"line {n}: bad section {s!r}"
            current = sections.setdefault(s[1:-1], {})
            continue
        assert current is not None, f"line {n}: key outside a section"
        key, sep, value = s.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"line {n}: {s!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_has_what_the_issue_requires():
    u = parse_unit(UNIT.read_text())
    svc = {k: v[-1] for k, v in u["Service"].items()}
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["WatchdogSec"] and svc["Restart"] == "on-failure"
    assert svc["RuntimeDirectory"] == "kvd" and svc["LimitMEMLOCK"] == "infinity"
    assert svc["ExecStart"].split()[1:3] == ["serve", "--config"]
    # A reload that waits for the read (kill -HUP returned before it), asked on the socket
    # kvd serves on (in the unit's RuntimeDirectory), SIGHUP when it cannot be asked.
    reload = svc["ExecReload"].split()
    assert reload[0].endswith("/kvdctl") and reload[3:] == ["reload", "--pid", "$MAINPID"]
    assert reload[1:3] == ["--socket", f"/run/{svc['RuntimeDirectory']}/kvd.sock"]
    devices = " ".join(u["Service"]["DeviceAllow"])
    for dev in ("nvidiactl", "nvidia-uvm", "nvidia-frontend", "nvidia-caps"):
        assert f"char-{dev} rw" in devices
    # Hardening known to break CUDA must not be there (cuda.md, "systemd on GPU nodes").
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "PrivateIPC", "ProtectProc",
                "ProcSubset", "SystemCallFilter", "PrivateTmp"):
        assert key not in u["Service"], key
    assert u["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze missing")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at this venv's kvd.
    kvd = Path(sys.executable).parent / "kvd"
    unit = tmp_path / "kvd.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/kvd", str(kvd)))
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stderr.strip() == "" and p.stdout.strip() == "", \
        p.stdout + p.stderr


@pytest.mark.skipif(not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")),
                    reason="systemd tools missing")
def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path):
    for kind in ("sysusers.d", "tmpfiles.d"):
        (tmp_path / "etc" / kind).mkdir(parents=True)
        shutil.copy(DEPLOY / kind / "kvd.conf", tmp_path / "etc" / kind / "kvd.conf")
    for tool in (["systemd-sysusers"], ["systemd-tmpfiles", "--create"]):
        p = subprocess.run([*tool, f"--root={tmp_path}"], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and "ignoring" not in p.stderr.lower(), p.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert re.search(r"^kvd:x:\d+:\d+:.*:/var/lib/kvd:/usr/sbin/nologin$", passwd, re.M)
    assert (tmp_path / "etc" / "group").read_text().startswith("kvd:")
    for d in ("run/kvd", "var/lib/kvd"):
        st = (tmp_path / d).stat()
        assert oct(st.st_mode & 0o777) == "0o750" and st.st_uid != 0, d


def test_tmpfiles_and_sysusers_syntax():
    for line in _entries(DEPLOY / "tmpfiles.d" / "kvd.conf"):
        typ, path, mode, user, group, *_ = line.split()
        assert typ == "d" and path.startswith("/") and re.fullmatch(r"0[0-7]{3}", mode)
        assert (user, group) == ("kvd", "kvd")
    entries = _entries(DEPLOY / "sysusers.d" / "kvd.conf")
    assert entries and entries[0].split()[:2] == ["u", "kvd"]


def _entries(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_example_config_lists_every_key_with_its_default():
    text = (DEPLOY / "kvd.toml").read_text()
    active = tomllib.loads(text)
    commented = tomllib.loads("\n".join(
        ln[2:] for ln in text.splitlines() if re.match(r"# [a-z_]+ = ", ln)))
    fields = set(Config.__struct_fields__)
    assert set(active) | set(commented) == fields, "document every key in deploy/kvd.toml"
    assert not set(active) & set(commented)
    defaults = msgspec.to_builtins(Config())
    normal, _ = load(None, {}, commented)  # sizes like "512M" normalised
    for key in commented:
        assert msgspec.to_builtins(normal)[key] == defaults[key], f"{key}: not the default"
    cfg, origin = load(str(DEPLOY / "kvd.toml"), {})
    assert cfg.socket == "/run/kvd/kvd.sock" and origin["socket"].startswith("file")


def test_daemonset_shares_what_vllm_pods_need():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "daemonset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Namespace", "ConfigMap", "DaemonSet"}
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostIPC"] is True
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert sorted(host.values()) == ["/dev/shm", "/run/kvd"]
    (c,) = pod["containers"]
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm" and mounts["run"] == "/run/kvd"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[0] == "kvdctl" and "health" in cmd
    assert "--live" in c["livenessProbe"]["exec"]["command"]
    assert "--live" not in c["readinessProbe"]["exec"]["command"]
    assert {"IPC_LOCK", "SYS_PTRACE"} <= set(c["securityContext"]["capabilities"]["add"])
    assert any(e["name"] == "NVIDIA_VISIBLE_DEVICES" for e in c["env"])
    # The embedded config is a valid kvd config.
    toml = kinds["ConfigMap"]["data"]["kvd.toml"]
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "kvd.toml"
    path.write_text(toml)
    cfg, _ = load(str(path), {})
    assert cfg.socket == "/run/kvd/kvd.sock" and cfg.metrics_port == 9727
    assert str(cfg.metrics_port) == kinds["DaemonSet"]["spec"]["template"]["metadata"][
        "annotations"]["prometheus.io/port"]


def test_grafana_dashboard_uses_only_metrics_kvd_exports():
    dash = json.loads((DEPLOY / "grafana" / "kvd.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    registry = CollectorRegistry()
    doc = {"counters": {"lookup_keys": 0, "hit_blocks": 0, "lookup_tokens": 0,
                        "hit_tokens": 0, "errors_by_code": {}},
           "pool": {}, "pinning": {"pinned_bytes": 0}, "tenants": [], "clients": []}
    doc["counters"].update({k: 0 for k in ("requests", "lookups", "stored_blocks",
                                           "stored_bytes", "loaded_blocks", "loaded_bytes",
                                           "evicted_blocks", "failed_stores",
                                           "failed_transfers", "expired_leases",
                                           "expired_pending", "no_space")})
    Metrics(lambda: (doc, 0.0), registry)
    exported = set(re.findall(r"^# TYPE (\w+) ", generate_latest(registry).decode(), re.M))
    exported |= {f"{n}_total" for n in exported} | {f"{n}_bucket" for n in exported}
    exported |= {"kvd_tenant_used_bytes", "kvd_tenant_clients"}  # families empty w/o tenants
    used = {n for e in exprs for n in re.findall(r"\bkvd_\w+", e)}
    assert used <= exported, used - exported
