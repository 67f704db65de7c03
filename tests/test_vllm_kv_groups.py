"""vLLM V1's KV cache groups for hybrid models (kvsim.model.kv_groups): the groups and the
pool's blocks derived by hand from vLLM 0.33.0's kv_cache_planning.py, the presets'
layer patterns, config.json parsing, and, where vLLM is installed, vLLM's own grouping."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import kvsim
from kvsim.model.kv_groups import KVGroup, kv_cache_groups
from kvsim.model.memory import PoolSizing
from kvsim.model.specs import GIB, MODEL_PRESETS, KVSpec, model_from_hf_config
from kvsim.model.vllm_pool import KVCapacity


def test_gpt_oss_has_one_windowed_and_one_full_group_of_half_its_layers():
    for name, half in (("gpt-oss-20b", 12), ("gpt-oss-120b", 18)):
        g = kv_cache_groups(MODEL_PRESETS[name])
        assert g.groups == (KVGroup(128, half), KVGroup(None, half)) and g.group_size == half


def test_gemma_3_has_six_windowed_groups_padded_to_ten_layers_and_one_full():
    g = kv_cache_groups(MODEL_PRESETS["gemma-3-27b"])  # 52 local, 10 global: layers[i::6]
    assert g.group_size == 10
    assert g.groups == (*(KVGroup(1024, n) for n in (9, 9, 9, 9, 8, 8)), KVGroup(None, 10))


def test_close_counts_take_the_larger_as_group_size():
    # 12 windowed + 13 full (gpt-oss-20b with a drafter's layer): 13 < 1.5 x 12
    m = replace(MODEL_PRESETS["gpt-oss-20b"], num_layers=25)
    g = kv_cache_groups(m)
    assert g.group_size == 13 and g.groups == (KVGroup(128, 12), KVGroup(None, 13))
    # 10 windowed + 20 full: 20 >= 15, so groups of 10, the full layers in two
    g = kv_cache_groups(replace(m, num_layers=30, hybrid_window_layers=10))
    assert g.group_size == 10 and g.groups == (KVGroup(128, 10), KVGroup(None, 10), KVGroup(None, 10))


def test_uniform_models_and_vllm_v0_keep_one_group_of_every_layer():
    assert kv_cache_groups(MODEL_PRESETS["llama-3-8b"]).groups == (KVGroup(None, 32),)
    assert kv_cache_groups(MODEL_PRESETS["mistral-7b"]).groups == (KVGroup(4096, 32),)
    assert kv_cache_groups(MODEL_PRESETS["gpt-oss-20b"], hybrid=False).groups == (KVGroup(None, 24),)


def test_hybrid_pool_blocks_and_concurrency_by_hand():
    """gpt-oss-20b in bf16: a layer's token is 2 x 8 heads x 64 x 2 B = 2,048 B; a block is
    16 tokens of 12 layers, 393,216 B. 1 GiB holds 2,730 blocks. A request of 1,024 tokens
    takes 64 blocks of the full group and min(127 + 256, 1024) -> 24 + 1 = 25 of the
    windowed one: 2,730 / 89 = 30.67 requests."""
    m = MODEL_PRESETS["gpt-oss-20b"]
    pool = PoolSizing("vllm-v1", 80 * GIB, 72 * GIB, 0.0, 0.0, 1 * GIB, 1, "test")
    cap = KVCapacity.of(pool, KVSpec(m, "bf16"), 16, 1024, in_flight_tokens=256, hybrid=True)
    assert cap.blocks == GIB // 393_216 == 2730
    assert cap.concurrency == pytest.approx(2730 / 89)
    assert cap.lines()[0] == "KV cache groups: 1 128-token window group + 1 full-attention group of 12 layers"
    # vLLM V0 has no groups: a block is 16 tokens of all 24 layers
    v0 = KVCapacity.of(replace(pool, engine="vllm-v0"), KVSpec(m, "bf16"), 16, 1024, in_flight_tokens=256)
    assert v0.blocks == 1365 and v0.concurrency == pytest.approx(1365 / 64)


def test_memory_shows_the_groups(tmp_path):
    code, out, err = kvsim("memory", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--engine", "vllm-v1")
    assert code == 0, err
    assert "KV cache groups: 6 1,024-token window groups + 1 full-attention group of 10 layers" in out


def test_config_json_layer_patterns(tmp_path):
    base = {
        "num_attention_heads": 8,
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "sliding_window": 256,
    }
    cases = {
        "types": {"layer_types": ["sliding_attention", "full_attention"] * 6},
        "gemma": {"sliding_window_pattern": 6},
        "uniform": {},
        "off": {"layer_types": ["sliding_attention", "full_attention"] * 6, "use_sliding_window": False},
    }
    got = {}
    for name, extra in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**base, **extra}))
        m = model_from_hf_config(tmp_path / f"{name}.json")
        got[name] = (m.sliding_window, m.hybrid_window, m.hybrid_window_layers)
    assert got == {
        "types": (None, 256, 6),
        "gemma": (None, 256, 10),
        "uniform": (256, None, 0),
        "off": (None, None, 0),
    }


def test_vllms_own_grouping_agrees():
    """vLLM 0.33.0's _get_kv_cache_groups_uniform_page_size over the layers in model
    order, and its specs' blocks per request, against kvsim's groups."""
    from kvsim.engines.vllm_reference import VllmMissing, load_vllm

    try:
        v = load_vllm()
    except VllmMissing as e:
        pytest.skip(str(e))
    import torch
    from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size

    shape = dict(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    for name in ("gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b"):
        m = MODEL_PRESETS[name]
        every = m.num_layers // (m.num_layers - m.hybrid_window_layers)  # gpt-oss 2, Gemma 3 6
        specs = {
            f"layer.{i}": v.FullAttentionSpec(**shape)
            if (i + 1) % every == 0 and i // every < m.num_layers - m.hybrid_window_layers
            else v.SlidingWindowSpec(**shape, sliding_window=m.hybrid_window)
            for i in range(m.num_layers)
        }
        theirs = _get_kv_cache_groups_uniform_page_size(specs)
        ours = kv_cache_groups(m)
        assert [(getattr(g.kv_cache_spec, "sliding_window", None), len(g.layer_names)) for g in theirs] == [
            (g.window, g.layers) for g in ours.groups
        ], name
        for in_flight, length in ((8192, 131072), (256, 1024), (2048, 100)):
            per_request = sum(
                -(-length // 16)
                if getattr(g.kv_cache_spec, "sliding_window", None) is None
                else g.kv_cache_spec.max_admission_blocks_per_request(in_flight, length)
                for g in theirs
            )
            assert ours.blocks_per_request(16, length, in_flight) == per_request
