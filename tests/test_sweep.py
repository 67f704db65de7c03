"""Sweeps: dotted-path overrides, expanding a sweep file into points, every point's rows
being its own run, a point that raises recorded while the rest finish, a killed worker's
point rerun without touching finished ones, an interrupted sweep resumed without
rerunning what finished, and `kvsim sweep` end to end. Local pool and Ray giving the same
rows: tests/test_sweep_ray.py.
"""

from __future__ import annotations

import copy
import io
import math
import os
import signal
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvsim.cli.app import main
from kvsim.config.errors import InputError
from kvsim.analysis.results import run_scenario
from kvsim.sweep.backends import LocalPool, run_point
from kvsim.sweep.grid import load_sweep, set_path
from kvsim.sweep.store import Store

# Llama-3-8B with a 1 GiB KV pool (8,192 slots): 30 requests of ~700 tokens at 20/s
# fill it, so the two policies differ; one run of both takes ~0.15 s.
BASE = {
    "name": "tiny",
    "seed": 1,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 2048,
    "kv_cache_memory_gib": 1,
    "cost_model": "roofline",
    "workload": {
        "num_requests": 30,
        "arrival": {"process": "poisson", "rate_per_s": 20.0},
        "prompt_tokens": {"dist": "lognormal", "mean": 600, "cv": 0.5, "min": 16, "max": 1500},
        "output_tokens": {"dist": "lognormal", "mean": 100, "cv": 0.5, "min": 4, "max": 400},
    },
    "policies": [
        {"name": "contiguous", "allocator": "contiguous"},
        {"name": "paged", "allocator": "paged", "block_size": 16},
    ],
}
# 2 x 2 points x 2 seeds = 8 runs
SWEEP = {
    "scenario": "base.yaml",
    "grid": {"workload.num_requests": [20, 30], "policies[allocator=paged].block_size": [16, 32]},
    "seeds": [1, 2],
}


def write_sweep(folder: Path, sweep: dict | None = None, base: dict | None = None) -> Path:
    (folder / "base.yaml").write_text(yaml.safe_dump(base or BASE, sort_keys=False))
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep or SWEEP, sort_keys=False))
    return path


def fill(plan, out: Path, backend, **kwargs):
    store = Store(out)
    with backend:
        store.fill(plan, backend, **kwargs)
    return store.write_tables(plan)


