"""The three engines' rules on small request streams, step by step.

Every step takes one second (OneSecondSteps), so each instant below is derived by hand
from the engines' documented rules (kvsim/engines/*.py cite the code they follow). KV is
counted as each engine allocates: under vLLM V0 a request holds prompt + 1 slots right
after its prefill (kvsim gives the sampled token its slot one step early), under V1 and
SGLang its prompt; then one more per decode step.
"""

import math

import pytest

from kvsim.kvcache import ContiguousAllocator, PagedAllocator, SeqShape
from kvsim.sim.loop import simulate
from kvsim.engines import SGLang
from kvsim.analysis.metrics import request_table, summarize
from kvsim.engines.base import LIMITS, Request, Step
from kvsim.sim.scheduler import Scheduler
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps
from test_engine import make_requests, timeline

ENGINES = ("vllm-v0", "vllm-v1", "sglang")


def run(engine, requests, allocator, *, budget=64, max_num_seqs=256, chunked=None, cost=None, **options):
    chunked = engine != "vllm-v0" if chunked is None else chunked
    return simulate(
        "p",
        requests,
        allocator,
        cost or OneSecondSteps(),
        engine=engine,
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        check_invariants=True,
        **options,
    )


def limits(result):
    return [LIMITS[int(row[-1])] for row in result.steps]


# --- prefill and decode: phases (V0, SGLang) or one mixed budget (V1) ---------------------
@pytest.mark.parametrize(
    "engine, expected",
    [
        # V0 and SGLang: r1's prefill at t=1 is a step of its own, so r0 does not decode in it
        ("vllm-v0", [(0, 0.0, 1.0, 4.0, 0, "completed"), (1, 1.0, 2.0, 4.0, 0, "completed")]),
        ("sglang", [(0, 0.0, 1.0, 4.0, 0, "completed"), (1, 1.0, 2.0, 4.0, 0, "completed")]),
        # V1: r0's decode and r1's prefill share the step at t=1
        ("vllm-v1", [(0, 0.0, 1.0, 3.0, 0, "completed"), (1, 1.0, 2.0, 4.0, 0, "completed")]),
    ],
)
def test_a_prefill_is_its_own_step_in_v0_and_sglang_and_shares_one_in_v1(engine, expected):
    cost = OneSecondSteps()
    result = run(engine, make_requests((0.0, 4, 3), (0.5, 4, 3)), PagedAllocator(100, 4), cost=cost)
    assert timeline(result) == expected
    if engine == "vllm-v1":
        assert [b.new_tokens for b in cost.batches] == [4, 5, 2, 1]
    else:
        assert [b.new_tokens for b in cost.batches] == [4, 4, 2, 2]


@pytest.mark.parametrize("engine, first_token", [("vllm-v0", 2.0), ("sglang", 2.0), ("vllm-v1", 3.0)])
def test_a_60_token_prompt_beside_10_decoding_requests_with_a_budget_of_64(engine, first_token):
    # Ten 4-token prompts fill step [0, 1] (40 tokens). The 60-token prompt arriving at 0.5:
    # V0 runs a prefill step at t=1 whose budget decodes do not touch (60 <= 64), as does
    # SGLang (60 <= its chunk size of 64); V1 shares the budget with the 10 decodes, so
    # it prefills 54 tokens at t=1 and the last 6 at t=2. (Pages of one token: SGLang
    # charges its chunk whole pages, below.)
    reqs = make_requests(*[(0.0, 4, 20)] * 10, (0.5, 60, 2))
    result = run(engine, reqs, PagedAllocator(16000, 1))
    late = result.seqs[10]
    assert (late.admitted_s, late.first_token_s) == (1.0, first_token)


def test_v1_without_chunked_prefill_waits_with_a_prompt_over_the_budget_left():
    # As in vLLM 0.33.0 with chunking off: the 60-token prompt does not fit the 54 tokens
    # the decodes leave, so it waits each step until the decodes are done at t=20.
    reqs = make_requests(*[(0.0, 4, 20)] * 10, (0.5, 60, 2))
    result = run("vllm-v1", reqs, PagedAllocator(1000, 16), chunked=False)
    assert result.seqs[10].admitted_s == 20.0
    assert set(limits(result)[1:20]) == {"token_budget"}


