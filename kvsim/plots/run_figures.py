"""Figures comparing KV-cache memory policies, drawn from the run's result DataFrames.

`write_plots(summary, timeseries, requests, out_dir, context)` writes five PNGs and
returns their paths, always in this order:

1. ``memory_breakdown.png``: where the KV pool went, per policy, split the way the
   vLLM paper splits it (token states, reservation, internal fragmentation, external
   fragmentation & others) plus free space; beside it the KV capacity in tokens and in
   requests, which shows FP8's doubled capacity even when arrivals limit the batch.
2. ``utilization_batch.png``: KV utilization and running batch size over simulated time.
3. ``latency.png``: empirical CDFs of TTFT, TPOT and end-to-end latency.
4. ``throughput_batch.png``: achievable vs mean batch size, and output throughput
   (marked where the arrival rate set it).
5. ``latency_percentiles.png``: TTFT and TPOT at p50, p90 and p99 as bars.

Every figure carries `context` (kvsim.plots.style.context_line: scenario, model, GPU
and tp, arrivals, engine, step costs) under its title.

Only this module knows about matplotlib; the simulator core hands it DataFrames.
Figures are built as bare `matplotlib.figure.Figure` objects rendered by the Agg
canvas, never registered with pyplot, so no backend is switched and no window or
figure is left open.  Each policy keeps one colour in every figure (policies in
colour derived from its name, kvsim.plots.style), lines differ in style and marker
too, identical lines are labelled so, and each memory category has one fixed colour.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvsim.sim.parallel import ordered_map
from kvsim.plots import tier_plots
from kvsim.plots.style import bar_figure_width, policy_styles, same_as, set_policy_ticks
from kvsim.plots.style import policy_colours, wrap_label  # noqa: F401 (re-exported)
from kvsim.analysis.metrics import BASIS
from kvsim.analysis.verdict import arrival_limited

DPI = 110
MAX_POINTS = 2000  # drawn points per policy line; more are invisible at this size
MAX_CDF_POINTS = 4000  # drawn points per latency CDF (a rank step under 1/4000 of the axis)
FILES = (
    "memory_breakdown.png",
    "utilization_batch.png",
    "latency.png",
    "throughput_batch.png",
    "latency_percentiles.png",
)

# (summary column, timeseries column, legend label, colour): good use green, waste
# in warm colours that darken as it gets harder to reclaim, free space grey.
CATEGORIES = (
    ("token_fraction", "token", "token states", "#2e7d32"),
    ("reservation_fraction", "reservation", "reservation", "#f9a825"),
    ("internal_fraction", "internal", "internal fragmentation", "#ef6c00"),
    ("external_fraction", "external", "external fragmentation & others", "#c62828"),
    ("free_fraction", "free", "free", "#cfd8dc"),
)


TIMED = {"latency.png", "throughput_batch.png", "latency_percentiles.png"}  # figures of time


def _builders(summary: pd.DataFrame, timeseries: pd.DataFrame, requests: pd.DataFrame, targets: dict | None = None):
    """Each figure's file name and a function that builds it (one figure at a time)."""
    styles = policy_styles(summary, timeseries, requests)
    colours = {name: s.colour for name, s in styles.items()}
    builders = (
        lambda: _memory_breakdown(summary, requests, colours),
        lambda: _utilization_batch(timeseries, styles),
        lambda: _latency(requests, styles, targets or {}),
        lambda: _throughput_batch(summary, colours),
        lambda: latency_percentiles(summary, colours, targets or {}),
    )
    built = dict(zip(FILES, builders))
    if tier_plots.tiered(summary):  # a run with KV tiers: their figure too
        built[tier_plots.FILE] = lambda: tier_plots.hits_by_tier(summary, timeseries, colours)
    return built


def figures(
    summary: pd.DataFrame,
    timeseries: pd.DataFrame,
    requests: pd.DataFrame,
    context: str = "",
    targets: dict | None = None,
    notes=(),
) -> dict[str, Figure]:
    """The five figures by file name (six with KV tiers: kvsim.plots.tier_plots; the notebooks show these; write_plots saves them).
    targets: the scenario's latency targets (drawn on the latency figures; target_lines
    says what form they take for compared runs); notes: lines
    for the figures of time (kvsim.analysis.unmodelled's)."""
    figs = {name: build() for name, build in _builders(summary, timeseries, requests, targets).items()}
    for name, fig in figs.items():
        add_context(fig, context, notes if name in TIMED else ())
    return figs


