"""Benchmark runs as kvsim reads them, and the engine-overhead fit (kvsim.calibrate).

Run folders are written here by hand (every field the reader takes, every rejection), or
made by kvsim itself: a run simulated with known coefficients and reported the way
inference-perf reports it, from which `fit` must recover the coefficients. The test on
the published vLLM H100 runs skips where ../shared/data is absent.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from kvsim.calibrate import engine_fit, run_check
from kvsim.calibrate.replay import Replay, streamed_events
from kvsim.calibrate.runs import read_run
from kvsim.config.errors import InputError
from helpers import kvsim

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vllm-h100"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data/vllm-h100 not present")
STATS = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99"}
NAMES = {"e2e": "request_latency", "ttft": "time_to_first_token", "itl": "inter_token_latency",
         "tpot": "time_per_output_token"}


def report(stage) -> dict:
    """A PredictedStage as inference-perf's stage report."""
    latency = {NAMES[w]: {theirs: stage.get(w, ours) for ours, theirs in STATS.items()}
               for w in NAMES if stage.get(w) is not None}
    return {"load_summary": {"count": stage.sent},
            "successes": {"count": stage.completed, "latency": latency},
            "failures": {"count": stage.failed}}


def write_run(d: Path, stages, *, model="llama-2-7b", output=24, reports=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "exp-config.yaml").write_text(yaml.safe_dump({"model": model, "tensor_parallelism": 1,
                                                       "max_model_len": 1024, "max_num_batched_tokens": 512,
                                                       "max_num_seqs": 32}))
    (d / "inference-perf-config.yaml").write_text(yaml.safe_dump({
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": 2, "num_prompts_per_group": 5, "system_prompt_len": 32, "question_len": 96,
            "output_len": output}},
        "load": {"type": "constant", "stages": [{"rate": r, "duration": s} for r, s in stages]}}))
    for i, doc in enumerate(reports or [{"load_summary": {"count": 1}, "successes": {"count": 1},
                                         "failures": {"count": 0}}] * len(stages)):
        (d / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps(doc))
    return d


def test_a_run_folder_reads_back(tmp_path):
    run = read_run(write_run(tmp_path / "r", [(2, 30), (4, 30)]))
    assert (run.model, run.tp, run.setting("max_num_seqs"), run.hf_config) == ("llama-2-7b", 1, 32, None)
    assert [(s.rate_per_s, s.duration_s, s.sent) for s in run.stages] == [(2, 30, 1), (4, 30, 1)]


@pytest.mark.parametrize("change, field, words", [
    (lambda d: (d / "exp-config.yaml").write_text("tensor_parallelism: 1\n"), "model", "model name is required"),
    (lambda d: (d / "exp-config.yaml").write_text("model: nobody/none\n"), "model", "no config.json"),
    (lambda d: (d / "exp-config.yaml").write_text("model: llama-2-7b\nmax_num_seqs: 0\n"), "max_num_seqs", ">= 1"),
    (lambda d: (d / "stage_1_lifecycle_metrics.json").unlink(), "load.stages", "2 stages configured, 1"),
    (lambda d: (d / "stage_0_lifecycle_metrics.json").write_text("{}"), "file", "not an inference-perf"),
    (lambda d: (d / "inference-perf-config.yaml").unlink(), "file", "missing"),
])
def test_a_broken_run_folder_is_an_input_error(tmp_path, change, field, words):
    d = write_run(tmp_path / "r", [(2, 30), (4, 30)])
    change(d)
    with pytest.raises(InputError) as info:
        read_run(d)
    assert f": {field}: " in str(info.value) and words in str(info.value)


