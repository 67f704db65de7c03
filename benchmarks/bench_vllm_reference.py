"""How much slower vLLM's own scheduler (engine vllm-reference's core,
kvsim.engines.vllm_reference) is than kvsim's native vllm-v1 rules on the same stream:
a shipped scenario's first requests (kvsim.sim.differential.scenario_stream, full
outputs), both schedulers stepped alike with nothing traced but what each schedules,
medians of --repeats, alternated. kvsim's time here is its plain (exact) scheduler
without the simulation around it; `kvsim run` adds the clock, cost model and records.
With --runs, whole runs instead: the scenario's paged policies, its first --requests
requests, as `kvsim run` simulates them (in this process, one worker), under
`engine: vllm-v1` (its defaults, the fast path included) and `engine: vllm-reference`,
in wall time and in CPU time (less swayed by a loaded machine).

    python benchmarks/bench_vllm_reference.py [--scenario scenarios/rag_8k.yaml] [--requests 400] [--runs]

Needs the kvsim[vllm] extra and vLLM (kvsim.engines.vllm_reference.INSTALL).
Not part of the test suite.
"""

import argparse
import statistics
import time
from pathlib import Path

from kvsim.sim.differential import run_native, run_reference, scenario_stream
from kvsim.engines.vllm_reference import load_vllm

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "rag_8k.yaml"))
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", action="store_true", help="time whole kvsim runs per engine")
    args = ap.parse_args()
    load_vllm()
    if args.runs:
        return time_runs(args)
    stream, setup = scenario_stream(args.scenario, n=args.requests, max_output=10**9)
    times = {"kvsim vllm-v1": [], "vLLM 0.33.0 scheduler": []}
    steps = 0
    for _ in range(args.repeats):
        for name, run in (("kvsim vllm-v1", run_native), ("vLLM 0.33.0 scheduler", run_reference)):
            t = time.perf_counter()
            steps = len(run(stream, setup, trace=False))
            times[name].append(time.perf_counter() - t)
    native, ref = (statistics.median(v) for v in times.values())
    print(f"{Path(args.scenario).name}: {len(stream)} requests, {steps} steps, {setup.num_blocks} blocks")
    print(
        f"kvsim vllm-v1 {native:.2f} s ({steps / native:,.0f} steps/s); vLLM's scheduler {ref:.2f} s "
        f"({steps / ref:,.0f} steps/s): {ref / native:.1f}x slower (medians of {args.repeats})"
    )


def time_runs(args) -> None:
    import yaml
    from kvsim.analysis.results import run_scenario
    from kvsim.config.scenario import validate_scenario

    path = Path(args.scenario)
    raw = yaml.safe_load(path.read_text())
    raw["workload"] = {**raw["workload"], "num_requests": args.requests}
    raw["policies"] = [p for p in raw["policies"] if p.get("allocator") == "paged"]
    times: dict[str, list[float]] = {"vllm-v1": [], "vllm-reference": []}
    cpu: dict[str, list[float]] = {"vllm-v1": [], "vllm-reference": []}
    for _ in range(args.repeats):
        for engine in times:
            scn = validate_scenario({**raw, "engine": engine}, str(path))
            t, c = time.perf_counter(), time.process_time()
            run_scenario(scn, path.parent, str(path), workers=1)  # in this process: its CPU time counts all
            times[engine].append(time.perf_counter() - t)
            cpu[engine].append(time.process_time() - c)
    print(f"{path.name}: {args.requests} requests, {len(raw['policies'])} paged policies, one worker")
    for what, got in (("wall", times), ("cpu", cpu)):
        native, ref = (statistics.median(v) for v in got.values())
        print(
            f"{what}: kvsim run, engine vllm-v1 {native:.2f} s; engine vllm-reference {ref:.2f} s: "
            f"{ref / native:.1f}x slower (medians of {args.repeats})"
        )


if __name__ == "__main__":
    main()
