"""`kvsim compare`: run folders in, one self-contained report.html (and its PNGs) out.

Folders are what `kvsim run` writes (summary.csv, scenario.yaml, timeseries and
requests tables, run.json); a folder holding such folders (a rate sweep) counts as all
of them. Runs of one scenario at several arrival rates form a sweep: the report adds
latency and throughput against rate and each policy's sustained rate, and its other
figures show the *focus* run: the highest rate that some policy sustains (the lowest
swept rate if none does), where the policies differ most while one still keeps up.
Other sets of runs are compared side by side, a policy named `folder/policy` where two
runs share a policy name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from kvsim.config.errors import InputError
from kvsim.plots import html
from kvsim.analysis.rates import summary_lines, sustained, sweep_table
from kvsim.plots.colours import with_settings
from kvsim.plots.style import arrival_rate, context_line, percent, seconds
from kvsim.analysis.verdict import pick, sentence


def _count(x) -> str:
    return f"{x:,.0f}"


def _one(x) -> str:
    return f"{x:,.1f}"


# The summary as the report shows it, in two tables that fit the page: (column,
# heading, format). Every column in full is in the table after them.
MEMORY_COLUMNS = [
    ("policy", "policy", str),
    ("engine", "engine", str),
    ("kv_utilization", "KV util", percent),
    ("reservation_fraction", "reserved", percent),
    ("internal_fraction", "internal", percent),
    ("external_fraction", "external", percent),
    ("kv_capacity_tokens", "KV capacity (tokens)", _count),
    ("memory_capacity_requests", "capacity (requests)", _one),
    ("achievable_batch_size", "achievable batch", _one),
    ("prefix_hit_rate", "prefix hit", percent),
    ("fraction_basis", "fractions over", str),
]
SERVING_COLUMNS = [
    ("policy", "policy", str),
    ("mean_batch_size", "mean batch", _one),
    ("throughput_tok_s", "output tok/s", _count),
    ("request_throughput", "req/s", "{:.3g}".format),
    ("ttft_p50_s", "TTFT p50", seconds),
    ("ttft_p99_s", "TTFT p99", seconds),
    ("tpot_p50_s", "TPOT p50", seconds),
    ("tpot_p99_s", "TPOT p99", seconds),
    ("e2e_p99_s", "E2E p99", seconds),
    ("preemptions", "preempted", _count),
    ("requests_rejected", "rejected", _count),
]


def key_table(summary: pd.DataFrame, columns) -> pd.DataFrame:
    """Some of the summary's columns, formatted for reading (engine only where runs differ)."""
    shown = [
        c for c in columns if c[0] in summary and (c[0] != "engine" or summary["engine"].astype(str).nunique() > 1)
    ]
    return pd.DataFrame(
        {
            head: [fmt(v) if not (isinstance(v, float) and math.isnan(v)) else "n/a" for v in summary[col]]
            for col, head, fmt in shown
        }
    )


@dataclass
class RunFolder:
    path: Path
    scenario: dict
    summary: pd.DataFrame
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    meta: dict = field(default_factory=dict)
    stages: pd.DataFrame | None = None  # stages.csv, where the run wrote one

    @property
    def rate(self) -> float | None:
        return arrival_rate(self.scenario)

    @property
    def name(self) -> str:
        return str(self.scenario.get("name", self.path.name))


