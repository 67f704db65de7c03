"""inference-perf configs as workloads: every field kvsim reads, every refusal, and the
requests and arrivals they make (kvsim.config.inference_perf, kvsim.workload.inference_perf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from kvsim.config.errors import InputError
from kvsim.config.inference_perf import expand
from kvsim.config.scenario import load_scenario
from kvsim.workload.requests import generate_requests

from helpers import kvsim, one_error_line, with_changes

RUNS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "vllm-h100"

# A config as inference-perf (commit b81afa4) dumps it resolved, every key present.
CONFIG = {
    "api": {"type": "completion", "streaming": True, "headers": {"x-team": "bench"}},
    "data": {
        "type": "shared_prefix",
        "path": None,
        "input_distribution": None,
        "output_distribution": None,
        "shared_prefix": {
            "num_groups": 3,
            "num_prompts_per_group": 2,
            "system_prompt_len": 40,
            "question_len": 24,
            "output_len": 8,
        },
    },
    "load": {
        "type": "constant",
        "interval": 1.5,
        "stages": [{"rate": 2.0, "duration": 3}, {"rate": 4, "duration": 2}],
        "sweep": None,
        "num_workers": 4,
        "worker_max_concurrency": 10,
        "worker_max_tcp_connections": 2500,
        "circuit_breakers": [],
        "request_timeout": 30.0,
    },
    "metrics": None,
    "report": {
        "request_lifecycle": {"summary": True, "per_stage": True, "per_request": False},
        "prometheus": {"summary": True, "per_stage": False},
    },
    "storage": {"local_storage": {"path": "reports", "report_file_prefix": None}},
    "server": {
        "type": "vllm",
        "model_name": "m",
        "base_url": "http://0.0.0.0:8000",
        "ignore_eos": True,
        "api_key": None,
    },
    "tokenizer": {"pretrained_model_name_or_path": "m", "trust_remote_code": None, "token": None},
    "circuit_breakers": None,
}


def changed(**changes) -> dict:
    """CONFIG with changes (helpers.with_changes: a key a__b sets [a][b], None drops it)."""
    return with_changes(CONFIG, **changes)


def test_every_field_kvsim_reads():
    out = expand(CONFIG, "ip.yaml")
    assert out == {
        "inference_perf": {
            "type": "shared_prefix",
            "streaming": True,
            "shared_prefix": {
                "num_groups": 3,
                "num_prompts_per_group": 2,
                "system_prompt_len": 40,
                "question_len": 24,
                "output_len": 8,
            },
        },
        "arrival": {
            "stages": [
                {"rate_per_s": 2.0, "duration_s": 3.0, "process": "inference-perf-constant"},
                {"rate_per_s": 4.0, "duration_s": 2.0, "process": "inference-perf-constant"},
            ],
            "drain": True,
            "poll_s": 1.0,
            "pause_s": 2.5,
        },
        "request_timeout_s": 30.0,
    }


def test_poisson_random_and_defaults():
    cfg = {
        "data": {
            "type": "random",
            "input_distribution": {"min": 5, "max": 50, "mean": 20, "std_dev": 10, "total_count": 100},
            "output_distribution": {"min": 0, "max": 9, "mean": 4, "std_dev": 3},
        },
        "load": {"type": "poisson", "stages": [{"rate": 1.5, "duration": 10}]},
    }
    out = expand(cfg, "ip.yaml")
    assert out["inference_perf"] == {
        "type": "random",
        "streaming": False,  # inference-perf's APIConfig.streaming default
        "input_distribution": {"min": 5, "max": 50, "mean": 20.0, "std_dev": 10.0, "total_count": 100},
        "output_distribution": {"min": 0, "max": 9, "mean": 4.0, "std_dev": 3.0},
    }
    # interval 1.0 by default, no timeout set: aiohttp's default total timeout
    assert out["arrival"] == {
        "stages": [{"rate_per_s": 1.5, "duration_s": 10.0, "process": "inference-perf-poisson"}],
        "drain": True,
        "poll_s": 1.0,
        "pause_s": 2.0,
    }
    assert out["request_timeout_s"] == 300.0
    assert expand(changed(load__request_timeout=0), "ip.yaml")["request_timeout_s"] == 300.0
    assert expand(changed(load__request_timeout=None), "ip.yaml")["request_timeout_s"] == 300.0


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"data__type": "shareGPT"}, "data.type", "'shareGPT' is not supported"),
        ({"data__type": None}, "data.type", "'mock' is not supported"),
        ({"api__type": "chat"}, "api.type", "completion"),
        ({"load__type": "concurrent"}, "load.type", "'concurrent' is not supported"),
        ({"load__sweep": {"type": "linear"}}, "load.sweep", "probing a real server"),
        ({"load__circuit_breakers": ["b"]}, "load.circuit_breakers", "not supported"),
        ({"circuit_breakers": [{"name": "b"}]}, "circuit_breakers", "not supported"),
        ({"load__num_workers": 0}, "load.num_workers", "at least 1"),
        ({"server__ignore_eos": False}, "server.ignore_eos", "must be true"),
        (
            {"data__input_distribution": {"min": 1, "max": 9, "mean": 5, "std_dev": 1}},
            "data",
            "ignores the distributions",
        ),
        ({"data__type": "random"}, "data", "takes no shared_prefix"),
        ({"data__shared_prefix": None}, "data", "needs a shared_prefix block"),
        ({"data__shared_prefix": {"num_groups": 0}}, "data.shared_prefix.num_groups", "greater than or equal to 1"),
        ({"data__shared_prefix": {"system_prompt_len": 0, "question_len": 0}}, "data.shared_prefix", "at least 1"),
        ({"data__shared_prefix": {"num_gruops": 2}}, "data.shared_prefix.num_gruops", "Extra inputs"),
        ({"load__stages": []}, "load.stages", "give a list of stages"),
        ({"load__stages": [{"rate": 2}]}, "load.stages[0]", "{rate"),
        ({"load__stages": [{"rate": -1, "duration": 5}]}, "load.stages[0].rate", "> 0"),
        ({"load__stages": [{"rate": 1, "duration": 2.5}]}, "load.stages[0].duration", "whole number"),
        ({"load__interval": -1}, "load.interval", ">= 0"),
        ({"load__request_timeout": "soon"}, "load.request_timeout", "a number"),
        ({"load__num_worker": 3}, "load.num_worker", "did you mean 'num_workers'"),
        ({"dta": {}}, "dta", "did you mean 'data'"),
        ({"api": "completion"}, "api", "must be a mapping"),
    ],
)
def test_refusals_name_the_field(changes, field, words):
    with pytest.raises(InputError) as e:
        expand(changed(**changes), "ip.yaml")
    assert e.value.source == "ip.yaml" and e.value.field == field, str(e.value)
    assert words in e.value.message, str(e.value)


def test_random_distribution_rules():
    base = {
        "type": "random",
        "input_distribution": {"min": 1, "max": 9, "mean": 5, "std_dev": 1},
        "output_distribution": {"min": 1, "max": 9, "mean": 5, "std_dev": 1},
    }
    for dist, words in [
        ({"min": 0, "max": 9, "mean": 5, "std_dev": 1}, "at least 1"),
        ({"min": 5, "max": 2, "mean": 3, "std_dev": 1}, "min must not exceed max"),
        ({"min": 1, "max": 9, "mean": 20, "std_dev": 1}, "mean must lie within"),
    ]:
        cfg = changed(data={**base, "input_distribution": dist})
        with pytest.raises(InputError, match=words):
            expand(cfg, "ip.yaml")
    with pytest.raises(InputError, match="needs input_distribution"):
        expand(changed(data={"type": "random"}), "ip.yaml")


def scenario_with(tmp_path: Path, cfg: dict, **workload) -> Path:
    (tmp_path / "ip.yaml").write_text(yaml.safe_dump(cfg))
    scn = {
        "name": "ip",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 4096,
        "cost_model": "roofline",
        "workload": {"inference_perf": "ip.yaml", **workload},
        "policies": [{"name": "paged", "allocator": "paged", "block_size": 16, "enable_prefix_caching": True}],
    }
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scn))
    return path


def test_shared_prefix_prompts_recur_in_the_shuffled_order_every_stage(tmp_path):
    scn, base = load_scenario(scenario_with(tmp_path, CONFIG))
    table = generate_requests(scn, base)
    # stage 0 sends int(2 * 3) = 6 requests, stage 1 int(4 * 2) = 8
    assert table.stage.tolist() == [0] * 6 + [1] * 8
    assert (table.prompt_tokens == 64).all() and (table.output_tokens == 8).all()
    segs = [table[i].segments for i in range(len(table))]
    n = len(table)
    # each prompt: its group's system prompt, then its own question; six distinct prompts
    # (3 groups x 2), the n-th request of each stage sending the same one
    assert all(len(s) == 2 and s[0][1] == 40 and s[1][1] == 24 for s in segs)
    assert len(set(segs[:6])) == 6
    assert segs[6:12] == segs[:6] and segs[12:] == segs[:2]
    groups = {s[1][0]: s[0][0] for s in segs}  # question -> its system prompt
    assert sorted(groups.values()) == [n, n, n + 1, n + 1, n + 2, n + 2]
    assert all(q >= n + 3 for q in groups)  # content ids apart from the requests' own
    # output is each request's own: nothing ties two requests' tails together
    assert table.tail_ids is None
    assert scn.workload.request_timeout_s == 30.0


def test_the_scenario_sets_its_own_timeout_and_count(tmp_path):
    scn, base = load_scenario(scenario_with(tmp_path, CONFIG, request_timeout_s=5.0, num_requests=7))
    assert scn.workload.request_timeout_s == 5.0
    table = generate_requests(scn, base)
    assert table.stage.tolist() == [0] * 6 + [1]
    assert table.plan.counts == (6, 1)


def test_random_lengths_repeat_per_stage_and_zero_outputs_become_30(tmp_path):
    cfg = changed(
        data={
            "type": "random",
            "input_distribution": {"min": 3, "max": 12, "mean": 6, "std_dev": 5},
            "output_distribution": {"min": 0, "max": 2, "mean": 0, "std_dev": 2},
        }
    )
    scn, base = load_scenario(scenario_with(tmp_path, cfg))
    table = generate_requests(scn, base)
    p, o = table.prompt_tokens, table.output_tokens
    assert ((p >= 3) & (p <= 12)).all()
    assert set(o.tolist()) <= {1, 2, 30} and 30 in o.tolist()
    assert (p[6:12] == p[:6]).all() and (o[6:12] == o[:6]).all()  # the n-th of each stage
    assert table.segments is None


def test_total_count_below_a_stage_is_refused(tmp_path):
    dist = {"min": 3, "max": 12, "mean": 6, "std_dev": 5, "total_count": 5}
    cfg = changed(data={"type": "random", "input_distribution": dist, "output_distribution": dist})
    scn, base = load_scenario(scenario_with(tmp_path, cfg))
    with pytest.raises(InputError, match="5 lengths for a stage of 8 requests"):
        generate_requests(scn, base)


def test_scenario_keys_the_file_gives_are_refused(tmp_path):
    path = scenario_with(tmp_path, CONFIG, arrival={"process": "poisson", "rate_per_s": 1.0})
    line = one_error_line(*kvsim("run", path, "--out", tmp_path / "out", "--quiet"))
    assert f"{path}: workload.arrival: given by the inference-perf config" in line


def test_a_bad_config_fails_the_run_in_one_line(tmp_path):
    path = scenario_with(tmp_path, changed(load__type="trace_replay"))
    line = one_error_line(*kvsim("run", path, "--out", tmp_path / "out", "--quiet"))
    assert (
        line == f"kvsim: error: {tmp_path / 'ip.yaml'}: load.type: 'trace_replay' is not supported; "
        "kvsim reads constant, poisson"
    )
    missing = scenario_with(tmp_path, CONFIG)
    (tmp_path / "ip.yaml").unlink()
    assert "ip.yaml: file: not found" in one_error_line(*kvsim("run", missing, "--out", tmp_path / "o", "--quiet"))
    assert not (tmp_path / "out").exists()


def test_the_run_writes_what_it_read_and_reruns_it(tmp_path):
    path = scenario_with(tmp_path, CONFIG)
    assert kvsim("run", path, "--out", tmp_path / "a", "--quiet")[0] == 0
    written = yaml.safe_load((tmp_path / "a" / "scenario.yaml").read_text())["workload"]
    assert "load" not in written["inference_perf"] and written["arrival"]["drain"] is True
    assert kvsim("run", tmp_path / "a" / "scenario.yaml", "--out", tmp_path / "b", "--quiet")[0] == 0
    for name in ("summary.csv", "stages.csv"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


@pytest.mark.skipif(not RUNS.is_dir(), reason="the vLLM H100 runs are not here")
def test_the_recorded_runs_configs():
    seen = set()
    for folder in sorted(p for p in RUNS.iterdir() if (p / "inference-perf-config.yaml").is_file()):
        cfg = yaml.safe_load((folder / "inference-perf-config.yaml").read_text())
        out = expand(cfg, str(folder))
        sp = cfg["data"]["shared_prefix"]
        assert out["inference_perf"]["shared_prefix"] == sp
        assert [(s["rate_per_s"], s["duration_s"]) for s in out["arrival"]["stages"]] == [
            (float(s["rate"]), float(s["duration"])) for s in cfg["load"]["stages"]
        ]
        assert out["request_timeout_s"] == 300.0 and out["arrival"]["pause_s"] == 2.0
        seen.add(folder.name)
    assert len(seen) == 10


@pytest.mark.skipif(not RUNS.is_dir(), reason="the vLLM H100 runs are not here")
def test_stage_counts_match_the_runs_reports():
    """Each stage sends int(rate * duration) requests, as the runs' load summaries count."""
    import json

    for folder in sorted(p for p in RUNS.iterdir() if (p / "inference-perf-config.yaml").is_file()):
        cfg = yaml.safe_load((folder / "inference-perf-config.yaml").read_text())
        for k, stage in enumerate(cfg["load"]["stages"]):
            report = json.loads((folder / f"stage_{k}_lifecycle_metrics.json").read_text())
            assert report["load_summary"]["count"] == int(stage["rate"] * stage["duration"])
            assert report["successes"]["count"] + report["failures"]["count"] == report["load_summary"]["count"]
    np.testing.assert_equal(int(0.29 * 100), 28)  # the float rounding kvsim keeps, as inference-perf does