@pytest.mark.parametrize(
    "engine, expected, steps",
    [
        # V0: both prompts in at t=0 (3 blocks each, the sampled token's slot included, fill
        # the 6); at t=4 r0 needs a 4th block and r1, the latest admitted, is preempted and
        # recomputed from its 8 + 4 tokens once r0 has finished at t=8.
        ("vllm-v0", [(0, 0.0, 1.0, 8.0, 0, "completed"), (1, 0.0, 1.0, 12.0, 1, "completed")], 12),
        # V1 (0.33.0) allocates the tokens it computes: 2 blocks each at t=0, the 3rd at t=1
        # (the first sampled token fed back); r0's 13th token wants a 4th block at t=5, so r1
        # goes then, and comes back at t=8 with 8 + 5 tokens to recompute.
        ("vllm-v1", [(0, 0.0, 1.0, 8.0, 0, "completed"), (1, 0.0, 1.0, 11.0, 1, "completed")], 11),
        # SGLang admits r0 (8 + 8 + a page of 4 < 24) but not r1 (20 >= 24 - 20 reserved): it
        # waits for r0 and nothing is ever preempted.
        ("sglang", [(0, 0.0, 1.0, 8.0, 0, "completed"), (1, 8.0, 9.0, 16.0, 0, "completed")], 16),
    ],
)
def test_memory_pressure_preempts_in_vllm_and_is_avoided_by_sglangs_reservation(engine, expected, steps):
    result = run(engine, make_requests((0.0, 8, 8), (0.0, 8, 8)), PagedAllocator(6, 4))
    assert timeline(result) == expected
    assert len(result.steps) == steps


def test_limits_name_what_kept_the_head_out_each_step():
    # V0 case above: r1 waits for memory from t=4 to t=8 (step at t=4 preempted it),
    # then nothing waits.
    result = run("vllm-v0", make_requests((0.0, 8, 8), (0.0, 8, 8)), PagedAllocator(6, 4))
    assert limits(result) == ["arrivals"] * 4 + ["preemption"] + ["memory"] * 3 + ["arrivals"] * 4


def test_v0_counts_every_beam_against_max_num_seqs():
    # beam_width 4 and max_num_seqs 8: two requests (8 sequences) run, the third waits for them
    reqs = make_requests((0.0, 4, 2), (0.0, 4, 2), (0.0, 4, 2))
    result = run("vllm-v0", reqs, PagedAllocator(200, 4), max_num_seqs=8, width=4, beam=True)
    assert [s.admitted_s for s in result.seqs] == [0.0, 0.0, 2.0]
    assert limits(result)[:2] == ["max_num_seqs"] * 2


def test_v0_swaps_a_preempted_group_by_default_and_recomputes_a_single_sequence():
    from kvsim.sim.scheduler import SwapSpace

    swap = SwapSpace(capacity_bytes=1000, bytes_per_token=1.0, bandwidth_bytes_s=1e9)
    # two pairs of samples fill 16 slots by their second decode: the second pair goes to CPU
    groups = run(
        "vllm-v0",
        make_requests((0.0, 4, 6), (0.0, 4, 6)),
        PagedAllocator(16, 1),
        width=2,
        preemption_mode=None,
        swap=swap,
    )
    assert groups.swaps == groups.preemptions >= 1
    assert [s.outcome for s in groups.seqs] == ["completed"] * 2
    # two single sequences outgrow 12 slots at their third decode: r1 is recomputed
    single = run(
        "vllm-v0", make_requests((0.0, 4, 6), (0.0, 4, 6)), PagedAllocator(12, 1), preemption_mode=None, swap=swap
    )
    assert single.preemptions >= 1 and single.swaps == 0


def test_v1_and_sglang_run_samples_as_requests_that_share_the_prompt_through_the_cache():
    from kvsim.kvcache import PrefixCachingPagedAllocator

    reqs = [RequestSpec(0, 0.0, 8, 3)]
    alloc = PrefixCachingPagedAllocator(100, 4)
    result = run("vllm-v1", reqs, alloc, width=3)
    assert len(result.seqs) == 3  # three requests of one sample each
    table = request_table(result)
    assert table[["request_id", "sequences", "outcome"]].values.tolist() == [[0, 3, "completed"]]
    # all three are admitted in step 0; their prompts' two full blocks were not cached yet,
    # so each computed its own; the prompt content is the same (it is a shared segment)
    shapes = {s.shape.segments for s in result.seqs}
    assert shapes == {((0, 8),)}
    row = summarize(result, table)
    assert row["throughput_tok_s"] == pytest.approx(3 * 3 / 3.0)  # 9 tokens, makespan 3 s


def _sglang_running(alloc, rows):
    """A scheduler under SGLang's rules with running requests (prompt, generated) of 100
    output tokens each, holding prompt + generated slots."""
    rules = SGLang()
    s = Scheduler(alloc, rules, max_model_len=200, max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=True)
    for i, (prompt, generated) in enumerate(rows):
        seq = Request(RequestSpec(i, 0.0, prompt, 100), SeqShape(prompt, 100))
        s.arrive(seq, 0.0, i)
        assert s.admit(seq, 0, prompt, prompt + generated, Step(), 0.0)
        seq.prefilled, seq.generated, seq.held = prompt, generated, prompt + generated
    return s, rules


