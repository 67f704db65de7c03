"""Determinism: the same scenario and seed give the same bytes, wherever and however run.

- two runs, same seed: identical summary.csv, summary.json and tables;
- a policy's row is the same whether it runs alone (--policy) or beside the others, for
  every policy of scenarios/rag_8k_overload.yaml;
- another seed gives other numbers;
- "another machine": a fresh interpreter with another PYTHONHASHSEED, started from
  another working directory with the scenario given by absolute path;
- the check mode only checks: results are identical with and without it;
- a golden file: tests/data/golden_summary.csv, from tests/data/golden_tiny.yaml.

Most runs are in-process with plots stubbed out (summary files never depend on them) and
without the per-step checks (the test above shows they change nothing), to stay fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

import helpers
from helpers import kvsim_command

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
RAG = ROOT / "scenarios" / "rag_8k_overload.yaml"  # rag_8k where memory is contended
RAG_REQUESTS = "100"  # enough for a queue to form: fraction_basis is "waiting"
SUMMARIES = ("summary.csv", "summary.json")


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr("kvsim.plots.run_figures.plot_jobs", lambda *args, **kwargs: [])
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)


def kvsim(*args) -> None:
    """In-process `kvsim ARGS`, which must succeed with nothing on stderr."""
    code, _, err = helpers.kvsim(*args)
    assert (code, err) == (0, ""), err


def read(folder: Path, *names: str) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names}


def rag_policies() -> list[str]:
    return [p["name"] for p in yaml.safe_load(RAG.read_text())["policies"]]


@pytest.fixture(scope="module")
def rag_all(tmp_path_factory):
    """rag_8k_overload with every policy, once for the module."""
    out = tmp_path_factory.mktemp("rag") / "all"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvsim.plots.run_figures.plot_jobs", lambda *args, **kwargs: [])
        mp.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
        kvsim("run", RAG, "--out", out, "--quiet", "--num-requests", RAG_REQUESTS)
    return out


def test_same_seed_same_bytes(rag_all, tmp_path):
    kvsim("run", RAG, "--out", tmp_path / "again", "--quiet", "--num-requests", RAG_REQUESTS)
    assert read(tmp_path / "again", *SUMMARIES) == read(rag_all, *SUMMARIES)
    for table in ("timeseries.parquet", "requests.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "again" / table), pd.read_parquet(rag_all / table))


def test_the_run_is_not_trivial(rag_all):
    summary = pd.read_csv(rag_all / "summary.csv")
    assert list(summary.policy) == rag_policies()
    assert (summary.limited_by_memory > 0).any()  # memory is contended
    assert summary.mean_batch_size.nunique() > 1  # and the policies differ


@pytest.mark.parametrize("policy", rag_policies())
def test_a_policy_alone_gives_the_same_row(rag_all, tmp_path, policy):
    kvsim("run", RAG, "--out", tmp_path / "one", "--quiet", "--num-requests", RAG_REQUESTS, "--policy", policy)
    alone = (tmp_path / "one" / "summary.csv").read_text().splitlines()
    beside = (rag_all / "summary.csv").read_text().splitlines()
    assert alone[0] == beside[0]
    assert alone[1:] == [row for row in beside[1:] if row.split(",")[0] == policy]
    requests = pd.read_parquet(rag_all / "requests.parquet")
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "one" / "requests.parquet"),
        requests[requests.policy == policy].reset_index(drop=True),
    )


def test_policy_order_does_not_matter(rag_all, tmp_path):
    names = rag_policies()[::-1]
    kvsim(
        "run",
        RAG,
        "--out",
        tmp_path / "rev",
        "--quiet",
        "--num-requests",
        RAG_REQUESTS,
        *[arg for name in names for arg in ("--policy", name)],
    )
    rev = pd.read_csv(tmp_path / "rev" / "summary.csv").set_index("policy")
    fwd = pd.read_csv(rag_all / "summary.csv").set_index("policy")
    pd.testing.assert_frame_equal(rev.loc[fwd.index], fwd)


def test_another_seed_changes_the_numbers(rag_all, tmp_path):
    kvsim("run", RAG, "--out", tmp_path / "seed", "--quiet", "--num-requests", RAG_REQUESTS, "--seed", "1")
    ours, theirs = pd.read_csv(tmp_path / "seed" / "summary.csv"), pd.read_csv(rag_all / "summary.csv")
    for column in ("ttft_p50_s", "throughput_tok_s", "token_fraction", "makespan_s"):
        assert (ours[column] != theirs[column]).all(), column


def test_check_mode_changes_nothing(tmp_path):
    scenario = DATA / "golden_tiny.yaml"
    kvsim("run", scenario, "--out", tmp_path / "plain", "--quiet")
    kvsim("run", scenario, "--out", tmp_path / "checked", "--quiet", "--check-invariants")
    names = (*SUMMARIES, "timeseries.parquet", "requests.parquet")
    assert read(tmp_path / "plain", *names) == read(tmp_path / "checked", *names)


def _fresh_interpreter(scenario: Path, out: Path, cwd: Path, **env_changes: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_CHECK_INVARIANTS"}
    env.update(env_changes)
    proc = subprocess.run(
        [*kvsim_command(), "run", str(scenario), "--out", str(out), "--quiet"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_another_machine_same_bytes(tmp_path):
    """Other processes, hash seeds, working directories, time zones, locales and thread
    counts (plots drawn for real), against an in-process run here; the scenario is reached
    through a copy in another folder."""
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    copy = tmp_path / "copy" / "golden_tiny.yaml"
    copy.parent.mkdir()
    shutil.copy(DATA / "golden_tiny.yaml", copy)
    kvsim("run", DATA / "golden_tiny.yaml", "--out", tmp_path / "here", "--quiet")
    _fresh_interpreter(
        copy,
        tmp_path / "there",
        cwd=elsewhere,
        PYTHONHASHSEED="12345",
        TZ="Pacific/Chatham",
        LC_ALL="C",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
    )
    _fresh_interpreter(copy, tmp_path / "there2", cwd=tmp_path, PYTHONHASHSEED="0", TZ="UTC")
    names = (*SUMMARIES, "timeseries.parquet", "requests.parquet")
    assert read(tmp_path / "there", *names) == read(tmp_path / "here", *names) == read(tmp_path / "there2", *names)
    assert all((tmp_path / "there" / png).stat().st_size > 0 for png in ("latency.png", "memory_breakdown.png"))


def test_golden_summary(tmp_path):
    """The committed numbers. A failure here means the model's output changed: if the
    change is intended (a new column, a fixed bug, a new cost model), regenerate with

        kvsim run tests/data/golden_tiny.yaml --out /tmp/golden --quiet --force \\
            && cp /tmp/golden/summary.csv tests/data/golden_summary.csv

    and say in the commit which numbers moved and why; otherwise it is a regression."""
    kvsim("run", DATA / "golden_tiny.yaml", "--out", tmp_path / "now", "--quiet")
    now = (tmp_path / "now" / "summary.csv").read_bytes()
    golden = (DATA / "golden_summary.csv").read_bytes()
    if now != golden:
        a, b = now.decode().splitlines(), golden.decode().splitlines()
        head_a, head_b = a[0].split(","), b[0].split(",")
        moved = (
            sorted(
                {h for ra, rb in zip(a[1:], b[1:]) for h, x, y in zip(head_a, ra.split(","), rb.split(",")) if x != y}
            )
            if head_a == head_b
            else ["the columns themselves"]
        )
        pytest.fail(f"summary.csv differs from tests/data/golden_summary.csv in: {', '.join(moved)}")
