"""KV-cache memory math, and how big the KV pool of a served model is.

`kv_footprint` is the standard formula, 2 (K and V) x layers x KV heads x head_dim x
bytes per element (see kvsim.model.specs): bytes per token, per request
of `context` tokens, and for a batch of them. `PoolSizing` is one GPU's memory as an
engine accounts for it and the KV pool that leaves: vLLM's profile-run accounting
(kvsim.model.vllm_pool) or SGLang's static fraction (kvsim.model.sglang_pool).
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
        model=model.name,
        attention=model.attention_kind,
        kv_dtype=kv_dtype,
        context=context,
        batch=batch,
        elements_per_token=elements,
        per_token_bytes=elements * bits // 8,
        per_request_bytes=per_request,
        total_bytes=per_request * batch,
    )


@dataclass(frozen=True)
class PoolSizing:
    """Where one GPU's memory goes in the engine's accounting, and the KV pool it leaves
    (bytes; kvsim.model.vllm_pool and kvsim.model.sglang_pool say how each engine decides).

    `per_gpu_bytes` is one GPU's KV cache; `pool_bytes` is the same pool counted in bytes
    of the whole model's KV (kvsim.model.specs.KVSpec.bytes_per_token), which is how allocators
    count it: one GPU's share times the GPUs a token's KV is split over (kv_shards)."""

    engine: str
    gpu_bytes: float  # one GPU's memory as CUDA reports it
    usable_bytes: float  # the engine's budget: gpu_memory_utilization or mem_fraction_static of it
    weight_bytes: float  # per GPU
    activation_bytes: float  # per GPU: the profiled activation peak (vLLM) or reserved share (SGLang)
    per_gpu_bytes: float  # the KV cache on one GPU
    kv_shards: int
    source: str  # what fixed the pool: a flag, or the engine's accounting
    non_torch_bytes: float = 0.0
    cudagraph_bytes: float = 0.0

    @property
    def pool_bytes(self) -> float:
        return max(self.per_gpu_bytes, 0.0) * self.kv_shards


def no_room(model: ModelSpec, gpu: GPUSpec, *, tp: int, gpu_memory_utilization: float, activation_bytes) -> str | None:
    """Why the KV pool would be empty, and what would help, or None if it is not.

    `activation_bytes(tp)` estimates one GPU's activations. When weights and activations
    fill even the whole GPU, raising gpu_memory_utilization cannot help: the message says
    so and names the smallest power-of-two tp, or the GPU memory, that leaves room at the
    scenario's gpu_memory_utilization. (Where 100% would leave room but the scenario's
    share does not, kvsim.sim.plan's message names both remedies.)
    """
    gpu_bytes = gpu.memory_gib * GIB
    weights, act = model.weight_bytes() / tp, activation_bytes(tp)
    if weights + act < gpu_bytes:
        return None
    usable = gpu_memory_utilization * gpu_bytes
    fix = []
    for more in (2**k for k in range(0, 11)):
        if more > tp and model.weight_bytes() / more + activation_bytes(more) < usable:
            fix.append(f"tensor_parallel_size {more}")
            break
    fix.append(f"a GPU with more than {(weights + act) / gpu_memory_utilization / GIB:.0f} GiB")
    return (
        f"no memory left for the KV cache: {weights / GIB:.1f} GiB of weights and "
        f"{act / GIB:.1f} GiB of activations per GPU (tp {tp}) exceed the {gpu.name}'s "
        f"{gpu.memory_gib:g} GiB, so raising gpu_memory_utilization cannot help; needs " + " or ".join(fix)
    )
