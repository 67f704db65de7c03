"""Resolve once: a scenario becomes one frozen Plan, which the simulation takes.

`resolve(scenario)` does, in one place, everything that turns what a scenario says into
what a run uses: the model and GPU specs, the KV pool's size on this GPU, the request
stream, and for each policy its KV layout, its allocator (the registered kind and its
options), the engine settings with every default filled (some depend on the policy's
pool in tokens), its swap space and its step-cost model. Every check that needs these
(a pool too small, a pool too large to simulate) fails here, before any simulation.
Nothing after this reads the scenario's schema: the simulation takes the plan, and
reports take the plan and the results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from kvsim.config.engine_defaults import EngineSettings
from kvsim.config.errors import InputError
from kvsim.config.scenario import KvCacheConfig, Scenario
from kvsim.config.trtllm import allocator_options, host_bytes_per_gpu
from kvsim.cost.model import CostModel, make_cost_model
from kvsim.kvcache import make_allocator
from kvsim.kvcache.hiradix import HiCacheSpec, host_slots
from kvsim.kvcache.tiers import TierStore, build_stores
from kvsim.model import sglang_pool, trtllm_pool, vllm_pool
from kvsim.model.memory import PoolSizing, no_room
from kvsim.model.specs import GIB, GPUSpec, KVSpec, ModelSpec, resolve_kv_dtype
from kvsim.sim.scheduler import SwapSpace
from kvsim.workload.requests import RequestTable, generate_requests

MAX_UNITS = 1 << 26  # blocks (or slots) a simulated pool may have: beyond, memory runs out


@dataclass(frozen=True)
class TierPlan:
    """A policy's KV tiers (kv_offload), resolved: host memory and disk per replica (or
    one store for the fleet, `shared`), the chunk size, and the links that copy them:
    the host link and network ports of a replica's tp GPUs, and the disk's read rate."""

    cpu_gib: float
    disk_gib: float
    policy: str
    chunk_tokens: int
    shared: bool
    link_bytes_s: float
    network_bytes_s: float
    disk_bytes_s: float
    hicache: tuple[int, str] | None = None  # behind the radix cache: (host slots, write policy)

    def stores(self, replicas: int, bytes_per_token: float) -> list[TierStore | HiCacheSpec]:
        """Fresh stores for one run, one per replica (kvsim.kvcache.tiers.build_stores),
        or each replica's HiCache host pool (kvsim.kvcache.hiradix)."""
        if self.hicache is not None:
            return [HiCacheSpec(*self.hicache, self.link_bytes_s)] * replicas
        return build_stores(
            replicas=replicas,
            shared=self.shared,
            cpu_bytes=self.cpu_gib * GIB,
            disk_bytes=self.disk_gib * GIB,
            policy=self.policy,
            chunk_tokens=self.chunk_tokens,
            bytes_per_token=bytes_per_token,
            link_bytes_s=self.link_bytes_s,
            network_bytes_s=self.network_bytes_s,
            disk_bytes_s=self.disk_bytes_s,
        )


def offload_columns(t: TierPlan | None) -> dict:
    """A policy's KV tiers as summary columns (zeros where it has none)."""
    if t is None:
        return {
            "kv_offload_cpu_gib": 0.0,
            "kv_offload_disk_gib": 0.0,
            "kv_offload_policy": "",
            "kv_offload_chunk_tokens": 0,
            "kv_offload_shared": False,
        }
    return {
        "kv_offload_cpu_gib": t.cpu_gib,
        "kv_offload_disk_gib": t.disk_gib,
        "kv_offload_policy": t.policy if t.hicache is None else t.hicache[1],
        "kv_offload_chunk_tokens": t.chunk_tokens,
        "kv_offload_shared": t.shared,
    }


