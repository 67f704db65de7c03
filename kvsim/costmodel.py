"""How long one engine step takes.

A step runs the model once over every token scheduled in it: new prompt tokens
(prefill, possibly a chunk) and one token per decoding sequence. The scheduler
describes the step as a `StepBatch`; a cost model turns it into seconds.

`Roofline` is the ideal bound: the step takes as long as the slower of reading its
bytes at peak HBM bandwidth and doing its FLOPs at peak dense BF16 compute. It ignores
kernel efficiency, launch and scheduling overheads and tensor-parallel communication,
so its times are lower bounds; every output that uses it says "roofline".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .specs import GPUSpec, KVSpec, ModelSpec


@dataclass(frozen=True)
class StepBatch:
    """One step's work.

    prefills: (chunk tokens, tokens already cached before the chunk) per prefilling
    sequence; decode_contexts: the tokens each decoding sequence attends to (its KV,
    the new token's included).
    """
    prefills: tuple[tuple[int, int], ...]
    decode_contexts: tuple[int, ...]

    @classmethod
    def build(cls, prefills, decode_contexts) -> "StepBatch":
        return cls(tuple(map(tuple, prefills)), tuple(decode_contexts))

    @property
    def new_tokens(self) -> int:
        """Prefill tokens plus one per decoding sequence."""
        return sum(n for n, _ in self.prefills) + len(self.decode_contexts)

    @property
    def attended_pairs(self) -> float:
        """(query, key) pairs attention computes: causal within a chunk, full to its cache."""
        return sum(n * (ctx + (n + 1) / 2) for n, ctx in self.prefills) + sum(self.decode_contexts)

    @property
    def kv_tokens_read(self) -> int:
        """KV tokens attention reads: each sequence's whole context."""
        return sum(ctx + n for n, ctx in self.prefills) + sum(self.decode_contexts)


class CostModel(Protocol):
    label: str

    def step_time(self, batch: StepBatch) -> float:
        """Seconds for one step."""


class Roofline:
    label = "roofline"

    def __init__(self, model: ModelSpec, gpu: GPUSpec, kv: KVSpec, tp: int):
        self.tp = tp
        self.peak_flops = gpu.bf16_tflops * 1e12
        self.bandwidth = gpu.hbm_tb_s * 1e12
        self.weight_bytes = model.weight_bytes()
        self.flops_per_token = 2 * model.flop_params        # one multiply-add per weight
        # QK^T and PV: two matmuls, 2 FLOPs per multiply-add, over every query head.
        self.flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
        self.kv_bytes_per_token = kv.bytes_per_token

    def step_time(self, batch: StepBatch) -> float:
        flops = batch.new_tokens * self.flops_per_token + batch.attended_pairs * self.flops_per_pair
        # Weights are read once per step; KV is read for attention and written for new tokens.
        moved = self.weight_bytes + (batch.kv_tokens_read + batch.new_tokens) * self.kv_bytes_per_token
        return max(flops / self.peak_flops, moved / self.bandwidth) / self.tp


COST_MODELS = {"roofline": Roofline}
