"""`kvsim calibrate`: measure a model's kernels with PyTorch and write a profile.

Imported only when the command runs; needs the optional extra ``kvsim[calibrate]``.
What it measures (a tensor-parallel degree is measured as one GPU's share of each op):

* the linear-layer ops of kvsim.cost.fit.LINEAR_OPS with the model's shapes (eager
  torch.matmul, RMSNorm, RoPE, SiLU-and-mul, embedding gather, residual add, LM head)
  over a grid of token counts and tp degrees;
* prefill attention (torch SDPA, causal; a chunk on a cache uses a bottom-right causal
  mask) over chunk x cached context;
* decode attention over a paged KV cache: K and V stored in the KV dtype (bf16, fp8
  e4m3, int8 with a scale) in blocks at random physical places, gathered through a
  block table, converted and attended with SDPA, over batch x context x block size x
  KV dtype; and the KV write (index_copy_ into the cache) for each step size;
* the all-reduce, where tp workers fit: NCCL across GPUs, gloo across CPU processes
  (kvsim.calibrate.allreduce); on one GPU it is not measured and the profile says so.

Then, where the model's weights fit on the GPU, it times whole forward steps of the
model and stores them, with the profile's prediction for each, as ``validation`` in
meta.json (kvsim.calibrate.validate); where they do not, its notes say so.

PyTorch's gather + SDPA is not a fused paged-attention kernel (FlashInfer, vLLM), so
decode times here are those of this reference implementation. ``--quick`` is a smoke
test: tiny grids and, on CPU, every width divided by 8 (recorded as ``shape_scale`` in
meta.json); its times do not describe the real model. On CUDA the timer is CUDA events
around each op, with the host's launch latency kept out (Timer); on CPU it is
perf_counter.
"""

from __future__ import annotations

import itertools
import math
import platform
import time
from datetime import datetime, timezone

import numpy as np
import pandas as pd

from kvsim import __version__
from kvsim.calibrate.allreduce import measure as measure_allreduce
from kvsim.config.errors import InputError
from kvsim.cost.generalize import gpu_fits, model_shape, token_grid
from kvsim.cost.fit import LINEAR_OPS, fit_attention
from kvsim.cost.profiles import FORMAT, Profile
from kvsim.model.specs import GPU_PRESETS, ModelSpec
from kvsim.calibrate.validate import no_room, rms_norm, rope, validate

KV_STORAGE = {"bf16": 16, "fp8": 8, "int8": 8}  # int4 has no torch storage type: not measured
# More than any GPU L2 or CPU last-level cache that kvsim calibrates on: weights and KV
# are spread over this many bytes so that no timed call finds them still cached.
CACHE_BYTES = 256 * 2**20


def _torch():
    try:
        import torch
    except ImportError:
        raise InputError(
            "command line", "calibrate", "PyTorch is not installed; pip install 'kvsim[calibrate]'"
        ) from None
    return torch


