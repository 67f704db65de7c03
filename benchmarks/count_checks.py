"""What `--check-invariants` does on a real run, and what it costs.

1. Counts, in-process, the checks one run makes: the engine checks the whole state
   after planning and after completing every step (two per step, so 2 x the `steps`
   column of summary.csv); each check runs the allocator's own check_invariants (every
   block or region and hole), then compares every running and waiting request with the
   allocator, and the breakdown with the pool.
2. Times the real command with and without the flag, in subprocesses, and reports the
   median of each and their ratio. Machines here are shared and noisy: read the median.

    python benchmarks/count_checks.py [--scenario scenarios/rag_8k.yaml] [--repeats 3] [--no-timing]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count(scenario: Path) -> None:
    from kvsim.analysis import results as tables
    from kvsim.sim import runner, scheduler
    from kvsim.config.scenario import load_scenario

    calls, requests = Counter(), Counter()
    real = scheduler.Scheduler.check
    current = {"policy": None}

    def counted(self):
        calls[current["policy"]] += 1
        requests[current["policy"]] += len(self.running) + len(self.waiting)
        return real(self)

    simulate = runner.simulate

    def simulate_one(name, *args, **kwargs):
        current["policy"] = name
        return simulate(name, *args, **kwargs)

    scheduler.Scheduler.check, runner.simulate = counted, simulate_one
    scn, base = load_scenario(scenario)
    started = time.perf_counter()
    results = tables.run_scenario(scn, base, str(scenario), check_invariants=True)
    elapsed = time.perf_counter() - started
    scheduler.Scheduler.check, runner.simulate = real, simulate
    print(f"{scenario} with --check-invariants ({elapsed:.0f} s in-process):")
    print(f"{'policy':<20} {'steps':>7} {'checks':>8} {'request checks':>15}")
    for row in results.summary.itertuples():
        assert calls[row.policy] == 2 * row.steps, "two checks per step"
        print(f"{row.policy:<20} {row.steps:>7,} {calls[row.policy]:>8,} {requests[row.policy]:>15,}")
    total_steps = int(results.summary.steps.sum())
    print(f"{'total':<20} {total_steps:>7,} {sum(calls.values()):>8,} {sum(requests.values()):>15,}")
    assert sum(calls.values()) == 2 * total_steps, "two checks per step"


def wall(scenario: Path, repeats: int) -> None:
    times: dict[str, list[float]] = {"without": [], "with": []}
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_CHECK_INVARIANTS"}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for mode, flag in (("without", []), ("with", ["--check-invariants"])):
                start = time.perf_counter()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "kvsim.cli",
                        "run",
                        str(scenario),
                        "--quiet",
                        "--out",
                        str(Path(tmp) / mode),
                        *flag,
                    ],
                    check=True,
                    env=env,
                )
                times[mode].append(time.perf_counter() - start)
                print(f"run {i + 1} {mode:<7} --check-invariants: {times[mode][-1]:.1f} s", flush=True)
    plain, checked = (statistics.median(times[m]) for m in ("without", "with"))
    print(
        f"median without {plain:.1f} s, with {checked:.1f} s: the check mode costs "
        f"{checked / plain:.1f}x over {repeats} runs each"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", type=Path, default=ROOT / "scenarios" / "rag_8k.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    count(args.scenario)
    if not args.no_timing:
        wall(args.scenario, args.repeats)


if __name__ == "__main__":
    main()
