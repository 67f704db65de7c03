"""Figures for many runs: a sweep's metrics against each swept parameter, and capacity.

`write_sweep_plots(summary, params, out_dir, workers, context)`: for each parameter that
takes two or more values, `sweep_<parameter>.png`: one row of panels per metric, one
column per combination of the other swept parameters (their mean, said in the title,
when there are more than MAX_PANELS), one line per policy, with 95% intervals over
seeds where the summary has them, cut at what the metric can physically be (no
latency or throughput below zero, no share above 100%). A metric with no value
anywhere (KV utilization where memory never bound, say) gets no row; a panel whose
metric is undefined says so. `write_capacity_plot(...)`: `capacity.png`, the answer
per policy beside every probe's value of each target. Axes name the swept fields in
words (kvsim.plots.style.param_label) and every figure carries its context line, and
under it the notes of what a swept or compared setting does not change in step time
(kvsim.analysis.unmodelled).
Like kvsim.plots.run_figures, figures are bare Agg `Figure`s: no pyplot state.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvsim.sim.parallel import ordered_map
from kvsim.plots.run_figures import add_context, policy_colours, save
from kvsim.plots.style import param_label

# (column, axis label, upper bound: 1 for shares, None for unbounded; all are >= 0)
METRICS = (
    ("throughput_tok_s", "output tok/s", None),
    ("ttft_p99_s", "TTFT p99 (s)", None),
    ("tpot_p50_s", "TPOT p50 (s)", None),
    ("kv_utilization", "KV utilization", 1.0),
    ("achievable_batch_size", "achievable batch", None),
)
UNDEFINED = {
    "kv_utilization": "n/a: memory never held a request back",
    "achievable_batch_size": "n/a: memory never held a request back",
}
MAX_PANELS = 6


def write_sweep_plots(
    summary: pd.DataFrame, params: list[str], out_dir: Path, workers: int = 1, context: str = "", notes=()
) -> list[Path]:
    """The figures are independent jobs, drawn in up to `workers` processes (kvsim.sim.parallel).
    notes: what the swept settings do not change (kvsim.analysis.unmodelled.sweep_notes),
    under the context line."""
    if summary.empty:
        return []
    swept = [p for p in params if summary[p].astype(str).nunique() > 1]
    metrics = [m for m in METRICS if m[0] in summary and pd.to_numeric(summary[m[0]], errors="coerce").notna().any()]
    colours = policy_colours(summary)

    def draw(i: int) -> Path:
        param = swept[i]
        path = Path(out_dir) / f"sweep_{re.sub(r'[^A-Za-z0-9]+', '_', param).strip('_')}.png"
        fig = _against(summary, param, [p for p in swept if p != param], metrics, colours)
        add_context(fig, context, notes)
        return save(fig, path)

    return ordered_map(draw, len(swept), workers)


def clipped_errors(values: np.ndarray, errors: np.ndarray, upper: float | None) -> np.ndarray:
    """(below, above) error bar lengths for `values` +- `errors`, cut at 0 and `upper`."""
    values, errors = np.asarray(values, float), np.nan_to_num(np.asarray(errors, float))
    below = np.minimum(errors, np.maximum(values, 0))
    above = errors if upper is None else np.minimum(errors, np.maximum(upper - values, 0))
    return np.vstack([below, above])


def _against(summary, param, others, metrics, colours) -> Figure:
    frame = summary.copy()
    combos = list(dict.fromkeys(frame[others].astype(str).itertuples(index=False, name=None))) if others else [()]
    averaged = len(combos) > MAX_PANELS
    if averaged:  # too many panels: one panel, the mean over the other parameters
        cols = [c for c, _, _ in metrics]
        frame = frame.groupby([param, "policy"], sort=False, dropna=False)[cols].mean().reset_index()
        combos = [()]
    fig = Figure(figsize=(3.6 * len(combos) + 1, 2.4 * len(metrics) + 1.0), layout="constrained")
    axes = fig.subplots(len(metrics), len(combos), squeeze=False, sharex=True)
    values = list(dict.fromkeys(frame[param]))
    numeric = all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(values)}
    labels = [param_label(o) for o in others]
    for j, combo in enumerate(combos):
        panel = frame
        if combo:
            panel = frame[(frame[others].astype(str) == list(combo)).all(axis=1)]
        for i, (col, label, upper) in enumerate(metrics):
            ax = axes[i][j]
            drawn = 0
            for policy, group in panel.groupby("policy", sort=False):
                group = group.assign(_x=group[param].map(position)).sort_values("_x")
                y = pd.to_numeric(group[col], errors="coerce").to_numpy(float)
                if not np.isfinite(y).any():
                    continue
                err = group.get(f"{col}_ci95")
                yerr = None if err is None else clipped_errors(y, err.to_numpy(float), upper)
                ax.errorbar(
                    group["_x"],
                    y,
                    yerr=yerr,
                    marker="o",
                    ms=4,
                    capsize=3,
                    color=colours.get(str(policy)),
                    label=str(policy),
                )
                drawn += 1
            if not drawn:
                ax.text(
                    0.5,
                    0.5,
                    UNDEFINED.get(col, "n/a: no value"),
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="0.35",
                )
            ax.set_ylim(bottom=0)
            if upper is not None and drawn:
                ax.set_ylim(top=min(upper * 1.05, ax.get_ylim()[1]))
            if j == 0:
                ax.set_ylabel(label)
            if i == 0 and combo:
                ax.set_title("\n".join(textwrap.fill(f"{o}: {v}", 34) for o, v in zip(labels, combo)), fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1][j].set_xlabel(param_label(param))
        if not numeric:
            axes[-1][j].set_xticks(list(position.values()), [str(v) for v in values])
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside right upper", title="policy", fontsize=8)
    title = f"Metrics against {param_label(param)}"
    if averaged:
        title += f" (mean over {', '.join(labels)})"
    elif any(c.endswith("_ci95") for c in summary):
        title += " (bars: 95% interval over seeds)"
    fig.suptitle(textwrap.fill(title, 30 * len(combos) + 20), fontsize=10)
    return fig


CAPACITY_AXES = {
    "max_rate_per_s": "highest rate within targets (req/s)",
    "gpus": "fewest GPUs within targets",
    "rate_per_s": "arrival rate (req/s)",
}


def write_capacity_plot(
    table: pd.DataFrame,
    probes: pd.DataFrame,
    targets: dict,
    answer: str,
    x: str,
    out_dir: Path,
    context: str = "",
    settings: pd.DataFrame | None = None,
    notes=(),
) -> Path:
    """`answer`: the table's column per policy (max_rate_per_s or gpus); `x`: the probes'
    varied column (rate_per_s or gpus); `settings`: the policies' settings, for their
    colours (kvsim.plots.colours.settings_frame); notes: what the policies' settings do
    not change (kvsim.analysis.unmodelled.notes)."""
    colours = policy_colours(table, *([settings] if settings is not None else []))
    fig = Figure(figsize=(4 + 3.8 * len(targets), 4.2), layout="constrained")
    axes = fig.subplots(1, 1 + len(targets), squeeze=False)[0]
    names = table["policy"].astype(str).tolist()
    heights = pd.to_numeric(table[answer], errors="coerce").fillna(0).to_numpy()
    axes[0].bar(range(len(names)), heights, color=[colours[n] for n in names])
    tilted = sum(map(len, names)) > 30
    axes[0].set_xticks(range(len(names)), names, rotation=25 if tilted else 0, ha="right" if tilted else "center")
    for i, h in enumerate(heights):
        axes[0].text(i, h, f"{h:.3g}", ha="center", va="bottom", fontsize=8)
    axes[0].set_ylabel(CAPACITY_AXES.get(answer, answer))
    axes[0].set_title("The answer per policy", fontsize=10)
    for ax, (col, bound) in zip(axes[1:], targets.items()):
        for policy, group in probes.groupby("policy", sort=False):
            group = group.sort_values(x)
            c = colours.get(str(policy))
            ax.plot(group[x], group[col], color=c, lw=1, alpha=0.6)
            met = group[group["met"]]
            ax.scatter(met[x], met[col], color=c, s=18, label=str(policy))
            ax.scatter(group[~group["met"]][x], group[~group["met"]][col], facecolors="none", edgecolors=c, s=18)
        ax.axhline(bound, color="black", ls="--", lw=1)
        finite = pd.to_numeric(probes[col], errors="coerce")
        if (finite > 0).all() and finite.max() / finite.min() > 50:
            ax.set_yscale("log")
        ax.set_xlabel(CAPACITY_AXES.get(x, x))
        ax.set_ylabel(f"{_metric_words(col)} (s)")
        ax.set_title(f"{_metric_words(col)} at each probe (target {bound:g} s)", fontsize=9)
        ax.grid(alpha=0.3)
    if len(axes) > 1:
        handles, labels = axes[1].get_legend_handles_labels()
        handles += [
            Line2D([], [], color="black", ls="--", lw=1),
            Line2D([], [], ls="", marker="o", mfc="none", mec="0.3", ms=5),
        ]
        labels += ["target", "probe that missed a target"]
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    add_context(fig, context, notes)
    return save(fig, Path(out_dir) / "capacity.png")


def _metric_words(column: str) -> str:
    """ttft_p99_s -> 'TTFT p99'."""
    name, _, pct = column.removesuffix("_s").rpartition("_")
    return f"{name.upper()} {pct}" if name else column
