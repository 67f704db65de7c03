"""Figures comparing KV-cache memory policies, drawn from the run's result DataFrames.

`write_plots(summary, timeseries, requests, out_dir)` writes four PNGs and returns
their paths, always in this order:

1. ``memory_breakdown.png``: where the KV pool went, per policy, split the way the
   vLLM paper splits it (token states, reservation, internal fragmentation, external
   fragmentation & others) plus free space.
2. ``utilization_batch.png``: KV utilization and running batch size over simulated time.
3. ``latency.png``: empirical CDFs of TTFT, TPOT and end-to-end latency.
4. ``throughput_batch.png``: achievable vs mean batch size, and output throughput.

Only this module knows about matplotlib; the simulator core hands it DataFrames.
Figures are built as bare `matplotlib.figure.Figure` objects rendered by the Agg
canvas, never registered with pyplot, so no backend is switched and no window or
figure is left open.  Each policy keeps one colour in every figure (policies in
summary order, then any that only appear in the other frames), and each memory
category has one fixed colour.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

DPI = 110
MAX_POINTS = 2000  # drawn points per policy line; more are invisible at this size
FILES = ("memory_breakdown.png", "utilization_batch.png", "latency.png",
         "throughput_batch.png")

# (summary column, timeseries column, legend label, colour): good use green, waste
# in warm colours that darken as it gets harder to reclaim, free space grey.
CATEGORIES = (
    ("token_fraction", "token", "token states", "#2e7d32"),
    ("reservation_fraction", "reservation", "reservation", "#f9a825"),
    ("internal_fraction", "internal", "internal fragmentation", "#ef6c00"),
    ("external_fraction", "external", "external fragmentation & others", "#c62828"),
    ("free_fraction", "free", "free", "#cfd8dc"),
)
BASIS = {"waiting": "time-weighted while requests wait",
         "busy": "time-weighted over busy time"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
            "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def write_plots(summary: pd.DataFrame, timeseries: pd.DataFrame,
                requests: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Write the four figures into `out_dir` (which must exist); return their paths."""
    out_dir = Path(out_dir)
    colours = policy_colours(summary, timeseries, requests)
    figures = (_memory_breakdown(summary, colours), _utilization_batch(timeseries, colours),
               _latency(requests, colours), _throughput_batch(summary, colours))
    paths = []
    for name, fig in zip(FILES, figures):
        path = out_dir / name
        FigureCanvasAgg(fig).print_figure(path, dpi=DPI)
        fig.clear()
        paths.append(path)
    return paths


def policy_colours(*frames: pd.DataFrame) -> dict[str, str]:
    """One colour per policy, in first-seen order across `frames` (summary first)."""
    names: dict[str, None] = {}
    for frame in frames:
        if "policy" in frame:
            names.update(dict.fromkeys(frame["policy"].astype(str)))
    return {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(names)}


