"""What `kvsim run` and `kvsim compare`/`reproduce` share: running with a progress bar,
writing a run's folder (swapped in whole) and run.json. The terminal table is
kvsim.cli.table's."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path


from kvsim import __version__


def simulate_with_progress(
    scn, base_dir, src: str, quiet: bool, check_invariants: bool, label: str = "", **run_options
):
    """run_scenario with a progress bar; `run_options` are its exact_steps, bucket_s and workers."""
    from kvsim.analysis.results import run_scenario

    bar = Progress([p.name for p in scn.policies], enabled=not quiet and sys.stderr.isatty(), label=label)
    try:  # no bar, no reports: the loop would otherwise call one at every step
        results = run_scenario(
            scn,
            base_dir,
            src,
            on_progress=bar.update if bar.enabled else None,
            check_invariants=check_invariants,
            **run_options,
        )
    except BaseException:
        bar.close(finished=False)
        raise
    bar.close(finished=True)
    return results


def run_meta(scn, src: str, results, started: float) -> dict:
    """run.json: versions, wall time, the KV pool's sizing with each figure's scope, each
    policy's step-cost model (its summary column), and the policy settings that leave step
    time unchanged (kvsim.analysis.unmodelled)."""
    from kvsim.analysis.unmodelled import notes

    pool = results.pool
    gib = 1 << 30
    return {
        "kvsim_version": __version__,
        "python": platform.python_version(),
        "versions": dict(_versions()),
        "scenario": src,
        "seed": scn.seed,
        "policies": [p.name for p in scn.policies],
        "wall_time_s": round(time.monotonic() - started, 3),
        "kv_pool": {
            "tensor_parallel_size": scn.tensor_parallel_size,
            "gpu_memory_bytes_per_gpu": pool.gpu_bytes,
            "usable_bytes_per_gpu": round(pool.usable_bytes, 3),
            "weight_bytes_per_gpu": round(pool.weight_bytes, 3),
            "activation_bytes_per_gpu": round(pool.activation_bytes, 3),
            "non_torch_bytes_per_gpu": round(pool.non_torch_bytes, 3),
            "cudagraph_bytes_per_gpu": round(pool.cudagraph_bytes, 3),
            "kv_pool_bytes_per_gpu": round(pool.per_gpu_bytes, 3),
            "kv_pool_bytes_total": round(pool.pool_bytes, 3),
            "kv_pool_gib_total": round(pool.pool_bytes / gib, 3),
            "kv_shards": pool.kv_shards,
            "engine": pool.engine,
            "source": pool.source,
            "engine_log": results.engine_log,
        },
        "cost_model": dict(zip(results.summary.policy.astype(str), results.summary.cost_model.astype(str))),
        "timing_notes": notes(scn, Path(src).parent),
        **engine_args(scn),
    }


def engine_args(scn) -> dict:
    """run.json's record of the scenario's vllm_args or sglang_args: what they set and the
    flags kvsim accepted and ignored (kvsim.config.engine_flags)."""
    from kvsim.config.engine_flags import ARGS_FIELDS, parse

    for key, engine in ARGS_FIELDS.items():
        text = getattr(scn, key)
        if text is not None:
            parsed = parse(text, engine, "scenario", key, v0=scn.engine_name == "vllm-v0")
            return {"engine_args": {key: text, "sets": parsed.sets, "ignored": list(parsed.ignored)}}
    return {}


@lru_cache(maxsize=None)
def _versions() -> dict:
    """The installed versions run.json names."""
    from importlib import metadata

    out = {}
    for name in ("numpy", "pandas", "matplotlib", "pydantic", "click"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def swap_in(out: Path, write) -> None:
    """write(folder) into a fresh folder beside `out`, then swap it in: never half a result."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_run(results, scn, folder: Path, meta: dict, workers: int = 1, plots: bool = True) -> None:
    """One run's files into `folder` (which must exist); the tables and each figure are
    independent jobs, run in up to `workers` processes (kvsim.sim.parallel). plots=False:
    the tables and run.json alone (matplotlib is not even imported)."""
    if not plots:
        _write_tables(results, scn, folder)
        (folder / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
        return
    from kvsim.sim.parallel import ordered_map
    from kvsim.plots.run_figures import plot_jobs
    from kvsim.plots.colours import with_settings
    from kvsim.plots.style import context_line

    scenario = scn.model_dump(mode="json", exclude_none=True)
    context = context_line(scenario, results.summary)
    series = results.timeseries
    if results.per_replica is not None:  # a fleet's figures show replica 0
        series = series[series.replica == 0]
    jobs = [
        lambda: _write_tables(results, scn, folder),
        *plot_jobs(
            with_settings(results.summary, scenario),
            series,
            results.requests,
            folder,
            context=context,
            targets=scn.slo.targets() if scn.slo else None,
            notes=meta.get("timing_notes", ()),
        ),
    ]
    # the longest jobs first, so that none ends the run alone: the latency CDFs, the step
    # series, the breakdown; the tables last, unless they are long (a million requests'
    # Parquet file takes longer than any figure)
    long_tables = len(results.requests) + len(results.timeseries) > 200_000
    ordered_map(lambda i: jobs[i](), len(jobs), workers, first=[0, 3, 2, 1] if long_tables else [3, 2, 1, 4, 5])
    (folder / "run.json").write_text(json.dumps(meta, indent=2) + "\n")


def _write_tables(results, scn, folder: Path) -> None:
    _write_table(results.summary, folder, "summary")
    if results.stages is not None:
        _write_table(results.stages, folder, "stages")
    if results.per_replica is not None:  # a fleet: its rows per replica too
        _write_table(results.per_replica, folder, "replica_summary")
    results.timeseries.to_parquet(folder / "timeseries.parquet", index=False)
    results.requests.to_parquet(folder / "requests.parquet", index=False)
    (folder / "scenario.yaml").write_text(_scenario_yaml(scn))


def _write_table(table, folder: Path, name: str) -> None:
    """NAME.csv and NAME.json (NaN as null) of a summary-like table."""
    table.to_csv(folder / f"{name}.csv", index=False)
    rows = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in table.to_dict(orient="records")
    ]
    (folder / f"{name}.json").write_text(json.dumps(rows, indent=2, allow_nan=False) + "\n")


def _scenario_yaml(scn) -> str:
    import yaml

    return yaml.safe_dump(scn.model_dump(mode="json", exclude_none=True), sort_keys=False)


class Progress:
    """One progress bar per policy on stderr (tqdm: count, rate and ETA), shown only
    once a policy's run passes two seconds."""

    def __init__(self, policies: list[str], enabled: bool, label: str = ""):
        self.enabled, self.policies, self.label = enabled, policies, label
        self.bar, self.current = None, None

    def update(self, policy: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if policy != self.current:
            self._end(finished=True)  # the runner moved on: that policy is done
            from tqdm import tqdm

            index = self.policies.index(policy) + 1 if policy in self.policies else 0
            self.current = policy
            self.bar = tqdm(
                total=total,
                desc=f"{self.label}[{index}/{len(self.policies)}] {policy}",
                unit="req",
                delay=2,
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )
        self.bar.update(done - self.bar.n)

    def _end(self, finished: bool) -> None:
        if self.bar is not None:
            if finished:
                self.bar.update(self.bar.total - self.bar.n)  # the last rejections end without a step
            self.bar.close()
        self.bar = None

    def close(self, finished: bool = True) -> None:
        self._end(finished)
