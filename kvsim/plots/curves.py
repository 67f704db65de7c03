"""Figures beyond one run's: rate sweeps and the claims' curves.

Same conventions as kvsim.plots.run_figures: bare Figures (no pyplot), a policy's colour
from kvsim.plots.style, the context line under the title.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvsim.plots.run_figures import add_context
from kvsim.analysis.rates import DIVERGENCE, sustained, unloaded_latency
from kvsim.plots.style import policy_styles


def rate_sweep(
    table: pd.DataFrame, context: str = "", divergence: float = DIVERGENCE, settings: pd.DataFrame | None = None
) -> Figure:
    """Normalized latency and throughput against request rate, per policy; a policy's
    sustained rate is ringed, and the divergence threshold drawn. `settings`: a frame of
    the policies' settings (a summary), for their colours."""
    styles = policy_styles(*([settings] if settings is not None else []), table)
    fig = Figure(figsize=(12.5, 4.8), layout="constrained")
    ax_lat, ax_tput = fig.subplots(1, 2)
    best = sustained(table, divergence)
    limit = divergence * unloaded_latency(table)
    for policy, rows in table.groupby("policy", sort=False):
        st = styles[str(policy)]
        rows = rows.sort_values("rate_per_s")
        kw = dict(color=st.colour, ls=st.linestyle, marker=st.marker, ms=4, lw=1.4)
        rate = best.get(str(policy), math.nan)
        label = f"{policy} (sustains {rate:g} req/s)" if not math.isnan(rate) else f"{policy} (never sustained)"
        ax_lat.plot(rows["rate_per_s"], rows["normalized_latency_s"], label=label, **kw)
        ax_tput.plot(rows["rate_per_s"], rows["throughput_tok_s"], **kw)
        if not math.isnan(rate):
            at = rows[rows["rate_per_s"] == rate].iloc[0]
            for ax, col in ((ax_lat, "normalized_latency_s"), (ax_tput, "throughput_tok_s")):
                ax.plot([rate], [at[col]], marker="o", ms=11, mfc="none", mec=st.colour, mew=1.5)
    if np.isfinite(limit) and limit > 0:
        ax_lat.axhline(limit, color="0.4", ls=":", lw=1)
        ax_lat.text(ax_lat.get_xlim()[0], limit, f" {divergence:g}x unloaded", va="bottom", fontsize=7, color="0.3")
        ax_lat.set_yscale("log")
    ax_lat.set_ylabel("normalized latency (s per output token)")
    ax_lat.set_title("Normalized latency vs request rate (rings: highest sustained rate)", fontsize=10)
    ax_tput.set_ylabel("output throughput (tok/s)")
    ax_tput.set_title("Throughput vs request rate", fontsize=10)
    for ax in (ax_lat, ax_tput):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", title="policy", fontsize=8)
    add_context(fig, context)
    return fig


def curves(
    series: dict[str, tuple[list[float], list[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    bands: list[tuple[float, float, str]] = (),
    context: str = "",
    percent: bool = True,
    logx: bool = False,
) -> Figure:
    """A line per name over shared axes; `bands` shade claimed ranges (low, high, label)."""
    styles = policy_styles(pd.DataFrame({"policy": list(series)}))
    fig = Figure(figsize=(9.5, 4.8), layout="constrained")
    ax = fig.subplots()
    scale = 100 if percent else 1
    for (low, high, label), shade in zip(bands, ("#fde0c5", "#d6e9f8", "#e4d7f5")):
        ax.axhspan(scale * low, scale * high, color=shade, alpha=0.6, label=label, lw=0)
    for name, (x, y) in series.items():
        st = styles[name]
        ax.plot(x, [scale * v for v in y], color=st.colour, ls=st.linestyle, marker=st.marker, ms=4, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
    add_context(fig, context)
    return fig
