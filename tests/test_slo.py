"""Latency targets: the scenario's slo: block, the --slo syntax, and what a row misses."""

import math

import pytest

from kvsim.config.errors import InputError
from kvsim.analysis.slo import misses, parse_targets
from kvsim.config.scenario import SLO


def test_a_row_misses_a_target_above_it_or_when_nothing_completed():
    row = {"ttft_p99_s": 2.5, "tpot_p50_s": 0.05, "e2e_p50_s": math.nan}
    assert misses(row, {"tpot_p50_s": 0.1}) == []
    assert misses(row, {"ttft_p99_s": 2.0, "tpot_p50_s": 0.05}) == ["ttft_p99_s 2.5 > 2"]
    assert misses(row, {"e2e_p50_s": 10}) == ["e2e_p50_s nan > 10"]


def test_targets_parse_and_match_the_slo_block():
    assert parse_targets("ttft_p99_s=2, tpot_p50_s=0.1") == {"ttft_p99_s": 2.0, "tpot_p50_s": 0.1}
    assert SLO(ttft_p99_s=2, tpot_p50_s=0.1).targets() == {"ttft_p99_s": 2, "tpot_p50_s": 0.1}


@pytest.mark.parametrize("text", ["", "ttft=2", "ttft_p99_s", "ttft_p99_s=-1", "ttft_p99_s=x", "ttft_p99_s=nan"])
def test_bad_targets_are_input_errors(text):
    with pytest.raises(InputError, match="--slo"):
        parse_targets(text)
