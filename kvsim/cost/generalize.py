"""Calibrated costs for a model that has no profile, from its GPU's fitted efficiencies.

For each GPU with measured data (kvsim/data/profiles/gpus.json, written by
scripts/derive_profiles.py) kvsim keeps the GEMM efficiency as a function of operator
shape, an elementwise bandwidth fit per op, the attention forms and the all-reduce
assumption (kvsim.cost.fit explains the forms). A new model's layer shapes then predict
its per-op times on the same token grid a measured profile has, and the result is an
ordinary Profile whose ``origin`` says "predicted".

Shapes come from the ModelSpec. Two things the spec does not say are inferred:
* gated MLP (SwiGLU, 3 matrices) or plain (2, e.g. OPT's ReLU): whichever parameter
  estimate is closer to the model's published parameter count;
* MLA models (DeepSeek): MLA's projections folded into one QKV-like GEMM.
MoE models' MLPs are priced by the experts their tokens touch (kvsim.cost.moe): the
expected distinct experts at each token count of the grid, one grouped GEMM per
projection. A model that gives active_params without its experts gets a
dense-equivalent MLP width matching those active parameters instead.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvsim.config.errors import InputError
from kvsim.cost.fit import (
    ELEMENTWISE_OPS,
    GEMM_OPS,
    LINEAR_OPS,
    elementwise_bytes_per_token,
    gemm_kn,
    gemm_work,
    predict_elementwise,
    predict_gemm,
)
from kvsim.cost.moe import MOE_OPS, act_width, moe_mlp_seconds
from kvsim.cost.profiles import FORMAT, SHIPPED, Profile, load_profile, shipped_meta, shipped_names
from kvsim.model.specs import GPUSpec, ModelSpec

if TYPE_CHECKING:
    import pandas as pd

GPU_FITS = SHIPPED / "gpus.json"
TP_GRID = (1, 2, 4, 8)
SHAPE_KEYS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size")
MOE_KEYS = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_expert_size", "dense_layers")


def token_grid(max_tokens: int = 32768, per_octave: int = 16) -> list[int]:
    """1, 2, 4, 8, then `per_octave` points per doubling, rounded to multiples of 8."""
    pts = {1, 2, 4, 8}
    k = 3.0
    while 2**k <= max_tokens:
        pts.add(int(round(2**k / 8) * 8))
        k += 1 / per_octave
    return sorted(pts | {max_tokens})


def model_shape(model: ModelSpec) -> dict:
    """The layer shapes the cost model needs, including the two inferred fields."""
    h, heads, kv, d, f = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
    )
    shape = {k: getattr(model, k) for k in SHAPE_KEYS} | {"name": model.name, "vocab_size": model.vocab_size}
    if model.alibi:
        shape["rope"] = False  # ALiBi adds its bias inside attention: no rotary kernel
    if model.is_mla:
        shape |= {"kv_lora_rank": model.kv_lora_rank, "qk_rope_head_dim": model.qk_rope_head_dim}
    attn = h * d * (2 * heads + 2 * kv)  # q, o and the K, V projections
    if model.is_mla:  # q, latent down-projection, latent up to K and V, o
        attn = (
            h * heads * d
            + h * (model.kv_lora_rank + model.qk_rope_head_dim)
            + model.kv_lora_rank * heads * 2 * d
            + heads * d * h
        )
        shape["qkv_width"] = attn // h - heads * d  # one GEMM standing for q and the latent
    emb = 2 * model.vocab_size * h
    if model.is_moe:
        shape |= {
            "num_experts": model.num_experts,
            "experts_per_token": model.experts_per_token,
            "moe_intermediate_size": model.expert_ffn,
            "shared_expert_size": model.shared_expert_size,
            "dense_layers": model.dense_layers,
            "gated_mlp": True,
        }
        shape["mlp_act_width"] = act_width(shape)
    elif model.active_params:
        per_layer = (model.active_params - emb) / model.num_layers - attn
        shape["intermediate_size"] = max(int(per_layer / (3 * h)), 1)
        shape["gated_mlp"] = True
        shape["dense_equivalent"] = True
    else:
        gated = model.num_layers * (attn + 3 * h * f) + emb
        plain = model.num_layers * (attn + 2 * h * f) + emb
        shape["gated_mlp"] = abs(gated - model.params) <= abs(plain - model.params)
    return shape


def same_shape(a: dict, b: dict) -> bool:
    """The same layer shapes: a dense profile never stands for a MoE model of equal widths."""
    return all(int(a.get(k, -1)) == int(b.get(k, -2)) for k in SHAPE_KEYS) and all(
        int(a.get(k) or 0) == int(b.get(k) or 0) for k in MOE_KEYS
    )


@lru_cache(maxsize=None)
def gpu_fits() -> dict:
    return json.loads(GPU_FITS.read_text()) if GPU_FITS.is_file() else {}


# GPUs without kernel measurements whose compute equals a measured part's (datasheet dense
# BF16: A100 40GB = A100 80GB = 312 TFLOPS; H200 = H100 SXM = 989): they take that part's
# shape model with their own HBM bandwidth. The fits are fractions of the peaks, so the
# memory-bound parts (decode GEMMs, elementwise ops, decode attention) scale with bandwidth
# and the compute-bound ones stay. Kernel efficiencies that change with memory size or
# clocks are not modelled.
SIBLINGS = {"a100-40gb": "a100-80gb", "h200": "h100-80gb"}


def fits_for(gpu: GPUSpec) -> dict | None:
    """This GPU's fitted shape model: measured, or a sibling's scaled by bandwidth (else None)."""
    fits = gpu_fits()
    if gpu.name in fits:
        return fits[gpu.name]
    sibling = fits.get(SIBLINGS.get(gpu.name, ""))
    if sibling is None:
        return None
    return sibling | {
        "bandwidth": gpu.hbm_tb_s * 1e12,
        "scaled_from": SIBLINGS[gpu.name],
        "device": f"{sibling['device']}, scaled to {gpu.name}'s {gpu.hbm_tb_s} TB/s HBM",
    }


def find_shipped(model: ModelSpec, gpu: GPUSpec) -> Profile | None:
    """The shipped profile of this GPU whose layer shapes match; the same model name first."""
    shape = model_shape(model)
    metas = {name: shipped_meta(name) for name in shipped_names()}
    found = [name for name, meta in metas.items() if meta["gpu"] == gpu.name and same_shape(meta["model"], shape)]
    found.sort(key=lambda name: metas[name]["model"].get("name") != model.name)
    return load_profile(found[0]) if found else None


def predict_linear(fits: dict, shape: dict, tps=TP_GRID, tokens=None) -> pd.DataFrame:
    """Per-op milliseconds on a (tp, tokens) grid from one GPU's fitted shape model."""
    import pandas as pd

    tokens = np.array(tokens or token_grid())
    peak, bw = fits["peak_flops"], fits["bandwidth"]
    frames = []
    for tp in tps:
        cols = {"tp": np.full(len(tokens), tp), "num_tokens": tokens}
        for op in GEMM_OPS:
            if shape.get("num_experts") and op in MOE_OPS:
                cols[op] = moe_mlp_seconds(fits["gemm"], shape, op, tokens, tp, peak, bw) * 1e3
                continue
            k, n = gemm_kn(shape, op, tp)
            flops, nbytes = gemm_work(tokens, k, n)
            cols[op] = predict_gemm(fits["gemm"], flops, nbytes, peak, bw) * 1e3
        for op in ELEMENTWISE_OPS:
            nbytes = tokens * elementwise_bytes_per_token(shape, op, tp)
            cols[op] = predict_elementwise(fits["elementwise"][op], nbytes, bw) * 1e3
        if not shape.get("rope", True):
            cols["attn_rope"] = np.zeros(len(tokens))
        frames.append(pd.DataFrame(cols))
    return pd.concat(frames, ignore_index=True)[["tp", "num_tokens", *LINEAR_OPS]]


