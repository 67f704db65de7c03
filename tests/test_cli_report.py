"""`kvsim compare`, `kvsim reproduce`, `kvsim run --rates`, the terminal table, the
progress bar, and what bare `kvsim` and `--help` print."""

from __future__ import annotations

import io
import re
import sys

import pandas as pd
import pytest

from helpers import kvsim, one_error_line
from test_cli import write_scenario


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """`kvsim run --rates` on a small scenario: 30 requests at 5 and 40 req/s."""
    work = tmp_path_factory.mktemp("sweep")
    write_scenario(
        work,
        workload={
            "num_requests": 30,
            "arrival": {"process": "poisson", "rate_per_s": 5.0},
            "prompt_tokens": {"dist": "fixed", "value": 800},
            "output_tokens": {"dist": "fixed", "value": 100},
        },
        slo={"ttft_p99_s": 1.0},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        code, out, err = kvsim("run", "small.yaml", "--rates", "5,40", "--out", "sw")
    assert (code, err) == (0, "")
    return work, out


def test_rates_write_a_run_per_rate_and_the_sweep(sweep):
    work, out = sweep
    assert sorted(p.name for p in (work / "sw").iterdir()) == [
        "rate-40",
        "rate-5",
        "rate_sweep.png",
        "rates.csv",
        "scenario.yaml",
    ]
    table = pd.read_csv(work / "sw" / "rates.csv")
    assert sorted(set(table.rate_per_s)) == [5.0, 40.0] and len(table) == 6
    assert "--- 5 req/s" in out and "sustains" in out
    assert "rate_per_s: 40.0" in (work / "sw" / "rate-40" / "scenario.yaml").read_text()


def test_compare_a_sweep_writes_a_self_contained_report(sweep, monkeypatch):
    work, _ = sweep
    monkeypatch.chdir(work)
    code, out, err = kvsim("compare", "sw", "--out", "cmp")
    assert (code, err) == (0, "") and out.endswith("\ncompared 2 run(s): wrote cmp/report.html\n")
    assert out.startswith("verdict: Pick pow2") and "- Rate sweep: " in out
    page = (work / "cmp" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6  # five figures and the sweep
    assert not re.search(r'src="(?!data:)', page)  # nothing loaded from beside it
    verdict = page[page.index("<h2>Verdict</h2>") : page.index("<h2>Memory")]
    assert "Pick " in verdict and "Rate sweep: " in verdict
    for name in ("contiguous", "pow2", "paged-16"):
        assert f"<li>{name} at " in verdict and "latency target" in verdict
    assert "Scenario as run" in page and "kvsim_version" in page


def test_compare_two_runs_side_by_side_renames_clashing_policies(sweep, monkeypatch):
    work, _ = sweep
    monkeypatch.chdir(work)
    code, _, err = kvsim("compare", "sw/rate-5", "sw/rate-40", "--out", "both")
    assert (code, err) == (0, "")  # two runs at different rates of one scenario: a sweep again
    code, _, err = kvsim("compare", "sw/rate-5", "--out", "one")
    assert code == 0 and "rate_sweep" not in (work / "one" / "report.html").read_text()


def test_each_run_s_context_line_names_its_own_step_costs(sweep, monkeypatch):
    """Two runs with different step costs: each line says what its own policies used (all
    one model), not that step costs differ."""
    work, _ = sweep
    monkeypatch.chdir(work)
    write_scenario(work, "measured.yaml", name="measured", cost_model="calibrated")
    assert kvsim("run", "measured.yaml", "--out", "measured", "--quiet")[0] == 0
    code, _, err = kvsim("compare", "sw/rate-5", "measured", "--out", "mixed")
    assert (code, err) == (0, "")
    lines = re.findall(r'<p class="context">([^<]*)</p>', (work / "mixed" / "report.html").read_text())
    assert len(lines) == 2 and not any("differ" in line for line in lines), lines
    assert lines[0].startswith("small ") and lines[0].endswith("step costs roofline")
    assert lines[1].startswith("measured ") and "step costs profile:" in lines[1]


def test_compare_judges_each_scenario_s_policies_by_its_own_targets(sweep, monkeypatch):
    """Two scenarios with different slo: blocks: each policy's sentence and the pick use
    its own run's targets, and the latency figures draw both runs' targets, each named."""
    from kvsim.plots.compare import build_report, load_run
    from kvsim.plots.run_figures import latency_percentiles, target_lines

    work, _ = sweep
    monkeypatch.chdir(work)
    write_scenario(work, "strict.yaml", name="strict", slo={"tpot_p50_s": 0.5, "ttft_p99_s": 0.25})
    assert kvsim("run", "strict.yaml", "--out", "strict", "--quiet")[0] == 0
    code, out, err = kvsim("compare", "sw/rate-5", "strict", "--out", "two")
    assert (code, err) == (0, "") and out.startswith("verdict: Pick ")
    (work / "two-again").mkdir()
    verdict = build_report([load_run(work / "sw" / "rate-5"), load_run(work / "strict")], work / "two-again")
    loose = [line for line in verdict if line.startswith("rate-5/")]
    strict = [line for line in verdict if line.startswith("strict/")]
    assert len(loose) == len(strict) == 3
    for line in loose:  # 5 req/s and ttft_p99_s <= 1
        assert " at 5 req/s " in line and ("(ttft p99 ≤ 1 s)" in line or "> 1;" in line + ";"), line
        assert "0.25" not in line and "tpot p50 ≤" not in line, line
    for line in strict:  # tpot_p50_s <= 0.5, ttft_p99_s <= 0.25
        assert "(tpot p50 ≤ 0.5 s, ttft p99 ≤ 0.25 s)" in line or "> 0.25" in line or "> 0.5" in line, line
        assert "≤ 1 s" not in line and "> 1;" not in line + ";", line
    figure_targets = {"small": {"ttft_p99_s": 1.0}, "strict": {"tpot_p50_s": 0.5, "ttft_p99_s": 0.25}}
    assert target_lines(figure_targets, "ttft") == [("p99", 1.0, " (small)"), ("p99", 0.25, " (strict)")]
    assert target_lines({"ttft_p99_s": 2}, "ttft") == [("p99", 2.0, "")]
    summary = pd.read_csv(work / "strict" / "summary.csv")
    fig = latency_percentiles(summary, dict.fromkeys(summary.policy, "C0"), figure_targets)
    legend = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert {"target p99 ≤ 1 s (small)", "target p99 ≤ 0.25 s (strict)", "target p50 ≤ 0.5 s (strict)"} <= set(legend)


def test_the_pick_weighs_each_policy_against_its_own_targets():
    from kvsim.analysis.verdict import pick

    summary = pd.DataFrame(
        {
            "policy": ["a/fast", "b/slow"],
            "throughput_tok_s": [2000.0, 1000.0],
            "ttft_p99_s": [3.0, 3.0],
            "tpot_p50_s": [0.05, 0.05],
        }
    )
    # the faster policy misses its run's 2 s target; the slower meets its run's 4 s one
    per_policy = {"a/fast": {"ttft_p99_s": 2.0}, "b/slow": {"ttft_p99_s": 4.0}}
    assert pick(summary, None, per_policy).startswith("Pick b/slow: it meets its own run's targets and")
    assert "1 of 2 policies meet their own run's targets." in pick(summary, None, per_policy)
    # one run without targets: its policy is judged by none, and the pick says so
    line = pick(summary, None, {"a/fast": {"ttft_p99_s": 2.0}})
    assert line.startswith("Pick b/slow: it has no latency targets and")
    assert line.endswith("No latency targets for b/slow (no slo: block in its run).")
    # one common set (or none) reads as before
    assert pick(summary, {"ttft_p99_s": 4.0}).startswith("Pick a/fast: it meets every target and")
    assert pick(summary).endswith("No latency targets are set: add an slo: block to weigh latency.")


def test_compare_refuses_what_is_not_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    line = one_error_line(*kvsim("compare", "empty"))
    assert line == "kvsim: error: empty: folder: holds no kvsim run (no summary.csv in it or below it)"
    line = one_error_line(*kvsim("compare", "nope"))
    assert "nope: folder: not found" in line


def test_rates_need_a_rate_to_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_scenario(
        tmp_path,
        workload={
            "num_requests": 5,
            "arrival": {"process": "burst"},
            "prompt_tokens": {"dist": "fixed", "value": 8},
            "output_tokens": {"dist": "fixed", "value": 8},
        },
    )
    line = one_error_line(*kvsim("run", "small.yaml", "--rates", "1,2"))
    assert "--rates: the scenario has 'burst' arrivals" in line
    assert one_error_line(*kvsim("run", "small.yaml", "--rates", "1:x:1")).endswith(
        "'x' is not a positive number of requests per second"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "small.yaml"]


def test_reproduce_one_claim_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = kvsim("reproduce", "--claim", "1", "--out", "claims")
    assert code == 0, err
    csv = pd.read_csv(tmp_path / "claims" / "claims.csv")
    assert list(csv.columns) == ["id", "claim", "source", "scenario", "measured", "expected", "verdict", "why"]
    assert csv.id.tolist() == ["1a", "1b"] and csv.verdict.tolist() == ["holds", "holds"]
    assert out.startswith("1a: holds: ") and (tmp_path / "claims" / "claims.md").read_text().startswith(
        "Measured with `kvsim reproduce --claim 1`."
    )
    assert "<table" in (tmp_path / "claims" / "report.html").read_text()
    assert one_error_line(*kvsim("reproduce", "--claim", "42")).startswith(
        "kvsim: error: command line: --claim: unknown claim 42"
    )


def test_the_wide_table_shows_tail_latency_prefix_hits_where_cached_and_each_cost_model():
    from kvsim.cli.table import print_run

    summary = pd.DataFrame(
        dict(
            policy=["a", "b"],
            kv_utilization=[0.5, 0.6],
            internal_fraction=[0.1, 0.0],
            external_fraction=[0.0, 0.0],
            achievable_batch_size=[3.0, 4.0],
            throughput_tok_s=[100.0, 120.0],
            ttft_p50_s=[0.1, 0.1],
            ttft_p99_s=[1.5, 0.9],
            tpot_p50_s=[0.02, 0.03],
            prefix_hit_rate=[0.0, 0.25],
            preemptions=[0, 1],
            requests_rejected=[0, 0],
            fraction_basis=["waiting"] * 2,
            cost_model=["roofline", "profile:x"],
        )
    )
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        print_run(summary, wide=True)
        print_run(
            summary.assign(
                prefix_hit_rate=0.0, cost_model="roofline", limited_by_memory=[0.9, 0.2], limited_by_arrivals=[0.1, 0.8]
            ),
            wide=True,
        )
        print_run(summary.assign(cost_model="roofline"))
    finally:
        sys.stdout = sys_stdout
    first, second = out.getvalue().split("step costs of b: profile:x\n")
    assert "ttft p99 s" in first and "tpot p50 s" in first and "prefix hit" in first and "25.0%" in first
    assert "step costs of a: roofline" in first
    second, third = second.split("step costs of b: roofline\n")
    assert "prefix hit" not in second and "limited by" in second and "memory 90%" in second
    assert "arrivals 80%" in second and "step costs of a: roofline" in second
    assert "step costs: roofline\n" in third


def test_progress_bars_reach_their_total_one_per_policy(monkeypatch):
    from kvsim.cli.output import Progress

    bars = []

    class Recorder:  # stands in for tqdm: what each bar was told
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.n, self.closed, self.delay = total, desc, 0, False, kw["delay"]
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    monkeypatch.setattr("tqdm.tqdm", Recorder)
    bar = Progress(["a", "b"], enabled=True)
    bar.update("a", 3, 10)
    bar.update("a", 7, 10)
    bar.update("b", 5, 10)  # a finished: its last rejections took no step
    bar.close(finished=True)
    assert [(b.desc, b.n, b.total, b.closed, b.delay) for b in bars] == [
        ("[1/2] a", 10, 10, True, 2),
        ("[2/2] b", 10, 10, True, 2),
    ]
    failed = Progress(["a"], enabled=True)
    failed.update("a", 4, 10)
    failed.close(finished=False)  # an interrupted run's bar stops where it was
    assert (bars[-1].n, bars[-1].closed) == (4, True)


def test_bare_kvsim_prints_the_help_and_help_shows_whole_descriptions():
    code, out, err = kvsim()
    assert code == 2 and err.startswith("Usage: kvsim") and "kvsim: error" not in err
    code, out, _ = kvsim("--help")
    assert code == 0
    commands = " ".join(out.split("Commands:")[1].split())
    assert "..." not in commands
    assert "Run every policy of SCENARIO on one request stream and write results and plots." in commands
    assert "compare" in commands and "reproduce" in commands
