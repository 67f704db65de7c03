"""SGLang 0.5.23's rules, each on a case derived by hand from the cited code
(kvsim/engines/sglang.py and kvsim/kvcache/radix.py name the files).

Slots count SGLang's way: a request holds its prompt after its prefill and one slot more
per decode step (the token it feeds in); every step takes one second.
"""

import pytest

from kvsim.engines import SGLang
from kvsim.engines import sglang_eos as eos
from kvsim.kvcache import PagedAllocator, RadixCacheAllocator, SeqShape
from kvsim.sim.loop import simulate
from kvsim.engines.base import Request, Step
from kvsim.sim.scheduler import Scheduler
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps
from test_engine import make_requests


def sglang(requests, allocator, *, budget=64, ignore_eos=False):
    return simulate(
        "p",
        requests,
        allocator,
        OneSecondSteps(),
        engine="sglang",
        max_model_len=8192,
        max_num_seqs=256,
        max_num_batched_tokens=budget,
        chunked_prefill=True,
        check_invariants=True,
        ignore_eos=ignore_eos,
    )


def running(alloc, rows, *, cache_prompts=False):
    """A scheduler under SGLang's rules with running requests (shape, generated), each
    holding prompt + generated slots; with `cache_prompts` their prompts went into the
    tree after their prefill."""
    rules = SGLang()
    s = Scheduler(alloc, rules, max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=True)
    for i, (shape, generated) in enumerate(rows):
        seq = Request(RequestSpec(i, 0.0, shape.prompt_tokens, shape.output_tokens), shape)
        s.arrive(seq, 0.0, i)
        assert s.admit(seq, 0, shape.prompt_tokens, shape.prompt_tokens + generated, Step(), 0.0)
        seq.prefilled, seq.generated, seq.held = shape.prompt_tokens, generated, shape.prompt_tokens + generated
        if cache_prompts:
            alloc.cache_prefilled(seq.ids[0], shape.prompt_tokens)
    return s, rules


def test_the_full_batch_latch_keeps_prefill_off_until_a_request_leaves():
    # 6,000 slots. r0 (10 + 4,000) is admitted at t=0 (10 + 4,000 + 1 page < 6,000). At t=1
    # r1 (10 + 3,500) needs 3,511 < 5,990 free - 3,999 x 0.7 reserved = 3,190.7: no, and r0
    # runs, so the latch is set. Without it r1 would be admitted once the ratio's decay
    # outpaces r0's growth (about 90 decode steps later); with it, prefill is not tried
    # again until r0 finishes at t=4,000.
    result = sglang(make_requests((0.0, 10, 4000), (0.5, 10, 3500)), PagedAllocator(6000, 1))
    r0, r1 = result.seqs
    assert r0.finish_s == 4000.0
    assert r1.admitted_s == 4000.0 and r1.outcome == "completed"


def test_the_ratio_starts_over_when_the_server_goes_idle():
    # r0 (10 + 700) decodes 699 steps: the ratio decays to its floor 0.098. The server is
    # idle from t=700 to 800, so it is 0.7 again when r1 (10 + 1,000) comes. At t=801 r2
    # (10 + 1,500) needs 1,511 < 1,990 free - 999 x 0.7 = 1,290.7: no (at 0.098 it would
    # fit: 1,892.1), and the latch keeps it out until r1 finishes at t=1,800.
    reqs = make_requests((0.0, 10, 700), (800.0, 10, 1000), (800.5, 10, 1500))
    result = sglang(reqs, PagedAllocator(2000, 1))
    assert [s.admitted_s for s in result.seqs] == [0.0, 800.0, 1800.0]


