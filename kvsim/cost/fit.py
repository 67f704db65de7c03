"""Operator shapes and the fitted forms that turn a shape into a kernel time.

Everything here is per transformer layer and per GPU of a tensor-parallel group (a
layer's weights are split over `tp` GPUs, Megatron-style: QKV and MLP-up by columns,
output projection and MLP-down by rows). Times are seconds; bf16/fp16 weights and
activations (2 bytes).

Three kinds of fitted form, all fitted by least squares on *relative* error (rows
weighted by 1/time), with numpy only:

* GEMMs (QKV, output projection, MLP up/down, LM head) of M tokens x K -> N, with
  FLOPs = 2MKN and bytes = 2(MK + KN + MN): a fixed launch time plus a smooth maximum
  of the memory time bytes / (bandwidth x e_bw) and the compute time
  FLOPs / (peak x e_flops) — a GPU's GEMM efficiency as a function of operator shape
  (small M: bandwidth-bound on the weights; large M: compute-bound). The same
  constants hold for any shape, so extrapolation is the form itself. Tile and wave
  quantization (the staircase in the measured times) is what it does not capture.
* Elementwise ops (norms, activation, RoPE, residual add, embedding gather):
  t = a + bytes / (bandwidth x e).
* Attention, with an efficiency that rises with the work W of one kernel launch:
  t = a + W / (peak x e_max) x (1 + (W_half / W)^k) [+ linear extras], where W is FLOPs
  against the peak BF16 rate (prefill) or KV bytes read against HBM bandwidth (decode).
  Efficiency is e_max / (1 + (W_half/W)^k): half of e_max at W_half. Because the form
  is in efficiencies, not seconds, it transfers to another GPU through its peaks.
"""

from __future__ import annotations

import numpy as np

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "lm_head")
ELEMENTWISE_OPS = ("emb", "input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
LINEAR_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
    "lm_head",
)
PER_STEP_OPS = ("emb", "lm_head")  # once a step; every other linear op once a layer
ACT_BYTES = 2


def gemm_kn(shape: dict, op: str, tp: int) -> tuple[float, float]:
    """(K, N) of one GPU's share of a GEMM; M is the token count."""
    h, heads, kv, d = shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    ffn = shape["intermediate_size"] * (2 if shape.get("gated_mlp", True) else 1)
    qkv = shape.get("qkv_width", (heads + 2 * kv) * d)  # MLA: see kvsim.cost.generalize
    return {
        "attn_pre_proj": (h, qkv / tp),
        "attn_post_proj": (heads * d / tp, h),
        "mlp_up_proj": (h, ffn / tp),
        "mlp_down_proj": (shape["intermediate_size"] / tp, h),
        "lm_head": (h, shape["vocab_size"] / tp),
    }[op]


def elementwise_bytes_per_token(shape: dict, op: str, tp: int) -> float:
    """Bytes an elementwise op reads and writes per token (one GPU's share)."""
    h, f = shape["hidden_size"], shape.get("mlp_act_width", shape["intermediate_size"])  # MoE: kvsim.cost.moe
    qk = (shape["num_heads"] + shape["num_kv_heads"]) * shape["head_dim"]
    gated = shape.get("gated_mlp", True)
    elems = {
        "emb": 2 * h,
        "input_layernorm": 2 * h,
        "post_attention_layernorm": 2 * h,
        "add": 3 * h,
        "mlp_act": (3 if gated else 2) * f / tp,
        "attn_rope": 2 * qk / tp if shape.get("rope", True) else 0,
    }[op]
    return elems * ACT_BYTES


def gemm_work(m, k, n) -> tuple[np.ndarray, np.ndarray]:
    m, k, n = (np.asarray(x, dtype=float) for x in (m, k, n))
    return 2 * m * k * n, ACT_BYTES * (m * k + k * n + m * n)


def _wls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1 / y
    return np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]


def _smooth_roof(fit: dict, flops, nbytes, peak_flops: float, bandwidth: float):
    p = fit["p"]
    mem = np.asarray(nbytes, dtype=float) / (bandwidth * fit["bw_eff"])
    comp = np.asarray(flops, dtype=float) / (peak_flops * fit["flops_eff"])
    return fit["a_s"] + (mem**p + comp**p) ** (1 / p)


