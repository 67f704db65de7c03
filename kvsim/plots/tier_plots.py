"""The figure of a run with KV tiers (kv_offload): where each policy's prefix hits came
from, and how full each tier ran.

Same conventions as kvsim.plots.run_figures: a bare Figure, a policy's colour from
kvsim.plots.style, the context line added by the caller.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvsim.plots.style import bar_figure_width, set_policy_ticks

FILE = "prefix_hits_by_tier.png"
# (summary column, label, colour): the GPU's own hits darkest, the slower tiers lighter
TIERS = (
    ("prefix_hit_rate_gpu", "GPU prefix cache", "#1b5e20"),
    ("prefix_hit_rate_cpu", "host memory", "#43a047"),
    ("prefix_hit_rate_disk", "disk", "#a5d6a7"),
)


def tiered(summary: pd.DataFrame) -> bool:
    """Whether the run has the tiers' columns (some policy had kv_offload)."""
    return "prefix_hit_rate_cpu" in summary


def hits_by_tier(summary: pd.DataFrame, timeseries: pd.DataFrame, colours: dict[str, str]) -> Figure:
    """Stacked bars: the share of prompt tokens each tier supplied, per policy (they sum
    to prefix_hit_rate), labelled with the seconds steps waited for loads; beside them,
    each tier's occupancy over time."""
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(bar_figure_width(len(policies), extra=3.5) + 5.5, 4.8), layout="constrained")
    ax, ax_occ = fig.subplots(1, 2, width_ratios=(max(len(policies), 2), 3))
    x = np.arange(len(policies))
    bottom = np.zeros(len(policies))
    for column, label, colour in TIERS:
        share = 100 * pd.to_numeric(summary[column], errors="coerce").fillna(0).to_numpy()
        ax.bar(x, share, 0.6, bottom=bottom, color=colour, label=label, edgecolor="white", linewidth=0.5)
        bottom += share
    for xi, top, load in zip(x, bottom, summary["tier_load_s"]):
        ax.text(xi, top + 1, f"{top:.1f}%\nloads {load:.3g} s", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(10.0, bottom.max() * 1.25))
    ax.set_ylabel("prompt tokens found cached (%)")
    ax.set_title("Prefix hits by tier", fontsize=10)
    set_policy_ticks(ax, x, policies, colours)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, title="hit in")
    for policy, rows in timeseries.groupby("policy", sort=False):
        for column, ls in (("tier_cpu_occupancy", "-"), ("tier_disk_occupancy", ":")):
            if column in rows and rows[column].notna().any() and rows[column].max() > 0:
                ax_occ.plot(
                    rows["time_s"],
                    100 * rows[column],
                    ls=ls,
                    lw=1.2,
                    color=colours[str(policy)],
                    label=f"{policy}: {column.split('_')[1]}",
                )
    ax_occ.set_xlabel("simulated time (s)")
    ax_occ.set_ylabel("tier occupancy (% of its capacity)")
    ax_occ.set_ylim(0, 105)
    ax_occ.set_title("Tier occupancy (solid: host memory, dotted: disk)", fontsize=10)
    ax_occ.grid(alpha=0.3)
    if ax_occ.lines:
        ax_occ.legend(fontsize=7, loc="lower right")
    return fig
