"""Memory policies beyond plain paging: swap, watermark, shared-content workloads, scales."""

import numpy as np
import pytest

from kvsim.kvcache import PagedAllocator, SeqShape
from kvsim.config.scenario import validate_scenario
from kvsim.sim.scheduler import SwapSpace
from kvsim.model.specs import MODEL_PRESETS, KVSpec
from kvsim.workload.requests import generate_requests
from helpers import OneSecondSteps
from test_engine import make_requests, timeline

from kvsim.sim.loop import simulate


def run(requests, allocator, **options):
    """Swap, the watermark and sequence groups are vLLM V0's: these cases run under its rules."""
    base = dict(engine="vllm-v0", max_model_len=64, max_num_seqs=256, max_num_batched_tokens=64, chunked_prefill=False)
    return simulate("p", requests, allocator, OneSecondSteps(), check_invariants=True, **{**base, **options})


def test_swap_preemption_keeps_progress_and_pays_pcie_time():
    # As in test_engine's recompute case, r1 is preempted at t=1; here its 4 tokens of KV
    # (1 byte each, 1 byte/s of PCIe) are copied out during step [1, 6] and back during
    # step [8, 13], after which it decodes its last token without recomputing anything.
    swap = SwapSpace(capacity_bytes=100, bytes_per_token=1.0, bandwidth_bytes_s=1.0)
    result = run(make_requests((0.0, 4, 4), (0.0, 3, 3)), PagedAllocator(10, 1), swap=swap, preemption_mode="swap")
    assert timeline(result) == [
        (0, 0.0, 1.0, 8.0, 0, "completed"),
        (1, 0.0, 1.0, 14.0, 1, "completed"),
    ]
    assert (result.preemptions, result.swaps) == (1, 1)
    assert [row[1] for row in result.steps] == [1.0, 5.0, 1.0, 1.0, 5.0, 1.0]
    # check_invariants compared the scheduler's swap_used with the swapped requests at every step


def test_swap_falls_back_to_recompute_when_cpu_space_is_full():
    swap = SwapSpace(capacity_bytes=3, bytes_per_token=1.0, bandwidth_bytes_s=1.0)
    result = run(make_requests((0.0, 4, 4), (0.0, 3, 3)), PagedAllocator(10, 1), swap=swap, preemption_mode="swap")
    assert (result.preemptions, result.swaps) == (1, 0)
    assert timeline(result)[1] == (1, 0.0, 1.0, 6.0, 1, "completed")


def test_watermark_keeps_blocks_free_while_others_run():
    # 10 one-slot blocks, watermark 0.3 keeps 3 free: r0 (5 slots) is admitted into the
    # empty pool, r1 (4 slots) would leave only 1 free, so it waits for r0 to finish.
    result = run(make_requests((0.0, 4, 1), (0.0, 3, 1)), PagedAllocator(10, 1), watermark=0.3)
    assert [s.admitted_s for s in result.seqs] == [0.0, 1.0]


def test_v0_rejects_a_prompt_larger_than_the_pool_minus_the_watermark():
    # can_allocate's NEVER: 10 slots less a watermark of 5 cannot take an 8-token prompt,
    # even with the pool empty; without a watermark (vLLM V1 keeps none) it runs.
    result = run(make_requests((0.0, 8, 1)), PagedAllocator(10, 1), watermark=0.5)
    assert [(s.outcome, s.reason) for s in result.seqs] == [
        ("rejected", "prompt exceeds the KV pool minus the watermark")
    ]
    result = run(make_requests((0.0, 8, 1)), PagedAllocator(10, 1), engine="vllm-v1")
    assert timeline(result) == [(0, 0.0, 1.0, 1.0, 0, "completed")]


BASE = dict(
    name="s",
    model="llama-3-8b",
    gpu="h100-80gb",
    max_model_len=4096,
    workload=dict(
        num_requests=200,
        arrival=dict(process="poisson", rate_per_s=2.0),
        prompt_tokens=dict(dist="uniform", min=10, max=100),
        output_tokens=dict(dist="uniform", min=5, max=50),
    ),
    policies=[dict(name="p", allocator="paged")],
)


def requests_for(**workload):
    scn = validate_scenario({**BASE, "workload": {**BASE["workload"], **workload}}, "s.yaml")
    return generate_requests(scn, base_dir=None)


