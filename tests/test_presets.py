"""Presets for current open models (kvsim/data/models.json): each from its published
config.json and model card, named and cited; their KV bytes and weights follow by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import kvsim
from kvsim.model.specs import GIB, MODEL_PRESETS

FILE = Path(__file__).resolve().parents[1] / "kvsim" / "data" / "models.json"
CURRENT = [
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.3-70b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "mistral-7b-v0.3",
    "mistral-nemo-12b",
    "mistral-small-24b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "deepseek-v3",
]


def test_every_current_model_has_a_preset_and_each_published_one_names_its_source():
    models = json.loads(FILE.read_text())["models"]
    assert set(CURRENT) <= set(MODEL_PRESETS)
    for name, entry in models.items():
        assert "config.json" in entry["source"] and "parameters" in entry["source"], name
        assert MODEL_PRESETS[name].max_position_embeddings, name


@pytest.mark.parametrize(
    "name, per_token",
    [
        # 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16)
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),
        ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),
        ("llama-3.2-1b", 2 * 16 * 8 * 64 * 2),
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
        ("qwen3-32b", 2 * 64 * 8 * 128 * 2),
        ("qwen3-235b-a22b", 2 * 94 * 4 * 128 * 2),
        ("mixtral-8x22b", 2 * 56 * 8 * 128 * 2),
        ("gpt-oss-120b", 2 * 36 * 8 * 64 * 2),
    ],
)
def test_kv_bytes_per_token_follow_from_the_shape(name, per_token):
    code, out, err = kvsim("memory", "--model", name, "--context", 1, "--kv-dtype", "bf16", "--json")
    assert code == 0, err
    assert json.loads(out)["per_token_bytes"] == per_token


@pytest.mark.parametrize(
    "name, experts, top_k, width",
    [
        ("mixtral-8x7b", 8, 2, 14336),
        ("mixtral-8x22b", 8, 2, 16384),
        ("qwen3-30b-a3b", 128, 8, 768),
        ("qwen3-235b-a22b", 128, 8, 1536),
        ("gpt-oss-20b", 32, 4, 2880),
        ("gpt-oss-120b", 128, 4, 2880),
    ],
)
def test_mixture_of_experts_presets_carry_their_experts(name, experts, top_k, width):
    m = MODEL_PRESETS[name]
    assert (m.num_experts, m.experts_per_token, m.expert_ffn, m.dense_layers) == (experts, top_k, width, 0)
    assert m.active_params < m.params


@pytest.mark.parametrize("name, checkpoint_gib", [("gpt-oss-120b", 60.8), ("gpt-oss-20b", 12.8)])
def test_gpt_oss_weights_are_its_checkpoint_with_mxfp4_experts(name, checkpoint_gib):
    """Experts at 4.25 bits (MXFP4), the rest in bf16: the model card's checkpoint sizes."""
    assert MODEL_PRESETS[name].weight_bytes() / GIB == pytest.approx(checkpoint_gib, rel=0.01)


def test_a_model_named_as_the_hub_names_it_points_to_the_preset():
    code, out, err = kvsim("memory", "--model", "llama3.1-8b", "--context", 10)
    assert code == 2 and "did you mean 'llama-3.1-8b'" in err
