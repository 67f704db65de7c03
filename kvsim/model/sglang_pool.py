"""The KV pool of an SGLang 0.5.23 server: a static fraction of the GPU.

SGLang does not profile a step. It reserves a share of the GPU for activations and CUDA
graphs by rule and gives the KV cache whatever `mem_fraction_static` (weights plus KV
over the GPU's memory) leaves after the weights:

    KV bytes = free after loading - free before loading x (1 - mem_fraction_static)
             = free before loading x mem_fraction_static - weights, per GPU
    (srt/mem_cache/kv_cache_configurator.py, KVCacheConfigurator._profile_available_bytes),
    tokens = KV bytes / bytes per token, rounded down to page_size and capped by
    --max-total-tokens (srt/model_executor/pool_configurator.py, DefaultPoolConfigurator)

Unset, mem_fraction_static = round((gpu_mem - reserved) / gpu_mem, 3) with gpu_mem the
GPU's memory in MiB and reserved, in MiB (srt/arg_groups/memory_hook.py,
handle_gpu_memory_settings and reserve_for_graph_mb):

    512 + 1.5 x max(chunked_prefill_size, 2048) + 1024 x tp / 8
    + 2 x the decode CUDA graphs' max batch + 8 per prefill CUDA-graph size,
    at least 10,240 above 60 GiB

chunked_prefill_size and the decode graphs' max batch default by GPU memory: under 20
GiB 2048 and 8; under 35 GiB 4096 and 48 (160 at tp 4 or more); under 60 GiB 4096 and
32 (160); under 160 GiB 8192 and 256 (512); above 16384 and 512; the max batch is cut
to max_running_requests where that is set lower. The prefill graphs' sizes are
generate_prefill_cuda_graph_batch_sizes' grid (srt/arg_groups/cuda_graph_hook.py) up to
chunked_prefill_size (4096 for Llama-2 models); an MLA model reserves 1.5 GiB for them
instead. (SGLang 0.5.10.post1 gave 2048 tokens and 24 (80) graphs under 35 GiB, and
never cut the graphs to max_running_requests.) Post-capture KV sizing, which skips the
reserve, is off by default (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING). What kvsim
estimates: the memory free before loading, taken as the GPU's memory less the CUDA
context (PRE_LOAD_OVERHEAD), and gpu_mem as CUDA's total (SGLang reads nvidia-smi's, a
few hundred MiB more; the fraction moves by at most 0.001).
"""

from __future__ import annotations

from kvsim.model.memory import PoolSizing
from kvsim.model.specs import GIB, GPUSpec, KVSpec, ModelSpec
from kvsim.model.vllm_pool import kv_shards, weight_bytes

PRE_LOAD_OVERHEAD = 0.5 * GIB  # CUDA context and distributed init before the weights load (estimate)


def gpu_defaults(gpu_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) SGLang picks for a GPU of gpu_mib MiB."""
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if gpu_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The prefill CUDA graphs' token counts (generate_prefill_cuda_graph_batch_sizes)."""
    grid = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in grid if s <= max_tokens]


def default_mem_fraction(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    chunked_prefill_size: int | None = None,
    cuda_graph_max_bs: int | None = None,
    max_running_requests: int | None = None,
) -> float:
    """mem_fraction_static as SGLang sets it when it is not given (no speculative
    decoding, no DP attention, no pipeline parallelism, CUDA graphs on)."""
    gpu_mib = gpu.memory_gib * 1024
    chunk, graph_bs = gpu_defaults(gpu_mib, tp)
    chunk = chunked_prefill_size or chunk
    if cuda_graph_max_bs:
        graph_bs = cuda_graph_max_bs
    elif max_running_requests:
        graph_bs = min(graph_bs, max_running_requests)
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if model.is_mla:
        reserved += 1.5 * 1024
    else:
        limit = min(chunk, 4096) if "llama-2" in model.name.lower() else chunk
        reserved += len(piecewise_sizes(limit)) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def size_pool(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    tp: int,
    mem_fraction_static: float | None = None,
    chunked_prefill_size: int | None = None,
    max_running_requests: int | None = None,
) -> PoolSizing:
    """One GPU's KV memory as SGLang sizes it (bytes; tokens_of turns it into tokens)."""
    fraction = (
        mem_fraction_static
        if mem_fraction_static is not None
        else default_mem_fraction(model, gpu, tp, chunked_prefill_size, max_running_requests=max_running_requests)
    )
    total = gpu.memory_gib * GIB
    free = total - PRE_LOAD_OVERHEAD
    weights = weight_bytes(model, tp)
    source = "mem_fraction_static" if mem_fraction_static is not None else "mem_fraction_static (SGLang's default)"
    return PoolSizing(
        "sglang",
        total,
        free * fraction,
        weights,
        free * (1 - fraction),
        free * fraction - weights,
        kv_shards(model, tp),
        f"{source} {fraction:g}",
    )


def tokens_of(pool: PoolSizing, kv: KVSpec, page_size: int = 1) -> int:
    """The token slots SGLang allocates ("KV Cache is allocated. #tokens: N"): whole
    tokens of this GPU's share of the KV, rounded down to whole pages."""
    cell = kv.bytes_per_token / pool.kv_shards
    return max(int(pool.per_gpu_bytes // cell), 0) // page_size * page_size
