"""Scenario files: YAML, validated once at load into frozen objects.

Everything deeper in kvsim receives these objects and trusts them. Every problem with
the file becomes one InputError naming the file, the field and what is allowed; an
unknown key names the closest valid key.
"""

from __future__ import annotations

import difflib
import functools
import json
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from kvsim.config.engine_defaults import DEFAULT_ENGINE, EngineSettings, prefix_defaults
from kvsim.config.engine_defaults import resolve as resolve_settings
from kvsim.config.errors import InputError
from kvsim.config.inference_perf import InferencePerf
from kvsim.config.trtllm import DEFAULTS as TRTLLM
from kvsim.config.trtllm import allocator_options
from kvsim.config.trtllm import check as check_trtllm
from kvsim.model.specs import DTYPE_BITS, GPU_PRESETS, MODEL_PRESETS, GPUSpec, ModelSpec, model_from_hf_config

MAX_REPLICAS = 256
KVDtype = Literal["auto", "fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
assert set(typing.get_args(KVDtype)) - {"auto"} == set(DTYPE_BITS)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# --- workload --------------------------------------------------------------------
class Poisson(Strict):
    process: Literal["poisson"]
    rate_per_s: float = Field(gt=0)


# A coefficient of variation: outside this range a gamma or lognormal is a typo, and
# its parameters (1/cv^2, log(1 + cv^2)) overflow or divide by zero.
CV = Annotated[float, Field(ge=1e-3, le=1e3)]


class Gamma(Strict):
    """Gamma-distributed gaps: cv > 1 is burstier than Poisson, cv < 1 more regular."""

    process: Literal["gamma"]
    rate_per_s: float = Field(gt=0)
    cv: CV


class Burst(Strict):
    """Every request arrives at t = 0: memory capacity alone sets the batch."""

    process: Literal["burst"]


class Constant(Strict):
    """A fixed interval: one request every 1/rate_per_s seconds."""

    process: Literal["constant"]
    rate_per_s: float = Field(gt=0)


class Stage(Strict):
    """int(rate_per_s * duration_s) requests, timed by `process` (kvsim.workload.stages)."""

    rate_per_s: float = Field(gt=0)
    duration_s: float = Field(gt=0, le=1e9)
    process: Literal["poisson", "constant", "gamma", "inference-perf-constant", "inference-perf-poisson"] = "poisson"
    cv: CV | None = None  # gamma's coefficient of variation

    @model_validator(mode="after")
    def _cv(self):
        if (self.cv is None) == (self.process == "gamma"):
            raise ValueError("cv goes with process gamma, and only with it")
        return self


class Staged(Strict):
    """Load stages one after another (kvsim.workload.stages): open loop, or each
    starting once the previous one's requests have ended (drain), pause_s later."""

    stages: list[Stage] = Field(min_length=1, max_length=1000)
    drain: bool = False
    pause_s: float = Field(0.0, ge=0)
    poll_s: float | None = Field(None, gt=0)  # with drain: the end is seen at polls this far apart

    @model_validator(mode="after")
    def _poll(self):
        if self.poll_s is not None and not self.drain:
            raise ValueError("poll_s goes with drain: true")
        return self


def _arrival_kind(value) -> str | None:
    if isinstance(value, dict):
        return "stages" if "stages" in value else value.get("process")
    return getattr(value, "process", "stages" if hasattr(value, "stages") else None)


Arrival = Annotated[
    Union[
        Annotated[Poisson, Tag("poisson")],
        Annotated[Gamma, Tag("gamma")],
        Annotated[Burst, Tag("burst")],
        Annotated[Constant, Tag("constant")],
        Annotated[Staged, Tag("stages")],
    ],
    Discriminator(
        _arrival_kind,
        custom_error_type="arrival",
        custom_error_message="process must be 'poisson', 'gamma', 'burst' or "
        "'constant', or give stages: [{rate_per_s, duration_s}]",
    ),
]


MAX_TOKENS = 1 << 30  # lengths beyond this are typos, not workloads
# KV tiers beyond these are typos, not hardware (and their bytes would overflow a float)
MAX_TIER_GIB = 1 << 30  # 1 EiB in one tier
MAX_HICACHE_RATIO = 1e4  # a host pool 10,000 times the GPU's (SGLang's default is 2)


class Bounded(Strict):
    min: int = Field(1, ge=1, le=MAX_TOKENS)
    max: int = Field(1 << 20, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class Fixed(Strict):
    dist: Literal["fixed"]
    value: int = Field(ge=1)


class Uniform(Bounded):
    dist: Literal["uniform"]


class Lognormal(Bounded):
    dist: Literal["lognormal"]
    mean: float = Field(gt=0)
    cv: CV


class Empirical(Bounded):
    """Draws with replacement from one column of a CSV (path relative to the scenario)."""

    dist: Literal["empirical"]
    file: str
    column: str


LengthDist = Annotated[Union[Fixed, Uniform, Lognormal, Empirical], Field(discriminator="dist")]


class PrefixGroups(Strict):
    """Each prompt starts with one of `groups` shared prefixes of `tokens` tokens."""

    groups: int = Field(ge=1)
    tokens: int = Field(ge=1)
    popularity: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = Field(1.1, gt=0)


class RAG(Strict):
    """A shared system prompt, then k documents retrieved from a corpus, then the question."""

    system_tokens: int = Field(0, ge=0)
    corpus_docs: int = Field(ge=1)
    doc_tokens: int = Field(ge=1)
    docs_per_request: int = Field(ge=1)
    popularity: Literal["uniform", "zipf"] = "zipf"
    zipf_s: float = Field(1.1, gt=0)

    @model_validator(mode="after")
    def _enough_docs(self):
        if self.docs_per_request > self.corpus_docs:
            raise ValueError(f"docs_per_request ({self.docs_per_request}) exceeds corpus_docs ({self.corpus_docs})")
        return self


class Conversation(Strict):
    """Multi-turn chats: each turn's prompt is the whole previous context plus new tokens."""

    turns: int = Field(ge=1)
    think_time_s: float = Field(30.0, ge=0)


class Workload(Strict):
    num_requests: int | None = Field(None, ge=1, le=10_000_000)  # with stages: the first N
    arrival: Arrival | None = None
    # requests as an inference-perf config's data section makes them; `inference_perf:
    # PATH` reads the whole file (kvsim.config.inference_perf)
    inference_perf: InferencePerf | None = None
    # a client that has waited this long for its request's last token gives up: the engine
    # aborts the request (its KV freed) and it counts as failed (kvsim.sim.loop)
    request_timeout_s: float | None = Field(None, gt=0)
    prompt_tokens: LengthDist | None = None
    output_tokens: LengthDist | None = None
    dataset: str | None = None  # joint lengths from a preset (kvsim.workload.datasets)
    trace: str | None = None  # a request trace (kvsim.workload.traces), replayed as is
    time_scale: float | None = Field(None, gt=0, le=1e6)  # a trace's arrivals times this
    n: int = Field(1, ge=1, le=64)  # parallel samples per request
    # the client asks every request to run to its max_new_tokens (benchmark clients'
    # ignore_eos); kvsim's outputs always do, so it changes only what SGLang reserves for
    # them (kvsim.engines.sglang_eos). Default: false, true for an inference_perf workload
    # (inference-perf sends it, and kvsim requires its server.ignore_eos)
    ignore_eos: bool | None = None
    beam_width: int = Field(1, ge=1, le=64)  # beams per request
    prefix: PrefixGroups | None = None
    rag: RAG | None = None
    conversation: Conversation | None = None

    @property
    def sends_ignore_eos(self) -> bool:
        return self.inference_perf is not None if self.ignore_eos is None else self.ignore_eos

    @property
    def sharing(self) -> PrefixGroups | RAG | Conversation | None:
        return self.prefix or self.rag or self.conversation

    @model_validator(mode="after")
    def _one_source(self):
        if sum(x is not None for x in (self.prefix, self.rag, self.conversation)) > 1:
            raise ValueError("choose at most one of prefix, rag and conversation")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("choose n (parallel sampling) or beam_width (beam search), not both")
        if self.trace is not None and self.sharing is not None:
            raise ValueError("a trace brings its own prompts: drop prefix, rag or conversation")
        if self.trace is None and self.time_scale is not None:
            raise ValueError("time_scale stretches a trace's arrivals: give a trace or drop time_scale")

        sources = [
            self.trace is not None,
            self.dataset is not None,
            self.prompt_tokens is not None or self.output_tokens is not None,
            self.inference_perf is not None,
        ]
        if sum(sources) != 1:
            raise ValueError(
                "give exactly one length source: prompt_tokens and "
                "output_tokens, or dataset, or trace, or inference_perf"
            )
        if sources[2] and (self.prompt_tokens is None or self.output_tokens is None):
            raise ValueError("prompt_tokens and output_tokens go together")
        if self.inference_perf is not None and (self.sharing is not None or self.n > 1 or self.beam_width > 1):
            raise ValueError(
                "an inference_perf workload says its own prompts: drop prefix, rag, conversation, n and beam_width"
            )
        if self.inference_perf is not None and not isinstance(self.arrival, Staged):
            raise ValueError(
                "an inference_perf workload needs arrival: {stages: [...]} (a config file's load.stages give it)"
            )
        if self.trace is not None and self.arrival is not None:
            raise ValueError("a trace brings its own arrival times: drop arrival")
        if self.trace is None and self.arrival is None:
            raise ValueError("arrival is required without a trace")
        if self.trace is None and self.num_requests is None and not isinstance(self.arrival, Staged):
            raise ValueError("num_requests is required without a trace or stages")
        return self


# --- engine ----------------------------------------------------------------------
Engine = Literal["vllm-v0", "vllm-v1", "sglang", "vllm-reference", "trtllm"]


class SchedulerSettings(Strict):
    """Engine settings under vLLM's names; what is left unset takes the engine's default
    (kvsim.config.engine_defaults)."""

    engine: Engine | None = None  # or top-level `engine:`
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_chunked_prefill: bool | None = None
    preemption_mode: Literal["recompute", "swap"] | None = None
    swap_space_gib: float = Field(4.0, ge=0)  # CPU memory per GPU for swapped-out KV (vLLM: 4)
    watermark: float | None = Field(None, ge=0, lt=1)  # share of the pool kept free at admission
    schedule_policy: Literal["fcfs", "lpm"] | None = None  # SGLang's order of the waiting queue
    async_scheduling: bool | None = None  # vLLM V1 (default true): kvsim.config.engine_defaults
    # TensorRT-LLM's SchedulerConfig (engine: trtllm; default GUARANTEED_NO_EVICT)
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] | None = None


class KvCacheConfig(Strict):
    """TensorRT-LLM's KvCacheConfig, the fields kvsim models (engine: trtllm), with the
    defaults (kvsim.config.trtllm says how they map to policies)."""

    # the share of the memory free after loading that the KV pool takes
    free_gpu_memory_fraction: float = Field(TRTLLM["free_gpu_memory_fraction"], gt=0, lt=1)
    enable_block_reuse: bool = TRTLLM["enable_block_reuse"]
    tokens_per_block: int = Field(TRTLLM["tokens_per_block"], ge=2, le=4096)
    host_cache_size: int | None = Field(TRTLLM["host_cache_size"], ge=0)  # host bytes per GPU, evicted blocks
    enable_partial_reuse: bool = TRTLLM["enable_partial_reuse"]
    copy_on_partial_reuse: bool = TRTLLM["copy_on_partial_reuse"]
    secondary_offload_min_priority: int = Field(TRTLLM["secondary_offload_min_priority"], ge=0, le=100)
    retention_priority: int = Field(TRTLLM["retention_priority"], ge=0, le=100)  # every block's (RetentionConfig)

    @model_validator(mode="after")
    def _power_of_two(self):
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"tokens_per_block {self.tokens_per_block} must be a power of two")
        return self


