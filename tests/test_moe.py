"""Mixture-of-experts models: their config.json, the experts a step touches, its price."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from kvsim.cost.fit import gemm_kn
from kvsim.cost.generalize import find_shipped, model_shape, same_shape
from kvsim.cost.model import Roofline, StepBatch, make_cost_model
from kvsim.cost.moe import expected_experts, routed_gemm_work
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, GPUSpec, KVSpec, ModelSpec, model_from_hf_config

# mistralai/Mixtral-8x7B-v0.1 config.json, the fields kvsim reads
MIXTRAL = {
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
# Qwen/Qwen1.5-MoE-A2.7B config.json: 60 experts of 1408, top 4, one shared expert of 5632
QWEN_MOE = {
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 24,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
}


def hf(tmp_path, cfg: dict) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return model_from_hf_config(path)


# --- the rule ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, k, experts, want",
    [
        (0, 2, 8, 0.0),
        (1, 2, 8, 2.0),  # one token reads its k experts
        (2, 2, 8, 3.5),  # 2 + 2 - expected overlap (2 x 2 / 8 = 0.5)
        (3, 1, 2, 1.75),  # 2 (1 - 1/8)
        (5, 8, 8, 8.0),  # k = E: every expert, whatever the batch
    ],
)
def test_expected_distinct_experts_by_hand(tokens, k, experts, want):
    assert expected_experts(tokens, k, experts) == pytest.approx(want)


def test_expected_experts_equals_enumerating_every_routing():
    """Every way B tokens can each choose k of E experts, equally likely: the mean union."""
    experts, k = 5, 2
    subsets = list(itertools.combinations(range(experts), k))
    for tokens in (1, 2, 3):
        sizes = [len(set().union(*choice)) for choice in itertools.product(subsets, repeat=tokens)]
        assert expected_experts(tokens, k, experts) == pytest.approx(np.mean(sizes))


def test_a_large_batch_touches_every_expert():
    assert expected_experts(256, 2, 8) == pytest.approx(8.0)
    assert 7.99 < expected_experts(32, 2, 8) < 8.0


# --- config.json ---------------------------------------------------------------------
def test_mixtral_config_holds_every_expert_and_computes_on_two(tmp_path):
    m = hf(tmp_path, MIXTRAL)
    assert (m.num_experts, m.experts_per_token, m.expert_ffn, m.moe_layers, m.dense_layers) == (8, 2, 14336, 32, 0)
    attention = 4096 * 128 * (2 * 32 + 2 * 8)
    expert = 3 * 4096 * 14336
    embeddings = 2 * 32000 * 4096
    assert m.params == 32 * (attention + 8 * expert + 4096 * 8) + embeddings == 46_702_526_464
    assert m.flop_params == 32 * (attention + 2 * expert + 4096 * 8) + embeddings == 12_879_659_008
    assert m.weight_bytes() == 2 * m.params  # memory: every expert, bf16


def test_qwen_moe_config_with_a_shared_expert(tmp_path):
    m = hf(tmp_path, QWEN_MOE)
    assert (m.num_experts, m.experts_per_token, m.expert_ffn, m.shared_expert_size) == (60, 4, 1408, 5632)
    attention, expert, shared = 2048 * 128 * 64, 3 * 2048 * 1408, 3 * 2048 * 5632
    per_layer = attention + 60 * (expert + 2048) + shared
    assert m.params == 24 * per_layer + 2 * 151936 * 2048  # 14.3B on its model card
    assert m.flop_params == pytest.approx(2.69e9, rel=0.01)  # "A2.7B"
    sparse = hf(tmp_path, QWEN_MOE | {"mlp_only_layers": [0, 1], "decoder_sparse_step": 2})
    assert (sparse.moe_layers, sparse.dense_layers) == (11, 13)  # layers 3, 5, ..., 23


def test_deepseek_config_dense_first_layers_and_shared_experts(tmp_path):
    cfg = {
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "n_routed_experts": 160,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "vocab_size": 102400,
    }
    m = hf(tmp_path, cfg)
    assert (m.num_experts, m.experts_per_token, m.shared_expert_size, m.dense_layers, m.moe_layers) == (
        160,
        6,
        3072,
        1,
        59,
    )


def test_dense_configs_have_no_experts(tmp_path):
    m = hf(tmp_path, {k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "num_experts_per_tok")})
    assert not m.is_moe and m.flop_params == m.params
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        hf(tmp_path, MIXTRAL | {"num_experts_per_tok": 9})


def test_deepseek_presets_keep_their_published_parameters():
    for name, total, active in (("deepseek-v2", 236e9, 21e9), ("deepseek-v3", 671e9, 37e9)):
        m = MODEL_PRESETS[name]
        assert (m.params, m.flop_params) == (total, active)
        assert m.is_moe and 0.9 * total < m.routed_params < total


# --- pricing -------------------------------------------------------------------------
def small_moe(**kw) -> ModelSpec:
    """4 layers, 8 experts of width 100, top 2, no attention worth counting."""
    fields = dict(
        name="toy-moe",
        num_layers=4,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        hidden_size=10,
        intermediate_size=100,
        vocab_size=1,
        params=0.0,
        num_experts=8,
        experts_per_token=2,
    )
    fields.update(kw)
    expert = 3 * 10 * 100
    shared = 1000.0  # non-expert parameters
    return ModelSpec(**fields | {"params": shared + 4 * 8 * expert})


def test_roofline_reads_the_touched_experts():
    m = small_moe()
    gpu = GPUSpec("bw-only", memory_gib=1, hbm_tb_s=1e-12, bf16_tflops=1e12)  # 1 byte/s; compute is free
    r = Roofline(m, gpu, KVSpec(m, "bf16"), tp=1)
    kv = KVSpec(m, "bf16").bytes_per_token
    expert_bytes = 3 * 10 * 100 * 2
    for tokens, touched in ((1, 2.0), (2, 3.5)):
        batch = StepBatch.build([], [1] * tokens)  # decodes over a context of 1
        want = 1000 * 2 + 4 * touched * expert_bytes + (tokens + tokens) * kv
        assert r.step_time(batch) == pytest.approx(want)


def test_roofline_computes_on_active_parameters():
    m = small_moe()
    gpu = GPUSpec("flops-only", memory_gib=1, hbm_tb_s=1e12, bf16_tflops=1e-12)  # 1 FLOP/s
    r = Roofline(m, gpu, KVSpec(m, "bf16"), tp=1)
    active = 1000 + 4 * 2 * 3 * 10 * 100
    batch = StepBatch.build([], [1] * 3)
    assert r.step_time(batch) == pytest.approx(3 * 2 * active + batch.attended_pairs * 4 * 4)


def test_routed_gemm_reads_touched_experts_and_computes_k_per_token():
    shape = model_shape(small_moe())
    k_dim, n = gemm_kn(shape | {"intermediate_size": 100}, "mlp_up_proj", 2)
    assert (k_dim, n) == (10, 100)  # hidden -> 2 x width / tp
    flops, nbytes = routed_gemm_work(shape, "mlp_up_proj", [1, 2], tp=2)
    assert list(flops) == [2 * 2 * 10 * 100, 2 * 4 * 10 * 100]
    assert list(nbytes) == pytest.approx([2 * (2.0 * 1000 + 2 * 10 + 2 * 100), 2 * (3.5 * 1000 + 4 * 10 + 4 * 100)])


def test_mixtral_is_priced_as_moe_not_by_a_dense_profile_of_equal_widths(tmp_path):
    m = hf(tmp_path, MIXTRAL)
    h100 = GPU_PRESETS["h100-80gb"]
    llama3 = MODEL_PRESETS["llama-3-8b"]
    assert model_shape(m)["intermediate_size"] == model_shape(llama3)["intermediate_size"]
    assert not same_shape(model_shape(m), model_shape(llama3))
    assert find_shipped(m, h100) is None
    cost = make_cost_model("calibrated", m, h100, KVSpec(m, "bf16"), 2, block_size=16)
    assert cost.label.startswith("predicted:h100-80gb/")
    linear = [cost.breakdown(StepBatch.build([], [512] * b))["linear"] for b in (1, 2, 8, 64)]
    # weights read grow from 2 experts a layer to all 8: about 8/2 of the expert part, not 64x
    assert linear[0] < linear[1] < linear[2] and linear[3] / linear[0] < 4.5
    # one token: as dear as a dense model whose MLP is its two experts side by side
    two = replace(m, num_experts=0, experts_per_token=0, intermediate_size=2 * 14336, params=m.flop_params)
    dense = make_cost_model("calibrated", two, h100, KVSpec(m, "bf16"), 2, block_size=16)
    one = StepBatch.build([], [512])
    assert cost.breakdown(one)["linear"] == pytest.approx(dense.breakdown(one)["linear"], rel=0.1)
