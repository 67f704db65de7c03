"""The same sweep on Ray and on the local process pool gives the same rows, row for row
and byte for byte in summary.csv; a Ray worker killed mid-sweep has its point rerun.
Skipped where Ray is not installed (pip install 'kvsim[ray]').
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray")

from kvsim.sweep.backends import LocalPool, RayCluster  # noqa: E402
from kvsim.sweep.grid import load_sweep  # noqa: E402
from test_sweep import Recorder, fill, write_sweep  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def session():
    """One local Ray instance of two CPUs for the module. Its workers import this tree's
    kvsim and, to unpickle Recorder, the tests folder."""
    path = os.pathsep.join(p for p in (str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="warning",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


def test_ray_and_the_local_pool_give_identical_results(session, tmp_path):
    plan = load_sweep(write_sweep(tmp_path))
    local = fill(plan, tmp_path / "local", LocalPool(2))
    on_ray = fill(plan, tmp_path / "ray", RayCluster("local"))
    assert len(local[0]) == 16 and local[2].empty
    for a, b in zip(local, on_ray):
        pd.testing.assert_frame_equal(a, b)
    assert (tmp_path / "local" / "summary.csv").read_bytes() == (tmp_path / "ray" / "summary.csv").read_bytes()


def test_a_killed_ray_worker_loses_no_finished_point_and_its_point_runs_again(session, tmp_path):
    plan = load_sweep(write_sweep(tmp_path))
    ids = list(dict.fromkeys(p.id for p in plan.points))
    recorder = Recorder(tmp_path, victim=ids[2])
    rows, _, errors = fill(plan, tmp_path / "out", RayCluster("local", fn=recorder))
    calls = recorder.calls()
    assert calls.count(ids[2]) == 2 and sorted(set(calls)) == sorted(ids) and len(calls) == len(ids) + 1
    assert errors.empty and sorted(set(rows.point)) == sorted(ids)