class SLO(Strict):
    """Latency targets (simulated seconds): a policy meets them when every given
    percentile of its completed requests is at most the target (kvsim.analysis.slo)."""

    ttft_p50_s: float | None = Field(None, gt=0)
    ttft_p90_s: float | None = Field(None, gt=0)
    ttft_p99_s: float | None = Field(None, gt=0)
    tpot_p50_s: float | None = Field(None, gt=0)
    tpot_p90_s: float | None = Field(None, gt=0)
    tpot_p99_s: float | None = Field(None, gt=0)
    e2e_p50_s: float | None = Field(None, gt=0)
    e2e_p99_s: float | None = Field(None, gt=0)

    def targets(self) -> dict[str, float]:
        """The targets that are set, by summary column."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class KVOffload(Strict):
    """KV tiers behind the GPU's prefix cache (kvsim.kvcache.tiers): host memory and
    local disk, per replica (vLLM's kv_offloading_size: the sum over the replica's GPUs)
    or, `shared`, one store for the whole fleet reached over the network. A tier of 0
    bytes is no tier; both at 0 is no kv_offload at all. Behind the radix cache, SGLang's
    HiCache (kvsim.kvcache.hiradix): a host pool of cpu_gib (its --hicache-size) or of
    hicache_ratio times the GPU pool, with its write_policy (--hicache-write-policy)."""

    cpu_gib: float = Field(0.0, ge=0, le=MAX_TIER_GIB)
    disk_gib: float = Field(0.0, ge=0, le=MAX_TIER_GIB)
    policy: Literal["lru", "arc"] = "lru"  # host memory's (vLLM's eviction_policy); disk: LRU
    chunk_tokens: int | None = Field(None, ge=1)  # tokens per stored chunk; default the block size
    # Samsung 980 PRO (PCIe 4.0 x4 NVMe) data sheet: 7,000 MB/s sequential read
    disk_gb_s: float = Field(7.0, gt=0)
    shared: bool = False
    # one 200 Gb/s port (InfiniBand HDR, or 200GbE) per GPU: 25 GB/s
    network_gb_s: float = Field(25.0, gt=0)
    hicache_ratio: float | None = Field(None, gt=0, le=MAX_HICACHE_RATIO)  # radix cache only; SGLang's default 2.0
    write_policy: Literal["write_through", "write_through_selective", "write_back"] | None = None

    @property
    def empty(self) -> bool:
        return self.cpu_gib == 0 and self.disk_gib == 0 and self.hicache_ratio is None

    def refusal(self, cache: str) -> str | None:
        """Why these tiers cannot sit behind a `cache` (radix or hash) prefix cache, if so."""
        given = self.model_fields_set
        if cache == "radix":
            wrong = [
                f
                for f in ("disk_gib", "policy", "chunk_tokens", "shared")
                if f in given and getattr(self, f) not in (0, False, "lru")
            ]
            if wrong:
                return (
                    f"{wrong[0]}: SGLang HiCache (behind the radix cache) is modelled with host "
                    "memory only, LRU, in the GPU's pages, per replica; give cpu_gib or hicache_ratio "
                    "and write_policy"
                )
        elif "hicache_ratio" in given or "write_policy" in given:
            return (
                "hicache_ratio and write_policy are SGLang HiCache's (the radix cache: prefix_cache: "
                "radix or engine: sglang); vLLM's offloading takes cpu_gib, disk_gib and policy"
            )
        return None


class PolicyBase(Strict):
    name: str
    kv_cache_dtype: KVDtype = "auto"
    kv_scale: Literal["tensor", "head", "group"] = "tensor"  # quantization scale granularity
    kv_scale_group_size: int = Field(64, ge=1)
    kv_offload: KVOffload | None = None

    @property
    def tiers(self) -> KVOffload | None:
        """kv_offload, or None where it holds no bytes."""
        return None if self.kv_offload is None or self.kv_offload.empty else self.kv_offload


class Contiguous(PolicyBase):
    allocator: Literal["contiguous"]
    reserve: Literal["max", "pow2", "oracle"] = "max"
    placement: Literal["first-fit", "buddy"] = "first-fit"
    enable_prefix_caching: bool = False

    @model_validator(mode="after")
    def _cannot_share(self):
        if self.enable_prefix_caching:
            raise ValueError(
                "contiguous allocation cannot share KV between requests (each owns one "
                "region); use allocator: paged for enable_prefix_caching"
            )
        if self.tiers is not None:
            raise ValueError(
                "kv_offload: contiguous allocation cannot share KV between requests, so "
                "no tier can give it back; use allocator: paged with enable_prefix_caching"
            )
        return self

    def allocator_kind(self, engine: str = "vllm-v1") -> tuple[str, dict]:
        return "contiguous", {"reserve": self.reserve, "placement": self.placement}


class Paged(PolicyBase):
    allocator: Literal["paged"]
    block_size: int = Field(16, ge=1, le=4096)
    enable_prefix_caching: bool | None = None  # default: the engine's
    prefix_cache: Literal["hash", "radix"] | None = None  # radix: SGLang-style radix tree

    def allocator_kind(self, engine: str = "vllm-v1") -> tuple[str, dict]:
        if engine == "trtllm":  # TensorRT-LLM's block manager, KvCacheConfig's defaults
            return "trtllm", allocator_options(self, None)
        default_on, default_cache = prefix_defaults(engine)
        on = default_on if self.enable_prefix_caching is None else self.enable_prefix_caching
        if not on:
            return "paged", {"block_size": self.block_size}
        if (self.prefix_cache or default_cache) == "radix":
            # block_size is SGLang's page_size; SGLang's default is 1, not vLLM's 16.
            given = "block_size" in self.model_fields_set
            return "radix", {"page_size": self.block_size} if given else {}
        return "paged", {"block_size": self.block_size, "prefix_caching": True}

    @model_validator(mode="after")
    def _tiers_need_a_cache(self):
        t = self.tiers
        if t is None:
            return self
        if self.enable_prefix_caching is False:
            raise ValueError("kv_offload: tiers hold what a prefix cache shares; set enable_prefix_caching: true")
        if self.prefix_cache is not None and (why := t.refusal(self.prefix_cache)):
            raise ValueError(f"kv_offload: {why}")
        if t.chunk_tokens is not None and t.chunk_tokens % self.block_size:
            raise ValueError(
                f"kv_offload: chunk_tokens ({t.chunk_tokens}) must be a multiple of block_size ({self.block_size})"
            )
        return self


Policy = Annotated[Union[Contiguous, Paged], Field(discriminator="allocator")]


class InlineModel(Strict):
    name: str = "custom"
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(32000, ge=1)
    params: float = Field(gt=0)
    active_params: float | None = Field(None, gt=0)
    dtype: Literal["fp32", "fp16", "bf16"] = "bf16"
    kv_lora_rank: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    sliding_window: int | None = Field(None, ge=1)
    hybrid_window: int | None = Field(None, ge=1)  # the window of hybrid_window_layers layers, the rest full
    hybrid_window_layers: int = Field(0, ge=0)
    max_position_embeddings: int | None = Field(None, ge=1)
    alibi: bool = False
    num_experts: int = Field(0, ge=0)  # MoE (kvsim.model.specs.ModelSpec); 0: dense
    experts_per_token: int = Field(0, ge=0)
    moe_intermediate_size: int | None = Field(None, ge=1)
    shared_expert_size: int = Field(0, ge=0)
    dense_layers: int = Field(0, ge=0)
    expert_weight_bits: float | None = Field(None, gt=0, le=32)  # e.g. 4.25 for MXFP4 experts

    @model_validator(mode="after")
    def _experts(self):
        if bool(self.num_experts) != bool(self.experts_per_token):
            raise ValueError("num_experts and experts_per_token go together")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        if self.dense_layers >= self.num_layers and self.num_experts:
            raise ValueError(f"dense_layers ({self.dense_layers}) leaves no MoE layer of {self.num_layers}")
        if (self.hybrid_window is None) != (not self.hybrid_window_layers):
            raise ValueError("hybrid_window and hybrid_window_layers go together")
        if self.hybrid_window_layers >= self.num_layers:
            raise ValueError(
                f"hybrid_window_layers ({self.hybrid_window_layers}) leaves no full-attention layer of "
                f"{self.num_layers} (a window on every layer is sliding_window)"
            )
        if self.hybrid_window is not None and self.sliding_window is not None:
            raise ValueError("sliding_window (every layer) and hybrid_window (some layers) exclude each other")
        return self


class HFModel(Strict):
    hf_config: str


class InlineGPU(Strict):
    name: str = "custom"
    memory_gib: float = Field(gt=0)
    hbm_tb_s: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = Field(None, gt=0)
    pcie_gb_s: float = Field(64.0, gt=0)
    nvlink_gb_s: float | None = Field(None, gt=0)


class InlineOverhead(Strict):
    """Host time per step given by hand (kvsim.cost.overhead); all-reduces stay the profile's."""

    step_ms: float = Field(0.0, ge=0)
    per_seq_ms: float = Field(0.0, ge=0)
    per_prefill_token_ms: float = Field(0.0, ge=0)
    launch_per_layer_ms: float = Field(0.0, ge=0)  # CPU launch time, hidden behind device work