def fit_gemm(flops, nbytes, t, peak_flops: float, bandwidth: float) -> dict:
    """t = a + ((bytes/(BW e_bw))^p + (FLOPs/(peak e_flops))^p)^(1/p), searched on grids.

    A smooth maximum of the two roofline times: p = 1 adds them, large p takes the
    larger. The fitted e_bw and e_flops are the GPU's achieved fractions of its peaks.
    """
    flops, nbytes, t = (np.asarray(x, dtype=float) for x in (flops, nbytes, t))
    w2 = 1 / t**2
    best = (np.inf, None)
    for p in (1.0, 1.25, 1.5, 2.0, 3.0):
        grids, here = [np.geomspace(0.05, 1.5, 30)] * 2, (np.inf, None)
        for span in (1.125, 1.025, 1.005):  # coarse grid, then finer ones around the best
            for e_bw in grids[0]:
                for e_fl in grids[1]:
                    fit = {"a_s": 0.0, "p": p, "bw_eff": float(e_bw), "flops_eff": float(e_fl)}
                    r = _smooth_roof(fit, flops, nbytes, peak_flops, bandwidth)
                    fit["a_s"] = max(float(np.sum((t - r) * w2) / np.sum(w2)), 0.0)
                    err = float(np.mean(np.abs(fit["a_s"] + r - t) / t))
                    here = min(here, (err, fit), key=lambda x: x[0])
            grids = [here[1][k] * span ** np.linspace(-1, 1, 11) for k in ("bw_eff", "flops_eff")]
        best = min(best, here, key=lambda x: x[0])
    return best[1]


def predict_gemm(fit: dict, flops, nbytes, peak_flops: float, bandwidth: float):
    return _smooth_roof(fit, flops, nbytes, peak_flops, bandwidth)


def fit_elementwise(nbytes, t, bandwidth: float) -> dict:
    nbytes, t = np.asarray(nbytes, dtype=float), np.asarray(t, dtype=float)
    a, b = _wls(np.column_stack([np.ones_like(t), nbytes]), t)
    a, b = max(a, 0.0), max(b, 1e-30)
    return {"a_s": float(a), "bw_eff": float(1 / (b * bandwidth))}


def predict_elementwise(fit: dict, nbytes, bandwidth: float):
    return fit["a_s"] + np.asarray(nbytes, dtype=float) / (bandwidth * fit["bw_eff"])


def fit_ramp(work, t, rate: float, extras: dict[str, np.ndarray] | None = None) -> dict:
    """Fit t = a + W/(rate e_max) (1 + (W_half/W)^k) + sum(c_i x_i), best k on a grid."""
    work, t = np.asarray(work, dtype=float), np.asarray(t, dtype=float)
    extras = extras or {}
    best = None
    for k in np.round(np.arange(0.1, 0.95, 0.05), 2):
        x = np.column_stack([np.ones_like(t), work, work ** (1 - k), *extras.values()])
        c = np.maximum(_wls(x, t), 0.0)  # no negative time terms
        err = np.mean(((x @ c) - t) ** 2 / t**2)
        if best is None or err < best[0]:
            best = (err, k, c)
    _, k, c = best
    e_max = 1 / (max(c[1], 1e-30) * rate)
    w_half = (c[2] / max(c[1], 1e-30)) ** (1 / k) if c[2] > 0 else 0.0
    out = {"a_s": float(c[0]), "e_max": float(e_max), "w_half": float(w_half), "k": float(k)}
    out.update({name: float(v) for name, v in zip(extras, c[3:])})
    out["range"] = [float(work.min()), float(work.max())]
    return out


def predict_ramp(fit: dict, work, rate: float, extras: dict[str, np.ndarray] | None = None):
    work = np.maximum(np.asarray(work, dtype=float), 1.0)
    t = fit["a_s"] + work / (rate * fit["e_max"]) * (1 + (fit["w_half"] / work) ** fit["k"])
    for name, x in (extras or {}).items():
        t = t + fit.get(name, 0.0) * np.asarray(x, dtype=float)
    return t


def fit_linear(cols: dict[str, np.ndarray], t) -> dict:
    """t = a + sum(c_i x_i), non-negative coefficients (KV-cache writes)."""
    t = np.asarray(t, dtype=float)
    c = np.maximum(_wls(np.column_stack([np.ones_like(t), *cols.values()]), t), 0.0)
    return {"a_s": float(c[0]), **{name: float(v) for name, v in zip(cols, c[1:])}}


def mape(pred, actual) -> float:
    pred, actual = np.asarray(pred, dtype=float), np.asarray(actual, dtype=float)
    return float(np.mean(np.abs(pred - actual) / actual))


