"""How long one engine step takes.

A step runs the model once over every token scheduled in it: new prompt tokens
(prefill, possibly a chunk) and one token per decoding sequence. The scheduler
describes the step as a `StepBatch`; a cost model turns it into seconds.

`Roofline` is the ideal bound: the step takes as long as the slower of reading its
bytes at peak HBM bandwidth and doing its FLOPs at peak dense BF16 compute. It ignores
kernel efficiency, launch and scheduling overheads and tensor-parallel communication,
so its times are lower bounds; every output that uses it says "roofline". A MoE
model's step reads its shared weights and the experts its tokens touch
(kvsim.cost.moe.expected_experts) and computes on the active parameters.

`Profiled` sums measured per-operator kernel times (kvsim.cost.profiles, kvsim.cost.fit) part
by part and adds the engine's overhead and tensor-parallel communication
(kvsim.cost.overhead, fitted on measured serving steps); `make_cost_model` turns the
scenario's `cost_model` into one of the two.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Protocol

from kvsim.config.errors import InputError
from kvsim.cost.generalize import check_profile, find_shipped, model_shape, synthesize
from kvsim.cost.fit import LINEAR_OPS, PER_STEP_OPS, kv_bytes_per_token
from kvsim.cost.overhead import DEFAULT, NONE, VLLM_V1_H100, Comm, Overhead, inline, load_overhead
from kvsim.cost.engine_terms import ApiServer
from kvsim.cost.moe import expected_experts
from kvsim.model.specs import GPUSpec, KVSpec, ModelSpec

DEFAULT_LIMITS = (1024, 8192)  # vLLM V1's max_num_seqs, max_num_batched_tokens on a large GPU


class Decodes(NamedTuple):
    """Decoding sequences given only in sum (kvsim.sim.lazy's): how many, the tokens their
    contexts hold together, and how many blocks of `block_size` those contexts fill
    (each context rounded up; 0 when block_size is None). A named tuple, as StepBatch:
    the fast path makes one per step."""

    sequences: int  # (not `count`: a tuple's method)
    total: int
    blocks: int = 0
    block_size: int | None = None


class StepBatch(NamedTuple):
    """One step's work (immutable, as every step makes one).

    prefills: (chunk tokens, tokens already cached before the chunk) per prefilling
    sequence; decode_contexts: the tokens each decoding sequence attends to (its KV,
    the new token's included); extra: further decoding sequences, in sum. Cost models
    read the decodes only through `decodes`, `decode_total` and `decode_blocks`, which
    are exact integers however the decodes are given.
    """

    prefills: tuple[tuple[int, int], ...]
    decode_contexts: tuple[int, ...]
    extra: Decodes | None = None

    @classmethod
    def build(cls, prefills, decode_contexts, extra: Decodes | None = None) -> "StepBatch":
        return cls(tuple(map(tuple, prefills)), tuple(decode_contexts), extra)

    # The sums below skip empty parts: a fast-path step has only `extra`, and an empty
    # sum is the int 0, so each value (and its type) is the one the full sum gives.
    @property
    def decodes(self) -> int:
        """Decoding sequences."""
        return len(self.decode_contexts) + (self.extra.sequences if self.extra else 0)

    @property
    def decode_total(self) -> int:
        """Tokens of context the decoding sequences attend to, together."""
        total = sum(self.decode_contexts) if self.decode_contexts else 0
        return total + self.extra.total if self.extra else total

    def decode_blocks(self, block_size: int) -> int:
        """Blocks of `block_size` the decoding sequences' contexts fill."""
        blocks = sum(-(-c // block_size) for c in self.decode_contexts)
        if self.extra and self.extra.sequences:
            if self.extra.block_size != block_size:
                raise ValueError(
                    f"decodes counted in blocks of {self.extra.block_size}, asked for blocks of {block_size}"
                )
            blocks += self.extra.blocks
        return blocks

    @property
    def new_tokens(self) -> int:
        """Prefill tokens plus one per decoding sequence."""
        if not self.prefills:
            return self.decodes
        return sum(n for n, _ in self.prefills) + self.decodes

    @property
    def attended_pairs(self) -> float:
        """(query, key) pairs attention computes: causal within a chunk, full to its cache."""
        if not self.prefills:
            return self.decode_total
        return sum(n * (ctx + (n + 1) / 2) for n, ctx in self.prefills) + self.decode_total

    @property
    def kv_tokens_read(self) -> int:
        """KV tokens attention reads: each sequence's whole context."""
        if not self.prefills:
            return self.decode_total
        return sum(ctx + n for n, ctx in self.prefills) + self.decode_total


class CostModel(Protocol):
    """What the step loop and the reports ask of a step-cost model."""

    label: str
    measured_kv_dtypes: tuple[str, ...]  # quantized KV dtypes whose dequantizing it timed

    @property
    def block_size(self) -> int | None:
        """The KV block size it prices attention's reads in (None: token by token); the
        fast path sums decode contexts in these blocks for it."""

    @property
    def api(self) -> ApiServer | None:
        """What the engine's HTTP server adds to each response (kvsim.cost.engine_terms),
        or None."""

    def price(self, batch: StepBatch) -> tuple[float, tuple[str, ...]]:
        """Seconds for one step, and why it extrapolated beyond measured ranges (if it did)."""

    def step_time(self, batch: StepBatch) -> float:
        """Seconds for one step."""

    def parts(self, batch: StepBatch) -> tuple[dict[str, float], tuple[str, ...]]:
        """Seconds of each part of one step (they sum to its price), and why it
        extrapolated; `kvsim cost` prints them."""


def describe(label: str, extrapolated: int, steps: int, reasons) -> str:
    """A run's cost_model column: the model's label and the steps it extrapolated in."""
    if not extrapolated:
        return label
    reasons = sorted(set(reasons))
    why = "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    return f"{label} [extrapolated in {extrapolated}/{steps} steps: {why}]"


_DESCRIBED = re.compile(r"^(?P<label>.*?) \[extrapolated in (?P<n>\d+)/(?P<steps>\d+) steps: (?P<why>.*)\]$")


class Described(NamedTuple):
    """describe() read back: the model's label, how many of a run's steps it priced
    beyond measured ranges, of how many, and why."""

    label: str
    extrapolated: int
    steps: int
    why: str


def undescribe(text: str) -> Described:
    """describe() read back; a label without extrapolations has 0 of 0 steps and no why."""
    m = _DESCRIBED.match(str(text))
    if not m:
        return Described(str(text), 0, 0, "")
    return Described(m["label"], int(m["n"]), int(m["steps"]), m["why"])


class NoProfile(LookupError):
    """No shipped or predicted profile covers this GPU and model."""


class Roofline:
    label = "roofline"
    block_size = None  # contexts priced token by token
    api = None  # no server in a roofline
    measured_kv_dtypes: tuple[str, ...] = ()  # it prices bytes and FLOPs, no dequantization

    def __init__(self, model: ModelSpec, gpu: GPUSpec, kv: KVSpec, tp: int):
        self.tp = tp
        self.peak_flops = gpu.bf16_tflops * 1e12
        self.bandwidth = gpu.hbm_tb_s * 1e12
        self.weight_bytes = model.weight_bytes()
        self.flops_per_token = 2 * model.flop_params  # one multiply-add per weight
        self.moe = None
        if model.is_moe:  # (bytes of the weights every step reads, of one layer's expert, ...)
            per_param = model.expert_bytes_per_param
            self.weight_bytes -= model.routed_params * per_param
            self.moe = (model.moe_layers * model.expert_params * per_param, model.experts_per_token, model.num_experts)
        # QK^T and PV: two matmuls, 2 FLOPs per multiply-add, over every query head.
        self.flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
        self.kv_bytes_per_token = kv.bytes_per_token

    def price(self, batch: StepBatch) -> tuple[float, tuple[str, ...]]:
        return self.step_time(batch), ()

    def parts(self, batch: StepBatch) -> tuple[dict[str, float], tuple[str, ...]]:
        return {"roofline": self.step_time(batch)}, ()  # a bound, in one piece

    def step_time(self, batch: StepBatch) -> float:
        if batch.prefills:
            new_tokens, pairs, kv_read = batch.new_tokens, batch.attended_pairs, batch.kv_tokens_read
        else:  # decodes alone: each attends to, and reads, its context
            new_tokens, kv_read = batch.decodes, batch.decode_total
            pairs = kv_read
        flops = new_tokens * self.flops_per_token + pairs * self.flops_per_pair
        # Weights are read once per step; KV is read for attention and written for new tokens.
        weights = self.weight_bytes
        if self.moe:
            layer_expert, k, experts = self.moe
            weights += layer_expert * float(expected_experts(new_tokens, k, experts))
        moved = weights + (kv_read + new_tokens) * self.kv_bytes_per_token
        return max(flops / self.peak_flops, moved / self.bandwidth) / self.tp


# A Profiled step's parts, in the order they are reported and summed.
PARTS = (
    "linear",
    "attention_prefill",
    "attention_decode",
    "kv_write",
    "allreduce",
    "embedding",
    "lm_head",
    "overhead_step",
    "overhead_seqs",
    "overhead_prompt_tokens",
    "overhead_launch",
)


class _Counted(NamedTuple):
    """What a Profiled step's parts owe to its counts of tokens, sequences and decodes
    alone (its kernels' factors applied), and why those parts extrapolated."""

    linear: float
    kv_write: float
    allreduce: float
    embedding: float
    lm_head: float
    host: tuple[float, ...]  # the overhead's host parts (Overhead.host), in order
    launch: float | None  # None: the launch wait, which depends on the device time
    why_before: tuple[str, ...]  # (the linear ops' and LM head's reasons ...
    why_after: tuple[str, ...]  # ... come before attention's, the overhead's after)


class Profiled:
    """Step time from measured per-operator kernel times (kvsim.cost.profiles), part by part:

        step = layers x (linear ops(N) + prefill attention + decode attention + KV write
                         + 2 all-reduces when tp > 1) + embedding(N) + LM head(S)
               + host overhead(S, prompt tokens) + launch wait

    N is the step's new tokens, S its sequences (each produces logits). Linear ops are
    interpolated in the profile's table; attention and KV writes use the fitted forms
    (kvsim.cost.fit) with this model's shapes, KV dtype and block size and this GPU's
    peaks; whole prompts and chunks on a cache are separate kernels, all decodes one.
    All-reduce is the overhead's fitted communication (kvsim.cost.overhead.Comm) or, when it
    has none, the profile's ring: latency + 2 (tp-1)/tp x N x hidden x 2 B / bus bandwidth.
    The launch wait is the CPU time to launch every layer's kernels beyond what the device
    time above (kernels and all-reduce) hides (kvsim.cost.overhead.Overhead.launch_wait).
    An overhead for an engine with CUDA graphs (kvsim.cost.engine_terms) prices each step
    by its mode (kvsim.cost.graphs): a graph step's linear ops and embedding run at the
    padded size and launch nothing per layer (full) or the attention layers between the
    pieces (piecewise); only an eager step pays the launch wait. `limits` are the
    engine's (max_num_seqs, max_num_batched_tokens), which set the captured sizes; None
    takes vLLM V1's defaults on a large GPU (1024, 8192). The overhead's `kernels`
    scale the profile's parts where that engine's kernels are measured to differ.
    `overhead` None keeps the profile's own fixed step_overhead_s (0 in shipped profiles).
    `price` names what a step left the measured ranges for; the run counts them
    (kvsim.sim.loop), so this object keeps no history and `label` is fixed.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        kv: KVSpec,
        tp: int,
        profile=None,
        block_size: int | None = None,
        overhead: Overhead | None = None,
        limits: tuple[int, int] | None = None,
    ):
        profile = profile or find_shipped(model, gpu) or synthesize(model, gpu)
        if profile is None:
            raise NoProfile(f"{gpu.name}/{model.name}")
        meta = profile.meta
        self.profile, self.tp, self.block_size = profile, tp, block_size
        self.shape = model_shape(model)
        self.layers = self.shape["num_layers"]
        # Attention efficiencies are relative to the peaks they were fitted against.
        self.peak = meta.get("peak_flops", gpu.bf16_tflops * 1e12)
        self.bw = meta.get("bandwidth", gpu.hbm_tb_s * 1e12)
        bits = kv.bytes_per_token * 8 / model.kv_elements_per_token  # scales included
        self.kv_per_token = kv_bytes_per_token(self.shape, tp, bits)
        self.flops_per_pair = 4 * self.shape["num_heads"] / tp * self.shape["head_dim"]
        self.att = meta["attention"]
        by_dtype = self.att.get("decode_by_dtype", {})
        dt = kv.kv_cache_dtype.split("_")[0]  # fp8_e4m3 -> fp8
        self.decode_fit = (
            by_dtype.get(dt) or by_dtype.get({"bf16": "fp16", "fp16": "bf16"}.get(dt)) or self.att["decode"]
        )
        self.measured_kv_dtypes = tuple(by_dtype)  # whose dequantizing the profile timed
        ar = meta["allreduce"]
        profile_comm = Comm(latency_s=ar["latency_s"], bus_gb_s=ar["bus_gb_s"])
        if overhead is None:
            fixed = meta.get("step_overhead_s", 0.0)
            overhead = inline(step_ms=fixed * 1e3) if fixed else NONE
        # A fitted communication replaces an assumed all-reduce, never a measured one.
        if overhead.comm and not str(ar.get("source", "ASSUMED")).startswith("ASSUMED"):
            overhead = replace(overhead, comm=None, label=f"{overhead.label} (host part; measured all-reduce)")
        self.overhead = overhead.for_gpu(gpu)
        self.comm = self.overhead.comm or profile_comm
        terms = self.overhead.graphs
        self.graphs = None if terms is None else terms.capture(*(limits or DEFAULT_LIMITS))
        self.piecewise_per_layer_s = 0.0 if terms is None else terms.piecewise_per_layer_s
        self.scale = dict(self.overhead.kernels)
        base = meta.get("label", f"profile:{profile.name}")
        base = base if meta["gpu"] == gpu.name else f"{base} (measured on {meta['gpu']})"
        self.label = f"{base} + {self.overhead.label}"
        # what a step's parts owe to its counts alone (tokens, sequences, decodes), kept
        # per counts (`_counted`): most steps of a run repeat the counts of an earlier one
        self._counted: dict[tuple[int, int, int], _Counted] = {}

    def _ops(self, tokens: int, ops) -> tuple[float, list[str]]:
        return self.profile.ops_time(ops, tokens, self.tp, self.overhead.linear == "envelope")

    def _ramp(self, name: str, work: float, rate: float, extra: float = 0.0, why=None) -> float:
        f = (self.decode_fit if name == "decode" else self.att[name]) or self.att["prefill_fresh"]
        if work > f["range"][1] and why is not None:
            why.append(f"{name} attention beyond measured work")
        return f["a_s"] + work / (rate * f["e_max"]) * (1 + (f["w_half"] / max(work, 1.0)) ** f["k"]) + extra

    def _counted_parts(self, n: int, seqs: int, decodes: int) -> _Counted:
        """The parts of a step of `n` new tokens over `seqs` sequences, `decodes` of them
        decoding, that depend on these counts alone (see `parts`)."""
        padded = self.graphs.padded(n) if self.graphs else None
        run = padded or n  # the tokens the linear ops compute on
        layer_linear, lwhy = self._ops(run, [o for o in LINEAR_OPS if o not in PER_STEP_OPS])
        emb = self._ops(run, ["emb"])[0]
        lm_head, hwhy = self._ops(seqs, ["lm_head"])
        w = self.att.get("kv_write") or {}
        pre_tokens = n - decodes
        kv_write = (
            (
                w.get("a_s", 0.0)
                + w.get("per_prefill_token_s", 0.0) * pre_tokens
                + w.get("per_decode_token_s", 0.0) * decodes
            )
            if w
            else 0.0
        )
        L, scale = self.layers, self.scale
        if padded is None:  # every kernel launched by the CPU: the wait depends on the device time
            launch = None
        elif self.graphs is not None and self.graphs.mode(n, seqs) == "piecewise":
            launch = L * self.piecewise_per_layer_s
        else:
            launch = 0.0
        return _Counted(
            L * layer_linear * scale.get("linear", 1.0),  # (x * 1.0 is x to the last bit)
            L * kv_write,
            self.comm.seconds(self.tp, self.layers, self.shape["hidden_size"], run),
            emb,
            lm_head * scale.get("lm_head", 1.0),
            tuple(self.overhead.host(seqs, pre_tokens).values()),
            launch,
            tuple(lwhy + hwhy),
            tuple(self.overhead.outside(self.tp, seqs, n)),
        )

    def _seconds(self, batch: StepBatch) -> tuple[tuple[float, ...], tuple[str, ...]]:
        """Each part's seconds, in PARTS order, and why the step extrapolated."""
        decodes = batch.decodes
        n = batch.new_tokens if batch.prefills else decodes
        key = (n, len(batch.prefills) + decodes, decodes)
        counted = self._counted.get(key)
        if counted is None:
            counted = self._counted[key] = self._counted_parts(*key)
        why = list(counted.why_before)
        prefill = 0.0
        if batch.prefills:
            fresh = sum(c * (c + 1) / 2 for c, ctx in batch.prefills if ctx == 0) * self.flops_per_pair
            cached = sum(c * (ctx + (c + 1) / 2) for c, ctx in batch.prefills if ctx) * self.flops_per_pair
            prefill = (self._ramp("prefill_fresh", fresh, self.peak, why=why) if fresh else 0.0) + (
                self._ramp("prefill_cached", cached, self.peak, why=why) if cached else 0.0
            )
        decode = 0.0
        if decodes:
            d = self.decode_fit
            blocks = batch.decode_blocks(self.block_size) if self.block_size else decodes
            decode = self._ramp(
                "decode",
                batch.decode_total * self.kv_per_token,
                self.bw,
                why=why,
                extra=d.get("per_seq_s", 0.0) * decodes + d.get("per_block_s", 0.0) * blocks,
            )
        why += counted.why_after
        L, scale = self.layers, self.scale
        prefill = L * prefill * scale.get("attention_prefill", 1.0)
        decode = L * decode * scale.get("attention_decode", 1.0)
        device = (
            counted.linear,
            prefill,
            decode,
            counted.kv_write,
            counted.allreduce,
            counted.embedding,
            counted.lm_head,
        )
        launch = counted.launch
        if launch is None:
            launch = self.overhead.launch_wait(L, sum(device))
        return (*device, *counted.host, launch), tuple(why)

    def parts(self, batch: StepBatch) -> tuple[dict[str, float], tuple[str, ...]]:
        """Seconds per part of one step (they sum to step_time), and why it extrapolated."""
        seconds, why = self._seconds(batch)
        return dict(zip(PARTS, seconds)), why

    @property
    def api(self) -> ApiServer | None:
        """What the overhead's API server adds to each request (kvsim.cost.engine_terms), or None."""
        return self.overhead.api

    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        """Seconds per part of one step (they sum to step_time)."""
        return self.parts(batch)[0]

    def price(self, batch: StepBatch) -> tuple[float, tuple[str, ...]]:
        seconds, why = self._seconds(batch)
        return sum(seconds), why

    def step_time(self, batch: StepBatch) -> float:
        return self.price(batch)[0]


ENGINE_DEFAULTS: dict[tuple[str | None, str], str] = {
    ("vllm-v1", "h100-80gb"): VLLM_V1_H100,
    ("vllm-v1", "h200"): VLLM_V1_H100,
}


def default_overhead(engine: str | None, gpu: str) -> Overhead:
    """What `calibrated` adds to the kernels for this engine and GPU: the vLLM V1 overhead
    fitted on H100 runs for vLLM V1 on an H100 or H200 (the same host and NVLink), the
    splitwise one (a 2023 stack without CUDA graphs) elsewhere."""
    return load_overhead(ENGINE_DEFAULTS.get((engine, gpu), DEFAULT))


def choose_overhead(choice, base_dir=".", src: str = "scenario", engine: str | None = None, gpu: str = "") -> Overhead:
    """The engine overhead a cost_model asks for: the default for this engine and GPU
    (`default_overhead`) unless it names one."""
    given = getattr(choice, "overhead", None)
    ms = getattr(choice, "step_overhead_ms", None)
    if ms is not None:  # the deprecated spelling of overhead: {step_ms: X}
        if given is not None:
            raise InputError(
                src,
                "cost_model.step_overhead_ms",
                "give overhead: {step_ms: X} (step_overhead_ms is its deprecated spelling), not both",
            )
        return inline(step_ms=ms)
    if given is None:
        return default_overhead(engine, gpu)
    if isinstance(given, str):
        return load_overhead(given, Path(base_dir), src, "cost_model.overhead")
    return inline(**given.model_dump())


def make_cost_model(
    choice,
    model: ModelSpec,
    gpu: GPUSpec,
    kv: KVSpec,
    tp: int,
    *,
    block_size: int | None = None,
    base_dir=".",
    src: str = "scenario",
    engine: str | None = None,
    limits: tuple[int, int] | None = None,
) -> CostModel:
    """The scenario's cost_model: "roofline", "calibrated" (the shipped profile for this GPU
    and model, else one predicted from the GPU's fits, else roofline, named as the
    fallback; plus the shipped engine overhead), or {profile: NAME_OR_PATH, overhead:
    NAME | none | {step_ms, per_seq_ms, per_prefill_token_ms}} (either key may be left out).
    The roofline is a lower bound and takes no overhead."""
    if choice == "roofline":
        return Roofline(model, gpu, kv, tp)
    ref = getattr(choice, "profile", None)
    profile = check_profile(ref, model, Path(base_dir), src) if ref is not None else None
    overhead = choose_overhead(choice, base_dir, src, engine, gpu.name)
    try:
        return Profiled(model, gpu, kv, tp, profile, block_size, overhead, limits)
    except KeyError as e:
        if ref is None:
            raise
        raise InputError(
            str(ref), "meta.json", f"has no {e.args[0]!r}: not a complete kvsim profile (see kvsim/cost/profiles.py)"
        ) from None
    except NoProfile as e:  # only a missing profile falls back, never a broken one
        fallback = Roofline(model, gpu, kv, tp)
        fallback.label = f"roofline (no profile for {e.args[0]})"
        return fallback
