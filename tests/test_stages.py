"""Load stages: exact arrival times of each process, stages one after another (open loop
and drained), and the per-stage table's definitions (kvsim.workload.stages,
kvsim.analysis.stages)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvsim.kvcache import PagedAllocator
from kvsim.analysis.metrics import request_table
from kvsim.analysis.stages import stage_rows, weighted_percentiles
from kvsim.config.scenario import Scenario
from kvsim.workload.requests import RequestTable, generate_requests
from kvsim.workload.stages import StagePlan, draw_stage

from helpers import kvsim, one_second_run


class Fixed:
    """An rng whose draws are given: exponential gaps and Poisson counts in turn."""

    def __init__(self, gaps=(), counts=()):
        self.gaps, self.counts = list(gaps), list(counts)

    def exponential(self, scale, n):
        out, self.gaps = self.gaps[:n], self.gaps[n:]
        return np.array(out, dtype=float)

    def poisson(self, lam):
        return self.counts.pop(0)


def test_constant_is_a_fixed_interval():
    assert draw_stage("constant", 4.0, 2.0, None).tolist() == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    assert draw_stage("constant", 0.29, 100, None).size == 28  # int(0.29 * 100), as inference-perf counts


def test_inference_perf_constant_scales_exponential_gaps_to_the_duration():
    # int(1.5 * 2) = 3 gaps of 1, 1, 2 scaled by 2 / 4: the last request at the stage's end
    assert draw_stage("inference-perf-constant", 1.5, 2.0, Fixed(gaps=[1, 1, 2])).tolist() == [0.5, 1.0, 2.0]


def test_inference_perf_poisson_spreads_each_seconds_count_over_it():
    # second 0 draws none; second 1 draws 2 (gaps 1, 3 scaled to 1 s); second 2 draws 1
    rng = Fixed(gaps=[1, 3, 5], counts=[0, 2, 1])
    assert draw_stage("inference-perf-poisson", 1.0, 3.0, rng).tolist() == [1.25, 2.0, 3.0]
    # the stage takes the first int(rate * duration) times, whatever seconds they fall in
    rng = Fixed(gaps=[1, 1, 1, 1], counts=[4])
    assert draw_stage("inference-perf-poisson", 0.5, 6.0, rng).tolist() == [0.25, 0.5, 0.75]


def test_a_stage_plan():
    plan = StagePlan((2.0, 4.0, 1.0), (3.0, 2.0, 5.0), (6, 8, 5), drain=True, pause_s=2.0, poll_s=1.0)
    assert plan.zeros == (0.0, 5.0, 9.0) and plan.firsts == (0, 6, 14)
    assert plan.next_zero(5.0, 8.2) == 5.0 + 4.0 + 2.0  # seen at the poll at 9, then 2 s later
    assert plan.next_zero(5.0, 9.0) == 11.0  # a poll at the very end sees it
    assert plan.next_zero(5.0, -math.inf) == 7.0  # a stage of no requests ends at its zero
    assert plan.truncated(10).counts == (6, 4)


def scenario(arrival: dict, n: int | None = None) -> Scenario:
    wl = {
        "arrival": arrival,
        "prompt_tokens": {"dist": "fixed", "value": 4},
        "output_tokens": {"dist": "fixed", "value": 2},
    }
    if n is not None:
        wl["num_requests"] = n
    return Scenario.model_validate(
        {
            "name": "s",
            "model": "llama-3-8b",
            "gpu": "h100-80gb",
            "max_model_len": 64,
            "workload": wl,
            "policies": [{"name": "p", "allocator": "paged"}],
        }
    )


def test_kvsim_constant_arrivals_and_open_loop_stages():
    table = generate_requests(scenario({"process": "constant", "rate_per_s": 2.0}, 3), None)
    assert table.arrival_s.tolist() == [0.5, 1.0, 1.5]
    staged = scenario(
        {
            "stages": [
                {"rate_per_s": 2, "duration_s": 1.5, "process": "constant"},
                {"rate_per_s": 1, "duration_s": 2, "process": "constant"},
            ],
            "pause_s": 0.5,
        }
    )
    table = generate_requests(staged, None)
    # stage 1 starts at 1.5 + 0.5: its requests one and two seconds after
    assert table.arrival_s.tolist() == [0.5, 1.0, 1.5, 3.0, 4.0]
    assert table.stage.tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "arrival, words",
    [
        ({"stages": []}, "at least 1 item"),
        ({"stages": [{"rate_per_s": 1, "duration_s": 2, "process": "gamma"}]}, "cv goes with process gamma"),
        ({"stages": [{"rate_per_s": 1, "duration_s": 2}], "poll_s": 1}, "poll_s goes with drain"),
        ({"stages": [{"rate_per_s": 1, "duration_s": 2, "process": "burst"}]}, "'poisson', 'constant'"),
        ({"process": "steady", "rate_per_s": 1}, "'poisson', 'gamma', 'burst' or 'constant'"),
    ],
)
def test_bad_stages_are_refused(arrival, words):
    with pytest.raises(Exception, match=words):
        scenario(arrival)


def drained_run(exact: bool):
    """Two stages of 1 and 2 requests, drained, pause 2 s, polled every second: stage 0's
    requests end at 2 and 3 (one-second steps), so stage 1 starts at 3 + 2 = 5."""
    plan = StagePlan((1.0, 1.0), (1.0, 2.0), (1, 2), drain=True, pause_s=2.0, poll_s=1.0)
    # nominal times: stage 0 at 0.5; stage 1 (nominal zero 1 + 2 = 3) at 3.5 and 4.5
    table = RequestTable([0.5, 3.5, 4.5], [4, 4, 4], [2, 2, 2], stage=[0, 1, 1], plan=plan)
    return one_second_run(table, check_invariants=True, exact_steps=exact)


@pytest.mark.parametrize("exact", [True, False])
def test_a_drained_stage_waits_for_the_previous_one(exact):
    run = drained_run(exact)
    table = request_table(run)
    # r0 arrives at 0.5, is prefilled in [0.5, 1.5] and decodes in [1.5, 2.5]: it ends at
    # 2.5, the poll at 3 sees it, and stage 1's zero is 3 + 2 = 5
    assert table.arrival_s.tolist() == [0.5, 5.5, 6.5]
    assert table.finish_s.tolist() == [2.5, 7.5, 8.5]
    assert table.stage.tolist() == [0, 1, 1]


def test_stage_rows_define_latencies_as_inference_perf_does():
    # one request: prompt 4, 3 tokens at 1, 2, 3 s (one-second steps from its arrival at 0)
    table = RequestTable([0.0], [4], [3])
    run = one_second_run(table)
    row = stage_rows(run, request_table(run), [(1.0, 1.0)])[0]
    # the client's lines: each token's event and its blank line, then [DONE] and its blank
    lines = [1, 1, 2, 2, 3, 3, 3, 3]
    gaps = np.diff(lines)
    assert row["ttft_mean_s"] == 1.0 and row["e2e_mean_s"] == 3.0
    assert row["tpot_mean_s"] == (lines[-1] - lines[0]) / (len(lines) - 1) == 2 / 7
    assert row["itl_mean_s"] == pytest.approx(gaps.mean())
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert row[f"itl_{key}_s"] == pytest.approx(np.percentile(gaps, q))
    # throughput over the stage's span, first send to last end
    assert (row["requests"], row["completed"], row["failed"]) == (1, 1, 0)
    assert row["input_tokens_per_s"] == 4 / 3 and row["output_tokens_per_s"] == 1.0


def test_pooled_gaps_match_inference_perf_on_a_busy_run():
    """Several requests overlapping in one-second steps (vLLM V1, no preemption): each
    one's tokens come at the ends of the steps it runs in; kvsim's pooled gaps are the
    client's line gaps, as inference-perf computes them over those times."""
    specs = RequestTable([0.0, 0.3, 1.2, 2.5, 2.6], [4, 9, 4, 30, 4], [5, 3, 6, 2, 1])
    run = one_second_run(specs, max_num_batched_tokens=16)
    table = request_table(run)
    ends = np.array([t + d for t, d, *_ in run.steps])
    all_gaps, tpots = [], []
    for r in table.itertuples():
        tokens = ends[(ends >= r.first_token_s) & (ends <= r.finish_s)]
        assert len(tokens) == r.output_tokens
        lines = np.repeat(np.r_[tokens, tokens[-1]], 2)
        all_gaps += np.diff(lines).tolist()
        tpots.append((lines[-1] - lines[0]) / (len(lines) - 1))
    row = stage_rows(run, table, [(1.0, 5.0)])[0]
    assert row["itl_mean_s"] == pytest.approx(np.mean(all_gaps))
    assert row["tpot_mean_s"] == pytest.approx(np.mean(tpots))
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert row[f"itl_{key}_s"] == pytest.approx(np.percentile(all_gaps, q))
        assert row[f"tpot_{key}_s"] == pytest.approx(np.percentile(tpots, q))


