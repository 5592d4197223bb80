"""Run a real vLLM engine on the CPU through a list of steps; print one JSON line each.

Run it in a subprocess, by path or as a module::

    python tests/e2e/_engine.py '{"model": "/path/to/model", "steps": [...]}'
    python tests/e2e/_engine.py config.json
    echo '{...}' | python -m tests.e2e._engine -      # from the repository root

The configuration (JSON object):

``model``               model directory (required; also used as the tokenizer)
``kv_transfer_config``  a ``KVTransferConfig`` as a dict, or null for no connector
``multiprocessing``     false (default): scheduler and worker in this process (engine
                        start ~2 s); true: vLLM spawns an engine-core and a worker
                        process (engine start ~12 s)
``llm``                 extra keyword arguments for ``vllm.LLM`` (override the defaults,
                        e.g. ``{"enforce_eager": false}`` to use torch.compile: ~8 s
                        engine start, ~30 s with a cold compile cache)
``env``                 extra environment variables, set before vLLM is imported
``steps``               list of steps, run in order:

  ``{"op": "generate", "prompt": str | "prompt_token_ids": [int], "max_tokens": 8}``
      one greedy request (temperature 0, EOS ignored). ``"prompts": [...]`` runs a
      batch instead (one result per prompt in ``outputs``).
  ``{"op": "reset_prefix_cache"}``  drop vLLM's own prefix cache (forces a load or a
      recompute of the next request's prefix); ``"reset_connector": true`` also calls
      the connector's ``reset_cache`` (the offloading manager's ``reset_cache``)
  ``{"op": "sleep", "seconds": s}``
  ``{"op": "tokenize", "prompt": str}``  the prompt's token ids, as vLLM sees them
  ``{"op": "touch", "path": str}``  create a file (tell the test a point was reached)
  ``{"op": "wait_file", "path": str, "timeout": 120}``  wait until a file exists (the
      test or another engine says go on); coordinates engines run side by side

Output: every result is one line on stdout, ``RESULT_PREFIX`` followed by a JSON object
(vLLM logs to stdout as well, so the prefix is how results are found). The first one is
``{"op": "ready", ...}`` with the import and engine-start times, then one per step, then
``{"op": "done", ...}``. A failing step prints ``{"op": "error", ...}`` and exits 1.
A ``generate`` result carries ``token_ids``, ``text``, ``finish_reason`` (``"error"``
when vLLM failed the request, e.g. a KV load failure under the default
``kv_load_failure_policy="fail"``), ``prompt_len``, ``num_cached_tokens`` (prefix
tokens not computed by this request: vLLM's prefix-cache hits plus tokens loaded by
a connector), ``request_id`` and ``elapsed_s``. Every step result also has ``cpu_s``,
the CPU time this process used during it (all its threads; in-process mode that is the
whole engine).

This file imports only the standard library and vLLM; it must not import kvd.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

RESULT_PREFIX = "@@KVD-E2E@@ "


def _enable_amx() -> None:
    """Ask the kernel for AMX tile state before any attention kernel runs.

    vLLM's CPU attention picks its AMX kernel on CPUs that have AMX, but only torch
    inductor requests the AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM), so with
    ``enforce_eager`` the first attention call dies with SIGILL. Done at module level
    on purpose: vLLM spawns its engine-core process, which re-imports this script as
    ``__mp_main__`` and so gets the permission too.
    """
    try:
        import torch

        torch.cpu._init_amx()
    except Exception:  # no AMX, or an older torch: nothing to do
        pass


if __name__ in ("__main__", "__mp_main__"):  # not when conftest imports RESULT_PREFIX
    _enable_amx()

# Offline, small and quiet (how vLLM runs on a CPU-only machine). Callers may override any.
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # With a kv_transfer_config vLLM reserves one more core; reserving one always keeps
    # timings comparable between runs with and without a connector. (Only multiprocess
    # engines pin their worker and so honour it; in-process ones compute on every core.)
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # PYTHONHASHSEED is deliberately left alone: when set it becomes the seed of vLLM's
    # root block hash (NONE_HASH), even for sha256. Unset, sha256 block hashes use a
    # fixed seed and agree across processes, as in production. Pass it in ``env`` to
    # test a different root hash.
}

DEFAULT_LLM_KWARGS = {
    "enable_prefix_caching": True,
    "max_model_len": 8192,
    "seed": 0,
    "dtype": "bfloat16",
    # Skip torch.compile: engine start ~2 s instead of ~8 s (30 s on a cold compile
    # cache). Outputs are deterministic in either mode, but not equal across modes.
    "enforce_eager": True,
}


def emit(result: dict) -> None:
    """Print one result line (flushed, so a parent sees it even if we die next)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def read_config(argv: list[str]) -> dict:
    if len(argv) > 1 and argv[1] != "-":
        text = argv[1]
        if not text.lstrip().startswith("{") and os.path.isfile(text):
            with open(text) as f:
                text = f.read()
    else:
        text = sys.stdin.read()
    config = json.loads(text)
    if not isinstance(config, dict) or "model" not in config:
        raise SystemExit("config must be a JSON object with a 'model' key")
    return config


