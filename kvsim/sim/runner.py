"""One scenario, every policy, one request stream: `run_scenario` returns the tables.

Building and running never write files; kvsim.cli.app writes what this returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvsim.kvcache import SeqShape, make_allocator
from kvsim.kvcache.tiers import build_stores
from kvsim.cost.model import describe, make_cost_model
from kvsim.sim.loop import simulate
from kvsim.engines import EngineSettings
from kvsim.config.errors import InputError
from kvsim.model import sglang_pool, vllm_pool
from kvsim.model.memory import PoolSizing, engine_log, no_room
from kvsim.sim.parallel import ordered_map
from kvsim.config.scenario import Scenario
from kvsim.sim.scheduler import SwapSpace
from kvsim.model.specs import GIB, GPUSpec, KVSpec, ModelSpec, resolve_kv_dtype
from kvsim.workload.requests import RequestTable, generate_requests

if TYPE_CHECKING:             # pandas is imported where tables are made (see run_scenario)
    import pandas as pd


MAX_UNITS = 1 << 26    # blocks (or slots) a simulated pool may have: beyond, memory runs out


@dataclass
class Results:
    summary: pd.DataFrame
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    pool: PoolSizing
    per_replica: pd.DataFrame | None = None    # a fleet's rows per (policy, replica)
    stages: pd.DataFrame | None = None         # rows per (policy, load stage): kvsim.analysis.stages
    engine_log: dict[str, list[str]] | None = None   # per policy, what the engine logs of its pool


def plan_pool(scn: Scenario, model: ModelSpec, gpu: GPUSpec, src: str) -> PoolSizing:
    """One GPU's memory in the scenario's engine's accounting and the KV pool it leaves:
    vLLM's profile run (kvsim.model.vllm_pool) or SGLang's static fraction (kvsim.model.sglang_pool);
    kv_cache_memory_gib fixes the pool, activation_memory_gib the activation peak."""
    tp = scn.tensor_parallel_size
    s = scn.engine_settings()
    fixed = None if scn.kv_cache_memory_gib is None else scn.kv_cache_memory_gib * GIB
    if scn.kv_cache_memory_gib is not None and scn.kv_cache_memory_gib > gpu.memory_gib:
        raise InputError(src, "kv_cache_memory_gib", f"{scn.kv_cache_memory_gib} GiB is more than "
                         f"the GPU's {gpu.memory_gib} GiB")

    def vllm(tp: int) -> PoolSizing:
        return vllm_pool.size_pool(
            model, gpu, tp=tp, gpu_memory_utilization=scn.gpu_memory_utilization,
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            cuda_graphs=scn.engine_name == "vllm-v1" and not scn.enforce_eager,
            activation_bytes=None if scn.activation_memory_gib is None else scn.activation_memory_gib * GIB,
            kv_cache_memory_bytes=fixed, engine=scn.engine_name)
    if scn.engine_name == "sglang":
        pool = sglang_pool.size_pool(model, gpu, tp=tp, mem_fraction_static=scn.mem_fraction_static,
                                     chunked_prefill_size=scn.scheduler.max_num_batched_tokens)
        if fixed is not None:
            pool = replace(pool, per_gpu_bytes=fixed, source="kv_cache_memory_gib")
        if pool.pool_bytes <= 0:
            raise InputError(src, "mem_fraction_static", f"no memory left for the KV cache: "
                             f"{pool.usable_bytes / GIB:.1f} GiB (mem_fraction_static of {gpu.memory_gib:g} GiB) "
                             f"holds {pool.weight_bytes / GIB:.1f} GiB of weights per GPU; raise "
                             "tensor_parallel_size or mem_fraction_static, or use a larger GPU")
        return pool
    def overheads(tp: int) -> float:       # all but the weights and the KV cache
        p = vllm(tp)
        return p.activation_bytes + p.non_torch_bytes + p.cudagraph_bytes
    problem = fixed is None and no_room(model, gpu, tp=tp, gpu_memory_utilization=scn.gpu_memory_utilization,
                                        activation_bytes=overheads)
    if problem:
        raise InputError(src, "tensor_parallel_size", problem)
    pool = vllm(tp)
    if pool.pool_bytes <= 0:
        raise InputError(src, "gpu_memory_utilization",
                         f"no memory left for the KV cache: {scn.gpu_memory_utilization} x "
                         f"{gpu.memory_gib} GiB holds {pool.weight_bytes / GIB:.1f} GiB of weights, "
                         f"{pool.activation_bytes / GIB:.1f} GiB of activations and "
                         f"{(pool.non_torch_bytes + pool.cudagraph_bytes) / GIB:.1f} GiB of CUDA and NCCL "
                         "buffers and CUDA graphs per GPU; raise tensor_parallel_size or "
                         "gpu_memory_utilization, or use a larger GPU")
    return pool


def scheduler_options(scn: Scenario, kv: KVSpec, gpu, s: EngineSettings) -> dict:
    """What the Scheduler takes: the engine's effective settings and the swap space."""
    swap = None
    if s.preemption_mode != "recompute":      # swap, or V0's choice (groups swap)
        swap = SwapSpace(scn.scheduler.swap_space_gib * GIB * scn.tensor_parallel_size,
                         kv.bytes_per_token, gpu.pcie_gb_s * 1e9 * scn.tensor_parallel_size)
    return dict(engine=s.engine, max_model_len=scn.max_model_len, max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens,
                chunked_prefill=s.enable_chunked_prefill, watermark=s.watermark,
                preemption_mode=s.preemption_mode, swap=swap, schedule_policy=s.schedule_policy,
                sliding_window=kv.model.sliding_window, seed=scn.seed,
                async_scheduling=s.async_scheduling,
                width=max(scn.workload.n, scn.workload.beam_width), beam=scn.workload.beam_width > 1)


