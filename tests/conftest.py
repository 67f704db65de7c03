"""Shared test set-up: every `kvsim run` in the suite checks invariants after each step,
except the flagship's whole run below, which two modules share."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("KVSIM_CHECK_INVARIANTS", "1")

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


@pytest.fixture(scope="session")
def flagship_run(tmp_path_factory):
    """`kvsim run scenarios/rag_8k.yaml` as a user runs it, once for the session (the
    flagship tests and the docs' table of it read the same run): (exit status, what it
    printed, what it wrote on stderr, its folder). Without the per-step checks, which
    would make this the suite's longest run by minutes; the flagship's workload runs with
    them in tests/test_flagship.py and in the quick start's test."""
    from helpers import kvsim

    out = tmp_path_factory.mktemp("flagship") / "rag_8k"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
        code, printed, err = kvsim("run", SCENARIOS / "rag_8k.yaml", "--out", out)
    return code, printed, err, out