def synthesize(model: ModelSpec, gpu: GPUSpec) -> Profile | None:
    """A predicted profile for `model` on `gpu`, or None when the GPU has no fits."""
    fits = fits_for(gpu)
    if fits is None:
        return None
    shape = model_shape(model)
    how = (
        f"the {fits['scaled_from']} shape model scaled by HBM bandwidth"
        if "scaled_from" in fits
        else f"the {gpu.name} GEMM/elementwise shape model"
    )
    meta = {
        "format": FORMAT,
        "name": f"{gpu.name}-{model.name}-predicted",
        "gpu": gpu.name,
        "device": fits["device"],
        "model": shape,
        "dtype": "bf16",
        "origin": {
            "linear": f"predicted by {how} (fitted on {', '.join(fits['models'])})"
            + ("; MoE MLP by the experts each token count touches" if model.is_moe else ""),
            "attention": fits["attention_origin"],
        },
        "attention": fits["attention"],
        "allreduce": fits["allreduce"],
        "peak_flops": fits["peak_flops"],
        "bandwidth": fits["bandwidth"],
        "label": f"predicted:{gpu.name}/{model.name} ("
        + (f"{fits['scaled_from']} shape model, HBM-scaled)" if "scaled_from" in fits else "GPU shape model)"),
        "step_overhead_s": fits["step_overhead_s"],
        "source": fits["source"],
        "license": fits["license"],
    }
    return Profile(meta, predict_linear(fits, shape))


def check_profile(
    ref: str, model: ModelSpec, base_dir: Path, src: str, field_name: str = "cost_model.profile"
) -> Profile:
    """Load a profile named in a scenario (or on the command line) and check it fits the model."""
    prof = load_profile(ref, base_dir, src, field_name)
    shape = model_shape(model)
    if not same_shape(prof.meta["model"], shape):
        have = ", ".join(f"{k} {prof.meta['model'].get(k)}" for k in SHAPE_KEYS)
        raise InputError(
            src,
            field_name,
            f"profile '{prof.name}' was measured for "
            f"{prof.meta['model'].get('name', '?')} ({have}), not {model.name}; "
            "use a profile of this model or cost_model: calibrated",
        )
    return prof
