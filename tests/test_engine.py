"""The scheduler and the step loop on hand-made cases with exact timelines.

A fixed cost model (every step takes one second) makes every instant predictable.
"""

import math

import pytest

from kvsim.kvcache import ContiguousAllocator, PagedAllocator
from kvsim.sim.loop import simulate
from kvsim.analysis.metrics import request_table, summarize
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps


def make_requests(*rows):
    """rows: (arrival_s, prompt_tokens, output_tokens)."""
    return [RequestSpec(i, a, p, o) for i, (a, p, o) in enumerate(rows)]


def run(requests, allocator, *, max_model_len=64, max_num_seqs=256, budget=64, chunked=False, cost=None):
    return simulate(
        "p",
        requests,
        allocator,
        cost or OneSecondSteps(),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        check_invariants=True,
    )


def timeline(result):
    return [(s.spec.id, s.admitted_s, s.first_token_s, s.finish_s, s.preemptions, s.outcome) for s in result.seqs]


def test_continuous_batching_timeline():
    # r0 is prefilled in [0,1] and decodes in [1,2] and [2,3]; r1 arrives mid-step at 0.5,
    # joins at the next step boundary and decodes beside r0.
    cost = OneSecondSteps()
    result = run(make_requests((0.0, 4, 3), (0.5, 4, 3)), PagedAllocator(100, 4), cost=cost)
    assert timeline(result) == [
        (0, 0.0, 1.0, 3.0, 0, "completed"),
        (1, 1.0, 2.0, 4.0, 0, "completed"),
    ]
    # step 1: r0 decodes over its 4 + 1 tokens of context (its prompt and the token it
    # feeds back) while r1 prefills 4 new tokens (the fast path gives decodes in sum: one
    # decode, 5 tokens of context in all)
    batch = cost.batches[1]
    assert (batch.prefills, batch.decodes, batch.decode_total) == (((4, 0),), 1, 5)
    assert [b.new_tokens for b in cost.batches] == [4, 5, 2, 1]


def test_request_arriving_at_a_step_boundary_joins_that_boundary():
    result = run(make_requests((0.0, 4, 2), (1.0, 4, 1)), PagedAllocator(100, 4))
    assert timeline(result)[1] == (1, 1.0, 2.0, 2.0, 0, "completed")


def test_latest_admitted_is_preempted_and_recomputed():
    # 10 one-token blocks (vLLM V1 counts: a prompt's slots, then one per token fed
    # back). r0 (4+4 tokens) and r1 (3+3) both fit at admission (4 + 3 slots) and take a
    # block each at t=1; at t=2 r0 takes the last one and r1 (the latest admitted) is
    # preempted, waits for r0 to finish at t=4, then prefills its prompt plus the 2
    # tokens it had generated and samples its last token. Its first token keeps its
    # original time.
    alloc = PagedAllocator(10, 1)
    result = run(make_requests((0.0, 4, 4), (0.0, 3, 3)), alloc)
    assert timeline(result) == [
        (0, 0.0, 1.0, 4.0, 0, "completed"),
        (1, 0.0, 1.0, 5.0, 1, "completed"),
    ]
    assert result.preemptions == 1
    assert alloc.free_blocks and len(alloc.free_blocks) == 10


def test_contiguous_max_reservation_never_preempts_but_holds_fewer():
    # Regions of max_model_len = 8 slots in a 20-slot pool: two fit, the third waits.
    alloc = ContiguousAllocator(20, 8, "max", "first-fit")
    result = run(make_requests((0, 2, 2), (0, 2, 2), (0, 2, 2)), alloc, max_model_len=8)
    assert timeline(result) == [
        (0, 0.0, 1.0, 2.0, 0, "completed"),
        (1, 0.0, 1.0, 2.0, 0, "completed"),
        (2, 2.0, 3.0, 4.0, 0, "completed"),
    ]
    first = result.steps[0]
    # while r2 waits: 2 x (2 tokens, 2 still to come, 4 never used); 4 free slots are a
    # hole too small for r2's 8-slot region.
    assert first[6:11] == (4, 4, 8, 4, 0)


