"""The figures the documentation quotes that need the reference data (public traces,
timings and benchmark runs that kvsim does not ship), measured into small files under
results/docs/ that the pages are rendered from (scripts/docs_tables.py,
scripts/step_costs_page.py), so that the pages and the checks that they are current need
no data.

    python scripts/docs_results.py --data DIR                # everything (~20 minutes on two cores)
    python scripts/docs_results.py --data DIR --only tiers

DIR holds `traces/mooncake_synthetic_trace.jsonl` (Mooncake's synthetic trace, Qin et
al., FAST 2025), `profiling/` (vidur's per-operator timings, read by
scripts/derive_profiles.py), `serving/` (splitwise-sim's measured iterations, read by
scripts/derive_overheads.py) and `vllm-h100/` (vLLM V1 benchmark runs). Parts:

- `tiers` (results/docs/mooncake_tiers.csv): the prefix hit rate of Mooncake's trace on a
  fleet with host-memory tiers, local to each replica or shared by all: the grid of
  `kvsim reproduce --claim 12` (4 replicas, round-robin), the same 128 GiB policies on 8
  replicas and behind the prefix-aware router, and the trace's hit rate with an unlimited
  cache. What it measures is scenarios/claims/mooncake_fig10.yaml and
  scenarios/mooncake_shared_tiers.yaml on the whole trace (~8 minutes).
- `sources` (results/docs/step_costs_sources.json): what docs/step-costs.md quotes of the
  source data that the shipped profiles and overheads do not keep (seconds).
- `cpu_calibrate` (the same file): `kvsim calibrate --device cpu --quick` a few times on
  this machine, needing no data but `kvsim[calibrate]` (a few minutes each).
- `pool` (results/docs/vllm_kv_pool.csv): vLLM H100 runs that went past their capacity
  replayed as `kvsim validate` replays them (the shipped overhead), with the KV pool
  kvsim sizes from vLLM's rules and with smaller pools pinned per GPU
  (kvsim.calibrate.replay, `kv_cache_gib`): what each pool makes of every stage (~2
  minutes).
- `per_seq` (results/docs/vllm_per_seq.csv): every vLLM H100 run replayed as `kvsim
  validate` replays it, with the shipped overhead and with its per-sequence host term at
  zero, everything else as shipped: what that term carries in the fit (~1 minute).

The tests check that the pages are what these files give, and, where DIR is beside the
checkout (../shared/data), that `sources` is what the data give, and that `tiers` holds
the runs this script makes, its unlimited row and one fleet's run as the data give them;
the whole `tiers` rerun is a slow test run on request (KVSIM_DOCS_RESULTS=1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "docs"
TIERS = OUT / "mooncake_tiers.csv"
SOURCES = OUT / "step_costs_sources.json"
POOL = OUT / "vllm_kv_pool.csv"
PER_SEQ = OUT / "vllm_per_seq.csv"
MOONCAKE = "traces/mooncake_synthetic_trace.jsonl"


# the fleets measured: (scenario, what overrides its replicas or router)
FLEETS = (
    ("claims/mooncake_fig10.yaml", {}),
    ("mooncake_shared_tiers.yaml", {"replicas": 8}),
    ("mooncake_shared_tiers.yaml", {"router": "prefix-aware"}),
)


def fleet_scenario(scenario: str, trace: Path, **fleet):
    """A tiers scenario on the whole trace, with `fleet` (replicas, router, policies)
    overriding its own."""
    from kvsim.config.scenario import read_yaml, validate_scenario

    src = ROOT / "scenarios" / scenario
    raw = read_yaml(src, "scenario keys (name, model, ...)")
    raw.update(workload={**raw["workload"], "trace": str(trace.resolve())}, **fleet)
    return validate_scenario(raw, str(src)), src


def _fleet_run(scenario: str, trace: Path, **fleet) -> pd.DataFrame:
    """One tiers scenario on the whole trace, with `fleet` overriding its own: one row
    per tier kind and host-memory size (a policy alone gives the row it gets beside the
    others: each policy's run is its own)."""
    from kvsim.analysis.results import run_scenario

    scn, src = fleet_scenario(scenario, trace, **fleet)
    summary = run_scenario(scn, src.parent, str(src)).summary.set_index("policy")
    rows = []
    for p in scn.policies:
        rows.append(
            {
                **fleet_key(scenario, scn, p),
                "prefix_hit_rate": float(summary.prefix_hit_rate[p.name]),
                "prefix_hit_rate_gpu": float(summary.get("prefix_hit_rate_gpu", summary.prefix_hit_rate)[p.name]),
            }
        )
        print(f"{scenario} {scn.fleet} {p.name}: {rows[-1]['prefix_hit_rate']:.4f}", flush=True)
    return pd.DataFrame(rows)


def fleet_key(scenario: str, scn, policy) -> dict:
    """The columns that name a policy's row: its fleet, its tier kind and size."""
    replicas, router = scn.fleet
    kind = "gpu-only" if policy.tiers is None else ("shared" if policy.tiers.shared else "local")
    return {
        "scenario": scenario,
        "replicas": replicas,
        "router": router,
        "tier": kind,
        "cpu_gib_per_replica": 0.0 if policy.tiers is None else float(policy.tiers.cpu_gib),
    }


def tiers(data: Path) -> pd.DataFrame:
    trace = data / MOONCAKE
    if not trace.is_file():
        raise SystemExit(f"tiers needs {trace}")
    table = pd.concat([_fleet_run(scenario, trace, **fleet) for scenario, fleet in FLEETS])
    return pd.concat([table, pd.DataFrame([unlimited_row(trace)])])


def unlimited_row(trace: Path) -> dict:
    """The trace's prefix hit rate with an unlimited cache (kvsim cache-curve's LRU)."""
    from kvsim.analysis.block_refs import block_references
    from kvsim.analysis.cache_curve import cache_curve
    from kvsim.reproduce.mooncake import BLOCK
    from kvsim.workload.traces import trace_requests

    curve = cache_curve(block_references(trace_requests(trace), BLOCK), [math.inf])
    unlimited = float(curve[curve.policy == "lru"].hit_rate.iloc[0])
    unlimited_row = {
        "scenario": f"kvsim cache-curve (blocks of {BLOCK})",
        "replicas": 1,
        "router": "",
        "tier": "unlimited",
        "cpu_gib_per_replica": math.inf,
        "prefix_hit_rate": unlimited,
        "prefix_hit_rate_gpu": unlimited,
    }
    return unlimited_row


def _script(name: str):
    """One of the scripts beside this one, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources(data: Path) -> dict:
    """Figures of the source data behind the shipped profiles and A100 overhead that the
    shipped files do not keep: how many token counts vidur measured, how many iterations
    splitwise-sim's file holds, the launch time of each leave-one-out fit, and the spread
    of the repeated runs where the overhead's held-out misses are."""
    from kvsim.cost.overhead_fit import configurations, fit_overhead
    from kvsim.cost.generalize import gpu_fits

    profiles = _script("derive_profiles")
    counts = {}
    for family, file in (("llama-2", "a100_Llama-2-7b-hf.mlp.csv"), ("llama-3", "a100_Meta-Llama-3-8B.mlp.csv")):
        long = profiles.read_mlp(data / "profiling" / file)
        counts[family] = int(long.groupby("tp").num_tokens.nunique().max())
    overheads = _script("derive_overheads")
    raw = pd.read_csv(data / "serving" / "splitwise_a100.csv")
    pts = overheads.points(configurations(raw))
    bus = gpu_fits()[overheads.GPU.name]["allreduce"]["bus_gb_s"]
    use, fitted = ~pts.excluded, pts.model == overheads.FITTED
    folds = [fitted & (pts.tp != tp) for tp in sorted(pts[fitted].tp.unique())] + [fitted]
    launches = [fit_overhead(pts[train & use], bus)["host"]["launch_per_layer_ms"] for train in folds]

    def spread(tp: int, batch: int) -> str:
        runs = raw[(raw.model == "llama2-70b") & (raw.tensor_parallel == tp) & (raw.prompt_size == 512)]
        runs = runs[(runs.batch_size == batch) & (runs.token_size == 128)].prompt_time
        return f"{runs.min():,.0f}-{runs.max():,.0f}"

    doc = {
        "source": "scripts/docs_results.py --only sources: vidur's profiling CSVs, splitwise-sim's perf_model.csv, "
        "one vLLM V1 H100 run under the A100 overhead",
        "profiles": {"measured_token_counts": counts},
        "overhead": {
            "ov_iterations": len(raw),
            "loo_launch": f"{min(launches):.2f}-{max(launches):.2f}",
            "spread_tp8_32": spread(8, 32),
            "spread_tp4_16": spread(4, 16),
        },
    }
    doc["vllm_splitwise"] = _validate(data / "vllm-h100" / VLLM_RUN, "splitwise-a100-v2")
    return doc


VLLM_RUN = "llama-2-7b-tp1-codegen"  # the run docs/step-costs.md shows, stage 0


def _validate(run: Path, overhead: str) -> dict:
    """Stage 0 of `kvsim validate RUN --cost-model OVERHEAD`: what it predicts."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kvsim.cli", "validate", str(run), "--cost-model", overhead, "--out", tmp]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        row = pd.read_csv(Path(tmp) / "validation.csv").iloc[0]
    keep = ("e2e_mean_predicted_s", "ttft_p50_predicted_s", "itl_mean_predicted_s")
    return {"run": run.name, "stage": int(row.stage), "cost_model": row.cost_model, **{k: float(row[k]) for k in keep}}


def _update(path: Path, doc: dict) -> None:
    """Write `doc`'s keys into the JSON file at `path`, keeping the other parts' keys."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**old, **doc}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


QUICK_RUNS = 5


def cpu_calibrate(data: Path) -> dict:
    """`kvsim calibrate --device cpu --quick` a few times on this machine, each profile's
    whole steps against its sum of parts (needs `kvsim[calibrate]`; no data)."""
    model, runs = "llama-3-8b", []
    for i in range(QUICK_RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            kvsim = [sys.executable, "-m", "kvsim.cli", "calibrate"]
            subprocess.run([*kvsim, "--model", model, "--device", "cpu", "--quick", "--out", tmp], check=True, cwd=ROOT)
            done = subprocess.run(
                [*kvsim, "--report", tmp, "--json"], check=True, cwd=ROOT, capture_output=True, text=True
            )
        e2e = json.loads(done.stdout)["end_to_end"]
        runs.append({"mape": e2e["mape"], "errors": [s["error"] for s in e2e["steps"]]})
        print(f"cpu calibrate {i + 1}/{QUICK_RUNS}: whole steps MAPE {e2e['mape']:.1%}", flush=True)
    return {"cpu_calibrate": {"model": model, "cores": os.cpu_count(), "runs": runs}}


# The runs replayed under other KV pools, each with the pools (GiB per GPU; None: as
# vLLM would size it) it is replayed with: the Mixtral run that kvsim's pool leaves far
# off, its other run, and the two dense runs past their capacity for comparison.
POOL_RUNS = {
    "mixtral-8x7b-v0-1-tp2-reasoning": (None, 16.0, 12.0, 10.0, 9.0, 8.5, 8.0),
    "mixtral-8x7b-v0-1-tp2-general": (None, 8.5),
    "codellama-34b-tp2-reasoning": (None, 16.0),
    "llama-2-7b-tp1-reasoning": (None, 50.0, 42.0),
}


def replayed(name: str, run, overhead, pool_gib: float | None = None, **columns) -> list[dict]:
    """`run` replayed as `kvsim validate` replays it under `overhead` (the KV pool per GPU
    pinned to `pool_gib`): one row per stage, `columns` first, predicted beside measured."""
    from kvsim.calibrate.replay import Replay

    replay = Replay(run, kv_cache_gib=pool_gib)
    simulated = replay.simulate(overhead)
    rows = [
        {
            "run": name,
            "stage": seen.index,
            **columns,
            "kv_cache_tokens": simulated.capacity_slots,
            "preemptions": simulated.preemptions,
            **{
                f"{what}_{stat}_{side}_s": (got if side == "predicted" else seen).get(what, stat)
                for what, stat in (("e2e", "mean"), ("ttft", "p50"), ("itl", "mean"))
                for side in ("predicted", "measured")
            },
            "answered_predicted": got.answered,
            "answered_measured": seen.answered,
        }
        for got, seen in zip(replay.report(simulated, overhead), run.stages)
    ]
    print(f"{name} ({columns}): {rows[-1]}", flush=True)
    return rows


def pool(data: Path) -> pd.DataFrame:
    """Each of POOL_RUNS replayed under each of its pools, with the shipped overhead: one
    row per stage, predicted beside measured."""
    from kvsim.calibrate.runs import read_run
    from kvsim.cost.overhead import VLLM_V1_H100, load_overhead

    overhead, rows = load_overhead(VLLM_V1_H100), []
    for name, pools in POOL_RUNS.items():
        run = read_run(data / "vllm-h100" / name)
        for gib in pools:
            rows += replayed(name, run, overhead, gib, kv_cache_gib="vllm" if gib is None else gib)
    return pd.DataFrame(rows)


def per_seq(data: Path, names: list[str] | None = None) -> pd.DataFrame:
    """Every run (or those `names`) replayed with the shipped overhead and with its
    per-sequence host term at zero: one row per stage and overhead."""
    from dataclasses import replace

    from kvsim.calibrate.runs import read_run, run_dirs
    from kvsim.cost.overhead import VLLM_V1_H100, load_overhead

    shipped, rows = load_overhead(VLLM_V1_H100), []
    for name in names or [p.name for p in run_dirs(data / "vllm-h100")]:
        run = read_run(data / "vllm-h100" / name)
        for overhead in (shipped, replace(shipped, per_seq_s=0.0)):
            got = replayed(name, run, overhead, per_seq_us=round(overhead.per_seq_s * 1e6, 3))
            rows += [{**row, "rate_per_s": seen.rate_per_s} for row, seen in zip(got, run.stages)]
    return pd.DataFrame(rows)


def csv_text(table: pd.DataFrame) -> str:
    """A table as its file under results/docs/ holds it."""
    return table.to_csv(index=False, float_format="%.6g")


def write_csv(path: Path):
    """What writes a table into `path`."""

    def write(table: pd.DataFrame) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        path.write_text(csv_text(table))
        print(f"wrote {path.relative_to(ROOT)}")

    return write


PARTS = {  # part: (measure, write)
    "tiers": (tiers, write_csv(TIERS)),
    "sources": (sources, lambda doc: _update(SOURCES, doc)),
    "cpu_calibrate": (cpu_calibrate, lambda doc: _update(SOURCES, doc)),
    "pool": (pool, write_csv(POOL)),
    "per_seq": (per_seq, write_csv(PER_SEQ)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="the reference data folder (traces/, serving/)")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), help="measure only these parts")
    args = ap.parse_args()
    for part in args.only or list(PARTS):
        measure, write = PARTS[part]
        write(measure(args.data))


if __name__ == "__main__":
    main()
