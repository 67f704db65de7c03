"""How fast kvsim runs beside other simulators, on workloads whose simulated work is
pinned (benchmarks/scenarios/: step costs `roofline`, engine, its limits and the pool
given in the file, so a change of kvsim's defaults changes no benchmark's work).

Each run is the real command in a fresh process: `kvsim run SCENARIO --quiet` (start-up,
the simulation, the Parquet files and the five figures, drawn in forked worker
processes), on the workloads that BLIS and Vidur run also `kvsim run --no-plots` (the
tables alone: those simulators draw no figures), and BLIS's `blis run` where it is built
(benchmarks/others.py). A run's wall
time is measured around the process; its CPU time (user and system, its worker
processes' included) and peak RSS (that of its largest process) come from wait4. Beside
them stands the simulated work that the run did: steps, simulated seconds (makespan) and
the mean batch, so that a change of speed is told from a change of work.

kvsim runs as an installed Python package does, from compiled bytecode: its modules are
compiled once before the runs (`compileall`, into the checkout's __pycache__ folders, which
git ignores), as pip compiles a package it installs and Python caches what it imports,
where a machine sets PYTHONDONTWRITEBYTECODE; BLIS runs its built binary.

The machine is shared and noisy, so each workload runs --repeats times, round-robin
with every other workload and simulator (a slow minute then slows all of them alike);
the tables give medians, every run's wall time, and ratios of medians.

    python benchmarks/bench_speed.py                     # the 10k and 100k workloads, 3 rounds
    python benchmarks/bench_speed.py --million --write   # also a million requests; RESULTS.md
    python benchmarks/bench_speed.py --million --million-repeats 2   # fewer runs of those
    python benchmarks/bench_speed.py --blis-variants "BLIS, snapshot off"   # BLIS as the targets judge it
    python benchmarks/bench_speed.py --only vidur_10k --repeats 5 [--exact-steps]
    python benchmarks/bench_speed.py --profile sharegpt_100k   # cProfile of one run, in-process
    python benchmarks/bench_speed.py --compiled          # also kvsim's compiled build (setup.py)

--write regenerates benchmarks/RESULTS.md from the runs just made (never edit it by
hand). Not part of the test suite: it takes many minutes.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # setup.py's compiled_copy
import others  # noqa: E402
import report  # noqa: E402
from report import COMPILED, COMPILED_NO_FIGURES, EVERY_STEP, NO_FIGURES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = Path(__file__).resolve().parent / "scenarios"


@dataclass(frozen=True)
class Workload:
    scenario: str
    requests: int
    blis: bool = False  # BLIS runs the same requests (others.BLIS_WORKLOAD)
    args: tuple[str, ...] = ()  # kvsim's further arguments

    def kvsim_args(self) -> list[str]:
        return ["--num-requests", str(self.requests), *self.args]

    def described(self) -> str:
        """Its scenario file (with the step series' buckets the file sets) and kvsim's arguments."""
        bucket = yaml.safe_load((SCENARIOS / f"{self.scenario}.yaml").read_text()).get("timeseries_bucket_s")
        setting = f" (timeseries_bucket_s: {bucket:g})" if bucket else ""
        return f"{self.scenario}.yaml{setting} {' '.join(self.kvsim_args())}"


# The ShareGPT scenarios record the step series in sums per 10 simulated seconds
# (timeseries_bucket_s in their files); vidur_10k.yaml records every step, as its 10k run
# does here, and its 100k run takes the same buckets from the command line.
WORKLOADS = {
    "vidur_10k": Workload("vidur_10k", 10_000, blis=True),
    "vidur_100k": Workload("vidur_10k", 100_000, blis=True, args=("--timeseries-bucket", "10")),
    "sharegpt_10k": Workload("sharegpt_1m", 10_000),
    "sharegpt_100k": Workload("sharegpt_1m", 100_000),
    "sharegpt_1m": Workload("sharegpt_1m", 1_000_000),
    "sharegpt_10k_prefix": Workload("sharegpt_1m_prefix", 10_000),
    "sharegpt_100k_prefix": Workload("sharegpt_1m_prefix", 100_000),
    "sharegpt_1m_prefix": Workload("sharegpt_1m_prefix", 1_000_000),
}
MILLION = ["sharegpt_1m", "sharegpt_1m_prefix"]
DEFAULT = [name for name in WORKLOADS if name not in MILLION]


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> dict:
    """Run cmd; its wall time, CPU time and peak RSS (from wait4: the process and the
    children it waited for) and its stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "stdout": stdout,
    }