def kfold(n: int, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Fold label per row: a fixed random split for held-out errors."""
    return np.random.default_rng(seed).integers(0, folds, n)


# --- attention ----------------------------------------------------------------------
def kv_bytes_per_token(shape: dict, tp: int, kv_bits: float) -> float:
    """KV bytes one layer holds per token on one GPU (MLA's latent is not split by tp)."""
    if shape.get("kv_lora_rank"):
        return (shape["kv_lora_rank"] + shape.get("qk_rope_head_dim", 0)) * kv_bits / 8
    return 2 * max(shape["num_kv_heads"] / tp, 1) * shape["head_dim"] * kv_bits / 8


def prefill_flops(shape: dict, tp: int, chunk, cached):
    """QK^T and PV over every query head on one GPU: causal within the chunk, full to the cache."""
    chunk, cached = np.asarray(chunk, dtype=float), np.asarray(cached, dtype=float)
    return 4 * shape["num_heads"] / tp * shape["head_dim"] * chunk * (cached + (chunk + 1) / 2)


def attention_features(rows: dict, shape: dict) -> dict:
    """Work of each measured attention row (columns as in a profile's attention.csv)."""
    tp, bits = np.asarray(rows["tp"]), np.asarray(rows["kv_bits"], dtype=float)
    batch, ctx = np.asarray(rows["batch_size"], dtype=float), np.asarray(rows["context"], dtype=float)
    per_tok = np.array([kv_bytes_per_token(shape, int(p), b) for p, b in zip(tp, bits)])
    return {
        "flops": prefill_flops(shape, tp, rows["chunk_tokens"], ctx),
        "kv_bytes": batch * ctx * per_tok,
        "batch": batch,
        "blocks": batch * np.ceil(ctx / np.asarray(rows["block_size"], dtype=float)),
    }


def fit_attention(rows: dict, shape: dict, peak_flops: float, bandwidth: float) -> dict:
    """Fit the prefill (whole prompt / chunk on a cache), decode and KV-write forms."""
    f, t = attention_features(rows, shape), np.asarray(rows["time_ms"], dtype=float) * 1e-3
    pre = np.asarray(rows["phase"]) == "prefill"
    fresh, cached = pre & (np.asarray(rows["context"]) == 0), pre & (np.asarray(rows["context"]) > 0)
    dec = ~pre
    extras = {"per_seq_s": f["batch"][dec]}
    if len(set(np.asarray(rows["block_size"])[dec])) > 1:
        extras["per_block_s"] = f["blocks"][dec]  # only when block sizes were varied
    out = {
        "prefill_fresh": fit_ramp(f["flops"][fresh], t[fresh], peak_flops),
        "prefill_cached": fit_ramp(f["flops"][cached], t[cached], peak_flops) if cached.any() else None,
        "decode": fit_ramp(f["kv_bytes"][dec], t[dec], bandwidth, extras),
    }
    dtypes = np.asarray(rows.get("kv_dtype", ["?"] * len(t)))
    if len(set(dtypes[dec])) > 1:  # dequantizing costs differ by format, not only by bytes
        out["decode_by_dtype"] = {
            str(dt): fit_ramp(
                f["kv_bytes"][dec & (dtypes == dt)],
                t[dec & (dtypes == dt)],
                bandwidth,
                {k: v[dtypes[dec] == dt] for k, v in extras.items()},
            )
            for dt in sorted(set(dtypes[dec]))
        }
    if "kv_write_ms" in rows:
        tokens = np.where(pre, np.asarray(rows["chunk_tokens"], dtype=float), f["batch"])
        out["kv_write"] = fit_linear(
            {"per_prefill_token_s": np.where(pre, tokens, 0), "per_decode_token_s": np.where(pre, 0, tokens)},
            np.asarray(rows["kv_write_ms"], dtype=float) * 1e-3,
        )
    return out


def predict_attention(fit: dict, rows: dict, shape: dict, peak_flops: float, bandwidth: float):
    """Predicted kernel seconds for each row of `rows` (held-out checks)."""
    f = attention_features(rows, shape)
    pre = np.asarray(rows["phase"]) == "prefill"
    cached = pre & (np.asarray(rows["context"]) > 0)
    fresh_t = predict_ramp(fit["prefill_fresh"], f["flops"], peak_flops)
    cached_t = predict_ramp(fit["prefill_cached"], f["flops"], peak_flops) if fit.get("prefill_cached") else fresh_t
    extras = {"per_seq_s": f["batch"], "per_block_s": f["blocks"]}
    dec_t = predict_ramp(fit["decode"], f["kv_bytes"], bandwidth, extras)
    for dt, dfit in fit.get("decode_by_dtype", {}).items():
        dec_t = np.where(
            np.asarray(rows["kv_dtype"]) == dt, predict_ramp(dfit, f["kv_bytes"], bandwidth, extras), dec_t
        )
    return np.where(cached, cached_t, np.where(pre, fresh_t, dec_t))
