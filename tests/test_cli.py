"""`kvsim run` end to end: a small scenario, the files it writes, determinism, overrides,
and bad input ending in one line on stderr, exit status 2 and nothing written.

Most runs go through `kvsim.cli.app.main([...])` in-process (it returns the exit status);
two go through the installed executable for real exit codes and stderr.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import kvsim, kvsim_command, one_error_line
from kvsim.config.errors import InputError
from kvsim.config.scenario import load_scenario

OUTPUT_FILES = {
    "summary.csv",
    "summary.json",
    "stages.csv",
    "stages.json",
    "timeseries.parquet",
    "requests.parquet",
    "run.json",
    "scenario.yaml",
    "memory_breakdown.png",
    "utilization_batch.png",
    "latency.png",
    "throughput_batch.png",
    "latency_percentiles.png",
}
SUMMARY_COLUMNS = [
    "policy",
    "requests_total",
    "requests_completed",
    "requests_rejected",
    "token_fraction",
    "reservation_fraction",
    "internal_fraction",
    "external_fraction",
    "free_fraction",
    "kv_utilization",
    "allocation_waste",
    "mean_batch_size",
    "max_batch_size",
    "achievable_batch_size",
    "throughput_tok_s",
    "request_throughput",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "preemptions",
    "prefix_hit_rate",
]
FRACTIONS = ["token_fraction", "reservation_fraction", "internal_fraction", "external_fraction", "free_fraction"]
POLICIES = ["contiguous", "pow2", "paged-16"]

# Llama-3-8B on an H100 with a 2 GiB KV pool (16,384 token slots): 60 requests of ~1,000
# tokens arriving at 20/s keep the pool full, so the policies differ.
SCENARIO = {
    "name": "small",
    "seed": 1,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 4096,
    "kv_cache_memory_gib": 2,
    "cost_model": "roofline",  # the commands' behaviour, not the step costs, is under test
    "workload": {
        "num_requests": 60,
        "arrival": {"process": "poisson", "rate_per_s": 20.0},
        "prompt_tokens": {"dist": "lognormal", "mean": 800, "cv": 0.5, "min": 16, "max": 3000},
        "output_tokens": {"dist": "lognormal", "mean": 200, "cv": 0.5, "min": 4, "max": 1000},
    },
    "policies": [
        {"name": "contiguous", "allocator": "contiguous", "reserve": "max", "placement": "first-fit"},
        {"name": "pow2", "allocator": "contiguous", "reserve": "pow2", "placement": "buddy"},
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
    ],
}


def write_scenario(folder: Path, filename: str = "small.yaml", **overrides) -> Path:
    raw = copy.deepcopy(SCENARIO)
    raw.update(overrides)
    path = folder / filename
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def kvsim_executable(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*kvsim_command(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def hidden_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One default run in a fresh working folder: (working folder, output folder, stdout)."""
    work = tmp_path_factory.mktemp("work")
    write_scenario(work)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        code, out, err = kvsim("run", "small.yaml")
    assert (code, err) == (0, "")
    return work, work / "results" / "small", out


