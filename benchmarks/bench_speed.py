"""How fast kvsim runs (issue 12): whole-process wall time, CPU time, simulated requests
per wall second and peak memory, for the workloads the issue sets, and where time goes.

Each workload runs the real command (`kvsim run ...` through kvsim.cli.app's main:
start-up, every policy, Parquet files and plots, with the policies and figures in one
worker process per core as `kvsim run` does by default) in a fresh process that reports
its CPU time and its workers', and the peak RSS of the largest of them; the wall time is
measured around it. Machines here are shared and noisy: read medians (--repeats) and
compare runs made in one session.

    python benchmarks/bench_speed.py                  # vidur_10k, sharegpt 10k and 100k (100k
                                                      # also with prefix caching), rag_8k
    python benchmarks/bench_speed.py --million        # also one million ShareGPT requests, both ways
    python benchmarks/bench_speed.py --only rag_8k --repeats 5 [--exact-steps] [--jobs 1]
    python benchmarks/bench_speed.py --profile sharegpt_10k   # cProfile of one run, in-process

Not part of the test suite: it takes minutes.
"""
import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

# name -> (scenario, extra `kvsim run` arguments)
WORKLOADS = {
    "vidur_10k": (HERE / "scenarios" / "vidur_10k.yaml", []),
    "sharegpt_10k": (HERE / "scenarios" / "sharegpt_1m.yaml", ["--num-requests", "10000"]),
    "sharegpt_100k": (HERE / "scenarios" / "sharegpt_1m.yaml", ["--num-requests", "100000",
                                                                "--timeseries-bucket", "10"]),
    "sharegpt_1m": (HERE / "scenarios" / "sharegpt_1m.yaml", ["--timeseries-bucket", "10"]),
    "sharegpt_100k_prefix": (HERE / "scenarios" / "sharegpt_1m_prefix.yaml", ["--num-requests", "100000",
                                                                              "--timeseries-bucket", "10"]),
    "sharegpt_1m_prefix": (HERE / "scenarios" / "sharegpt_1m_prefix.yaml", ["--timeseries-bucket", "10"]),
    "rag_8k": (ROOT / "scenarios" / "rag_8k.yaml", []),
}
DEFAULT = ["vidur_10k", "sharegpt_10k", "sharegpt_100k", "sharegpt_100k_prefix", "rag_8k"]
ONCE = ("sharegpt_100k", "sharegpt_1m")       # workloads (and their _prefix twins) run once


def child(args: list[str]) -> None:
    """Run `kvsim ARGS` in this process, then print its CPU seconds (with its worker
    processes': kvsim.sim.parallel) and the peak RSS of the largest of them."""
    from kvsim.cli.app import exit_now, main
    code = main(args)
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"code": code, "cpu_s": sum(u.ru_utime + u.ru_stime for u in (me, workers)),
                      "peak_rss_mb": max(me.ru_maxrss, workers.ru_maxrss) / 1024}), file=sys.stderr)
    exit_now(code)      # as the `kvsim` command ends (kvsim.cli.app.entry)


def measure(name: str, extra: list[str], out: Path) -> dict:
    scenario, args = WORKLOADS[name]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", "run", str(scenario), "--quiet", "--force",
                           "--out", str(out / name), *args, *extra],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    report = json.loads(done.stderr.strip().splitlines()[-1])
    if report["code"] != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    import pandas as pd
    summary = pd.read_csv(out / name / "summary.csv")
    requests = int(summary.requests_total.iloc[0])
    return {"name": name, "requests": requests, "policies": len(summary), "steps": int(summary.steps.sum()),
            "simulated_s": float(summary.makespan_s.max()), "wall_s": wall, **report}


def profile(name: str, extra: list[str]) -> None:
    """Where the time of one run goes (cProfile inflates small functions; read shares)."""
    from kvsim.cli.app import main
    scenario, args = WORKLOADS[name]
    with tempfile.TemporaryDirectory() as tmp:
        prof = cProfile.Profile()
        prof.enable()
        main(["run", str(scenario), "--quiet", "--force", "--out", str(Path(tmp) / "out"), "--jobs", "1",
              *args, *extra])      # one process: workers' time would escape the profile
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--million", action="store_true", help="also run one million ShareGPT requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exact-steps", action="store_true", help="the plain path, for comparison")
    ap.add_argument("--jobs", help="kvsim run --jobs (default: one worker per core)")
    ap.add_argument("--profile", choices=list(WORKLOADS))
    opts = ap.parse_args()
    extra = (["--exact-steps"] if opts.exact_steps else []) + (["--jobs", opts.jobs] if opts.jobs else [])
    if opts.profile:
        profile(opts.profile, extra)
        return
    names = opts.only or DEFAULT + (["sharegpt_1m", "sharegpt_1m_prefix"] if opts.million else [])
    print(f"{'workload':<20} {'requests':>9} {'steps':>9} {'wall s':>8} {'cpu s':>8} "
          f"{'req/s':>9} {'sim s/s':>8} {'RSS MB':>7}   (median of runs; 1M and 100k run once)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            runs = [measure(name, extra, Path(tmp))
                    for _ in range(1 if name.startswith(ONCE) else opts.repeats)]
            wall = statistics.median(r["wall_s"] for r in runs)
            cpu = statistics.median(r["cpu_s"] for r in runs)
            rss = max(r["peak_rss_mb"] for r in runs)
            r = runs[0]
            walls = ", ".join(f"{x['wall_s']:.2f}" for x in runs)
            print(f"{name:<20} {r['requests']:>9,} {r['steps']:>9,} {wall:>8.2f} {cpu:>8.2f} "
                  f"{r['requests'] * r['policies'] / wall:>9,.0f} {r['simulated_s'] * r['policies'] / wall:>8.0f} "
                  f"{rss:>7.0f}   walls {walls}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