def find_runs(paths: list[Path]) -> list[Path]:
    """Each path that is a run folder, or the run folders below it, in name order."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise InputError(str(path), "folder", "not found (give folders that `kvsim run` wrote)")
        if (path / "summary.csv").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.glob("*/summary.csv")) or sorted(
            p.parent for p in path.glob("*/*/summary.csv")
        )
        if not below:
            raise InputError(str(path), "folder", "holds no kvsim run (no summary.csv in it or below it)")
        found.extend(below)
    return list(dict.fromkeys(found))


def load_run(path: Path) -> RunFolder:
    try:
        summary = pd.read_csv(path / "summary.csv")
        scenario = yaml.safe_load((path / "scenario.yaml").read_text()) if (path / "scenario.yaml").is_file() else {}
        meta = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
    except (OSError, ValueError, yaml.YAMLError, pd.errors.ParserError) as e:
        raise InputError(str(path), "folder", f"unreadable run files ({type(e).__name__}: {e})") from None
    if "policy" not in summary:
        raise InputError(str(path / "summary.csv"), "policy", "column missing: not a kvsim summary")
    tables = {}
    for name in ("timeseries", "requests"):
        file = path / f"{name}.parquet"
        tables[name] = pd.read_parquet(file) if file.is_file() else pd.DataFrame(columns=["policy"])
    stages = None
    if (path / "stages.csv").is_file():
        try:
            stages = pd.read_csv(path / "stages.csv")
        except (OSError, ValueError, pd.errors.ParserError) as e:
            raise InputError(str(path / "stages.csv"), "file", f"unreadable ({type(e).__name__}: {e})") from None
    return RunFolder(path, scenario or {}, summary, tables["timeseries"], tables["requests"], meta, stages)


def is_sweep(runs: list[RunFolder]) -> bool:
    rates = [r.rate for r in runs]
    return len(runs) > 1 and len({r.name for r in runs}) == 1 and None not in rates and len(set(rates)) == len(rates)


def slo_targets(scenario: dict) -> dict[str, float]:
    """The latency targets a run's scenario.yaml sets, by summary column."""
    return {k: float(v) for k, v in (scenario.get("slo") or {}).items() if v is not None}


def run_targets(runs: list[RunFolder]) -> dict[str, tuple[dict[str, float], float | None]]:
    """(its run's latency targets, its run's arrival rate) for each policy, by the name
    `combine` gives it: runs of different scenarios each keep their own slo: block."""
    names = [p for r in runs for p in r.summary["policy"].astype(str)]
    clash = len(runs) > 1 and len(names) != len(set(names))
    return {
        (run.path.name + "/" + policy if clash else policy): (slo_targets(run.scenario), run.rate)
        for run in runs
        for policy in run.summary["policy"].astype(str)
    }


