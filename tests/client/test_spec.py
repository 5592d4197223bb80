"""What the spec vLLM builds makes of an engine: its tenant (who may share its blocks)
and, for a layout kvd cannot serve, an engine that serves on without offloading."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvd.core.tenants import fingerprint_digest  # noqa: E402
from kvd_client.vllm.fingerprint import UNNAMED, config_digest  # noqa: E402
from kvd_client.vllm.off import ManagerOff, OffloadOff  # noqa: E402
from kvd_client.vllm.spec import KvdOffloadingSpec  # noqa: E402
from kvd_client.vllm.weights import weights_stamp  # noqa: E402

PAGE = 4096


def spec(model: str, extra: dict | None = None, *, engine: str = "e0", pcp: int = 1,
         chunk: int = 1) -> KvdOffloadingSpec:
    return KvdOffloadingSpec(OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=2 * PAGE, enable_kv_cache_events=False,
        extra_config={"spec_name": "KvdOffloadingSpec", **(extra or {})}, engine_id=engine,
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=chunk),
        parallel=OffloadingParallelConfig(0, pcp, 1, 1, pcp, 1, 0, 1, None, True)))


def tenant(s: KvdOffloadingSpec) -> str:
    return fingerprint_digest(msgspec.structs.asdict(s.fingerprint))


def _model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "model.safetensors").write_bytes(b"\x01" * 100_000)
    return path


def test_weights_not_found_keep_the_tenant_to_the_engine_run(monkeypatch) -> None:
    """Shared by the model's name alone, an engine of that name with other weights (an
    update in place, a re-download) would load the old weights' KV."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, b = spec("no-such-org/no-such-model"), spec("no-such-org/no-such-model", engine="e1")
    assert a.fingerprint.extra.endswith(";engine=e0")
    assert tenant(a) != tenant(b)
    # Named by the user, or the stamp turned off on purpose: shared by that name.
    named = [spec("no-such-org/no-such-model", {"kvd_model_version": "v7"}, engine=e)
             for e in ("e0", "e1")]
    assert tenant(named[0]) == tenant(named[1])
    assert spec("no-such-org/no-such-model",
                {"kvd_model_version": ""}).fingerprint.extra == "vllm-offloading/1"


def test_a_hub_model_in_vllms_download_dir_is_stamped(tmp_path: Path, monkeypatch) -> None:
    """``--download-dir`` puts the hub cache elsewhere; the stamp looks there."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _model(tmp_path / "dl" / "models--org--tiny" / "snapshots" / ("a" * 40))
    (tmp_path / "dl" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "dl" / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    stamp = weights_stamp(str(snap))
    assert weights_stamp("org/tiny") == ""  # not in the default cache
    s = spec("org/tiny", {"kvd_download_dir": str(tmp_path / "dl")})
    assert s.fingerprint.extra == f"vllm-offloading/1;weights={stamp}"


def test_fp8_layers_left_unquantized_are_part_of_the_digest() -> None:
    """The same bytes per block either way: only the digest tells the engines apart.
    (The rest of the digest runs on real vLLM configs: tests/e2e/test_kvd_identity.py.)"""
    def cfg(skip):
        return SimpleNamespace(model_config=SimpleNamespace(quantization=None,
                                                            hf_overrides=None),
                               cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=skip))

    assert config_digest(cfg([])) == ""
    a, b = config_digest(cfg(["layers.0"])), config_digest(cfg(["layers.1"]))
    assert a and b and a != b
    assert config_digest(cfg(["layers.1", "layers.0"])) == config_digest(
        cfg(["layers.0", "layers.1"]))


def test_overrides_that_cannot_be_named_keep_the_blocks_to_the_engine_run(
        tmp_path: Path) -> None:
    """A function's name says nothing of what it does (an edited one keeps it); sets
    and objects have no stable text; keys of mixed types stopped the engine at start."""
    def cfg(overrides):
        return SimpleNamespace(model_config=SimpleNamespace(quantization=None,
                                                            hf_overrides=overrides))

    for overrides in (lambda c: c, {"rope": {1, 2}}, {1: "a", "b": 2}, {"o": object()}):
        assert config_digest(cfg(overrides)) == UNNAMED
    assert config_digest(cfg({"rope_theta": 1e6})) not in ("", UNNAMED)
    path = str(_model(tmp_path / "m"))
    a, b = (spec(path, {"kvd_config_digest": UNNAMED}, engine=e) for e in ("e0", "e1"))
    assert a.fingerprint.extra.endswith(";engine=e0") and tenant(a) != tenant(b)


def test_settings_that_change_the_kv_name_another_tenant(tmp_path: Path) -> None:
    path = str(_model(tmp_path / "m"))
    base = spec(path)
    assert tenant(spec(path, {"kvd_config_digest": ""})) == tenant(base)
    assert tenant(spec(path, {"kvd_config_digest": "0123456789abcdef"})) != tenant(base)


@pytest.mark.parametrize("layout", [{"pcp": 2}, {"chunk": 2}])
def test_a_layout_kvd_refuses_leaves_the_engine_serving(tmp_path: Path, layout) -> None:
    """Prefill context parallel ranks hold other tokens of a block under one TP rank
    (they overwrote each other's KV); a chunk of several blocks per key never stored.
    Refused without stopping the engine: no hits, no stores, nothing raised."""
    s = spec(str(_model(tmp_path / "m")), **layout)
    mgr = s.get_manager()
    assert isinstance(mgr, ManagerOff) and mgr.disabled
    ctx = ReqContext("r")
    mgr.on_new_request(ctx)
    assert mgr.lookup(b"k" * 36, ctx) == LookupResult.MISS
    # Nothing to store, said quietly: None is an allocation failure to vLLM, counted,
    # logged and retried with the same keys every step.
    out = mgr.prepare_store([b"k" * 36], ctx)
    assert out is not None and list(out.keys_to_store) == []
    storage = torch.zeros((2, 4, PAGE), dtype=torch.int8)
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(storage[i], PAGE)
                                        for i in range(2)], group_data_refs=[])
    worker = s.get_worker(caches)
    assert isinstance(worker, OffloadOff)
    spec_ = GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
    assert worker.submit_store(7, spec_, None)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, True)]