class Timer:
    """Median seconds of `reps` calls after `warmup` calls. Several functions are timed
    in rounds (each once per round), so a burst of load on a shared machine raises one
    call of each rather than every call of one.

    On CUDA a call is timed with events as the GPU runs it when fed without gaps: the
    GPU spins (torch.cuda._sleep) while the host enqueues the events and the call's
    kernels, so the host's launch latency is not in the time. An engine hides that
    latency with CUDA graphs, and kvsim's engine overhead stands for what it does not
    hide. If the GPU reached the call before the host had enqueued all of it, the spin
    doubles and the call is timed again. `launched=True` times calls as the host
    launches them, latency included."""

    SPIN_CYCLES = 2_000_000  # about 1 ms at an H100's or H200's clock
    MAX_SPIN_CYCLES = SPIN_CYCLES << 8

    def __init__(self, torch, device: str, warmup: int, reps: int, launched: bool = False):
        self.torch, self.cuda, self.warmup, self.reps = torch, device == "cuda", warmup, reps
        self.launched, self.spin = launched, self.SPIN_CYCLES

    def __call__(self, fn) -> float:
        return self.rounds({0: fn})[0]

    def rounds(self, fns: dict) -> dict:
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        times = {key: [] for key in fns}
        for _ in range(self.reps):
            for key, fn in fns.items():
                times[key].append(self._once(fn))
        return {key: float(np.median(t)) for key, t in times.items()}

    def _once(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        while True:
            if not self.launched:
                cuda._sleep(self.spin)
            start.record()
            fn()
            end.record()
            fed = self.launched or not start.query()  # the GPU still spinning: no gaps
            cuda.synchronize()
            if fed:
                return start.elapsed_time(end) * 1e-3
            if self.spin >= self.MAX_SPIN_CYCLES:
                raise RuntimeError(
                    "the host could not enqueue a timed call while the GPU spun "
                    "(more kernels than the launch queue holds?)"
                )
            self.spin *= 2


def plan(model: ModelSpec, device: str, quick: bool) -> dict:
    shape = model_shape(model)
    scale = 8 if quick and device == "cpu" else 1
    measured = dict(shape)
    for key in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
        measured[key] = max(shape[key] // scale, 1)
    tps = [1, 2] if quick else [1, 2, 4, 8]
    grid = {
        "tokens": [1, 4, 8, 64, 256] if quick else token_grid(16384, per_octave=4),
        "chunks": [16, 64] if quick else [64, 256, 1024, 4096, 8192],
        "cached": [0, 128] if quick else [0, 1024, 4096, 12288],
        "batches": [1, 4] if quick else [1, 4, 16, 64, 256],
        "contexts": [64, 256] if quick else [256, 1024, 4096, 16384],
        "block_sizes": [16, 32] if quick else [8, 16, 32],
        "warmup": 1 if quick else 3,
        "reps": 5 if quick else 10,
        # skip points whose tensors would not fit comfortably: K+V elements gathered
        # for decode, and query x key pairs for a masked prefill
        "max_kv_elems": 1 << 30,
        "max_pairs": 1 << 26,
    }
    return {
        "shape": shape,
        "measured": measured,
        "scale": scale,
        "tps": [t for t in tps if measured["num_heads"] % t == 0],
        **grid,
    }


def measure_linear(torch, p: dict, dev: str, dtype, timer: Timer, log=print) -> pd.DataFrame:
    s = p["measured"]
    h, d, heads, kvh = s["hidden_size"], s["head_dim"], s["num_heads"], s["num_kv_heads"]
    ffn, vocab = s["intermediate_size"], s["vocab_size"]
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
    rows = []
    for tp in p["tps"]:
        qh, kh, f = heads // tp, max(kvh // tp, 1), math.ceil(ffn / tp)
        w = rotation(
            lambda: {
                "qkv": rnd(h, (qh + 2 * kh) * d),
                "o": rnd(qh * d, h),
                "up": rnd(h, 2 * f),
                "down": rnd(f, h),
                "lm": rnd(h, math.ceil(vocab / tp)),
                "norm": rnd(h),
            }
        )
        emb = rnd(vocab, h)  # a lookup reads only its rows: one table is enough
        for n in p["tokens"]:
            x, y, up = rnd(n, h), rnd(n, qh * d), rnd(n, 2 * f)
            q, cos = rnd(n, qh + kh, d), rnd(n, 1, d // 2)
            ids = torch.randint(0, vocab, (n,), device=dev)
            ops = {
                "emb": lambda: torch.nn.functional.embedding(ids, emb),
                "input_layernorm": lambda: rms_norm(torch, x, w()["norm"]),
                "attn_pre_proj": lambda: x @ w()["qkv"],
                "attn_rope": lambda: rope(torch, q, cos, cos),
                "attn_post_proj": lambda: y @ w()["o"],
                "mlp_up_proj": lambda: x @ w()["up"],
                "mlp_act": lambda: torch.nn.functional.silu(up[:, :f]) * up[:, f:],
                "mlp_down_proj": lambda: up[:, :f] @ w()["down"],
                "add": lambda: x + x,
                "lm_head": lambda: x @ w()["lm"],
            }
            ops["post_attention_layernorm"] = ops["input_layernorm"]
            times = timer.rounds({op: ops[op] for op in LINEAR_OPS})
            rows.append({"tp": tp, "num_tokens": n, **{op: times[op] * 1e3 for op in LINEAR_OPS}})
        log(f"  linear ops at tp {tp}: done")
    return pd.DataFrame(rows)


def rotation(make):
    """A function that returns the next of enough copies of make()'s tensors to fill
    CACHE_BYTES, so each call reads its weights from memory, as in a forward pass where
    every layer has its own."""
    first = make()
    size = sum(t.nelement() * t.element_size() for t in first.values())
    return itertools.cycle([first] + [make() for _ in range(math.ceil(CACHE_BYTES / size) - 1)]).__next__


def _cycler(rows):
    """A function that returns rows[0], rows[1], ... and starts over (a tensor's rows are
    indexed one at a time: iterating it would make every row's view at once)."""
    count = itertools.count()
    return lambda: rows[next(count) % len(rows)]


def _pool_blocks(blocks_needed: int, block_bytes: int) -> int:
    return max(blocks_needed, math.ceil(CACHE_BYTES / block_bytes))


def measure_attention(torch, p: dict, dev: str, dtype, timer: Timer, log=print) -> pd.DataFrame:
    s = p["measured"]
    d, heads, kvh = s["head_dim"], s["num_heads"], s["num_kv_heads"]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
    rows = []
    for tp in [t for t in p["tps"] if kvh % t == 0]:
        qh, kh = heads // tp, kvh // tp
        for n in p["chunks"]:
            for ctx in p["cached"]:
                if ctx and n * (ctx + n) > p["max_pairs"]:
                    continue
                q, k, v = rnd(1, qh, n, d), rnd(1, kh, ctx + n, d), rnd(1, kh, ctx + n, d)
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=dev).tril(diagonal=ctx)
                fn = (
                    (lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
                    if ctx == 0
                    else (lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True))
                )
                rows.append(
                    _row(
                        "prefill",
                        tp,
                        1,
                        n,
                        ctx,
                        16,
                        "bf16",
                        timer(fn),
                        _kv_write(torch, timer, n, kh, d, 16, "bf16", dev, dtype),
                    )
                )
        for bs in p["block_sizes"]:
            for kv_dtype in KV_STORAGE:
                for batch in p["batches"]:
                    for ctx in p["contexts"]:
                        if 2 * batch * ctx * kh * d > p["max_kv_elems"]:
                            continue
                        fn = _paged_decode(torch, batch, ctx, qh, kh, d, bs, kv_dtype, dev, dtype)
                        rows.append(
                            _row(
                                "decode",
                                tp,
                                batch,
                                0,
                                ctx,
                                bs,
                                kv_dtype,
                                timer(fn),
                                _kv_write(torch, timer, batch, kh, d, bs, kv_dtype, dev, dtype),
                            )
                        )
        log(f"  attention at tp {tp}: done")
    return pd.DataFrame(rows)


def _row(phase, tp, batch, chunk, ctx, bs, kv_dtype, t, write) -> dict:
    return {
        "phase": phase,
        "tp": tp,
        "batch_size": batch,
        "chunk_tokens": chunk,
        "context": ctx,
        "block_size": bs,
        "kv_dtype": kv_dtype,
        "kv_bits": KV_STORAGE[kv_dtype],
        "time_ms": t * 1e3,
        "kv_write_ms": write * 1e3,
    }


def _storage(torch, kv_dtype: str, dtype):
    """The KV dtype's torch type, and the type a cache of it is held in: fp8 as its bytes,
    since gather and index_copy_ have no fp8 kernels."""
    store = {"bf16": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_dtype]
    return store, torch.uint8 if kv_dtype == "fp8" else store


def _paged_decode(torch, batch, ctx, qh, kh, d, bs, kv_dtype, dev, dtype):
    """Decode over K/V blocks at random places in a pool of at least CACHE_BYTES, gathered
    through a block table; successive calls use disjoint blocks, so none is cached."""
    per_seq = -(-ctx // bs)
    _, held = _storage(torch, kv_dtype, dtype)
    n_blocks = _pool_blocks(batch * per_seq, bs * kh * d * held.itemsize)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tables = torch.randperm(n_blocks, generator=gen)[: n_blocks // (batch * per_seq) * batch * per_seq]
    tables = _cycler(tables.view(-1, batch, per_seq).to(dev))
    raw = [torch.zeros(n_blocks, bs, kh, d, device=dev, dtype=held) for _ in "kv"]  # zeros: no denormals
    q, scale = torch.randn(batch, qh, 1, d, device=dev, dtype=dtype), 0.05

    def step():
        table = tables()
        k, v = (
            _as(torch, c[table], kv_dtype).view(batch, per_seq * bs, kh, d)[:, :ctx].transpose(1, 2).to(dtype)
            for c in raw
        )
        if kv_dtype == "int8":
            k, v = k * scale, v * scale
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return step


def _kv_write(torch, timer, tokens, kh, d, bs, kv_dtype, dev, dtype) -> float:
    """Scatter `tokens` new K and V vectors into random slots of a paged cache."""
    store, held = _storage(torch, kv_dtype, dtype)
    slots = _pool_blocks(4 * tokens, 2 * kh * d * held.itemsize)
    cache = [torch.zeros(slots, kh, d, device=dev, dtype=held) for _ in "kv"]
    new = torch.randn(tokens, kh, d, device=dev, dtype=dtype).to(store).view(held)
    where = torch.randperm(slots, device=dev)[: slots // tokens * tokens].view(-1, tokens)
    where = _cycler(where)

    def write():  # each call writes other slots
        at = where()
        for c in cache:
            c.index_copy_(0, at, new)

    return timer(write)


def _as(torch, x, kv_dtype: str):
    return x.view(torch.float8_e4m3fn) if kv_dtype == "fp8" else x


def detect_gpu(torch, device: str) -> tuple[str, str]:
    """(kvsim GPU preset or 'custom'/'cpu', device description)."""
    if device == "cpu":
        return "cpu", f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    name = torch.cuda.get_device_name(0)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    for key, preset in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb" if mem > 60 else "a100-40gb")):
        if key in name:
            return preset, name
    return "custom", name


def calibrate(model: ModelSpec, device: str, quick: bool, gpu_name: str | None, log=print) -> Profile:
    torch = _torch()
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("command line", "--device", "CUDA is not available here; use --device cpu")
    detected, description = detect_gpu(torch, device)
    gpu = gpu_name or detected
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    p = plan(model, device, quick)
    timer = Timer(torch, device, p["warmup"], p["reps"])
    log(f"measuring linear ops: {len(p['tps'])} tp x {len(p['tokens'])} token counts")
    linear = measure_linear(torch, p, device, dtype, timer, log)
    log("measuring attention: prefill, paged decode, KV writes")
    att = measure_attention(torch, p, device, dtype, timer, log)
    preset = GPU_PRESETS.get(gpu)
    # CPU (or an unknown GPU) has no datasheet peaks: efficiencies are then relative to
    # nominal 1 TFLOP/s and 100 GB/s, and the cost model converts back with the same numbers.
    peak, bw = (preset.bf16_tflops * 1e12, preset.hbm_tb_s * 1e12) if preset else (1e12, 1e11)
    fits = fit_attention({c: att[c].values for c in att}, p["measured"], peak, bw)
    log("measuring all-reduce where tp workers fit (GPUs, or CPU processes)")
    allreduce, why_not = measure_allreduce(
        torch, device, p["tps"], p["tokens"], p["measured"]["hidden_size"], p["warmup"], p["reps"], log
    )
    if allreduce is None:
        log(f"  all-reduce not measured: {why_not}")
        known = gpu_fits().get("h100-80gb" if gpu == "h200" else gpu)
        allreduce = (
            dict(known["allreduce"])
            if known
            else {"bus_gb_s": 100.0, "latency_s": 1e-5, "source": "ASSUMED placeholder"}
        )
        allreduce["source"] += f"; calibrate could not measure it: {why_not}"
    meta = {
        "format": FORMAT,
        "name": f"{gpu}-{model.name}" + ("-quick" if quick else ""),
        "gpu": gpu,
        "device": description,
        "model": p["shape"],
        "measured_shape": p["measured"],
        "shape_scale": p["scale"],
        "dtype": str(dtype).replace("torch.", ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "tools": {
            "kvsim": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda if device == "cuda" else None,
        },
        "source": "kvsim calibrate: PyTorch eager ops (matmul, SDPA, gather through a block table)",
        "license": "measurements made by the user",
        "peak_flops": peak,
        "bandwidth": bw,
        "origin": {
            "linear": "measured",
            "attention": "fitted on the measured points in attention.csv",
            "allreduce": allreduce["source"],
        },
        "attention": fits,
        "allreduce": allreduce,
        "step_overhead_s": 0.0,
        "step_overhead_source": "not measured; the engine's comes from cost_model.overhead",
        "notes": [
            "decode = PyTorch gather through a block table + SDPA, not a fused paged kernel",
            "elementwise ops (RMSNorm, RoPE, SiLU-and-mul) are eager PyTorch, several kernels each",
            "int4 KV not measured (no torch storage type)",
        ]
        + (["CUDA times exclude the host's launch latency (the GPU fed without gaps)"] if device == "cuda" else [])
        + (
            [f"--quick on CPU: widths divided by {p['scale']}; times do not describe the real model"]
            if p["scale"] > 1
            else []
        ),
    }
    profile = Profile(meta, linear, att)
    why = no_room(torch, p["measured"], device, dtype)
    if why:
        log(f"whole forward steps not timed: {why}")
        meta["notes"].append(f"whole forward steps not timed: {why}")
    else:
        meta["validation"] = validate(torch, profile, device, dtype, timer, quick, log)
    return profile
