"""Derive kvsim's shipped step-cost profiles from measured GPU kernel timings.

Reads ``../shared/data/profiling`` (relative to the repository root; pass another folder
as the first argument) and writes ``kvsim/data/profiles/``:

* one folder per (GPU, model) profile: meta.json + linear.csv. The linear table keeps,
  per tensor-parallel degree, the median timing (the source's median over repeats; the
  median again where the source measured a token count twice) at the measured token
  count nearest to each point of a 16-per-octave grid — about 130 of the source's
  259-451 counts. ``lm_head`` is not in the source and is predicted by the GPU's
  GEMM shape model;
* ``gpus.json``: per GPU, the GEMM efficiency fitted on every measured model's
  shapes, elementwise bandwidth fits, the attention forms and the all-reduce
  assumption (kvsim.cost.generalize uses them for models without a profile);
* ``accuracy.json``: held-out errors — interpolation (fit on the grid, predict the
  other measured counts), leave-one-shape-out for the shape model, 5-fold
  cross-validation for the attention forms.

Coverage: A100 Llama-2-7B/70B and Llama-3-8B/70B and H100 Llama-2-7B/70B are
measured. H100 Llama-3-70B borrows H100 Llama-2-70B's linear ops (identical layer
shapes; only the vocabulary differs, which touches emb and lm_head). H100 Llama-3-8B
has no measurement: its linear ops are predicted by the H100 shape model (fitted on
Llama-2-7B and -70B). Attention is fitted on the A100 Llama-3-8B FlashInfer sample
only; every other profile uses those efficiencies through its own model shape and GPU
peaks.

Source: microsoft/vidur data/profiling/compute (MIT licence), measured with
Sarathi-Serve's profiler. Output is deterministic (sorted keys, rounded floats).

Usage: python scripts/derive_profiles.py [PROFILING_DIR] [OUT_DIR]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.cost.generalize import model_shape, predict_linear, token_grid
from kvsim.cost.fit import (
    GEMM_OPS,
    LINEAR_OPS,
    elementwise_bytes_per_token,
    fit_attention,
    fit_elementwise,
    fit_gemm,
    gemm_kn,
    gemm_work,
    kfold,
    mape,
    predict_attention,
    predict_elementwise,
    predict_gemm,
)
from kvsim.cost.profiles import FORMAT, Profile, save_profile
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS

REPO = Path(__file__).resolve().parent.parent
DEFAULT_IN = REPO.parent / "shared" / "data" / "profiling"
DEFAULT_OUT = REPO / "kvsim" / "data" / "profiles"
SOURCE = (
    "microsoft/vidur data/profiling/compute/<gpu>/<model>/mlp.csv and (A100 Llama-3-8B) "
    "attention.csv, measured with Sarathi-Serve's profiler (CUDA kernel timings, ms per layer)"
)
LICENSE = "MIT (microsoft/vidur)"
DATE = "2024 (vidur's profiling data; derived by kvsim 2025)"
MEASURED = {  # file stem -> (gpu preset, model preset)
    "a100_Llama-2-7b-hf": ("a100-80gb", "llama-2-7b"),
    "a100_Llama-2-70b-hf": ("a100-80gb", "llama-2-70b"),
    "a100_Meta-Llama-3-8B": ("a100-80gb", "llama-3-8b"),
    "a100_Meta-Llama-3-70B": ("a100-80gb", "llama-3-70b"),
    "h100_Llama-2-7b-hf": ("h100-80gb", "llama-2-7b"),
    "h100_Llama-2-70b-hf": ("h100-80gb", "llama-2-70b"),
}
DEVICE = {"a100-80gb": "NVIDIA A100 80GB SXM (vidur 'a100')", "h100-80gb": "NVIDIA H100 80GB SXM (vidur 'h100')"}
# ASSUMED, not measured (the source has no collective timings): ring all-reduce at 80% of
# the per-direction NVLink bandwidth on the datasheets (A100 SXM 600 GB/s, H100 SXM
# 900 GB/s in both directions together) plus a fixed latency per call.
ALLREDUCE = {
    g: {
        "bus_gb_s": bw,
        "latency_s": 8e-6,
        "source": "ASSUMED: 80% of per-direction NVLink "
        f"bandwidth ({bw / 0.8:.0f} GB/s, NVIDIA datasheet) + 8 us per call; not measured",
    }
    for g, bw in (("a100-80gb", 240.0), ("h100-80gb", 360.0))
}
OVERHEAD_NOTE = (
    "0: the source data holds GPU kernel times only; the engine's host time and fitted "
    "all-reduce come from cost_model.overhead (kvsim/data/overheads)"
)


def read_mlp(path: Path) -> pd.DataFrame:
    """Long-form (op, tp, tokens, seconds), medians of repeated measurements."""
    d = pd.read_csv(path)
    ops = [op for op in LINEAR_OPS if f"time_stats.{op}.median" in d]
    long = d.melt(
        id_vars=["num_tensor_parallel_workers", "num_tokens"],
        value_vars=[f"time_stats.{op}.median" for op in ops],
        var_name="op",
        value_name="ms",
    )
    long["op"] = long.op.str.split(".").str[1]
    long = long.rename(columns={"num_tensor_parallel_workers": "tp"})
    return long.groupby(["op", "tp", "num_tokens"], as_index=False).ms.median()


def grid_of(measured: np.ndarray) -> np.ndarray:
    return np.unique([measured[np.abs(measured - g).argmin()] for g in token_grid(int(measured.max()))])


def with_work(long: pd.DataFrame, shape: dict) -> pd.DataFrame:
    """Add each row's GEMM FLOPs and bytes, or an elementwise op's bytes (one GPU's share)."""
    d = long.copy()
    gemm = d.op.isin(GEMM_OPS)
    kn = np.array([gemm_kn(shape, op, tp) if g else (1, 1) for op, tp, g in zip(d.op, d.tp, gemm)])
    d["flops"], d["bytes"] = gemm_work(d.num_tokens, kn[:, 0], kn[:, 1])
    per_token = [0.0 if g else elementwise_bytes_per_token(shape, op, tp) for op, tp, g in zip(d.op, d.tp, gemm)]
    d.loc[~gemm, "bytes"] = (d.num_tokens * np.array(per_token))[~gemm]
    d["shape_key"] = f"{shape['hidden_size']}/{shape['intermediate_size']}"
    return d


def fit_shapes(rows: pd.DataFrame, peak: float, bw: float) -> dict:
    g = rows[rows.op.isin(GEMM_OPS)]
    return {
        "gemm": fit_gemm(g.flops, g.bytes, g.ms * 1e-3, peak, bw),
        "elementwise": {
            op: fit_elementwise(e.bytes, e.ms * 1e-3, bw) for op, e in rows[~rows.op.isin(GEMM_OPS)].groupby("op")
        },
    }


def predict_shapes(fits: dict, rows: pd.DataFrame, peak: float, bw: float) -> np.ndarray:
    pred = predict_gemm(fits["gemm"], rows.flops, rows.bytes, peak, bw)
    for op, f in fits["elementwise"].items():
        pred = np.where(rows.op == op, predict_elementwise(f, rows.bytes, bw), pred)
    return pred * 1e3


def fit_gpu(gpu: str, data: dict, attention: dict) -> tuple[dict, dict]:
    """Shape-model fits on every model of one GPU, and their leave-one-shape-out error
    (models with identical layer shapes, Llama-2-70B and Llama-3-70B, are held out together)."""
    spec = GPU_PRESETS[gpu]
    peak, bw = spec.bf16_tflops * 1e12, spec.hbm_tb_s * 1e12
    rows = pd.concat([with_work(long, shape).assign(model=name) for name, (long, shape) in data.items()])
    fits = {
        "peak_flops": peak,
        "bandwidth": bw,
        "device": DEVICE[gpu],
        "models": sorted(data),
        **fit_shapes(rows, peak, bw),
        "attention": attention,
        "allreduce": ALLREDUCE[gpu],
        "step_overhead_s": 0.0,
        "source": SOURCE,
        "license": LICENSE,
        "attention_origin": "fitted on A100 Llama-3-8B FlashInfer timings (vidur), "
        "applied through this model's shapes and the GPU's peaks",
    }
    loso = {}
    for key in sorted(rows.shape_key.unique()):
        tr, te = rows[rows.shape_key != key], rows[rows.shape_key == key].copy()
        te["pred"] = predict_shapes(fit_shapes(tr, peak, bw), te, peak, bw)
        gemm = te.op.isin(GEMM_OPS)
        layer = te[te.op != "emb"].groupby(["model", "tp", "num_tokens"])[["pred", "ms"]].sum()
        loso[key] = {
            "held_out_models": sorted(te.model.unique()),
            "trained_on": sorted(tr.model.unique()),
            "gemm_mape": round(mape(te.pred[gemm], te.ms[gemm]), 4),
            "layer_total_mape": round(mape(layer.pred, layer.ms), 4),
            "per_op": {op: round(mape(s.pred, s.ms), 4) for op, s in te.groupby("op")},
        }
    return fits, loso


def attention_rows(path: Path) -> pd.DataFrame:
    d = pd.read_csv(path)
    pre = d.is_prefill.astype(bool)
    return pd.DataFrame(
        {
            "phase": np.where(pre, "prefill", "decode"),
            "tp": d.num_tensor_parallel_workers,
            "batch_size": d.batch_size,
            "chunk_tokens": np.where(pre, d.prefill_chunk_size, 0),
            "context": d.kv_cache_size,
            "block_size": d.block_size,
            "kv_dtype": "fp16",
            "kv_bits": 16,
            "time_ms": np.where(pre, d["time_stats.attn_prefill.median"], d["time_stats.attn_decode.median"]),
            "kv_write_ms": d["time_stats.attn_kv_cache_save.median"],
        }
    )


def attention_accuracy(rows: pd.DataFrame, shape: dict, peak: float, bw: float) -> dict:
    folds = kfold(len(rows))
    pred = np.zeros(len(rows))
    for k in range(5):
        fit = fit_attention({c: rows[c].values[folds != k] for c in rows}, shape, peak, bw)
        pred[folds == k] = predict_attention(fit, {c: rows[c].values[folds == k] for c in rows}, shape, peak, bw)
    t = rows.time_ms.values * 1e-3
    parts = {
        "prefill_whole_prompt": (rows.phase == "prefill") & (rows.context == 0),
        "prefill_chunk_on_cache": (rows.phase == "prefill") & (rows.context > 0),
        "decode": rows.phase == "decode",
    }
    write = np.zeros(len(rows))
    for k in range(5):
        fit = fit_attention({c: rows[c].values[folds != k] for c in rows}, shape, peak, bw)["kv_write"]
        te = rows[folds == k]
        tokens = np.where(te.phase == "prefill", te.chunk_tokens, te.batch_size)
        write[folds == k] = (
            fit["a_s"] + np.where(te.phase == "prefill", fit["per_prefill_token_s"], fit["per_decode_token_s"]) * tokens
        ) * 1e3
    return {name: {"mape": round(mape(pred[m], t[m]), 4), "rows": int(m.sum())} for name, m in parts.items()} | {
        "all": {"mape": round(mape(pred, t), 4), "rows": len(rows)},
        "method": "5-fold cross-validation",
        "kv_write": {"mape": round(mape(write, rows.kv_write_ms), 4), "rows": len(rows)},
    }


def interpolation_accuracy(long: pd.DataFrame, grid: dict) -> dict:
    out = {}
    for op, g in long.groupby("op"):
        errs = []
        for tp, s in g.groupby("tp"):
            keep = s.num_tokens.isin(grid[tp])
            pred = np.interp(s.num_tokens[~keep], s.num_tokens[keep], s.ms[keep])
            errs.append(np.abs(pred - s.ms[~keep].values) / s.ms[~keep].values)
        out[op] = round(float(np.concatenate(errs).mean()), 4)
    out["all_ops"] = round(float(np.mean(list(out.values()))), 4)
    return out


def main(src: Path = DEFAULT_IN, out: Path = DEFAULT_OUT) -> None:
    att_rows = attention_rows(src / "a100_Meta-Llama-3-8B.attention.sample.csv")
    a100 = GPU_PRESETS["a100-80gb"]
    s8b = model_shape(MODEL_PRESETS["llama-3-8b"])
    attention = fit_attention(
        {c: att_rows[c].values for c in att_rows}, s8b, a100.bf16_tflops * 1e12, a100.hbm_tb_s * 1e12
    )
    accuracy = {
        "attention": attention_accuracy(att_rows, s8b, a100.bf16_tflops * 1e12, a100.hbm_tb_s * 1e12),
        "interpolation": {},
        "leave_one_shape_out": {},
    }
    measured, by_gpu = {}, {}
    for stem, (gpu, model) in MEASURED.items():
        long, shape = read_mlp(src / f"{stem}.mlp.csv"), model_shape(MODEL_PRESETS[model])
        measured[(gpu, model)] = long
        by_gpu.setdefault(gpu, {})[model] = (long, shape)
    gpus = {}
    for gpu, data in by_gpu.items():
        gpus[gpu], accuracy["leave_one_shape_out"][gpu] = fit_gpu(gpu, data, attention)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for (gpu, model), long in measured.items():
        grid = {tp: grid_of(s.num_tokens.unique()) for tp, s in long.groupby("tp")}
        accuracy["interpolation"][f"{gpu[:4]}-{model}"] = interpolation_accuracy(long, grid)
    plan = {(g, m): (g, m, "measured") for g, m in measured}
    plan[("h100-80gb", "llama-3-70b")] = (
        "h100-80gb",
        "llama-2-70b",
        "borrowed from H100 Llama-2-70B (identical layer shapes; vocabulary differs)",
    )
    plan[("h100-80gb", "llama-3-8b")] = (
        None,
        None,
        "predicted by the H100 shape model (no H100 Llama-3-8B measurement exists in the source)",
    )
    for (gpu, model), (src_gpu, src_model, origin) in sorted(plan.items()):
        shape, fits = model_shape(MODEL_PRESETS[model]), gpus[gpu]
        pred = predict_linear(fits, shape)
        if src_gpu is None:
            linear = pred
        else:
            long = measured[(src_gpu, src_model)]
            frames = []
            for tp, s in long.groupby("tp"):
                wide = (
                    s[s.num_tokens.isin(grid_of(s.num_tokens.unique()))]
                    .pivot(index="num_tokens", columns="op", values="ms")
                    .reset_index()
                )
                wide["tp"] = tp
                ks = np.array([gemm_kn(shape, "lm_head", tp)] * len(wide))
                flops, nbytes = gemm_work(wide.num_tokens, ks[:, 0], ks[:, 1])
                wide["lm_head"] = predict_gemm(fits["gemm"], flops, nbytes, fits["peak_flops"], fits["bandwidth"]) * 1e3
                frames.append(wide)
            linear = pd.concat(frames, ignore_index=True)
        name = f"{gpu[:4]}-{model}"
        meta = {
            "format": FORMAT,
            "name": name,
            "gpu": gpu,
            "device": DEVICE[gpu],
            "model": shape,
            "dtype": "fp16/bf16 (as profiled by vidur)",
            "date": DATE,
            "tools": {
                "profiler": "Sarathi-Serve profiler via microsoft/vidur",
                "attention_backend": "FlashInfer",
                "derived_with": "scripts/derive_profiles.py",
            },
            "origin": {
                "linear": origin,
                "lm_head": f"predicted by the {gpu} GEMM shape model",
                "attention": fits["attention_origin"],
                "allreduce": ALLREDUCE[gpu]["source"],
            },
            "attention": attention,
            "allreduce": ALLREDUCE[gpu],
            "step_overhead_s": 0.0,
            "peak_flops": fits["peak_flops"],
            "bandwidth": fits["bandwidth"],
            "step_overhead_source": OVERHEAD_NOTE,
            "source": SOURCE,
            "license": LICENSE,
            "notes": [
                "decode attention time jumps at some batch sizes (e.g. 13->14, 40->41, 108->109, "
                "160->168 in the A100 sample); the smooth fitted form averages over the jumps",
                "kv_write (FlashInfer KV append, as measured) costs ~0.55 us per prefill token "
                "per layer regardless of tp, far slower than HBM bandwidth; kept as measured",
            ],
        }
        prof = Profile(meta, linear, att_rows if (gpu, model) == ("a100-80gb", "llama-3-8b") else None)
        save_profile(prof, out / name)
    (out / "gpus.json").write_text(json.dumps(_round(gpus), indent=1, sort_keys=True) + "\n")
    (out / "accuracy.json").write_text(json.dumps(_round(accuracy), indent=1, sort_keys=True) + "\n")
    print(json.dumps(accuracy, indent=1, sort_keys=True))


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


if __name__ == "__main__":
    args = [Path(a) for a in sys.argv[1:3]]
    main(*args)
