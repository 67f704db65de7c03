"""KV-cache memory math, and how big the KV pool of a served model is.

`kv_footprint` is the seeds' formula (see kvsim.model.specs): bytes per token, per request
of `context` tokens, and for a batch of them. `size_pool` follows vLLM: the KV pool is
what remains of gpu_memory_utilization x GPU memory after the weights and the peak
activation memory; with tensor parallelism each GPU holds 1/tp of the weights and of
every token's KV, so the pool is tp times one GPU's remainder.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvsim.model.specs import DTYPE_BITS, GIB, GPUSpec, ModelSpec


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


def no_room(model: ModelSpec, gpu: GPUSpec, *, tp: int, gpu_memory_utilization: float,
            activation_bytes) -> str | None:
    """Why the KV pool would be empty, and what would help, or None if it is not.

    `activation_bytes(tp)` estimates one GPU's activations. When weights and activations
    fill even the whole GPU, raising gpu_memory_utilization cannot help: the message says
    so and names the smallest power-of-two tp, or the GPU memory, that leaves room at the
    scenario's gpu_memory_utilization. (Where 100% would leave room but the scenario's
    share does not, kvsim.sim.runner's message names both remedies.)
    """
    gpu_bytes = gpu.memory_gib * GIB
    weights, act = model.weight_bytes() / tp, activation_bytes(tp)
    if weights + act < gpu_bytes:
        return None
    usable = gpu_memory_utilization * gpu_bytes
    fix = []
    for more in (2 ** k for k in range(0, 11)):
        if more > tp and model.weight_bytes() / more + activation_bytes(more) < usable:
            fix.append(f"tensor_parallel_size {more}")
            break
    fix.append(f"a GPU with more than {(weights + act) / gpu_memory_utilization / GIB:.0f} GiB")
    return (f"no memory left for the KV cache: {weights / GIB:.1f} GiB of weights and "
            f"{act / GIB:.1f} GiB of activations per GPU (tp {tp}) exceed the {gpu.name}'s "
            f"{gpu.memory_gib:g} GiB, so raising gpu_memory_utilization cannot help; needs "
            + " or ".join(fix))
