"""Layers point one way: core <- proto <- daemon shell / client <- vLLM integration."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def modules(directory: str) -> list[Path]:
    return sorted((ROOT / directory).rglob("*.py"))


@pytest.mark.parametrize("path", modules("kvd/core"), ids=lambda p: p.name)
def test_core_imports_only_the_standard_library_and_numpy(path):
    for name in imports(path):
        top = name.split(".")[0]
        assert top in STDLIB or top == "numpy" or name.startswith("kvd.core"), (path, name)


@pytest.mark.parametrize("path", modules("proto"), ids=lambda p: p.name)
def test_proto_imports_neither_daemon_nor_client(path):
    for name in imports(path):
        assert name.split(".")[0] not in ("kvd", "kvd_client"), (path, name)


@pytest.mark.parametrize("path", modules("client"), ids=lambda p: p.name)
def test_client_does_not_import_the_daemon(path):
    for name in imports(path):
        assert name.split(".")[0] != "kvd", (path, name)


@pytest.mark.parametrize("path", [p for p in modules("kvd") if "core" not in p.parts],
                         ids=lambda p: p.name)
def test_daemon_does_not_import_the_client_library_or_vllm(path):
    for name in imports(path):
        top = name.split(".")[0]
        assert top != "vllm" and not name.startswith("kvd_client.vllm"), (path, name)


def test_importing_the_packages_loads_no_cuda_torch_or_vllm():
    code = ("import sys, kvd, kvd.server, kvd.service, kvd_proto, kvd_client, kvd.cli.ctl;"
            "bad = [m for m in ('torch', 'vllm', 'cuda', 'cuda.bindings') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