@dataclass(frozen=True)
class PolicyPlan:
    """One policy, resolved."""

    name: str
    allocator: str  # the scenario's allocator family (contiguous, paged)
    kind: str  # the registered allocator it runs (kvsim.kvcache.ALLOCATORS) ...
    options: Mapping[str, object]  # ... with these options
    capacity: int  # its pool in slots
    kv: KVSpec
    settings: EngineSettings
    swap: SwapSpace | None
    cost: CostModel
    tiers: TierPlan | None = None  # KV tiers behind its prefix cache

    def scheduler_options(self, plan: Plan) -> dict:
        """What kvsim.sim.scheduler.Scheduler takes for this policy."""
        s = self.settings
        return dict(
            max_model_len=plan.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            chunked_prefill=s.enable_chunked_prefill,
            watermark=s.watermark,
            preemption_mode=s.preemption_mode,
            swap=self.swap,
            schedule_policy=s.schedule_policy,
            sliding_window=self.kv.model.sliding_window,
            seed=plan.seed,
            async_scheduling=s.async_scheduling,
            width=plan.width,
            beam=plan.beam,
            ignore_eos=plan.ignore_eos,
        )

    def columns(self) -> dict:
        """The settings the policy ran with, as summary columns (so a comparison hides none)."""
        return policy_columns(self.settings, self.kind, self.options)


def policy_columns(s: EngineSettings, kind: str, options: Mapping[str, object]) -> dict:
    """Engine settings and an allocator's kind and options as a summary's columns."""
    cache = "radix" if kind == "radix" else "hash" if options.get("prefix_caching") else "none"
    return {
        "engine": s.engine,
        "block_size": options.get("block_size", 1 if kind == "radix" else 0),
        "enable_prefix_caching": cache != "none",
        "prefix_cache": cache,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enable_chunked_prefill": s.enable_chunked_prefill,
        "preemption_mode": s.preemption_mode or "recompute; swap for groups",
        "watermark": s.watermark,
    }


@dataclass(frozen=True)
class Plan:
    """A scenario, resolved: what a run of every policy uses."""

    name: str
    source: str  # where it came from (a file, for messages)
    seed: int
    model: ModelSpec
    gpu: GPUSpec
    tensor_parallel_size: int
    pool: PoolSizing
    max_model_len: int
    width: int  # sequences per request (samples or beams)
    beam: bool
    replicas: int
    router: str
    time_limit_s: float | None
    request_timeout_s: float | None  # clients give up this long after sending
    requests: RequestTable
    stages: tuple[tuple[float, float], ...]  # each load stage's (rate_per_s, duration_s)
    streaming: bool  # clients read tokens as they come (inference-perf's streaming)
    policies: tuple[PolicyPlan, ...]
    ignore_eos: bool = False  # the clients send ignore_eos (SGLang reserves their whole outputs)
    timeseries_bucket_s: float | None = None  # record the steps in sums per bucket (kvsim.sim.records.BucketLog)


def plan_pool(scn: Scenario, model: ModelSpec, gpu: GPUSpec, src: str) -> PoolSizing:
    """One GPU's memory in the scenario's engine's accounting and the KV pool it leaves:
    vLLM's profile run (kvsim.model.vllm_pool) or SGLang's static fraction (kvsim.model.sglang_pool);
    kv_cache_memory_gib fixes the pool, activation_memory_gib the activation peak."""
    tp = scn.tensor_parallel_size
    s = scn.engine_settings()
    fixed = None if scn.kv_cache_memory_gib is None else scn.kv_cache_memory_gib * GIB
    if scn.kv_cache_memory_gib is not None and scn.kv_cache_memory_gib > gpu.memory_gib:
        raise InputError(
            src, "kv_cache_memory_gib", f"{scn.kv_cache_memory_gib} GiB is more than the GPU's {gpu.memory_gib} GiB"
        )

    def vllm(tp: int) -> PoolSizing:
        return vllm_pool.size_pool(
            model,
            gpu,
            tp=tp,
            gpu_memory_utilization=scn.gpu_memory_utilization,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            cuda_graphs=scn.engine_name in ("vllm-v1", "vllm-reference") and not scn.enforce_eager,
            activation_bytes=None if scn.activation_memory_gib is None else scn.activation_memory_gib * GIB,
            kv_cache_memory_bytes=fixed,
            engine=scn.engine_name,
        )

    if scn.engine_name == "trtllm":
        return _trtllm_pool(scn, model, gpu, src, fixed)
    if scn.engine_name == "sglang":
        pool = sglang_pool.size_pool(
            model,
            gpu,
            tp=tp,
            mem_fraction_static=scn.mem_fraction_static,
            chunked_prefill_size=scn.scheduler.max_num_batched_tokens,
            max_running_requests=scn.scheduler.max_num_seqs,
        )
        if fixed is not None:
            pool = replace(pool, per_gpu_bytes=fixed, source="kv_cache_memory_gib")
        if pool.pool_bytes <= 0:
            raise InputError(
                src,
                "mem_fraction_static",
                f"no memory left for the KV cache: "
                f"{pool.usable_bytes / GIB:.1f} GiB (mem_fraction_static of {gpu.memory_gib:g} GiB) "
                f"holds {pool.weight_bytes / GIB:.1f} GiB of weights per GPU; raise "
                "tensor_parallel_size or mem_fraction_static, or use a larger GPU",
            )
        return pool

    def overheads(tp: int) -> float:  # all but the weights and the KV cache
        p = vllm(tp)
        return p.activation_bytes + p.non_torch_bytes + p.cudagraph_bytes

    problem = fixed is None and no_room(
        model, gpu, tp=tp, gpu_memory_utilization=scn.gpu_memory_utilization, activation_bytes=overheads
    )
    if problem:
        raise InputError(src, "tensor_parallel_size", problem)
    pool = vllm(tp)
    if pool.pool_bytes <= 0:
        raise InputError(
            src,
            "gpu_memory_utilization",
            f"no memory left for the KV cache: {scn.gpu_memory_utilization} x "
            f"{gpu.memory_gib} GiB holds {pool.weight_bytes / GIB:.1f} GiB of weights, "
            f"{pool.activation_bytes / GIB:.1f} GiB of activations and "
            f"{(pool.non_torch_bytes + pool.cudagraph_bytes) / GIB:.1f} GiB of CUDA and NCCL "
            "buffers and CUDA graphs per GPU; raise tensor_parallel_size or "
            "gpu_memory_utilization, or use a larger GPU",
        )
    return pool


