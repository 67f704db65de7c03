"""What the commands print: tables and notes that fit a terminal of WIDTH columns.

`kvsim run` prints the essentials by default: per policy the share of the KV pool
holding tokens, the mean batch, what limited it, throughput, TTFT and TPOT at p50 and
p99 (and whether the scenario's latency targets are met), then a verdict; optional
columns (prefix hits, preemptions, rejections) join only while the table still fits.
`--wide` prints every column and every note in full, the way the files hold them.
Policy names longer than the room left are cut with an ellipsis (the files keep them).
"""

from __future__ import annotations

import math
import textwrap
from typing import Callable, Mapping

import click

from kvsim.plots.style import percent, seconds

WIDTH = 100
GAP = "  "
MIN_NAME = 12  # a policy column is never cut below this many characters


def wrap(text: str, width: int = WIDTH, indent: str = "  ") -> list[str]:
    """`text` on lines of at most `width` characters, later lines indented."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=True) or [""]


def echo_wrapped(text: str, width: int = WIDTH, indent: str = "  ") -> None:
    for line in wrap(text, width, indent):
        click.echo(line)


def layout(heads: list, rows: list[list[str]], width: int | None = WIDTH) -> list[str]:
    """Aligned lines (first column left, the rest right). A heading may be a pair
    (group, name): a line above names the group over its columns, which stand one space
    apart instead of two. Where the lines would pass `width`, the first column is cut
    (with an ellipsis) down to MIN_NAME characters."""
    groups = [h[0] if isinstance(h, tuple) else "" for h in heads]
    names = [h[1] if isinstance(h, tuple) else h for h in heads]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(names)]
    gaps = [" " if g and g == groups[i - 1] else GAP for i, g in enumerate(groups)][1:]
    over = sum(widths) + sum(map(len, gaps)) - (width or 10**9)
    if over > 0 and widths:
        widths[0] = max(MIN_NAME, widths[0] - over)
    lines = []
    if any(groups):
        lines.append(_group_line(groups, widths, gaps))
    for line in [names] + rows:
        cells = [_cut(line[0], widths[0]).ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])]
        lines.append("".join(c + g for c, g in zip(cells, gaps + [""])).rstrip())
    return lines


def _group_line(groups: list[str], widths: list[int], gaps: list[str]) -> str:
    """Each group's name centred over the span of its columns."""
    out, i = "", 0
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and groups[j + 1] and groups[j + 1] == groups[i]:
            j += 1
        span = sum(widths[i : j + 1]) + sum(len(g) for g in gaps[i:j])
        out += groups[i].center(span) if groups[i] else " " * span
        out += gaps[j] if j < len(gaps) else ""
        i = j + 1
    return out.rstrip()


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def fits(heads: list, rows: list[list[str]], width: int = WIDTH) -> bool:
    return max(len(line) for line in layout(heads, rows, width=None)) <= width


# --- kvsim run's table -----------------------------------------------------------
Column = tuple[str, str, Callable[[Mapping], str]]  # (key, heading, cell of a summary row)


def _value(column: str, fmt: Callable[[float], str]) -> Callable[[Mapping], str]:
    def cell(row: Mapping) -> str:
        v = row.get(column, math.nan)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt(v)

    return cell


def _limit(row: Mapping) -> str:
    from kvsim.analysis.verdict import limiting_factor

    what, share, _ = limiting_factor(row)
    what = SHORT_LIMITS.get(what, what.split(" (")[0])
    return f"{what} {share:.0%}" if share is not None else what


SHORT_LIMITS = {
    "the admission watermark": "watermark",
    "the sequence cap (max_num_seqs)": "max_num_seqs",
    "the token budget (max_num_batched_tokens)": "token budget",
    "arrivals (nothing waiting)": "arrivals",
    "a scheduler limit (sequence cap or token budget)": "scheduler",
}