def test_a_preemption_is_one_long_gap():
    # 10 one-token blocks: r1 (3 + 3) is preempted when r0 (4 + 4) grows, then recomputed
    # once r0 is done (the scheduler's own test has this timeline: tests/test_engine.py)
    specs = RequestTable([0.0, 0.0], [4, 3], [4, 3])
    run = one_second_run(specs, PagedAllocator(10, 1), chunked_prefill=False)
    table = request_table(run)
    assert table.preemptions.tolist() == [0, 1]
    stalls = run.records.stalls[1]
    assert len(stalls) == 1
    ((last, resumed),) = stalls
    r1 = table.iloc[1]
    ends = np.array([t + d for t, d, *_ in run.steps])
    tokens = np.r_[ends[(ends >= r1.first_token_s) & (ends <= last)], ends[(ends >= resumed) & (ends <= r1.finish_s)]]
    assert len(tokens) == 3
    r0 = table.iloc[0]
    t0 = ends[(ends >= r0.first_token_s) & (ends <= r0.finish_s)]
    gaps = np.r_[np.diff(np.repeat(np.r_[t0, t0[-1]], 2)), np.diff(np.repeat(np.r_[tokens, tokens[-1]], 2))]
    row = stage_rows(run, table, [(1.0, 1.0)])[0]
    assert row["itl_p90_s"] == pytest.approx(np.percentile(gaps, 90))
    assert row["itl_p99_s"] == pytest.approx(np.percentile(gaps, 99))