def _trtllm_pool(scn: Scenario, model: ModelSpec, gpu: GPUSpec, src: str, fixed: float | None) -> PoolSizing:
    s, cfg = scn.engine_settings(), scn.kv_cache_config
    pool = trtllm_pool.size_pool(
        model,
        gpu,
        tp=scn.tensor_parallel_size,
        max_num_tokens=s.max_num_batched_tokens,
        max_batch_size=s.max_num_seqs,
        free_gpu_memory_fraction=(cfg or KvCacheConfig()).free_gpu_memory_fraction,
        activation_bytes=None if scn.activation_memory_gib is None else scn.activation_memory_gib * GIB,
        kv_cache_memory_bytes=fixed,
    )
    if pool.pool_bytes <= 0:
        raise InputError(
            src,
            "tensor_parallel_size",
            f"no memory left for the KV cache: "
            f"{pool.weight_bytes / GIB:.1f} GiB of weights and {pool.activation_bytes / GIB:.1f} "
            f"GiB of activations per GPU fill the {gpu.memory_gib:g} GiB GPU; raise "
            "tensor_parallel_size or use a larger GPU",
        )
    return pool


def _trtllm_policy(scn: Scenario, policy, pool: PoolSizing, gpu: GPUSpec) -> tuple[dict, TierPlan | None]:
    """A policy's TensorRT-LLM block manager options and, with a host pool, the tier the
    summary reports it as. The host pool counts bytes of the whole model's KV, as the
    GPU pool does (each GPU holds its share of every token)."""
    tp = scn.tensor_parallel_size
    options = allocator_options(policy, scn.kv_cache_config)
    host = host_bytes_per_gpu(policy, scn.kv_cache_config, tp)
    link = gpu.pcie_gb_s * 1e9 * tp
    options.update(host_cache_bytes=host * pool.kv_shards, link_bytes_s=link)
    if not host:
        return options, None
    return options, TierPlan(host * tp / GIB, 0.0, "lru", options["block_size"], False, link, 0.0, 0.0)