def write_plots(
    summary: pd.DataFrame,
    timeseries: pd.DataFrame,
    requests: pd.DataFrame,
    out_dir: Path,
    context: str = "",
    workers: int = 1,
    targets: dict | None = None,
    notes=(),
) -> list[Path]:
    """Write the figures into `out_dir` (which must exist); return their paths.
    workers: draw them in up to that many processes (kvsim.sim.parallel; the same files)."""
    jobs = plot_jobs(summary, timeseries, requests, out_dir, context, targets, notes)
    return ordered_map(lambda i: jobs[i](), len(jobs), workers)


def plot_jobs(
    summary: pd.DataFrame,
    timeseries: pd.DataFrame,
    requests: pd.DataFrame,
    out_dir: Path,
    context: str = "",
    targets: dict | None = None,
    notes=(),
) -> list[Callable[[], Path]]:
    """One job per figure, in FILES order: build it, save it into `out_dir`, return its path
    (independent of each other, so a caller may run them in any process)."""

    def job(name: str, build) -> Callable[[], Path]:
        def draw() -> Path:
            fig = build()
            add_context(fig, context, notes if name in TIMED else ())
            return save(fig, Path(out_dir) / name)

        return draw

    return [job(name, build) for name, build in _builders(summary, timeseries, requests, targets).items()]


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at DPI (matplotlib's savefig on the Agg canvas: no pyplot)."""
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def add_context(fig: Figure, context: str, notes=()) -> None:
    """The run's context in small grey text above the figure's own titles, from the left
    edge: centred, it ran into a legend outside the axes at the upper right (which is at
    most about 3 inches wide). Notes (what a setting does not change) follow it, each
    on lines of its own. A title the figure already has (a sweep's) stays, between the
    context and the notes (it would be replaced otherwise: a figure has one suptitle)."""
    if context or notes:
        inches = fig.get_figwidth() - (3.2 if fig.legends else 0.2)
        width = max(40, int(inches * 13))  # characters that surely fit at 8 pt
        title = " ".join(fig.get_suptitle().split())
        lines = (
            textwrap.wrap(context, width)
            + textwrap.wrap(title, width)
            + [line for note in notes for line in textwrap.wrap("Note: " + note, width)]
        )
        fig.suptitle("\n".join(lines), fontsize=8, color="0.35", x=0.01, ha="left")


def downsample(series: pd.DataFrame, columns: list[str], max_points: int = MAX_POINTS) -> pd.DataFrame:
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
    return pd.DataFrame(
        {
            "policy": done["policy"].astype(str),
            "ttft_s": done["first_token_s"] - done["arrival_s"],
            "tpot_s": ((done["finish_s"] - done["first_token_s"]) / decode_tokens.where(decode_tokens > 0)),
            "e2e_s": done["finish_s"] - done["arrival_s"],
        }
    )


def breakdown_title(policies: list[str], bases: list[str], width_in: float) -> str:
    """The breakdown's title and the basis of its shares: the most common basis in words,
    the others with the policies they hold for, wrapped to the figure's width."""
    title = "KV pool breakdown"
    if not bases:
        return title
    by_basis: dict[str, list[str]] = {}
    for policy, basis in zip(policies, bases):
        by_basis.setdefault(basis, []).append(policy)
    common = max(by_basis, key=lambda b: len(by_basis[b]))
    parts = [BASIS.get(common, common)] + [
        f"{', '.join(names)}: {BASIS.get(b, b)}" for b, names in by_basis.items() if b != common
    ]
    text = "(" + "; ".join(parts) + ")"
    return title + "\n" + "\n".join(textwrap.wrap(text, max(40, int(width_in * 9))))


def _memory_breakdown(summary: pd.DataFrame, requests: pd.DataFrame, colours: dict[str, str]) -> Figure:
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(bar_figure_width(len(policies), extra=3.5), 7.6), layout="constrained")
    ax, ax_cap = fig.subplots(2, 1, height_ratios=(3, 2))
    x = np.arange(len(policies))
    bottom = np.zeros(len(policies))
    for col, _, label, colour in CATEGORIES:
        share = 100 * pd.to_numeric(summary[col], errors="coerce").fillna(0).to_numpy()
        ax.bar(x, share, 0.6, bottom=bottom, color=colour, label=label, edgecolor="white", linewidth=0.5)
        bottom += share
    tokens = pd.to_numeric(summary["token_fraction"], errors="coerce")
    for xi, top, tok in zip(x, bottom, tokens):
        text = "n/a" if pd.isna(tok) else f"{100 * tok:.1f}%\ntokens"
        ax.text(xi, top + 1.5, text, ha="center", va="bottom", fontsize=8, weight="bold")
    bases = summary["fraction_basis"].astype(str).tolist() if "fraction_basis" in summary else []
    ax.set_title(breakdown_title(policies, bases, fig.get_figwidth()), fontsize=10)
    set_policy_ticks(ax, x, policies, colours)
    ax.set_ylabel("share of KV pool (%)")
    ax.set_ylim(0, 118)
    ax.set_xlim(-0.6, len(policies) - 0.4)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside right upper", title="memory", fontsize=8)
    _capacity(ax_cap, summary, requests, policies, colours)
    return fig


