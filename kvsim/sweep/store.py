"""A sweep's folder: one file per finished point, each written whole or not at all, and
the tables built from them.

    OUT/sweep.json                the plan: every point's id, parameters and seed
    OUT/points/<id>.parquet       a finished point: its summary rows, one per policy
    OUT/points/<id>.error.json    a failed point: its error (removed when it succeeds)
    OUT/results.parquet           every row of every finished point, in plan order
    OUT/summary.csv               one row per (point, policy): the mean over seeds and,
                                  with several seeds, each metric's 95% interval (_ci95)
    OUT/errors.csv                the failed points, if any
    OUT/sweep_<parameter>.png     plots (kvsim.plots.sweep_figures)

A point's file is written under a temporary name and renamed, so an interrupted sweep
(Ctrl-C, a killed process, a lost node) leaves every finished point intact and no
partial one; the tables are rebuilt from the point files at the end of each run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from kvsim.analysis.metrics import ten_digits
from kvsim.sweep.backends import Outcome, Task
from kvsim.sweep.grid import Point, Sweep

# Two-sided 95% quantiles of Student's t by degrees of freedom (any statistics table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2); between rows, the row
# below (a slightly wider interval).
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
    60: 2.000,
    120: 1.980,
}


def t95(dof: int) -> float:
    return T95[max(k for k in T95 if k <= dof)] if dof < 1000 else 1.960


class Store:
    def __init__(self, out: Path):
        self.out = Path(out)
        self.points = self.out / "points"

    def finished(self) -> set[str]:
        return {p.name.removesuffix(".parquet") for p in self.points.glob("*.parquet")}

    def failed(self) -> set[str]:
        return {p.name.removesuffix(".error.json") for p in self.points.glob("*.error.json")}

    def start(self, sweep: Sweep) -> None:
        self.points.mkdir(parents=True, exist_ok=True)
        plan = {
            "name": sweep.name,
            "sweep": sweep.src,
            "scenario": sweep.scenario_src,
            "params": sweep.params,
            "points": [{"id": p.id, "params": p.params, "seed": p.seed} for p in sweep.points],
        }
        _atomic(self.out / "sweep.json", lambda tmp: tmp.write_text(json.dumps(plan, indent=1) + "\n"))

    def write(self, outcome: Outcome) -> None:
        ok = self.points / f"{outcome.id}.parquet"
        bad = self.points / f"{outcome.id}.error.json"
        if outcome.summary is not None:
            _atomic(ok, lambda tmp: outcome.summary.to_parquet(tmp, index=False))
            bad.unlink(missing_ok=True)
        else:
            record = {"error": outcome.error, "detail": outcome.detail}
            _atomic(bad, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))

    def fill(
        self, sweep: Sweep, backend, resume: bool = False, on_outcome: Callable[[Outcome], None] = lambda o: None
    ) -> list[Point]:
        """Run the sweep's points that this folder lacks (with resume: those not finished;
        without: all), writing each as it finishes; returns the points it ran. The backend
        must be open (`with backend:`)."""
        self.start(sweep)
        done = self.finished() if resume else set()
        todo = {p.id: p for p in sweep.points if p.id not in done}  # a repeated scenario runs once

        def record(outcome: Outcome) -> None:
            self.write(outcome)
            on_outcome(outcome)

        backend.run([Task(p.id, p.scenario, sweep.base_dir, sweep.scenario_src) for p in todo.values()], record)
        return list(todo.values())

    def error(self, point_id: str) -> dict:
        return json.loads((self.points / f"{point_id}.error.json").read_text())

    def tables(self, sweep: Sweep) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """(rows, summary, errors) of the plan's points that have finished or failed."""
        finished, failed = self.finished(), self.failed() - self.finished()
        params = _param_columns(sweep)
        parts = []
        for i, point in enumerate(sweep.points):
            if point.id in finished:
                rows = pd.read_parquet(self.points / f"{point.id}.parquet")
                head = params.iloc[[i] * len(rows)].reset_index(drop=True)
                head.insert(len(head.columns), "seed", point.seed)
                head.insert(len(head.columns), "point", point.id)
                # a swept field the summary also reports (engine, router, ...) is one column
                parts.append(pd.concat([head, rows.drop(columns=[c for c in head if c in rows])], axis=1))
        rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
        errors = pd.DataFrame(
            [
                {**params.iloc[i].to_dict(), "seed": p.seed, "point": p.id, "error": self.error(p.id)["error"]}
                for i, p in enumerate(sweep.points)
                if p.id in failed
            ]
        )
        return rows, summarize(rows, sweep.params), errors

    def write_tables(self, sweep: Sweep) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        rows, summary, errors = self.tables(sweep)
        _atomic(self.out / "results.parquet", lambda tmp: rows.to_parquet(tmp, index=False))
        _atomic(self.out / "summary.csv", lambda tmp: summary.to_csv(tmp, index=False))
        target = self.out / "errors.csv"
        if len(errors):
            _atomic(target, lambda tmp: errors.to_csv(tmp, index=False))
        else:
            target.unlink(missing_ok=True)
        return rows, summary, errors


def summarize(rows: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """One row per (point, policy): the mean over seeds of every numeric column and, with
    several seeds, its 95% confidence interval's half-width (Student's t)."""
    if rows.empty:
        return pd.DataFrame()
    keys = [*params, "policy"]
    skip = {*keys, "seed", "point"}
    metrics = [c for c in rows.columns if c not in skip]
    several = rows.groupby(keys, sort=False, dropna=False).size().max() > 1
    out = []
    for key, group in rows.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["seeds"] = len(group)
        for col in metrics:
            values = group[col]
            if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
                row[col] = values.iloc[0]
                continue
            x = values.to_numpy(dtype=float)
            x = x[~np.isnan(x)]
            row[col] = ten_digits(float(x.mean())) if len(x) else math.nan
            if several:
                half = t95(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else math.nan
                row[f"{col}_ci95"] = ten_digits(float(half))
        out.append(row)
    return pd.DataFrame(out)


def _param_columns(sweep: Sweep) -> pd.DataFrame:
    """The points' parameters, one column per swept path. A column whose values are not all
    numbers, all strings or all booleans (a preset name here, an inline model there) holds
    each value as JSON text, so every column has one type in Parquet."""
    columns = {}
    for name in sweep.params:
        values = [p.params.get(name) for p in sweep.points]
        present = [v for v in values if v is not None]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)
        uniform = numbers or all(isinstance(v, str) for v in present) or all(isinstance(v, bool) for v in present)
        columns[name] = (
            values
            if uniform
            else [None if v is None else v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values]
        )
    return pd.DataFrame(columns, index=range(len(sweep.points)))


def _atomic(path: Path, write) -> None:
    """Write through a temporary file in the same folder, then rename: whole or absent."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
