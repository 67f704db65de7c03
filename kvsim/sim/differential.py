"""kvsim's `vllm-v1` rules against vLLM's own scheduler, step by step.

The same request stream goes through kvsim's scheduler with the `vllm-v1` rules and a
prefix-caching (or plain) paged allocator, and through vLLM's V1 scheduler itself
(kvsim.engines.vllm_reference). Requests arrive at step numbers, not times, so both
see each arrival before the same step. After every step the two are compared: tokens
scheduled per request, admissions with the tokens each found cached, preemptions,
finished requests, free blocks, the blocks holding a prefix-cache key, and every
running request's block table (a hybrid model's: each KV cache group's, `Setup.groups`).
kvsim's block b is vLLM's block b + 1 (vLLM keeps block 0 as its null block, which also
stands for the blocks a sliding window released), and kvsim's pool has the one block
fewer.

`random_stream` draws streams that exercise the rules: shared prefixes (a few
documents, block-aligned or not), parallel samples of one prompt, lengths that press
the pool into preemption, arrivals in bursts. `scenario_stream` takes a shipped
scenario's first requests as kvsim draws them (their shared system prompts, documents,
conversation turns and samples), two arrivals a step, outputs cut short to keep the
comparison quick, over a pool that holds about four of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.engines.base import Request
from kvsim.engines.vllm_v1 import VllmV1
from kvsim.kvcache import (
    PagedAllocator,
    PrefixCachingPagedAllocator,
    SeqShape,
    SlidingWindowPagedAllocator,
    SlidingWindowPrefixCache,
)
from kvsim.kvcache.hybrid import HybridPagedAllocator
from kvsim.kvcache.hybrid_prefix import HybridPrefixCache
from kvsim.kvcache.sliding import admission_cap
from kvsim.sim.scheduler import Scheduler, sample_shape
from kvsim.workload.requests import RequestSpec


@dataclass(frozen=True)
class Setup:
    """What both schedulers run with (vLLM's names)."""

    num_blocks: int  # vLLM's pool, its null block included
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 4096
    sliding_window: int | None = None  # on every layer (vLLM's SlidingWindowSpec)
    groups: tuple[int | None, ...] = ()  # a hybrid model's KV cache groups: each one's window or None


@dataclass(frozen=True)
class Arrival:
    step: int
    key: int
    shape: SeqShape


@dataclass
class Record:
    """One step, as the two sides are compared."""

    scheduled: dict[int, int] = field(default_factory=dict)
    admitted: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    free_blocks: int = 0
    cached_blocks: frozenset[int] = frozenset()
    tables: dict[int, list[int] | tuple[tuple[int, ...], ...]] = field(default_factory=dict)


def random_stream(rng: np.random.Generator, setup: Setup, n: int = 30) -> list[Arrival]:
    """`n` requests (samples count one each) over a few dozen steps."""
    bs, out, step, key = setup.block_size, [], 0, 0
    docs = [
        (100 + d, int(rng.integers(1, 6)) * bs + int(rng.integers(0, 2)) * int(rng.integers(1, bs))) for d in range(3)
    ]
    per_group = setup.num_blocks // max(len(setup.groups), 1) - 1  # a hybrid pool's share of each group
    longest = max(16, per_group * bs // 3)  # a few fit at once: preemption
    while key < n:
        step += int(rng.integers(0, 4))
        segments = tuple(docs[int(rng.integers(0, 3))] for _ in range(int(rng.integers(0, 3))))
        shared = sum(length for _, length in segments)
        prompt = shared + int(rng.integers(1, max(2, longest - shared)))
        output = int(rng.integers(1, max(2, min(longest, setup.max_model_len - prompt) // 2)))
        if prompt + output > setup.max_model_len or prompt + output > per_group * bs:
            continue
        samples = int(rng.choice([1, 1, 1, 2, 3]))
        repeat = int(rng.integers(1000, 1010)) if rng.random() < 0.3 else None  # tails met again
        for _ in range(min(samples, n - key)):
            tail = repeat if repeat is not None and samples == 1 else 10_000 + key  # else its own
            out.append(Arrival(step, key, SeqShape(prompt, output, segments, tail)))
            key += 1
    return out


def scenario_stream(path, n: int = 24, max_output: int = 48) -> tuple[list[Arrival], Setup]:
    """The first `n` sequences of a scenario's request stream, and a setup for them."""
    from kvsim.config.scenario import load_scenario
    from kvsim.workload.requests import generate_requests

    scn, base = load_scenario(path)
    table, width = generate_requests(scn, base, str(path)), scn.workload.n
    shapes = []
    for i in range(min(len(table), n)):
        spec = table[i]
        shapes += [sample_shape(spec, k) for k in range(width)] if width > 1 else [spec.shape]
    shapes = [SeqShape(x.prompt_tokens, min(x.output_tokens, max_output), x.segments, x.tail_id) for x in shapes[:n]]
    bs = next((p.block_size for p in scn.policies if getattr(p, "block_size", None)), 16)
    finals = sorted(-(-x.final_tokens // bs) for x in shapes)
    setup = Setup(
        num_blocks=1 + max(finals[-1], sum(finals[-4:])),
        block_size=bs,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_model_len=max(x.final_tokens for x in shapes),
        sliding_window=scn.model_spec(base).sliding_window,
    )
    return [Arrival(k // 2, k, x) for k, x in enumerate(shapes)], setup


def run_reference(stream: list[Arrival], setup: Setup, max_steps: int = 100_000, trace: bool = True) -> list[Record]:
    """vLLM's scheduler over the stream; `trace` False records only what was scheduled."""
    from kvsim.engines.vllm_reference import VllmReference

    ref = VllmReference(
        num_blocks=setup.num_blocks,
        block_size=setup.block_size,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        max_model_len=setup.max_model_len,
        enable_prefix_caching=setup.enable_prefix_caching,
        sliding_window=setup.sliding_window,
        groups=setup.groups,
    )
    records, pending, step = [], list(stream), 0
    while (pending or ref.unfinished) and step < max_steps:
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            ref.add(a.key, a.shape)
        t = ref.step(trace_cache=trace)
        records.append(
            Record(
                t.scheduled,
                sorted(t.admitted),
                sorted(t.preempted),
                sorted(t.finished),
                t.free_blocks,
                t.cached_blocks,
                {k: _flat(ref.tables(k)) for k in sorted(t.scheduled) if ref.table(k)} if trace else {},
            )
        )
        step += 1
    return records


def run_native(stream: list[Arrival], setup: Setup, max_steps: int = 100_000, trace: bool = True) -> list[Record]:
    """kvsim's scheduler and vllm-v1 rules over the stream; `trace` as run_reference's."""
    alloc = native_allocator(setup)
    s = Scheduler(
        alloc,
        VllmV1(),
        max_model_len=setup.max_model_len,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        chunked_prefill=setup.enable_chunked_prefill,
        sliding_window=setup.sliding_window,
    )
    records, pending, step, live = [], list(stream), 0, 0
    cached = (lambda: frozenset(b + 1 for b in alloc.cached_blocks)) if setup.enable_prefix_caching else frozenset
    while (pending or live) and step < max_steps:
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            spec = RequestSpec(
                a.key, float(step), a.shape.prompt_tokens, a.shape.output_tokens, a.shape.segments, a.shape.tail_id
            )
            s.arrive(Request(spec, a.shape), float(step), a.key)
            live += 1
        before = list(s.running)
        st = s.schedule(float(step))
        rec = Record(
            scheduled={q.spec.id: n for q, n in st.work},
            admitted=sorted((q.spec.id, q.prefilled) for q, n in st.work if q not in before),
            preempted=sorted(q.spec.id for q in before if q not in s.running),
        )
        done = s.complete(st, float(step) + 0.5)
        live -= len(done) + len(st.rejected)
        rec.finished = sorted(q.spec.id for q in done)
        if trace:
            rec.free_blocks = len(alloc.free_blocks)
            rec.cached_blocks = cached()
            rec.tables = {
                q.spec.id: _flat(native_tables(alloc, q.ids[0]))
                for q in sorted(s.running, key=lambda q: q.spec.id)
                if q.spec.id in rec.scheduled
            }
        records.append(rec)
        step += 1
    return records


def native_tables(alloc, seq_id: int) -> list[list[int]]:
    """Each group's table as vLLM numbers it: block b as b + 1, a released block as 0."""
    if isinstance(alloc, HybridPagedAllocator):
        pairs = list(zip(alloc.released(seq_id), alloc.block_tables(seq_id)))
    else:
        pairs = [(alloc.released_blocks(seq_id), alloc.block_table(seq_id))]
    return [[0] * d + [b + 1 for b in table] for d, table in pairs]


def _flat(tables: list[list[int]]) -> list[int] | tuple[tuple[int, ...], ...]:
    """One group's table as a list, several as a tuple of tuples."""
    return list(tables[0]) if len(tables) == 1 else tuple(map(tuple, tables))


def native_allocator(setup: Setup) -> PagedAllocator | HybridPagedAllocator:
    """kvsim's pool for the setup: vLLM's less its null block, stepped synchronously (one
    batch of max_num_batched_tokens in flight)."""
    blocks, bs = setup.num_blocks - 1, setup.block_size
    if setup.groups:
        caps = tuple(
            0 if w is None else admission_cap(w, bs, setup.max_num_batched_tokens, setup.max_model_len)
            for w in setup.groups
        )
        return (HybridPrefixCache if setup.enable_prefix_caching else HybridPagedAllocator)(
            blocks, bs, setup.groups, caps
        )
    if setup.sliding_window is not None:
        cap = admission_cap(setup.sliding_window, bs, setup.max_num_batched_tokens, setup.max_model_len)
        make = SlidingWindowPrefixCache if setup.enable_prefix_caching else SlidingWindowPagedAllocator
        return make(blocks, bs, setup.sliding_window, cap)
    return PrefixCachingPagedAllocator(blocks, bs) if setup.enable_prefix_caching else PagedAllocator(blocks, bs)


def compare(native: list[Record], reference: list[Record]) -> list[str]:
    """Where the two disagree: the first differing field of each differing step (at most 5)."""
    out = []
    if len(native) != len(reference):
        out.append(f"steps: kvsim ran {len(native)}, vLLM {len(reference)}")
    for i, (a, b) in enumerate(zip(native, reference)):
        for name in ("scheduled", "admitted", "preempted", "finished", "free_blocks", "cached_blocks", "tables"):
            x, y = getattr(a, name), getattr(b, name)
            if x != y:
                if isinstance(x, frozenset):
                    x, y = sorted(x - y), sorted(y - x)
                out.append(f"step {i}: {name}: kvsim {x}, vLLM {y}")
                break
        if len(out) >= 5:
            break
    return out
