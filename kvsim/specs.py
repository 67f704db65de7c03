"""Model, GPU and KV-cache layout specs, and their presets.

A transformer caches, per layer and per token, one key and one value vector for each
KV head (MHA: every query head; GQA: a few shared heads; MQA: one). MLA models
(DeepSeek-V2/V3) instead cache one latent vector of kv_lora_rank + qk_rope_head_dim
elements per layer and token, with no separate K and V. So

    bytes per token = 2 * layers * kv_heads * head_dim * dtype bytes      (MHA/GQA/MQA)
    bytes per token = layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes   (MLA)

Model shapes and GPU peaks are the published figures collected in
shared/guide/FACTS.md (model cards and vendor datasheets).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

# Bits per cached element. fp8 means e4m3 or e5m2: both are one byte.
DTYPE_BITS = {
    "fp32": 32, "fp16": 16, "bf16": 16,
    "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4,
}
GIB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    params: float                 # total parameters (weights held in memory)
    active_params: float | None = None   # per-token parameters for MoE models
    dtype: str = "bf16"           # weight and default KV dtype
    kv_lora_rank: int = 0         # MLA only: latent KV width
    qk_rope_head_dim: int = 0     # MLA only: decoupled RoPE key width
    sliding_window: int | None = None
    max_position_embeddings: int | None = None   # context length: max_model_len's default
    alibi: bool = False           # ALiBi attention biases instead of rotary embeddings (BLOOM)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token over all layers (K and V both, or the MLA latent)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def flop_params(self) -> float:
        return self.active_params or self.params

    def weight_bytes(self) -> float:
        return self.params * DTYPE_BITS[self.dtype] / 8


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    hbm_tb_s: float       # HBM bandwidth, TB/s (1e12 bytes per second)
    bf16_tflops: float    # dense peak
    fp8_tflops: float | None = None
    pcie_gb_s: float = 64.0   # host link, GB/s (PCIe 5.0 x16 per direction; 4.0 is 32)
    nvlink_gb_s: float | None = None   # GPU-to-GPU link, GB/s, both directions together (datasheet)


QUANTIZED = {"fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
SCALE_BYTES = 2    # one fp16 scale


@dataclass(frozen=True)
class KVSpec:
    """One frozen layout from which every allocator derives its sizes.

    Quantized KV also stores scales. `scale_granularity`:
      tensor  static scales, one per layer for K and one for V: no bytes per token;
      head    one fp16 scale per token for each cached vector (each KV head's K and V,
              or the MLA latent) per layer (dynamic per-token-head quantization);
      group   one fp16 scale per `scale_group_size` elements of each such vector.
    """
    model: ModelSpec
    kv_cache_dtype: str
    scale_granularity: str = "tensor"
    scale_group_size: int = 64

    @property
    def data_bytes_per_token(self) -> float:
        return self.model.kv_elements_per_token * DTYPE_BITS[self.kv_cache_dtype] / 8

    @property
    def scale_bytes_per_token(self) -> float:
        if self.kv_cache_dtype not in QUANTIZED or self.scale_granularity == "tensor":
            return 0.0
        m = self.model
        vectors, width = ((m.num_layers, m.kv_lora_rank + m.qk_rope_head_dim) if m.is_mla
                          else (2 * m.num_layers * m.num_kv_heads, m.head_dim))
        per_vector = 1 if self.scale_granularity == "head" else -(-width // self.scale_group_size)
        return vectors * per_vector * SCALE_BYTES

    @property
    def bytes_per_token(self) -> float:
        return self.data_bytes_per_token + self.scale_bytes_per_token


def resolve_kv_dtype(kv_cache_dtype: str, model: ModelSpec) -> str:
    """vLLM's "auto" means the model's own dtype."""
    return model.dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def _model(name, layers, heads, kv_heads, head_dim, hidden, ffn, vocab, params, **kw):
    return ModelSpec(name, layers, heads, kv_heads, head_dim, hidden, ffn, vocab, params, **kw)


# Shapes from FACTS.md ("Model shapes"): the models' Hugging Face config.json files.
# Context lengths (max_position_embeddings, what vLLM takes as max_model_len's default)
# from the same config.json files: meta-llama/Meta-Llama-3-8B and -70B 8,192;
# meta-llama/Llama-2-*-hf 4,096; mistralai/Mistral-7B-v0.1 32,768; Qwen/Qwen2-7B-Instruct
# 32,768; facebook/opt-13b 2,048; deepseek-ai/DeepSeek-V2 and -V3 163,840.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": _model("llama-3-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8.03e9,
                         max_position_embeddings=8192),
    "llama-3-70b": _model("llama-3-70b", 80, 64, 8, 128, 8192, 28672, 128256, 70.6e9,
                          max_position_embeddings=8192),
    "llama-2-7b": _model("llama-2-7b", 32, 32, 32, 128, 4096, 11008, 32000, 6.74e9,
                         max_position_embeddings=4096),
    "llama-2-13b": _model("llama-2-13b", 40, 40, 40, 128, 5120, 13824, 32000, 13.0e9,
                          max_position_embeddings=4096),
    "llama-2-70b": _model("llama-2-70b", 80, 64, 8, 128, 8192, 28672, 32000, 69.0e9,
                          max_position_embeddings=4096),
    "mistral-7b": _model("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32000, 7.24e9,
                         sliding_window=4096, max_position_embeddings=32768),
    "qwen2-7b": _model("qwen2-7b", 28, 28, 4, 128, 3584, 18944, 152064, 7.07e9,
                       max_position_embeddings=32768),
    "opt-13b": _model("opt-13b", 40, 40, 40, 128, 5120, 20480, 50272, 12.9e9, dtype="fp16",
                      max_position_embeddings=2048),
    # MLA: the per-head fields describe queries; the cache holds the 512 + 64 latent.
    "deepseek-v2": _model("deepseek-v2", 60, 128, 128, 128, 5120, 1536, 102400, 236e9,
                          active_params=21e9, kv_lora_rank=512, qk_rope_head_dim=64,
                          max_position_embeddings=163840),
    "deepseek-v3": _model("deepseek-v3", 61, 128, 128, 128, 7168, 2048, 129280, 671e9,
                          active_params=37e9, kv_lora_rank=512, qk_rope_head_dim=64,
                          max_position_embeddings=163840),
    # BLOOM-176B (bigscience/bloom config.json: n_layer 70, n_head 112, hidden 14336; MHA,
    # ALiBi, a plain 4x GELU MLP, vocabulary 250,880; 176,247,271,424 parameters on its
    # model card). fp16: the dtype of the serving measurements in shared/data/serving.
    "bloom-176b": _model("bloom-176b", 70, 112, 112, 128, 14336, 57344, 250880, 176.25e9,
                         dtype="fp16", alibi=True,
                         max_position_embeddings=2048),   # its seq_length
}

# Dense peaks from FACTS.md ("GPUs"): NVIDIA A100 and H100/H200 datasheets (SXM parts).
# NVLink per GPU, both directions together, from the same datasheets: A100 SXM (40 and
# 80 GB) 600 GB/s (NVLink 3), H100 SXM and H200 SXM 900 GB/s (NVLink 4).
# Memory is what the CUDA driver reports, in GiB: the A100s' "40/80 GB" are 40/80 GiB;
# an H100 80GB reports 81,559 MiB; an H200's "141 GB" shows as about 139 GiB usable
# (the H200 machine lent to this project, see the device tool's notes).
GPU_PRESETS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 40, 1.555, 312, None, pcie_gb_s=32, nvlink_gb_s=600),
    "a100-80gb": GPUSpec("a100-80gb", 80, 2.039, 312, None, pcie_gb_s=32, nvlink_gb_s=600),
    "h100-80gb": GPUSpec("h100-80gb", 79.6, 3.35, 989, 1979, nvlink_gb_s=900),
    "h200": GPUSpec("h200", 139, 4.8, 989, 1979, nvlink_gb_s=900),
}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json (missing fields take HF's defaults).

    Raises KeyError naming the missing field, or ValueError for unreadable JSON.
    """
    cfg = json.loads(Path(path).read_text())
    if not isinstance(cfg, dict):
        raise ValueError("the file must hold a JSON object")

    def size(key, default=None, minimum=1):
        value = cfg.get(key, default)
        if value is None:
            raise KeyError(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{key} must be a whole number >= {minimum}, got {value!r}")
        return value

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    layers = size("num_hidden_layers")
    head_dim = size("head_dim", cfg.get("head_dim") or hidden // heads)
    ffn = size("intermediate_size", cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden)
    vocab = size("vocab_size", 32000)
    kv_heads = size("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
    dtype = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(
        cfg.get("torch_dtype", "bfloat16"), "bf16")
    # Dense estimate: attention projections + gated (3 matrices) or plain (2) MLP + embeddings.
    mlp_mats = 3 if cfg.get("hidden_act", "silu") in ("silu", "swiglu") else 2
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    params = layers * (attn + mlp_mats * hidden * ffn) + 2 * vocab * hidden
    return ModelSpec(
        name=cfg.get("_name_or_path") or Path(path).parent.name or "hf-model",
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=hidden, intermediate_size=ffn, vocab_size=vocab, params=float(params),
        dtype=dtype, kv_lora_rank=size("kv_lora_rank", cfg.get("kv_lora_rank") or 0, minimum=0),
        qk_rope_head_dim=size("qk_rope_head_dim", cfg.get("qk_rope_head_dim") or 0, minimum=0),
        sliding_window=cfg.get("sliding_window") and size("sliding_window"),
        max_position_embeddings=cfg.get("max_position_embeddings") and size("max_position_embeddings"),
    )


def with_kv_heads(model: ModelSpec, num_kv_heads: int | None) -> ModelSpec:
    return model if num_kv_heads is None else replace(model, num_kv_heads=num_kv_heads)
