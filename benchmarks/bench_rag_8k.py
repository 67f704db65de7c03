"""How long the main job takes: `kvsim run scenarios/rag_8k.yaml`, end to end.

Runs the real command (CLI start-up, simulation of every policy, Parquet, plots) in a
subprocess several times and reports the median and spread of wall-clock seconds.
Machines here are shared and noisy: read the median, not one run.

    python benchmarks/bench_rag_8k.py [--repeats 5] [--scenario scenarios/rag_8k.yaml]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scenario", default=str(Path(__file__).parents[1] / "scenarios" / "rag_8k.yaml"))
    args = ap.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "kvsim.cli", "run", args.scenario, "--quiet", "--out", str(Path(tmp) / "out")],
                check=True,
            )
            times.append(time.perf_counter() - start)
            print(f"run {i + 1}: {times[-1]:.2f} s", flush=True)
    print(
        f"median {statistics.median(times):.2f} s  min {min(times):.2f}  max {max(times):.2f}"
        f"  over {len(times)} runs of {args.scenario}"
    )


if __name__ == "__main__":
    main()
