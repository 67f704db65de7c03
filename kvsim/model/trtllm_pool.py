"""TensorRT-LLM's KV pool: a fraction of the GPU memory left free once the model runs.

TensorRT-LLM (PyTorch backend) loads the weights, runs a profiling forward with a small
KV cache, then gives the KV cache `free_gpu_memory_fraction` (0.9 by default:
executor.h's KvCacheConfig::kDefaultGpuMemFraction) of the memory then free
(BaseKVCacheManager::calculateFreeMemBytes in TensorRT-LLM 1.2.0rc2's
cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, commit b35ac1b64368: free memory x the fraction; the
estimate is tensorrt_llm/_torch/pyexecutor/_util.py's KvCacheCreator). The rest stays for
the CUDA graphs captured afterwards and for fragmentation. kvsim estimates the free
memory as vLLM's accounting of the same parts does (kvsim.model.vllm_pool): the GPU's
memory less the weights, the activation peak of a step of max_num_tokens tokens and
max_batch_size sequences and the CUDA and NCCL buffers, no CUDA graphs.
"""

from __future__ import annotations

from dataclasses import replace

from kvsim.model import vllm_pool
from kvsim.model.memory import PoolSizing
from kvsim.model.specs import GPUSpec, ModelSpec


def size_pool(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    tp: int,
    free_gpu_memory_fraction: float,
    max_num_tokens: int,
    max_batch_size: int,
    activation_bytes: float | None = None,
    kv_cache_memory_bytes: float | None = None,
) -> PoolSizing:
    """One GPU's accounting; kv_cache_memory_bytes fixes the pool (kvsim's
    kv_cache_memory_gib), activation_bytes the activation peak."""
    free = vllm_pool.size_pool(
        model,
        gpu,
        tp=tp,
        gpu_memory_utilization=1.0,
        max_num_batched_tokens=max_num_tokens,
        max_num_seqs=max_batch_size,
        cuda_graphs=False,
        activation_bytes=activation_bytes,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        engine="trtllm",
    )
    if kv_cache_memory_bytes is not None:
        return replace(free, source="kv_cache_memory_gib")
    return replace(free, per_gpu_bytes=free.per_gpu_bytes * free_gpu_memory_fraction, source="free_gpu_memory_fraction")