@pytest.mark.skipif(not RUNS.is_dir(), reason="the vLLM H100 runs are not here")
def test_the_runs_stream_two_lines_per_token():
    """kvsim's client-side TPOT and ITL rest on 2N + 2 streamed lines per request: in
    every recorded stage, TPOT = (E2E - TTFT) / (2N + 1) in the mean, and ITL = TPOT."""
    import json

    for folder in sorted(p for p in RUNS.iterdir() if (p / "inference-perf-config.yaml").is_file()):
        n = yaml.safe_load((folder / "inference-perf-config.yaml").read_text())["data"]["shared_prefix"]["output_len"]
        for report in sorted(folder.glob("stage_*_lifecycle_metrics.json")):
            lat = json.loads(report.read_text())["successes"]["latency"]
            tpot = lat["time_per_output_token"]["mean"]
            span = lat["request_latency"]["mean"] - lat["time_to_first_token"]["mean"]
            assert span / (2 * n + 1) == pytest.approx(tpot, rel=2e-3), report
            assert lat["inter_token_latency"]["mean"] == pytest.approx(tpot, rel=1e-4), report


def test_the_inline_block_needs_stages_and_no_other_prompts():
    from kvsim.config.scenario import validate_scenario

    block = {"type": "shared_prefix", "shared_prefix": {"num_groups": 2}}
    base = {
        "name": "s",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 4096,
        "policies": [{"name": "p", "allocator": "paged"}],
    }
    stages = {"stages": [{"rate_per_s": 1, "duration_s": 4, "process": "inference-perf-constant"}]}
    ok = validate_scenario({**base, "workload": {"inference_perf": block, "arrival": stages}}, "s.yaml")
    assert ok.workload.inference_perf.shared_prefix.num_groups == 2
    for workload, words in [
        (
            {"inference_perf": block, "arrival": {"process": "poisson", "rate_per_s": 1}, "num_requests": 3},
            "needs arrival: {stages",
        ),
        ({"inference_perf": block, "arrival": stages, "prefix": {"groups": 2, "tokens": 10}}, "drop prefix"),
        (
            {
                "inference_perf": block,
                "arrival": stages,
                "prompt_tokens": {"dist": "fixed", "value": 3},
                "output_tokens": {"dist": "fixed", "value": 3},
            },
            "exactly one length source",
        ),
        ({"inference_perf": {**block, "shared_prefx": {}}, "arrival": stages}, "did you mean .shared_prefix."),
    ]:
        with pytest.raises(InputError, match=words):
            validate_scenario({**base, "workload": workload}, "s.yaml")