def downsample(series: pd.DataFrame, columns: list[str],
               max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Time-bucket one policy's step series to at most `max_points` rows.

    Steps are assigned to equal-width time buckets by their start time; each bucket
    keeps the start of its first step as `time_s`, the summed duration as `step_s`
    and the duration-weighted mean of each column (a plain mean if every step in it
    lasted zero seconds).  Weighting buckets by `step_s` therefore reproduces the
    series' overall time-weighted mean exactly.  Deterministic; input order is free.
    """
    frame = series.sort_values("time_s", kind="mergesort")
    if len(frame) <= max_points:
        return frame[["time_s", "step_s", *columns]].reset_index(drop=True)
    t = frame["time_s"].to_numpy(float)
    w = frame["step_s"].fillna(0.0).to_numpy(float)
    span = max(t[-1] + w[-1] - t[0], np.finfo(float).tiny)
    bucket = np.minimum(((t - t[0]) / span * max_points).astype(np.int64), max_points - 1)
    keep = np.unique(bucket)
    count = np.bincount(bucket, minlength=max_points)[keep]
    weight = np.bincount(bucket, weights=w, minlength=max_points)[keep]
    first = np.searchsorted(bucket, keep)  # bucket ids are sorted because t is
    out = {"time_s": t[first], "step_s": weight}
    for col in columns:
        v = frame[col].to_numpy(float)
        weighted = np.bincount(bucket, weights=v * w, minlength=max_points)[keep]
        plain = np.bincount(bucket, weights=v, minlength=max_points)[keep] / count
        out[col] = np.where(weight > 0, weighted / np.where(weight > 0, weight, 1), plain)
    return pd.DataFrame(out)


def latency_samples(requests: pd.DataFrame) -> pd.DataFrame:
    """Per completed request: ttft_s, tpot_s and e2e_s (NaN where undefined).

    TPOT is (finish - first token) / (output_tokens - 1), defined only for requests
    that produced more than one token.
    """
    done = requests[requests["outcome"] == "completed"]
    decode_tokens = done["output_tokens"] - 1
    return pd.DataFrame({
        "policy": done["policy"].astype(str),
        "ttft_s": done["first_token_s"] - done["arrival_s"],
        "tpot_s": ((done["finish_s"] - done["first_token_s"])
                   / decode_tokens.where(decode_tokens > 0)),
        "e2e_s": done["finish_s"] - done["arrival_s"],
    })


def _memory_breakdown(summary: pd.DataFrame, colours: dict[str, str]) -> Figure:
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(max(6.5, 1.3 * len(policies) + 4.5), 4.8), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(policies))
    bottom = np.zeros(len(policies))
    for col, _, label, colour in CATEGORIES:
        share = 100 * pd.to_numeric(summary[col], errors="coerce").fillna(0).to_numpy()
        ax.bar(x, share, 0.6, bottom=bottom, color=colour, label=label,
               edgecolor="white", linewidth=0.5)
        bottom += share
    tokens = pd.to_numeric(summary["token_fraction"], errors="coerce")
    for xi, top, tok in zip(x, bottom, tokens):
        text = "n/a" if pd.isna(tok) else f"{100 * tok:.1f}% tokens"
        ax.text(xi, top + 1.5, text, ha="center", va="bottom", fontsize=9, weight="bold")
    bases = summary["fraction_basis"].astype(str).tolist() if "fraction_basis" in summary else []
    if len(set(bases)) == 1:
        title, ticks = f"KV pool breakdown ({BASIS.get(bases[0], bases[0])})", policies
    else:  # mixed or missing: say it under each bar instead
        title = "KV pool breakdown"
        ticks = [f"{p}\n({BASIS.get(b, b)})" for p, b in zip(policies, bases)] or policies
    ax.set_title(title)
    ax.set_xticks(x, ticks, rotation=_rotation(policies), ha="right" if _rotation(policies) else "center")
    for tick, name in zip(ax.get_xticklabels(), policies):
        tick.set_color(colours[name])
    ax.set_ylabel("share of KV pool (%)")
    ax.set_ylim(0, 112)
    ax.set_xlim(-0.6, len(policies) - 0.4)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside right upper", title="memory")
    return fig


def _utilization_batch(timeseries: pd.DataFrame, colours: dict[str, str]) -> Figure:
    fig = Figure(figsize=(10.5, 6.2), layout="constrained")
    ax_util, ax_batch = fig.subplots(2, 1, sharex=True)
    groups = dict(tuple(timeseries.groupby(timeseries["policy"].astype(str), sort=False)))
    handles = []
    for name, colour in colours.items():
        frame = groups.get(name)
        if frame is None or frame.empty:
            handles.append(Line2D([], [], color=colour, label=f"{name} (no steps)"))
            continue
        d = downsample(frame, ["token", "running"])
        # repeat the last value to the end of the last step so steps-post shows it
        end = d.iloc[[-1]].assign(time_s=d["time_s"].iloc[-1] + d["step_s"].iloc[-1])
        d = pd.concat([d, end], ignore_index=True)
        ax_util.plot(d["time_s"], 100 * d["token"], drawstyle="steps-post", color=colour, lw=1.2)
        ax_batch.plot(d["time_s"], d["running"], drawstyle="steps-post", color=colour, lw=1.2)
        handles.append(Line2D([], [], color=colour, label=name))
    if timeseries.empty:
        ax_util.text(0.5, 0.5, "no steps recorded", transform=ax_util.transAxes, ha="center")
    ax_util.set_ylabel("KV utilization\n(token states, %)")
    ax_util.set_ylim(0, 105)
    ax_batch.set_ylabel("running batch\n(requests)")
    ax_batch.set_ylim(bottom=0)
    ax_batch.set_xlabel("simulated time (s)")
    for ax in (ax_util, ax_batch):
        ax.grid(alpha=0.3)
    ax_util.set_title("KV utilization and batch size over time")
    fig.legend(handles=handles, loc="outside right upper", title="policy")
    return fig


def _latency(requests: pd.DataFrame, colours: dict[str, str]) -> Figure:
    samples = latency_samples(requests)
    fig = Figure(figsize=(13.5, 4.3), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    panels = (("ttft_s", "time to first token (s)"),
              ("tpot_s", "time per output token (s)"),
              ("e2e_s", "end-to-end latency (s)"))
    by_policy = dict(tuple(samples.groupby("policy", sort=False)))
    for ax, (col, xlabel) in zip(axes, panels):
        values = samples[col].to_numpy(float)
        values = values[np.isfinite(values)]
        floor = _log_floor(values)
        for name, colour in colours.items():
            v = by_policy[name][col].to_numpy(float) if name in by_policy else np.array([])
            v = np.sort(v[np.isfinite(v)])
            if v.size == 0:
                continue
            if floor is not None:
                v = np.maximum(v, floor)  # zeros and stragglers sit at the left edge
            y = np.arange(1, v.size + 1) / v.size
            ax.plot(np.r_[v[0], v], np.r_[0.0, y], drawstyle="steps-post", color=colour, lw=1.4)
        if values.size == 0:
            ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
        elif floor is not None:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.grid(which="minor", alpha=0.1)
    axes[0].set_ylabel("fraction of completed requests")
    counts = samples["policy"].value_counts()
    handles = [Line2D([], [], color=c, label=f"{n} (n={counts.get(n, 0)})")
               for n, c in colours.items()]
    fig.suptitle("Latency CDFs, completed requests")
    fig.legend(handles=handles, loc="outside right upper", title="policy")
    return fig


def _throughput_batch(summary: pd.DataFrame, colours: dict[str, str]) -> Figure:
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(max(9.0, 1.6 * len(policies) + 6), 4.5), layout="constrained")
    ax_batch, ax_tput = fig.subplots(1, 2)
    x = np.arange(len(policies))
    policy_colours_ = [colours[p] for p in policies]
    achievable = _numbers(summary, "achievable_batch_size")
    mean = _numbers(summary, "mean_batch_size")
    bars_a = ax_batch.bar(x - 0.2, np.nan_to_num(achievable), 0.4, color=policy_colours_)
    bars_m = ax_batch.bar(x + 0.2, np.nan_to_num(mean), 0.4, color=policy_colours_,
                          alpha=0.45, hatch="//", edgecolor="white")
    for bars, values in ((bars_a, achievable), (bars_m, mean)):
        ax_batch.bar_label(bars, ["n/a" if np.isnan(v) else f"{v:.1f}" for v in values],
                           fontsize=8, padding=2)
    ax_batch.legend(handles=[Patch(color="0.35", label="achievable batch size"),
                             Patch(facecolor="0.35", alpha=0.45, hatch="//",
                                   edgecolor="white", label="mean batch size")],
                    loc="upper left", fontsize=8)
    ax_batch.set_ylabel("batch size (requests)")
    ax_batch.set_title("Batch size: achievable vs mean")
    tput = _numbers(summary, "throughput_tok_s")
    bars_t = ax_tput.bar(x, np.nan_to_num(tput), 0.6, color=policy_colours_)
    ax_tput.bar_label(bars_t, ["n/a" if np.isnan(v) else f"{v:,.0f}" for v in tput],
                      fontsize=8, padding=2)
    ax_tput.set_ylabel("output throughput (tok/s)")
    ax_tput.set_title("Output throughput")
    for ax in (ax_batch, ax_tput):
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.22 if top > 0 else 1)  # room for the value labels and legend
        ax.set_xticks(x, policies, rotation=_rotation(policies),
                      ha="right" if _rotation(policies) else "center")
        ax.grid(axis="y", alpha=0.3)
    return fig


def _numbers(frame: pd.DataFrame, column: str) -> np.ndarray:
    if column not in frame:
        return np.full(len(frame), np.nan)
    return pd.to_numeric(frame[column], errors="coerce").to_numpy(float)


def _log_floor(values: np.ndarray) -> float | None:
    """Left edge for a log axis, or None if the spread is too small to need one.

    The spread is judged from the 1st percentile of the positive values, so a few
    near-zero samples (float noise, instant first tokens) neither force a log axis
    nor stretch it across decades; anything below a tenth of it is drawn at the edge.
    """
    positive = values[values > 0]
    if positive.size == 0:
        return None
    low = float(np.quantile(positive, 0.01))
    return low / 10 if positive.max() / low > 30 else None


def _rotation(labels: list[str]) -> int:
    return 20 if len(labels) > 4 or max(map(len, labels), default=0) > 14 else 0
