"""Model, GPU and KV-cache layout specs, and their presets.

A transformer caches, per layer and per token, one key and one value vector for each
KV head (MHA: every query head; GQA: a few shared heads; MQA: one). MLA models
(DeepSeek-V2/V3) instead cache one latent vector of kv_lora_rank + qk_rope_head_dim
elements per layer and token, with no separate K and V. So

    bytes per token = 2 * layers * kv_heads * head_dim * dtype bytes      (MHA/GQA/MQA)
    bytes per token = layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes   (MLA)

A mixture-of-experts model (Mixtral, Qwen-MoE, DeepSeek) replaces the MLP of its MoE
layers by `num_experts` routed experts, of which each token uses `experts_per_token`,
plus optional always-used shared experts. Memory holds every expert; a token computes
on its active parameters only (kvsim.cost.moe prices the weights a step reads).

Model shapes and GPU peaks are published figures: the models' config.json files and
model cards, and the vendors' datasheets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

# Bits per cached element. fp8 means e4m3 or e5m2: both are one byte.
DTYPE_BITS = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,
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
    params: float  # total parameters (weights held in memory)
    active_params: float | None = None  # per-token parameters for MoE models
    dtype: str = "bf16"  # weight and default KV dtype
    kv_lora_rank: int = 0  # MLA only: latent KV width
    qk_rope_head_dim: int = 0  # MLA only: decoupled RoPE key width
    sliding_window: int | None = None  # a window on every layer
    # Hybrid attention: this many layers attend to the last hybrid_window tokens, the
    # others to every token (gpt-oss alternates them, Gemma 3 has five local to one global)
    hybrid_window: int | None = None
    hybrid_window_layers: int = 0
    max_position_embeddings: int | None = None  # context length: max_model_len's default
    alibi: bool = False  # ALiBi attention biases instead of rotary embeddings (BLOOM)
    num_experts: int = 0  # MoE: routed experts per MoE layer (0: a dense MLP)
    experts_per_token: int = 0  # MoE: routed experts each token uses (top-k)
    moe_intermediate_size: int | None = None  # MoE: one routed expert's FFN width (default intermediate_size)
    shared_expert_size: int = 0  # MoE: FFN width of the always-used shared experts together
    dense_layers: int = 0  # MoE: layers with a dense MLP of intermediate_size (DeepSeek's first ones)
    expert_weight_bits: float | None = None  # MoE: bits per routed-expert weight as stored (default: dtype's)

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
    def is_hybrid(self) -> bool:
        """Sliding-window layers beside full-attention ones (vLLM's hybrid KV cache groups)."""
        return self.hybrid_window is not None and 0 < self.hybrid_window_layers < self.num_layers

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token over all layers (K and V both, or the MLA latent)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def expert_params(self) -> float:
        """One routed expert of one layer: gate, up and down projections (SwiGLU)."""
        return 3 * self.hidden_size * self.expert_ffn

    @property
    def routed_params(self) -> float:
        """Every routed expert of every MoE layer: held in memory, read only where touched."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def flop_params(self) -> float:
        """Parameters one token computes on: all of a dense model's; a MoE model's given
        active_params, else all but the routed experts it does not choose."""
        if self.active_params:
            return self.active_params
        if self.is_moe:
            return self.params - self.routed_params + self.moe_layers * self.experts_per_token * self.expert_params
        return self.params

    @property
    def expert_bytes_per_param(self) -> float:
        """Bytes per routed-expert weight: the checkpoint's (gpt-oss keeps its experts in
        MXFP4: 4-bit values with one 8-bit scale per 32, 4.25 bits; OCP Microscaling
        Formats v1.0), else the model dtype's."""
        return (self.expert_weight_bits or DTYPE_BITS[self.dtype]) / 8

    def weight_bytes(self) -> float:
        """The weights held in memory: every parameter in the model dtype, but routed
        experts at their own width where the checkpoint stores them narrower."""
        dense = self.params - (self.routed_params if self.expert_weight_bits else 0.0)
        experts = self.routed_params * self.expert_bytes_per_param if self.expert_weight_bits else 0.0
        return dense * DTYPE_BITS[self.dtype] / 8 + experts


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    hbm_tb_s: float  # HBM bandwidth, TB/s (1e12 bytes per second)
    bf16_tflops: float  # dense peak
    fp8_tflops: float | None = None
    pcie_gb_s: float = 64.0  # host link, GB/s (PCIe 5.0 x16 per direction; 4.0 is 32)
    nvlink_gb_s: float | None = None  # GPU-to-GPU link, GB/s, both directions together (datasheet)


