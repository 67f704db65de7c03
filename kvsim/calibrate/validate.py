"""End-to-end check of a profile that `kvsim calibrate` just measured.

The profile predicts a step as a sum of separately timed parts (kvsim.cost.model.
Profiled). Here whole forward steps of the same model run back to back, as an engine
runs them, and their measured times are set against the profile's prediction:
embedding; per layer RMSNorm, QKV, RoPE, KV write into a paged cache, attention
(causal SDPA per prompt; decode gathered through a block table), output projection,
residual, RMSNorm, gated MLP, residual; then the LM head on each sequence's last
token. Weights and caches are distinct per layer, so each layer reads its own memory.

Steps are whole prompts, decode batches, and a prompt mixed into a decode batch
(tp 1, KV in the model dtype, block size 16). This checks how the parts add up on the
device that measured them, using the same eager PyTorch kernels: not a production
engine (fused kernels, CUDA graphs, scheduling, sampling), whose overhead the profile
leaves to the engine overhead (kvsim.cost.overhead). On CUDA a step is replayed from
a CUDA graph, so its time, like the parts', leaves out the host's launch latency; the
same step launched eagerly is timed too (`launched_ms`).
"""

from __future__ import annotations

import itertools

import numpy as np

from kvsim.cost.model import Profiled, StepBatch
from kvsim.cost.profiles import Profile
from kvsim.model.specs import GPUSpec, KVSpec, ModelSpec

BLOCK = 16


def steps(quick: bool) -> list[tuple[str, StepBatch]]:
    """(label, batch) for every step measured: prompts, decode batches, one mixed."""
    prompts, batches, contexts = ([16, 64], [1, 4], [64, 256]) if quick else ([128, 512, 2048], [1, 8, 32], [512, 2048])
    out = [(f"prefill {t}", StepBatch.build([(t, 0)], [])) for t in prompts]
    out += [(f"decode {b} x {c}", StepBatch.build([], [c] * b)) for b in batches for c in contexts]
    t, b, c = prompts[1], batches[-1], contexts[0]
    return out + [(f"prefill {t} + decode {b} x {c}", StepBatch.build([(t, 0)], [c] * b))]


