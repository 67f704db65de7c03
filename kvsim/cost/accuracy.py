"""Held-out error of a profile: fit on part of its measured points, predict the rest.

* Linear ops: per tp, the table's even-indexed token counts predict the odd-indexed
  ones by the same piecewise-linear interpolation the cost model uses (so the grid is
  half as dense as the cost model's: a pessimistic bound on its interpolation error).
  Rows whose ``origin`` is "predicted" are skipped as not measurements.
* Attention (when the profile carries attention.csv): the fitted forms of
  kvsim.cost.fit, 5-fold cross-validated on the measured points.

MAPE = mean of |predicted - measured| / measured, per operator and over all of them.
A profile made by `kvsim calibrate` also carries whole forward steps timed end to end
against its prediction (kvsim.calibrate.validate); the report passes them on as ``end_to_end``.
For shipped profiles the errors against the full source data (denser than the shipped
grid) and the leave-one-shape-out error of the GPU shape model are in
kvsim/data/profiles/accuracy.json, written by scripts/derive_profiles.py. For any other
profile measured on a GPU that kvsim predicts without it (its own shape model, or a
sibling's scaled by HBM bandwidth), the report sets that prediction against the measured
linear ops (``against_prediction``): how far kvsim was from this GPU before it was measured.
"""

from __future__ import annotations

import json

import numpy as np

from kvsim.cost.fit import LINEAR_OPS, PER_STEP_OPS, fit_attention, kfold, mape, predict_attention
from kvsim.cost.generalize import fits_for, predict_linear
from kvsim.cost.profiles import SHIPPED, Profile
from kvsim.model.specs import GPU_PRESETS


def linear_heldout(profile: Profile) -> dict[str, float]:
    out = {}
    for op in LINEAR_OPS:
        errs = []
        for tp, rows in profile.linear.groupby("tp"):
            rows = rows.sort_values("num_tokens")
            x, y = rows.num_tokens.values, rows[op].values
            if len(x) < 3:
                continue
            pred = np.interp(x[1::2], x[0::2], y[0::2])
            errs.append(np.abs(pred - y[1::2]) / y[1::2])
        if errs:
            out[op] = float(np.mean(np.concatenate(errs)))
    return out


def attention_heldout(profile: Profile) -> dict[str, float]:
    rows = profile.attention_rows
    if rows is None or len(rows) < 10:
        return {}
    shape = profile.meta.get("measured_shape", profile.meta["model"])
    peak, bw = profile.meta["peak_flops"], profile.meta["bandwidth"]
    cols = {c: rows[c].values for c in rows}
    folds = kfold(len(rows))
    pred = np.zeros(len(rows))
    for k in range(5):
        fit = fit_attention({c: v[folds != k] for c, v in cols.items()}, shape, peak, bw)
        pred[folds == k] = predict_attention(fit, {c: v[folds == k] for c, v in cols.items()}, shape, peak, bw)
    t = rows.time_ms.values * 1e-3
    pre = rows.phase.values == "prefill"
    parts = {
        "attn_prefill_whole_prompt": pre & (rows.context.values == 0),
        "attn_prefill_chunk_on_cache": pre & (rows.context.values > 0),
        "attn_decode": ~pre,
    }
    return {name: mape(pred[m], t[m]) for name, m in parts.items() if m.any()}


def against_prediction(profile: Profile) -> dict | None:
    """kvsim's prediction of this profile's linear ops made without it, against them: per
    op, and for a step's linear ops (summed over the layers, the LM head at as many
    sequences as tokens, as in a decode step) at up to 128 tokens and above, the median
    signed error (predicted / measured - 1) and the MAPE."""
    gpu = GPU_PRESETS.get(profile.meta["gpu"])
    fits = fits_for(gpu) if gpu else None
    if fits is None or profile.meta.get("shape_scale", 1) != 1:
        return None
    shape, measured = profile.meta["model"], profile.linear
    predicted = predict_linear(fits, shape, sorted(set(measured.tp)), sorted(set(measured.num_tokens)))
    both = measured.merge(predicted, on=["tp", "num_tokens"], suffixes=("", "_predicted"))

    def summary(err) -> dict:
        return {"median": round(float(np.median(err)), 4), "mape": round(float(np.mean(np.abs(err))), 4)}

    def step(suffix: str):
        return sum(both[op + suffix] * (1 if op in PER_STEP_OPS else shape["num_layers"]) for op in LINEAR_OPS)

    err = step("_predicted") / step("") - 1
    small = both.num_tokens.values <= 128
    return {
        "prediction": f"{fits['device']}; fitted on {', '.join(fits['models'])}",
        "ops": {op: summary(both[op + "_predicted"] / both[op] - 1) for op in LINEAR_OPS},
        "step": {"<= 128 tokens": summary(err[small]), "> 128 tokens": summary(err[~small])},
    }


def report(profile: Profile) -> dict:
    linear_origin = str(profile.meta.get("origin", {}).get("linear", "measured"))
    lin = {} if linear_origin.startswith("predicted") else linear_heldout(profile)
    per_op = {
        **{k: v for k, v in lin.items() if not profile.meta.get("origin", {}).get(k, "").startswith("predicted")},
        **attention_heldout(profile),
    }
    out = {
        "profile": profile.name,
        "linear_origin": linear_origin,
        "method": "linear ops: even token counts predict odd ones; attention: 5-fold CV",
        "mape": {k: round(v, 4) for k, v in per_op.items()},
        "overall_mape": round(float(np.mean(list(per_op.values()))), 4) if per_op else None,
    }
    if "validation" in profile.meta:
        out["end_to_end"] = profile.meta["validation"]
    acc = SHIPPED / "accuracy.json"
    if (SHIPPED / profile.name).is_dir() and acc.is_file():
        src = json.loads(acc.read_text())
        out["source_data"] = {
            "interpolation_vs_all_measured": src["interpolation"].get(profile.name),
            "gpu_shape_model_leave_one_shape_out": src["leave_one_shape_out"].get(profile.meta["gpu"]),
            "attention_5fold": src["attention"],
        }
    elif not linear_origin.startswith("predicted") and (against := against_prediction(profile)):
        out["against_prediction"] = against
    return out
