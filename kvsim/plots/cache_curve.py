"""The cache curve's figure: hit rate against cache capacity, one line per eviction
policy, the unlimited cache's hit rate as the ceiling (kvsim.analysis.cache_curve).

Same conventions as kvsim.plots.curves: a bare Figure, a policy's colour from
kvsim.plots.style, the context line above the title.
"""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from kvsim.plots.run_figures import add_context
from kvsim.plots.style import policy_styles


def cache_curve_figure(table: pd.DataFrame, context: str = "", tokens_per_gib: float | None = None) -> Figure:
    """Hit rate (%) against capacity in tokens (log scale); with `tokens_per_gib`, a
    second axis on top gives the capacity in GiB of KV."""
    styles = policy_styles(table)
    fig = Figure(figsize=(9.5, 4.8), layout="constrained")
    ax = fig.subplots()
    finite = table[table.capacity_tokens.map(math.isfinite)]
    unlimited = table[~table.capacity_tokens.map(math.isfinite)]
    for policy, rows in finite.groupby("policy", sort=False):
        st = styles[str(policy)]
        ax.plot(
            rows.capacity_tokens,
            100 * rows.hit_rate,
            color=st.colour,
            ls=st.linestyle,
            marker=st.marker,
            ms=4,
            label=str(policy),
        )
    if not unlimited.empty:
        ceiling = 100 * float(unlimited.hit_rate.max())
        ax.axhline(ceiling, color="0.4", ls=":", lw=1, label=f"unlimited: {ceiling:.1f}%")
    if not finite.empty:
        ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("cache capacity (tokens, log scale)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title("Prefix-cache hit rate against capacity", fontsize=10)
    ax.grid(alpha=0.3)
    if tokens_per_gib and not finite.empty:
        top = ax.secondary_xaxis("top", functions=(lambda t: t / tokens_per_gib, lambda g: g * tokens_per_gib))
        top.set_xlabel("cache capacity (GiB of KV)")
    fig.legend(loc="outside right upper", title="eviction", fontsize=8)
    add_context(fig, context)
    return fig
