"""`kvsim reproduce`'s checks: the fast ones run whole; the curve helpers on hand-made data."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvsim.reproduce import checks as cc
from kvsim.reproduce.claims import Context, default_scenarios, markdown


@pytest.fixture
def ctx(tmp_path):
    return Context(default_scenarios(), quick=True, out=tmp_path)


def test_every_claim_scenario_loads(ctx):
    from kvsim.reproduce import mooncake
    from kvsim.reproduce.claims import default_traces

    for path in sorted(ctx.scenarios.glob("*.yaml")):
        if path.name != mooncake.FIG10:
            ctx.load(path.name)
    traces = default_traces()
    if traces is not None and (traces / mooncake.NAMES[1]).is_file():  # it replays the trace
        mooncake._fig10_scenario(ctx, traces / mooncake.NAMES[1])
    assert len(list(ctx.scenarios.glob("*.yaml"))) == 10


def test_the_memory_math_by_hand(ctx):
    a, b = cc.memory_math(ctx)
    # 2 x 80 layers x 8 heads x 128 x 2 B = 327,680 B; x 8,192 = 2,684,354,560; x 32 = 85,899,345,920
    assert "327,680 B/token" in a.measured and "2,684,354,560 B" in a.measured
    assert "85,899,345,920 B (85.90 GB" in a.measured and a.verdict == "holds"
    assert "85.7 GB is an arithmetic slip" in a.why
    # 32,768 x 8 x 327,680 = 85.9 GB; with 64 KV heads 8x that, 687.2 GB
    assert "GQA 85.9 GB; MHA 687.2 GB; ratio 8.0x" == b.measured and b.verdict == "holds"


def test_a_requests_kv_peaks_at_its_last_step_not_after_prefill(ctx):
    (row,) = cc.prefill_peak(ctx)
    # vLLM V1: the 2,000 prompt tokens in the prefill step; 2,000 + 499 at the end (the last
    # token sampled is never fed back, so it never takes a slot)
    assert row.measured.startswith(
        "KV in the prefill step 2,000 slots (the prompt; the first token takes its slot as it is fed back); peak 2,499"
    )
    assert row.verdict.startswith("holds only for the step's activations")
    assert [png.name for _, png in ctx.figures] == ["claim9_timeline.png"]


def test_crossing_interpolates_a_rising_curve():
    x, y = [0.1, 0.5, 1.0], [0.1, 0.3, 0.8]
    assert cc._crossing(x, y, 0.2) == pytest.approx(0.3)
    assert cc._crossing(x, y, 0.6) == pytest.approx(0.8)
    assert math.isnan(cc._crossing(x, y, 0.9))
    assert cc._span(x, y, 0.2, 0.6) == "30%-80%" and cc._span(x, y, 0.6, 0.9) == "80% or more"
    assert cc._span(x, y, 0.85, 0.9) == "never"


def test_steady_state_starts_at_the_first_completion_and_ends_with_the_queue():
    class Res:
        timeseries = pd.DataFrame(
            dict(
                policy="p",
                time_s=[0.0, 1.0, 2.0, 3.0],
                step_s=[1.0, 1.0, 2.0, 1.0],
                waiting=[5, 3, 1, 0],
                token=[0.2, 0.9, 0.6, 0.1],
            )
        )
        requests = pd.DataFrame(dict(policy=["p", "p"], finish_s=[1.0, 4.0]))

    # steps at 1 s and 2 s: (0.9 x 1 + 0.6 x 2) / 3
    assert cc._steady_util(Res, "p") == pytest.approx(0.7)


def test_markdown_keeps_one_line_per_claim_and_the_notes(ctx):
    table = pd.DataFrame(
        [
            dict(
                id="1",
                claim="a | b",
                source="s",
                scenario="x",
                measured="m",
                expected="e",
                verdict="holds",
                why="because",
            )
        ]
    )
    text = markdown(table)
    assert text.splitlines()[2] == "| 1 | a \\| b | s | x | m | e | holds |"
    assert text.rstrip().endswith("- **1**: because")