def effective_columns(s: EngineSettings, kind: str, options: dict) -> dict:
    """The settings a policy ran with, as summary columns (so a comparison hides none)."""
    cache = "radix" if kind == "radix" else "hash" if options.get("prefix_caching") else "none"
    return {"engine": s.engine, "block_size": options.get("block_size", 1 if kind == "radix" else 0),
            "enable_prefix_caching": cache != "none", "prefix_cache": cache,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "enable_chunked_prefill": s.enable_chunked_prefill,
            "preemption_mode": s.preemption_mode or "recompute; swap for groups",
            "watermark": s.watermark}


def tier_stores(t, kv: KVSpec, gpu: GPUSpec, scn: Scenario, block_size: int, replicas: int) -> list:
    """Each replica's KV tiers (kvsim.kvcache.tiers) for a policy's kv_offload `t`: the
    host link and the network per GPU, each of the replica's tp GPUs copying its share."""
    tp = scn.tensor_parallel_size
    return build_stores(replicas=replicas, shared=t.shared, cpu_bytes=t.cpu_gib * GIB,
                        disk_bytes=t.disk_gib * GIB, policy=t.policy,
                        chunk_tokens=t.chunk_tokens or block_size, bytes_per_token=kv.bytes_per_token,
                        link_bytes_s=gpu.pcie_gb_s * 1e9 * tp, network_bytes_s=t.network_gb_s * 1e9 * tp,
                        disk_bytes_s=t.disk_gb_s * 1e9)


def offload_columns(t, block_size: int | None) -> dict:
    """A policy's kv_offload settings as summary columns (zeros where it has none)."""
    if t is None:
        return {"kv_offload_cpu_gib": 0.0, "kv_offload_disk_gib": 0.0, "kv_offload_policy": "",
                "kv_offload_chunk_tokens": 0, "kv_offload_shared": False}
    return {"kv_offload_cpu_gib": t.cpu_gib, "kv_offload_disk_gib": t.disk_gib,
            "kv_offload_policy": t.policy, "kv_offload_chunk_tokens": t.chunk_tokens or block_size,
            "kv_offload_shared": t.shared}


def total_footprint(allocator, requests: RequestTable) -> int:
    """The sum of every request's footprint (allocator.footprint), asked once per distinct
    (prompt, output) pair: a footprint depends on a shape's lengths alone."""
    pairs, counts = np.unique(np.stack([requests.prompt_tokens, requests.output_tokens], axis=1),
                              axis=0, return_counts=True)
    return sum(allocator.footprint(SeqShape(int(p), int(o))) * int(c) for (p, o), c in zip(pairs, counts))