ESSENTIAL: list[Column] = [
    ("kv_utilization", ("KV", "util"), _value("kv_utilization", percent)),
    ("mean_batch_size", "batch", _value("mean_batch_size", "{:.1f}".format)),
    ("limited", "limited by", _limit),
    ("throughput_tok_s", "tok/s", _value("throughput_tok_s", "{:,.0f}".format)),
    ("ttft_p50_s", ("TTFT", "p50"), _value("ttft_p50_s", seconds)),
    ("ttft_p99_s", ("TTFT", "p99"), _value("ttft_p99_s", seconds)),
    ("tpot_p50_s", ("TPOT", "p50"), _value("tpot_p50_s", seconds)),
    ("tpot_p99_s", ("TPOT", "p99"), _value("tpot_p99_s", seconds)),
]
OPTIONAL: list[Column] = [  # joined in this order while the table fits
    ("prefix_hit_rate", ("prefix", "hit"), _value("prefix_hit_rate", percent)),
    ("preemptions", "preempt", _value("preemptions", "{:,}".format)),
    ("requests_rejected", "rejected", _value("requests_rejected", "{:,}".format)),
]


def run_table(
    summary, targets: Mapping[str, float] | None = None, caching: bool | None = None, width: int = WIDTH
) -> list[str]:
    """The default table of `kvsim run`: ESSENTIAL columns (those the summary has), an
    SLO column where targets are set, then OPTIONAL ones that still fit."""
    from kvsim.analysis.slo import misses

    records = summary.to_dict(orient="records")
    has = set(summary.columns) | {"limited"}
    if caching is None:
        caching = bool((summary.get("prefix_hit_rate", 0) > 0).any()) if len(summary) else False
    columns = [c for c in ESSENTIAL if c[0] in has]
    if targets:
        columns.append(("slo", "SLO", lambda r: "miss" if misses(r, targets) else "met"))
    wanted = {
        "prefix_hit_rate": caching,
        "preemptions": any(r.get("preemptions", 0) for r in records),
        "requests_rejected": any(r.get("requests_rejected", 0) for r in records),
    }
    for column in OPTIONAL:
        trial = columns + [column]
        if column[0] in has and wanted.get(column[0]) and fits(*_cells(trial, records), width):
            columns = trial
    return layout(*_cells(columns, records), width)


def _cells(columns: list[Column], records: list[Mapping]):
    heads = ["policy"] + [h for _, h, _ in columns]
    rows = [[str(r.get("policy", "?"))] + [cell(r) for _, _, cell in columns] for r in records]
    return heads, rows


def step_cost_note(summary) -> str:
    """The step-cost models in one sentence: each label once, the policies that used it
    where they differ, and the share of steps priced beyond measured data."""
    from kvsim.cost.model import undescribe

    if "cost_model" not in summary:
        return ""
    parts = [undescribe(v) for v in summary["cost_model"].astype(str)]
    labels = list(dict.fromkeys(p.label for p in parts))
    steps, extra = sum(p.steps for p in parts), sum(p.extrapolated for p in parts)
    if len(labels) == 1:
        text = f"step costs: {labels[0]}"
    else:
        names = summary["policy"].astype(str).tolist()
        text = "step costs: " + "; ".join(
            f"{label} ({', '.join(n for n, p in zip(names, parts) if p.label == label)})" for label in labels
        )
    if extra:
        reasons = list(dict.fromkeys(r for p in parts for r in p.why.split("; ") if r))
        text += f"; {extra / steps:.0%} of steps priced beyond measured data (" + "; ".join(reasons) + ")"
    return text


