"""Derive kvsim's shipped engine overhead from measured serving iterations.

Reads ``../shared/data/serving/splitwise_a100.csv`` (relative to the repository root;
pass another file as the first argument): whole prefill and decode iterations of
Llama-2-70B (tp 2, 4, 8) and BLOOM-176B (tp 8) served on a DGX-A100, from the
splitwise-sim repository (MIT, Microsoft Research; Patel et al., ISCA 2024). Writes

* ``kvsim/data/overheads/splitwise-a100-v2.json``: the fitted host overhead, kernel
  launch time and tensor-parallel communication (kvsim.cost.overhead), the rules applied to the data,
  every point with its kernel time, measured and fitted time, and the fit's error;
* ``kvsim/data/overheads/accuracy.json``: leave-one-out errors (fit on two of
  Llama-2-70B's tp degrees, predict the third; fit on Llama-2-70B, predict BLOOM-176B)
  per (model, tp, phase), the worst point, the same for the purely additive form of
  ``splitwise-a100-v1`` (no launch overlap), and kvsim's error before the overhead;

and prints the tables the documentation quotes (docs/step-costs.md). Each point's kernel time is what kvsim's
profile predicts for that step with no communication and no overhead: the shipped
``a100-llama-2-70b`` profile, or for BLOOM-176B (which has none) the A100 shape model.
Prefill points are batch x prompt new tokens in one step; a decode point is the mean
step over contexts prompt..prompt+tokens, priced at the middle context. The shipped fit
uses every usable A100 point (both models); the held-out errors come from the fits that
leave a part out. Deterministic: no randomness, sorted keys, rounded floats.

Usage: python scripts/derive_overheads.py [CSV] [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.cost.generalize import gpu_fits
from kvsim.cost.model import Profiled, StepBatch
from kvsim.cost.overhead import FORMAT, NONE
from kvsim.cost.overhead_fit import configurations, fit_overhead, predict
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, KVSpec

REPO = Path(__file__).resolve().parent.parent
DEFAULT_IN = REPO.parent / "shared" / "data" / "serving" / "splitwise_a100.csv"
DEFAULT_OUT = REPO / "kvsim" / "data" / "overheads"
NAME, VERSION = "splitwise-a100-v2", 2
MODELS = {"llama2-70b": "llama-2-70b", "bloom-176b": "bloom-176b"}
FITTED = "llama-2-70b"  # the model whose tp degrees are left out in turn
GPU = GPU_PRESETS["a100-80gb"]
COMM_PARTS = ("allreduce", "overhead_step", "overhead_seqs", "overhead_prompt_tokens", "overhead_launch")
SOURCE = (
    "splitwise-sim data/perf_model.csv (Microsoft Research, MIT licence), the characterization "
    "behind Splitwise (Patel et al., ISCA 2024): whole iterations on a DGX-A100 (A100-80GB SXM, "
    "NVLink), fp16"
)


def points(cfg: pd.DataFrame) -> pd.DataFrame:
    """Two points per configuration (prefill, decode) with kvsim's kernel time and the
    profile's assumed all-reduce (what kvsim predicted before this overhead)."""
    rows, models = [], {}
    for c in cfg.itertuples():
        model = MODEL_PRESETS[MODELS[c.model]]
        key = (model.name, c.tensor_parallel)
        if key not in models:
            models[key] = Profiled(model, GPU, KVSpec(model, "fp16"), c.tensor_parallel, block_size=16, overhead=NONE)
        cost = models[key]
        b, p, t = c.batch_size, c.prompt_size, c.token_size
        mid = int(round(p + (t + 1) / 2))
        for phase, batch, measured, excluded in (
            ("prefill", StepBatch.build([(p, 0)] * b, []), c.prompt_ms, c.prefill_excluded),
            ("decode", StepBatch.build([], [mid] * b), c.token_ms, c.decode_excluded),
        ):
            parts, _ = cost.parts(batch)
            kernel = sum(v for k, v in parts.items() if k not in COMM_PARTS) * 1e3
            rows.append(
                {
                    "model": model.name,
                    "tp": c.tensor_parallel,
                    "phase": phase,
                    "prompt": p,
                    "batch": b,
                    "tokens": t,
                    "layers": model.num_layers,
                    "hidden": model.hidden_size,
                    "seqs": b,
                    "prefill_tokens": b * p if phase == "prefill" else 0,
                    "new_tokens": batch.new_tokens,
                    "measured_ms": measured,
                    "kernel_ms": kernel,
                    "before_ms": kernel + parts["allreduce"] * 1e3,
                    "repeats": c.repeats,
                    "excluded": bool(excluded),
                    "why": c.why if excluded else "",
                }
            )
    return pd.DataFrame(rows)