def run_scenario(scn: Scenario, base_dir: Path, src: str = "scenario", *,
                 on_progress: Callable[[str, int, int], None] | None = None,
                 check_invariants: bool = False, exact_steps: bool = False,
                 bucket_s: float | None = None, workers: int = 1,
                 meanwhile: Callable[[], None] | None = None) -> Results:
    """Run every policy of `scn`; on_progress(policy, finished, total) reports progress.
    workers: simulate the policies in up to that many processes (kvsim.sim.parallel; the
    same results; progress is then reported as each policy ends); meanwhile: work for
    this process while they do (a lone policy then runs in a worker too).
    exact_steps: the plain step-by-step path (kvsim.sim.loop.simulate); same results.
    bucket_s: the time series in buckets of that many simulated seconds, not steps."""
    model, gpu = scn.model_spec(base_dir), scn.gpu_spec()
    pool = plan_pool(scn, model, gpu, src)
    requests = generate_requests(scn, base_dir, src)
    setups = []     # build every policy first: bad input fails before any simulation
    log: dict[str, list[str]] = {}
    for i, policy in enumerate(scn.policies):
        kv = KVSpec(model, resolve_kv_dtype(policy.kv_cache_dtype, model), policy.kv_scale,
                    policy.kv_scale_group_size)
        kind, options = policy.allocator_kind(scn.engine_name)
        units = pool.pool_bytes / kv.bytes_per_token / options.get("block_size", 1)
        if units > MAX_UNITS:
            raise InputError(src, f"policies[{i}]", f"the KV pool would hold {units:.3g} "
                             f"{'blocks' if 'block_size' in options else 'token slots'} for policy "
                             f"'{policy.name}'; kvsim simulates at most {MAX_UNITS:,} (use larger blocks "
                             "or a smaller pool)")
        allocator = make_allocator(kind, pool.pool_bytes, kv, scn.max_model_len, **options)
        if allocator.capacity <= 0:
            raise InputError(src, f"policies[{i}]", f"the KV pool ({pool.pool_bytes / GIB:.3g} GiB) "
                             f"holds not even one block of policy '{policy.name}'")
        cost = make_cost_model(scn.cost_model, model, gpu, kv, scn.tensor_parallel_size,
                               block_size=options.get("block_size"), base_dir=base_dir, src=src)
        settings = scn.engine_settings(int(pool.pool_bytes // kv.bytes_per_token))
        setups.append((policy, kv, allocator, cost, settings, kind, options))
        lines = engine_log(pool, kv, kind, options, scn.max_model_len)
        if lines:
            log[policy.name] = lines
    width = max(scn.workload.n, scn.workload.beam_width)
    replicas, router = scn.fleet
    stage_list = _stage_list(scn, requests)
    streaming = scn.workload.inference_perf.streaming if scn.workload.inference_perf else True
    parallel = workers > 1 and (len(setups) > 1 or meanwhile is not None)

    def run_policy(i: int):      # in a worker where parallel: plain records travel back
        policy, kv, allocator, cost, settings, kind, options = setups[i]
        progress = (lambda done, name=policy.name: on_progress(name, done, len(requests))) \
            if on_progress and not parallel else None
        fleet = [allocator] + [make_allocator(kind, pool.pool_bytes, kv, scn.max_model_len, **options)
                               for _ in range(replicas - 1)]
        if policy.tiers is not None:       # fresh stores for this run: the allocators behind them too
            fleet = [make_allocator(kind, pool.pool_bytes, kv, scn.max_model_len, **options, tiers=store)
                     for store in tier_stores(policy.tiers, kv, gpu, scn, options["block_size"], replicas)]
        run = simulate(policy.name, requests, fleet, cost, on_step=progress,
                       check_invariants=check_invariants, time_limit_s=scn.time_limit_s,
                       exact_steps=exact_steps, bucket_s=bucket_s, router=router,
                       request_timeout_s=scn.workload.request_timeout_s,
                       **scheduler_options(scn, kv, gpu, settings))
        if parallel:             # not sent back: the caller holds the same table
            for r in (run, *run.parts):
                r.requests = None
        return run

    tabulated: dict[int, tuple] = {}

    def tabulate(i: int, run) -> None:
        """Policy i's summary rows and tables, made as its run arrives: with workers, while
        the others still run (the command's process has imported pandas by then)."""
        from kvsim.analysis.metrics import request_table, step_table, summarize, tidy, tier_columns
        from kvsim.analysis.stages import stage_rows
        policy, kv, allocator, cost, settings, kind, options = setups[i]
        for r in (run, *run.parts):
            r.requests = requests
        table = request_table(run)
        api = getattr(cost, "api", None)       # the HTTP server's delay on each response
        if api is not None:
            table = api.respond(table, scn.workload.request_timeout_s)
        mean_footprint = total_footprint(allocator, requests) * width / len(requests)
        fixed = {"policy": policy.name, "allocator": policy.allocator,
                 "kv_cache_dtype": kv.kv_cache_dtype, **effective_columns(settings, kind, options)}
        tiered = any(p.tiers is not None for p in scn.policies)
        if tiered:
            fixed.update(offload_columns(policy.tiers, options.get("block_size")))
        if replicas > 1:
            fixed.update(replicas=replicas, router=router)

        def row(run, table, share: int) -> dict:
            """share: the replicas the row's pool and capacity columns add up."""
            return {**fixed, "kv_pool_gib": tidy(pool.pool_bytes * share / GIB),
                    "kv_capacity_tokens": allocator.capacity * share,
                    "memory_capacity_requests": tidy(allocator.capacity * share / mean_footprint),
                    **summarize(run, table, kv.scale_bytes_per_token / kv.bytes_per_token),
                    **(tier_columns(run) if tiered else {}),
                    "cost_model": describe(cost.label, run.extrapolated, len(run.steps),
                                           run.extrapolation_reasons)}
        parts = []
        for r, part in enumerate(run.parts):
            mine = table[table.replica == r]
            parts.append({"replica": r, "requests_routed": len(mine), **row(part, mine, 1)})
        tabulated[i] = (row(run, table, replicas), parts, step_table(run), table,
                        stage_rows(run, table, stage_list, streaming))

    def ended(i: int, run) -> None:     # in workers, a policy reports progress only as it ends
        if on_progress and parallel:
            on_progress(setups[i][0].name, len(requests), len(requests))
        tabulate(i, run)
    # in workers, the prefix caches first, as the longest runs: the radix cache (it runs
    # step by step, kvsim.sim.lazy), then the hashed one (its lookups)
    first = ([i for i, setup in enumerate(setups) if setup[5] == "radix"]
             + [i for i, setup in enumerate(setups) if setup[6].get("prefix_caching")])
    ordered_map(run_policy, len(setups), workers if parallel else 1, first=first, on_result=ended,
                meanwhile=meanwhile)
    import pandas as pd       # only now: the workers above were forked without it (see kvsim.cli.output)
    rows, parts, series, tables, stage_parts = zip(*(tabulated[i] for i in range(len(setups))))
    per_replica = [r for p in parts for r in p]
    from kvsim.analysis.metrics import tidy
    stages = pd.DataFrame([r for p in stage_parts for r in p]).map(lambda v: tidy(v) if isinstance(v, float) else v)
    return Results(pd.DataFrame(list(rows)), pd.concat(series, ignore_index=True),
                   pd.concat(tables, ignore_index=True), pool,
                   _replica_columns(pd.DataFrame(per_replica)) if per_replica else None, stages, log)


def _stage_list(scn: Scenario, requests: RequestTable) -> list[tuple[float, float]]:
    """Each load stage's (rate_per_s, duration_s); a run without stages is one stage at
    its arrival rate (NaN where it has none), as long as its arrivals span."""
    if requests.plan is not None:
        return list(zip(requests.plan.rates, requests.plan.durations))
    rate = getattr(scn.workload.arrival, "rate_per_s", math.nan)
    return [(float(rate), float(requests.arrival_s.max()) if len(requests) else 0.0)]


def _replica_columns(df: pd.DataFrame) -> pd.DataFrame:
    """policy, replica first: the rest as in the summary."""
    return df[["policy", "replica", *[c for c in df.columns if c not in ("policy", "replica")]]]