def print_run(summary, scn=None, wide: bool = False, width: int = WIDTH) -> None:
    """A run's table, its notes and the verdict: WIDTH columns, or everything with `wide`."""
    from kvsim.analysis.verdict import pick, sentence

    targets = scn.slo.targets() if scn is not None and scn.slo is not None else {}
    caching = any(getattr(p, "enable_prefix_caching", False) for p in scn.policies) if scn else None
    if wide:
        for line in wide_table(summary, caching):
            click.echo(line)
    else:
        for line in run_table(summary, targets, caching, width):
            click.echo(line)
    notes = [column_note(summary, wide)]
    engine = "engine " + ", ".join(dict.fromkeys(summary["engine"].astype(str))) if "engine" in summary else ""
    if wide and engine:
        notes.append(engine)
    if "replicas" in summary:
        n, router = summary["replicas"].iloc[0], summary["router"].iloc[0]
        notes.append(
            f"fleet: {n} replicas behind a {router} router; rows are the fleet's (batch and "
            "fractions per replica, over replica-time); each replica in replica_summary.csv"
        )
    if wide:
        notes += [
            f"step costs of {name}: {cost}"
            for name, cost in zip(summary.policy.astype(str), summary.cost_model.astype(str))
        ]
    else:
        notes.append("; ".join(filter(None, [engine, step_cost_note(summary)])))
    for note in filter(None, notes):
        if wide:
            click.echo(note)
        else:
            echo_wrapped(note, width)
    rate = getattr(getattr(getattr(scn, "workload", None), "arrival", None), "rate_per_s", None)
    echo_wrapped("verdict: " + pick(summary, targets), width if not wide else 10**6)
    if wide:
        for row in summary.to_dict(orient="records"):
            click.echo("  " + sentence(row, targets, rate))


def column_note(summary, wide: bool) -> str:
    """What the table's memory columns mean (the time window they are weighted over)."""
    from kvsim.analysis.metrics import BASIS

    bases = list(dict.fromkeys(summary["fraction_basis"].astype(str))) if "fraction_basis" in summary else []
    if wide:
        return "fractions and achv batch: " + "; ".join(f"basis '{b}': {BASIS.get(b, b)}" for b in bases)
    never = "none" in bases
    return (
        "KV util: share of the KV pool holding tokens while memory kept requests waiting"
        + (" (n/a: memory never did)" if never else "")
        + "; batch: mean running requests; --wide for every column"
    )


