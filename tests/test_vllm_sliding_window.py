"""vLLM V1's sliding-window rules (kvsim.kvcache.sliding), block id by block id, each
expected value worked out by hand from vLLM 0.33.0's code: single_type_kv_cache_manager.py
(SlidingWindowManager.get_num_skipped_tokens, find_longest_cache_hit,
reachable_block_mask, _remove_blocks_in_range), kv_cache_manager.py (allocate_slots),
block_pool.py (free_blocks), kv_cache_interface.py
(SlidingWindowSpec.max_admission_blocks_per_request). kvsim's block b is vLLM's b + 1."""

import dataclasses

from kvsim.kvcache import (
    SeqShape,
    SlidingWindowPagedAllocator,
    SlidingWindowPrefixCache,
    PagedAllocator,
    PrefixCachingPagedAllocator,
    make_allocator,
)
from kvsim.kvcache.sliding import admission_cap
from kvsim.model.specs import MODEL_PRESETS, KVSpec

DOC = ((100, 8),)  # a shared document of 8 tokens: blocks 0-3 at block size 2


def test_blocks_leave_before_the_next_allocation_on_the_tokens_computed():
    # window 4: of c computed tokens, c - 3 are skipped (get_num_skipped_tokens)
    alloc = SlidingWindowPagedAllocator(10, 2, window=4, cap=100)
    assert alloc.allocate(0, SeqShape(5, 10), 5)  # a new request holds every block
    assert alloc.block_table(0) == [0, 1, 2]
    assert alloc.grow(0, 6)  # c = 5: 2 skipped, block 0 leaves first; 3 blocks cover 6
    assert (alloc.block_table(0), alloc.free_blocks[:2]) == ([1, 2], [0, 3])
    assert alloc.grow(0, 7)  # c = 6: still 1 block skipped; the 4th block is the head: 0
    assert (alloc.block_table(0), alloc.free_blocks[:1]) == ([1, 2, 0], [3])
    assert alloc.grow(0, 8)  # c = 7: 4 skipped, block 1 leaves to the head
    assert (alloc.block_table(0), alloc.free_blocks[:2]) == ([2, 0], [1, 3])
    alloc.check_invariants()
    alloc.free(0)  # deepest first, prepended as one run: 0 is handed out next
    assert alloc.free_blocks[:4] == [0, 2, 1, 3]
    # kvsim's rule for vLLM V0 releases after the growth: blocks 0 and 1 at 8 tokens already
    old = PagedAllocator(10, 2, window=4)
    assert old.allocate(0, SeqShape(5, 10), 5) and old.grow(0, 6)
    assert old.block_table(0) == [1, 2]


def test_a_failed_allocation_still_releases_the_skipped_blocks():
    alloc = SlidingWindowPagedAllocator(4, 2, window=4, cap=100)
    assert alloc.allocate(0, SeqShape(8, 4), 8)  # the whole pool
    assert not alloc.grow(0, 14)  # c = 8: blocks 0 and 1 leave; 3 more do not fit in 2
    assert alloc.block_table(0) == [2, 3] and alloc.free_blocks == [1, 0]
    assert alloc.tokens_of(0) == 8


def test_admission_needs_at_most_the_capped_blocks():
    # ceil(min(window - 1 + in flight, max_model_len) / block_size) + 1
    assert admission_cap(4096, 16, 2 * 8192, 32768) == 1281
    assert admission_cap(4, 2, 2, 100) == 4 and admission_cap(4, 2, 2, 3) == 3
    alloc = SlidingWindowPagedAllocator(6, 2, window=4, cap=4)
    long = SeqShape(20, 1)
    assert alloc._blocks_short(long, 20) == 4 - 6  # 10 blocks wanted, 4 checked
    assert not alloc.allocate(0, long, 20)  # the step's own allocation is not capped
    assert alloc.allocate(0, long, 8)  # a first chunk of 8 is


def cache(num_blocks=12):
    return SlidingWindowPrefixCache(num_blocks, 2, window=4, cap=100)