class ProfileCost(Strict):
    """Step costs from a profile, a shipped name or a folder relative to the scenario
    (kvsim.cost.profiles; absent: the automatic choice, as `calibrated`), plus an engine
    overhead (kvsim.cost.overhead): a shipped name, `none`, a file, or {step_ms, per_seq_ms,
    per_prefill_token_ms}; absent: the shipped default. step_overhead_ms: X is the deprecated
    spelling of overhead: {step_ms: X}."""

    profile: str | None = None
    overhead: (
        Annotated[
            Union[Annotated[str, Tag("overhead-name")], Annotated[InlineOverhead, Tag("overhead-inline")]],
            Discriminator(lambda v: "overhead-name" if isinstance(v, str) else "overhead-inline"),
        ]
        | None
    ) = None
    step_overhead_ms: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_overhead(self):
        if self.overhead is not None and self.step_overhead_ms is not None:
            raise ValueError("give overhead: {step_ms: X} (step_overhead_ms is its deprecated spelling), not both")
        return self


def _spec_kind(value) -> str:
    """A model or GPU is a preset name, a Hugging Face config, or given inline (as read
    from YAML, or as the validated object when a scenario is written back)."""
    if isinstance(value, str):
        return "preset"
    return "hf" if isinstance(value, HFModel) or isinstance(value, dict) and "hf_config" in value else "inline"