# (column, heading, format): --wide's table, every column the files' summary leads with
WIDE = [
    ("policy", "policy", "{}"),
    ("kv_utilization", "kv util", "{:.1%}"),
    ("internal_fraction", "internal", "{:.1%}"),
    ("external_fraction", "external", "{:.1%}"),
    ("achievable_batch_size", "achv batch", "{:.1f}"),
    ("mean_batch_size", "mean batch", "{:.1f}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("ttft_p50_s", "ttft p50 s", "{:.3g}"),
    ("ttft_p90_s", "ttft p90 s", "{:.3g}"),
    ("ttft_p99_s", "ttft p99 s", "{:.3g}"),
    ("tpot_p50_s", "tpot p50 s", "{:.3g}"),
    ("tpot_p90_s", "tpot p90 s", "{:.3g}"),
    ("tpot_p99_s", "tpot p99 s", "{:.3g}"),
    ("e2e_p50_s", "e2e p50 s", "{:.3g}"),
    ("e2e_p99_s", "e2e p99 s", "{:.3g}"),
    ("prefix_hit_rate", "prefix hit", "{:.1%}"),
    ("preemptions", "preempt", "{}"),
    ("requests_rejected", "rejected", "{}"),
    ("requests_unfinished", "unfinished", "{}"),
    ("fraction_basis", "basis", "{}"),
]


def wide_table(summary, caching: bool | None = None) -> list[str]:
    """Every WIDE column the summary has (prefix hits where a policy caches), and the
    limit of each batch where the run records it; no width limit."""
    if caching is None:
        caching = bool((summary.get("prefix_hit_rate", 0) > 0).any()) if len(summary) else False
    shown = [c for c in WIDE if c[0] in summary and (c[0] != "prefix_hit_rate" or caching)]
    heads = [h for _, h, _ in shown]
    records = summary.to_dict(orient="records")
    rows = [[_cell(r[c], fmt) for c, _, fmt in shown] for r in records]
    if any(k.startswith("limited_by_") for k in summary.columns):
        heads.append("limited by")
        for row, r in zip(rows, records):
            row.append(_limit(r))
    return layout(heads, rows, width=None)


def _cell(value, fmt: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return fmt.format(value)


WIDE_HELP = "Print every column and note in full (the default table fits 100 columns)."


# --- kvsim sweep's tables --------------------------------------------------------
SWEPT: list[Column] = [
    ("throughput_tok_s", "tok/s", _value("throughput_tok_s", "{:,.0f}".format)),
    ("ttft_p50_s", ("TTFT", "p50"), _value("ttft_p50_s", seconds)),
    ("ttft_p99_s", ("TTFT", "p99"), _value("ttft_p99_s", seconds)),
    ("tpot_p50_s", ("TPOT", "p50"), _value("tpot_p50_s", seconds)),
    ("tpot_p99_s", ("TPOT", "p99"), _value("tpot_p99_s", seconds)),
    ("kv_utilization", ("KV", "util"), _value("kv_utilization", percent)),
    ("mean_batch_size", "batch", _value("mean_batch_size", "{:.1f}".format)),
]


def sweep_tables(summary, params: list[str], width: int = WIDTH) -> list[str]:
    """Per swept field (two or more values): one row per policy and value, each metric
    the mean over the other swept fields' values and the seeds."""
    from kvsim.plots.style import param_label

    lines: list[str] = []
    if summary.empty:
        return lines
    metrics = [c for c in SWEPT if c[0] in summary]
    for param in (p for p in params if summary[p].astype(str).nunique() > 1):
        others = [p for p in params if p != param and summary[p].astype(str).nunique() > 1]
        means = (
            summary.groupby(["policy", param], sort=False, dropna=False)[[c for c, _, _ in metrics]]
            .mean()
            .reset_index()
        )
        order = {v: i for i, v in enumerate(dict.fromkeys(summary[param]))}
        means = means.sort_values(by=param, key=lambda col: col.map(order), kind="mergesort")
        means = means.sort_values(
            by="policy",
            key=lambda col: col.map({p: i for i, p in enumerate(dict.fromkeys(summary["policy"]))}),
            kind="mergesort",
        )
        label = param_label(param)
        over = " and ".join(filter(None, [", ".join(map(param_label, others)), "seeds"]))
        lines += [""] + wrap(f"{label}: means over {over}", width)
        records = means.to_dict(orient="records")
        heads = ["policy", "value"] + [h for _, h, _ in metrics]
        rows = [[str(r["policy"]), _plain(r[param])] + [cell(r) for _, _, cell in metrics] for r in records]
        lines += layout(heads, rows, width)
    return lines[1:]


def _plain(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- kvsim reproduce's lines -----------------------------------------------------
def claim_lines(table, width: int = WIDTH) -> list[str]:
    """Per claim: its id, verdict and words, then what was measured and expected, each
    wrapped to `width` (the whole rows are in claims.md and claims.csv)."""
    lines: list[str] = []
    for row in table.to_dict(orient="records"):
        lines += wrap(f"{row['id']}: {row['verdict']}: {row['claim']}", width, indent="    ")
        lines += wrap(f"    measured: {row['measured']}", width, indent="      ")
        lines += wrap(f"    expected: {row['expected']}", width, indent="      ")
    return lines


# --- kvsim capacity's table ------------------------------------------------------
def capacity_lines(head: str, table, width: int = WIDTH) -> list[str]:
    """The question, the answer per policy (its notes below the table, wrapped)."""
    shown = [c for c in table.columns if c != "note"]
    rows = [
        [
            _plain(v) if not (isinstance(v, float) and math.isnan(v)) and v is not None and str(v) != "<NA>" else "-"
            for v in r
        ]
        for r in table[shown].itertuples(index=False)
    ]
    lines = wrap(head, width) + layout(shown, rows, width)
    if "note" in table:
        for policy, note in zip(table["policy"].astype(str), table["note"]):
            if isinstance(note, str) and note:
                lines += wrap(f"{policy}: {note}", width)
    return lines