def test_rejections_on_arrival_with_reasons():
    alloc = PagedAllocator(4, 4)  # 16 slots
    result = run(make_requests((0, 10, 10), (0, 60, 10), (0, 4, 4)), alloc, max_model_len=64)
    outcomes = [(s.outcome, s.reason) for s in result.seqs]
    assert outcomes == [
        ("rejected", "final length exceeds KV pool"),
        ("rejected", "prompt + output exceeds max_model_len"),
        ("completed", ""),
    ]
    table = request_table(result)
    row = summarize(result, table)
    assert (row["requests_completed"], row["requests_rejected"]) == (1, 2)


def test_chunked_prefill_splits_a_prompt_across_steps():
    cost = OneSecondSteps()
    result = run(make_requests((0, 10, 2)), PagedAllocator(100, 4), budget=4, chunked=True, cost=cost)
    assert timeline(result) == [(0, 0.0, 3.0, 4.0, 0, "completed")]
    assert [b.new_tokens for b in cost.batches] == [4, 4, 2, 1]


def test_max_num_seqs_limits_the_batch():
    result = run(make_requests((0, 2, 3), (0, 2, 3), (0, 2, 3)), PagedAllocator(100, 4), max_num_seqs=2)
    assert [s.admitted_s for s in result.seqs] == [0.0, 0.0, 3.0]
    assert max(r[2] for r in result.steps) == 2


def test_summary_definitions_on_a_known_run():
    alloc = ContiguousAllocator(20, 8, "max", "first-fit")
    result = run(make_requests((0, 2, 2), (0, 2, 2), (0, 2, 2)), alloc, max_model_len=8)
    row = summarize(result, request_table(result))
    # Steps: [0,1] and [1,2] run r0 and r1 while r2 waits for memory (two regions of 8
    # leave 4 of 20 slots); [2,3] and [3,4] run r2 alone with nothing waiting.
    # Memory-bound window = the first two steps: token slots 4 then 6 of 20 -> 0.25.
    assert row["fraction_basis"] == "memory"
    assert (row["limited_by_memory"], row["limited_by_arrivals"], row["limited_by_token_budget"]) == (0.5, 0.5, 0)
    assert row["token_fraction"] == pytest.approx(0.25)
    assert sum(row[f"{p}_fraction"] for p in ("token", "reservation", "internal", "external", "free")) == pytest.approx(
        1.0
    )
    assert row["achievable_batch_size"] == 2.0
    assert row["mean_batch_size"] == 1.5
    assert row["max_batch_size"] == 2
    # 6 requests' worth... 3 requests x 2 output tokens over a 4 s makespan
    assert row["throughput_tok_s"] == 1.5
    assert row["ttft_p50_s"] == 1.0 and row["e2e_p50_s"] == 2.0 and row["tpot_p50_s"] == 1.0
    # allocated 16,16,8,8 slots; tokens 4,6,2,3 -> waste = (12+10+6+5)/48
    assert row["allocation_waste"] == pytest.approx(33 / 48)


def test_every_policy_sees_the_same_stream_and_ends_empty():
    reqs = make_requests(*[(0.1 * i, 5 + i % 7, 1 + i % 5) for i in range(40)])
    for alloc in (
        PagedAllocator(12, 4),
        ContiguousAllocator(48, 16, "pow2", "buddy"),
        ContiguousAllocator(48, 16, "oracle", "first-fit"),
    ):
        result = run(reqs, alloc, max_model_len=16)
        assert all(s.outcome == "completed" for s in result.seqs)
        b = alloc.breakdown(None)
        assert b.free == alloc.capacity
        assert all(not math.isnan(s.finish_s) for s in result.seqs)
