"""The weights stamp in the fingerprint: new weights at the same model path are another
tenant (never the old weights' KV), the same weights anywhere are the same tenant."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kvd_client.vllm.weights import SAMPLE_BYTES, weights_stamp

from kvd.core.tenants import fingerprint_digest


def _model(path: Path, shard: bytes = b"\x01" * 300_000, config: str = '{"a": 1}') -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config)
    (path / "model-00001-of-00002.safetensors").write_bytes(shard)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 200_000)
    (path / "README.md").write_text("not part of the weights")
    return path


def test_the_same_files_anywhere_give_the_same_stamp(tmp_path: Path) -> None:
    a = _model(tmp_path / "node-a" / "llama")
    b = tmp_path / "node-b" / "models" / "llama-copy"
    shutil.copytree(a, b)
    (b / "README.md").write_text("edited: not a weight")
    stamp = weights_stamp(str(a))
    assert len(stamp) == 16
    assert weights_stamp(str(b)) == stamp == weights_stamp(str(a))


def test_new_weights_or_config_at_the_same_path_give_another_stamp(tmp_path: Path) -> None:
    path = _model(tmp_path / "m")
    before = weights_stamp(str(path))
    shard = bytearray(b"\x01" * 300_000)
    shard[150_000:150_000 + SAMPLE_BYTES] = b"\x07" * SAMPLE_BYTES  # a sampled stretch
    _model(path, shard=bytes(shard))
    changed = weights_stamp(str(path))
    assert changed != before
    _model(path, shard=bytes(shard), config='{"a": 2}')
    assert weights_stamp(str(path)) not in (before, changed)
    assert weights_stamp(str(path), revision="v2") != weights_stamp(str(path))


def test_a_single_file_model_is_stamped_by_its_content(tmp_path: Path) -> None:
    one = tmp_path / "a" / "model.gguf"
    one.parent.mkdir()
    one.write_bytes(b"GGUF" + b"\x01" * 100_000)
    other = tmp_path / "b" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF" + b"\x02" * 100_000)
    assert weights_stamp(str(one)) not in ("", weights_stamp(str(other)))
    shutil.copy(one, other)
    assert weights_stamp(str(other)) == weights_stamp(str(one))


def test_a_model_without_local_files_has_no_stamp_but_its_revision() -> None:
    # Neither a path nor in the hub cache (the lookup never downloads).
    assert weights_stamp("no-such-org/no-such-model") == ""
    assert weights_stamp("no-such-org/no-such-model", revision="abc") != ""


def test_the_stamp_makes_another_tenant(tmp_path: Path) -> None:
    """Through the spec vLLM builds: the fingerprint carries the stamp (or the user's
    ``kvd_model_version``), so the daemon keys another tenant by it."""
    pytest.importorskip("vllm")
    from kvd_client.vllm.spec import KvdOffloadingSpec
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    path = _model(tmp_path / "m")

    def spec(extra: dict) -> KvdOffloadingSpec:
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
            worker_kv_bytes_per_block=4096, enable_kv_cache_events=False,
            extra_config={"spec_name": "KvdOffloadingSpec", **extra}, engine_id="e0",
            model=OffloadingModelConfig(name=str(path), dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
        return KvdOffloadingSpec(cfg)

    def digest(s: KvdOffloadingSpec) -> str:
        import msgspec

        return fingerprint_digest(msgspec.structs.asdict(s.fingerprint))

    first = spec({})
    assert first.fingerprint.extra.endswith(f";weights={weights_stamp(str(path))}")
    _model(path, shard=b"\x09" * 300_000)  # new weights, same path
    assert digest(spec({})) != digest(first)
    named = spec({"kvd_model_version": "2026-11-25"})
    assert named.fingerprint.extra.endswith(";weights=2026-11-25")
    assert spec({"kvd_model_version": ""}).fingerprint.extra == "vllm-offloading/1"