def held_out(pts: pd.DataFrame, bus: float, **how) -> pd.Series:
    """Each point's prediction from a fit that did not see it (`how`: passed to fit_overhead)."""
    use, pred = ~pts.excluded, pd.Series(np.nan, index=pts.index)
    fitted = pts.model == FITTED
    folds = [(fitted & (pts.tp != tp), fitted & (pts.tp == tp)) for tp in sorted(pts[fitted].tp.unique())]
    folds += [(fitted, pts.model == m) for m in sorted(set(pts.model) - {FITTED})]
    for train, test in folds:
        fit = fit_overhead(pts[train & use], bus, **how)
        pred[test] = predict(fit, pts[test])
    return pred


def mape_table(pts: pd.DataFrame, col: str) -> dict:
    err = (pts[col] / pts.measured_ms - 1).abs()
    out = {}
    for (m, tp, ph), e in err[~pts.excluded].groupby([pts.model, pts.tp, pts.phase]):
        out[f"{m} tp{tp} {ph}"] = round(float(e.mean()), 4)
    return out


def describe_point(r) -> str:
    step = (
        f"prefill {r.batch} x {r.prompt}"
        if r.phase == "prefill"
        else f"decode batch {r.batch}, prompt {r.prompt}, {r.tokens} tokens"
    )
    return f"{r.model} tp{r.tp} {step}"


def r4(x: float) -> float:
    return float(f"{x:.4g}") if np.isfinite(x) else None