def capacity_requests(summary: pd.DataFrame, requests: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Concurrent requests each pool holds: the run's memory_capacity_requests where it has
    them, else KV capacity in tokens over the mean request (prompt + output tokens)."""
    if "memory_capacity_requests" in summary:
        return _numbers(summary, "memory_capacity_requests"), "requests of mean size"
    tokens = _numbers(summary, "kv_capacity_tokens")
    lengths = (requests["prompt_tokens"] + requests["output_tokens"]) if len(requests) else pd.Series(dtype=float)
    mean = float(lengths.mean()) if len(lengths) else np.nan
    return tokens / mean if mean > 0 else np.full(len(summary), np.nan), "≈ requests (tokens ÷ mean length)"


def _capacity(ax, summary, requests, policies, colours) -> None:
    x = np.arange(len(policies))
    tokens = _numbers(summary, "kv_capacity_tokens")
    reqs, what = capacity_requests(summary, requests)
    bars = ax.bar(x, np.nan_to_num(tokens), 0.6, color=[colours[p] for p in policies])
    ax.bar_label(
        bars,
        [
            "n/a" if np.isnan(t) else f"{t:,.0f}\n{r:,.0f} req" if not np.isnan(r) else f"{t:,.0f}"
            for t, r in zip(tokens, reqs)
        ],
        fontsize=7,
        padding=2,
    )
    ax.set_title(f"KV capacity: token slots and {what}", fontsize=10)
    ax.set_ylabel("token slots")
    top = ax.get_ylim()[1]
    ax.set_ylim(0, top * 1.25 if top > 0 else 1)
    set_policy_ticks(ax, x, policies, colours)
    ax.grid(axis="y", alpha=0.3)


def _utilization_batch(timeseries: pd.DataFrame, styles: dict) -> Figure:
    fig = Figure(figsize=(10.5, 6.4), layout="constrained")
    ax_util, ax_batch = fig.subplots(2, 1, sharex=True)
    groups = dict(tuple(timeseries.groupby(timeseries["policy"].astype(str), sort=False)))
    drawn = {}
    for name in styles:
        frame = groups.get(name)
        if frame is not None and not frame.empty:
            d = downsample(frame, ["token", "running"])
            # repeat the last value to the end of the last step so steps-post shows it
            end = d.iloc[[-1]].assign(time_s=d["time_s"].iloc[-1] + d["step_s"].iloc[-1])
            drawn[name] = pd.concat([d, end], ignore_index=True)
    twins = same_as({n: (tuple(d["time_s"]), tuple(d["token"]), tuple(d["running"])) for n, d in drawn.items()})
    handles = []
    for name, st in styles.items():
        d = drawn.get(name)
        if d is None:
            handles.append(Line2D([], [], color=st.colour, label=f"{name} (no steps)"))
            continue
        kw = dict(drawstyle="steps-post", color=st.colour, lw=1.2, ls=st.linestyle)
        ax_util.plot(d["time_s"], 100 * d["token"], **kw)
        ax_batch.plot(d["time_s"], d["running"], **kw)
        label = f"{name} (same as {twins[name]})" if name in twins else name
        handles.append(Line2D([], [], color=st.colour, ls=st.linestyle, label=label))
    if timeseries.empty:
        ax_util.text(0.5, 0.5, "no steps recorded", transform=ax_util.transAxes, ha="center")
    ax_util.set_ylabel("KV utilization\n(token states, %)")
    ax_util.set_ylim(0, 105)
    ax_batch.set_ylabel("running batch\n(requests)")
    ax_batch.set_ylim(bottom=0)
    ax_batch.set_xlabel("simulated time (s)")
    for ax in (ax_util, ax_batch):
        ax.grid(alpha=0.3)
    ax_util.set_title("KV utilization and batch size over time", fontsize=10)
    fig.legend(handles=handles, loc="outside right upper", title="policy", fontsize=8)
    return fig


def _latency(requests: pd.DataFrame, styles: dict, targets: dict) -> Figure:
    """CDFs with the percentiles marked (dotted lines at 0.5, 0.9, 0.99, labelled) and
    each latency target drawn where its percentile must stay below it."""
    samples = latency_samples(requests)
    fig = Figure(figsize=(13.5, 4.5), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    panels = (
        ("ttft_s", "time to first token (s)"),
        ("tpot_s", "time per output token (s)"),
        ("e2e_s", "end-to-end latency (s)"),
    )
    by_policy = dict(tuple(samples.groupby("policy", sort=False)))
    for ax, (col, xlabel) in zip(axes, panels):
        values = samples[col].to_numpy(float)
        values = values[np.isfinite(values)]
        floor = _log_floor(values)
        for name, st in styles.items():
            v = by_policy[name][col].to_numpy(float) if name in by_policy else np.array([])
            v = np.sort(v[np.isfinite(v)])
            if v.size == 0:
                continue
            if floor is not None:
                v = np.maximum(v, floor)  # zeros and stragglers sit at the left edge
            x, y = cdf_points(v)
            ax.plot(x, y, drawstyle="steps-post", color=st.colour, ls=st.linestyle, lw=1.4)
        if values.size == 0:
            ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
        elif floor is not None:
            ax.set_xscale("log")
        for pct, level in PERCENTILE_LEVELS:
            ax.axhline(level, color="0.55", ls=":", lw=0.8)
            ax.text(1.0, level, f" {pct}", transform=ax.get_yaxis_transform(), va="center", fontsize=7, color="0.35")
        _targets_on_cdf(ax, col.removesuffix("_s"), targets)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.grid(which="minor", alpha=0.1)
    axes[0].set_ylabel("fraction of completed requests")
    axes[1].set_title("Latency CDFs, completed requests", fontsize=10)
    counts = samples["policy"].value_counts()
    handles = [
        Line2D([], [], color=st.colour, ls=st.linestyle, label=f"{n} (n={counts.get(n, 0)})")
        for n, st in styles.items()
    ]
    fig.legend(handles=handles, loc="outside right upper", title="policy", fontsize=8)
    return fig


PERCENTILE_LEVELS = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
TARGET_STYLE = {"p50": ":", "p90": "-.", "p99": "--"}  # a target's line, by its percentile


def target_lines(targets: dict, metric: str) -> list[tuple[str, float, str]]:
    """(percentile, bound, whose) for each target of `metric` (ttft, tpot, e2e).
    `targets` is one scenario's {column: seconds}, or, for runs compared whose scenarios
    set different targets, {run name: its {column: seconds}} (whose: " (run name)")."""
    sets = targets.items() if any(isinstance(v, dict) for v in targets.values()) else [("", targets)]
    out = []
    for who, mine in sets:
        for column, bound in mine.items():
            name, _, pct = column.removesuffix("_s").rpartition("_")
            if name == metric:
                out.append((pct, float(bound), f" ({who})" if who else ""))
    return out


def _targets_on_cdf(ax, metric: str, targets: dict) -> None:
    """Each target of `metric` (e.g. ttft_p99_s <= 2) as a black line at its bound up to
    its percentile's level, with a marker where the CDF must pass above it."""
    for pct, bound, who in target_lines(targets, metric):
        level = dict(PERCENTILE_LEVELS).get(pct)
        if level is None:
            continue
        ax.axvline(bound, ymax=level / 1.02, color="black", ls=TARGET_STYLE.get(pct, "--"), lw=1.1)
        ax.plot([bound], [level], marker="v", color="black", ms=5)
        ax.annotate(
            f"target {pct} ≤ {bound:g} s{who} ",
            (bound, level),
            xytext=(-2, 3),
            textcoords="offset points",
            fontsize=7,
            ha="right",
        )


def cdf_points(v: np.ndarray, max_points: int = MAX_CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of sorted samples `v` as a steps-post line from (v[0], 0): every
    sample up to `max_points`, else the samples at `max_points` evenly spaced ranks (the
    first and last among them), each at its exact height. The line then lags the true one
    by less than 1 / max_points of the axis between kept ranks: invisible at this size."""
    n = v.size
    rank = np.arange(n) if n <= max_points else np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))
    return np.r_[v[0], v[rank]], np.r_[0.0, (rank + 1) / n]


def _throughput_batch(summary: pd.DataFrame, colours: dict[str, str]) -> Figure:
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(2 * bar_figure_width(len(policies), extra=1.0), 4.8), layout="constrained")
    ax_batch, ax_tput = fig.subplots(1, 2)
    x = np.arange(len(policies))
    policy_colours_ = [colours[p] for p in policies]
    achievable = _numbers(summary, "achievable_batch_size")
    mean = _numbers(summary, "mean_batch_size")
    bars_a = ax_batch.bar(x - 0.2, np.nan_to_num(achievable), 0.4, color=policy_colours_)
    bars_m = ax_batch.bar(
        x + 0.2, np.nan_to_num(mean), 0.4, color=policy_colours_, alpha=0.45, hatch="//", edgecolor="white"
    )
    for bars, values in ((bars_a, achievable), (bars_m, mean)):
        ax_batch.bar_label(bars, ["n/a" if np.isnan(v) else f"{v:.1f}" for v in values], fontsize=7, padding=2)
    ax_batch.legend(
        handles=[
            Patch(color="0.35", label="achievable batch size"),
            Patch(facecolor="0.35", alpha=0.45, hatch="//", edgecolor="white", label="mean batch size"),
        ],
        loc="upper left",
        fontsize=8,
    )
    ax_batch.set_ylabel("batch size (requests)")
    ax_batch.set_title("Batch size: achievable vs mean", fontsize=10)
    tput = _numbers(summary, "throughput_tok_s")
    bars_t = ax_tput.bar(x, np.nan_to_num(tput), 0.6, color=policy_colours_)
    limited = [arrival_limited(r) for r in summary.to_dict(orient="records")]
    ax_tput.bar_label(
        bars_t,
        ["n/a" if np.isnan(v) else f"{v:,.0f}" + ("\nset by\narrivals" if a else "") for v, a in zip(tput, limited)],
        fontsize=7,
        padding=2,
    )
    ax_tput.set_ylabel("output throughput (tok/s)")
    title = "Output throughput"
    if all(limited) and limited:
        title += ": set by the arrival rate for every policy"
    elif any(limited):
        title += " (\"set by arrivals\": the arrival rate, not the policy, set it)"
    ax_tput.set_title(title, fontsize=10)
    for ax in (ax_batch, ax_tput):
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.3 if top > 0 else 1)  # room for the value labels and legend
        set_policy_ticks(ax, x, policies, colours)
        ax.grid(axis="y", alpha=0.3)
    return fig


# per percentile: bar opacity and hatch, so that the three differ without colour too
PERCENTILES = (("p50", 1.0, ""), ("p90", 0.65, "//"), ("p99", 0.35, "xx"))


def latency_percentiles(summary: pd.DataFrame, colours: dict[str, str], targets: dict | None = None) -> Figure:
    """TTFT and TPOT at p50, p90 and p99: one group of three bars per policy, told
    apart by hatching as well as shade; each latency target a line (its style by
    percentile) across its panel."""
    policies = summary["policy"].astype(str).tolist()
    fig = Figure(figsize=(2 * bar_figure_width(len(policies), extra=1.0), 4.6), layout="constrained")
    x = np.arange(len(policies))
    for ax, metric, label in zip(
        fig.subplots(1, 2), ("ttft", "tpot"), ("time to first token (s)", "time per output token (s)")
    ):
        for k, (pct, alpha, hatch) in enumerate(PERCENTILES):
            values = _numbers(summary, f"{metric}_{pct}_s")
            ax.bar(
                x + (k - 1) * 0.27,
                np.nan_to_num(values),
                0.27,
                alpha=alpha,
                hatch=hatch,
                color=[colours[p] for p in policies],
                edgecolor="0.3",
                linewidth=0.4,
            )
        handles = [
            Patch(facecolor="0.6", alpha=alpha, hatch=hatch, edgecolor="0.3", label=pct)
            for pct, alpha, hatch in PERCENTILES
        ]
        for pct, bound, who in target_lines(targets or {}, metric):
            ax.axhline(bound, color="black", ls=TARGET_STYLE.get(pct, "--"), lw=1.1)
            handles.append(
                Line2D([], [], color="black", ls=TARGET_STYLE.get(pct, "--"), label=f"target {pct} ≤ {bound:g} s{who}")
            )
        ax.legend(handles=handles, fontsize=7, loc="upper left")
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.25 if top > 0 else 1)  # room for the legend
        ax.set_ylabel(label)
        ax.set_title(f"{metric.upper()} percentiles (bars: p50, p90, p99)", fontsize=10)
        set_policy_ticks(ax, x, policies, colours)
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
