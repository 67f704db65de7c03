"""vLLM's own V1 scheduler and KV cache manager, stepped by kvsim (vLLM 0.33.0).

Where kvsim's `vllm-v1` rules are kvsim's reading of vLLM's source, this is vLLM's code
itself: `vllm.v1.core.sched.scheduler.Scheduler` with its `KVCacheManager` and
`BlockPool` over one KV cache group of `num_blocks` blocks, full attention or a
sliding window on every layer, or a hybrid model's groups (a window's and full
attention's, each one layer: vLLM schedules blocks, whatever a block holds). It needs no
GPU: the scheduler is plain Python over block ids, and the model is never run. kvsim
plays the rest of the engine, as vLLM's own tests do (tests/v1/core/test_scheduler.py):
it adds the requests, calls `schedule()`, and answers each step with a
`ModelRunnerOutput` of one sampled token for every request that ends its prefill or
decodes (none for a prefill chunk that leaves prompt to compute), then
`update_from_output`, which appends the tokens, finishes requests at max_tokens and
frees their blocks.

Token ids come from kvsim's token identity (kvsim.kvcache.SeqShape): the token at
offset k of content c is one id wherever it appears, so shared system prompts, RAG
documents and earlier conversation turns meet in vLLM's prefix cache as they do in
kvsim's; content -1 ("unique") gets ids of its own sequence. Output tokens continue the
tail content, so a later turn that repeats an answer hits the blocks that hold it.

vLLM's pool of `num_blocks` blocks keeps block 0 out as its null block
(block_pool.py, BlockPool.__init__): num_blocks - 1 are usable. Prefix-cache hashes are
vLLM's default (CacheConfig.prefix_caching_hash_algo "sha256"). The model described by
kvsim/data/vllm_reference/config.json only satisfies vLLM's config checks; nothing of
it is used.

Installing: the pure-Python packages the scheduler's imports ask for are the extra
`kvsim[vllm]`; vLLM itself goes in without its dependencies (its wheel asks for a CUDA
build of PyTorch and GPU kernels the scheduler never loads). See INSTALL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from types import SimpleNamespace
from typing import NamedTuple

from kvsim.config.engine_defaults import VLLM_INSTALL as INSTALL, VLLM_VERSION
from kvsim.kvcache import SeqShape

UNIQUE = -(1 << 40)  # content -1: codes below every content id's


class Fed(NamedTuple):
    """A request kvsim gave vLLM's scheduler (which names it by the string of its key)."""

    key: int
    shape: SeqShape


class VllmMissing(ImportError):
    """vLLM (the pinned release) is not importable here; the message says how to install it."""