def main(src: Path = DEFAULT_IN, out_dir: Path = DEFAULT_OUT) -> None:
    cfg = configurations(pd.read_csv(src))
    pts = points(cfg)
    bus = gpu_fits()[GPU.name]["allreduce"]["bus_gb_s"]  # the datasheet-based assumption
    use = ~pts.excluded
    free = fit_overhead(pts[use], None)
    fit = fit_overhead(pts[use], bus)
    pts["fitted_ms"] = predict(fit, pts)
    pts["held_out_ms"] = held_out(pts, bus)
    pts["additive_ms"] = held_out(pts, bus, launches_ms=(0.0,))  # v1's form: no launch overlap
    err = pts.held_out_ms / pts.measured_ms - 1
    used = err[use]
    worst = pts.loc[used.abs().idxmax()]
    by_model = {m: round(float(e.abs().mean()), 4) for m, e in used.groupby(pts.model[use])}
    llama_fit = fit_overhead(pts[use & (pts.model == FITTED)], bus)
    per_tp = {
        f"tp{tp}": {
            "latency_per_allreduce_us": round(fit["comm"]["latency_per_hop_us"] * (tp - 1), 2),
            "fixed_ms_per_step_llama_2_70b": round(
                fit["host"]["step_ms"] + 2 * 80 * fit["comm"]["latency_per_hop_us"] * (tp - 1) / 1e3, 3
            ),
        }
        for tp in (2, 4, 8)
    }
    doc = {
        "format": FORMAT,
        "name": NAME,
        "version": VERSION,
        "gpu": GPU.name,
        "engine": "the serving stack behind the Splitwise characterization (2023), as measured; its "
        "settings (CUDA graphs, scheduler, all-reduce library) are not recorded in the data",
        "source": SOURCE,
        "license": "MIT (splitwise-sim)",
        "derived_with": "scripts/derive_overheads.py",
        "host": {k: r4(v) for k, v in fit["host"].items()},
        "comm": {
            "latency_us": 0.0,
            "latency_per_hop_us": r4(fit["comm"]["latency_per_hop_us"]),
            "bus_gb_s": bus,
            "large_step_tokens": fit["comm"]["large_step_tokens"],
            "large_step_bus_gb_s": r4(fit["comm"]["large_step_bus_gb_s"]),
        },
        "per_tp": per_tp,
        "range": {
            "tp": [int(pts.tp[use].min()), int(pts.tp[use].max())],
            "seqs": [int(pts.seqs[use].min()), int(pts.seqs[use].max())],
            "new_tokens": [int(pts.new_tokens[use].min()), int(pts.new_tokens[use].max())],
        },
        "what_is_measured": [
            "host.step_ms and comm.latency_per_hop_us are separated only by the assumed hop form "
            "latency = latency_per_hop x (tp - 1): with one layer count per tp in the Llama rows, "
            "step_ms + 2 x layers x latency(tp) is what the data fix per tp (per_tp).",
            f"host.launch_per_layer_ms ({fit['host']['launch_per_layer_ms']:g} ms, "
            f"{80 * fit['host']['launch_per_layer_ms']:.1f} ms per Llama-2-70B step): the CPU time to launch a "
            "layer's kernels, hidden behind device work (step = host + max(device, layers x launch)). It is "
            "resolved by the steps whose device time is shorter than the launches: decode at tp 4 and 8 (the "
            "same ~45 ms while the kernels halve) and BLOOM-176B's decode, which carries 2x Llama-2-70B's weight "
            "bytes per GPU yet takes only ~5 ms longer. The split of the launch-bound steps' time between the "
            "launches and step_ms + per_seq_ms rests on the device-bound steps (tp 2 decode, prefill).",
            f"comm.bus_gb_s is the datasheet-based assumption ({bus} GB/s = 80% of 300 GB/s per direction): "
            "fitted freely it comes out "
            + (
                "unresolved (0 ms per GB)"
                if not np.isfinite(free["comm"]["bus_gb_s"])
                else f"{free['comm']['bus_gb_s']:.0f} GB/s"
            )
            + f" with an in-sample error of {free['mape']:.2%} against {fit['mape']:.2%} held at {bus:g}: below "
            "large_step_tokens the bytes are too small next to the other terms to be resolved in these steps.",
            "large_step_bus_gb_s: steps beyond large_step_tokens new tokens cost extra time in proportion "
            "to their all-reduce bytes beyond the knee. The knee is chosen on a grid by the fit; the cause "
            "(slow large all-reduces, allocator or clock effects) is not identified by these data, and "
            "the term is treated as communication when carried to other GPUs.",
        ],
        "transfer": "kvsim.cost.overhead.Overhead.for_gpu: host part unchanged; bus_gb_s and "
        "large_step_bus_gb_s scaled by NVLink bandwidth (datasheets: A100 SXM 600 GB/s, H100 "
        "and H200 SXM 900 GB/s); latencies unchanged.",
        "rules": {
            "medians": "median of each configuration's repeated runs (5; 15 for prompt 512, "
            "batch 1, 128 tokens); e2e_time is not fitted",
            "prefill_excluded": "prefill faster than the same configuration at half the batch",
            "decode_excluded": "median e2e_time more than 10% above prefill + token_size x token_time",
            "e2e_short_runs_kept": int((cfg.e2e_ratio < 0.9).sum()),
            "e2e_single_runs_below_half_their_median": int(cfg.e2e_low_runs.sum()),
        },
        "fit": {
            "method": "non-negative least squares on relative error, alternating with each point's regime (device- or launch-bound); knee from a 1,024-4,096 grid, launch per layer from 0-0.8 ms in 0.02 then 0.002 steps",
            "points_used": int(use.sum()),
            "points_excluded": int((~use).sum()),
            "in_sample_mape": round(fit["mape"], 4),
            "free_bus_fit": {
                "host": {k: r4(v) for k, v in free["host"].items()},
                "comm": {k: r4(v) if isinstance(v, float) else v for k, v in free["comm"].items()},
                "in_sample_mape": round(free["mape"], 4),
            },
        },
        "error": {
            "held_out_mape": round(float(used.abs().mean()), 4),
            "held_out_by_model": by_model,
            "held_out_worst": {"point": describe_point(worst), "error": round(float(err[worst.name]), 4)},
            "llama_2_70b_only_fit": {
                "host": {k: r4(v) for k, v in llama_fit["host"].items()},
                "comm": {k: r4(v) if isinstance(v, float) else v for k, v in llama_fit["comm"].items()},
            },
        },
        "points": [
            {
                "model": r.model,
                "tp": int(r.tp),
                "phase": r.phase,
                "prompt": int(r.prompt),
                "batch": int(r.batch),
                "tokens": int(r.tokens),
                "measured_ms": r4(r.measured_ms),
                "kernel_ms": r4(r.kernel_ms),
                "fitted_ms": r4(r.fitted_ms),
                "held_out_ms": r4(r.held_out_ms),
                **({"excluded": r.why} if r.excluded else {}),
            }
            for r in pts.itertuples()
        ],
    }
    accuracy = {
        "method": "leave one out: fit on two of Llama-2-70B's tp degrees, predict the third; fit on "
        "Llama-2-70B, predict BLOOM-176B (no kernel profile: the A100 shape model)",
        "held_out_mape": doc["error"]["held_out_mape"],
        "held_out_by_model": by_model,
        "held_out_additive": mape_table(pts, "additive_ms"),
        "held_out_additive_mape": round(float((pts.additive_ms / pts.measured_ms - 1)[use].abs().mean()), 4),
        "held_out": mape_table(pts, "held_out_ms"),
        "in_sample": mape_table(pts, "fitted_ms"),
        "before_overhead": mape_table(pts, "before_ms"),
        "before_overhead_mape": round(float((pts.before_ms / pts.measured_ms - 1)[use].abs().mean()), 4),
        "worst": doc["error"]["held_out_worst"],
        "points_over_25pct": [describe_point(r) for r in pts[use & (err.abs() > 0.25)].itertuples()],
        "excluded": [f"{describe_point(r)}: {r.why}" for r in pts[~use].itertuples()],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{NAME}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    (out_dir / "accuracy.json").write_text(json.dumps(accuracy, indent=1, sort_keys=True) + "\n")
    report(doc, accuracy, pts)


def report(doc: dict, acc: dict, pts: pd.DataFrame) -> None:
    print(f"{doc['name']}: host {doc['host']}, comm {doc['comm']}")
    print(
        f"held-out MAPE {acc['held_out_mape']:.1%} (kvsim before: {acc['before_overhead_mape']:.1%}); "
        f"worst {acc['worst']['point']} {acc['worst']['error']:+.1%}"
    )
    print(
        f"additive form (v1, no launch overlap) held out: {acc['held_out_additive_mape']:.1%}; "
        f"points over 25%: {acc['points_over_25pct']}"
    )
    print(
        "\n| model | tp | phase | held out | in sample | held out, additive (v1) | before |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for key, e in acc["held_out"].items():
        m, tp, ph = key.split()
        print(
            f"| {m} | {tp[2:]} | {ph} | {e:.1%} | {acc['in_sample'][key]:.1%} | "
            f"{acc['held_out_additive'][key]:.1%} | {acc['before_overhead'][key]:.1%} |"
        )
    print(
        "\n| model | tp | prompt x batch, tokens | prefill ms: measured / fitted (kernels + comm + host) "
        "/ held out | decode ms: measured / fitted (kernels + comm + host) / held out |"
    )
    print("| --- | --- | --- | --- | --- |")
    for (m, tp, p, b, t), g in pts.groupby(["model", "tp", "prompt", "batch", "tokens"], sort=True):
        cells = []
        for r in g.sort_values("phase", ascending=False).itertuples():
            host = r.fitted_ms - r.kernel_ms - comm_ms(doc, r)
            mark = " (excluded)" if r.excluded else ""
            cells.append(
                f"{r.measured_ms:,.1f} / {r.fitted_ms:,.1f} ({r.kernel_ms:,.1f} + {comm_ms(doc, r):,.1f} "
                f"+ {host:,.1f}) / {r.held_out_ms:,.1f}{mark}"
            )
        print(f"| {m} | {tp} | {p} x {b}, {t} | {cells[0]} | {cells[1]} |")


def comm_ms(doc: dict, r) -> float:
    from kvsim.cost.overhead import from_file

    return from_file(doc).comm.seconds(int(r.tp), int(r.layers), int(r.hidden), int(r.new_tokens)) * 1e3


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]) if args else DEFAULT_IN, Path(args[1]) if len(args) > 1 else DEFAULT_OUT)