QUANTIZED = {"fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
SCALE_BYTES = 2  # one fp16 scale


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
        vectors, width = (
            (m.num_layers, m.kv_lora_rank + m.qk_rope_head_dim)
            if m.is_mla
            else (2 * m.num_layers * m.num_kv_heads, m.head_dim)
        )
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


# Shapes from the models' Hugging Face config.json files.
# Context lengths (max_position_embeddings, what vLLM takes as max_model_len's default)
# from the same config.json files: meta-llama/Meta-Llama-3-8B and -70B 8,192;
# meta-llama/Llama-2-*-hf 4,096; mistralai/Mistral-7B-v0.1 32,768; Qwen/Qwen2-7B-Instruct
# 32,768; facebook/opt-13b 2,048; deepseek-ai/DeepSeek-V2 and -V3 163,840.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": _model("llama-3-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8.03e9, max_position_embeddings=8192),
    "llama-3-70b": _model("llama-3-70b", 80, 64, 8, 128, 8192, 28672, 128256, 70.6e9, max_position_embeddings=8192),
    "llama-2-7b": _model("llama-2-7b", 32, 32, 32, 128, 4096, 11008, 32000, 6.74e9, max_position_embeddings=4096),
    "llama-2-13b": _model("llama-2-13b", 40, 40, 40, 128, 5120, 13824, 32000, 13.0e9, max_position_embeddings=4096),
    "llama-2-70b": _model("llama-2-70b", 80, 64, 8, 128, 8192, 28672, 32000, 69.0e9, max_position_embeddings=4096),
    "mistral-7b": _model(
        "mistral-7b", 32, 32, 8, 128, 4096, 14336, 32000, 7.24e9, sliding_window=4096, max_position_embeddings=32768
    ),
    "qwen2-7b": _model("qwen2-7b", 28, 28, 4, 128, 3584, 18944, 152064, 7.07e9, max_position_embeddings=32768),
    "opt-13b": _model(
        "opt-13b", 40, 40, 40, 128, 5120, 20480, 50272, 12.9e9, dtype="fp16", max_position_embeddings=2048
    ),
    # MLA: the per-head fields describe queries; the cache holds the 512 + 64 latent.
    # MoE (the models' config.json: n_routed_experts, num_experts_per_tok, n_shared_experts,
    # moe_intermediate_size, first_k_dense_replace, intermediate_size of the dense layers):
    # V2 160 routed experts of width 1536, 6 per token, 2 shared, 1 dense layer of 12288;
    # V3 256 of width 2048, 8 per token, 1 shared, 3 dense layers of 18432. With the MLA
    # projections these give 235.8B / 21.4B (V2) and 670.9B / 37.5B (V3) parameters, the
    # published 236B / 21B and 671B / 37B, which are the figures kept here.
    "deepseek-v2": _model(
        "deepseek-v2",
        60,
        128,
        128,
        128,
        5120,
        12288,
        102400,
        236e9,
        active_params=21e9,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_position_embeddings=163840,
        num_experts=160,
        experts_per_token=6,
        moe_intermediate_size=1536,
        shared_expert_size=2 * 1536,
        dense_layers=1,
    ),
    "deepseek-v3": _model(
        "deepseek-v3",
        61,
        128,
        128,
        128,
        7168,
        18432,
        129280,
        671e9,
        active_params=37e9,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_position_embeddings=163840,
        num_experts=256,
        experts_per_token=8,
        moe_intermediate_size=2048,
        shared_expert_size=2048,
        dense_layers=3,
    ),
    # BLOOM-176B (bigscience/bloom config.json: n_layer 70, n_head 112, hidden 14336; MHA,
    # ALiBi, a plain 4x GELU MLP, vocabulary 250,880; 176,247,271,424 parameters on its
    # model card). fp16: the dtype of the serving measurements in shared/data/serving.
    "bloom-176b": _model(
        "bloom-176b",
        70,
        112,
        112,
        128,
        14336,
        57344,
        250880,
        176.25e9,
        dtype="fp16",
        alibi=True,
        max_position_embeddings=2048,
    ),  # its seq_length
}


