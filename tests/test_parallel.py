"""Policies and figures in worker processes (kvsim.sim.parallel): the same results in the same
order as one after the other, byte for byte on disk, and errors raised in a worker
arrive whole in the caller."""

import copy
import os
import pickle
from pathlib import Path

import pandas as pd
import pytest

from kvsim.kvcache import InvariantError
from kvsim.config.errors import InputError
from kvsim.sim.parallel import can_fork, ordered_map
from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario

import helpers
from test_fast_path import BASE, assert_same

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs the fork start method")


def test_results_come_in_job_order_whatever_ran_first():
    seen = []
    out = ordered_map(lambda i: i * i, 7, 2, first=[6, 3], on_result=lambda i, r: seen.append((i, r)))
    assert out == [i * i for i in range(7)]
    assert sorted(seen) == [(i, i * i) for i in range(7)]
    assert ordered_map(lambda i: i + 1, 3, 1) == [1, 2, 3]  # serial


def boom(i):
    if i == 2:
        raise InputError("s.yaml", "policies[2]", "no such thing")
    return i


def test_a_workers_error_is_raised_in_the_caller():
    with pytest.raises(InputError) as e:
        ordered_map(boom, 4, 2)
    assert (e.value.source, e.value.field, e.value.message) == ("s.yaml", "policies[2]", "no such thing")
    assert str(pickle.loads(pickle.dumps(e.value))) == "s.yaml: policies[2]: no such thing"

    def interrupted(i):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ordered_map(interrupted, 2, 2)

    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")

    def odd(i):
        raise Unpicklable("x", "y")

    with pytest.raises(RuntimeError, match="Unpicklable: xy"):
        ordered_map(odd, 2, 2)


def test_policies_in_workers_give_the_serial_tables(monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    scn = validate_scenario(copy.deepcopy(BASE), "fast")
    serial = run_scenario(scn, Path("."), "fast", workers=1)
    progress = []
    parallel = run_scenario(scn, Path("."), "fast", workers=2, on_progress=lambda *a: progress.append(a))
    assert_same(serial, parallel)
    assert serial.summary.to_csv() == parallel.summary.to_csv()
    assert sorted(p[0] for p in progress) == sorted(p["name"] for p in BASE["policies"])


def test_jobs_change_no_byte_of_the_output(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = copy.deepcopy(BASE)
    doc["workload"]["num_requests"] = 30
    (tmp_path / "s.yaml").write_text(__import__("yaml").safe_dump(doc))
    outs = {}
    for jobs in ("1", "2"):
        code, _, err = helpers.kvsim("run", tmp_path / "s.yaml", "--quiet", "--jobs", jobs, "--out", tmp_path / jobs)
        assert (code, err) == (0, "")
        outs[jobs] = tmp_path / jobs
    names = sorted(p.name for p in outs["1"].iterdir())
    assert names == sorted(p.name for p in outs["2"].iterdir()) and "latency.png" in names
    for name in names:
        if name.endswith(".parquet"):
            pd.testing.assert_frame_equal(pd.read_parquet(outs["1"] / name), pd.read_parquet(outs["2"] / name))
        elif name != "run.json":  # run.json holds the wall time
            assert (outs["1"] / name).read_bytes() == (outs["2"] / name).read_bytes(), name


def test_an_invariant_broken_in_a_worker_ends_the_run_as_in_one_process(tmp_path, monkeypatch):
    def broken(name, *args, **kwargs):
        raise InvariantError(f"{name}: block 3 lost")

    monkeypatch.setattr("kvsim.sim.runner.simulate", broken)
    (tmp_path / "s.yaml").write_text(__import__("yaml").safe_dump(BASE))
    code, _, err = helpers.kvsim("run", tmp_path / "s.yaml", "--quiet", "--jobs", "2", "--out", tmp_path / "o")
    assert code == 3 and err.startswith("kvsim: invariant violated: ") and "block 3 lost" in err
    assert not (tmp_path / "o").exists()


def test_jobs_run_in_workers_where_there_are_two_or_more():
    here = os.getpid()
    assert all(pid != here for pid in ordered_map(lambda i: os.getpid(), 2, 2))
    assert ordered_map(lambda i: os.getpid(), 1, 2) == [here]  # a lone job runs here
