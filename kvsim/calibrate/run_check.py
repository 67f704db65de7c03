"""Predicted against measured, per load stage: the rows `kvsim validate` prints and writes.

Each row is one stage of one run: its rate, the requests sent, and for each figure the
measured value, kvsim's and the signed relative error (predicted / measured - 1). The
figures: E2E latency (mean, p50, p90, p99), time to first token (mean, p50, p90, p99),
inter-token latency (mean, p90, p99) and time per output token (mean), each as
inference-perf defines it (kvsim.calibrate.runs); the share of requests answered within
the client's timeout (its error in points, not relative). `summary` states the
accuracy figures kvsim's targets name: the mean absolute E2E-mean error and the worst
stage's, the median absolute TTFT-p50 error over stages, and the worst answered-share
error over the stages past capacity (where the run or kvsim failed some requests).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kvsim.calibrate.replay import PredictedStage
from kvsim.calibrate.runs import BenchmarkRun

FIGURES = (
    ("e2e", "mean"),
    ("e2e", "p50"),
    ("e2e", "p90"),
    ("e2e", "p99"),
    ("ttft", "mean"),
    ("ttft", "p50"),
    ("ttft", "p90"),
    ("ttft", "p99"),
    ("itl", "mean"),
    ("itl", "p90"),
    ("itl", "p99"),
    ("tpot", "mean"),
)


def rows(run: BenchmarkRun, predicted: Sequence[PredictedStage], cost_model: str) -> list[dict]:
    out = []
    for m, p in zip(run.stages, predicted):
        row = {
            "run": run.name,
            "stage": m.index,
            "rate_per_s": m.rate_per_s,
            "requests": m.sent,
            "answered_measured": round(m.answered, 4),
            "answered_predicted": round(p.answered, 4),
            "answered_error_points": round(100 * (p.answered - m.answered), 2),
        }
        for what, stat in FIGURES:
            mv, pv = m.get(what, stat), p.get(what, stat)
            key = f"{what}_{stat}"
            row[f"{key}_measured_s"] = mv
            row[f"{key}_predicted_s"] = pv
            row[f"{key}_error"] = round(pv / mv - 1, 4) if mv and pv is not None and mv > 0 else math.nan
        row["cost_model"] = cost_model
        out.append(row)
    return out


def summary(table: Sequence[dict]) -> dict:
    """The target figures over a table's stages (NaN where no stage has the figure)."""
    e2e = np.array([abs(r["e2e_mean_error"]) for r in table if not math.isnan(r["e2e_mean_error"])])
    ttft = np.array([abs(r["ttft_p50_error"]) for r in table if not math.isnan(r["ttft_p50_error"])])
    past = [abs(r["answered_error_points"]) for r in table if r["answered_measured"] < 1 or r["answered_predicted"] < 1]
    return {
        "stages": len(table),
        "e2e_mean_mae": float(e2e.mean()) if len(e2e) else math.nan,
        "e2e_mean_worst": float(e2e.max()) if len(e2e) else math.nan,
        "ttft_p50_median_error": float(np.median(ttft)) if len(ttft) else math.nan,
        "answered_worst_points": float(max(past)) if past else math.nan,
    }


def text_table(table: Sequence[dict]) -> str:
    """The terminal table: a line per stage, measured / predicted (error)."""
    head = (
        f"{'run':34s} {'st':>2s} {'rate':>5s} {'E2E mean s':>22s} {'TTFT p50 ms':>22s} "
        f"{'ITL mean ms':>20s} {'answered':>16s}"
    )
    lines = [head]
    for r in table:

        def cell(key, unit):
            m, p, e = r[f"{key}_measured_s"], r[f"{key}_predicted_s"], r[f"{key}_error"]
            if m is None or p is None:
                return "-"
            return f"{m * unit:.3g} / {p * unit:.3g} ({e:+.1%})"

        lines.append(
            f"{r['run']:34s} {r['stage']:>2d} {r['rate_per_s']:>5g} {cell('e2e_mean', 1):>22s} "
            f"{cell('ttft_p50', 1e3):>22s} {cell('itl_mean', 1e3):>20s} "
            f"{r['answered_measured']:.0%} / {r['answered_predicted']:.0%}"
        )
    return "\n".join(lines)


def figure(table: Sequence[dict], path) -> None:
    """Predicted against measured for E2E mean, TTFT p50 and ITL mean, one point per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (key, title, unit) in zip(
        axes, (("e2e_mean", "E2E mean (s)", 1), ("ttft_p50", "TTFT p50 (ms)", 1e3), ("itl_mean", "ITL mean (ms)", 1e3))
    ):
        pts = [
            (r[f"{key}_measured_s"] * unit, r[f"{key}_predicted_s"] * unit)
            for r in table
            if r[f"{key}_measured_s"] and r[f"{key}_predicted_s"]
        ]
        if pts:
            m, p = np.array(pts).T
            lo, hi = min(m.min(), p.min()) * 0.8, max(m.max(), p.max()) * 1.25
            ax.plot([lo, hi], [lo, hi], color="0.6", lw=1)
            ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="0.9")
            ax.scatter(m, p, s=18)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("measured")
        ax.set_ylabel("kvsim")
    fig.suptitle("kvsim against the runs, per load stage (band: within 20%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
