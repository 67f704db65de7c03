"""What KV tiers cost in simulation time: a policy of a scenario run with its kv_offload
and without it, alternated, medians of several runs each, for every case in one run.

The target: a tiered run takes at most 1.5x the same run without tiers. Both runs are
the same policy on the same requests; the tiered one also stores every prompt chunk,
looks up the tiers at every admission and records their occupancy each step. Only the
simulation is timed (run_scenario: no files, no figures), in CPU seconds of this
process, which other jobs on a shared machine disturb less than wall time; read the
ratio of medians. The cases: retrieval-augmented prompts of ~5,600 tokens over a host
tier (LRU, ARC) and a host tier with a disk behind it, multi-turn chat and a shared
system prompt, each with its chunks of 16 tokens (vLLM's default: the GPU's block), and
the retrieval prompts under SGLang with HiCache's default host pool (2x the GPU's) behind
its radix cache in pages of 16.

    python benchmarks/bench_tiers.py [--repeats 5] [--num-requests 1000]
    python benchmarks/bench_tiers.py --scenario scenarios/rag_offload.yaml --policy cpu-16g
                                     [--offload '{cpu_gib: 16}']
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import yaml

from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario

TARGET = 1.5
ROOT = Path(__file__).parents[1]
SGLANG = ({"engine": "sglang"}, {"prefix_cache": "radix"})  # SGLang's radix cache, HiCache behind it
CASES = [  # (scenario, policy, kv_offload to give it: None keeps its own[, scenario and policy changes])
    ("scenarios/rag_offload.yaml", "cpu-16g", None),
    ("scenarios/rag_offload.yaml", "cpu-16g-arc", None),
    ("scenarios/rag_offload.yaml", "cpu-4g-disk-64g", None),
    ("scenarios/chat_multiturn.yaml", "paged-16-prefix", {"cpu_gib": 16}),
    ("scenarios/shared_system_prompt.yaml", "paged-16-prefix", {"cpu_gib": 4, "disk_gib": 64}),
    ("scenarios/rag_offload.yaml", "gpu-only", {"hicache_ratio": 2.0}, *SGLANG),
]


def timed(doc: dict, base: Path) -> float:
    scn = validate_scenario(copy.deepcopy(doc), "bench")
    start = time.process_time()
    run_scenario(scn, base, "bench")
    return time.process_time() - start


def case(
    scenario: str,
    policy: str,
    offload: dict | None,
    repeats: int,
    num_requests: int,
    top: dict | None = None,
    changes: dict | None = None,
) -> dict:
    path = ROOT / scenario if not Path(scenario).is_absolute() else Path(scenario)
    doc = {**yaml.safe_load(path.read_text()), **(top or {})}
    doc["workload"]["num_requests"] = num_requests
    tiered = {**next(p for p in doc["policies"] if p["name"] == policy), **(changes or {})}
    if offload is not None:
        tiered = {**tiered, "kv_offload": offload}
    plain = {k: v for k, v in tiered.items() if k != "kv_offload"}
    runs = {"plain": {**doc, "policies": [plain]}, "tiered": {**doc, "policies": [tiered]}}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, d in runs.items():
            times[name].append(timed(d, path.parent))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "case": f"{path.stem} {policy} {yaml.safe_dump(tiered['kv_offload'], default_flow_style=True).strip()}",
        "plain_s": med["plain"],
        "tiered_s": med["tiered"],
        "ratio": med["tiered"] / med["plain"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--scenario", help="one case: this scenario (with --policy)")
    ap.add_argument("--policy")
    ap.add_argument("--offload", help="kv_offload to give the policy, as YAML (default: its own)")
    args = ap.parse_args()
    cases = (
        [(args.scenario, args.policy, yaml.safe_load(args.offload) if args.offload else None)]
        if args.scenario
        else CASES
    )
    rows = []
    for scenario, policy, offload, *changes in cases:
        rows.append(case(scenario, policy, offload, args.repeats, args.num_requests, *changes))
        r = rows[-1]
        print(f"{r['case']}: plain {r['plain_s']:.2f} s, tiered {r['tiered_s']:.2f} s, {r['ratio']:.2f}x", flush=True)
    worst = max(r["ratio"] for r in rows)
    print(
        f"medians of {args.repeats} alternated runs each, {args.num_requests} requests, CPU seconds; "
        f"largest ratio {worst:.2f}x (target at most {TARGET}x)"
    )
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