def load_vllm():
    """vLLM's scheduler modules, as a namespace; VllmMissing if vLLM is absent or another release."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its import warns of missing GPU kernels
    try:
        import vllm
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as e:
        raise VllmMissing(
            f"engine vllm-reference needs vLLM {VLLM_VERSION}'s scheduler ({e}); install it with: {INSTALL}"
        ) from None
    if vllm.__version__ != VLLM_VERSION:
        raise VllmMissing(
            f"engine vllm-reference is pinned to vLLM {VLLM_VERSION}, found "
            f"{vllm.__version__}; install it with: {INSTALL}"
        )
    return SimpleNamespace(
        CacheConfig=CacheConfig,
        DeviceConfig=DeviceConfig,
        ModelConfig=ModelConfig,
        SchedulerConfig=SchedulerConfig,
        VllmConfig=VllmConfig,
        SamplingParams=SamplingParams,
        get_hash_fn_by_name=get_hash_fn_by_name,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        Scheduler=Scheduler,
        FullAttentionSpec=FullAttentionSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        ModelRunnerOutput=ModelRunnerOutput,
        Request=Request,
        StructuredOutputManager=StructuredOutputManager,
    )


def token_ids(shape: SeqShape, key: int, start: int, end: int) -> list[int]:
    """Ids of tokens [start, end) of a sequence: (content + 1, offset) packed in one int,
    content -1 as the sequence's own (its key's) negative code. Injective for offsets
    under 2**32, so equal ids mean equal tokens."""
    out: list[int] = []
    for content, offset, length in shape.runs(start, end):
        code = UNIQUE - key if content == -1 else content + 1
        base = code << 32
        out.extend(range(base + offset, base + offset + length))
    return out


@dataclass
class StepTrace:
    """One step as vLLM decided it, in request keys (kvsim's sequence ids)."""

    scheduled: dict[int, int] = field(default_factory=dict)  # key -> tokens computed
    admitted: list[tuple[int, int]] = field(default_factory=list)  # (key, tokens found cached)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    free_blocks: int = 0
    cached_blocks: frozenset[int] = frozenset()  # blocks whose hash another request could hit


class VllmReference:
    """vLLM's V1 scheduler over a pool of `num_blocks` blocks (block 0 its null block)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.0,
        sliding_window: int | None = None,
        groups: tuple[int | None, ...] = (),
    ):
        """sliding_window: one on every layer; groups: a hybrid model's KV cache groups,
        each group's window (None: full attention) in vLLM's group order
        (kvsim.model.kv_groups), one layer each (vLLM schedules blocks, not layers)."""
        v = self.v = load_vllm()
        model = str(resources.files("kvsim") / "data" / "vllm_reference")
        scheduler = v.SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            is_encoder_decoder=False,
            watermark=watermark,
            async_scheduling=False,
        )  # stepped in turn
        cache = v.CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        config = v.VllmConfig(
            scheduler_config=scheduler,
            cache_config=cache,
            device_config=v.DeviceConfig(device="cpu"),
            model_config=v.ModelConfig(
                model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
            ),
        )
        shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=_float32())
        kv_groups = [
            v.KVCacheGroupSpec(
                [f"layer.{i}"],
                v.FullAttentionSpec(**shape) if w is None else v.SlidingWindowSpec(**shape, sliding_window=w),
            )
            for i, w in enumerate(groups or (sliding_window,))
        ]
        cache.num_gpu_blocks = num_blocks
        self.scheduler = v.Scheduler(
            vllm_config=config,
            structured_output_manager=v.StructuredOutputManager(config),
            kv_cache_config=v.KVCacheConfig(  # the retention interval as vLLM's planner sets it
                num_blocks=num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=kv_groups,
                prefix_cache_retention_interval=cache.prefix_cache_retention_interval,
            ),
            block_size=block_size,
            log_stats=False,
        )
        hash_fn = v.get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        v.init_none_hash(hash_fn)
        self._hasher = v.get_request_block_hasher(block_size, hash_fn)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self._fed: dict[str, Fed] = {}  # vLLM's request id -> kvsim's request
        self._shareable: dict[int, bool] = {}  # hashed block -> no unique token up to its end

    def add(self, key: int, shape: SeqShape) -> None:
        """A request arrives: its prompt's token ids, max_tokens its output length."""
        params = self.v.SamplingParams(max_tokens=shape.output_tokens, ignore_eos=True)
        request = self.v.Request(
            request_id=str(key),
            prompt_token_ids=token_ids(shape, key, 0, shape.prompt_tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self._fed[str(key)] = Fed(key, shape)
        self.scheduler.add_request(request)

    def step(self, trace_cache: bool = False) -> StepTrace:
        """Schedule one step, run it (one sampled token per request that samples), and
        say what happened; `trace_cache` also lists the blocks holding a hash of shared
        content (vLLM hashes every full block; kvsim keys only content that can recur)."""
        sched, trace = self.scheduler, StepTrace()
        out = sched.schedule()
        requests = sched.requests
        if trace_cache:
            self._note_shareable()
        ids, sampled = list(out.num_scheduled_tokens), []
        for rid in ids:
            request = requests[rid]
            key, shape = self._fed[rid]
            n = out.num_scheduled_tokens[rid]
            trace.scheduled[key] = n
            done = request.num_computed_tokens >= request.num_tokens  # computed after this step
            sampled.append(token_ids(shape, key, request.num_tokens, request.num_tokens + 1) if done else [])
        for new in out.scheduled_new_reqs:
            trace.admitted.append((self._fed[new.req_id].key, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_req_ids:  # back from preemption: its hits now
                trace.admitted.append((self._fed[rid].key, computed))
        trace.preempted = [self._fed[rid].key for rid in out.preempted_req_ids]
        before = set(requests)
        sched.update_from_output(
            out,
            self.v.ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
            ),
        )
        trace.finished = [self._fed[rid].key for rid in ids if rid in before and rid not in requests]
        trace.free_blocks = self.pool.get_num_free_blocks()
        if trace_cache:
            trace.cached_blocks = frozenset(
                b.block_id for b in self.pool.blocks if b.block_hash is not None and self._shareable.get(b.block_id)
            )
        return trace

    def _note_shareable(self) -> None:
        """For each block in a table: whether every token up to its end is shared content
        (a hash chain through a unique token can never be hit)."""
        bs = self.pool.hash_block_size
        for rid in self.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks:
            key, shape = self._fed[rid]
            shared = (
                sum(length for content, _, length in shape.runs(0, shape.final_tokens) if content != -1)
                if shape.tail_id != -1
                else sum(n for _, n in shape.segments)
            )
            for table in self.tables(key):  # each KV cache group's
                for i, block in enumerate(table):
                    self._shareable[block] = (i + 1) * bs <= shared

    def table(self, key: int) -> list[int]:
        """Block ids of a request's table (empty if it holds none)."""
        return self.tables(key)[0] if str(key) in self.scheduler.requests else []

    def tables(self, key: int) -> list[list[int]]:
        """Block ids of each KV cache group's table of the request."""
        if str(key) not in self.scheduler.requests:
            return []
        return [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(str(key))]

    def free_queue(self) -> list[int]:
        """Free block ids, the next one handed out first."""
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    @property
    def unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


def _float32():
    import torch

    return torch.float32