def test_admission_charges_a_page_and_locks_the_heads_cached_prefix():
    # A 60-slot tree holds an unreferenced 16-token prefix (evictable): 44 free. r0 (4
    # unique + 10, 1 generated) runs: 39 free, 55 free or evictable, 9 x 0.7 = 6.3 reserved.
    # The head (the 16 cached tokens + 4, output X) locks its prefix while it is tested:
    # 4 + X + 1 page < 55 - 6.3 - 16 = 32.7 admits X = 27, not X = 28 (unlocked, 48.7).
    for output, admitted in ((27, True), (28, False)):
        alloc = RadixCacheAllocator(60)
        doc = SeqShape(16, 0, segments=((5, 16),))
        assert alloc.allocate(900, doc, 16)
        alloc.free(900)
        s, rules = running(alloc, [(SeqShape(4, 10), 1)])
        head = Request(RequestSpec(1, 0.0, 20, output), SeqShape(20, output, segments=((5, 16),)))
        s.arrive(head, 0.0, 1)
        step = s.schedule(1.0)
        assert (head in s.running) is admitted
        if admitted:
            assert step.work == [(head, 4)]
        else:
            assert step.limit == "memory" and rules.full == "memory"


def test_a_chunk_is_charged_whole_pages():
    # Pages of 16 and a chunk of 64: each 4-token prompt takes a page of the chunk, so four
    # are prefilled per step (PrefillAdder._update_prefill_budget).
    result = sglang(make_requests(*[(0.0, 4, 20)] * 10), PagedAllocator(1000, 16))
    assert [s.admitted_s for s in result.seqs] == [0.0] * 4 + [1.0] * 4 + [2.0] * 2


@pytest.mark.parametrize("b_generated, b_prompt_cached", [(30, True), (1, False)])
def test_a_retracted_request_keeps_only_its_prompt_in_the_tree(b_generated, b_prompt_cached):
    # A (4 + 31 generated) and B (4 + b generated), of 60 outputs each, fill a 100-slot tree with 31 or 60 slots
    # held outside; their prompts went into the tree after prefill, their outputs (content
    # of their own, so cacheable) did not. The next decode needs 2 slots: B goes (fewer
    # outputs). Its outputs are freed, not inserted, its prompt stays unlocked. Then the tree
    # evicts what 20 decode steps of A need beyond the free slots: with 30 outputs freed
    # nothing; with 1 freed, 19, which takes B's prompt. (Had B's outputs been inserted
    # instead, that eviction would have taken their leaf first and ended the same: the
    # rule itself is checked on the allocator below.)
    alloc = RadixCacheAllocator(100)
    assert alloc.allocate(999, SeqShape(100 - 39 - b_generated, 0), 100 - 39 - b_generated)
    a = SeqShape(4, 60, segments=((1, 4),), tail_id=10)
    b = SeqShape(4, 60, segments=((2, 4),), tail_id=20)
    s, rules = running(alloc, [(a, 31), (b, b_generated)], cache_prompts=True)
    step = s.schedule(1.0)
    assert [q.spec.id for q in s.waiting] == [1]
    assert [(q.spec.id, n) for q, n in step.work] == [(0, 1)]
    prompts = [(0, ((1, 0, 4),), 1)] + ([(0, ((2, 0, 4),), 0)] if b_prompt_cached else [])
    assert sorted(alloc.nodes()) == sorted(prompts)
    assert alloc.match_prefix(b, 4 + b_generated + 1) == (4 if b_prompt_cached else 0)
    assert rules.ratio == pytest.approx((31 + 20) / (60 + 1))
    alloc.check_invariants()


def test_drop_frees_what_free_would_cache():
    shape = SeqShape(8, 8, segments=((7, 8),), tail_id=9)
    for release, cached in (("drop", 8), ("free", 12)):
        alloc = RadixCacheAllocator(64)
        assert alloc.allocate(1, shape, 8)
        alloc.cache_prefilled(1, 8)
        assert alloc.grow(1, 12)
        getattr(alloc, release)(1)
        assert alloc.match_prefix(shape, 13) == cached
        assert alloc.free_slots == 64 - cached
        alloc.check_invariants()


