"""KV-cache memory math, and how big the KV pool of a served model is.

`kv_footprint` is the seeds' formula (see kvsim.specs): bytes per token, per request
of `context` tokens, and for a batch of them. `size_pool` follows vLLM: the KV pool is
what remains of gpu_memory_utilization x GPU memory after the weights and the peak
activation memory; with tensor parallelism each GPU holds 1/tp of the weights and of
every token's KV, so the pool is tp times one GPU's remainder.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvsim.specs import DTYPE_BITS, GIB, GPUSpec, ModelSpec


@dataclass(frozen=True)
class Footprint:
    model: str
    attention: str
    kv_dtype: str
    context: int
    batch: int
    elements_per_token: int
    per_token_bytes: int
    per_request_bytes: int
    total_bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def kv_footprint(model: ModelSpec, context: int, batch: int, kv_dtype: str) -> Footprint:
    """Raw KV bytes (no quantization scales) for `batch` requests of `context` tokens."""
    elements = model.kv_elements_per_token
    bits = DTYPE_BITS[kv_dtype]
    per_request = elements * context * bits // 8
    return Footprint(
        model=model.name, attention=model.attention_kind, kv_dtype=kv_dtype,
        context=context, batch=batch, elements_per_token=elements,
        per_token_bytes=elements * bits // 8, per_request_bytes=per_request,
        total_bytes=per_request * batch,
    )


@dataclass(frozen=True)
class PoolSizing:
    """Where one GPU's memory goes, and the KV pool over all tp GPUs (bytes)."""
    gpu_bytes: float
    usable_bytes: float        # gpu_memory_utilization x gpu_bytes
    weight_bytes: float        # per GPU
    activation_bytes: float    # per GPU
    pool_bytes: float          # all GPUs together
    source: str                # "kv_cache_memory_gib" or "gpu_memory_utilization"


def activation_estimate(model: ModelSpec, batched_tokens: int, max_num_seqs: int, tp: int) -> float:
    """Peak activation bytes per GPU for a step of `batched_tokens` tokens.

    vLLM measures this by profiling a dummy step; kvsim estimates the largest live
    tensors of that step instead: the MLP's gate and up outputs (2 x ffn wide), a few
    hidden-size buffers (residual, norm output, attention output, QKV), all in the
    model dtype and split by tp where the layer is, plus fp32 logits for one token per
    sequence. An estimate, labelled as such; set activation_memory_gib to override.
    """
    act = DTYPE_BITS[model.dtype] / 8
    per_token = (2 * model.intermediate_size / tp + 4 * model.hidden_size) * act
    logits = max_num_seqs * model.vocab_size * 4 / tp
    return batched_tokens * per_token + logits


def size_pool(model: ModelSpec, gpu: GPUSpec, *, tp: int, gpu_memory_utilization: float,
              kv_cache_memory_gib: float | None, activation_bytes: float) -> PoolSizing:
    gpu_bytes = gpu.memory_gib * GIB
    usable = gpu_bytes * gpu_memory_utilization
    weights = model.weight_bytes() / tp
    if kv_cache_memory_gib is not None:
        return PoolSizing(gpu_bytes, usable, weights, activation_bytes,
                          kv_cache_memory_gib * GIB * tp, "kv_cache_memory_gib")
    per_gpu = usable - weights - activation_bytes
    return PoolSizing(gpu_bytes, usable, weights, activation_bytes, max(per_gpu, 0.0) * tp,
                      "gpu_memory_utilization")
