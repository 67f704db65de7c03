"""Verdicts, rate sweeps and `kvsim compare`: hand-made summaries (with and without the
engines' limited_by_* columns) and one small run compared end to end."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvsim.config.errors import InputError
from kvsim.analysis.rates import normalized_latency, parse_rates, sustained, sweep_table
from kvsim.plots.style import context_line
from kvsim.analysis.verdict import arrival_limited, limiting_factor, pick, sentence

LIMITS = dict(
    limited_by_memory=0.7,
    limited_by_watermark=0.0,
    limited_by_max_num_seqs=0.1,
    limited_by_token_budget=0.05,
    limited_by_preemption=0.05,
    limited_by_arrivals=0.1,
)


def row(policy="paged-16", **kw):
    base = dict(
        policy=policy,
        throughput_tok_s=1000.0,
        ttft_p99_s=2.0,
        tpot_p50_s=0.05,
        mean_batch_size=20.0,
        fraction_basis="waiting",
        free_fraction=0.02,
    )
    return base | kw


def test_the_limit_comes_from_the_limited_by_columns_where_the_run_has_them():
    assert limiting_factor(row(**LIMITS)) == ("memory", 0.7, False)
    arrivals = LIMITS | dict(limited_by_memory=0.0, limited_by_arrivals=0.8)
    assert limiting_factor(row(**arrivals))[0].startswith("arrivals") and arrival_limited(row(**arrivals))
    # the engines' "none" basis (never memory-bound): fractions NaN, arrivals from the columns
    never = row(fraction_basis="none", free_fraction=math.nan, **(arrivals | {"limited_by_memory": math.nan}))
    assert limiting_factor(never) == ("arrivals (nothing waiting)", 0.8, False)


@pytest.mark.parametrize(
    "basis, free, expected",
    [
        ("busy", 0.5, "arrivals (nothing waiting)"),
        ("waiting", 0.05, "memory"),
        ("waiting", 0.4, "a scheduler limit (sequence cap or token budget)"),
    ],
)
def test_without_the_columns_the_limit_is_inferred_and_says_so(basis, free, expected):
    assert limiting_factor(row(fraction_basis=basis, free_fraction=free)) == (expected, None, True)
    assert "inferred" in sentence(row(fraction_basis=basis, free_fraction=free))


def test_a_sentence_names_targets_met_or_missed_throughput_and_the_limit():
    text = sentence(row(**LIMITS), {"ttft_p99_s": 3.0}, rate=4.0)
    assert text == (
        "paged-16 at 4 req/s meets every latency target (ttft p99 ≤ 3 s), with 1,000 output tok/s, "
        "TTFT p99 2 s and TPOT p50 0.05 s; its batch (mean 20.0) was limited by memory "
        "for 70% of the busy time."
    )
    assert "misses ttft_p99_s 2 > 1" in sentence(row(**LIMITS), {"ttft_p99_s": 1.0})


def test_pick_takes_the_highest_throughput_that_meets_the_targets_and_breaks_ties_by_latency():
    summary = pd.DataFrame(
        [
            row("a", throughput_tok_s=900.0, ttft_p99_s=0.5),
            row("b", throughput_tok_s=1000.0, ttft_p99_s=5.0),
            row("c", throughput_tok_s=995.0, ttft_p99_s=1.0),
        ]
    )
    assert pick(summary).startswith("Pick c:")  # b and c within 1%: c's TTFT p99 is lower
    assert pick(summary, {"ttft_p99_s": 0.8}).startswith("Pick a:")
    assert pick(summary, {"ttft_p99_s": 0.1}).startswith("No policy meets")


def test_context_line_names_scenario_model_gpu_rate_engine_and_step_costs():
    scn = dict(
        name="rag_8k",
        model="llama-3-8b",
        gpu="h100-80gb",
        tensor_parallel_size=1,
        workload=dict(arrival=dict(process="poisson", rate_per_s=4.0)),
    )
    summary = pd.DataFrame(dict(policy=["a", "b"], engine=["vllm-v1"] * 2, cost_model=["roofline"] * 2))
    assert context_line(scn, summary) == (
        "rag_8k · llama-3-8b on h100-80gb, tp 1 · poisson 4 req/s · engine vllm-v1 · step costs roofline"
    )
    assert "step costs differ" in context_line(scn, summary.assign(cost_model=["x", "y"]))
    # the same model, extrapolated in different steps, is one model
    same = summary.assign(
        cost_model=["p + o [extrapolated in 5/9 steps: a]", "p + o [extrapolated in 7/7 steps: a; b]"]
    )
    assert context_line(scn, same).endswith("step costs p + o")
    assert context_line(scn, summary.drop(columns="engine"), swept=True).count("engine") == 0


@pytest.mark.parametrize(
    "text, rates",
    [("0.5,1,2,4", [0.5, 1, 2, 4]), ("4, 1,1", [1, 4]), ("0.5:2:0.5", [0.5, 1.0, 1.5, 2.0]), ("1:1:1", [1.0])],
)
def test_rates_parse(text, rates):
    assert parse_rates(text) == rates


@pytest.mark.parametrize("text", ["", "0", "-1,2", "x", "1:2", "2:1:0.5", "0.001:100:0.001", "nan"])
def test_bad_rates_are_input_errors(text):
    with pytest.raises(InputError, match="--rates"):
        parse_rates(text)


def test_normalized_latency_and_the_sustained_rate():
    requests = pd.DataFrame(
        dict(
            policy=["a", "a", "a"],
            arrival_s=[0.0, 1.0, 2.0],
            finish_s=[10.0, 3.0, 9.0],
            output_tokens=[10, 4, 1],
            outcome=["completed", "completed", "rejected"],
        )
    )
    assert normalized_latency(requests)["a"] == pytest.approx((1.0 + 0.5) / 2)
    # unloaded level 0.02 s/token (the lowest at the lowest rate); the limit is 4x = 0.08
    table = pd.DataFrame(
        dict(
            rate_per_s=[1, 1, 2, 2, 3, 3],
            policy=["x", "y"] * 3,
            normalized_latency_s=[0.02, 0.03, 0.09, 0.05, 0.5, 0.07],
        )
    )
    assert sustained(table) == {"x": 1, "y": 3}
    table.loc[1, "normalized_latency_s"] = 0.2  # y diverges at once: never sustained
    assert math.isnan(sustained(table)["y"])


def test_sweep_table_has_one_row_per_rate_and_policy():
    summary = pd.DataFrame(dict(policy=["a"], throughput_tok_s=[10.0]))
    requests = pd.DataFrame(
        dict(policy=["a"], arrival_s=[0.0], finish_s=[2.0], output_tokens=[4], outcome=["completed"])
    )
    table = sweep_table([(2.0, summary, requests), (1.0, summary, requests)])
    assert table["rate_per_s"].tolist() == [1.0, 2.0]
    assert table["normalized_latency_s"].tolist() == [0.5, 0.5]


def test_html_table_escapes_and_embeds(tmp_path):
    from kvsim.plots import html

    assert "&lt;b&gt;" in html.table(pd.DataFrame({"x": ["<b>"]}))
    png = tmp_path / "a.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nxyz")
    assert 'src="data:image/png;base64,iVBORw0KGgp4eXo="' in html.image(png, "a")