def _published_presets() -> dict[str, ModelSpec]:
    """Current open models (kvsim/data/models.json: each from its published config.json
    and model card, the source named in the file)."""
    doc = json.loads((Path(__file__).resolve().parents[1] / "data" / "models.json").read_text())
    return {
        name: ModelSpec(name=name, **{k: v for k, v in entry.items() if k != "source"})
        for name, entry in doc["models"].items()
    }


MODEL_PRESETS.update(_published_presets())

# Dense peaks from NVIDIA's A100 and H100/H200 datasheets (SXM parts).
# NVLink per GPU, both directions together, from the same datasheets: A100 SXM (40 and
# 80 GB) 600 GB/s (NVLink 3), H100 SXM and H200 SXM 900 GB/s (NVLink 4).
# Memory is the total CUDA reports (cudaMemGetInfo), which engines multiply by their
# memory fraction, in GiB: an H100 80GB HBM3 79.19 GiB ("Free memory on device
# (78.66/79.19 GiB)" in vLLM 0.10's startup log; nvidia-smi shows 81,559 MiB), an H200
# 139.81 GiB (vLLM 0.11's "Free memory on device (139.21/139.81 GiB)"); the A100s'
# "40/80 GB" are taken as 40/80 GiB.
GPU_PRESETS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 40, 1.555, 312, None, pcie_gb_s=32, nvlink_gb_s=600),
    "a100-80gb": GPUSpec("a100-80gb", 80, 2.039, 312, None, pcie_gb_s=32, nvlink_gb_s=600),
    "h100-80gb": GPUSpec("h100-80gb", 79.19, 3.35, 989, 1979, nvlink_gb_s=900),
    "h200": GPUSpec("h200", 139.81, 4.8, 989, 1979, nvlink_gb_s=900),
}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json (missing fields take HF's defaults).

    Raises ValueError with a sentence for the user: the file is missing or unreadable,
    not JSON, or lacks a field every decoder's config gives.
    """
    cfg = _read_config(Path(path))
    # multimodal configs (Llama 4, Mistral 3, Qwen-VL) keep the language model's shape here
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg

    def size(key, default=None, minimum=1):
        value = cfg.get(key, default)
        if value is None:
            raise ValueError(
                f"{path}: no {key} in it; is this a transformer model's config.json "
                "(from the model's Hugging Face page)?"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{path}: {key} must be a whole number >= {minimum}, not {json.dumps(value)}")
        return value

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    layers = size("num_hidden_layers")
    head_dim = size("head_dim", cfg.get("head_dim") or hidden // heads)
    ffn = size("intermediate_size", cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden)
    vocab = size("vocab_size", 32000)
    kv_heads = size("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
    dtype = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(
        str(cfg.get("torch_dtype", "bfloat16")), "bf16"
    )
    moe = _hf_experts(cfg, layers, size)
    # Dense estimate: attention projections + gated (3 matrices) or plain (2) MLP + embeddings
    # (one matrix when the LM head is tied to them); MoE layers hold every expert and a router.
    mlp_mats = 3 if cfg.get("hidden_act", "silu") in ("silu", "swiglu") else 2
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    dense_mlp = (layers - moe["moe_layers"]) * mlp_mats * hidden * ffn
    experts = moe["moe_layers"] * (
        moe["num_experts"] * (3 * hidden * (moe["moe_intermediate_size"] or ffn) + hidden)
        + 3 * hidden * moe["shared_expert_size"]
    )
    embeddings = (1 if cfg.get("tie_word_embeddings") else 2) * vocab * hidden
    params = layers * attn + dense_mlp + experts + embeddings
    return ModelSpec(
        name=cfg.get("_name_or_path") or Path(path).parent.name or "hf-model",
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=ffn,
        vocab_size=vocab,
        params=float(params),
        dtype=dtype,
        kv_lora_rank=size("kv_lora_rank", cfg.get("kv_lora_rank") or 0, minimum=0),
        qk_rope_head_dim=size("qk_rope_head_dim", cfg.get("qk_rope_head_dim") or 0, minimum=0),
        sliding_window=_window(cfg) and size("sliding_window"),
        **_hybrid(cfg, layers, size),
        max_position_embeddings=cfg.get("max_position_embeddings") and size("max_position_embeddings"),
        num_experts=moe["num_experts"],
        experts_per_token=moe["experts_per_token"],
        moe_intermediate_size=moe["moe_intermediate_size"],
        shared_expert_size=moe["shared_expert_size"],
        dense_layers=layers - moe["moe_layers"] if moe["num_experts"] else 0,
    )


def _hf_experts(cfg: dict, layers: int, size) -> dict:
    """A config.json's mixture of experts, under each family's names (Hugging Face
    transformers' configuration classes): Mixtral `num_local_experts` (each expert as wide
    as intermediate_size); Qwen2/Qwen3-MoE `num_experts`, `moe_intermediate_size`,
    `shared_expert_intermediate_size`, MoE every `decoder_sparse_step` layers except
    `mlp_only_layers`; DeepSeek `n_routed_experts`, `n_shared_experts` experts of
    moe_intermediate_size, dense below `first_k_dense_replace`, then every `moe_layer_freq`.
    All take `num_experts_per_tok`. A dense model gets zeros."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    none = {
        "num_experts": 0,
        "experts_per_token": 0,
        "moe_intermediate_size": None,
        "shared_expert_size": 0,
        "moe_layers": 0,
    }
    if not experts:
        return none
    key = next(k for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k))
    experts = size(key)
    top_k = size("num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds {key} ({experts})")
    width = cfg.get("moe_intermediate_size") and size("moe_intermediate_size")
    if cfg.get("n_routed_experts"):  # DeepSeek
        shared = (cfg.get("n_shared_experts") or 0) * (width or size("intermediate_size"))
        first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
    else:  # Mixtral, Qwen-MoE
        shared = cfg.get("shared_expert_intermediate_size") or 0
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": width,
        "shared_expert_size": int(shared),
        "moe_layers": moe_layers,
    }


