"""SGLang's HiCache: the radix tree over a GPU and a host pool (write policies, GPU and
host eviction, loads), the allocator that loads host hits at admission, and runs."""

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario
from kvsim.kvcache import SeqShape
from kvsim.kvcache.hiradix import HiCacheSpec, HiRadixCacheAllocator, host_slots
from kvsim.kvcache.host_tree import HostRadixTree
from kvsim.plots.run_figures import figures

from test_prefix_caches import OPS, radix_model, run_ops

A = ((1, 0, 8),)  # 8 tokens of content 1
B = ((2, 0, 6),)
C = ((3, 0, 4),)
D = ((4, 0, 4),)


def node_of(tree, runs):
    return tree.walk(runs, everywhere=True).path[-1]


def test_write_through_copies_at_insert_and_gpu_eviction_demotes_or_deletes():
    t = HostRadixTree(1, host_capacity=12)
    assert t.insert(A)[1] == 0
    assert (t.size, t.host_size, t.written) == (8, 8, 8)
    t.insert(B)  # 8 + 6 > 12, and no host-only leaf to evict: no copy
    assert t.host_size == 8 and not node_of(t, B).host
    assert t.evict(6) == 8  # the least recent GPU leaf, A, has a copy: demoted
    assert t.size == 6 and t.walk(A).matched == 0 and t.host_match(A)[1] == 8
    assert t.evict(6) == 6  # B has none: deleted
    assert t.size == 0 and t.host_match(B)[0].matched == 0
    t.check({})
    match, host = t.host_match(A)
    assert t.load(match) == 8 and (t.size, t.evictable, t.loaded, t.host_size) == (8, 8, 8, 8)
    assert node_of(t, A).gpu and node_of(t, A).host  # it keeps its copy
    t.check({})


def test_host_eviction_takes_host_only_leaves_least_recent_first():
    t = HostRadixTree(1, host_capacity=12)
    t.insert(A)
    t.evict(8)  # A host-only
    t.insert(C)  # copied: the pool is full (8 + 4)
    t.insert(D)  # 4 more: A, the only host-only leaf, goes (C is on the GPU)
    assert t.host_size == 8 and t.host_match(A)[0].matched == 0
    assert node_of(t, C).host and node_of(t, D).host
    t.check({})


def test_write_through_selective_copies_at_the_second_insert_of_another_request():
    t = HostRadixTree(1, 100, "write_through_selective")
    t.insert(A)
    t.insert(A, inserted=8)  # the same request again: no new hit
    assert t.host_size == 0
    t.insert(A)  # another request walks it: the second hit
    assert t.host_size == 8 and t.written == 8


def test_write_back_copies_at_eviction():
    t = HostRadixTree(1, 100, "write_back")
    t.insert(A)
    assert t.host_size == 0
    assert t.evict(8) == 8
    assert (t.size, t.host_size, t.written) == (0, 8, 8) and t.host_match(A)[1] == 8


def test_an_insert_through_a_host_only_node_splits_it_and_brings_its_head_back():
    t = HostRadixTree(1, 100)
    t.insert(A)
    t.evict(8)
    node, known = t.insert(((1, 0, 4), (5, 0, 4)))
    assert known == 0  # the head was host-only: the sequence's copy is its GPU copy
    assert t.size == 8 and t.host_size == 12
    assert t.walk(A).matched == 4 and t.host_match(A)[1] == 4
    t.check({})


def test_host_pool_sizes_as_sglang_sizes_it():
    assert host_slots(1000, 1, 100.0, 0, None) == 2001  # 2.0 x the GPU pool, plus a page
    assert host_slots(1024, 16, 100.0, 0, 1.5) == 97 * 16  # 1,536 tokens: 96 pages + 1
    assert host_slots(1024, 16, 100.0, 1e6, 1.5) == 626 * 16  # bytes win: 10,000 tokens


def cache(capacity=32, host=64):
    return HiRadixCacheAllocator(capacity, 1, HiCacheSpec(host, "write_through", 1e9), 1000.0)


def stored_then_evicted(alloc, shape):
    """`shape`'s prompt enters the tree (and the host pool); a unique request then takes
    the whole GPU pool, so it is evicted to host."""
    assert alloc.allocate(0, shape, shape.prompt_tokens)
    alloc.free(0)
    assert alloc.allocate(1, SeqShape(alloc.capacity, 0, (), -1), alloc.capacity)
    alloc.free(1)
    alloc.check_invariants()


def test_a_host_hit_is_loaded_at_admission_and_the_step_waits_for_it():
    alloc = cache()
    a = SeqShape(24, 2, ((1, 24),), 7)
    stored_then_evicted(alloc, a)
    assert alloc.store.written == 24 and alloc.tier_occupancy() == (24, 0)
    assert alloc.match_prefix(a, 24) == 23  # all but the last token, from host
    assert alloc.allocate(2, a, 24)
    assert alloc.take_load_s() == pytest.approx(23 * 1000 / 1e9) and alloc.take_load_s() == 0
    assert alloc.tier_hit_tokens == [23] and alloc.store.read == 23
    assert alloc.free_slots == 32 - 24  # 23 loaded into the tree, 1 computed
    alloc.check_invariants()