def resolve(scn: Scenario, base_dir: Path, src: str = "scenario") -> Plan:
    """The scenario's plan; bad input fails here, before any simulation."""
    model, gpu = scn.model_spec(base_dir), scn.gpu_spec()
    pool = plan_pool(scn, model, gpu, src)
    requests = generate_requests(scn, base_dir, src)
    tp = scn.tensor_parallel_size
    policies = []
    for i, policy in enumerate(scn.policies):
        kv = KVSpec(model, resolve_kv_dtype(policy.kv_cache_dtype, model), policy.kv_scale, policy.kv_scale_group_size)
        kind, options = policy.allocator_kind(scn.engine_name)
        tiers = None
        if kind == "trtllm":
            options, tiers = _trtllm_policy(scn, policy, pool, gpu)
        units = pool.pool_bytes / kv.bytes_per_token / options.get("block_size", 1)
        if units > MAX_UNITS:
            raise InputError(
                src,
                f"policies[{i}]",
                f"the KV pool would hold {units:.3g} "
                f"{'blocks' if 'block_size' in options else 'token slots'} for policy "
                f"'{policy.name}'; kvsim simulates at most {MAX_UNITS:,} (use larger blocks "
                "or a smaller pool)",
            )
        settings = scn.engine_settings(int(pool.pool_bytes // kv.bytes_per_token))
        v1 = kind == "paged" and settings.engine in ("vllm-v1", "vllm-reference")
        if v1 and (model.sliding_window or model.is_hybrid):
            # vLLM V1's sliding-window rules, whose admission cap counts the tokens in flight
            batches = 2 if settings.async_scheduling else 1  # VllmConfig.max_concurrent_batches
            options = {**options, "vllm_in_flight_tokens": batches * settings.max_num_batched_tokens}
        if v1 and model.is_hybrid and policy.tiers is None:
            # vLLM V1's KV cache groups (kvsim.kvcache.hybrid, hybrid_prefix); behind KV
            # tiers kvsim counts every layer as full
            options = {**options, "hybrid_groups": True}
        capacity = make_allocator(kind, pool.pool_bytes, kv, scn.max_model_len, **options).capacity
        if capacity <= 0:
            raise InputError(
                src,
                f"policies[{i}]",
                f"the KV pool ({pool.pool_bytes / GIB:.3g} GiB) holds not even one block of policy '{policy.name}'",
            )
        cost = make_cost_model(
            scn.cost_model,
            model,
            gpu,
            kv,
            tp,
            block_size=options.get("block_size"),
            base_dir=base_dir,
            src=src,
            engine=settings.engine,
            limits=(settings.max_num_seqs, settings.max_num_batched_tokens),
        )
        swap = None
        if settings.preemption_mode != "recompute":  # swap, or V0's choice (groups swap)
            swap = SwapSpace(scn.scheduler.swap_space_gib * GIB * tp, kv.bytes_per_token, gpu.pcie_gb_s * 1e9 * tp)
        if kind != "trtllm" and (t := policy.tiers) is not None:
            if why := t.refusal("radix" if kind == "radix" else "hash"):
                raise InputError(src, f"policies[{i}].kv_offload", why)
            cpu_gib, hicache = t.cpu_gib, None
            if kind == "radix":  # SGLang's host pool, sized by its own rules
                slots = host_slots(
                    capacity, options.get("page_size", 1), kv.bytes_per_token, t.cpu_gib * GIB, t.hicache_ratio
                )
                cpu_gib, hicache = slots * kv.bytes_per_token / GIB, (slots, t.write_policy or "write_through")
            tiers = TierPlan(
                cpu_gib,
                t.disk_gib,
                t.policy,
                t.chunk_tokens or options.get("block_size", 1),
                t.shared,
                gpu.pcie_gb_s * 1e9 * tp,
                t.network_gb_s * 1e9 * tp,
                t.disk_gb_s * 1e9,
                hicache,
            )
        policies.append(
            PolicyPlan(
                policy.name,
                policy.allocator,
                kind,
                MappingProxyType(dict(options)),
                capacity,
                kv,
                settings,
                swap,
                cost,
                tiers,
            )
        )
    replicas, router = scn.fleet
    wl = scn.workload
    return Plan(
        scn.name,
        src,
        scn.seed,
        model,
        gpu,
        tp,
        pool,
        scn.max_model_len,
        max(wl.n, wl.beam_width),
        wl.beam_width > 1,
        replicas,
        router,
        scn.time_limit_s,
        wl.request_timeout_s,
        requests,
        _stages(scn, requests),
        wl.inference_perf.streaming if wl.inference_perf else True,
        tuple(policies),
        ignore_eos=wl.sends_ignore_eos,
        timeseries_bucket_s=scn.timeseries_bucket_s,
    )


def _stages(scn: Scenario, requests: RequestTable) -> tuple[tuple[float, float], ...]:
    """Each load stage's (rate_per_s, duration_s); a run without stages is one stage at
    its arrival rate (NaN where it has none), as long as its arrivals span."""
    if requests.plan is not None:
        return tuple(zip(requests.plan.rates, requests.plan.durations))
    rate = getattr(scn.workload.arrival, "rate_per_s", math.nan)
    return ((float(rate), float(requests.arrival_s.max()) if len(requests) else 0.0),)
