"""What a mixture-of-experts layer costs in one step: the experts its tokens touch.

An MoE layer routes each token to k of its E experts (Mixtral: top 2 of 8). Memory
holds all E experts (kvsim.model.memory sizes the KV pool after them), but a step reads only
the weights of the experts that at least one of its tokens chose, and each token
computes on its k experts alone. The rule kvsim uses for the number of experts touched:

    expected distinct experts for B tokens = E x (1 - (1 - k/E)^B)

A token's router picks k different experts; if every k-subset is equally likely a given
expert is missed by one token with probability 1 - k/E, and by all B tokens, routed
independently, with probability (1 - k/E)^B. So one token reads k experts, a batch of
a few dozen reads nearly all E. Uniform routing is what the routers' load-balancing
loss trains for (Fedus, Zoph and Shazeer, "Switch Transformers", JMLR 2022, section
2.2; Mixtral is trained with it, router_aux_loss_coef in its config.json), and tokens
of different requests (a decode batch) route independently. Tokens of one prompt are
correlated (Jiang et al., "Mixtral of Experts", 2024, section 5: consecutive tokens
often share experts), so for a short prefill chunk the rule overstates the experts read;
a chunk of hundreds of tokens touches every expert either way. Load imbalance between
experts (the busiest expert sets a grouped GEMM's tail) is not modelled.

Priced per GPU of a tensor-parallel group as vLLM runs MoE by default (FusedMoE without
expert parallelism: each GPU holds a 1/tp slice of every expert's FFN width, as a dense
MLP is split). One layer's routed experts are one grouped GEMM per projection, as
vLLM's fused MoE kernel launches them:

    FLOPs = 2 x (B k) x K x N          bytes = 2 x (touched x K x N + B k x K + B k x N)

with K x N one expert's slice (up: hidden -> 2 x width / tp; down: width / tp -> hidden),
timed by the GPU's fitted GEMM form (kvsim.cost.fit). Shared experts (DeepSeek,
Qwen-MoE) are a dense MLP every token runs; the router (hidden -> E, not split by tp)
is one small GEMM; DeepSeek's first dense layers are averaged in.
"""

from __future__ import annotations

import numpy as np

from kvsim.cost.fit import gemm_kn, gemm_work, predict_gemm

MOE_OPS = ("mlp_up_proj", "mlp_down_proj")


def expected_experts(tokens, k: int, experts: int):
    """Expected distinct experts B tokens touch when each picks k of `experts` uniformly."""
    tokens = np.asarray(tokens, dtype=float)
    return experts * (1 - (1 - k / experts) ** tokens)


def routed_gemm_work(shape: dict, op: str, tokens, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """(FLOPs, bytes) of one layer's routed-expert GEMM `op` on one GPU, for `tokens` tokens."""
    tokens = np.asarray(tokens, dtype=float)
    k, experts = shape["experts_per_token"], shape["num_experts"]
    kk, n = gemm_kn(shape | {"intermediate_size": shape["moe_intermediate_size"], "gated_mlp": True}, op, tp)
    rows = tokens * k
    touched = expected_experts(tokens, k, experts)
    flops, _ = gemm_work(rows, kk, n)
    nbytes = 2 * (touched * kk * n + rows * kk + rows * n)
    return flops, nbytes


def moe_mlp_seconds(fit: dict, shape: dict, op: str, tokens, tp: int, peak: float, bw: float):
    """Seconds per layer (averaged over the model's layers) of MLP projection `op` of a MoE
    model: routed experts, shared experts and, with the up projection, the router."""
    tokens = np.asarray(tokens, dtype=float)
    t = predict_gemm(fit, *routed_gemm_work(shape, op, tokens, tp), peak, bw)
    if shape.get("shared_expert_size"):
        kk, n = gemm_kn(shape | {"intermediate_size": shape["shared_expert_size"], "gated_mlp": True}, op, tp)
        t = t + predict_gemm(fit, *gemm_work(tokens, kk, n), peak, bw)
    if op == "mlp_up_proj":
        t = t + predict_gemm(fit, *gemm_work(tokens, shape["hidden_size"], shape["num_experts"]), peak, bw)
    dense = shape.get("dense_layers", 0)
    if dense:
        kk, n = gemm_kn(shape | {"gated_mlp": True}, op, tp)
        t_dense = predict_gemm(fit, *gemm_work(tokens, kk, n), peak, bw)
        t = (dense * t_dense + (shape["num_layers"] - dense) * t) / shape["num_layers"]
    return t


def act_width(shape: dict) -> float:
    """FFN width one token's activation function runs over, averaged over layers: its k
    experts and the shared ones on a MoE layer, intermediate_size on a dense one."""
    dense = shape.get("dense_layers", 0)
    moe = shape["experts_per_token"] * shape["moe_intermediate_size"] + shape.get("shared_expert_size", 0)
    return (dense * shape["intermediate_size"] + (shape["num_layers"] - dense) * moe) / shape["num_layers"]
