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

    python benchmarks/bench_tiers.py [--repeats 5] [--num-requests 1000] [--write]
    python benchmarks/bench_tiers.py --scenario scenarios/rag_offload.yaml --policy cpu-16g
                                     [--offload '{cpu_gib: 16}']

--write (all the cases only) regenerates benchmarks/TIERS_RESULTS.md from the runs just
made: every run's CPU seconds, the medians and their ratio, the machine's load; never
edited by hand. docs/kv-tiers.md quotes it through scripts/tiers_speed_page.py.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario

TARGET = 1.5
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "TIERS_RESULTS.md"
DATA = "<!-- data: "  # the line of TIERS_RESULTS.md that holds the runs as JSON
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
        "plain_runs": times["plain"],
        "tiered_runs": times["tiered"],
    }


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def results_text(data: dict) -> str:
    """TIERS_RESULTS.md from a run of every case: its header, a table of the medians and
    each run, and the runs themselves as JSON on the last line (what the docs read)."""
    rows = data["rows"]
    worst = max(r["ratio"] for r in rows)
    lines = [
        "# KV tiers: what they cost in simulation time",
        "",
        f"Written by `{data['command']}` on {data['started']} (load average {data['load_before']:.1f} before, "
        f"{data['load_after']:.1f} after; {data['cpus']} CPUs). Each case is one policy run on the same "
        f"{data['num_requests']:,} requests with its kv_offload and without it, alternated, {data['repeats']} "
        "times each; CPU seconds of the simulation alone (no files, no figures); the ratio is that of the "
        f"medians. The target: at most {TARGET}x.",
        "",
        "| case | without tiers (s) | with tiers (s) | ratio | runs without | runs with |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['plain_s']:.2f} | {r['tiered_s']:.2f} | {r['ratio']:.2f}x "
            f"| {_runs(r['plain_runs'])} | {_runs(r['tiered_runs'])} |"
        )
    verdict = "within" if worst <= TARGET else "over"
    lines += ["", f"Largest ratio {worst:.2f}x: {verdict} the target of {TARGET}x.", ""]
    lines.append(DATA + json.dumps(data, sort_keys=True) + " -->")
    return "\n".join(lines) + "\n"


def read_results(path: Path = RESULTS) -> dict:
    """The runs TIERS_RESULTS.md holds (its JSON line)."""
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith(DATA))
    return json.loads(line[len(DATA) : -len(" -->")])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--scenario", help="one case: this scenario (with --policy)")
    ap.add_argument("--policy")
    ap.add_argument("--offload", help="kv_offload to give the policy, as YAML (default: its own)")
    ap.add_argument("--write", action="store_true", help="regenerate benchmarks/TIERS_RESULTS.md (all cases)")
    args = ap.parse_args()
    if args.write and args.scenario:
        ap.error("--write takes every case: leave out --scenario")
    cases = (
        [(args.scenario, args.policy, yaml.safe_load(args.offload) if args.offload else None)]
        if args.scenario
        else CASES
    )
    load_before, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M", time.gmtime())
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
    if args.write:
        command = (
            f"python benchmarks/bench_tiers.py --repeats {args.repeats} --num-requests {args.num_requests} --write"
        )
        data = {
            "command": command,
            "started": started,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "num_requests": args.num_requests,
            "rows": rows,
        }
        RESULTS.write_text(results_text(data))
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