class Forward:
    """A Llama-shaped decoder with random weights and a paged KV cache per layer."""

    def __init__(self, torch, shape: dict, dev: str, dtype, max_kv_tokens: int):
        self.torch, self.dev, self.dtype = torch, dev, dtype
        h, d, f = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
        self.qh, self.kh, self.d, self.f = shape["num_heads"], shape["num_kv_heads"], d, f
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype) * 0.02  # noqa: E731
        self.layers = [
            {
                "n1": 1 + rnd(h),
                "qkv": rnd(h, (self.qh + 2 * self.kh) * d),
                "o": rnd(self.qh * d, h),
                "n2": 1 + rnd(h),
                "up": rnd(h, 2 * f),
                "down": rnd(f, h),
                "kv": torch.zeros(2, max_kv_tokens, self.kh, d, device=dev, dtype=dtype),
            }
            for _ in range(shape["num_layers"])
        ]
        self.emb, self.lm = rnd(shape["vocab_size"], h), rnd(h, shape["vocab_size"])
        self.slots = max_kv_tokens

    def prepare(self, batch: StepBatch) -> dict:
        """Token ids, cache slots and block table for one step (not timed)."""
        torch, dev = self.torch, self.dev
        gen = torch.Generator(device="cpu").manual_seed(0)
        blocks = torch.randperm(self.slots // BLOCK, generator=gen)
        prompts, ctxs = [n for n, _ in batch.prefills], list(batch.decode_contexts)
        ctx = max(ctxs, default=0)
        assert ctxs.count(ctx) == len(ctxs), "one context length per decode batch"
        per_seq = -(-ctx // BLOCK)
        table = blocks[: len(ctxs) * per_seq].view(len(ctxs), per_seq)
        # a prompt's tokens go to fresh blocks; each decode token to its context's last slot
        fresh = blocks[len(ctxs) * per_seq :][: -(-sum(prompts) // BLOCK)]
        prompt_slots = (fresh[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[: sum(prompts)]
        decode_slots = table[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK if ctxs else prompt_slots[:0]
        n, half = batch.new_tokens, self.d // 2
        return {
            "ids": torch.randint(0, self.emb.shape[0], (n,), generator=gen).to(dev),
            "slots": torch.cat([prompt_slots, decode_slots]).to(dev),
            "table": table.to(dev),
            "ctx": ctx,
            "prompts": prompts,
            "cos": torch.rand(n, 1, half, device=dev, dtype=self.dtype),
            "sin": torch.rand(n, 1, half, device=dev, dtype=self.dtype),
            "last": torch.tensor([t - 1 for t in itertools.accumulate(prompts)] + list(range(sum(prompts), n))).to(dev),
        }

    def __call__(self, s: dict):
        torch, F = self.torch, self.torch.nn.functional
        qh, kh, d, f = self.qh, self.kh, self.d, self.f
        x = F.embedding(s["ids"], self.emb)
        for w in self.layers:
            a = rms_norm(torch, x, w["n1"]) @ w["qkv"]
            q, k, v = a.view(-1, qh + 2 * kh, d).split([qh, kh, kh], dim=1)
            q, k = rope(torch, q, s["cos"], s["sin"]), rope(torch, k, s["cos"], s["sin"])
            w["kv"][0].index_copy_(0, s["slots"], k)
            w["kv"][1].index_copy_(0, s["slots"], v)
            outs, start = [], 0
            for n in s["prompts"]:
                qs, ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
                outs.append(
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0]
                    .transpose(0, 1)
                    .reshape(n, qh * d)
                )
                start += n
            if s["ctx"]:
                outs.append(self._decode(w["kv"], q[start:], s["table"], s["ctx"]))
            x = x + torch.cat(outs) @ w["o"]
            up = rms_norm(torch, x, w["n2"]) @ w["up"]
            x = x + (F.silu(up[:, :f]) * up[:, f:]) @ w["down"]
        return x[s["last"]] @ self.lm

    def _decode(self, kv, q, table, ctx):
        """Every sequence's K and V gathered through its block table, then attended. K and
        V are gathered each from its own cache, as kvsim.calibrate.measure times decode."""
        b, span = table.shape[0], table.shape[1] * BLOCK
        k, v = (
            c.view(-1, BLOCK, self.kh, self.d)[table]  # b, blocks, BLOCK, kh, d
            .view(b, span, self.kh, self.d)[:, :ctx]
            .transpose(1, 2)
            for c in kv
        )
        out = self.torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
        return out.reshape(b, self.qh * self.d)


def _graphed(torch, fn):
    """fn captured in a CUDA graph (warmed up on a side stream first, as PyTorch asks).
    A step of a thousand kernels then reaches the GPU in one launch: launched one by one,
    they would fill the launch queue and the host would wait for the GPU to drain it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rms_norm(torch, x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rope(torch, x, cos, sin):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def validate(torch, profile: Profile, dev: str, dtype, timer, quick: bool, log=print) -> dict:
    """Measured vs predicted times of whole forward steps; stored in the profile's meta."""
    s = dict(profile.meta["measured_shape"])
    model = ModelSpec(
        name=s["name"],
        num_layers=s["num_layers"],
        num_heads=s["num_heads"],
        num_kv_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"],
        params=_gated_params(s),
    )
    gpu = GPUSpec(profile.meta["gpu"], 0.0, profile.meta["bandwidth"] / 1e12, profile.meta["peak_flops"] / 1e12)
    predict = Profiled(model, gpu, KVSpec(model, "bf16"), 1, profile, BLOCK)
    plan = steps(quick)
    kv_tokens = max(sum(b.decode_contexts) + BLOCK * len(b.decode_contexts) for _, b in plan)
    kv_tokens += max(n for _, b in plan for n, _ in b.prefills) + 2 * BLOCK
    net = Forward(torch, s, dev, dtype, -(-kv_tokens // BLOCK) * BLOCK)
    log(f"timing {len(plan)} whole forward steps ({s['num_layers']} layers)")
    with torch.inference_mode():
        states = {label: net.prepare(batch) for label, batch in plan}
        calls = {label: (lambda st=st: net(st)) for label, st in states.items()}
        # on CUDA, also as eager PyTorch launches it: how much of a step is host latency
        launched = type(timer)(torch, dev, timer.warmup, timer.reps, launched=True).rounds(calls) if timer.cuda else {}
        measured = timer.rounds({label: _graphed(torch, fn) for label, fn in calls.items()} if timer.cuda else calls)
    rows = []
    for label, batch in plan:
        predicted = predict.step_time(batch)
        rows.append(
            {
                "step": label,
                "measured_ms": round(measured[label] * 1e3, 4),
                "predicted_ms": round(predicted * 1e3, 4),
                "error": round((predicted - measured[label]) / measured[label], 4),
            }
            | ({"launched_ms": round(launched[label] * 1e3, 4)} if launched else {})
        )
    return {
        "method": "whole forward steps timed back to back vs the profile's sum of parts "
        "(tp 1, KV in the model dtype, block 16; kvsim.calibrate.validate)"
        + ("; launched_ms: the same steps timed as launched, host latency included" if launched else ""),
        "mape": round(float(np.mean([abs(r["error"]) for r in rows])), 4),
        "steps": rows,
    }


def no_room(torch, shape: dict, dev: str, dtype) -> str | None:
    """Why the whole model does not fit on this GPU for `validate` (its weights over 90%
    of the free memory, the rest left for caches and activations); None if it fits."""
    if dev != "cuda":
        return None
    need = _gated_params(shape) * torch.tensor([], dtype=dtype).element_size()
    free = torch.cuda.mem_get_info()[0]
    if need <= 0.9 * free:
        return None
    return f"the model's {need / 2**30:.0f} GiB of weights do not fit in 90% of the GPU's {free / 2**30:.0f} GiB free"


def _gated_params(s: dict) -> float:
    """A parameter count that kvsim.cost.generalize.model_shape reads as a gated MLP."""
    h, d = s["hidden_size"], s["head_dim"]
    attn = h * d * (2 * s["num_heads"] + 2 * s["num_kv_heads"])
    return s["num_layers"] * (attn + 3 * h * s["intermediate_size"]) + 2 * s["vocab_size"] * h
