"""Simulation time alone (no start-up, no files, no figures), two checkouts side by side.

For each workload, a fresh process whose PYTHONPATH is one checkout loads the scenario
and times `run_scenario` with every policy in that process (one worker), tables
included; the import of kvsim and the reading of the scenario are left out. With
--against, the two checkouts take turns, run after run, so that a noisy shared machine
weighs on both alike; the medians and their ratio (this checkout over the other) are
printed, of wall time and of the process's CPU time (less swayed by a loaded machine).

    python benchmarks/bench_simulate.py --against /path/to/other/checkout --repeats 5
    python benchmarks/bench_simulate.py --only rag_8k vidur_10k sharegpt_1m --repeats 3

Not part of the test suite: it takes minutes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (scenario relative to a checkout, `kvsim run` overrides: num_requests, bucket_s)
WORKLOADS = {
    "rag_8k": ("scenarios/rag_8k.yaml", None, None),
    "vidur_10k": ("benchmarks/scenarios/vidur_10k.yaml", None, None),
    "sharegpt_100k": ("benchmarks/scenarios/sharegpt_1m.yaml", 100_000, 10.0),
    "sharegpt_1m": ("benchmarks/scenarios/sharegpt_1m.yaml", None, 10.0),
}
DEFAULT = ["rag_8k", "vidur_10k", "sharegpt_1m"]

CHILD = r"""
import json, sys, time
from pathlib import Path
scenario, num_requests, bucket_s = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    from kvsim.config.scenario import load_scenario
except ImportError:                      # the flat layout of older checkouts
    from kvsim.scenario import load_scenario
try:
    from kvsim.analysis.results import run_scenario
except ImportError:                      # where the runner made the tables
    try:
        from kvsim.sim.runner import run_scenario
    except ImportError:
        from kvsim.runner import run_scenario
scn, base = load_scenario(scenario)
if num_requests != "-":
    scn = scn.model_copy(update={"workload": scn.workload.model_copy(update={"num_requests": int(num_requests)})})
start, cpu = time.perf_counter(), time.process_time()
results = run_scenario(scn, base, scenario, workers=1, bucket_s=None if bucket_s == "-" else float(bucket_s))
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "steps": int(results.summary.steps.sum())}))
"""


def measure(repo: Path, name: str) -> dict:
    scenario, n, bucket = WORKLOADS[name]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(repo / scenario), str(n or "-"), str(bucket or "-")],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "KVSIM_CHECK_INVARIANTS": ""},
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} in {repo} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout, timed in turn with this one")
    opts = ap.parse_args()
    repos = {"this": ROOT} | ({"other": opts.against.resolve()} if opts.against else {})
    for name in opts.only or DEFAULT:
        runs: dict[str, list[dict]] = {k: [] for k in repos}
        for i in range(opts.repeats):
            order = list(repos) if i % 2 == 0 else list(reversed(repos))
            for key in order:
                runs[key].append(measure(repos[key], name))
        for what in ("seconds", "cpu"):
            times = {key: [r[what] for r in rs] for key, rs in runs.items()}
            line = f"{name:<14} {'wall' if what == 'seconds' else 'cpu':<4}" + "".join(
                f"  {key} {statistics.median(t):7.3f} s (steps {runs[key][-1]['steps']:,}; "
                f"runs {', '.join(f'{x:.3f}' for x in t)})"
                for key, t in times.items()
            )
            if opts.against:
                line += f"  ratio this/other {statistics.median(times['this']) / statistics.median(times['other']):.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