def test_prefix_groups_prepend_a_shared_prefix():
    reqs = requests_for(prefix=dict(groups=3, tokens=500, popularity="zipf", zipf_s=1.5))
    plain = requests_for()
    assert [r.prompt_tokens - 500 for r in reqs] == [r.prompt_tokens for r in plain]
    groups = [r.segments[0][0] - len(reqs) for r in reqs]
    assert set(groups) <= {0, 1, 2} and all(r.segments[0][1] == 500 for r in reqs)
    counts = np.bincount(groups, minlength=3)
    assert counts[0] > counts[1] > counts[2]  # Zipf: the first prefix is the most popular
    assert all(r.shape.tail_id == r.id for r in reqs)


def test_rag_requests_share_a_system_prompt_then_retrieved_documents():
    reqs = requests_for(rag=dict(system_tokens=300, corpus_docs=50, doc_tokens=200, docs_per_request=3))
    for r in reqs:
        system, *docs = r.segments
        assert system == (len(reqs), 300)
        assert len({d for d, _ in docs}) == 3 and all(n == 200 for _, n in docs)
        assert r.prompt_tokens >= 300 + 3 * 200 + 10


def test_conversation_turns_carry_the_whole_previous_context():
    reqs = requests_for(conversation=dict(turns=3, think_time_s=5.0))
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_tail = {r.shape.tail_id: r for r in reqs}
    followers = [r for r in reqs if r.segments]
    assert followers
    for r in followers:
        prev = by_tail[r.segments[-1][0]]
        # the previous turn's tokens (its shared part, its own prompt and its answer) lead this prompt
        assert r.segments[:-1] == prev.segments
        assert sum(n for _, n in r.segments) == prev.prompt_tokens + prev.output_tokens
        assert r.arrival_s == pytest.approx(prev.arrival_s + 5.0)
        assert r.prompt_tokens + r.output_tokens <= 4096


def test_shared_content_must_leave_room_under_max_model_len():
    from kvsim.config.errors import InputError

    with pytest.raises(InputError, match="leaves no room"):
        requests_for(prefix=dict(groups=1, tokens=4096))


def test_contiguous_prefix_caching_is_a_clear_error():
    from kvsim.config.errors import InputError

    bad = {**BASE, "policies": [dict(name="c", allocator="contiguous", enable_prefix_caching=True)]}
    with pytest.raises(InputError, match="contiguous allocation cannot share"):
        validate_scenario(bad, "s.yaml")


@pytest.mark.parametrize(
    "dtype, scale, group, data, scales",
    [
        ("bf16", "head", 64, 131072, 0),  # unquantized: no scales whatever is asked
        ("fp8", "tensor", 64, 65536, 0),  # static per-tensor scales cost nothing per token
        ("int8", "head", 64, 65536, 2 * 32 * 8 * 2),  # one fp16 scale per K/V head per layer
        ("int4", "group", 64, 32768, 2 * 32 * 8 * 2 * 2),  # 128-wide heads: two groups each
    ],
)
def test_quantization_scales_add_bytes_per_token(dtype, scale, group, data, scales):
    kv = KVSpec(MODEL_PRESETS["llama-3-8b"], dtype, scale, group)
    assert (kv.data_bytes_per_token, kv.scale_bytes_per_token) == (data, scales)
    assert kv.bytes_per_token == data + scales


def test_mla_scales_count_one_latent_vector_per_layer():
    kv = KVSpec(MODEL_PRESETS["deepseek-v3"], "fp8", "group", 64)
    assert kv.data_bytes_per_token == 61 * 576
    assert kv.scale_bytes_per_token == 61 * 9 * 2


def test_sliding_window_releases_blocks_that_left_the_window():
    alloc = PagedAllocator(10, 2, window=4)
    assert alloc.allocate(0, SeqShape(5, 10), 5)  # blocks 0,1,2; none out yet
    assert (alloc.block_table(0), alloc.free_blocks) == ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9])
    assert alloc.grow(0, 8)  # tokens 0-3 are before the last 4: blocks 0 and 1 go
    assert alloc.block_table(0) == [2, 3]
    # Deepest first, to the head (vLLM 0.33.0 _remove_blocks_in_range, BlockPool.free_blocks).
    assert alloc.free_blocks == [1, 0, 4, 5, 6, 7, 8, 9]
    b = alloc.breakdown(None)
    assert (b.token, b.reservation, b.internal) == (4, 0, 0)
    alloc.check_invariants()
    alloc.free(0)
    assert alloc.free_blocks == [3, 2, 1, 0, 4, 5, 6, 7, 8, 9]


