"""Figures for many runs: a sweep's metrics against each swept parameter, and capacity.

`write_sweep_plots(summary, params, out_dir, workers)`: for each parameter that takes
two or more values, `sweep_<parameter>.png`: one row of panels per metric, one column
per combination of the other swept parameters (their mean, said in the title, when
there are more than MAX_PANELS), one line per policy, with 95% intervals over seeds
where the summary has them. `write_capacity_plot(...)`: `capacity.png`, the answer per
policy beside every probe's value of each target. Like kvsim.report.plots, figures are
bare Agg `Figure`s: no pyplot state.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvsim.parallel import ordered_map
from kvsim.report.plots import policy_colours, save

METRICS = (("throughput_tok_s", "output tok/s"), ("ttft_p99_s", "TTFT p99 (s)"),
           ("tpot_p50_s", "TPOT p50 (s)"), ("kv_utilization", "KV utilization"),
           ("achievable_batch_size", "achievable batch"))
MAX_PANELS = 6


def write_sweep_plots(summary: pd.DataFrame, params: list[str], out_dir: Path, workers: int = 1) -> list[Path]:
    """The figures are independent jobs, drawn in up to `workers` processes (kvsim.parallel)."""
    if summary.empty:
        return []
    swept = [p for p in params if summary[p].astype(str).nunique() > 1]
    metrics = [(c, label) for c, label in METRICS if c in summary]
    colours = policy_colours(summary)

    def draw(i: int) -> Path:
        param = swept[i]
        path = Path(out_dir) / f"sweep_{re.sub(r'[^A-Za-z0-9]+', '_', param).strip('_')}.png"
        return save(_against(summary, param, [p for p in swept if p != param], metrics, colours), path)
    return ordered_map(draw, len(swept), workers)


def _against(summary, param, others, metrics, colours) -> Figure:
    frame = summary.copy()
    combos = list(dict.fromkeys(frame[others].astype(str).itertuples(index=False, name=None))) if others else [()]
    averaged = len(combos) > MAX_PANELS
    if averaged:     # too many panels: one panel, the mean over the other parameters
        cols = [c for c, _ in metrics]
        frame = frame.groupby([param, "policy"], sort=False, dropna=False)[cols].mean().reset_index()
        combos = [()]
    fig = Figure(figsize=(3.6 * len(combos) + 1, 2.4 * len(metrics) + 0.8), layout="constrained")
    axes = fig.subplots(len(metrics), len(combos), squeeze=False, sharex=True)
    values = list(dict.fromkeys(frame[param]))
    numeric = all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(values)}
    for j, combo in enumerate(combos):
        panel = frame
        if combo:
            panel = frame[(frame[others].astype(str) == list(combo)).all(axis=1)]
        for i, (col, label) in enumerate(metrics):
            ax = axes[i][j]
            for policy, group in panel.groupby("policy", sort=False):
                group = group.assign(_x=group[param].map(position)).sort_values("_x")
                err = group.get(f"{col}_ci95")
                ax.errorbar(group["_x"], group[col], yerr=None if err is None else err.fillna(0),
                            marker="o", ms=4, capsize=3, color=colours.get(str(policy)), label=str(policy))
            if j == 0:
                ax.set_ylabel(label)
            if i == 0 and combo:
                ax.set_title("\n".join(f"{o}={v}" for o, v in zip(_short(others), combo)), fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1][j].set_xlabel(param)
        if not numeric:
            axes[-1][j].set_xticks(list(position.values()), [str(v) for v in values])
    axes[0][0].legend(fontsize=8)
    title = f"metrics against {param}"
    if averaged:
        title += f" (mean over {', '.join(others)})"
    elif any(c.endswith("_ci95") for c in summary):
        title += " (bars: 95% interval over seeds)"
    fig.suptitle(textwrap.fill(title, 30 * len(combos) + 20), fontsize=10)
    return fig


def _short(params: list[str]) -> list[str]:
    """Each path's last key (policies[*].block_size -> block_size) where that stays unambiguous."""
    short = [re.sub(r"\[[^\]]*\]", "", p).rsplit(".", 1)[-1] for p in params]
    return short if len(set(short)) == len(short) else params


def write_capacity_plot(table: pd.DataFrame, probes: pd.DataFrame, targets: dict,
                        answer: str, x: str, out_dir: Path) -> Path:
    """`answer`: the table's column per policy (max_rate_per_s or gpus); `x`: the probes'
    varied column (rate_per_s or tensor_parallel_size)."""
    colours = policy_colours(table)
    fig = Figure(figsize=(4 + 3.8 * len(targets), 3.8), layout="constrained")
    axes = fig.subplots(1, 1 + len(targets), squeeze=False)[0]
    names = table["policy"].astype(str).tolist()
    heights = pd.to_numeric(table[answer], errors="coerce").fillna(0).to_numpy()
    axes[0].bar(range(len(names)), heights, color=[colours[n] for n in names])
    tilted = sum(map(len, names)) > 30
    axes[0].set_xticks(range(len(names)), names, rotation=25 if tilted else 0, ha="right" if tilted else "center")
    for i, h in enumerate(heights):
        axes[0].text(i, h, f"{h:.3g}", ha="center", va="bottom", fontsize=8)
    axes[0].set_ylabel(answer)
    axes[0].set_title(answer.replace("_", " "), fontsize=10)
    for ax, (col, bound) in zip(axes[1:], targets.items()):
        for policy, group in probes.groupby("policy", sort=False):
            group = group.sort_values(x)
            c = colours.get(str(policy))
            ax.plot(group[x], group[col], color=c, lw=1, alpha=0.6)
            met = group[group["met"]]
            ax.scatter(met[x], met[col], color=c, s=18, label=str(policy))
            ax.scatter(group[~group["met"]][x], group[~group["met"]][col], facecolors="none",
                       edgecolors=c, s=18)
        ax.axhline(bound, color="black", ls="--", lw=1)
        finite = pd.to_numeric(probes[col], errors="coerce")
        if (finite > 0).all() and finite.max() / finite.min() > 50:
            ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_title(f"{col} (target {bound:g}; hollow: missed)", fontsize=9)
        ax.grid(alpha=0.3)
    if len(axes) > 1:
        axes[1].legend(fontsize=8)
    return save(fig, Path(out_dir) / "capacity.png")