def test_weighted_percentiles_are_numpys_on_the_repeated_values():
    rng = np.random.default_rng(3)
    for _ in range(20):
        v = rng.random(7)
        w = rng.integers(0, 4, 7)
        w[0] += 1
        qs = [0, 10, 50, 90, 99, 100]
        assert weighted_percentiles(v, w, qs) == pytest.approx(np.percentile(np.repeat(v, w), qs))


def test_stages_csv_from_the_command(tmp_path):
    import yaml

    scn = {
        "name": "st",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 2048,
        "cost_model": "roofline",
        "workload": {
            "arrival": {
                "stages": [
                    {"rate_per_s": 2, "duration_s": 3, "process": "constant"},
                    {"rate_per_s": 4, "duration_s": 1, "process": "poisson"},
                ],
                "drain": True,
            },
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 20},
        },
        "policies": [{"name": "a", "allocator": "paged"}, {"name": "b", "allocator": "contiguous"}],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scn))
    assert kvsim("run", path, "--out", tmp_path / "out", "--quiet")[0] == 0
    stages = pd.read_csv(tmp_path / "out" / "stages.csv")
    assert stages[["policy", "stage", "rate_per_s", "duration_s", "requests"]].values.tolist() == [
        ["a", 0, 2.0, 3.0, 6],
        ["a", 1, 4.0, 1.0, 4],
        ["b", 0, 2.0, 3.0, 6],
        ["b", 1, 4.0, 1.0, 4],
    ]
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    for col in ("ttft_mean_s", "e2e_mean_s", "e2e_p90_s", "itl_mean_s", "requests_timed_out"):
        assert col in summary
    # a run without stages is one stage at its rate
    scn["workload"] = {
        "num_requests": 5,
        "arrival": {"process": "poisson", "rate_per_s": 3},
        "prompt_tokens": {"dist": "fixed", "value": 100},
        "output_tokens": {"dist": "fixed", "value": 20},
    }
    path.write_text(yaml.safe_dump(scn))
    assert kvsim("run", path, "--out", tmp_path / "one", "--quiet")[0] == 0
    one = pd.read_csv(tmp_path / "one" / "stages.csv")
    assert one[["policy", "stage", "rate_per_s", "requests"]].values.tolist() == [["a", 0, 3.0, 5], ["b", 0, 3.0, 5]]
    code, out, _ = kvsim("compare", tmp_path / "out", tmp_path / "one", "--out", tmp_path / "cmp")
    assert code == 0
    page = (tmp_path / "cmp" / "report.html").read_text().replace("<wbr>", "")
    assert "Per load stage" in page and "out/a: e2e_mean_s" in page and "one/b: itl_mean_s" in page
    # runs of one stage each: the summary says it all
    assert kvsim("compare", tmp_path / "one", "--out", tmp_path / "cmp1")[0] == 0
    assert "Per load stage" not in (tmp_path / "cmp1" / "report.html").read_text()


def test_figures_name_the_stages():
    from kvsim.plots.style import context_line

    scn = {
        "name": "s",
        "model": "m",
        "gpu": "g",
        "workload": {
            "arrival": {"stages": [{"rate_per_s": 8, "duration_s": 600}, {"rate_per_s": 20, "duration_s": 600}]}
        },
    }
    assert "stages 8 req/s x 600 s, 20 req/s x 600 s" in context_line(scn)
