"""The KV pool of a vLLM 0.33.0 server, sized as that release sizes it, and its log lines.

At startup vLLM's GPU worker (vllm/v1/worker/gpu_worker.py, determine_available_memory)
measures what everything but the KV cache takes on one GPU and gives the KV cache the
rest of its budget:

    requested = ceil(total GPU memory x gpu_memory_utilization)   (v1/worker/utils.py, request_memory)
    available = requested - weights - non-torch memory - profile run's activation peak
                - CUDA-graph memory estimate

Weights are what loading the model allocated ("Model loading took X GiB"), non-torch
memory is what the CUDA runtime, cuBLAS and NCCL took outside PyTorch's allocator, the
activation peak is the transient PyTorch peak of one dummy step of max_num_batched_tokens
tokens followed by a dummy sampler run over max_num_seqs requests (utils/mem_utils.py,
memory_profiling; gpu_model_runner.py, profile_run and _dummy_sampler_run), and the
CUDA-graph estimate comes from capturing the two largest graphs of each mode
(gpu_model_runner.py, profile_cudagraph_memory), counted by default since 0.21.0
(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS). vLLM measures each part on the GPU; kvsim
estimates them (see each function), which is where its figures can differ from a log.

The pool then holds available // (block bytes) blocks, a block being block_size tokens
of every layer's K and V on this GPU, or of one KV cache group's layers for a hybrid
model (v1/core/kv_cache_planning.py, get_kv_cache_config_from_groups; kvsim.model.kv_groups),
and vLLM logs (v1/core/kv_cache_utils.py, update_kv_cache_capacity):

    GPU KV cache size: {blocks / R x L} tokens, Maximum concurrency
    for {L} tokens per request: {blocks / R}x     (L = max_model_len)

R being the blocks a request of L tokens takes: ceil(L / block_size) per full-attention
group, a sliding window's admission cap per windowed group.

Each GPU of a tensor-parallel group holds every token's KV for its share of the KV heads
(max(1, kv_heads / tp) of them, replicated when tp exceeds the heads: config/model.py,
get_num_kv_heads); an MLA latent is not split. All figures here are per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim.model.kv_groups import kv_cache_groups
from kvsim.model.memory import PoolSizing
from kvsim.model.specs import DTYPE_BITS, GIB, GPUSpec, KVSpec, ModelSpec

MIB = 1 << 20
# Non-torch memory, estimated: what vLLM's profile finds outside PyTorch's allocator.
# One GPU: the CUDA runtime's and cuBLAS's workspaces, 0.02-0.26 GiB in published startup
# logs of vLLM 0.10-0.11 ("... GiB for non-torch memory"); kvsim takes 0.1 GiB. With tensor
# parallelism NCCL's and the custom all-reduce's buffers add about 1.8 GiB per GPU
# (vLLM pull request #10511's profile of Llama-3-8B on H100: 1.79 GiB at tp 1, 3.58 at tp 2).
NON_TORCH_ONE_GPU = 0.1 * GIB
NON_TORCH_PARALLEL = 1.8 * GIB
# CUDA-graph memory per captured graph piece, estimated: vLLM 0.21's estimate for Qwen3-8B
# (36 layers; 51 piecewise graphs of 37 pieces and 35 full graphs; LMCache issue #3430)
# was 0.52 GiB, about 0.25 MiB per piece once the largest graph's activations are taken off.
GRAPH_PIECE = 0.25 * MIB
# Bytes per (request, vocabulary entry) the dummy sampler run holds at its peak: the
# model-dtype logits it keeps (2), their float32 copy (4), the softmax probabilities (4)
# and the exponential noise of random_sample (4) (v1/sample/sampler.py; top-k/top-p are
# applied in place by the Triton kernel, v1/sample/ops/topk_topp_triton.py).
SAMPLER_BYTES = 2 + 4 + 4 + 4


@dataclass(frozen=True)
class KVCapacity:
    blocks: int
    tokens: int
    concurrency: float
    max_model_len: int
    groups: str = ""  # a hybrid model's KV cache groups, in words (kvsim.model.kv_groups)

    @classmethod
    def of(
        cls,
        pool: PoolSizing,
        kv: KVSpec,
        block_size: int,
        max_model_len: int,
        in_flight_tokens: int | None = None,
        hybrid: bool = False,
    ) -> "KVCapacity":
        """The capacity vLLM logs for a pool in KV layout `kv` and blocks of block_size.
        A block spans one KV cache group's layers (kvsim.model.kv_groups; `hybrid` False:
        every layer, a hybrid model's windowed layers counted as full, as vLLM V0 and
        kvsim's own runs of prefix-cached hybrid models do), and a request at
        max_model_len takes blocks from each group, a sliding window's group at most its
        admission cap, whose in-flight tokens are max_num_batched_tokens per batch in
        flight (`in_flight_tokens`; None: windows counted as full)."""
        groups = kv_cache_groups(kv.model, hybrid=hybrid)
        block = groups.block_bytes(kv, block_size) / pool.kv_shards
        blocks = int(max(pool.per_gpu_bytes, 0) // block)
        if in_flight_tokens is None:
            per_request = len(groups.groups) * -(-max_model_len // block_size)
        else:
            per_request = groups.blocks_per_request(block_size, max_model_len, in_flight_tokens)
        concurrency = blocks / per_request
        return cls(
            blocks,
            int(concurrency * max_model_len),
            concurrency,
            max_model_len,
            groups.describe() if groups.hybrid else "",
        )

    def lines(self) -> tuple[str, ...]:
        """The two figures as vLLM 0.33.0 prints them, after a hybrid model's groups."""
        return (*((self.groups,) if self.groups else ()),) + (
            f"GPU KV cache size: {self.tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.concurrency:.2f}x",
        )