def test_a_prompt_hashes_only_the_blocks_before_its_replay_boundary():
    # 9 prompt tokens: the replay boundary is token 8, block 4; a hit needs
    # ceil(3 / 2) = 2 blocks, so blocks 2 and 3 are hashed, 0 and 1 are not
    alloc = cache()
    assert alloc.allocate(0, SeqShape(9, 2, DOC, 500), 9)
    assert alloc.block_table(0) == [0, 1, 2, 3, 4]
    assert alloc.cached_blocks == [2, 3]
    # a prompt sharing only the document's first half finds nothing: its blocks are unhashed
    assert alloc.match_prefix(SeqShape(7, 2, ((100, 4),), 502), 7) == 0
    full = PrefixCachingPagedAllocator(12, 2)  # full attention would hit both
    assert full.allocate(0, SeqShape(9, 2, DOC, 500), 9)
    assert full.match_prefix(SeqShape(7, 2, ((100, 4),), 502), 7) == 4


def test_a_hit_ends_in_a_window_of_cached_blocks_and_skips_the_rest():
    alloc = cache()
    assert alloc.allocate(0, SeqShape(9, 2, DOC, 500), 9)
    other = SeqShape(9, 2, DOC, 501)
    assert alloc.match_prefix(other, 9) == 8  # blocks 3 and 2 from the right: 4 blocks hit
    assert alloc.allocate(1, other, 9)  # blocks 0-1 skipped (null), 2-3 shared, 1 new
    assert alloc.block_table(1) == [2, 3, 5] and alloc.ref_count(2) == 2
    alloc.free(0)  # deepest first: 4, 1, 0 unhashed to the head; 3 and 2 still held
    assert alloc.free_blocks == [4, 1, 0, 6, 7, 8, 9, 10, 11]
    assert alloc.grow(1, 10)  # c = 9: 6 skipped, block 2 (hashed, now unheld) to the tail
    assert alloc.block_table(1) == [3, 5] and alloc.free_blocks[-1] == 2
    alloc.check_invariants()
    alloc.free(1)  # 5 unhashed to the head, 3 hashed to the tail
    assert alloc.free_blocks == [5, 4, 1, 0, 6, 7, 8, 9, 10, 11, 2, 3]
    third = SeqShape(9, 2, DOC, 502)  # both hashed blocks come back from the queue
    assert alloc._blocks_short(third, 9) == (5 - 4) + 2 - 12
    assert alloc.allocate(2, third, 9) and alloc.block_table(2) == [2, 3, 5]


def test_without_a_full_window_the_hit_is_the_run_from_the_first_block():
    # window 8 at block size 2: a hit needs ceil(7 / 2) = 4 cached blocks in a row; a
    # 5-token prompt hashes blocks 0 and 1 (those up to block (5 - 1) // 2 = 2)
    alloc = SlidingWindowPrefixCache(12, 2, window=8, cap=100)
    assert alloc.allocate(0, SeqShape(5, 2, ((100, 4),), 500), 5)
    assert alloc.cached_blocks == [0, 1]
    assert alloc.match_prefix(SeqShape(9, 2, DOC, 501), 9) == 4  # the run from block 0


def test_the_registry_builds_vllm_v1_s_window_rules_where_asked():
    kv = KVSpec(dataclasses.replace(MODEL_PRESETS["mistral-7b"], sliding_window=64), "bf16")
    pool = 100 * 16 * kv.bytes_per_token
    assert type(make_allocator("paged", pool, kv, 4096)) is PagedAllocator
    plain = make_allocator("paged", pool, kv, 4096, vllm_in_flight_tokens=512)
    cached = make_allocator("paged", pool, kv, 4096, prefix_caching=True, vllm_in_flight_tokens=512)
    assert type(plain) is SlidingWindowPagedAllocator and plain.cap == 37  # ceil(575 / 16) + 1
    assert type(cached) is SlidingWindowPrefixCache and cached.cap == 37