def test_sliding_window_model_holds_fewer_blocks_in_a_run():
    reqs = make_requests(*[(0.0, 30, 40)] * 4)
    full = run(reqs, PagedAllocator(100, 4), max_model_len=128)
    windowed = run(reqs, PagedAllocator(100, 4, window=16), max_model_len=128, sliding_window=16)
    assert max(r[6] for r in windowed.steps) < max(r[6] for r in full.steps)
    assert [s.outcome for s in windowed.seqs] == ["completed"] * 4


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    alloc = PagedAllocator(8, 4)
    assert alloc.allocate(0, SeqShape(6, 4), 7)  # blocks 0, 1 (1 holds 3 tokens)
    assert alloc.fork(0, 1)
    assert alloc.block_table(1) == [0, 1] and alloc.ref_count(0) == alloc.ref_count(1) == 2
    b = alloc.breakdown(None)
    assert (b.token, b.reservation, b.internal, b.free, b.shared) == (7, 1, 0, 24, 8)
    assert alloc.grow(1, 8)  # writes into shared block 1: copy
    assert alloc.block_table(1) == [0, 2] and alloc.ref_count(1) == 1
    assert alloc.grow(0, 8)  # block 1 is its own now: in place
    assert alloc.block_table(0) == [0, 1]
    alloc.check_invariants()
    alloc.free(0)
    assert alloc.free_blocks == [1, 3, 4, 5, 6, 7] and alloc.ref_count(0) == 1
    alloc.free(1)  # to the head, deepest first
    assert alloc.free_blocks == [2, 0, 1, 3, 4, 5, 6, 7]


def test_contiguous_fork_is_a_full_copy():
    from kvsim.kvcache import ContiguousAllocator

    alloc = ContiguousAllocator(20, 8, "oracle", "first-fit")
    assert alloc.allocate(0, SeqShape(4, 4), 5) and alloc.fork(0, 1)
    assert (alloc.region(0), alloc.region(1)) == ((0, 8), (8, 8))
    assert not alloc.fork(0, 2)  # 4 slots left: no room for a copy
    assert alloc.holes() == [(16, 4)]


def test_parallel_samples_share_the_prompt_and_finish_together():
    alloc = PagedAllocator(100, 4)
    result = run(make_requests((0.0, 8, 3)), alloc, width=3)
    assert timeline(result) == [(0, 0.0, 1.0, 3.0, 0, "completed")]
    # step 0: the prompt's 2 blocks + the first token's block, shared by all three samples
    assert result.steps[0][12] == 2 * 3 * 4
    assert [row[5] for row in result.steps] == [0, 3, 3]  # three decode tokens per step
    assert len(alloc.free_blocks) == 100


def test_beam_search_completes_and_shares_blocks_under_different_block_sizes():
    reqs = make_requests(*[(0.1 * i, 6 + i, 12) for i in range(6)])
    small, large = (run(reqs, PagedAllocator(n, bs), width=4, beam=True, seed=3) for n, bs in ((60, 4), (400, 1)))
    assert [s.outcome for s in small.seqs] == [s.outcome for s in large.seqs] == ["completed"] * 6
    assert any(row[12] for row in small.steps)  # beams shared blocks


def test_a_group_that_cannot_fit_an_empty_pool_is_rejected():
    from kvsim.kvcache import ContiguousAllocator

    result = run(make_requests((0.0, 4, 4)), ContiguousAllocator(20, 8, "oracle", "first-fit"), width=3)
    assert [(s.outcome, s.reason) for s in result.seqs] == [
        ("rejected", "does not fit an empty KV pool with its 3 sequences")
    ]


def test_a_group_that_cannot_grow_even_alone_is_rejected_not_retried_forever():
    # 4 samples of 2 + 5 tokens fit at admission (3 shared slots) but need 4 x 4 + 2
    # slots at the end: more than the 10-slot pool. Alone and stuck, the group is
    # rejected instead of being preempted and restarted forever.
    result = run(make_requests((0.0, 2, 5), (0.0, 2, 1)), PagedAllocator(10, 1), width=4)
    assert [(s.outcome, s.reason) for s in result.seqs] == [
        ("rejected", "cannot grow to its final length even alone in the KV pool with its 4 sequences"),
        ("completed", ""),
    ]


def test_token_budget_below_the_group_width_is_an_input_error():
    from kvsim.config.errors import InputError

    bad = {
        **BASE,
        "engine": "vllm-v0",
        "max_model_len": 32,
        "scheduler": {"max_num_batched_tokens": 32},
        "workload": {
            **BASE["workload"],
            "n": 40,
            "prompt_tokens": {"dist": "fixed", "value": 8},
            "output_tokens": {"dist": "fixed", "value": 8},
        },
    }
    with pytest.raises(InputError, match="max_num_batched_tokens: 32 is below the 40 sequences"):
        validate_scenario(bad, "s.yaml")