_SPEC_TAGS = {"preset": str, "inline": None, "hf": HFModel}


class Scenario(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seed: int = Field(0, ge=0)
    model: Annotated[
        Union[Annotated[str, Tag("preset")], Annotated[InlineModel, Tag("inline")], Annotated[HFModel, Tag("hf")]],
        Discriminator(_spec_kind),
    ]
    gpu: Annotated[Union[Annotated[str, Tag("preset")], Annotated[InlineGPU, Tag("inline")]], Discriminator(_spec_kind)]
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_memory_gib: float | None = Field(None, gt=0)
    activation_memory_gib: float | None = Field(None, ge=0)  # default: estimated
    enforce_eager: bool = False  # vLLM: no CUDA graphs, so none counted in the pool
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)  # SGLang's pool (default: by GPU and tp)
    kv_cache_config: KvCacheConfig | None = None  # TensorRT-LLM's (engine: trtllm)
    vllm_args: str | None = None  # `vllm serve` flags setting the fields above (kvsim.config.engine_flags)
    sglang_args: str | None = None  # SGLang's launch flags, likewise (engine: sglang)
    max_model_len: int | None = Field(None, ge=1)  # default: the model's context length (filled at load)
    engine: Engine | None = None  # vllm-v0, vllm-v1 (default), sglang, vllm-reference or trtllm; or under scheduler:
    time_limit_s: float | None = Field(None, gt=0)  # simulated seconds; the rest is "unfinished"
    timeseries_bucket_s: float | None = Field(None, gt=0)  # the step series in sums per that many simulated s
    replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS)  # engines behind a router (default 1)
    router: Literal["round-robin", "least-loaded", "prefix-aware"] | None = None  # default round-robin
    cost_model: Annotated[
        Union[Annotated[Literal["roofline", "calibrated"], Tag("preset")], Annotated[ProfileCost, Tag("profile-ref")]],
        Discriminator(lambda v: "preset" if isinstance(v, str) else "profile-ref"),
    ] = "calibrated"
    workload: Workload
    scheduler: SchedulerSettings = SchedulerSettings()
    slo: SLO | None = None
    policies: list[Policy] = Field(min_length=1)

    # Resolved views: the rest of kvsim uses these, not the raw fields.
    @property
    def engine_name(self) -> str:
        return self.engine or self.scheduler.engine or DEFAULT_ENGINE

    def engine_settings(self, pool_tokens: int | None = None) -> EngineSettings:
        """The scheduler block's values, or the engine's defaults (kvsim.config.engine_defaults)."""
        gpu = self.gpu_spec()
        return resolve_settings(
            self.engine_name,
            self.scheduler,
            max_model_len=self.max_model_len,
            gpu_name=gpu.name,
            gpu_memory_gib=gpu.memory_gib,
            pool_tokens=pool_tokens,
        )

    @property
    def fleet(self) -> tuple[int, str]:
        """(replicas, router), defaults filled in."""
        return self.replicas or 1, self.router or "round-robin"

    @property
    def batched_token_budget(self) -> int:
        return self.engine_settings().max_num_batched_tokens

    def model_spec(self, base_dir: Path = Path(".")) -> ModelSpec:
        if isinstance(self.model, str):
            return MODEL_PRESETS[self.model]
        if isinstance(self.model, HFModel):
            return model_from_hf_config(base_dir / self.model.hf_config)
        return ModelSpec(**self.model.model_dump())

    def gpu_spec(self) -> GPUSpec:
        return GPU_PRESETS[self.gpu] if isinstance(self.gpu, str) else GPUSpec(**self.gpu.model_dump())


