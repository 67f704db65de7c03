"""The compiled build (setup.py with KVSIM_COMPILE=1): Cython compiles the step loop's
modules from their unchanged source, and every run gives the interpreted run's bytes.

The build is made once, into a copy of the package (about a minute on two cores); it and
the runs skip where Cython or a C compiler is missing (.ci/run installs Cython). Each
scenario runs twice in fresh processes, on the copy and on this checkout, started from
the test's folder so that neither is found through the working directory.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("setuptools")  # (setup.py's)
sys.path.insert(0, str(ROOT))
from setup import STEP_LOOP, compiled_copy  # noqa: E402

TABLES = ("summary.csv", "summary.json", "requests.parquet", "timeseries.parquet")
EVERY_STEP = ["--timeseries-bucket", "0"]  # (over the file's buckets: each step's row compared)
CASES = {  # scenario: its arguments (small runs that go through each compiled module)
    "benchmarks/scenarios/sharegpt_1m.yaml": ["--num-requests", "3000", *EVERY_STEP],  # vLLM V1, quiet steps
    "benchmarks/scenarios/sharegpt_1m_prefix.yaml": ["--num-requests", "3000", *EVERY_STEP],  # its prefix cache
    "benchmarks/scenarios/vidur_10k.yaml": ["--num-requests", "1000"],  # vLLM V0
    "scenarios/rag_8k_overload.yaml": ["--num-requests", "100"],  # contiguous, FP8, preemptions
    "scenarios/chat_multiturn.yaml": ["--num-requests", "200"],  # shared prefixes keyed one by one
}


def test_no_assignment_in_a_comprehension():
    """Cython gives `:=` inside a comprehension another variable than the function's own of
    that name (cython/cython#6547), which can change a result without a crash: none in the
    compiled modules."""
    comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    for path in STEP_LOOP:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, comprehensions):
                assert not any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)), f"{path}:{node.lineno}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A copy of the package with the step loop's modules compiled beside their source."""
    pytest.importorskip("Cython")
    if not shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):
        pytest.skip("no C compiler")
    return compiled_copy(tmp_path_factory.mktemp("compiled"))


def run(package: Path, scenario: str, args: list[str], out: Path, cwd: Path) -> dict[str, bytes]:
    """`kvsim run` in a fresh process on the package at `package`, without the per-step
    checks (the runs compare outputs, which the checks do not change); its tables' bytes."""
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_CHECK_INVARIANTS"}
    subprocess.run(
        [sys.executable, "-m", "kvsim.cli", "run", ROOT / scenario, "--out", out, "--quiet", "--no-plots", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(package)},
        check=True,
        capture_output=True,
    )
    return {name: (out / name).read_bytes() for name in TABLES}


def test_the_step_loop_is_compiled(compiled, tmp_path):
    for path in STEP_LOOP:
        assert list((compiled / path).parent.glob(f"{Path(path).stem}.*.so")), path
    where = subprocess.run(
        [sys.executable, "-c", "import kvsim.sim.loop as m; print(m.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(compiled)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().endswith(".so")


@pytest.mark.parametrize("scenario", CASES)
def test_same_bytes(compiled, tmp_path, scenario):
    args = CASES[scenario]
    plain = run(ROOT, scenario, args, tmp_path / "plain", tmp_path)
    assert run(compiled, scenario, args, tmp_path / "compiled", tmp_path) == plain
