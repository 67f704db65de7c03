"""kvsim's build (the metadata is in setup.cfg).

With KVSIM_COMPILE=1 the step loop's modules (STEP_LOOP) are also compiled by Cython from
their unchanged source, in pure-Python mode: the annotations are not read as C types, so
every operation is still Python's own and every output is the same byte for byte, while
the interpreter's work between operations goes (benchmarks/RESULTS.md times the build,
docs/performance.md says more). It needs Cython and a C compiler where it installs:

    pip install cython wheel && KVSIM_COMPILE=1 pip install --no-build-isolation .

Not with `pip install -e`: a compiled module is imported before its source, so edits to it
would not take effect.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

STEP_LOOP = [
    "kvsim/sim/loop.py",
    "kvsim/sim/lazy.py",
    "kvsim/sim/running.py",
    "kvsim/sim/scheduler.py",
    "kvsim/sim/waiting.py",
    "kvsim/sim/pool_sums.py",
    "kvsim/sim/records.py",
    "kvsim/kvcache/base.py",
    "kvsim/kvcache/paged.py",
    "kvsim/kvcache/prefix.py",
    "kvsim/kvcache/naming.py",
    "kvsim/kvcache/free_queue.py",
    "kvsim/engines/base.py",
    "kvsim/engines/vllm_v0.py",
    "kvsim/engines/vllm_v1.py",
    "kvsim/cost/model.py",
    "kvsim/workload/table.py",
]


def extensions() -> list:
    if os.environ.get("KVSIM_COMPILE") != "1":
        return []
    from Cython.Build import cythonize

    directives = {"language_level": 3, "annotation_typing": False, "binding": True}
    return cythonize(STEP_LOOP, compiler_directives=directives, build_dir="build/cython", quiet=True)


def compiled_copy(dest: Path) -> Path:
    """This checkout's package copied into `dest`, with STEP_LOOP compiled beside its source
    (what tests/test_compiled.py and benchmarks/bench_speed.py --compiled run: put `dest`
    on PYTHONPATH). About a minute on two cores."""
    root = Path(__file__).resolve().parent
    shutil.copytree(root / "kvsim", dest / "kvsim", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(root / name, dest)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=dest,
        env={**os.environ, "KVSIM_COMPILE": "1"},
        check=True,
        capture_output=True,
    )
    return dest


if __name__ == "__main__":  # (pip runs it so; the tests import STEP_LOOP)
    setup(ext_modules=extensions())