# --- loading ---------------------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML where a repeated key is an error, not a silent last-one-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_scenario(path: str | Path, engine_args: dict[str, str] | None = None) -> tuple[Scenario, Path]:
    """Read and validate a scenario; returns it and the folder relative paths start from.
    engine_args: {"vllm_args" or "sglang_args": a command line} given to `kvsim run`,
    which applies over the scenario's own fields (kvsim.config.engine_flags)."""
    path = Path(path)
    return validate_scenario(read_yaml(path, "scenario keys (name, model, ...)"), str(path), engine_args), path.parent


def read_yaml(path: Path, keys: str) -> dict:
    """A YAML file that must hold a mapping (of `keys`, for the error); any problem is an InputError."""
    src = str(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise InputError(src, "file", "not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(src, "file", f"cannot be read as UTF-8 text ({type(e).__name__})") from None
    except RecursionError:
        raise InputError(src, "YAML", "nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else f"character {e.position}" if hasattr(e, "position") else "YAML"
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise InputError(src, where, f"invalid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise InputError(src, "top level", f"must be a mapping of {keys}")
    return raw


def validate_scenario(raw: dict, src: str, engine_args: dict[str, str] | None = None) -> Scenario:
    raw = _expand_inference_perf(raw, src)
    base = Path(src).parent
    raw = _with_engine_args(raw, base, src, engine_args or {})
    _check_files(raw, base, src)
    try:
        scn = Scenario.model_validate(raw)
    except ValidationError as e:
        raise _input_error(e, src) from None
    if isinstance(scn.model, str) and scn.model not in MODEL_PRESETS:
        raise InputError(src, "model", _unknown_model(scn.model))
    scn = _with_defaults(scn, base, src)
    names = [p.name for p in scn.policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(src, "policies", f"policy names must be unique; repeated: {', '.join(dup)}")
    if isinstance(scn.gpu, str) and scn.gpu not in GPU_PRESETS:
        raise InputError(src, "gpu", _unknown(scn.gpu, GPU_PRESETS, "preset"))
    _check_engine(scn, src)
    check_parallel(scn.tensor_parallel_size, scn.model_spec(base), src)
    wl = scn.workload
    if wl.dataset is not None and wl.dataset not in dataset_names():
        raise InputError(src, "workload.dataset", _unknown(wl.dataset, dataset_names(), "dataset"))
    return scn


@functools.lru_cache(maxsize=None)
def dataset_names() -> tuple[str, ...]:
    """The shipped dataset presets (kvsim/data/datasets.json; kvsim.workload.datasets samples them)."""
    return tuple(json.loads((resources.files("kvsim") / "data" / "datasets.json").read_text())["datasets"])


def _check_files(raw: dict, base: Path, src: str) -> None:
    """A file the scenario names that is not there: the likeliest mistake, so it is said
    before anything else is checked (paths are relative to the scenario's folder)."""
    workload = raw.get("workload") if isinstance(raw.get("workload"), dict) else {}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    named = [("workload.trace", workload.get("trace")), ("model.hf_config", model.get("hf_config"))]
    for key in ("prompt_tokens", "output_tokens"):
        dist = workload.get(key)
        if isinstance(dist, dict) and dist.get("dist") == "empirical":
            named.append((f"workload.{key}.file", dist.get("file")))
    for field, name in named:
        if isinstance(name, str) and name and not (base / name).is_file():
            what = "is a folder, not a file" if (base / name).is_dir() else "not found"
            raise InputError(src, field, f"file {base / name} {what}")


def _expand_inference_perf(raw: dict, src: str) -> dict:
    """`workload: {inference_perf: PATH}`: the file's data, stages and timeout as
    workload keys (kvsim.config.inference_perf); the scenario's own request_timeout_s wins."""
    workload = raw.get("workload")
    if not isinstance(workload, dict) or not isinstance(workload.get("inference_perf"), str):
        return raw
    path = Path(src).parent / workload["inference_perf"]
    from kvsim.config.inference_perf import expand

    given = expand(read_yaml(path, "inference-perf config sections (api, data, load, ...)"), str(path))
    clash = sorted(k for k in given if k in workload and k not in ("inference_perf", "request_timeout_s"))
    if clash:
        raise InputError(
            src, f"workload.{clash[0]}", f"given by the inference-perf config {path}; drop it from the scenario"
        )
    return {**raw, "workload": {**given, **{k: v for k, v in workload.items() if k != "inference_perf"}}}


def _check_engine(scn: Scenario, src: str) -> None:
    """What the chosen engine cannot run, as input errors naming the field."""
    if scn.engine and scn.scheduler.engine and scn.engine != scn.scheduler.engine:
        raise InputError(
            src, "engine", f"'{scn.engine}' differs from scheduler.engine '{scn.scheduler.engine}'; give it once"
        )
    name, s = scn.engine_name, scn.engine_settings()
    width = max(scn.workload.n, scn.workload.beam_width)

    def error(field: str, message: str):
        raise InputError(src, field, message)

    check_trtllm(scn, src, error)
    if name != "vllm-v0":
        if scn.workload.beam_width > 1:
            raise InputError(
                src,
                "workload.beam_width",
                f"{name} has no beam groups in its scheduler (beam search runs above the engine); use engine: vllm-v0",
            )
        if scn.scheduler.preemption_mode == "swap":
            raise InputError(src, "scheduler.preemption_mode", f"{name} preempts by recompute only; swap is vllm-v0's")
        if scn.scheduler.watermark:
            raise InputError(src, "scheduler.watermark", f"{name} keeps no watermark; it is vllm-v0's")
    if name != "sglang" and scn.mem_fraction_static is not None:
        raise InputError(
            src, "mem_fraction_static", "is SGLang's pool setting (engine: sglang); vLLM's is gpu_memory_utilization"
        )
    if name == "sglang" and scn.enforce_eager:
        raise InputError(
            src,
            "enforce_eager",
            "is vLLM's; SGLang's pool does not count CUDA graphs (its mem_fraction_static reserves room for them)",
        )
    if name == "vllm-reference":
        _check_reference(scn, src)
    if name != "vllm-v1" and scn.scheduler.async_scheduling:
        raise InputError(
            src, "scheduler.async_scheduling", f"vllm-v1's setting; kvsim models no asynchronous scheduling for {name}"
        )
    if name != "sglang" and scn.scheduler.schedule_policy:
        raise InputError(
            src, "scheduler.schedule_policy", "fcfs or lpm is SGLang's choice; vLLM admits first come first served"
        )
    if name == "vllm-v0":
        if width > s.max_num_batched_tokens:
            raise InputError(
                src,
                "scheduler.max_num_batched_tokens",
                f"{s.max_num_batched_tokens} is below the {width} sequences one request decodes per step",
            )
        if width > 1 and s.enable_chunked_prefill:
            raise InputError(
                src,
                "scheduler.enable_chunked_prefill",
                "must be false with workload.n or "
                "workload.beam_width above 1: a group forks from a whole prefilled prompt",
            )
        if width > s.max_num_seqs:
            raise InputError(
                src,
                "scheduler.max_num_seqs",
                f"{s.max_num_seqs} is below the {width} sequences of one request (vLLM V0 counts every sample or beam)",
            )
    if s.max_num_batched_tokens < scn.max_model_len and not s.enable_chunked_prefill:
        raise InputError(
            src,
            "scheduler.max_num_batched_tokens",
            f"{s.max_num_batched_tokens} is smaller than max_model_len ({scn.max_model_len}), "
            "so a long prompt could never be prefilled; raise it or set "
            "enable_chunked_prefill: true",
        )


def _check_reference(scn: Scenario, src: str) -> None:
    """vllm-reference runs vLLM's own scheduler: it must be installed (the pinned release),
    and each policy a paged pool with vLLM's prefix cache or none, as vLLM's block pool is."""
    from importlib import metadata
    from kvsim.config.engine_defaults import VLLM_INSTALL as INSTALL, VLLM_VERSION

    try:
        found = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        found = None
    if found != VLLM_VERSION:
        raise InputError(
            src,
            "engine",
            f"vllm-reference runs vLLM {VLLM_VERSION}'s own scheduler, "
            f"{'not installed' if found is None else f'found vLLM {found}'}; install it with: {INSTALL}",
        )
    for i, policy in enumerate(scn.policies):
        if policy.allocator_kind("vllm-reference")[0] != "paged":
            raise InputError(
                src,
                f"policies[{i}]",
                "vllm-reference runs on vLLM's block pool: "
                "allocator: paged, with prefix_cache: hash or no prefix caching",
            )
        if policy.tiers is not None:
            raise InputError(src, f"policies[{i}].kv_offload", "vllm-reference has no KV tiers")


def _with_engine_args(raw: dict, base: Path, src: str, given: dict[str, str]) -> dict:
    """The scenario with what its vllm_args or sglang_args set, then what the command line's
    do (kvsim.config.engine_flags); the command line's flags win over the file's fields."""
    from kvsim.config.engine_flags import ARGS_FIELDS, apply

    for key in ARGS_FIELDS:
        text = raw.get(key)
        if text is not None:
            if not isinstance(text, str):
                raise InputError(src, key, "must be one string of flags, as on the command line")
            raw, _ = apply(raw, key, text, src, base)
    if sum(k in raw or k in given for k in ARGS_FIELDS) > 1:
        raise InputError(src, "vllm_args", "give vLLM's flags or SGLang's, not both")
    for key, text in given.items():
        raw, _ = apply(raw, key, text, "command line", Path.cwd(), override=True)
        raw[key] = text
    return raw


def check_parallel(tp: int, model: ModelSpec, src: str, field: str = "tensor_parallel_size") -> None:
    """Tensor parallelism must split the heads evenly, as vLLM 0.33.0 requires: the query
    heads by tp (config/model.py, verify_with_parallel_config), and the KV heads by tp, or
    tp by the KV heads when each GPU holds a replica of one (model_executor/layers/linear.py,
    QKVParallelLinear). An MLA latent is not split."""
    if model.num_heads % tp:
        raise InputError(
            src,
            field,
            f"{tp} does not divide {model.name}'s "
            f"{model.num_heads} attention heads; use one of {_divisors(model.num_heads)}",
        )
    kv = model.num_kv_heads
    if not model.is_mla and (tp % kv if tp >= kv else kv % tp):
        allowed = [t for t in _divisors(model.num_heads) if (t % kv == 0 if t >= kv else kv % t == 0)]
        raise InputError(
            src,
            field,
            f"{tp} does not divide {model.name}'s {kv} KV heads "
            f"(nor do they divide it, to replicate them); use one of {allowed}",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= 1024]


def _with_defaults(scn: Scenario, base: Path, src: str) -> Scenario:
    """Read the model once (a bad hf_config is an input error) and fill max_model_len from
    its context length, as vLLM does, when the scenario leaves it out. vLLM V0 leaves
    chunked prefill off for a model with a sliding window on every layer, whatever its
    context (0.6.3.post1 engine/arg_utils.py, EngineArgs.create_engine_config: the 32K
    default needs model_config.get_sliding_window() None; a hybrid model's window is
    switched off there, config.py ModelConfig, so it is not an exception)."""
    try:
        model = scn.model_spec(base)
    except ValueError as e:
        raise InputError(src, "model.hf_config", str(e)) from None
    if scn.engine_name == "vllm-v0" and model.sliding_window and scn.scheduler.enable_chunked_prefill is None:
        scn = scn.model_copy(update={"scheduler": scn.scheduler.model_copy(update={"enable_chunked_prefill": False})})
    if scn.max_model_len is not None:
        return scn
    if model.max_position_embeddings is None:
        raise InputError(
            src, "max_model_len", "required: the model does not give its context length (max_position_embeddings)"
        )
    return scn.model_copy(update={"max_model_len": model.max_position_embeddings})


def _unknown_model(name: str) -> str:
    """A Hugging Face id (org/name) is not fetched: say how to give its config instead."""
    if "/" not in name:
        return _unknown(name, MODEL_PRESETS, "preset")
    close = difflib.get_close_matches(name.split("/")[-1].lower(), list(MODEL_PRESETS), n=1, cutoff=0.5)
    hint = f"use the preset '{close[0]}', or " if close else "use a preset, or "
    return (
        f"'{name}' looks like a Hugging Face model id, which kvsim does not download; {hint}"
        "give its config.json as {hf_config: path/to/config.json}"
    )


# Keys users of vLLM put at the top level, and where kvsim wants them.
MISPLACED = {
    **{k: "scheduler" for k in SchedulerSettings.model_fields},
    "swap_space": "scheduler",
    "max_num_batched_tokens": "scheduler",
    **{
        k: "policy"
        for k in (
            "block_size",
            "kv_cache_dtype",
            "enable_prefix_caching",
            "prefix_cache",
            "kv_scale",
            "kv_scale_group_size",
            "allocator",
        )
    },
}


def _misplaced(key: str) -> str | None:
    where = MISPLACED.get(key)
    if where == "scheduler":
        name = "swap_space_gib" if key == "swap_space" else key
        return f"'{key}' belongs under scheduler: (scheduler: {{{name}: ...}})"
    if where == "policy":
        return (
            f"'{key}' is set per policy: put it in each entry of policies: "
            f"(- {{name: paged-16, allocator: paged, {key}: ...}})"
        )
    return None


def _unknown(value: str, valid, what: str) -> str:
    close = difflib.get_close_matches(value, list(valid), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {what} '{value}'{hint}; choose from: {', '.join(sorted(valid))}"


def _input_error(exc: ValidationError, src: str) -> InputError:
    """The first validation problem as one line; unknown keys get the closest valid key."""
    errors = exc.errors()
    # An unknown key explains a "missing" one next to it (a typo), so it goes first.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = err["loc"]
    field = _dotted(loc) or "top level"
    if err["type"] == "extra_forbidden":
        if len(loc) == 1 and _misplaced(str(loc[0])):
            return InputError(src, field, _misplaced(str(loc[0])))
        allowed = _fields_at(loc[:-1])
        return InputError(src, field, _unknown(str(loc[-1]), allowed, "key"))
    if err["type"] == "union_tag_invalid":  # e.g. dist: constant
        ctx = err["ctx"]
        tags = [t.strip(" '") for t in ctx["expected_tags"].split(",")]
        return InputError(src, field, _unknown(str(ctx["tag"]), tags, ctx["discriminator"].strip("'")))
    if err["type"] in ("union_tag_not_found", "model_attributes_type", "model_type", "dict_type"):
        return InputError(src, field, _mapping_needed(loc, err["input"]))
    msg = err["msg"].removeprefix("Value error, ")
    return InputError(src, field, msg)


def _mapping_needed(loc, given) -> str:
    """What belongs where a mapping of keys is needed (`prompt_tokens: 100`, a policy
    given by name, a distribution without `dist:`): each form the field takes."""
    if len(loc) == 2 and loc[1] == "inline":  # model: or gpu:, given neither a name nor keys
        hf = ", {hf_config: path to a config.json}" if loc[0] == "model" else ""
        return f"needs a preset's name{hf} or the {loc[0]}'s keys ({', '.join(_fields_at(loc))}), not {given!r}"
    if tuple(loc) == ("cost_model", "profile-ref"):
        return f"needs 'roofline', 'calibrated' or {{profile, overhead}}, not {given!r}"
    models = _models_at(loc)
    forms = []
    for model in models:
        tag = _tag_of(model)
        # a kind of a union by its tag and what it requires; a plain mapping by all its keys
        keys = [
            k
            for k, f in model.model_fields.items()
            if k not in ("process", "dist", "allocator") and (f.is_required() or not tag)
        ]
        key = next((k for k in ("process", "dist", "allocator") if k in model.model_fields), None)
        forms.append("{" + ", ".join(([f"{key}: {tag}"] if tag else []) + keys) + "}")
    what = f"one of {', '.join(forms)}" if len(forms) > 1 else (forms[0] if forms else "a mapping")
    if isinstance(given, dict):
        return f"needs {what}"
    return f"needs a mapping of keys, not {given!r}: {what}"


def _dotted(loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TAGS or part in _SPEC_TAGS:
            continue  # pydantic's union branch names, not the user's keys
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields_at(loc) -> list[str]:
    """The keys allowed at a pydantic error location (walking unions by their tag)."""
    return sorted({f for m in _models_at(loc) for f in m.model_fields})


def _models_at(loc) -> list[type[BaseModel]]:
    """The models a value at a pydantic error location may be (every branch of a union)."""
    candidates: list[type[BaseModel]] = [Scenario]
    prev = None
    for part in loc:
        if isinstance(part, int):
            continue
        if part in _TAGS:
            candidates = [_TAGS[part]]
            continue
        if part in _SPEC_TAGS:
            field = {"hf": "HFModel", "inline": "Inline" + ("Model" if prev == "model" else "GPU")}
            candidates = [globals()[field[part]]]
            continue
        prev = part
        model = candidates[0]
        candidates = _models_in(model.model_fields[part].annotation)
    return candidates


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (Annotated,):
        return _models_in(args[0])
    return [m for a in args for m in _models_in(a)] if args else []


def _tag_of(model: type[BaseModel]) -> str | None:
    for key in ("process", "dist", "allocator"):
        if key in model.model_fields:
            return typing.get_args(model.model_fields[key].annotation)[0]
    return None


_TAGS = {
    _tag_of(m): m for m in (Poisson, Gamma, Burst, Constant, Fixed, Uniform, Lognormal, Empirical, Contiguous, Paged)
}
_TAGS["stages"] = Staged  # arrival: {stages: [...]}
_TAGS["profile-ref"] = ProfileCost  # cost_model: {profile: ...}
_TAGS["overhead-inline"] = InlineOverhead  # cost_model: {overhead: {step_ms: ...}}
_TAGS["overhead-name"] = InlineOverhead  # (a name has no keys; listed so its tag leaves error paths)