def combine(runs: list[RunFolder]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Summaries and tables of several runs, policies renamed folder/policy where they
    clash; each summary with its contiguous policies' reservation (for their colours)."""
    if len(runs) == 1:
        return with_settings(runs[0].summary, runs[0].scenario), runs[0].timeseries, runs[0].requests
    names = [p for r in runs for p in r.summary["policy"].astype(str)]
    clash = len(names) != len(set(names))
    out = ([], [], [])
    for run in runs:
        for i, frame in enumerate((with_settings(run.summary, run.scenario), run.timeseries, run.requests)):
            frame = frame.copy()
            if clash and "policy" in frame:
                frame["policy"] = run.path.name + "/" + frame["policy"].astype(str)
            out[i].append(frame)
    return tuple(pd.concat(frames, ignore_index=True) for frames in out)


def build_report(runs: list[RunFolder], out: Path) -> list[str]:
    """Write the PNGs and report.html into `out` (which must exist); return the verdict
    (its first line the recommendation, then a line per policy and the sweep's)."""
    from kvsim.plots.curves import rate_sweep
    from kvsim.plots.run_figures import save, write_plots

    body = [html.heading("kvsim compare: " + ", ".join(dict.fromkeys(r.name for r in runs)), 1)]
    sweep = sweep_table([(r.rate, r.summary, r.requests) for r in runs]) if is_sweep(runs) else None
    if sweep is not None:
        best = [v for v in sustained(sweep).values() if not math.isnan(v)]
        focus_rate = max(best) if best else min(r.rate for r in runs)
        focus = [next(r for r in runs if r.rate == focus_rate)]
    else:
        focus = runs
    summary, timeseries, requests = combine(focus)
    scenarios = list({json.dumps(r.scenario, sort_keys=True): r.scenario for r in focus}.values())
    # each run's line from its own summary: the policies of another run used their own step costs
    contexts = list(dict.fromkeys(context_line(r.scenario, r.summary) for r in focus))
    own = run_targets(focus)  # each policy's run's targets and rate, by its name in `summary`
    sets = {json.dumps(t, sort_keys=True): t for t, _ in own.values()}
    common = next(iter(sets.values())) if len(sets) == 1 else None

    body.append(html.heading("Verdict"))
    rows = summary.to_dict(orient="records")
    verdict = [pick(summary, common, None if common is not None else {p: t for p, (t, _) in own.items()})]
    verdict += [sentence(r, *own.get(str(r["policy"]), ({}, None))) for r in rows]
    if sweep is not None:
        verdict += ["Rate sweep: " + line for line in summary_lines(sweep)]
        verdict.append(
            f"The figures below show the run at {focus[0].rate:g} req/s (the highest rate some policy sustains)."
        )
    body.append(html.items(verdict, "verdict"))
    body += [html.paragraph(c, "context") for c in contexts]

    # the latency figures draw every run's targets (each run's named where they differ)
    figure_targets = common if common is not None else {r.name: slo_targets(r.scenario) for r in focus}
    notes = list(dict.fromkeys(n for r in focus for n in r.meta.get("timing_notes", ())))
    pngs = write_plots(summary, timeseries, requests, out, " | ".join(contexts), targets=figure_targets, notes=notes)
    if sweep is not None:
        pngs.append(
            save(
                rate_sweep(sweep, context_line(runs[0].scenario, summary, swept=True), settings=summary),
                out / "rate_sweep.png",
            )
        )
        sweep.to_csv(out / "rates.csv", index=False)
    sections = [
        ("Memory: where the KV pool went, and its capacity", ["memory_breakdown.png"]),
        ("Memory and batch over time", ["utilization_batch.png"]),
        ("Latency", ["latency_percentiles.png", "latency.png"]),
        ("Batch and throughput", ["throughput_batch.png", "rate_sweep.png"]),
    ]
    for title, files in sections:
        body.append(html.heading(title))
        body += [html.image(out / f, f) for f in files if (out / f).is_file()]

    stages = combine_stages(focus)
    if stages is not None and stages["stage"].nunique() > 1:  # one stage is the summary again
        body.append(html.heading("Per load stage"))
        body.append(
            html.paragraph(
                "Each stage's requests, as inference-perf reports them: itl and tpot "
                "are its client-side line gaps (about half the time between tokens)."
            )
        )
        body.append(html.table(side_by_side(stages), scroll=True))
        body.append(html.heading("Every stage column", 3))
        body.append(html.table(stages, scroll=True))

    body.append(html.heading("Summary"))
    body += [
        html.heading("Memory", 3),
        html.table(key_table(summary, MEMORY_COLUMNS)),
        html.heading("Throughput and latency", 3),
        html.table(key_table(summary, SERVING_COLUMNS)),
    ]
    if sweep is not None:
        body += [html.heading("Rate sweep", 3), html.table(sweep)]
    body += [
        html.heading("Step-cost model per policy (with extrapolations)"),
        html.table(summary[[c for c in ("policy", "cost_model") if c in summary]]),
    ]
    body.append(html.heading("Every summary column"))
    body.append(html.table(summary, scroll=True))
    body.append(html.heading("Scenario as run"))
    body += [html.pre(yaml.safe_dump(s, sort_keys=False)) for s in scenarios]
    body.append(html.heading("Versions and KV pool sizing"))
    body += [html.pre(f"{r.path}:\n" + json.dumps(r.meta, indent=2)) for r in focus]
    (out / "report.html").write_text(html.page("kvsim compare", body), encoding="utf-8")
    return verdict


STAGE_SHOWN = ("completed", "failed", "ttft_p50_s", "e2e_mean_s", "e2e_p90_s", "itl_mean_s")


def combine_stages(runs: list[RunFolder]) -> pd.DataFrame | None:
    """The runs' stages.csv rows, policies renamed as `combine` renames them; None if none has one."""
    frames = [(run, run.stages) for run in runs if run.stages is not None and len(run.stages)]
    if not frames:
        return None
    names = [p for r in runs for p in r.summary["policy"].astype(str)]
    clash = len(names) != len(set(names))
    out = []
    for run, frame in frames:
        frame = frame.copy()
        if clash:
            frame["policy"] = run.path.name + "/" + frame["policy"].astype(str)
        out.append(frame)
    return pd.concat(out, ignore_index=True)


def side_by_side(stages: pd.DataFrame) -> pd.DataFrame:
    """One row per stage (its number, rate and duration: runs that differ there get rows
    of their own), each policy's key figures in columns beside the others'."""
    keys = ["stage", "rate_per_s", "duration_s"]
    out = stages[keys].drop_duplicates().reset_index(drop=True)
    for policy in dict.fromkeys(stages["policy"].astype(str)):
        mine = stages[stages["policy"].astype(str) == policy][keys + list(STAGE_SHOWN)]
        out = out.merge(mine.rename(columns={m: f"{policy}: {m}" for m in STAGE_SHOWN}), on=keys, how="left")
    return out