def test_a_request_that_fails_the_test_in_an_empty_server_is_rejected():
    # 10 + 19 + 1 page is not under 30 slots: SGLang would hold it at the head for ever.
    result = sglang(make_requests((0.0, 10, 19)), RadixCacheAllocator(30))
    assert result.seqs[0].outcome == "rejected"


# --- ignore_eos (kvsim.engines.sglang_eos) ----------------------------------------------------
def test_a_running_fixed_length_request_reserves_its_whole_output():
    # Radix cache on, 6,000 slots. r0 (10 + 2,000) runs from t=0; at t=1 it holds its 10
    # prompt slots (in the tree, locked) and has 1,999 tokens left. r1 (10 + 4,000) needs
    # 10 + 4,000 + 1 page = 4,011 < 5,990 - 1,999 x ratio: at the ratio 0.7 (4,590.7) it is
    # admitted; with ignore_eos the reservation is 1,999 x 1.0 (3,991), so it is refused,
    # the latch is set, and it waits for r0 to finish at t=2,000.
    reqs = make_requests((0.0, 10, 2000), (0.5, 10, 4000))
    assert [s.admitted_s for s in sglang(reqs, RadixCacheAllocator(6000)).seqs] == [0.0, 1.0]
    assert [s.admitted_s for s in sglang(reqs, RadixCacheAllocator(6000), ignore_eos=True).seqs] == [0.0, 2000.0]


def test_without_the_tree_a_fixed_length_request_takes_the_run_to_the_end_test():
    # Radix cache off (a plain pool of 100 slots). At t=1 r0 (10 + 10) holds 10 slots with
    # 9 tokens left; 90 free. The ordinary test refuses r1 (10 + 76): 10 + 76 + 1 = 87 is
    # not below 90 - 9 x 0.7 = 83.7, and r1 waits for r0 to finish at t=10. With ignore_eos:
    # 10 + 1 page = 11 <= min(90, 90 - 9 x 1.0); the states sorted by tokens left are
    # r0 (9 left, 11 occupied), r1 (76, 10); 90 - 11 = 79 free: 79 - 2 x 9 = 61 > 2, then
    # 79 + 11 (r0 done) - 76 = 14 > 1: admitted at t=1, whose step is r1's prefill alone
    # (prefill before decode), so r0 finishes a step later.
    reqs = make_requests((0.0, 10, 10), (0.5, 10, 76))
    assert [s.admitted_s for s in sglang(reqs, PagedAllocator(100, 1)).seqs] == [0.0, 10.0]
    result = sglang(reqs, PagedAllocator(100, 1), ignore_eos=True)
    assert [(s.admitted_s, s.finish_s) for s in result.seqs] == [(0.0, 11.0), (1.0, 77.0)]


def test_a_later_candidate_goes_before_the_last_state_when_it_leaves_the_most():
    # Both arrive at t=0, tree off, 100 slots. r0 (10 + 10) is admitted: states [(10, 10)],
    # 100 - 11 = 89 free, 89 - 10 > 1. r1 (10 + 70): 11 <= min(89, 100 - 21). SGLang's
    # insertion finds no state leaving 70 or more and stops its index at the last one, so
    # r1 goes first: [(70, 10), (10, 10)]; 89 - 11 = 78 free, 78 - 2 x 70 <= 2: refused (in
    # order it would pass: 78 - 2 x 10 = 58 > 2, 78 + 10 - 70 = 18 > 1). r0 was admitted,
    # so the latch holds r1 until r0 finishes at t=10.
    result = sglang(make_requests((0.0, 10, 10), (0.0, 10, 70)), PagedAllocator(100, 1), ignore_eos=True)
    assert [s.admitted_s for s in result.seqs] == [0.0, 10.0]
    states = [(10, 10)]
    eos.insert_state(states, (70, 10))
    assert states == [(70, 10), (10, 10)] and not eos.outlast(states, 78)
    assert eos.outlast([(10, 10), (70, 10)], 78)