def test_other_data_types_are_refused(tmp_path):
    d = write_run(tmp_path / "r", [(2, 30)])
    cfg = yaml.safe_load((d / "inference-perf-config.yaml").read_text())
    cfg["data"]["type"] = "random"
    (d / "inference-perf-config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(InputError, match="data.type: 'random'"):
        Replay(read_run(d))


TRUE = {"step_us": 400.0, "per_seq_us": 30.0, "api_ms": 8.0}


@pytest.fixture(scope="module")
def made_runs(tmp_path_factory):
    """Two runs kvsim simulated with TRUE, reported as inference-perf reports them."""
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    # sequences decode about 1 (1 req/s) to 20 at a time (24 req/s): the batch sizes
    # tell the per-step and per-sequence parts apart
    for name, stages in (("slow", [(1, 20), (8, 10)]), ("busy", [(24, 10)])):
        d = write_run(root / name, stages, output=96)
        predicted = Replay(read_run(d)).predict(engine_fit.overhead(TRUE))
        for i, p in enumerate(predicted):
            (d / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps(report(p)))
        dirs.append(d)
    return dirs


def test_fit_recovers_the_coefficients_of_runs_kvsim_made(made_runs):
    replays = [Replay(read_run(d)) for d in made_runs]
    assert [r.events for r in replays] == [1, 1]          # one event per token, as kvsim reports
    objective = engine_fit.Objective(replays)
    result = engine_fit.fit(objective, start={"step_us": 100.0, "per_seq_us": 5.0, "api_ms": 2.0},
                            free=tuple(TRUE))
    got = result["theta"]
    assert got["step_us"] == pytest.approx(TRUE["step_us"], rel=0.1)
    assert got["per_seq_us"] == pytest.approx(TRUE["per_seq_us"], rel=0.15)
    assert got["api_ms"] == pytest.approx(TRUE["api_ms"], rel=0.1)
    assert result["objective"] < 0.05


def test_kvsim_fit_and_validate_on_the_command_line(made_runs, tmp_path):
    out = tmp_path / "mine.json"
    code, _, err = kvsim("fit", *made_runs, "--out", out, "--quiet", "--max-iterations", 2)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["format"] == "kvsim-overhead/3" and doc["name"] == "mine" and len(doc["points"]) == 3
    code, text, err = kvsim("validate", *made_runs, "--cost-model", out, "--out", tmp_path / "v")
    assert code == 0, err
    assert "overhead:mine" in text and "E2E mean: mean absolute error" in text
    table = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert table["summary"]["e2e_mean_mae"] < 0.2
    assert (tmp_path / "v" / "validation.png").stat().st_size > 0


def test_run_check_rows_and_summary():
    class Stage:
        def __init__(self, e2e, ttft, answered):
            self.index, self.rate_per_s, self.sent = 0, 1.0, 10
            self.v, self.answered = {("e2e", "mean"): e2e, ("ttft", "p50"): ttft}, answered

        def get(self, what, stat="mean"):
            return self.v.get((what, stat))

    class Run:
        name, stages = "r", [Stage(2.0, 0.02, 1.0), Stage(4.0, 0.04, 0.5)]
    table = run_check.rows(Run, [Stage(2.2, 0.019, 1.0), Stage(3.6, 0.05, 0.6)], "x")
    assert [r["e2e_mean_error"] for r in table] == [0.1, -0.1]
    assert table[1]["answered_error_points"] == 10.0 and math.isnan(table[0]["itl_mean_error"])
    s = run_check.summary(table)
    assert s["e2e_mean_mae"] == pytest.approx(0.1) and s["ttft_p50_median_error"] == pytest.approx(0.15)
    assert s["answered_worst_points"] == 10.0


@needs_data
def test_a_given_run_held_out_is_predicted_within_the_targets():
    """codellama-34b-tp2-roleplay, simulated whole with the overhead fitted on the other
    runs (the leave-one-out coefficients the shipped file records)."""
    from kvsim.cost.overhead import SHIPPED
    doc = json.loads((SHIPPED / "vllm-v1-h100-v1.json").read_text())
    theta = doc["error"]["leave_one_out_runs"]["codellama-34b-tp2-roleplay"]["theta"]
    run = read_run(DATA / "codellama-34b-tp2-roleplay")
    replay = Replay(run)
    assert replay.events == 2           # the runs stream two events per token
    (stage,) = replay.predict(engine_fit.overhead(theta))
    (measured,) = run.stages
    assert abs(stage.get("e2e") / measured.get("e2e") - 1) < 0.08
    assert abs(stage.get("ttft", "p50") / measured.get("ttft", "p50") - 1) < 0.15
    assert stage.answered == measured.answered == 1.0


@needs_data
def test_streamed_events_per_token_as_the_reports_show():
    run = read_run(DATA / "llama-2-7b-tp1-codegen")
    assert streamed_events(run, 247) == 2