def apply_env(config: dict) -> None:
    """Set the environment before vLLM is imported (it reads most of it at import)."""
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
        "1" if config.get("multiprocessing", False) else "0"
    )
    for key, value in (config.get("env") or {}).items():
        os.environ[str(key)] = str(value)


def _request_result(out, elapsed: float) -> dict:
    completion = out.outputs[0]
    return {
        "request_id": out.request_id,
        "prompt_len": len(out.prompt_token_ids or ()),
        "num_cached_tokens": out.num_cached_tokens,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "text": completion.text,
        "elapsed_s": round(elapsed, 6),
    }


class _StepCounter:
    """Counts the engine's steps until the first one that returns a token (in-process
    engines only: ``first_token`` stays None in multiprocess mode)."""

    def __init__(self, llm) -> None:
        client = llm.llm_engine.engine_core
        self.core = getattr(client, "engine_core", None)  # InprocClient only
        self.first_token: int | None = None
        self._calls = 0

    def __enter__(self) -> _StepCounter:
        if self.core is not None:
            step = self._orig = self.core.step_fn

            def counted():
                outputs, executed = step()
                self._calls += 1
                if self.first_token is None and any(
                        o.new_token_ids for eco in outputs.values() for o in eco.outputs):
                    self.first_token = self._calls
                return outputs, executed

            self.core.step_fn = counted
        return self

    def __exit__(self, *exc) -> None:
        if self.core is not None:
            self.core.step_fn = self._orig


def run_steps(llm, steps: list[dict]) -> None:
    from vllm import SamplingParams

    for index, step in enumerate(steps):
        op = step.get("op")
        started = time.perf_counter()
        cpu_started = time.process_time()
        result: dict = {"op": op, "step": index}
        if op == "generate":
            params = SamplingParams(
                temperature=0.0,
                max_tokens=int(step.get("max_tokens", 8)),
                ignore_eos=True,
                seed=0,
            )
            if "prompts" in step:
                prompts = list(step["prompts"])
            elif "prompt_token_ids" in step:
                prompts = [{"prompt_token_ids": list(step["prompt_token_ids"])}]
            else:
                prompts = [step["prompt"]]
            with _StepCounter(llm) as counter:
                outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            results = [_request_result(o, elapsed) for o in outs]
            if counter.first_token is not None:
                result["steps_to_first_token"] = counter.first_token
            if "prompts" in step:
                result["outputs"] = results
            else:
                result.update(results[0])
        elif op == "reset_prefix_cache":
            result["ok"] = bool(
                llm.reset_prefix_cache(
                    reset_connector=bool(step.get("reset_connector", False))
                )
            )
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
        elif op == "touch":
            with open(step["path"], "w"):
                pass
        elif op == "wait_file":
            deadline = time.monotonic() + float(step.get("timeout", 120))
            while not os.path.exists(step["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step['path']} did not appear")
                time.sleep(0.02)
        elif op == "tokenize":
            tokenizer = llm.get_tokenizer()
            result["token_ids"] = list(tokenizer.encode(step["prompt"]))
        else:
            raise ValueError(f"unknown step op {op!r} (step {index})")
        result["elapsed_s"] = round(time.perf_counter() - started, 6)
        result["cpu_s"] = round(time.process_time() - cpu_started, 6)  # this process only
        emit(result)


def main(argv: list[str]) -> int:
    config = read_config(argv)
    apply_env(config)
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM

        t_import = time.perf_counter() - t0
        kwargs = dict(DEFAULT_LLM_KWARGS)
        kwargs.update(model=config["model"], tokenizer=config["model"])
        if config.get("kv_transfer_config") is not None:
            kwargs["kv_transfer_config"] = dict(config["kv_transfer_config"])
        kwargs.update(config.get("llm") or {})
        t1 = time.perf_counter()
        llm = LLM(**kwargs)
        emit(
            {
                "op": "ready",
                "pid": os.getpid(),
                "vllm_version": vllm.__version__,
                "multiprocessing": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1",
                "import_s": round(t_import, 3),
                "engine_start_s": round(time.perf_counter() - t1, 3),
            }
        )
        run_steps(llm, list(config.get("steps") or ()))
    except BaseException as exc:  # report, then fail: the parent reads the reason
        emit(
            {
                "op": "error",
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    emit({"op": "done", "total_s": round(time.perf_counter() - t0, 3)})
    # Shut the engine down explicitly: in multiprocess mode this stops the engine-core
    # process instead of leaving it to the interpreter's exit hooks.
    shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if shutdown is not None and hasattr(shutdown, "shutdown"):
        try:
            shutdown.shutdown()
        except Exception:  # best effort at exit; the results are already out
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