def _window(cfg: dict) -> int | None:
    """The sliding window every layer uses, else None: Qwen2's configs name a window they
    switch off (use_sliding_window: false); where some layers attend in full, the window
    is the hybrid pattern's (_hybrid)."""
    if cfg.get("use_sliding_window") is False or _layer_types(cfg):
        return None
    return cfg.get("sliding_window")


def _layer_types(cfg: dict) -> list[str]:
    """Each layer's attention where the config mixes kinds: gpt-oss's `layer_types`, or
    Gemma 2/3's `sliding_window_pattern` (every n-th layer global, the others local:
    Hugging Face transformers' Gemma3TextConfig builds layer_types so); [] otherwise."""
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return []
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    if not types and isinstance(pattern, int) and pattern > 1:
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])
        ]
    types = list(types or ())
    return types if "full_attention" in types and "sliding_attention" in types else []


def _hybrid(cfg: dict, layers: int, size) -> dict:
    """hybrid_window and hybrid_window_layers of a config whose layers mix a sliding
    window and full attention, else nothing."""
    types = _layer_types(cfg)
    if not types:
        return {}
    if len(types) != layers:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers {layers}")
    return {"hybrid_window": size("sliding_window"), "hybrid_window_layers": types.count("sliding_attention")}


def _read_config(path: Path) -> dict:
    """A config.json as a dict, every failure a plain sentence (ValueError)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder; give the config.json inside it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or 'not UTF-8 text'})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object (a config.json), not a {type(cfg).__name__}")
    return cfg


def with_kv_heads(model: ModelSpec, num_kv_heads: int | None) -> ModelSpec:
    return model if num_kv_heads is None else replace(model, num_kv_heads=num_kv_heads)