def test_sglang_retracts_fewest_outputs_first_until_the_next_decode_fits():
    # A (prompt 2 + 3 generated), B (3 + 1) and C (2 + 1) and 288 slots held outside the
    # scheduler fill a pool of 300. The next decode needs 3 slots: retract B (1 output, the
    # longer prompt); then 4 slots are free and A and C need 2, so C stays. The ratio
    # becomes (3 + 1 decoded + 20 x 2) / (100 + 100 + 1).
    alloc = PagedAllocator(300, 1)
    assert alloc.allocate(999, SeqShape(288, 0), 288)
    s, rules = _sglang_running(alloc, [(2, 3), (3, 1), (2, 1)])
    step = s.schedule(1.0)
    assert [q.spec.id for q in s.waiting] == [1]
    assert [(q.spec.id, n) for q, n in step.work] == [(0, 1), (2, 1)]
    assert rules.ratio == pytest.approx(44 / 201)
    assert step.limit == "preemption"


def test_sglang_retracts_at_least_one_and_keeps_at_least_one():
    # 296 slots held outside: A (2 + 3) alone would fit the next decode (4 free after B
    # goes), but one request is retracted even so; with only A and B, B goes and A stays.
    alloc = PagedAllocator(300, 1)
    assert alloc.allocate(999, SeqShape(291, 0), 291)
    s, rules = _sglang_running(alloc, [(2, 3), (3, 1)])  # 291 + 5 + 4 = 300
    step = s.schedule(1.0)
    assert [q.spec.id for q in s.waiting] == [1]
    assert [(q.spec.id, n) for q, n in step.work] == [(0, 1)]
    assert rules.ratio == pytest.approx((3 + 20) / 101)


def test_sglang_ratio_decays_per_decode_step_to_its_floor():
    rules = SGLang()
    assert (rules.ratio, rules.min_ratio) == (0.7, pytest.approx(0.098))
    assert rules.decay == pytest.approx((0.7 - 0.098) / 600)


# --- the memory breakdown: what the head needs this step, after the watermark --------------
def test_free_blocks_are_external_only_when_the_heads_chunk_cannot_use_them():
    alloc = PagedAllocator(8, 4)
    assert alloc.allocate(0, SeqShape(20, 0), 20)  # 5 blocks; 3 free (12 slots)
    head = SeqShape(40, 4)
    whole, chunk = alloc.breakdown((head, 41, 0)), alloc.breakdown((head, 8, 0))
    assert (whole.unusable, whole.free, whole.starved) == (12, 0, True)
    assert (chunk.unusable, chunk.free, chunk.starved) == (0, 12, False)
    # a watermark of 8 slots (2 blocks) leaves 1 block: the 8-token chunk no longer fits
    assert alloc.breakdown((head, 8, 8)).starved


def test_a_chunked_run_records_the_heads_chunk_not_its_whole_prompt():
    # r1 (a 40-token prompt) waits for max_num_seqs while r0 holds at most 8 of 12 blocks.
    # Chunked to the budget of 8 it would need 2 blocks: the free ones are free. Whole, it
    # needs 11 blocks, so every free block is external fragmentation.
    reqs = make_requests((0.0, 19, 12), (0.5, 40, 2))
    chunked = run("vllm-v1", reqs, PagedAllocator(12, 4), budget=8, max_num_seqs=1)
    whole = run("vllm-v1", reqs, PagedAllocator(12, 4), budget=64, max_num_seqs=1, chunked=False)
    for result in (chunked, whole):  # r0's own chunks may spend the budget first
        waiting = [row for row in result.steps if row[3] > 0]
        assert waiting and {LIMITS[int(row[-1])] for row in waiting} <= {"max_num_seqs", "token_budget"}
    assert all(row[9] == 0 and row[10] > 0 for row in chunked.steps if row[3] > 0)
    assert all(row[9] > 0 and row[10] == 0 for row in whole.steps if row[3] > 0)


# --- engine settings and what each engine refuses -----------------------------------------
def scenario(**extra):
    from kvsim.config.scenario import validate_scenario

    base = dict(
        name="s",
        model="llama-3-8b",
        gpu="a100-80gb",
        max_model_len=4096,
        workload=dict(
            num_requests=4,
            arrival=dict(process="poisson", rate_per_s=1.0),
            prompt_tokens=dict(dist="fixed", value=100),
            output_tokens=dict(dist="fixed", value=10),
        ),
        policies=[dict(name="p", allocator="paged")],
    )
    for key, value in extra.items():
        if key in base and isinstance(value, dict) and isinstance(base[key], dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return validate_scenario(base, "s.yaml")


@pytest.mark.parametrize(
    "engine, seqs, budget, chunked, preemption, watermark",
    [
        ("vllm-v0", 256, 4096, False, None, 0.01),  # max(max_model_len, 2048)
        ("vllm-v1", 256, 2048, True, "recompute", 0.0),  # an A100: the smaller V1 defaults
        ("sglang", 2048, 8192, True, "recompute", 0.0),  # 80 GiB: chunked_prefill_size 8192
    ],
)
def test_unset_settings_take_the_engines_defaults(engine, seqs, budget, chunked, preemption, watermark):
    s = scenario(engine=engine).engine_settings()
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill) == (seqs, budget, chunked)
    assert (s.preemption_mode, s.watermark) == (preemption, watermark)