def kvsim(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


class Recorder:
    """A worker function that logs every call (one line per attempt) and kills its own
    process the first time (or, with always=True, every time) it meets `victim`.
    Pickled by value into the workers, so it carries its folder with it."""

    def __init__(self, folder: Path, victim: str | None = None, always: bool = False):
        self.folder, self.victim, self.always = Path(folder), victim, always

    def __call__(self, task):
        with open(self.folder / "calls.log", "a") as log:
            log.write(task.id + "\n")
        mark = self.folder / "killed"
        if task.id == self.victim and (self.always or not mark.exists()):
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return run_point(task)

    def calls(self) -> list[str]:
        log = self.folder / "calls.log"
        return log.read_text().split() if log.exists() else []


# --- dotted paths ----------------------------------------------------------------
def raw_scenario() -> dict:
    return {
        "seed": 0,
        "workload": {"arrival": {"process": "poisson", "rate_per_s": 1.0}},
        "policies": [
            {"name": "a", "allocator": "contiguous"},
            {"name": "b", "allocator": "paged"},
            {"name": "c", "allocator": "paged"},
        ],
    }


def test_paths_set_keys_list_entries_and_selected_entries():
    raw = raw_scenario()
    for path, value in [
        ("workload.arrival.rate_per_s", 3),
        ("policies[allocator=paged].block_size", 32),
        ("policies[0].kv_cache_dtype", "fp8"),
        ("policies[*].kv_scale", "head"),
        ("policies[-1].name", "z"),
        ("scheduler.max_num_seqs", 4),
        ("engine", "vllm-v1"),
    ]:
        set_path(raw, path, value, "s.yaml", f"grid.{path}")
    assert raw == {
        "seed": 0,
        "workload": {"arrival": {"process": "poisson", "rate_per_s": 3}},
        "policies": [
            {"name": "a", "allocator": "contiguous", "kv_cache_dtype": "fp8", "kv_scale": "head"},
            {"name": "b", "allocator": "paged", "block_size": 32, "kv_scale": "head"},
            {"name": "z", "allocator": "paged", "block_size": 32, "kv_scale": "head"},
        ],
        "scheduler": {"max_num_seqs": 4},
        "engine": "vllm-v1",
    }


def test_a_set_value_is_a_copy():
    raw, model = raw_scenario(), {"name": "m", "num_layers": 2}
    set_path(raw, "model", model, "s.yaml", "grid.model")
    model["num_layers"] = 99
    assert raw["model"] == {"name": "m", "num_layers": 2}


@pytest.mark.parametrize(
    "path, message",
    [
        ("policies[name=zzz].block_size", "no entry of policies matches [name=zzz]"),
        ("policies[5].block_size", "policies has 3 entries; [5] is out of range"),
        ("seed.x", "seed is 0, not a mapping"),
        ("workload[0]", "workload is {\"arrival\": {\"process\": \"poisson\", \"r..., not a list"),
        ("policies[*", "not a field path"),
        ("policies..x", "not a field path"),
        ("policies[x].a", "select list entries with [*], [INDEX] or [KEY=VALUE]"),
        ("scheduler[*].x", "the scenario has no list at scheduler"),
        ("[0]", "a field path starts with a key"),
    ],
)
def test_bad_paths_are_input_errors_naming_the_sweep_and_the_entry(path, message):
    with pytest.raises(InputError) as e:
        set_path(raw_scenario(), path, 1, "s.yaml", f"grid.{path}")
    assert (e.value.source, e.value.field) == ("s.yaml", f"grid.{path}")
    assert message in e.value.message


# --- expanding a sweep -----------------------------------------------------------
def test_points_times_grid_times_seeds_in_the_files_order(tmp_path):
    sweep = {
        "scenario": "base.yaml",
        "points": [{"scheduler.max_num_seqs": 4}, {"scheduler.max_num_seqs": 8}],
        "grid": {"workload.arrival.rate_per_s": [10, 20]},
        "seeds": [3, 4],
        "set": {"workload.num_requests": 12},
    }
    plan = load_sweep(write_sweep(tmp_path, sweep))
    assert plan.params == ["scheduler.max_num_seqs", "workload.arrival.rate_per_s"]
    assert [(tuple(p.params.values()), p.seed) for p in plan.points] == [
        ((s, r), seed) for s in (4, 8) for r in (10, 20) for seed in (3, 4)
    ]
    for p in plan.points:
        scn = p.scenario
        assert (scn.scheduler.max_num_seqs, scn.workload.arrival.rate_per_s, scn.seed, scn.workload.num_requests) == (
            p.params["scheduler.max_num_seqs"],
            p.params["workload.arrival.rate_per_s"],
            p.seed,
            12,
        )
    assert len({p.id for p in plan.points}) == 8
    assert plan.name == "sweep" and plan.base_dir == tmp_path


def test_quick_replaces_seeds_and_updates_set_and_grid(tmp_path):
    sweep = {
        **SWEEP,
        "set": {"workload.num_requests": 12},
        "quick": {"seeds": [7], "set": {"workload.num_requests": 6}, "grid": {"workload.num_requests": [6]}},
    }
    plan = load_sweep(write_sweep(tmp_path, sweep), quick=True)
    assert [(p.params, p.seed) for p in plan.points] == [
        ({"workload.num_requests": 6, "policies[allocator=paged].block_size": b}, 7) for b in (16, 32)
    ]


def test_without_seeds_a_point_runs_once_with_the_scenarios_seed(tmp_path):
    plan = load_sweep(write_sweep(tmp_path, {"scenario": "base.yaml", "grid": {"workload.num_requests": [5, 6]}}))
    assert [p.seed for p in plan.points] == [1, 1]


def test_one_scenario_reached_twice_is_one_id(tmp_path):
    # gpu_memory_utilization defaults to 0.9: setting it to 0.9 runs the same scenario.
    sweep = {"scenario": "base.yaml", "points": [{"gpu_memory_utilization": 0.9}, {"gpu_memory_utilization": 0.5}, {}]}
    ids = [p.id for p in load_sweep(write_sweep(tmp_path, sweep)).points]
    assert ids[0] == ids[2] != ids[1]


@pytest.mark.parametrize(
    "sweep, field, message",
    [
        (
            {"grid": {"workload.arrival.rate_per_s": [10, -1]}},
            "workload.arrival.rate_per_s",
            "greater than 0 (at workload.arrival.rate_per_s=-1, seed=1)",
        ),
        ({"grid": {"workload.arival.rate_per_s": [10]}}, "workload.arival", "did you mean 'arrival'?"),
        ({"grid": {"policies[*].block_size": [16]}}, "policies[0].block_size", "unknown key 'block_size'"),
        ({"grids": {}}, "grids", "did you mean 'grid'?"),
        ({"grid": {"seed": [1, 2]}, "seeds": [1]}, "grid.seed", "sweep seeds there"),
        ({"seeds": [1, 1]}, "seeds", "distinct"),
        ({"grid": {"workload.num_requests": [5, 5]}}, "grid.workload.num_requests", "repeats the value 5"),
        ({"grid": {"workload.num_requests": []}}, "grid.workload.num_requests", "at least one value"),
        ({"grid": {"x": [1]}, "points": [{"x": 2}]}, "points[0].x", "is also in grid"),
        ({"seeds": ["a"]}, "seeds.0", "integer"),
        ({"scenario": "nope.yaml"}, "scenario", "nope.yaml not found"),
    ],
)
def test_bad_sweeps_are_one_input_error_naming_the_sweep_file(tmp_path, sweep, field, message):
    path = write_sweep(tmp_path, {"scenario": "base.yaml", **sweep})
    with pytest.raises(InputError) as e:
        load_sweep(path)
    assert (e.value.source, e.value.field) == (str(path), field)
    assert message in e.value.message


def test_quick_needs_a_quick_block_and_the_base_scenario_is_checked_as_itself(tmp_path):
    path = write_sweep(tmp_path)
    with pytest.raises(InputError, match="quick: --quick needs a quick: block"):
        load_sweep(path, quick=True)
    bad = copy.deepcopy(BASE)
    bad["seed"] = -1
    with pytest.raises(InputError) as e:
        load_sweep(write_sweep(tmp_path, base=bad))
    assert (e.value.source, e.value.field) == (str(tmp_path / "base.yaml"), "seed")


# --- running ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return load_sweep(write_sweep(tmp_path_factory.mktemp("plan")))


@pytest.fixture(scope="module")
def local(plan, tmp_path_factory):
    """The plan, run once on a pool of two processes: (rows, summary, errors)."""
    return fill(plan, tmp_path_factory.mktemp("local"), LocalPool(2))


def test_every_points_rows_are_its_own_run(plan, local):
    rows, summary, errors = local
    assert errors.empty and len(rows) == 2 * len(plan.points)
    for point in plan.points:
        mine = rows[rows.point == point.id].reset_index(drop=True)
        expected = run_scenario(point.scenario, plan.base_dir, plan.scenario_src).summary
        pd.testing.assert_frame_equal(mine[expected.columns], expected)
        assert (mine[plan.params].iloc[0].to_dict(), mine.seed[0]) == (point.params, point.seed)
        assert (mine.requests_total == point.params["workload.num_requests"]).all()


def test_the_summary_is_the_mean_over_seeds_with_a_t_interval(plan, local):
    rows, summary, _ = local
    assert len(summary) == 2 * 4 and (summary.seeds == 2).all()
    keys = [*plan.params, "policy"]
    for _, s in summary.iterrows():
        pair = rows[(rows[keys] == s[keys]).all(axis=1)].throughput_tok_s.to_numpy()
        assert len(pair) == 2
        assert s.throughput_tok_s == pytest.approx(pair.mean(), rel=1e-9)
        # two seeds: sd = |a - b| / sqrt(2), half-width = t(1) sd / sqrt(2) = 12.706 |a - b| / 2
        assert s.throughput_tok_s_ci95 == pytest.approx(12.706 * abs(pair[0] - pair[1]) / 2, rel=1e-9)


def test_a_point_that_raises_is_recorded_and_the_rest_finish(tmp_path):
    # 1e-7 GiB (107 bytes) holds no token slot of Llama-3-8B (128 KiB per token): that
    # point fails when it runs, not when the sweep is read.
    sweep = {"scenario": "base.yaml", "grid": {"kv_cache_memory_gib": [1, 1e-7], "workload.num_requests": [10, 12]}}
    plan = load_sweep(write_sweep(tmp_path, sweep))
    rows, _, errors = fill(plan, tmp_path / "out", LocalPool(2))
    bad = [p.id for p in plan.points if p.params["kv_cache_memory_gib"] == 1e-7]
    assert sorted(errors.point) == sorted(bad) and len(bad) == 2
    assert errors.error.str.contains("holds not even one block").all()
    assert sorted(set(rows.point)) == sorted(p.id for p in plan.points if p.id not in bad)
    # --resume reruns the failed points only
    recorder = Recorder(tmp_path)
    fill(plan, tmp_path / "out", LocalPool(1, fn=recorder), resume=True)
    assert sorted(recorder.calls()) == sorted(bad)


def test_a_killed_worker_loses_no_finished_point_and_its_point_runs_again(plan, local, tmp_path):
    ids = list(dict.fromkeys(p.id for p in plan.points))
    recorder = Recorder(tmp_path, victim=ids[2])
    rows, _, errors = fill(plan, tmp_path / "out", LocalPool(1, fn=recorder))
    # one worker: points 0 and 1 finished before point 2 killed it; only point 2 ran again
    assert recorder.calls() == ids[:3] + ids[2:]
    assert errors.empty
    pd.testing.assert_frame_equal(rows, local[0])


def test_a_point_that_always_kills_its_worker_fails_after_three_attempts(plan, tmp_path):
    ids = list(dict.fromkeys(p.id for p in plan.points))[:3]
    recorder = Recorder(tmp_path, victim=ids[1], always=True)
    store = Store(tmp_path / "out")
    with LocalPool(1, fn=recorder) as pool:
        store.fill(plan, pool)
    assert recorder.calls().count(ids[1]) == 3
    assert "died 3 times" in store.error(ids[1])["error"]
    assert store.finished() == {p.id for p in plan.points} - {ids[1]}


def test_an_interrupted_sweep_keeps_finished_points_and_resume_runs_only_the_rest(plan, local, tmp_path):
    seen = []

    def interrupt_after_three(outcome):
        seen.append(outcome.id)
        if len(seen) == 3:
            raise KeyboardInterrupt

    store = Store(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        with LocalPool(2) as pool:
            store.fill(plan, pool, on_outcome=interrupt_after_three)
    assert store.finished() == set(seen)
    assert sorted(p.name for p in store.points.iterdir()) == sorted(f"{i}.parquet" for i in seen)
    recorder = Recorder(tmp_path)
    rows, _, errors = fill(plan, tmp_path / "out", LocalPool(2, fn=recorder), resume=True)
    assert sorted(recorder.calls()) == sorted({p.id for p in plan.points} - set(seen))
    pd.testing.assert_frame_equal(rows, local[0])


# --- kvsim sweep -----------------------------------------------------------------
def test_kvsim_sweep_writes_rows_summary_and_plots_and_resumes(tmp_path):
    path = write_sweep(tmp_path, {**SWEEP, "seeds": [1], "quick": {"grid": {"workload.num_requests": [8]}}})
    out = tmp_path / "out"
    code, stdout, stderr = kvsim("sweep", path, "--out", out, "--workers", "2")
    assert code == 0, stderr
    assert "4 runs (4 distinct), 4 to run on local pool of 2 workers" in stderr
    assert {p.name for p in out.iterdir()} == {
        "sweep.json",
        "points",
        "results.parquet",
        "summary.csv",
        "sweep_workload_num_requests.png",
        "sweep_policies_allocator_paged_block_size.png",
    }
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns[:4]) == [*SWEEP["grid"], "policy", "seeds"]
    assert not any(c.endswith("_ci95") for c in summary.columns)  # one seed: no interval
    assert len(pd.read_parquet(out / "results.parquet")) == 8
    from kvsim.analysis.unmodelled import sweep_notes
    from kvsim.cli.sweep import sweep_context
    from kvsim.plots.sweep_figures import write_sweep_plots  # drawn in 2 processes above

    (tmp_path / "serial").mkdir()
    plan = load_sweep(path)
    notes = sweep_notes([p.scenario for p in plan.points], plan.base_dir)
    serial = write_sweep_plots(
        summary, list(SWEEP["grid"]), tmp_path / "serial", workers=1, context=sweep_context(plan), notes=notes
    )
    assert len(serial) == 2 and all(p.read_bytes() == (out / p.name).read_bytes() for p in serial)

    code, _, stderr = kvsim("sweep", path, "--out", out)
    assert code == 2 and stderr.count("\n") == 1 and "pass --resume" in stderr
    code, _, stderr = kvsim("sweep", path, "--out", out, "--resume")
    assert code == 0 and "0 to run" in stderr and "4 kept" in stderr
    code, _, stderr = kvsim("sweep", path, "--quick", "--out", tmp_path / "q", "--workers", "1")
    assert code == 0 and "2 runs" in stderr


def test_kvsim_sweep_exits_1_and_lists_failed_points(tmp_path):
    sweep = {"scenario": "base.yaml", "grid": {"kv_cache_memory_gib": [1, 1e-7]}, "set": {"workload.num_requests": 8}}
    code, stdout, stderr = kvsim("sweep", write_sweep(tmp_path, sweep), "--out", tmp_path / "out", "--workers", "1")
    assert code == 1
    assert "point failed (kv_cache_memory_gib=1e-07, seed=1)" in stderr and "1 failed" in stdout
    errors = pd.read_csv(tmp_path / "out" / "errors.csv")
    assert list(errors.columns) == ["kv_cache_memory_gib", "seed", "point", "error"]
    assert math.isclose(errors.kv_cache_memory_gib[0], 1e-7)


def test_kvsim_sweep_bad_input_is_one_line_and_writes_nothing(tmp_path):
    path = write_sweep(tmp_path, {"scenario": "base.yaml", "grid": {"workload.arrival.rate_per_s": [-1]}})
    code, _, stderr = kvsim("sweep", path, "--out", tmp_path / "out")
    assert code == 2 and stderr.startswith(f"kvsim: error: {path}: workload.arrival.rate_per_s:")
    assert stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_without_ray_installed_ray_is_an_input_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    code, _, stderr = kvsim("sweep", write_sweep(tmp_path), "--ray", "local", "--out", tmp_path / "out")
    assert (code, stderr) == (2, "kvsim: error: command line: --ray: Ray is not installed: pip install 'kvsim[ray]'\n")
    assert not (tmp_path / "out").exists()
