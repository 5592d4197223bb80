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


# The core is pure: it never reads a clock, a file, a socket or a thread of its own (the
# shell passes ``now`` in and does the I/O around it).
IO_MODULES = {
    "asyncio", "ctypes", "fcntl", "io", "logging", "mmap", "multiprocessing", "os",
    "pathlib", "select", "selectors", "shutil", "signal", "socket", "subprocess", "sys",
    "tempfile", "threading", "time", "urllib", "http",
}


@pytest.mark.parametrize("path", modules("kvd/core"), ids=lambda p: p.name)
def test_core_imports_no_io_module(path):
    for name in imports(path):
        assert name.split(".")[0] not in IO_MODULES, (path, name)


PACKAGES = {"kvd": ROOT / "kvd", "kvd_proto": ROOT / "proto", "kvd_client": ROOT / "client"}


def module_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports: every import statement, also those
    under ``TYPE_CHECKING`` and inside functions (a deferred import is still a cycle)."""
    files: dict[str, Path] = {}
    for package, directory in packages.items():
        for path in directory.rglob("*.py"):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:  # a module, or the package that holds the name
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def first_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                raise _Found(path[path.index(target):] + [target])
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    try:
        for module in sorted(graph):
            if module not in state:
                visit(module)
    except _Found as found:
        return found.cycle
    return []


class _Found(Exception):
    def __init__(self, cycle: list[str]) -> None:
        self.cycle = cycle


def test_no_import_cycles():
    cycle = first_cycle(module_graph(PACKAGES))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_deferred_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.a import A\n")
    assert first_cycle(module_graph({"pkg": pkg})) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def late():\n    from pkg.a import A\n")
    assert first_cycle(module_graph({"pkg": pkg})) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("import numpy\n")
    assert first_cycle(module_graph({"pkg": pkg})) == []


@pytest.mark.parametrize("path", modules("proto"), ids=lambda p: p.name)
def test_proto_imports_neither_daemon_nor_client(path):
    for name in imports(path):
        assert name.split(".")[0] not in ("kvd", "kvd_client"), (path, name)


@pytest.mark.parametrize("path", modules("client"), ids=lambda p: p.name)
def test_client_does_not_import_the_daemon(path):
    for name in imports(path):
        assert name.split(".")[0] != "kvd", (path, name)


# What the daemon shares with the client library: the CUDA seam and the run coalescing.
DAEMON_MAY_IMPORT = {"kvd_client.cudart", "kvd_client.runs"}


@pytest.mark.parametrize("path", [p for p in modules("kvd") if "core" not in p.parts],
                         ids=lambda p: p.name)
def test_daemon_does_not_import_the_client_library_or_vllm(path):
    for name in imports(path):
        top = name.split(".")[0]
        assert top != "vllm", (path, name)
        assert top != "kvd_client" or name in DAEMON_MAY_IMPORT, (path, name)


def test_the_wire_package_holds_messages_and_ids_only():
    assert sorted(p.name for p in (ROOT / "proto").iterdir()
                  if p.name != "__pycache__") == ["__init__.py", "ids.py", "messages.py"]


def test_importing_the_packages_loads_no_cuda_torch_or_vllm():
    code = ("import sys, kvd, kvd.server, kvd.service, kvd_proto, kvd_client, kvd.cli.ctl;"
            "bad = [m for m in ('torch', 'vllm', 'cuda', 'cuda.bindings') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