@pytest.mark.parametrize("shared, loaded", [(9, 0), (10, 10)])
def test_a_host_hit_under_ten_tokens_is_computed_again(shared, loaded):
    alloc = cache()
    stored_then_evicted(alloc, SeqShape(24, 2, ((1, 24),), 7))
    b = SeqShape(shared + 3, 0, ((1, shared),), 8)
    assert alloc.match_prefix(b, b.prompt_tokens) == loaded
    assert alloc.allocate(3, b, b.prompt_tokens)
    assert alloc.tier_hit_tokens == [loaded]
    alloc.check_invariants()


def test_an_admission_that_does_not_fit_loads_nothing():
    alloc = cache()
    a = SeqShape(24, 2, ((1, 24),), 7)
    stored_then_evicted(alloc, a)
    assert alloc.allocate(4, SeqShape(20, 0, (), -1), 20)  # 12 slots left
    assert not alloc.allocate(2, a, 24, keep_free=12)
    assert alloc.tier_hit_tokens == [0] and alloc.take_load_s() == 0
    alloc.check_invariants()


@pytest.mark.parametrize("page, policy", [(1, "write_through"), (4, "write_back"), (1, "write_through_selective")])
@settings(max_examples=100, deadline=None)
@given(pages=st.integers(20, 60), host=st.integers(0, 80), ops=OPS)
def test_random_operations_keep_every_invariant(page, policy, pages, host, ops):
    spec = HiCacheSpec(host // page * page, policy, 1e9)
    run_ops(HiRadixCacheAllocator(pages // page * page, page, spec, 100.0), ops)


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=50, deadline=None)
@given(ops=OPS)
def test_without_eviction_lookups_are_the_radix_caches(page, ops):
    spec = HiCacheSpec(64, "write_through", 1e9)
    run_ops(HiRadixCacheAllocator(5000 // page * page, page, spec, 100.0), ops, radix_model(page))


# -- runs -------------------------------------------------------------------------------

RADIX = {"name": "radix", "allocator": "paged"}
BASE = {
    "name": "hicache",
    "seed": 5,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 0.25,
    "max_model_len": 2048,
    "cost_model": "calibrated",
    "engine": "sglang",
    "workload": {
        "num_requests": 80,
        "arrival": {"process": "poisson", "rate_per_s": 8.0},
        "rag": {
            "system_tokens": 64,
            "corpus_docs": 60,
            "doc_tokens": 400,
            "docs_per_request": 2,
            "popularity": "zipf",
            "zipf_s": 1.2,
        },
        "prompt_tokens": {"dist": "lognormal", "mean": 60, "cv": 0.5, "min": 8, "max": 200},
        "output_tokens": {"dist": "lognormal", "mean": 40, "cv": 0.6, "min": 2, "max": 120},
    },
    "policies": [RADIX],
}


def scenario(policies) -> dict:
    return {**copy.deepcopy(BASE), "policies": policies}


def test_a_host_pool_gives_back_what_the_gpu_evicted():
    doc = scenario(
        [
            RADIX,
            {**RADIX, "name": "hicache", "kv_offload": {"cpu_gib": 1.0}},
            {**RADIX, "name": "ratio", "kv_offload": {"hicache_ratio": 2.0, "write_policy": "write_back"}},
        ]
    )
    r = run_scenario(validate_scenario(doc, "hicache"), Path("."), "hicache", check_invariants=True)
    s = r.summary.set_index("policy")
    plain, hi, ratio = s.loc["radix"], s.loc["hicache"], s.loc["ratio"]
    assert plain.prefix_hit_rate_cpu == 0 and hi.prefix_hit_rate > plain.prefix_hit_rate
    assert hi.prefix_hit_rate_cpu > 0.05 and hi.tier_cpu_read_gib > 0 and hi.tier_load_s > 0
    assert hi.kv_offload_policy == "write_through" and ratio.kv_offload_policy == "write_back"
    # 2.0 x the pool's 2,048 token slots (0.25 GiB), plus one page of one token
    assert ratio.kv_offload_cpu_gib == 4097 * 131072 / 2**30
    for row in (hi, ratio):
        parts = row.prefix_hit_rate_gpu + row.prefix_hit_rate_cpu + row.prefix_hit_rate_disk
        assert parts == pytest.approx(row.prefix_hit_rate, abs=1e-9)
        assert 0 < row.tier_cpu_occupancy <= 1 and row.tier_disk_occupancy == 0
    assert r.timeseries[r.timeseries.policy == "hicache"].tier_cpu_occupancy.max() <= 1
    # the hits-by-tier figure stacks, per policy, the GPU's share, then host memory's, then disk's
    bars = figures(r.summary, r.timeseries, r.requests)["prefix_hits_by_tier.png"].axes[0].patches
    heights = [bar.get_height() for bar in bars]
    for k, tier in enumerate(("gpu", "cpu", "disk")):
        assert heights[3 * k : 3 * k + 3] == pytest.approx(list(100 * s[f"prefix_hit_rate_{tier}"]))