def kv_shards(model: ModelSpec, tp: int) -> int:
    """GPUs over which one token's KV is split: tp while each holds its own heads, the KV
    heads when tp replicates them, 1 for an MLA latent (every GPU holds it whole)."""
    return 1 if model.is_mla else min(tp, model.num_kv_heads)


def weight_bytes(model: ModelSpec, tp: int) -> float:
    """What loading the model takes on one GPU: its parameters split by tp, plus the rotary
    embedding's cos/sin cache (max_position_embeddings x head_dim in the model dtype,
    model_executor/layers/rotary_embedding/base.py), which every GPU holds whole."""
    per = DTYPE_BITS[model.dtype] / 8
    rope = 0 if model.alibi else (model.max_position_embeddings or 0) * model.head_dim * per
    return model.params * per / tp + rope


def forward_peak(model: ModelSpec, tokens: int, tp: int) -> float:
    """The largest tensors alive at once in one forward step of `tokens` tokens, estimated:
    the residual stream and the normed hidden states (2 x hidden) beside the widest
    layer's intermediates: the MLP's gate-and-up output and its activation (3 x FFN / tp),
    for a MoE layer those of each token's k experts plus their down-projected outputs
    (fused MoE's three intermediate caches), or attention's QKV and output."""
    h, per = model.hidden_size, DTYPE_BITS[model.dtype] / 8
    attention = (model.num_heads * 2 + model.num_kv_heads * 2) * model.head_dim / tp
    mlp = 3 * model.intermediate_size / tp
    if model.is_moe:
        moe = model.experts_per_token * (3 * model.expert_ffn / tp + h) + 3 * model.shared_expert_size / tp
        mlp = max(mlp if model.dense_layers else 0.0, moe)
    return tokens * (2 * h + max(attention, mlp)) * per


def sampler_peak(model: ModelSpec, seqs: int, tokens: int) -> float:
    """The dummy sampler run's peak: SAMPLER_BYTES per (request, vocabulary entry), while
    the step's hidden states are still held."""
    return seqs * model.vocab_size * SAMPLER_BYTES + tokens * model.hidden_size * DTYPE_BITS[model.dtype] / 8


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """CUDA-graph capture sizes by default (config/vllm.py, VllmConfig's capture-size
    rule, outside Blackwell): 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256,
    up to min(2 x max_num_seqs, 512, max_num_batched_tokens), plus max_num_seqs and
    max_num_batched_tokens where they fit."""
    top = min(max_num_seqs * 2, 512, max_num_batched_tokens)
    sizes = [n for n in (1, 2, 4) if n <= top] + list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))
    sizes += [n for n in (max_num_batched_tokens, max_num_seqs) if n <= top]
    return sorted(set(sizes))


def cudagraph_estimate(model: ModelSpec, tp: int, max_num_seqs: int, max_num_batched_tokens: int) -> float:
    """vLLM's CUDA-graph estimate under the default FULL_AND_PIECEWISE mode: piecewise
    graphs (layers + 1 pieces) at every capture size, full graphs for decode batches up to
    max_num_seqs; the first capture's memory is the largest size's activations, each
    further graph GRAPH_PIECE per piece (at least vLLM's 1 MiB floor)."""
    sizes = capture_sizes(max_num_seqs, max_num_batched_tokens)
    full = [n for n in sizes if n <= max_num_seqs]
    piece = max(GRAPH_PIECE * (model.num_layers + 1), MIB)
    return forward_peak(model, sizes[-1], tp) + piece * (len(sizes) - 1) + MIB * max(len(full) - 1, 0)


def size_pool(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    tp: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    cuda_graphs: bool = True,
    activation_bytes: float | None = None,
    kv_cache_memory_bytes: float | None = None,
    engine: str = "vllm-v1",
) -> PoolSizing:
    """One GPU's accounting as vLLM 0.33.0 does it. cuda_graphs False: --enforce-eager
    (nothing captured, nothing counted); activation_bytes: a given activation peak in place
    of kvsim's estimate; kv_cache_memory_bytes: --kv-cache-memory-bytes, which skips the
    profile and fixes the KV cache's size."""
    total = gpu.memory_gib * GIB
    requested = math.ceil(total * gpu_memory_utilization)
    weights = weight_bytes(model, tp)
    non_torch = NON_TORCH_ONE_GPU + (NON_TORCH_PARALLEL if tp > 1 else 0.0)
    seqs = min(max_num_seqs, max_num_batched_tokens)
    activation = (
        activation_bytes
        if activation_bytes is not None
        else max(forward_peak(model, max_num_batched_tokens, tp), sampler_peak(model, seqs, max_num_batched_tokens))
    )
    graphs = cudagraph_estimate(model, tp, max_num_seqs, max_num_batched_tokens) if cuda_graphs else 0.0
    shards = kv_shards(model, tp)
    if kv_cache_memory_bytes is not None:
        return PoolSizing(
            engine,
            total,
            requested,
            weights,
            activation,
            kv_cache_memory_bytes,
            shards,
            "kv_cache_memory_bytes",
            non_torch,
            graphs,
        )
    available = requested - weights - non_torch - activation - graphs
    return PoolSizing(
        engine, total, requested, weights, activation, available, shards, "gpu_memory_utilization", non_torch, graphs
    )


def activation_estimate(model: ModelSpec, batched_tokens: int, max_num_seqs: int, tp: int) -> float:
    """Peak activation bytes per GPU of a step of `batched_tokens` tokens and its sampler
    over max_num_seqs requests, estimated as for vLLM's profile run."""
    return max(
        forward_peak(model, batched_tokens, tp), sampler_peak(model, min(max_num_seqs, batched_tokens), batched_tokens)
    )
