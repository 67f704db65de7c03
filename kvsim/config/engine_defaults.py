"""Each engine's defaults for the settings a scenario leaves unset, and what each allows.

A scenario's `scheduler:` block and its policies use vLLM's names; whatever they leave
unset takes the chosen engine's default, read from that engine's source:

| setting | vllm-v0 (0.6.3.post1) | vllm-v1 (0.33.0) | sglang (0.5.23) | trtllm (1.2.0rc2) |
| --- | --- | --- | --- | --- |
| max_num_seqs | 256 | 1024 on a GPU of 70 GiB or more other than A100, else 256 | min(pool tokens / 2, clamp(pool tokens / max_model_len x 512, 2048, 4096)) | max_batch_size 2048 |
| max_num_batched_tokens | max(max_model_len, 2048); 512 with chunking | 16384 on a GPU of 160 GiB or more, 8192 on such a GPU, else 2048 | chunked_prefill_size: 2048 under 20 GiB, 4096 under 60 GiB, 8192 under 160 GiB, else 16384 | max_num_tokens 8192 |
| enable_chunked_prefill | false; true where max_model_len exceeds 32,768, unless the model has a sliding window on every layer | true | true | false |
| preemption_mode | recompute for one sequence, swap for a group | recompute | recompute (retraction) | recompute (MAX_UTILIZATION's pause) |
| watermark | 0.01 | none | none (it reserves for running requests' outputs instead) | none (GUARANTEED_NO_EVICT reserves every request's full length) |
| enable_prefix_caching | false | true (hash) | true (radix) | true (enable_block_reuse, partial reuse) |
| async_scheduling | no | true (vLLM 0.33.0's default) | not modelled | not modelled |
| capacity_scheduler_policy | - | - | - | GUARANTEED_NO_EVICT |

Sources: vllm/config.py SchedulerConfig (V0 max_num_batched_tokens), vllm/engine/arg_utils.py
(0.6.3.post1 `EngineArgs.create_engine_config`: chunked prefill on by default for a
max_model_len over 32K, on a GPU, for a model without a sliding window, multimodal input,
speculative decoding, LoRA or prompt adapters; of these kvsim can express the sliding
window, applied by kvsim.config.scenario; it simulates no multimodal input, drafts,
adapters or devices other than GPUs), vllm/core/block_manager.py
(watermark), vllm/core/scheduler.py `_preempt` (V0); vllm/engine/arg_utils.py
(0.33.0 `EngineArgs.get_batch_defaults`: V1's per-GPU defaults for the OpenAI server); sglang/srt/arg_groups/memory_hook.py
(0.5.23 `_handle_gpu_memory_settings`: chunked_prefill_size by GPU memory), sglang/srt/server_args.py
(max_prefill_tokens 16384, schedule_policy fcfs), sglang/srt/model_executor/pool_configurator.py
(`_resolve_max_running_requests_per_worker`, as ModelRunner resolves max_running_requests);
TensorRT-LLM's tensorrt_llm/llmapi/llm_args.py (TorchLlmArgs, KvCacheConfig, SchedulerConfig),
as its API reference documents them, and tensorrt_llm/builder.py BuildConfig at commit
008b2b8d23af (max_batch_size 2048, max_num_tokens 8192, the defaults the LLM API falls
back to); the block manager they configure is TensorRT-LLM 1.2.0rc2's (docs/engines.md
lists the files and commits).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ENGINE = "vllm-v1"
# engine vllm-reference runs this vLLM release's own scheduler, installed so:
VLLM_VERSION = "0.33.0"
VLLM_INSTALL = f"pip install 'kvsim[vllm]' && pip install --no-deps vllm=={VLLM_VERSION}"
GIB = 2**30


@dataclass(frozen=True)
class EngineSettings:
    """What one run's scheduler works with: the scenario's values, or its engine's defaults."""

    engine: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    preemption_mode: str | None  # None: the engine chooses per request (V0: groups swap)
    watermark: float
    schedule_policy: str = "fcfs"  # SGLang: fcfs or lpm (longest prefix match first); TensorRT-LLM:
    # its capacity_scheduler_policy
    async_scheduling: bool = False  # vLLM V1: plan the next step while this one runs


def resolve(
    engine: str, s, *, max_model_len: int, gpu_name: str, gpu_memory_gib: float, pool_tokens: int | None = None
) -> EngineSettings:
    """Effective settings of scheduler block `s` (kvsim.config.scenario.SchedulerSettings) under `engine`.
    pool_tokens (the KV pool in token slots) sizes SGLang's max_running_requests."""
    big = gpu_memory_gib >= 70 and "a100" not in gpu_name.lower()
    if engine == "vllm-v0":
        chunked = max_model_len > 32768 if s.enable_chunked_prefill is None else s.enable_chunked_prefill
        return EngineSettings(
            engine,
            s.max_num_seqs or 256,
            s.max_num_batched_tokens or (512 if chunked else max(max_model_len, 2048)),
            chunked,
            s.preemption_mode,
            0.01 if s.watermark is None else s.watermark,
        )
    if engine in ("vllm-v1", "vllm-reference"):  # vllm-reference: vLLM's own, stepped synchronously
        huge = gpu_memory_gib >= 160  # vLLM 0.33.0: B200-class GPUs get 16384 tokens
        return EngineSettings(
            engine,
            s.max_num_seqs or (1024 if big or huge else 256),
            s.max_num_batched_tokens or (16384 if huge else 8192 if big else 2048),
            True if s.enable_chunked_prefill is None else s.enable_chunked_prefill,
            s.preemption_mode or "recompute",
            s.watermark or 0.0,
            async_scheduling=engine == "vllm-v1" if s.async_scheduling is None else s.async_scheduling,
        )
    if engine == "trtllm":
        return EngineSettings(
            engine,
            s.max_num_seqs or 2048,
            s.max_num_batched_tokens or 8192,
            bool(s.enable_chunked_prefill),
            "recompute",
            0.0,
            s.capacity_scheduler_policy or "GUARANTEED_NO_EVICT",
        )
    chunk = 2048 if gpu_memory_gib < 20 else 4096 if gpu_memory_gib < 60 else 8192 if gpu_memory_gib < 160 else 16384
    seqs = s.max_num_seqs
    if seqs is None:
        if pool_tokens is None:  # before the pool is sized (activation estimate)
            seqs = 2048
        else:
            seqs = max(1, min(pool_tokens // 2, min(max(int(pool_tokens / max_model_len * 512), 2048), 4096)))
    return EngineSettings(
        engine,
        seqs,
        s.max_num_batched_tokens or chunk,
        True if s.enable_chunked_prefill is None else s.enable_chunked_prefill,
        s.preemption_mode or "recompute",
        s.watermark or 0.0,
        s.schedule_policy or "fcfs",
    )


def prefix_defaults(engine: str) -> tuple[bool, str]:
    """(enable_prefix_caching, prefix_cache) for a paged policy that leaves them unset."""
    return {
        "vllm-v0": (False, "hash"),
        "vllm-v1": (True, "hash"),
        "vllm-reference": (True, "hash"),
        "sglang": (True, "radix"),
        "trtllm": (True, "hash"),
    }[engine]
