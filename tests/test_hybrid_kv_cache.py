"""vLLM V1's KV cache groups in a run (kvsim.kvcache.hybrid): block ids derived by hand
from vLLM 0.33.0's coordinator and managers on a tiny hybrid model (a window of 8 tokens
beside full attention, blocks of 4), and the plan's choice of allocator."""

from __future__ import annotations

import pytest

from kvsim.kvcache import HybridPagedAllocator, HybridPrefixCache, SeqShape, make_allocator
from kvsim.kvcache.sliding import admission_cap
from kvsim.model.kv_groups import kv_cache_groups
from kvsim.model.specs import GIB, MODEL_PRESETS, KVSpec


def tiny(num_blocks=10, cap=4) -> HybridPagedAllocator:
    return HybridPagedAllocator(num_blocks, 4, (8, None), (cap, 0))


def test_groups_take_blocks_in_group_order_and_the_window_frees_before_allocating():
    a = tiny()
    assert a.allocate(0, SeqShape(6, 10), 6)
    # allocate_new_blocks: the windowed group (0) first, then full attention, each from the head
    assert a.block_tables(0) == [[0, 1], [2, 3]]
    assert a.grow(0, 12)  # 6 computed: the window (8) skips nothing yet
    assert a.block_tables(0) == [[0, 1, 4], [2, 3, 5]]
    # 12 computed: the first 12 - 8 + 1 = 5 tokens are skipped, one whole block: block 0
    # goes to the head before allocating, and the windowed group takes it straight back
    assert a.grow(0, 13)
    assert a.block_tables(0) == [[1, 4, 0], [2, 3, 5, 6]] and a.released(0) == [1, 0]
    a.check_invariants()
    # free: group by group, each deepest first to the head, so the full group's last
    # block is the next handed out
    a.free(0)
    assert a.free_blocks == [6, 5, 3, 2, 0, 4, 1, 7, 8, 9]


def test_admission_caps_the_windowed_group_only():
    # a 40-token prompt: 10 blocks of full attention; the windowed group's share is capped
    # at ceil(min(8 - 1 + 4, 64) / 4) + 1 = 4 (one batch of 4 tokens in flight)
    assert admission_cap(8, 4, 4, 64) == 4
    a = tiny(num_blocks=14)
    shape = SeqShape(40, 1)
    assert a._blocks_short(shape, 40) == 10 + 4 - 14 == 0
    assert a.pool_free((shape, 40, 0)) == (0, 56, False)
    assert a.pool_free((shape, 44, 0))[2]  # 11 + 4 > 14: starved
    # the step's own allocation is not capped: a 40-token chunk needs 10 + 10 blocks
    assert not a.allocate(1, shape, 40)
    assert a.allocate(1, shape, 28) and [len(t) for t in a.block_tables(1)] == [7, 7]


def test_the_footprint_counts_a_windowed_tables_blocks_since_its_window():
    a = tiny(num_blocks=100)
    # 30 tokens: full attention 8 blocks; the window skips (30 - 7) // 4 = 5 of its 8
    assert a.footprint(SeqShape(20, 10)) == 4 * (8 + 3)


def test_a_hybrid_model_without_prefix_caching_gets_vllms_groups():
    m = MODEL_PRESETS["gpt-oss-20b"]
    kv = KVSpec(m, "bf16")
    alloc = make_allocator("paged", 1 * GIB, kv, 1024, block_size=16, hybrid_groups=True, vllm_in_flight_tokens=256)
    assert isinstance(alloc, HybridPagedAllocator)
    assert alloc.num_blocks == GIB // kv_cache_groups(m).block_bytes(kv, 16) == 2730
    assert alloc.windows == (128, None) and alloc.caps == (25, 0)
    # the same pool counted as full attention: a block of all 24 layers
    assert make_allocator("paged", 1 * GIB, kv, 1024, block_size=16, prefix_caching=True).num_blocks == 1365


@pytest.mark.parametrize("caching", [False, True])
def test_the_plan_gives_vllm_v1_the_groups(tmp_path, caching):
    from kvsim.config.scenario import validate_scenario
    from kvsim.sim.plan import resolve

    raw = {
        "name": "hybrid",
        "model": "gpt-oss-20b",
        "gpu": "h100-80gb",
        "max_model_len": 8192,
        "cost_model": "roofline",
        "workload": {
            "num_requests": 2,
            "arrival": {"process": "burst"},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 10},
        },
        "policies": [{"name": "p", "allocator": "paged", "enable_prefix_caching": caching}],
    }
    plan = resolve(validate_scenario(raw, str(tmp_path / "s.yaml")), tmp_path)
    assert plan.policies[0].options.get("hybrid_groups")


def test_the_prefix_cache_hits_full_attention_then_the_windows_run_and_pins_the_junction():
    """vLLM 0.33.0's HybridKVCacheCoordinator by hand: a window of 8 tokens (a hit needs
    ceil(7 / 4) = 2 cached blocks in a row) beside full attention, blocks of 4."""
    a = HybridPrefixCache(20, 4, (8, None), (100, 0))
    doc = ((100, 16),)  # a shared 16-token document: 4 blocks
    first = SeqShape(16, 2, doc, 7)
    assert a.match_prefix(first, 16) == 0 and a.allocate(0, first, 16)
    assert a.block_tables(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # full attention hashes every full block; the window only the 2 blocks that end at
    # the replay boundary, block (16 - 1) // 4 = 3: blocks 1 and 2
    assert a.cached_blocks == [1, 2, 4, 5, 6, 7]
    a.free(0)  # group by group, the deepest first: unhashed to the head, hashed to the tail
    assert a.free_blocks[:2] == [3, 0] and a.free_blocks[-6:] == [2, 1, 7, 6, 5, 4]
    # the document again, and 16 tokens of its own: full attention hits all 4 blocks, the
    # window's rightmost run of 2 within them ends at block 3 (block 3 was not hashed):
    # the hit is 12 tokens, and 16 is the shared-prefix boundary
    second = SeqShape(32, 2, doc, 8)
    assert a.match_prefix(second, 32) == 12
    assert a.allocate(1, second, 32)
    assert a.released(1) == [1, 0]  # the window's block 0 is skipped (vLLM's null block)
    assert a.block_tables(1) == [[1, 2, 3, 0, 8, 9, 10], [4, 5, 6, 11, 12, 13, 14, 15]]
    # the window hashes blocks 5-6 (the replay boundary, block 31 // 4 = 7) and block 3
    # (the 2 ending at the boundary's block 4; block 2 is a hit already): blocks 3, 8, 9
    assert {3, 8, 9} <= set(a.cached_blocks) and not {0, 10} & set(a.cached_blocks)
    a.check_invariants()
    # a third request of the document finds the pinned junction: a 16-token hit
    assert a.match_prefix(SeqShape(24, 2, doc, 9), 24) == 16


def test_a_hybrid_model_with_prefix_caching_gets_the_hybrid_prefix_cache():
    kv = KVSpec(MODEL_PRESETS["gemma-3-27b"], "bf16")
    alloc = make_allocator("paged", GIB, kv, 4096, block_size=16, prefix_caching=True, hybrid_groups=True)
    assert isinstance(alloc, HybridPrefixCache) and alloc.windows == (1024,) * 6 + (None,)