def kvsim_env(package: Path = ROOT) -> dict:
    """kvsim's environment: the package in `package` (this checkout, or its compiled copy),
    whose compiled bytecode it may use."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(package)}


def compile_kvsim(package: Path = ROOT) -> None:
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(package / "kvsim")], env=kvsim_env(package), check=True
    )


def run_kvsim(name: str, extra: list[str], tmp: Path, package: Path = ROOT) -> dict:
    """`kvsim run` on workload `name`, from the package in `package`, started there."""
    w = WORKLOADS[name]
    out = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "kvsim.cli",
        "run",
        str(SCENARIOS / f"{w.scenario}.yaml"),
        "--quiet",
        "--force",
        "--out",
        str(out),
        *w.kvsim_args(),
        *extra,
    ]
    run = timed(cmd, package, kvsim_env(package))
    import pandas as pd

    s = pd.read_csv(out / "summary.csv").iloc[0]
    return {
        **run,
        "requests": int(s.requests_completed),
        "steps": int(s.steps),
        "makespan_s": float(s.makespan_s),
        "mean_batch": float(s.mean_batch_size),
    }


def run_blis(name: str, variant: str, source: Path) -> dict:
    run = timed(others.blis_command(source, WORKLOADS[name].requests, variant), source)
    return {**run, **others.blis_work(run["stdout"])}


KVSIM_RUNS = {  # contender: (compiled, its extra arguments)
    "kvsim": (False, []),
    NO_FIGURES: (False, ["--no-plots"]),
    COMPILED: (True, []),
    COMPILED_NO_FIGURES: (True, ["--no-plots"]),
    EVERY_STEP: (False, ["--timeseries-bucket", "0"]),
}


def contenders(name: str, blis: Path | None, variants: list[str], compiled: bool) -> list[str]:
    """kvsim as it runs by default (its five figures drawn), and on the workloads that
    other simulators run, kvsim without figures and those simulators; on a million
    ShareGPT requests, also kvsim recording every step; with `compiled`, kvsim's
    compiled build beside each."""
    others_run = WORKLOADS[name].blis
    kvsim = ["kvsim"] + ([NO_FIGURES] if others_run else []) + ([EVERY_STEP] if name == "sharegpt_1m" else [])
    if compiled:
        kvsim += [COMPILED] + ([COMPILED_NO_FIGURES] if others_run else [])
    return kvsim + (variants if blis and others_run else [])


def measure(
    names: list[str],
    repeats: int,
    extra: list[str],
    blis: Path | None,
    million_repeats: int,
    variants: list[str],
    compiled: bool,
) -> dict:
    """{(workload, simulator): [run, ...]}, the runs made round-robin."""
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-") as tmp:
        packages = {False: ROOT}
        if compiled:
            from setup import compiled_copy

            packages[True] = compiled_copy(Path(tmp) / "compiled")
        for package in packages.values():
            compile_kvsim(package)
        for round_ in range(max(repeats, million_repeats)):
            for name in names:
                if round_ >= (million_repeats if name in MILLION else repeats):
                    continue
                for who in contenders(name, blis, variants, compiled):
                    if who in KVSIM_RUNS:
                        built, args = KVSIM_RUNS[who]
                        r = run_kvsim(name, [*extra, *args], Path(tmp), packages[built])
                    else:
                        r = run_blis(name, who, blis)
                    r.pop("stdout")
                    runs.setdefault((name, who), []).append(r)
                    print(
                        f"round {round_ + 1}  {name:<22} {who:<20} {r['wall_s']:7.2f} s wall "
                        f"{r['cpu_s']:7.2f} s cpu {r['peak_rss_mb']:7.0f} MB",
                        flush=True,
                    )
    return runs


def summarize(runs: list[dict]) -> dict:
    first = runs[0]
    return {
        "runs": len(runs),
        "walls": [r["wall_s"] for r in runs],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        **{k: first[k] for k in ("requests", "steps", "makespan_s", "mean_batch")},
    }


def profile(name: str, extra: list[str]) -> None:
    """Where the time of one run goes, in one process (cProfile inflates small
    functions: read shares, not seconds)."""
    from kvsim.cli.app import main

    w = WORKLOADS[name]
    with tempfile.TemporaryDirectory() as tmp:
        prof = cProfile.Profile()
        prof.enable()
        main(
            [
                "run",
                str(SCENARIOS / f"{w.scenario}.yaml"),
                "--quiet",
                "--force",
                "--out",
                str(Path(tmp) / "o"),
                "--jobs",
                "1",
                *w.kvsim_args(),
                *extra,
            ]
        )
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(30)


def default_blis() -> Path | None:
    found = os.environ.get("BLIS") or ROOT / "benchmarks" / "blis"
    return Path(found) if (Path(found) / "blis").is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--million", action="store_true", help="also the million-request workloads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--million-repeats", type=int, help="runs of each million-request workload (default: --repeats)")
    ap.add_argument("--exact-steps", action="store_true", help="kvsim's plain path, for comparison")
    ap.add_argument("--jobs", help="kvsim run --jobs (default: one worker per core)")
    ap.add_argument(
        "--blis",
        type=Path,
        default=default_blis(),
        help="BLIS's built source folder (build_blis.sh; default $BLIS or benchmarks/blis)",
    )
    ap.add_argument("--no-blis", action="store_true")
    ap.add_argument(
        "--blis-variants",
        nargs="+",
        choices=list(others.BLIS_VARIANTS),
        default=list(others.BLIS_VARIANTS),
        help="the BLIS runs to make (default: all; the targets are judged on its snapshot off)",
    )
    ap.add_argument(
        "--compiled", action="store_true", help="also kvsim's compiled build (setup.py; needs Cython and a C compiler)"
    )
    ap.add_argument("--write", action="store_true", help="regenerate benchmarks/RESULTS.md")
    ap.add_argument("--profile", choices=list(WORKLOADS))
    opts = ap.parse_args()
    extra = (["--exact-steps"] if opts.exact_steps else []) + (["--jobs", opts.jobs] if opts.jobs else [])
    if opts.profile:
        profile(opts.profile, extra)
        return
    names = opts.only or DEFAULT + (MILLION if opts.million else [])
    blis = None if opts.no_blis else opts.blis
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M")
    runs = measure(
        names, opts.repeats, extra, blis, opts.million_repeats or opts.repeats, opts.blis_variants, opts.compiled
    )
    table = {key: summarize(r) for key, r in runs.items()}
    text = report.render(
        table,
        command=" ".join(["python", "benchmarks/bench_speed.py", *sys.argv[1:]]),
        started=started,
        loads=(load_before, os.getloadavg()),
        extra=extra,
        workloads={name: WORKLOADS[name].described() for name in names},
    )
    print(text)
    if opts.write:
        (ROOT / "benchmarks" / "RESULTS.md").write_text(text)


if __name__ == "__main__":
    main()
