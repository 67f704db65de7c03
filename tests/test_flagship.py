"""The flagship scenario says something: `kvsim run scenarios/rag_8k.yaml` runs at a
load its server sustains under the shipped step costs, has latency targets, and ends in
a verdict that picks a policy meeting them while others miss (the policies part there).
The overloaded variant is the same workload at a rate the server does not sustain. The
tutorial's scenario too is at a load where its policies part, and its page shows what
kvsim prints for it today.

If the default step costs change and this fails, rerun scripts/flagship_load.py and
move rag_8k's rate to where the policies part again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import kvsim
from kvsim.analysis.slo import misses
from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


@pytest.fixture(scope="module")
def flagship(flagship_run):
    """`kvsim run scenarios/rag_8k.yaml` as a user runs it (the session's one run of it):
    the scenario, its summary and what the command printed."""
    code, printed, err, out = flagship_run
    assert code == 0, err
    scn, _ = load_scenario(SCENARIOS / "rag_8k.yaml")
    return scn, pd.read_csv(out / "summary.csv"), printed


def test_the_flagship_has_targets_and_its_server_keeps_up(flagship):
    scn, summary, _ = flagship
    assert scn.slo is not None and scn.slo.targets()
    assert (summary["requests_completed"] == summary["requests_total"]).all()
    # sustained: arrivals, not the server, set the throughput: every policy serves the
    # same output tokens per second, within 2%
    tput = summary["throughput_tok_s"]
    assert tput.min() >= 0.98 * tput.max()


def test_the_flagship_s_policies_part_against_its_targets(flagship):
    scn, summary, _ = flagship
    met = [r["policy"] for r in summary.to_dict(orient="records") if not misses(r, scn.slo.targets())]
    assert 0 < len(met) < len(summary), met


def test_kvsim_run_of_the_flagship_ends_in_a_verdict_that_picks_a_policy(flagship):
    out = flagship[2]
    verdict = " ".join(out.split("verdict: ", 1)[1].split("\nwrote ")[0].split())
    assert verdict.startswith("Pick ") and "meets every target" in verdict, verdict
    assert "policies meet every target" in verdict


def test_the_overloaded_variant_is_the_same_workload_past_what_the_server_sustains():
    flag = yaml.safe_load((SCENARIOS / "rag_8k.yaml").read_text())
    over = yaml.safe_load((SCENARIOS / "rag_8k_overload.yaml").read_text())
    assert over["policies"] == flag["policies"] and over["model"] == flag["model"]
    assert over["workload"]["arrival"]["rate_per_s"] > flag["workload"]["arrival"]["rate_per_s"]
    scn, base = load_scenario(SCENARIOS / "rag_8k_overload.yaml")
    summary = run_scenario(scn, base, "rag_8k_overload.yaml").summary
    # a queue that grows for the whole run: the median request waits over ten seconds
    # for its first token under every policy
    assert (summary["ttft_p50_s"] > 10).all(), summary[["policy", "ttft_p50_s"]]


# --- the tutorial's scenario -------------------------------------------------------
TUTORIAL = SCENARIOS / "tutorial_vllm_serve.yaml"
TUTORIAL_OUTPUT = SCENARIOS.parent / "docs" / "generated" / "tutorial_output.md"


def docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", SCENARIOS.parent / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """`kvsim run` of the tutorial's scenario as its page shows it: what it printed, each
    policy's summary row, and whether it met every target."""
    out = tmp_path_factory.mktemp("tutorial") / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
        code, printed, err = kvsim("run", TUTORIAL, "--out", out)
    assert code == 0, err
    scn, _ = load_scenario(TUTORIAL)
    rows = pd.read_csv(out / "summary.csv").to_dict(orient="records")
    return printed, {r["policy"]: not misses(r, scn.slo.targets()) for r in rows}, rows


def test_the_tutorial_shows_what_kvsim_run_prints_today(tutorial):
    """If this fails, a change moved results: run `python scripts/docs_tables.py --only tutorial`
    (and scripts/flagship_load.py on the tutorial's scenario if its policies no longer part)."""
    tables = docs_tables()
    assert tables.printed(tables.TUTORIAL[0], tutorial[0]) in TUTORIAL_OUTPUT.read_text()


def test_the_tutorial_s_policies_part_while_the_server_keeps_up(tutorial):
    printed, met, rows = tutorial
    assert 0 < sum(met.values()) < len(met), met
    tput = [r["throughput_tok_s"] for r in rows]
    assert min(tput) >= 0.98 * max(tput), tput
    verdict = " ".join(printed.split("verdict: ", 1)[1].split())
    assert verdict.startswith("Pick ") and "policies meet every target" in verdict, verdict


def test_the_tutorial_s_capacity_agrees_with_its_run(tutorial):
    """The capacity search the page quotes, against the run at the scenario's rate: a
    policy that meets its targets there has a highest rate at or above it, one that
    misses has a missed rate at or below it."""
    rate = yaml.safe_load(TUTORIAL.read_text())["workload"]["arrival"]["rate_per_s"]
    block = TUTORIAL_OUTPUT.read_text().split("$ kvsim capacity", 1)[1]
    found = {
        row[0]: (float(row[1]), float(row[2]))
        for row in map(str.split, block.splitlines())
        if row and row[0] in tutorial[1]
    }
    assert found.keys() == tutorial[1].keys(), found
    for policy, met in tutorial[1].items():
        highest, missed = found[policy]
        assert highest >= rate if met else missed <= rate, (policy, met, found[policy])