def test_a_fixed_length_prompt_is_cut_to_the_chunk_left_in_tokens():
    # Pages of 4, a chunk of 62, tree off. r0's 29 tokens take 32 of the chunk (whole
    # pages); r1 (50 tokens) is cut to the 30 left: 30 tokens under ignore_eos
    # (add_one_req_ignore_eos), 28 (whole pages) under the ordinary test.
    for ignore_eos, cut in ((False, 28), (True, 30)):
        alloc = PagedAllocator(1000, 4)
        rules = SGLang()
        s = Scheduler(
            alloc,
            rules,
            max_model_len=8192,
            max_num_seqs=8,
            max_num_batched_tokens=62,
            chunked_prefill=True,
            ignore_eos=ignore_eos,
        )
        reqs = [Request(spec, spec.shape) for spec in make_requests((0.0, 29, 5), (0.0, 50, 5))]
        for i, req in enumerate(reqs):
            s.arrive(req, 0.0, i)
        step = s.schedule(0.0)
        assert [(q.spec.id, n) for q, n in step.work] == [(0, 29), (1, cut)]


@pytest.mark.parametrize("given, sent", [(None, False), (True, True), (False, False)])
def test_the_workloads_ignore_eos_reaches_sglangs_rules(given, sent):
    from pathlib import Path

    from kvsim.config.scenario import validate_scenario
    from kvsim.sim.plan import resolve

    workload = dict(
        num_requests=2,
        arrival=dict(process="poisson", rate_per_s=1.0),
        prompt_tokens=dict(dist="fixed", value=100),
        output_tokens=dict(dist="fixed", value=10),
    ) | ({} if given is None else {"ignore_eos": given})
    scn = dict(
        name="s",
        model="llama-3-8b",
        gpu="h100-80gb",
        engine="sglang",
        workload=workload,
        policies=[{"name": "p", "allocator": "paged"}],
    )
    plan = resolve(validate_scenario(scn, "s.yaml"), Path("."))
    assert plan.ignore_eos is sent and plan.policies[0].scheduler_options(plan)["ignore_eos"] is sent


# --- paged allocation's eviction demand (mem_cache/allocation.py) -------------------------------
def test_a_paged_admission_evicts_for_its_tokens_and_a_page():
    # 32 slots in pages of 4; A then B (8 tokens each) cached and unlocked: 16 free. C (14
    # tokens, 4 pages) fits the 16 free slots, but alloc_paged_token_slots_extend evicts
    # until 14 + 4 = 18 are free: A, the least recently used, goes (8 slots).
    alloc = RadixCacheAllocator(32, 4)
    for i in (1, 2):
        assert alloc.allocate(i, SeqShape(8, 0, tail_id=i), 8)
        alloc.free(i)
    assert (alloc.free_slots, alloc.evictable_slots) == (16, 16)
    assert alloc.allocate(3, SeqShape(14, 4, tail_id=3), 14)
    assert (alloc.free_slots, alloc.evictable_slots, alloc.cached_slots) == (8, 8, 8)
    assert alloc.match_prefix(SeqShape(9, 0, tail_id=2), 9) == 8  # B stayed


def test_a_paged_decode_evicts_for_a_page_per_request():
    # 16 slots in pages of 4. r0 (6 + 10, 1 generated) holds 7 tokens in 2 pages; A (8
    # tokens) cached, unlocked: none free. r0's next token fits its last page, so
    # check_decode_mem asks for nothing, but alloc_paged_token_slots_decode evicts until a
    # page per request is free: A goes.
    alloc = RadixCacheAllocator(16, 4)
    s, rules = running(alloc, [(SeqShape(6, 10), 1)])
    assert alloc.allocate(50, SeqShape(8, 0, tail_id=50), 8)
    alloc.free(50)
    assert (alloc.free_slots, alloc.evictable_slots) == (0, 8)
    step = s.schedule(1.0)
    assert [(q.spec.id, n) for q, n in step.work] == [(0, 1)]
    assert (alloc.free_slots, alloc.evictable_slots) == (8, 0)