def test_sglang_max_running_requests_follows_the_pool():
    # min(pool / 2, clamp(pool / max_model_len x 512, 2048, 4096)): 100,000 tokens -> 4096 cap
    assert scenario(engine="sglang").engine_settings(100_000).max_num_seqs == 4096
    assert scenario(engine="sglang").engine_settings(3_000).max_num_seqs == 1500


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"engine": "vllm-v1", "workload": {"beam_width": 2}}, "workload.beam_width", "use engine: vllm-v0"),
        ({"engine": "sglang", "scheduler": {"preemption_mode": "swap"}}, "scheduler.preemption_mode", "recompute only"),
        ({"engine": "vllm-v1", "scheduler": {"watermark": 0.1}}, "scheduler.watermark", "no watermark"),
        ({"engine": "vllm-v1", "scheduler": {"schedule_policy": "lpm"}}, "scheduler.schedule_policy", "SGLang"),
        ({"engine": "sglang", "scheduler": {"async_scheduling": True}}, "scheduler.async_scheduling", "vllm-v1's"),
        ({"engine": "vllm-v0", "scheduler": {"engine": "sglang"}}, "engine", "give it once"),
        (
            {"engine": "vllm-v0", "workload": {"n": 4}, "scheduler": {"max_num_seqs": 2}},
            "scheduler.max_num_seqs",
            "counts every sample or beam",
        ),
    ],
)
def test_what_an_engine_cannot_run_is_an_input_error(extra, field, words):
    from kvsim.config.errors import InputError

    with pytest.raises(InputError) as info:
        scenario(**extra)
    assert f": {field}: " in str(info.value) and words in str(info.value)


def test_prefix_caching_defaults_follow_the_engine():
    from kvsim.config.scenario import Paged

    p = Paged(name="p", allocator="paged")
    assert p.allocator_kind("vllm-v0") == ("paged", {"block_size": 16})
    assert p.allocator_kind("vllm-v1") == ("paged", {"block_size": 16, "prefix_caching": True})
    assert p.allocator_kind("sglang") == ("radix", {})  # SGLang's page size 1
    paged = Paged(name="p", allocator="paged", block_size=32)
    assert paged.allocator_kind("sglang") == ("radix", {"page_size": 32})  # a block_size given is its page
    off = Paged(name="p", allocator="paged", enable_prefix_caching=False)
    assert all(off.allocator_kind(e) == ("paged", {"block_size": 16}) for e in ENGINES)


def test_contiguous_runs_under_every_engine_and_never_preempts():
    for engine in ENGINES:
        result = run(
            engine, make_requests(*[(0.1 * i, 6, 4) for i in range(6)]), ContiguousAllocator(40, 16, "max", "first-fit")
        )
        assert all(s.outcome == "completed" for s in result.seqs) and result.preemptions == 0
        assert not math.isnan(result.seqs[-1].finish_s)


@pytest.mark.parametrize("policy, admitted", [("fcfs", [0.0, 1.0, 5.0]), ("lpm", [0.0, 5.0, 1.0])])
def test_sglang_lpm_admits_the_longest_cached_prefix_first(policy, admitted):
    # r0 leaves its 20 prompt tokens (16 of them shared content 100) in a 30-slot radix
    # tree at t=1. Then r1 (a prompt of its own) and r2 (the same 16 shared tokens first)
    # wait. fcfs takes r1: 20 + 4 + 1 page < 30, and its allocation evicts r0's leaf, so r2
    # (4 + 4 + 1 >= 30 - 25 reserved) waits for r1 to finish at t=5. lpm takes r2 (16
    # tokens cached and locked: 9 < 30 - 16); r1 (25 >= 14 - 9) waits until t=5.
    from kvsim.kvcache import RadixCacheAllocator

    shared = ((100, 16),)
    reqs = [RequestSpec(0, 0.0, 20, 1, shared), RequestSpec(1, 0.5, 20, 4), RequestSpec(2, 0.5, 20, 4, shared)]
    result = run("sglang", reqs, RadixCacheAllocator(30), schedule_policy=policy)
    assert [s.admitted_s for s in result.seqs] == admitted
