"""`engine: trtllm`: what a scenario's settings mean for TensorRT-LLM, and what it refuses.

TensorRT-LLM's own names (tensorrt_llm/llmapi/llm_args.py, as its API reference documents
them; the block manager they configure is TensorRT-LLM 1.2.0rc2's) appear where kvsim has no name of its own:
`kv_cache_config:` holds KvCacheConfig's fields engine-wide, and
`scheduler.capacity_scheduler_policy` is SchedulerConfig's. The settings both engines
have keep vLLM's names: scheduler.max_num_seqs is max_batch_size (2048 by default),
max_num_batched_tokens is max_num_tokens (8192), enable_chunked_prefill the same (off).
A policy's own block_size, enable_prefix_caching and kv_offload.cpu_gib (the replica's
host pool, all its GPUs together) override tokens_per_block, enable_block_reuse and
host_cache_size (bytes per GPU, as TensorRT-LLM counts it).

Imports nothing from the simulator: the plan (kvsim.sim.plan) turns these values into
the allocator's options.
"""

from __future__ import annotations

GIB = 2**30
# KvCacheConfig's defaults (kvsim.config.scenario.KvCacheConfig takes them)
DEFAULTS = {
    "free_gpu_memory_fraction": 0.9,
    "enable_block_reuse": True,
    "tokens_per_block": 32,
    "host_cache_size": None,
    "enable_partial_reuse": True,
    "copy_on_partial_reuse": True,
    "secondary_offload_min_priority": 30,
    "retention_priority": 35,
}


def allocator_options(policy, cfg) -> dict:
    """The `trtllm` allocator's options for a paged policy under KvCacheConfig `cfg`
    (None: its defaults), but for the host pool and the link, which the plan sizes
    (host_bytes_per_gpu)."""
    c = DEFAULTS if cfg is None else cfg.model_dump()
    block_size = policy.block_size if "block_size" in policy.model_fields_set else c["tokens_per_block"]
    reuse = c["enable_block_reuse"] if policy.enable_prefix_caching is None else policy.enable_prefix_caching
    return {
        "block_size": block_size,
        "prefix_caching": reuse,
        "partial_reuse": c["enable_partial_reuse"],
        "copy_on_partial_reuse": c["copy_on_partial_reuse"],
        "offload_min_priority": c["secondary_offload_min_priority"],
        "retention_priority": c["retention_priority"],
    }


def host_bytes_per_gpu(policy, cfg, tensor_parallel_size: int) -> float:
    """One GPU's host pool: the policy's kv_offload.cpu_gib shared by its GPUs, else
    host_cache_size (`cfg`: the scenario's KvCacheConfig, or None)."""
    if policy.tiers is not None:
        return policy.tiers.cpu_gib * GIB / tensor_parallel_size
    return float(cfg.host_cache_size or 0) if cfg is not None else 0.0


def check(scn, src: str, error) -> None:
    """What engine: trtllm cannot run, and TensorRT-LLM's settings under another engine,
    as `error(field, message)`."""
    name = scn.engine_name
    if name != "trtllm":
        if scn.kv_cache_config is not None:
            error(
                "kv_cache_config",
                "is TensorRT-LLM's KvCacheConfig (engine: trtllm); vLLM's pool is "
                "gpu_memory_utilization, SGLang's mem_fraction_static",
            )
        if scn.scheduler.capacity_scheduler_policy is not None:
            error("scheduler.capacity_scheduler_policy", "is TensorRT-LLM's (engine: trtllm)")
        return
    for field in ("gpu_memory_utilization", "enforce_eager"):
        if field in scn.model_fields_set:
            error(field, "is vLLM's; TensorRT-LLM sizes its pool with kv_cache_config.free_gpu_memory_fraction")
    for i, policy in enumerate(scn.policies):
        at = f"policies[{i}]"
        if policy.allocator != "paged":
            error(f"{at}.allocator", "engine trtllm runs TensorRT-LLM's paged block manager; use allocator: paged")
        if policy.prefix_cache == "radix":
            error(
                f"{at}.prefix_cache",
                "TensorRT-LLM reuses blocks by hash and tree (its own); drop prefix_cache or use engine: sglang",
            )
        bs = policy.block_size if "block_size" in policy.model_fields_set else None
        if bs is not None and (bs < 2 or bs & (bs - 1)):
            error(f"{at}.block_size", f"{bs}: TensorRT-LLM's tokens_per_block must be a power of two greater than 1")
        t = policy.tiers
        if t is None:
            continue
        if t.disk_gib:
            error(
                f"{at}.kv_offload.disk_gib",
                "TensorRT-LLM's block manager keeps a host pool only (host_cache_size); use cpu_gib",
            )
        for field, default in (("policy", "lru"), ("shared", False), ("chunk_tokens", None)):
            if getattr(t, field) != default:
                error(
                    f"{at}.kv_offload.{field}",
                    "not TensorRT-LLM's: its host pool holds whole blocks, "
                    "per GPU, evicted least recently used first by priority; give cpu_gib only",
                )
