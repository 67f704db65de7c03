"""`engine: trtllm`: TensorRT-LLM's block manager and schedulers on hand-made cases.

Every expected value below was derived by hand from the TensorRT-LLM sources that
kvsim/kvcache/trtllm.py and kvsim/engines/trtllm.py cite (kvCacheManager.cpp,
evictionPolicy.cpp, capacityScheduler.cpp, microBatchScheduler.cpp): block ids, the
free queues' order, what is offloaded and onboarded, and which request is admitted,
deferred or paused when. A step of the engine tests takes one second plus the KV
transfers it waits for.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.engines.trtllm import GUARANTEED_NO_EVICT, MAX_UTILIZATION, chunk_after_reuse, fcfs_chunk
from kvsim.kvcache import SeqShape
from kvsim.kvcache.trtllm import TrtllmBlockManager
from kvsim.kvcache.trtllm_tree import Match
from kvsim.kvcache.trtllm_host import TrtllmHostPoolManager
from kvsim.kvcache.trtllm_eviction import SECONDARY
from kvsim.sim.loop import simulate
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps
from test_engine import timeline

S = 7  # a shared content id


def shape(prompt, output=1, shared=0, tail=100):
    """`shared` leading tokens of content S, the rest (and the output) content `tail`."""
    return SeqShape(prompt, output, ((S, shared),) if shared else (), tail)


# --- the block manager -------------------------------------------------------------
def test_full_blocks_are_reused_once_stored_and_a_stored_partial_block_is_taken_over():
    a = TrtllmBlockManager(8, 4)
    first = shape(10, 2, shared=10, tail=100)
    assert a.allocate(1, first, 10) and a.block_table(1) == [0, 1, 2]
    second = shape(12, 2, shared=10, tail=101)
    assert a.match_prefix(second, 12) == 0  # nothing is stored before the context has run
    a.store_context_blocks(1)  # its full blocks: [0, 4) and [4, 8)
    assert a.match_prefix(second, 12) == 8  # [8, 11) differs from what block 2 will hold
    assert a.allocate(2, second, 12) and a.block_table(2) == [0, 1, 3]
    assert (a.ref[0], a.ref[1]) == (2, 2)
    a.free(1)  # stores block 2 as the partial block (S, 8, 2); released deepest first
    assert a.free_blocks() == [4, 5, 6, 7, 2]
    third = shape(11, 1, shared=10, tail=102)
    # at most 10 tokens: two full blocks and an exact match of the stored partial block
    assert a.lookup(third, 11) == [Match(0, 4, False), Match(1, 4, False), Match(2, 2, True)]
    assert a.allocate(3, third, 11) and a.block_table(3) == [0, 1, 2]
    assert a.free_blocks() == [4, 5, 6, 7] and 2 not in a.tree  # free leaf: now its own
    a.check_invariants()


def test_a_partial_match_on_a_block_in_use_is_copied_into_a_new_block():
    a = TrtllmBlockManager(8, 4)
    running = shape(8, 4, shared=8)
    assert a.allocate(1, running, 8) and a.grow(1, 10) and a.block_table(1) == [0, 1, 2]
    a.store_context_blocks(1)
    newcomer = shape(7, 1, shared=6, tail=101)  # shares block 0 and 2 tokens of block 1
    assert a.lookup(newcomer, 7) == [Match(0, 4, False), Match(1, 2, True)]
    assert a.allocate(2, newcomer, 7) and a.block_table(2) == [0, 3]
    assert (a.ref[0], a.ref[1], a.ref[3]) == (2, 1, 1)
    a.check_invariants()


def test_evicted_blocks_go_to_the_host_pool_and_come_back_on_a_hit():
    # 4 GPU blocks (0-3) and 2 host blocks (4, 5); a block's bytes cross the link in 0.5 s
    a = TrtllmBlockManager(4, 4, secondary_blocks=2, block_bytes=1.0, link_bytes_s=2.0)
    prompt = shape(8, 1, shared=8)
    assert a.allocate(1, prompt, 8) and a.block_table(1) == [0, 1]
    a.free(1)  # stored: 0 = (S, 0, 4), 1 = (S, 4, 4) under it
    assert a.free_blocks() == [2, 3, 1, 0]
    # 2 and 3 hold nothing; 1 and 0 hold content of the default priority (35 >= 30) and
    # the host pool has room: each moves there and the freed host block is handed out
    assert a.allocate(2, shape(16, 1, tail=101), 16) and a.block_table(2) == [2, 3, 4, 5]
    assert (a.level[0], a.level[1], a.level[4], a.level[5]) == (SECONDARY, SECONDARY, 0, 0)
    assert a.free_blocks(SECONDARY) == [1, 0] and a.host_held == 2
    assert a.take_transfer_s() == 1.0  # two offloads, no onboard
    a.free(2)
    assert a.free_blocks() == [5, 4, 3, 2]
    again = shape(8, 1, shared=8, tail=102)
    assert a.lookup(again, 8) == [Match(0, 4, False), Match(1, 3, True)]
    assert a.allocate(3, again, 8) and a.block_table(3) == [0, 5]
    # the blocks are taken one by one: onboarding block 0 takes GPU block 5, whose
    # content moves to the host pool's only free block, 1, dropping what 1 held, the
    # next block this prompt matched; so 4 tokens are reused, not 7, and the second
    # block is a new one: GPU block 4, whose content moves into host block 5 first
    assert a.reused_tokens(3) == 4 and a.host_hit_tokens == 4
    assert (a.level[0], a.level[1]) == (0, SECONDARY)
    assert a.free_blocks() == [3, 2] and a.free_blocks(SECONDARY) == [1, 4]
    assert a.host_held == 1
    assert a.take_transfer_s() == 1.0  # max(2 offloads, 1 onboard) blocks
    assert a.match_prefix(shape(16, 1, tail=101), 16) == 12  # 2, 3, then 4 from the host
    a.check_invariants()


def test_the_reuse_a_request_skips_is_what_taking_its_blocks_gave():
    """load_prefix takes the matched blocks (as addSequence does before the scheduler
    knows the prepopulated length), allocate adds the rest; a refusal gives them back."""
    a = TrtllmBlockManager(4, 4, secondary_blocks=2, block_bytes=1.0)
    assert a.allocate(1, shape(8, 1, shared=8), 8)
    a.free(1)
    assert a.allocate(2, shape(16, 1, tail=101), 16)
    a.free(2)
    again = shape(8, 1, shared=8, tail=102)
    assert a.match_prefix(again, 8) == 7  # what the lookup finds
    assert a.load_prefix(3, again, 8) == 4  # what taking block 0 leaves of it
    assert a.allocate(3, again, 8) and a.reused_tokens(3) == 4 and a.tokens_of(3) == 8
    a.free(3)
    assert a.load_prefix(4, shape(20, 1, shared=8, tail=103), 20) is None  # 5 blocks of 4
    # a refusal after the load (the watermark): the loaded blocks go back to the queues
    assert a.load_prefix(4, again, 8) == 7
    assert not a.allocate(4, again, 8, keep_free=16) and a.tokens_of(4) is None
    assert a.free_queues.free_count(0) == 4
    a.check_invariants()


def test_lower_priority_blocks_go_first_and_below_the_offload_priority_are_dropped():
    a = TrtllmBlockManager(4, 4, secondary_blocks=2, block_bytes=1.0, link_bytes_s=1.0)
    a.retention_priority = 20  # below secondary_offload_min_priority (30)
    assert a.allocate(1, shape(8, 1, shared=8), 8)
    a.free(1)
    a.retention_priority = 35
    # the free queue of priority 20 (blocks 1, 0) comes before the default's (2, 3)
    assert a.free_blocks() == [1, 0, 2, 3]
    assert a.allocate(2, shape(8, 1, tail=101), 8) and a.block_table(2) == [1, 0]
    assert a.offloaded_bytes == 0 and a.host_held == 0
    assert a.match_prefix(shape(8, 1, shared=8, tail=102), 8) == 0
    a.check_invariants()


def test_the_first_block_not_stored_names_where_it_would_hang():
    a = TrtllmBlockManager(8, 4)
    assert a.allocate(1, shape(8, 1, shared=8), 8)
    other = shape(9, 1, shared=8, tail=101)
    assert a.new_context_block(other, 9) == (-1, ((S, 0, 4),))
    a.store_context_blocks(1)
    assert a.new_context_block(other, 9) is None  # its two full blocks are stored
    assert a.new_context_block(shape(12, 1, shared=8, tail=101), 12) == (1, ((101, 0, 4),))


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("allocate"),
            st.integers(0, 4),
            st.integers(1, 20),
            st.integers(0, 12),
            st.sampled_from([0, 4, 6, 12]),
        ),
        st.tuples(st.just("grow"), st.integers(0, 4), st.integers(1, 9)),
        st.tuples(st.just("store"), st.integers(0, 4)),
        st.tuples(st.just("free"), st.integers(0, 4)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, host=st.sampled_from([0, 3]), partial=st.booleans(), copy=st.booleans())
def test_random_operations_keep_the_block_managers_invariants(ops, host, partial, copy):
    """Allocation, growth, storing and freeing in any order: every block is in one place,
    the pools keep their sizes, a hit returns what some pool holds, transfers add up."""
    cls = TrtllmHostPoolManager if host else TrtllmBlockManager
    a = cls(
        6,
        4,
        secondary_blocks=host,
        block_bytes=1.0,
        link_bytes_s=1.0,
        partial_reuse=partial,
        copy_on_partial_reuse=copy,
    )
    held = {}
    for op, sid, *args in ops:
        if op == "allocate" and sid not in held:
            rest, output, shared = args
            s = shape(shared + rest, output, shared=shared, tail=100 + sid)
            expected = a.match_prefix(s, s.prompt_tokens)
            if a.allocate(sid, s, s.prompt_tokens):
                held[sid] = s.prompt_tokens
                assert sum(m.tokens for m in a.lookup(s, s.prompt_tokens)) <= s.prompt_tokens - 1
                assert expected < s.prompt_tokens or expected == 0
        elif op == "grow" and sid in held:
            if a.grow(sid, held[sid] + args[0]):
                held[sid] += args[0]
        elif op == "store" and sid in held:
            a.store_context_blocks(sid)
        elif op == "free" and sid in held:
            a.free(sid)
            del held[sid]
        a.check_invariants()
    if host:
        assert a.store.tiers[0].written >= a.host_held
    for sid in list(held):
        a.free(sid)
    a.check_invariants()
    assert a.breakdown(None).free == a.capacity


# --- the schedulers ------------------------------------------------------------------
def run(requests, alloc, *, policy=GUARANTEED_NO_EVICT, budget=64, chunked=False, cost=None):
    return simulate(
        "p",
        requests,
        alloc,
        cost or OneSecondSteps(),
        engine="trtllm",
        max_model_len=64,
        max_num_seqs=2048,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        schedule_policy=policy,
        check_invariants=True,
    )


def req(i, arrival, prompt, output, shared=0):
    return RequestSpec(i, arrival, prompt, output, ((S, shared),) if shared else ())


def test_guaranteed_no_evict_admits_only_what_can_run_to_the_end():
    # 6 blocks of 4; each request needs 4 blocks for its 8 + 8 tokens: r1 waits for r0
    result = run([req(0, 0.0, 8, 8), req(1, 0.0, 8, 8)], TrtllmBlockManager(6, 4))
    assert timeline(result) == [(0, 0.0, 1.0, 8.0, 0, "completed"), (1, 8.0, 9.0, 16.0, 0, "completed")]


def test_max_utilization_admits_both_and_pauses_the_last_started():
    # both prompts fit (2 blocks each); at t=5 r0's 13th token needs a 4th block, none is
    # free: r1 (started last) is paused, its 3 blocks stored and freed, r0 takes the last
    # of them (its content goes); r1 comes back when r0 ends, its prompt and 5 tokens
    # prefilled again with 8 of them reused, and samples its last 3 tokens
    result = run([req(0, 0.0, 8, 8), req(1, 0.0, 8, 8)], TrtllmBlockManager(6, 4), policy=MAX_UTILIZATION)
    assert timeline(result) == [(0, 0.0, 1.0, 8.0, 0, "completed"), (1, 0.0, 1.0, 11.0, 1, "completed")]
    assert result.cached_tokens == 8


def test_a_request_waits_one_step_to_reuse_the_block_an_earlier_admission_computes():
    # identical prompts at once: r1's first block is the one r0 will store, so r1 is
    # skipped; a step later it reuses block 0 and 3 tokens of block 1 (copied: r0 holds it)
    result = run([req(0, 0.0, 8, 2, shared=8), req(1, 0.0, 8, 2, shared=8)], TrtllmBlockManager(16, 4))
    assert timeline(result) == [(0, 0.0, 1.0, 2.0, 0, "completed"), (1, 1.0, 2.0, 3.0, 0, "completed")]
    assert result.cached_tokens == 7


def test_the_token_budget_counts_a_prompt_whole_though_the_cache_holds_most_of_it():
    # max_num_tokens 8: while r0 decodes (1 token) the 8-token prompt of r1 does not fit,
    # though r1 computes 1 token of it once admitted
    result = run([req(0, 0.0, 8, 4, shared=8), req(1, 1.5, 8, 2, shared=8)], TrtllmBlockManager(16, 4), budget=8)
    assert timeline(result) == [(0, 0.0, 1.0, 4.0, 0, "completed"), (1, 4.0, 5.0, 6.0, 0, "completed")]
    assert result.cached_tokens == 7


def test_chunked_context_cuts_a_prompt_to_whole_blocks():
    cost = OneSecondSteps()
    result = run([req(0, 0.0, 20, 1)], TrtllmBlockManager(16, 4), budget=10, chunked=True, cost=cost)
    assert timeline(result) == [(0, 0.0, 3.0, 3.0, 0, "completed")]
    assert [b.prefills for b in cost.batches] == [((8, 0),), ((8, 8),), ((4, 16),)]


def test_a_step_waits_for_the_host_pools_transfers():
    # 4 GPU and 4 host blocks, 0.5 s a block: r1's 4 blocks offload r0's 2 (1 s more);
    # r2 onboards them and offloads 2 of r1's (max(2, 2) blocks: 1 s more)
    alloc = TrtllmHostPoolManager(4, 4, secondary_blocks=4, block_bytes=1.0, link_bytes_s=2.0)
    result = run([req(0, 0.0, 8, 1, shared=8), req(1, 1.0, 15, 1), req(2, 3.0, 8, 1, shared=8)], alloc)
    assert timeline(result) == [
        (0, 0.0, 1.0, 1.0, 0, "completed"),
        (1, 1.0, 3.0, 3.0, 0, "completed"),
        (2, 3.0, 5.0, 5.0, 0, "completed"),
    ]
    assert result.cached_tokens == 7
    assert result.tiers["hit_tokens_cpu"] == 7 and result.tiers["load_s"] == 2.0
    assert result.tiers["written_bytes_cpu"] == 4.0 and result.tiers["read_bytes_cpu"] == 2.0


@pytest.mark.parametrize("remaining, budget, expected", [(20, 10, 8), (4, 10, 4), (10, 10, 10), (9, 3, 0)])
def test_first_come_first_served_chunks(remaining, budget, expected):
    assert fcfs_chunk(remaining, budget, 4) == expected


@pytest.mark.parametrize("cached, chunk, expected", [(7, 8, 5), (8, 8, 8), (6, 4, 2), (0, 20, 20), (5, 2, 2)])
def test_a_chunk_after_reused_tokens_ends_on_a_block_boundary(cached, chunk, expected):
    assert chunk_after_reuse(cached, chunk, 20, 4) == expected


# --- scenarios: settings, the pool, bad input, whole runs ------------------------------
def scenario(**extra):
    from kvsim.config.scenario import validate_scenario

    base = dict(
        name="s",
        model="llama-3-8b",
        gpu="h100-80gb",
        max_model_len=4096,
        engine="trtllm",
        workload=dict(
            num_requests=4,
            arrival=dict(process="poisson", rate_per_s=1.0),
            prompt_tokens=dict(dist="fixed", value=100),
            output_tokens=dict(dist="fixed", value=10),
        ),
        policies=[dict(name="p", allocator="paged")],
    )
    base.update(extra)
    return validate_scenario(base, "s.yaml")


def test_unset_settings_take_tensorrt_llms_defaults():
    s = scenario().engine_settings()
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill) == (2048, 8192, False)
    assert (s.preemption_mode, s.watermark, s.schedule_policy) == ("recompute", 0.0, GUARANTEED_NO_EVICT)
    assert scenario().policies[0].allocator_kind("trtllm") == (
        "trtllm",
        {
            "block_size": 32,
            "prefix_caching": True,
            "partial_reuse": True,
            "copy_on_partial_reuse": True,
            "offload_min_priority": 30,
            "retention_priority": 35,
        },
    )
    chosen = scenario(scheduler={"capacity_scheduler_policy": "MAX_UTILIZATION"}).engine_settings()
    assert chosen.schedule_policy == MAX_UTILIZATION


def test_the_pool_is_a_fraction_of_the_memory_free_after_loading():
    from kvsim.sim.plan import plan_pool

    scn = scenario()
    pool = plan_pool(scn, scn.model_spec(), scn.gpu_spec(), "s.yaml")
    free = pool.gpu_bytes - pool.weight_bytes - pool.non_torch_bytes - pool.activation_bytes
    assert pool.source == "free_gpu_memory_fraction" and pool.per_gpu_bytes == pytest.approx(0.9 * free)
    half = scenario(kv_cache_config={"free_gpu_memory_fraction": 0.45})
    assert plan_pool(half, half.model_spec(), half.gpu_spec(), "s.yaml").per_gpu_bytes == pytest.approx(0.45 * free)


@pytest.mark.parametrize(
    "extra, host_gib",
    [
        ({"policies": [dict(name="p", allocator="paged", kv_offload={"cpu_gib": 2.0})]}, 2.0),
        ({"kv_cache_config": {"host_cache_size": 2**30}}, 1.0),
        (
            {
                "kv_cache_config": {"host_cache_size": 2**30},  # the policy's own wins
                "policies": [dict(name="p", allocator="paged", kv_offload={"cpu_gib": 3.0})],
            },
            3.0,
        ),
    ],
)
def test_the_host_pool_comes_from_the_policy_or_kv_cache_config(extra, host_gib):
    from kvsim.kvcache import make_allocator
    from kvsim.sim.plan import resolve

    plan = resolve(scenario(kv_cache_memory_gib=1.0, **extra), __import__("pathlib").Path("."))
    policy = plan.policies[0]
    assert policy.tiers.cpu_gib == host_gib and policy.options["host_cache_bytes"] == host_gib * 2**30
    alloc = make_allocator(policy.kind, plan.pool.pool_bytes, policy.kv, plan.max_model_len, **policy.options)
    # Llama-3-8B: 128 KiB a token; 1 GiB of GPU pool is 8,192 tokens, 256 blocks of 32
    assert (alloc.num_blocks, alloc.secondary_blocks) == (256, int(host_gib * 256))


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"policies": [dict(name="c", allocator="contiguous")]}, "policies[0].allocator", "paged block manager"),
        (
            {"policies": [dict(name="r", allocator="paged", prefix_cache="radix")]},
            "policies[0].prefix_cache",
            "its own",
        ),
        ({"policies": [dict(name="b", allocator="paged", block_size=24)]}, "policies[0].block_size", "power of two"),
        (
            {"policies": [dict(name="d", allocator="paged", kv_offload={"cpu_gib": 1, "disk_gib": 8})]},
            "policies[0].kv_offload.disk_gib",
            "host pool only",
        ),
        (
            {"policies": [dict(name="s", allocator="paged", kv_offload={"cpu_gib": 1, "shared": True})]},
            "policies[0].kv_offload.shared",
            "give cpu_gib only",
        ),
        ({"gpu_memory_utilization": 0.8}, "gpu_memory_utilization", "free_gpu_memory_fraction"),
        ({"kv_cache_config": {"tokens_per_block": 48}}, "kv_cache_config", "power of two"),
        (
            {"kv_cache_config": {"free_gpu_memory_fraction": 1.0}},
            "kv_cache_config.free_gpu_memory_fraction",
            "less than 1",
        ),
        ({"kv_cache_config": {"host_cache_size": -1}}, "kv_cache_config.host_cache_size", "greater than or equal to 0"),
        (
            {"scheduler": {"capacity_scheduler_policy": "STATIC_BATCH"}},
            "scheduler.capacity_scheduler_policy",
            "'GUARANTEED_NO_EVICT' or 'MAX_UTILIZATION'",
        ),
        ({"engine": "vllm-v1", "kv_cache_config": {}}, "kv_cache_config", "engine: trtllm"),
        (
            {"engine": "sglang", "scheduler": {"capacity_scheduler_policy": "MAX_UTILIZATION"}},
            "scheduler.capacity_scheduler_policy",
            "engine: trtllm",
        ),
    ],
)
def test_what_trtllm_cannot_run_is_an_input_error(extra, field, words):
    from kvsim.config.errors import InputError

    with pytest.raises(InputError) as info:
        scenario(**extra)
    assert f": {field}: " in str(info.value) and words in str(info.value), str(info.value)


def run_doc(policy: str, **changes):
    from pathlib import Path

    from kvsim.analysis.results import run_scenario
    from kvsim.config.scenario import validate_scenario

    doc = dict(
        name="t",
        seed=1,
        model="llama-3-8b",
        gpu="h100-80gb",
        engine="trtllm",
        kv_cache_memory_gib=0.25,
        max_model_len=1024,
        cost_model="calibrated",
        scheduler={"capacity_scheduler_policy": policy},
        workload=dict(
            num_requests=50,
            arrival=dict(process="poisson", rate_per_s=30.0),
            prefix=dict(groups=3, tokens=100),
            prompt_tokens=dict(dist="lognormal", mean=200, cv=0.6, min=8, max=600),
            output_tokens=dict(dist="lognormal", mean=80, cv=0.8, min=1, max=300),
        ),
        policies=[
            dict(name="reuse", allocator="paged", block_size=8),
            dict(name="host", allocator="paged", block_size=8, kv_offload={"cpu_gib": 0.05}),
        ],
    )
    doc.update(changes)
    return lambda **kw: run_scenario(validate_scenario(doc, "t"), Path("."), "t", **kw)


@pytest.mark.parametrize("policy", [GUARANTEED_NO_EVICT, MAX_UTILIZATION])
def test_a_run_keeps_every_invariant_and_the_fast_path_gives_the_plain_paths_tables(policy):
    run = run_doc(policy)
    plain, fast = run(exact_steps=True, check_invariants=True), run()
    for table in ("summary", "timeseries", "requests"):
        assert getattr(plain, table).equals(getattr(fast, table)), table
    s = plain.summary.set_index("policy")
    assert (s.requests_completed == 50).all()
    assert s.loc["host", "prefix_hit_rate_cpu"] > 0 and s.loc["reuse", "prefix_hit_rate_cpu"] == 0
    assert s.loc["host", "prefix_hit_rate"] >= s.loc["reuse", "prefix_hit_rate"]
    if policy == GUARANTEED_NO_EVICT:
        assert (s.preemptions == 0).all()
    else:
        assert (s.preemptions > 0).all()


def test_the_shipped_scenario_runs_and_repeats_byte_for_byte(tmp_path):
    from pathlib import Path

    from helpers import kvsim

    path = Path(__file__).resolve().parents[1] / "scenarios" / "trtllm_host_offload.yaml"
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        code, _, err = kvsim("run", path, "--num-requests", "20", "--policy", "host-16g", "--quiet", "--out", out)
        assert code == 0, err
    assert (outs[0] / "summary.csv").read_bytes() == (outs[1] / "summary.csv").read_bytes()


def test_bad_input_from_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    import yaml

    from helpers import kvsim, one_error_line

    doc = dict(
        name="bad",
        model="llama-3-8b",
        gpu="h100-80gb",
        engine="trtllm",
        workload=dict(
            num_requests=4,
            arrival=dict(process="poisson", rate_per_s=1.0),
            prompt_tokens=dict(dist="fixed", value=100),
            output_tokens=dict(dist="fixed", value=10),
        ),
        policies=[dict(name="c", allocator="contiguous")],
    )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    line = one_error_line(*kvsim("run", path, "--out", tmp_path / "out"))
    assert "policies[0].allocator" in line and not (tmp_path / "out").exists()


def test_a_host_pool_of_no_bytes_is_no_host_pool():
    """kv_offload of 0 GiB or a host_cache_size of 0 give the tables of a policy without one."""
    policies = [dict(name="reuse", allocator="paged", block_size=8), dict(name="host", allocator="paged", block_size=8)]
    plain = run_doc(GUARANTEED_NO_EVICT, policies=policies)()
    policies[1] = {**policies[1], "kv_offload": {"cpu_gib": 0.0}}
    zero = run_doc(GUARANTEED_NO_EVICT, kv_cache_config={"host_cache_size": 0}, policies=policies)()
    for table in ("summary", "timeseries", "requests"):
        assert getattr(plain, table).equals(getattr(zero, table)), table


def test_the_engine_logs_its_pool_as_tensorrt_llm_does():
    from kvsim.model.engine_log import trtllm_lines
    from kvsim.model.memory import PoolSizing
    from kvsim.model.specs import MODEL_PRESETS, KVSpec

    kv = KVSpec(MODEL_PRESETS["llama-3-8b"], "bf16")  # 128 KiB a token
    pool = PoolSizing("trtllm", 0, 0, 0, 0, 2**30 + 5 * 2**17, 1, "free_gpu_memory_fraction")
    # 8,197 tokens: 257 blocks of 32 (rounded up), 8,224 tokens, 1.00 GiB
    assert trtllm_lines(pool, kv, 32) == [
        "Number of tokens per block: 32.",
        "[MemUsageChange] Allocated 1.00 GiB for max tokens in paged KV cache (8224).",
    ]
    code, out, _ = __import__("helpers").kvsim(
        "memory", "--model", "llama-3-8b", "--context", "1000", "--gpu", "h100-80gb", "--engine", "trtllm"
    )
    assert code == 0 and "trtllm (TensorRT-LLM 1.2.0rc2" in out and "for max tokens in paged KV cache" in out