@pytest.fixture
def in_scenario_folder(tmp_path, monkeypatch):
    write_scenario(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- a full run ------------------------------------------------------------------------
def test_run_writes_every_output_into_results_name(full_run):
    work, out, stdout = full_run
    assert set(p.name for p in out.iterdir()) == OUTPUT_FILES
    assert sorted(p.name for p in (work / "results").iterdir()) == ["small"]  # no leftover temp folders
    for png in ("memory_breakdown.png", "utilization_batch.png", "latency.png", "throughput_batch.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert stdout.splitlines()[-1] == "wrote results/small/"
    for name in POLICIES:
        assert any(line.startswith(name) for line in stdout.splitlines())


def test_summary_rows_and_columns(full_run):
    summary = pd.read_csv(full_run[1] / "summary.csv")
    assert list(summary.policy) == POLICIES
    missing = [c for c in SUMMARY_COLUMNS if c not in summary.columns]
    assert missing == []
    assert summary.requests_total.tolist() == [60, 60, 60]
    assert summary.kv_utilization.tolist() == summary.token_fraction.tolist()
    # summary.json holds the same values as summary.csv (NaN written as null)
    rows = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in summary.to_dict(orient="records")
    ]
    assert json.loads((full_run[1] / "summary.json").read_text()) == rows


def test_fractions_sum_to_one(full_run):
    summary = pd.read_csv(full_run[1] / "summary.csv")
    for _, row in summary.iterrows():
        assert sum(row[f] for f in FRACTIONS) == pytest.approx(1.0, abs=1e-9)
        assert all(0 <= row[f] <= 1 for f in FRACTIONS)


def test_paged_wastes_less_than_contiguous(full_run):
    summary = pd.read_csv(full_run[1] / "summary.csv").set_index("policy")
    assert summary.loc["paged-16", "kv_utilization"] > summary.loc["contiguous", "kv_utilization"]
    assert summary.loc["paged-16", "internal_fraction"] < summary.loc["contiguous", "internal_fraction"]
    assert summary.loc["paged-16", "achievable_batch_size"] > summary.loc["contiguous", "achievable_batch_size"]


def test_completed_plus_rejected_is_total(full_run):
    summary = pd.read_csv(full_run[1] / "summary.csv")
    assert (summary.requests_completed + summary.requests_rejected == summary.requests_total).all()
    assert summary.requests_unfinished.tolist() == [0, 0, 0]  # no time limit: everything ends
    requests = pd.read_parquet(full_run[1] / "requests.parquet")
    assert requests.groupby("policy", sort=False).size().to_dict() == dict.fromkeys(POLICIES, 60)
    timeseries = pd.read_parquet(full_run[1] / "timeseries.parquet")
    assert list(timeseries.policy.unique()) == POLICIES


def test_run_json_and_scenario_copy(full_run):
    work, out, _ = full_run
    meta = json.loads((out / "run.json").read_text())
    assert (meta["seed"], meta["policies"], meta["scenario"]) == (1, POLICIES, "small.yaml")
    assert meta["kv_pool"]["kv_pool_bytes_total"] == meta["kv_pool"]["kv_pool_bytes_per_gpu"] == 2 * 2**30
    assert load_scenario(out / "scenario.yaml")[0] == load_scenario(work / "small.yaml")[0]


def test_trace_run_rejects_what_exceeds_max_model_len(tmp_path, monkeypatch):
    # tests/data/tiny_trace.csv has 10 requests; 2048 + 17 and 4000 + 120 exceed max_model_len 2048
    shutil.copy(Path(__file__).parent / "data" / "tiny_trace.csv", tmp_path / "trace.csv")
    workload = {"trace": "trace.csv"}
    write_scenario(tmp_path, max_model_len=2048, workload=workload)
    monkeypatch.chdir(tmp_path)
    code, _, err = kvsim("run", "small.yaml", "--quiet")
    assert (code, err) == (0, "")
    summary = pd.read_csv(tmp_path / "results" / "small" / "summary.csv")
    assert summary[["requests_total", "requests_completed", "requests_rejected"]].values.tolist() == [[10, 8, 2]] * 3


# --- determinism and overrides ---------------------------------------------------------
def test_same_seed_is_byte_identical_and_seed_changes_it(full_run, in_scenario_folder):
    ref = full_run[1]
    assert kvsim("run", "small.yaml", "--out", "again", "--quiet")[0] == 0
    for name in ("summary.csv", "summary.json"):
        assert (in_scenario_folder / "again" / name).read_bytes() == (ref / name).read_bytes()
    assert kvsim("run", "small.yaml", "--out", "seed2", "--seed", "2", "--quiet")[0] == 0
    for name in ("summary.csv", "summary.json"):
        assert (in_scenario_folder / "seed2" / name).read_bytes() != (ref / name).read_bytes()
    assert json.loads((in_scenario_folder / "seed2" / "run.json").read_text())["seed"] == 2


def test_policy_option_runs_one_policy_with_the_same_row(full_run, in_scenario_folder):
    code, _, _ = kvsim("run", "small.yaml", "--policy", "paged-16", "--out", "one", "--quiet")
    assert code == 0
    one = (in_scenario_folder / "one" / "summary.csv").read_text().splitlines()
    full = (full_run[1] / "summary.csv").read_text().splitlines()
    assert one[0] == full[0]  # same header
    assert one[1:] == [line for line in full[1:] if line.startswith("paged-16,")]


def test_repeated_policy_options_keep_their_order(in_scenario_folder):
    code, _, _ = kvsim(
        "run",
        "small.yaml",
        "--policy",
        "paged-16",
        "--policy",
        "contiguous",
        "--policy",
        "paged-16",
        "--out",
        "two",
        "--quiet",
    )
    assert code == 0
    assert pd.read_csv(in_scenario_folder / "two" / "summary.csv").policy.tolist() == ["paged-16", "contiguous"]


def test_num_requests_override(in_scenario_folder):
    code, _, _ = kvsim("run", "small.yaml", "--num-requests", "7", "--out", "seven", "--quiet")
    assert code == 0
    summary = pd.read_csv(in_scenario_folder / "seven" / "summary.csv")
    assert summary.requests_total.tolist() == [7, 7, 7]
    assert len(pd.read_parquet(in_scenario_folder / "seven" / "requests.parquet")) == 21


def test_no_plots_writes_the_same_tables_and_no_figure(full_run, in_scenario_folder):
    assert kvsim("run", "small.yaml", "--out", "tables", "--quiet", "--no-plots") == (0, "", "")
    out = in_scenario_folder / "tables"
    assert {p.name for p in out.iterdir()} == {n for n in OUTPUT_FILES if not n.endswith(".png")}
    for name in ("summary.csv", "summary.json", "stages.csv", "timeseries.parquet", "requests.parquet"):
        assert (out / name).read_bytes() == (full_run[1] / name).read_bytes()


def test_no_plots_never_imports_matplotlib(in_scenario_folder):
    """A run without figures prints its table and notes without loading the plotting stack."""
    script = (
        "import sys\nfrom kvsim.cli.app import main\n"
        "code = main(['run', 'small.yaml', '--out', 'tables', '--no-plots'])\n"
        "print(code, 'matplotlib' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "verdict:" in done.stdout  # the table and its notes were printed
    assert done.stdout.splitlines()[-1] == "0 False"


def test_no_plots_is_refused_with_rates(in_scenario_folder):
    line = one_error_line(*kvsim("run", "small.yaml", "--no-plots", "--rates", "1,2"))
    assert line == "kvsim: error: command line: --no-plots: not with --rates (a rate sweep's folder is its figures)"
    assert not (in_scenario_folder / "results").exists()


def test_quiet_prints_nothing(in_scenario_folder):
    assert kvsim("run", "small.yaml", "--quiet", "--num-requests", "5") == (0, "", "")
    assert (in_scenario_folder / "results" / "small" / "summary.csv").is_file()


# --- bad input: one line, exit 2, nothing written --------------------------------------
def test_unknown_policy(in_scenario_folder):
    line = one_error_line(*kvsim("run", "small.yaml", "--policy", "paged16"))
    assert line == (
        "kvsim: error: small.yaml: --policy: no policy 'paged16'; the scenario has: contiguous, pow2, paged-16"
    )
    assert not (in_scenario_folder / "results").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--seed", "-1"], "--seed"),
        (["--num-requests", "0"], "--num-requests"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_run_flags(in_scenario_folder, args, needle):
    line = one_error_line(*kvsim("run", "small.yaml", *args))
    assert needle in line
    assert not (in_scenario_folder / "results").exists()


def test_invalid_scenario_through_the_executable(tmp_path):
    write_scenario(tmp_path, policies=[{"name": "p", "allocator": "paged", "blok_size": 8}])
    proc = kvsim_executable("run", "small.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "kvsim: error: small.yaml: policies[0].blok_size: unknown key 'blok_size' (did you mean "
        "'block_size'?); choose from: allocator, block_size, enable_prefix_caching, kv_cache_dtype, "
        "kv_offload, kv_scale, kv_scale_group_size, name, prefix_cache"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.yaml"]  # no results/ folder


@pytest.mark.parametrize(
    "content", [b"name: [unclosed\n", b"", b"\xff\xfe\x00garbage"], ids=["yaml", "empty", "binary"]
)
def test_unreadable_scenarios_write_nothing(tmp_path, monkeypatch, content):
    (tmp_path / "bad.yaml").write_bytes(content)
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*kvsim("run", "bad.yaml"))
    assert line.startswith("kvsim: error: bad.yaml: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_missing_scenario_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*kvsim("run", "nope.yaml"))
    assert line == "kvsim: error: nope.yaml: file: not found"
    assert list(tmp_path.iterdir()) == []


def test_failing_run_leaves_an_existing_output_untouched(in_scenario_folder):
    assert kvsim("run", "small.yaml", "--out", "out", "--quiet")[0] == 0
    before = snapshot(in_scenario_folder / "out")
    # Llama-3-70B's 141 GB of weights leave an A100-40GB no KV pool: refused at load,
    # naming what would help and what cannot: at tp 4 each GPU's 32.9 GiB of weights and
    # about 4.6 GiB of activations, NCCL buffers and CUDA graphs exceed 90% of 40 GiB; tp 8 fits
    write_scenario(in_scenario_folder, "broken.yaml", model="llama-3-70b", gpu="a100-40gb", kv_cache_memory_gib=None)
    line = one_error_line(*kvsim("run", "broken.yaml", "--out", "out"))
    assert line.startswith("kvsim: error: broken.yaml: tensor_parallel_size: no memory left for the KV cache")
    assert "raising gpu_memory_utilization cannot help" in line and "tensor_parallel_size 8" in line
    # valid file, failing run: 80% of an A100-80GB (64 GiB) leaves no room beside Llama-3-70B's
    # 65.7 GiB of weights per GPU at tp 2, though all of it would
    write_scenario(
        in_scenario_folder,
        "broken.yaml",
        model="llama-3-70b",
        gpu="a100-80gb",
        kv_cache_memory_gib=None,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.8,
    )
    line = one_error_line(*kvsim("run", "broken.yaml", "--out", "out"))
    assert line.startswith("kvsim: error: broken.yaml: gpu_memory_utilization: no memory left for the KV cache")
    line = one_error_line(*kvsim("run", "small.yaml", "--out", "out", "--policy", "nope"))
    assert snapshot(in_scenario_folder / "out") == before
    assert hidden_entries(in_scenario_folder) == []


def test_crash_while_writing_leaves_an_existing_output_untouched(in_scenario_folder, monkeypatch):
    assert kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")[0] == 0
    results = in_scenario_folder / "results"
    before = snapshot(results / "small")

    def broken_plots(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("kvsim.plots.run_figures.plot_jobs", broken_plots)
    with pytest.raises(RuntimeError, match="disk full"):
        kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")
    assert snapshot(results / "small") == before
    assert hidden_entries(results) == []


@pytest.mark.parametrize("where", ["kvsim.sim.runner.simulate", "kvsim.plots.run_figures.plot_jobs"])
def test_ctrl_c_leaves_an_existing_output_untouched(in_scenario_folder, monkeypatch, where):
    # Ctrl-C during the simulation or while results are written: exit 130, one line,
    # the earlier results as they were and no temporary folder left behind.
    assert kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")[0] == 0
    results = in_scenario_folder / "results"
    before = snapshot(results / "small")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(where, interrupted)
    code, out, err = kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")
    assert code == 130 and err.strip().splitlines() == ["kvsim: interrupted; earlier results left as they were"]
    assert snapshot(results / "small") == before
    assert hidden_entries(results) == []


def test_rerun_replaces_its_own_earlier_results(in_scenario_folder):
    assert kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")[0] == 0
    out = in_scenario_folder / "results" / "small"
    (out / "stale.txt").write_text("from an older run")
    assert kvsim("run", "small.yaml", "--quiet", "--num-requests", "5")[0] == 0
    assert set(p.name for p in out.iterdir()) == OUTPUT_FILES
    assert hidden_entries(out.parent) == []


def test_a_foreign_output_folder_is_refused_unless_forced(in_scenario_folder):
    out = in_scenario_folder / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not kvsim's")
    line = one_error_line(*kvsim("run", "small.yaml", "--out", "mine"))
    assert line == (
        "kvsim: error: command line: --out: mine holds files that are not kvsim results; pass --force to replace it"
    )
    assert snapshot(out) == {"notes.txt": b"not kvsim's"}
    assert kvsim("run", "small.yaml", "--out", "mine", "--force", "--quiet", "--num-requests", "5")[0] == 0
    assert set(p.name for p in out.iterdir()) == OUTPUT_FILES


def test_time_limit_leaves_requests_unfinished(in_scenario_folder):
    write_scenario(in_scenario_folder, time_limit_s=1.0)
    assert kvsim("run", "small.yaml", "--quiet")[0] == 0
    summary = pd.read_csv(in_scenario_folder / "results" / "small" / "summary.csv")
    assert (summary.requests_unfinished > 0).all()
    assert (
        summary.requests_completed + summary.requests_rejected + summary.requests_unfinished == summary.requests_total
    ).all()


def test_timeseries_bucket_from_the_scenario_and_the_flag(full_run, in_scenario_folder):
    """The scenario's timeseries_bucket_s writes the series in buckets, as the flag does;
    the flag wins over it, and 0 writes every step."""
    assert kvsim("run", "small.yaml", "--quiet", "--no-plots", "--timeseries-bucket", "0.5", "--out", "flag")[0] == 0
    write_scenario(in_scenario_folder, timeseries_bucket_s=0.5)
    assert kvsim("run", "small.yaml", "--quiet", "--no-plots", "--out", "field")[0] == 0
    assert kvsim("run", "small.yaml", "--quiet", "--no-plots", "--timeseries-bucket", "0", "--out", "steps")[0] == 0
    series = {name: in_scenario_folder / name / "timeseries.parquet" for name in ("flag", "field", "steps")}
    every_step = full_run[1] / "timeseries.parquet"
    field = pd.read_parquet(series["field"])
    assert "bucket" in field.columns and field.steps.sum() == len(pd.read_parquet(every_step))
    assert series["field"].read_bytes() == series["flag"].read_bytes()
    assert series["steps"].read_bytes() == every_step.read_bytes()


def test_bad_timeseries_bucket_is_refused(in_scenario_folder):
    write_scenario(in_scenario_folder, timeseries_bucket_s=0)
    line = one_error_line(*kvsim("run", "small.yaml"))
    assert "small.yaml" in line and "timeseries_bucket_s" in line
    assert not (in_scenario_folder / "results").exists()


def test_default_output_never_lands_on_the_results_folder_itself(tmp_path, monkeypatch):
    other = tmp_path / "results" / "other"
    other.mkdir(parents=True)
    (other / "keep.txt").write_text("keep")
    write_scenario(tmp_path, name=".")  # results/. is results/
    monkeypatch.chdir(tmp_path)
    one_error_line(*kvsim("run", "small.yaml", "--quiet", "--num-requests", "3"))
    assert (other / "keep.txt").read_text() == "keep"


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_refused_at_load(tmp_path, name):
    path = write_scenario(tmp_path, name=name)
    with pytest.raises(InputError, match=": name: "):
        load_scenario(path)


# --- the executable, end to end --------------------------------------------------------
def test_executable_end_to_end(tmp_path, full_run):
    write_scenario(tmp_path)
    proc = kvsim_executable("run", "small.yaml", "--quiet", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    out = tmp_path / "results" / "small"
    assert set(p.name for p in out.iterdir()) == OUTPUT_FILES
    assert (out / "summary.csv").read_bytes() == (full_run[1] / "summary.csv").read_bytes()
    assert hidden_entries(tmp_path / "results") == []
