"""`kvsim cost`, `kvsim calibrate --report` and `kvsim run --profile` end to end."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import yaml

from helpers import kvsim, one_error_line
from kvsim.cost.profiles import SHIPPED


def test_cost_json_has_step_time_and_parts_that_sum_to_it():
    code, out, err = kvsim(
        "cost", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--decode-batch", "64", "--context", "1024", "--json"
    )
    assert (code, err) == (0, "")
    res = json.loads(out)
    # the shipped overhead was measured at tp 2-8: a tp-1 step is priced beyond it, and says so
    assert res["cost_model"] == (
        "profile:a100-llama-3-8b + overhead:splitwise-a100-v2 [extrapolated in 1/1 "
        "steps: engine overhead at tp 1 (measured 2-8)]"
    )
    assert res["extrapolated"] == ["engine overhead at tp 1 (measured 2-8)"]
    assert res["step_time_s"] == pytest.approx(sum(res["parts_s"].values()))
    assert res["step_time_s"] == pytest.approx(sum(res["groups_s"].values()))
    assert res["roofline_s"] < res["step_time_s"] < 0.1  # tens of ms, not the roofline's few


def test_cost_text_shows_each_part():
    code, out, _ = kvsim(
        "cost", "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "2", "--prefill-tokens", "2048"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("llama-2-70b on h100-80gb x2 under vllm-v1: prefill 2,048 tokens")
    assert lines[1] == "cost model: profile:h100-llama-2-70b + overhead:vllm-v1-h100-v1"
    assert lines[2].startswith("step time:")
    assert [ln.split()[0] for ln in lines[3:]] == [
        "linear",
        "attention_prefill",
        "attention_decode",
        "kv_write",
        "allreduce",
        "embedding",
        "lm_head",
        "overhead_step",
        "overhead_seqs",
        "overhead_prompt_tokens",
        "overhead_launch",
        "of",
    ]
    assert lines[-1].startswith("of which kernels ") and "engine overhead" in lines[-1]


def test_cost_prices_the_step_of_the_engine_named():
    """Each engine's default overhead; a CUDA-graph engine's capture sizes follow its limits."""

    def priced(*args):
        code, out, err = kvsim(
            "cost",
            "--model",
            "llama-2-7b",
            "--gpu",
            "h100-80gb",
            "--decode-batch",
            "13",
            "--context",
            "100",
            "--json",
            *args,
        )
        assert code == 0, err
        return json.loads(out)

    v1, v0 = priced(), priced("--engine", "vllm-v0")
    assert (v1["engine"], v1["cost_model"]) == ("vllm-v1", "profile:h100-llama-2-7b + overhead:vllm-v1-h100-v1")
    assert v0["cost_model"].startswith("profile:h100-llama-2-7b + overhead:splitwise-a100-v2")
    assert v0["step_time_s"] > 3 * v1["step_time_s"]  # a 2023 stack without CUDA graphs
    # 13 sequences replay the graph of 16 (linear ops on 16 tokens) unless max_num_seqs 4
    # caps the captured sizes at 8: the step then runs eagerly on its own 13 tokens
    eager = priced("--max-num-seqs", "4")
    assert eager["parts_s"]["linear"] < v1["parts_s"]["linear"]
    assert priced("--max-num-seqs", "8")["parts_s"] == v1["parts_s"]


def test_cost_roofline_is_a_bound_without_parts():
    code, out, _ = kvsim(
        "cost", "--model", "llama-3-8b", "--gpu", "h200", "--prefill-tokens", "512", "--json", "--roofline"
    )
    res = json.loads(out)
    assert res["cost_model"] == "roofline" and res["groups_s"] is None
    assert res["step_time_s"] == pytest.approx(res["roofline_s"])


@pytest.mark.parametrize(
    "args, field",
    [
        ([], "--prefill-tokens"),
        (["--prefill-tokens", "8", "--decode-batch", "2", "--context", "5"], "--prefill-tokens"),
        (["--decode-batch", "4"], "--context"),
        (["--prefill-tokens", "8", "--gpu", "a10"], "--gpu"),
        (["--prefill-tokens", "8", "--profile", "a100-llama-2-7b"], "--profile"),
        (["--prefill-tokens", "8", "--profile", "no/such/dir"], "--profile"),
        (["--prefill-tokens", "0"], "--prefill-tokens"),
        (["--prefill-tokens", "8", "--overhead", "splitwise-h100"], "--overhead"),
    ],
)
def test_cost_bad_input_is_one_line_and_exit_2(args, field):
    base = {"--model": "llama-3-8b", "--gpu": "a100-80gb"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    code, out, err = kvsim("cost", *[x for kv in base.items() for x in kv])
    assert field in one_error_line(code, out, err)


def test_calibrate_report_prints_held_out_mape():
    code, out, err = kvsim("calibrate", "--report", "a100-llama-3-8b", "--json")
    assert (code, err) == (0, "")
    res = json.loads(out)
    assert set(res["mape"]) >= {"mlp_up_proj", "attn_decode", "attn_prefill_whole_prompt"}
    assert 0 < res["overall_mape"] < 0.1
    assert res["source_data"]["gpu_shape_model_leave_one_shape_out"]
    code, out, _ = kvsim("calibrate", "--report", "h100-llama-3-8b")
    assert code == 0 and "no measured points" in out


def test_calibrate_needs_model_and_out():
    code, out, err = kvsim("calibrate", "--device", "cpu")
    assert "--model" in one_error_line(code, out, err)


SCENARIO = {
    "name": "tiny",
    "seed": 0,
    "model": "llama-3-8b",
    "gpu": "a100-80gb",
    "max_model_len": 2048,
    "kv_cache_memory_gib": 1,
    "cost_model": "calibrated",
    "workload": {
        "num_requests": 12,
        "arrival": {"process": "poisson", "rate_per_s": 10.0},
        "prompt_tokens": {"dist": "uniform", "min": 100, "max": 1500},
        "output_tokens": {"dist": "uniform", "min": 4, "max": 40},
    },
    "policies": [
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
        {"name": "paged-16-fp8", "allocator": "paged", "block_size": 16, "kv_cache_dtype": "fp8"},
    ],
}


TP1_LABEL = re.compile(
    r"profile:a100-llama-3-8b \+ overhead:splitwise-a100-v2 \[extrapolated in (\d+)/\1 "
    r"steps: engine overhead at tp 1 \(measured 2-8\)\]"
)  # every step: tp 1


def run_summary(tmp_path, scenario: dict, *extra) -> pd.DataFrame:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario))
    code, _, err = kvsim("run", path, "--out", tmp_path / "out", "--quiet", *extra)
    assert (code, err) == (0, "")
    return pd.read_csv(tmp_path / "out" / "summary.csv")


def test_run_with_calibrated_costs_names_the_profile(tmp_path):
    summary = run_summary(tmp_path, SCENARIO)
    assert all(TP1_LABEL.fullmatch(label) for label in summary.cost_model)
    roof = run_summary(tmp_path / "r", {**SCENARIO, "cost_model": "roofline"})
    assert (summary.makespan_s > roof.makespan_s).all()  # measured kernels are slower than peaks


def test_run_profile_option_overrides_the_scenario(tmp_path):
    summary = run_summary(tmp_path, {**SCENARIO, "cost_model": "roofline"}, "--profile", SHIPPED / "a100-llama-3-8b")
    assert all(TP1_LABEL.fullmatch(label) for label in summary.cost_model)
    written = yaml.safe_load((tmp_path / "out" / "scenario.yaml").read_text())
    assert written["cost_model"]["profile"].endswith("a100-llama-3-8b")


def test_run_bad_profile_is_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, "cost_model": {"profile": "missing-profile"}}))
    code, out, err = kvsim("run", path, "--out", tmp_path / "out", "--quiet")
    assert "cost_model.profile: no profile 'missing-profile'" in one_error_line(code, out, err)
    assert not (tmp_path / "out").exists()
    code, out, err = kvsim("run", path, "--out", tmp_path / "out", "--profile", "h100-llama-2-7b")
    assert "--profile" in one_error_line(code, out, err)


def test_a_broken_profile_is_an_error_not_a_silent_fallback(tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(SHIPPED / "a100-llama-3-8b", broken)
    meta = json.loads((broken / "meta.json").read_text())
    del meta["allreduce"]["latency_s"]
    (broken / "meta.json").write_text(json.dumps(meta))
    code, out, err = kvsim(
        "cost",
        "--model",
        "llama-3-8b",
        "--gpu",
        "a100-80gb",
        "--tp",
        "2",
        "--prefill-tokens",
        "100",
        "--profile",
        broken,
    )
    assert one_error_line(code, out, err) == (
        f"kvsim: error: {broken}: meta.json: has no 'latency_s': "
        "not a complete kvsim profile (see kvsim/cost/profiles.py)"
    )
