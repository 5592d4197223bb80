"""Engine settings that change the KV of the same weights and tokens make another kvd
tenant: real vLLM configs of the tiny model, through the path an engine takes
(``KvdConnector``'s ``prepare_config``, vLLM's own offloading config, kvd's spec). No
engine is started: the tenant is decided before one runs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def _fingerprint(model, **kw):
    torch = pytest.importorskip("torch")
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from kvd_client.vllm.connector import prepare_config
    from kvd_client.vllm.spec import KvdOffloadingSpec

    args = EngineArgs(model=str(model), tokenizer=str(model), dtype="bfloat16",
                      block_size=16, max_model_len=512, enforce_eager=True,
                      kv_transfer_config={"kv_connector": "KvdConnector",
                                          "kv_connector_module_path": "kvd_client.vllm",
                                          "kv_role": "kv_both",
                                          "kv_connector_extra_config": {}}, **kw)
    vc = args.create_engine_config()
    prepare_config(vc)
    mc, pc = vc.model_config, vc.parallel_config
    attn = FullAttentionSpec(block_size=16, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(), dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(pc))]
    page = attn.page_size_bytes
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(
        size=8 * page * len(layers), layers=layers, layer_stride=8 * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(layers, attn)])
    return KvdOffloadingSpec(build_offloading_config(vc, kcc)).fingerprint


def test_rope_overrides_and_online_quantization_are_other_tenants(tiny_model):
    """K is stored after RoPE: another base or scaling, or weights quantized at load,
    give other KV for the same files and tokens, which a shared tenant would serve."""
    base = _fingerprint(tiny_model)
    assert ";config=" not in base.extra  # engines without such settings keep their tenant
    assert _fingerprint(tiny_model) == base
    others = [
        _fingerprint(tiny_model, hf_overrides={"rope_parameters": {
            "rope_theta": 12345.0, "rope_type": "default"}}),
        _fingerprint(tiny_model, hf_overrides={"rope_parameters": {
            "rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 4096}}),
        _fingerprint(tiny_model, quantization="fp8"),
    ]
    extras = {fp.extra for fp in others}
    assert len(extras) == 3 and base.extra not in extras
