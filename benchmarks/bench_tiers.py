"""What KV tiers cost in simulation time: one policy of a scenario run with its
kv_offload and without it, alternated, medians of several runs each.

The target: a tiered run takes at most 1.5x the same run without tiers. Both runs are
the same policy on the same requests; the tiered one also stores every prompt chunk,
looks up the tiers at every admission and records their occupancy each step. Only the
simulation is timed (run_scenario: no files, no figures), in CPU seconds of this
process, which other jobs on a shared machine disturb less than wall time; read the
ratio of medians.

    python benchmarks/bench_tiers.py [--repeats 5] [--scenario scenarios/rag_offload.yaml]
                                     [--policy cpu-4g-disk-64g] [--num-requests 1000]
                                     [--offload '{cpu_gib: 16}']
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import yaml

from kvsim.sim.runner import run_scenario
from kvsim.config.scenario import validate_scenario

TARGET = 1.5


def timed(doc: dict, base: Path) -> float:
    scn = validate_scenario(copy.deepcopy(doc), "bench")
    start = time.process_time()
    run_scenario(scn, base, "bench")
    return time.process_time() - start


def main() -> int:
    root = Path(__file__).parents[1]
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scenario", default=str(root / "scenarios" / "rag_offload.yaml"))
    ap.add_argument("--policy", default="cpu-4g-disk-64g")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--offload", help="kv_offload to give the policy, as YAML (default: its own)")
    args = ap.parse_args()
    doc = yaml.safe_load(Path(args.scenario).read_text())
    doc["workload"]["num_requests"] = args.num_requests
    tiered = next(p for p in doc["policies"] if p["name"] == args.policy)
    if args.offload:
        tiered = {**tiered, "kv_offload": yaml.safe_load(args.offload)}
    plain = {k: v for k, v in tiered.items() if k != "kv_offload"}
    runs = {"tiered": {**doc, "policies": [tiered]}, "plain": {**doc, "policies": [plain]}}
    times = {name: [] for name in runs}
    for i in range(args.repeats):
        for name, d in runs.items():
            times[name].append(timed(d, Path(args.scenario).parent))
        print(f"run {i + 1}: plain {times['plain'][-1]:.2f} s, tiered {times['tiered'][-1]:.2f} s (CPU)", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["tiered"] / med["plain"]
    print(f"median plain {med['plain']:.2f} s, tiered {med['tiered']:.2f} s: {ratio:.2f}x "
          f"(target at most {TARGET}x) over {args.repeats} runs each of policy {args.policy} "
          f"in {args.scenario}, {args.num_requests} requests")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
