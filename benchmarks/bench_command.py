"""The whole `kvsim run` command's wall time (start-up, simulation, tables, figures, exit),
two checkouts side by side.

Each run is a fresh `python -m kvsim.cli run SCENARIO --quiet` whose PYTHONPATH is one
checkout, timed from before the process starts to after it has ended, writing into a
scratch folder. With --against, the two checkouts take turns, run after run, so that a
noisy shared machine weighs on both alike; the medians and their ratio (this checkout
over the other) are printed, of wall time and of CPU time (the command's process and
its workers). Where bench_simulate.py times the simulation alone, this
shows the fixed cost of a run: imports, figures, the interpreter's exit.

    python benchmarks/bench_command.py --against /path/to/other/checkout --repeats 5
    python benchmarks/bench_command.py --only small --jobs 1

Not part of the test suite: it takes minutes.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> scenario relative to a checkout
WORKLOADS = {
    "small": "tests/data/golden_tiny.yaml",
    "rag_8k": "scenarios/rag_8k.yaml",
}


def measure(repo: Path, name: str, jobs: int | None) -> tuple[float, float]:
    """(wall, CPU) seconds one `kvsim run` of workload `name` takes from `repo`; the CPU
    time, the process's and its workers', is less swayed by a loaded machine."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "kvsim.cli",
            "run",
            str(repo / WORKLOADS[name]),
            "--quiet",
            "--force",
            "--out",
            str(Path(tmp) / "out"),
            *(["--jobs", str(jobs)] if jobs else []),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": str(repo), "KVSIM_CHECK_INVARIANTS": ""},
        )
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{name} in {repo} failed (exit status {done.returncode}):\n{done.stderr}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jobs", type=int, help="kvsim run --jobs (default: kvsim's, one per core)")
    ap.add_argument("--against", type=Path, help="another checkout, timed in turn with this one")
    opts = ap.parse_args()
    repos = {"this": ROOT} | ({"other": opts.against.resolve()} if opts.against else {})
    for name in opts.only or list(WORKLOADS):
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in repos}
        for i in range(opts.repeats):
            for key in list(repos) if i % 2 == 0 else list(reversed(repos)):
                runs[key].append(measure(repos[key], name, opts.jobs))
        for what, k in (("wall", 0), ("cpu", 1)):
            times = {key: [r[k] for r in rs] for key, rs in runs.items()}
            line = f"{name:<8} {what:<4}" + "".join(
                f"  {key} {statistics.median(t):7.3f} s (runs {', '.join(f'{x:.2f}' for x in t)})"
                for key, t in times.items()
            )
            if opts.against:
                line += f"  ratio this/other {statistics.median(times['this']) / statistics.median(times['other']):.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
