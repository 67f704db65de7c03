"""The prefix caches: exact block ids, free-queue order, refcounts and tree shapes on small
hand-worked cases, then random operations checked against the invariants and, in pools
too big to evict, against a brute-force model of what should be cached."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache import (
    Breakdown,
    InvariantError,
    PrefixCachingPagedAllocator,
    RadixCacheAllocator,
    SeqShape,
    make_allocator,
)
from kvsim.kvcache.prefix import KEYS_SLACK
from kvsim.kvcache.runs import common_length, split_runs
from kvsim.model.specs import MODEL_PRESETS, KVSpec

from test_fast_path import CASES, POLICIES, assert_same, run, scenario

SYSTEM = ((7, 8),)  # a shared system prompt of two 4-token blocks


def shaped(prompt: int, output: int = 0, segments=SYSTEM, tail: int = -1) -> SeqShape:
    return SeqShape(prompt, output, segments, tail)


def hashed() -> PrefixCachingPagedAllocator:
    return PrefixCachingPagedAllocator(num_blocks=8, block_size=4)


# -- hash-based prefix caching on paged blocks -----------------------------------------


def test_two_requests_share_the_system_prompt_blocks():
    alloc = hashed()
    assert alloc.allocate(1, shaped(11, 5), 11)
    assert alloc.block_table(1) == [0, 1, 2]
    assert alloc.cached_blocks == [0, 1]  # block 2 is partial and unique
    assert alloc.match_prefix(shaped(11, 5), 11) == 8
    assert alloc.allocate(2, shaped(11, 5), 11)
    assert alloc.block_table(2) == [0, 1, 3]
    assert [alloc.ref_count(b) for b in range(5)] == [2, 2, 1, 1, 0]
    assert alloc.free_blocks == [4, 5, 6, 7]
    # 22 tokens held in 14 physical token slots; each holds 1 slot for its 16th token.
    assert alloc.breakdown(None) == Breakdown(14, 2, 0, 0, 0, 16, shared=8)
    assert alloc.tokens_of(2) == 11
    alloc.check_invariants()


def test_hit_after_the_first_request_is_freed():
    alloc = hashed()
    assert alloc.allocate(1, shaped(11), 11)
    alloc.free(1)
    # vLLM 0.33.0's BlockPool.free_blocks: the full (hashed) blocks deepest first to the
    # tail, the partly filled block 2 to the head
    assert alloc.free_blocks == [2, 3, 4, 5, 6, 7, 1, 0]
    assert alloc.cached_blocks == [0, 1]  # queued, still cached
    assert alloc.breakdown(None) == Breakdown(0, 0, 0, 0, 0, 32)
    assert alloc.allocate(2, shaped(11), 11)
    assert alloc.block_table(2) == [0, 1, 2]  # hits leave the queue from its middle
    assert alloc.free_blocks == [3, 4, 5, 6, 7]
    alloc.check_invariants()


def test_eviction_takes_the_deepest_block_of_a_freed_request_first():
    alloc = hashed()
    prompt = shaped(12, segments=((7, 12),))
    assert alloc.allocate(1, prompt, 12)
    alloc.free(1)
    assert alloc.cached_blocks == [0, 1, 2]
    assert alloc.allocate(2, shaped(24, segments=()), 24)  # 6 blocks: 3..7, then 2
    assert alloc.block_table(2) == [3, 4, 5, 6, 7, 2]
    assert alloc.cached_blocks == [0, 1]
    assert alloc.match_prefix(prompt, 13) == 8
    assert alloc.allocate(3, shaped(1, segments=()), 1)
    assert alloc.block_table(3) == [1]
    assert alloc.cached_blocks == [0]
    assert alloc.match_prefix(prompt, 13) == 4
    alloc.check_invariants()


def test_partial_last_block_is_never_shared_until_filled():
    alloc = hashed()
    long = shaped(16, segments=((7, 16),))
    assert alloc.allocate(1, shaped(10, 2, segments=((7, 16),)), 10)
    assert alloc.cached_blocks == [0, 1]
    assert alloc.match_prefix(long, 16) == 8
    assert alloc.grow(1, 12)  # block 2 fills: cached now
    assert alloc.cached_blocks == [0, 1, 2]
    assert alloc.match_prefix(long, 16) == 12
    alloc.check_invariants()


def test_unique_content_is_never_cached():
    alloc = hashed()
    s = shaped(16, segments=((-1, 4), (7, 12)), tail=7)
    assert alloc.allocate(1, s, 16)
    assert alloc.cached_blocks == []  # every block follows a unique one
    assert alloc.allocate(2, shaped(12, segments=()), 12)
    assert alloc.cached_blocks == []
    assert alloc.match_prefix(s, 16) == 0
    alloc.check_invariants()


def test_match_is_whole_blocks_and_leaves_the_last_token():
    alloc = hashed()
    s = shaped(16, segments=((7, 16),))
    assert alloc.allocate(1, s, 16)
    assert [alloc.match_prefix(s, n) for n in (0, 1, 4, 5, 8, 9, 16, 17)] == [0, 0, 0, 4, 4, 8, 12, 16]
    assert alloc.allocate(2, s, 16)  # reuses 3 blocks, recomputes the 4th
    assert alloc.block_table(2) == [0, 1, 2, 4]
    # vLLM does not de-duplicate: block 4 is cached as a second copy of block 3's key.
    assert alloc.cached_blocks == [0, 1, 2, 3, 4]
    assert alloc.copies(3) == alloc.copies(4) == [3, 4]
    assert [alloc.ref_count(b) for b in range(5)] == [2, 2, 2, 1, 1]
    alloc.free(1)
    assert alloc.free_blocks == [5, 6, 7, 3]
    alloc.free(2)
    assert alloc.free_blocks == [5, 6, 7, 3, 4, 2, 1, 0]
    alloc.check_invariants()


def test_a_recomputed_copy_still_hits_after_the_first_copy_is_evicted():
    """vLLM 0.10.1.1 BlockPool: cached_block_hash_to_block maps a hash to every block
    cached under it; evicting one copy (_maybe_evict_cached_block) leaves the others,
    and get_cached_block returns the first one left."""
    alloc = hashed()
    s = shaped(16, segments=((7, 16),))
    assert alloc.allocate(1, s, 16) and alloc.allocate(2, s, 16)
    assert alloc.block_table(2) == [0, 1, 2, 4]
    alloc.free(1)
    alloc.free(2)
    assert alloc.free_blocks == [5, 6, 7, 3, 4, 2, 1, 0]
    assert alloc.allocate(3, shaped(16, segments=()), 16)  # takes 5, 6, 7 and evicts 3
    assert alloc.block_table(3) == [5, 6, 7, 3]
    assert alloc.cached_blocks == [0, 1, 2, 4] and alloc.copies(4) == [4]
    alloc.free(3)
    assert alloc.free_blocks == [4, 2, 1, 0, 3, 7, 6, 5]
    longer = shaped(17, segments=((7, 16),))
    assert alloc.match_prefix(longer, 17) == 16  # the fourth block hits its copy
    assert alloc.allocate(4, longer, 17)
    assert alloc.block_table(4) == [0, 1, 2, 4, 3]
    assert alloc.free_blocks == [7, 6, 5]
    alloc.check_invariants()


def test_a_lookup_kept_from_an_earlier_step_sees_its_first_copy_evicted_by_growth():
    """The last lookup is kept until a key it read changes its first copy. Here a waiting
    request is looked up, then a running one grows into the first copy of its fourth
    block's key (an eviction with no other lookup between): the next lookup must take
    the second copy, as vLLM's get_cached_block returns the first copy left."""
    alloc = PrefixCachingPagedAllocator(num_blocks=9, block_size=4)
    s = shaped(16, segments=((7, 16),))
    unique = shaped(4, segments=())
    assert alloc.allocate(10, unique, 4) and alloc.block_table(10) == [0]
    assert alloc.allocate(1, s, 16) and alloc.allocate(2, s, 16)
    assert alloc.block_table(1) == [1, 2, 3, 4] and alloc.block_table(2) == [1, 2, 3, 5]
    assert alloc.copies(4) == [4, 5]
    alloc.free(1)
    alloc.free(2)
    alloc.free(10)
    assert alloc.free_blocks == [6, 7, 8, 4, 5, 3, 2, 1, 0]
    assert alloc.allocate(3, shaped(12, 4, segments=()), 12)  # takes 6, 7, 8
    longer = shaped(17, segments=((7, 16),))
    assert alloc.match_prefix(longer, 17) == 16  # hits 1, 2, 3, 4
    assert alloc.grow(3, 13) and alloc.block_table(3) == [6, 7, 8, 4]  # evicts 4
    assert alloc.copies(5) == [5] and alloc.free_blocks == [5, 3, 2, 1, 0]
    assert alloc.allocate(4, longer, 17)
    assert alloc.block_table(4) == [1, 2, 3, 5, 0]  # the second copy hits
    alloc.check_invariants()


def test_next_request_counts_its_hits_before_calling_free_space_unusable():
    alloc = hashed()
    prompt = shaped(12, segments=((7, 12),))
    assert alloc.allocate(1, prompt, 12)
    alloc.free(1)
    assert alloc.allocate(2, shaped(20, segments=()), 20)
    assert alloc.free_blocks == [2, 1, 0]  # all three cached
    # 17 tokens: hits 0, 1, 2 leave the queue; 2 more blocks needed, none left.
    assert alloc.breakdown((shaped(17, segments=((7, 12),)), 17, 0)) == Breakdown(20, 0, 0, 0, 12, 0, starved=True)
    assert not alloc.allocate(3, shaped(17, segments=((7, 12),)), 17)
    # 12 tokens: hits 0, 1 (the last token is computed); block 2 is evicted and refilled.
    assert alloc.breakdown((prompt, 12, 0)) == Breakdown(20, 0, 0, 0, 0, 12)
    assert alloc.allocate(3, prompt, 12)
    assert alloc.block_table(3) == [0, 1, 2]
    assert alloc.cached_blocks == [0, 1, 2]
    alloc.check_invariants()


def test_watermark_blocks_admission_but_not_hits():
    alloc = hashed()
    assert alloc.allocate(1, shaped(8), 8)
    assert not alloc.allocate(2, shaped(24, segments=()), 24, keep_free=1)  # 6 of 6 free
    assert alloc.allocate(2, shaped(9), 9, keep_free=20)  # hits 0, 1 + one block; 5 stay
    assert alloc.block_table(2) == [0, 1, 2]
    alloc.check_invariants()


def test_forks_share_blocks_and_copy_the_partial_one_on_write():
    alloc = hashed()
    assert alloc.allocate(1, shaped(10, 6), 10)
    assert alloc.fork(1, 2)
    assert alloc.block_table(2) == [0, 1, 2]
    assert [alloc.ref_count(b) for b in range(3)] == [2, 2, 2]
    # One physical copy of 10 tokens; block 2's 2 reserved slots are counted once.
    assert alloc.breakdown(None) == Breakdown(10, 2, 0, 0, 0, 20, shared=12)
    assert alloc.grow(2, 11)  # writes into shared block 2: copy
    assert alloc.block_table(2) == [0, 1, 3]
    assert alloc.grow(1, 12)  # block 2 is its own now
    assert alloc.block_table(1) == [0, 1, 2]
    assert alloc.breakdown(None) == Breakdown(15, 1, 0, 0, 0, 16, shared=8)
    alloc.free(1)
    assert alloc.free_blocks == [4, 5, 6, 7, 2]
    alloc.check_invariants()


def test_copy_on_write_fails_cleanly_without_a_free_block():
    alloc = PrefixCachingPagedAllocator(num_blocks=3, block_size=4)
    assert alloc.allocate(1, shaped(10, 6), 10)
    assert alloc.fork(1, 2)
    before = alloc.breakdown(None)
    assert not alloc.grow(2, 11)
    assert alloc.block_table(2) == [0, 1, 2] and alloc.breakdown(None) == before
    assert alloc.grow(2, 12) is False and alloc.tokens_of(2) == 10
    alloc.check_invariants()


def test_hash_cache_invariants_name_the_fault():
    alloc = hashed()
    assert alloc.allocate(1, shaped(11), 11)
    alloc._ref = alloc._counts()  # counts kept from here on, block 1's wrong
    alloc._ref[1] = 2
    with pytest.raises(InvariantError, match=r"block 1 \(in seq 1's table\) has reference count 2 but 1 owners"):
        alloc.check_invariants()
    alloc = hashed()  # two documents: a stretch of two blocks each, the second's below the first's
    assert alloc.allocate(1, SeqShape(19, 0, ((7, 8), (8, 8)), -1), 19)
    alloc.free(1)  # blocks 0 to 3 stay cached, queued
    del alloc._first[alloc._key_of[1]]  # the first document's last key evicted, not the second's
    alloc._key_of[1] = None
    with pytest.raises(InvariantError, match=r"key entries .* are kept, but not the keys they hang below"):
        alloc._forget_keys()


def test_registry_builds_the_caches():
    kv = KVSpec(MODEL_PRESETS["llama-3-8b"], "bf16")
    pool = 1000 * kv.bytes_per_token
    cache = make_allocator("paged", pool, kv, 64, block_size=16, prefix_caching=True)
    assert isinstance(cache, PrefixCachingPagedAllocator)
    assert (cache.num_blocks, cache.block_size) == (62, 16)
    assert type(make_allocator("paged", pool, kv, 64, prefix_caching=False)).__name__ == "PagedAllocator"
    radix = make_allocator("radix", pool, kv, 64)
    assert isinstance(radix, RadixCacheAllocator) and radix.capacity == 1000
    assert radix.unfit_reason(SeqShape(1000, 1)) == "final length exceeds KV pool"


# -- radix tree ---------------------------------------------------------------------------


def test_runs_helpers():
    assert common_length(((1, 0, 6), (2, 0, 4)), ((1, 0, 3), (1, 3, 5))) == 6
    assert common_length(((1, 0, 6),), ((1, 1, 6),)) == 0
    assert common_length(((-1, 0, 6),), ((-1, 0, 6),)) == 0
    assert split_runs(((1, 0, 6), (2, 0, 4)), 8) == (((1, 0, 6), (2, 0, 2)), ((2, 2, 2),))


SHAPES = st.builds(
    lambda segments, prompt, output, tail: SeqShape(
        max(prompt, sum(n for _, n in segments)), output, tuple(segments), tail
    ),
    st.lists(st.tuples(st.integers(-1, 3), st.sampled_from([0, 1, 3, 4, 5, 8, 12, 16, 40])), max_size=5),
    st.integers(0, 60),
    st.integers(0, 60),
    st.integers(-1, 3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(SHAPES, min_size=1, max_size=4), st.sampled_from([1, 3, 4, 16]))
def test_block_keys_are_equal_exactly_where_the_prefixes_are(shapes, block):
    """Each shape's chain has a key per full block up to the first one holding content -1,
    and two blocks (of any shapes, computed in any order) have the same key exactly when
    they are the same block of the same tokens: shape.runs of their prefixes are equal."""
    alloc = PrefixCachingPagedAllocator(num_blocks=4, block_size=block)
    chains = [alloc._chain(shape) for shape in shapes]
    prefixes = []
    for shape, chain in zip(shapes, chains):
        cacheable = 0
        while cacheable < shape.final_tokens // block and all(
            content != -1 for content, _, _ in shape.runs(cacheable * block, (cacheable + 1) * block)
        ):
            cacheable += 1
        assert len(chain) == cacheable
        prefixes.append([shape.runs(0, (i + 1) * block) for i in range(cacheable)])
    for a, chain_a in enumerate(chains):
        for b, chain_b in enumerate(chains):
            for i, key_a in enumerate(chain_a):
                for j, key_b in enumerate(chain_b):
                    assert (key_a == key_b) == (i == j and prefixes[a][i] == prefixes[b][j])
    assert [alloc._chain(shape) for shape in reversed(shapes)] == chains[::-1]  # kept, or the same again


def test_blocks_filled_past_the_final_length_are_cached_too():
    # Found by test_hash_cache_matches_every_filled_block: a sequence of one token (its
    # final length) grown to two fills a second block of its tail content, which a
    # longer request of the same tail then hits.
    alloc = PrefixCachingPagedAllocator(num_blocks=8, block_size=1)
    assert alloc.allocate(0, SeqShape(1, 0, (), 5), 1) and alloc.grow(0, 2)
    assert alloc.cached_blocks == [0, 1]
    assert alloc.match_prefix(SeqShape(3, 0, (), 5), 3) == 2
    alloc.check_invariants()


@pytest.fixture
def radix():
    """32 slots; A (6 of content 1, 4 of content 2) was freed into the tree,
    then B (6 of content 1, 4 of content 3) was admitted, splitting A's edge."""
    alloc = RadixCacheAllocator(32)
    a = shaped(12, segments=((1, 6), (2, 4)))
    assert alloc.allocate(1, a, 12)
    assert alloc.nodes() == []
    alloc.free(1)  # the 2 unique tokens are dropped
    assert alloc.nodes() == [(0, ((1, 0, 6), (2, 0, 4)), 0)]
    assert alloc.free_slots == 22
    b = shaped(12, segments=((1, 6), (3, 4)))
    assert alloc.match_prefix(b, 12) == 6  # a lookup splits, as SGLang's does
    assert alloc.nodes() == [(0, ((1, 0, 6),), 0), (6, ((2, 0, 4),), 0)]
    assert alloc.allocate(2, b, 12)
    assert alloc.nodes() == [(0, ((1, 0, 6),), 1), (6, ((2, 0, 4),), 0)]
    alloc.check_invariants()
    return alloc


def test_radix_split_and_breakdown(radix):
    # B holds 6 tree slots and 6 private; A's 4-token leaf is evictable, so free.
    assert radix.breakdown(None) == Breakdown(12, 0, 0, 0, 0, 20)
    assert radix.tokens_of(2) == 12


def test_radix_shared_match_and_refcounts(radix):
    c = shaped(12, segments=((1, 6), (2, 4)))
    assert radix.match_prefix(c, 12) == 10
    assert radix.allocate(3, c, 12)
    assert radix.nodes() == [(0, ((1, 0, 6),), 2), (6, ((2, 0, 4),), 1)]
    assert radix.breakdown(None) == Breakdown(18, 0, 0, 0, 0, 14, shared=6)
    radix.free(2)  # B's content-3 tokens join the tree
    assert radix.nodes() == [(0, ((1, 0, 6),), 1), (6, ((2, 0, 4),), 1), (6, ((3, 0, 4),), 0)]
    radix.free(3)
    assert [ref for _, _, ref in radix.nodes()] == [0, 0, 0]
    assert radix.breakdown(None) == Breakdown(0, 0, 0, 0, 0, 32)
    radix.check_invariants()


def two_leaves(lookup: bool) -> RadixCacheAllocator:
    """14 slots; X = (1: 4 tokens, 2: 4 tokens) then Y = (1: 4, 3: 4) were freed, each
    with one unique token: the tree is (1) -> (2), (3), 2 slots free. Y's leaf (3) was
    made last, so it is the more recent unless `lookup` then looks X up."""
    alloc = RadixCacheAllocator(14)
    x, y = shaped(9, segments=((1, 4), (2, 4))), shaped(9, segments=((1, 4), (3, 4)))
    assert alloc.allocate(1, x, 9)
    alloc.free(1)
    assert alloc.allocate(2, y, 9)
    alloc.free(2)
    assert alloc.nodes() == [(0, ((1, 0, 4),), 0), (4, ((2, 0, 4),), 0), (4, ((3, 0, 4),), 0)]
    assert alloc.free_slots == 2
    if lookup:
        assert alloc.match_prefix(x, 9) == 8
    return alloc


@pytest.mark.parametrize("lookup, left", [(False, 3), (True, 2)])
def test_radix_lookup_refreshes_the_path_it_matches(lookup, left):
    """SGLang 0.5.23 RadixCache._match_prefix_helper stamps every node it visits: looking X up
    makes leaf (2) newer than leaf (3), so the least recently used leaf is (3)."""
    alloc = two_leaves(lookup)
    assert alloc.allocate(3, shaped(3, segments=()), 3)  # 3 > 2 free: evict 3 slots
    assert alloc.nodes() == [(0, ((1, 0, 4),), 0), (4, ((left, 0, 4),), 0)]
    assert alloc.free_slots == 2 + 4 - 3
    alloc.check_invariants()


def test_radix_evicts_the_shortfall_when_short():
    """SGLang 0.5.23 evict_to_free_tokens (mem_cache/allocator/base.py): with 2 slots
    free, a 6-token allocation evicts the 4 missing, the least recently used leaf (2)."""
    alloc = two_leaves(lookup=False)
    assert alloc.allocate(3, shaped(6, segments=()), 6)
    assert alloc.nodes() == [(0, ((1, 0, 4),), 0), (4, ((3, 0, 4),), 0)]
    assert alloc.free_slots == 2 + 4 - 6
    assert alloc.breakdown(None) == Breakdown(6, 0, 0, 0, 0, 8)
    assert alloc.allocate(4, shaped(5, segments=()), 5)  # 4 free, 4 evictable: all go
    assert alloc.nodes() == [] and alloc.free_slots == 3
    alloc.check_invariants()


def test_radix_shares_a_prompt_once_its_prefill_ran():
    """SGLang 0.5.23 inserts a prompt after its prefill (checkpoint_kv_cache), so a
    request admitted after that step shares it; one admitted in the same step does not.
    kvsim's scheduler allocates before the step that computes the tokens."""
    alloc = RadixCacheAllocator(64)
    a, b, c = (SeqShape(10, 4, ((7, 8),)) for _ in range(3))  # 8 shared, 2 unique each
    assert alloc.allocate(1, a, 11)  # the prefill step: 10 prompt tokens + 1
    assert alloc.match_prefix(b, 11) == 0  # nothing computed yet
    assert alloc.allocate(2, b, 11)  # admitted in the same step: computes it too
    assert alloc.nodes() == [] and alloc.free_slots == 42
    assert alloc.grow(1, 12)  # next step: a's prompt went in, then it grows
    assert alloc.nodes() == [(0, ((7, 0, 8),), 1)]
    assert alloc.free_slots == 41
    assert alloc.grow(2, 12)  # b's copy of the 8 shared tokens is freed
    assert alloc.nodes() == [(0, ((7, 0, 8),), 2)]
    assert alloc.free_slots == 48
    assert alloc.breakdown(None) == Breakdown(16, 0, 0, 0, 0, 48, shared=8)
    assert alloc.match_prefix(c, 11) == 8
    assert alloc.allocate(3, c, 11)
    assert alloc.nodes() == [(0, ((7, 0, 8),), 3)] and alloc.free_slots == 45
    alloc.check_invariants()


def test_radix_cache_prefilled_shares_before_the_request_grows_again():
    """An engine whose steps are prefill-only (SGLang's, when a new prefill batch can be
    formed) calls cache_prefilled after the step, as SGLang runs cache_unfinished_req
    after the forward: the next prefill batch shares the prompt though the first request
    has not decoded yet. After a recompute the re-prefilled output tokens go in too."""
    alloc = RadixCacheAllocator(64)
    a, b = SeqShape(10, 4, ((7, 8),)), SeqShape(10, 4, ((7, 8),))
    assert alloc.allocate(1, a, 11)
    alloc.cache_prefilled(1, 10)  # the prompt's 10 tokens are computed
    assert alloc.nodes() == [(0, ((7, 0, 8),), 1)]
    assert alloc.free_slots == 53  # nothing duplicated, nothing freed
    assert alloc.match_prefix(b, 11) == 8
    assert alloc.grow(1, 12)  # nothing left to insert
    assert alloc.nodes() == [(0, ((7, 0, 8),), 1)] and alloc.free_slots == 52
    turn = SeqShape(6, 4, (), tail_id=9)  # recomputed with 2 generated tokens: 8 + 1
    assert alloc.allocate(2, turn, 9)
    alloc.cache_prefilled(2, 8)
    assert alloc.nodes() == [(0, ((7, 0, 8),), 1), (0, ((9, 0, 8),), 1)]
    alloc.cache_prefilled(2, 20)  # at most what it holds: 9; a leaf for the 9th
    assert alloc.nodes() == [(0, ((7, 0, 8),), 1), (0, ((9, 0, 8),), 1), (8, ((9, 8, 1),), 1)]
    assert alloc.free_slots == 64 - 12 - 9
    alloc.check_invariants()


def test_radix_inserts_each_prefill_chunk_at_the_next_one():
    alloc = RadixCacheAllocator(64)
    a = SeqShape(10, 4, ((7, 8),))
    assert alloc.allocate(1, a, 4)  # chunk 1: tokens 0-3
    assert alloc.nodes() == []
    assert alloc.grow(1, 8)  # chunk 2; chunk 1 went in
    assert alloc.nodes() == [(0, ((7, 0, 4),), 1)]
    assert alloc.grow(1, 11)  # last chunk + first token; chunk 2 went in
    assert alloc.nodes() == [(0, ((7, 0, 4),), 1), (4, ((7, 4, 4),), 1)]
    assert alloc.grow(1, 12)  # the prompt's last 2 tokens are unique
    assert alloc.nodes() == [(0, ((7, 0, 4),), 1), (4, ((7, 4, 4),), 1)]
    assert alloc.free_slots == 64 - 12
    alloc.check_invariants()


def paged_radix(page: int) -> RadixCacheAllocator:
    """A (6 tokens of content 1, then its own content 5) prefilled 11 prompt tokens and
    decoded to 13, then was freed."""
    alloc = RadixCacheAllocator(32, page_size=page)
    a = SeqShape(11, 2, ((1, 6),), tail_id=5)
    assert alloc.allocate(1, a, 12) and alloc.grow(1, 13)
    alloc.free(1)
    return alloc


def test_radix_pages_match_and_insert_whole_pages():
    """SGLang 0.5.23 RadixCache with page_size 4: inserts cut to whole pages, children
    keyed by their first page, matches compared page by page."""
    alloc = RadixCacheAllocator(32, page_size=4)
    a = SeqShape(11, 2, ((1, 6),), tail_id=5)
    assert alloc.allocate(1, a, 12)  # 3 pages
    assert alloc.breakdown(None) == Breakdown(12, 0, 0, 0, 0, 20)
    assert alloc.grow(1, 13)  # 8 of the 11 prompt tokens go in; a 4th page
    assert alloc.nodes() == [(0, ((1, 0, 6), (5, 0, 2)), 1)]
    # 5 private tokens in 8 slots, final 13: 3 slots will never be used.
    assert alloc.breakdown(None) == Breakdown(13, 0, 3, 0, 0, 16)
    alloc.free(1)  # 12 of its 13 tokens go in; the partial page is freed
    assert alloc.nodes() == [(0, ((1, 0, 6), (5, 0, 2)), 0), (8, ((5, 2, 4),), 0)]
    assert alloc.free_slots == 20
    c = SeqShape(14, 2, ((1, 6), (5, 4)), tail_id=9)  # agrees on 10 tokens
    assert alloc.match_prefix(c, 14) == 8
    assert paged_radix(1).match_prefix(c, 14) == 10
    assert alloc.unfit_reason(SeqShape(30, 3)) == "final length exceeds KV pool"
    assert alloc.unfit_reason(SeqShape(29, 3)) is None
    alloc.check_invariants()


def test_radix_page_size_from_the_scenario():
    from kvsim.config.scenario import Paged

    radix = {"name": "r", "allocator": "paged", "enable_prefix_caching": True, "prefix_cache": "radix"}
    assert Paged.model_validate(radix).allocator_kind() == ("radix", {})
    assert Paged.model_validate({**radix, "block_size": 16}).allocator_kind() == ("radix", {"page_size": 16})
    kv = KVSpec(MODEL_PRESETS["llama-3-8b"], "bf16")
    paged = make_allocator("radix", 1000 * kv.bytes_per_token, kv, 64, page_size=16)
    assert (paged.capacity, paged.page_size) == (992, 16)


def test_radix_never_evicts_what_a_running_sequence_uses(radix):
    before = (radix.nodes(), radix.breakdown(None))
    assert radix.breakdown((shaped(21, segments=()), 21, 0)) == Breakdown(12, 0, 0, 0, 20, 0, starved=True)
    assert not radix.allocate(3, shaped(21, segments=()), 21)  # 16 free + 4 evictable
    assert (radix.nodes(), radix.breakdown(None)) == before
    assert not radix.grow(2, 33)
    assert radix.allocate(3, shaped(20, segments=()), 20)
    assert radix.nodes() == [(0, ((1, 0, 6),), 1)]
    radix.check_invariants()


def test_radix_match_ending_mid_edge_is_kept_whole():
    alloc = RadixCacheAllocator(32)
    assert alloc.allocate(1, shaped(12, segments=((1, 6), (2, 4))), 12)
    alloc.free(1)
    tree = alloc.nodes()
    # A 33-token request matching 6 of the 10 cached tokens needs 27 slots: 22 free and
    # 4 evictable, as the 6 it reuses cannot be evicted.
    b = shaped(33, segments=((1, 6), (3, 4)))
    assert alloc.breakdown((b, 33, 0)) == Breakdown(0, 0, 0, 0, 32, 0, starved=True)
    assert not alloc.allocate(2, b, 33)
    assert alloc.nodes() == tree
    assert alloc.allocate(2, shaped(32, segments=((1, 6), (3, 4))), 32)
    assert alloc.nodes() == [(0, ((1, 0, 6),), 1)]
    assert alloc.free_slots == 0
    alloc.check_invariants()


def test_radix_next_turn_matches_the_generated_tokens():
    alloc = RadixCacheAllocator(64)
    turn1 = SeqShape(6, 4, (), tail_id=9)  # a conversation's own content
    assert alloc.allocate(1, turn1, 6)
    assert alloc.grow(1, 10)  # the prompt went in first
    assert alloc.nodes() == [(0, ((9, 0, 6),), 1)]
    alloc.free(1)  # then the answer
    assert alloc.nodes() == [(0, ((9, 0, 6),), 0), (6, ((9, 6, 4),), 0)]
    turn2 = shaped(14, segments=((9, 10),))
    assert alloc.match_prefix(turn2, 14) == 10
    assert alloc.match_prefix(turn2, 10) == 9  # the last token is always computed
    assert alloc.nodes() == [(0, ((9, 0, 6),), 0), (6, ((9, 6, 3),), 0), (9, ((9, 9, 1),), 0)]
    assert alloc.allocate(2, turn2, 10)
    assert alloc.nodes() == [(0, ((9, 0, 6),), 1), (6, ((9, 6, 3),), 1), (9, ((9, 9, 1),), 0)]
    alloc.free(2)  # its private token duplicates the tree's
    assert [ref for _, _, ref in alloc.nodes()] == [0, 0, 0]
    assert alloc.free_slots == 54
    alloc.check_invariants()


def test_radix_fork_caches_the_parent_and_copies_only_unique_tokens():
    alloc = RadixCacheAllocator(32)
    parent = SeqShape(10, 4, ((1, 6),))  # 6 shareable tokens, 4 unique
    assert alloc.allocate(1, parent, 10)
    assert alloc.fork(1, 2)
    assert alloc.nodes() == [(0, ((1, 0, 6),), 2)]
    assert alloc.free_slots == 32 - 6 - 4 - 4
    assert alloc.tokens_of(2) == 10
    assert alloc.breakdown(None) == Breakdown(14, 0, 0, 0, 0, 18, shared=6)
    alloc.free(1)
    alloc.free(2)
    assert alloc.nodes() == [(0, ((1, 0, 6),), 0)]
    assert alloc.breakdown(None) == Breakdown(0, 0, 0, 0, 0, 32)
    alloc.check_invariants()


def test_radix_fork_fails_cleanly_when_the_copy_does_not_fit():
    alloc = RadixCacheAllocator(12)
    assert alloc.allocate(1, SeqShape(10, 4, ((1, 6),)), 10)
    before = alloc.breakdown(None)
    assert not alloc.fork(1, 2)  # 4 unique tokens to copy, 2 slots free
    assert alloc.nodes() == [] and alloc.breakdown(None) == before
    assert alloc.tokens_of(2) is None
    alloc.check_invariants()


def test_radix_invariants_name_the_fault(radix):
    radix._tree.root.children[((1, 0, 1),)].ref = 0
    with pytest.raises(InvariantError, match="refcount 0; 1 running paths"):
        radix.check_invariants()


# -- random operations ----------------------------------------------------------------

POOLS = [(), ((1, 8),), ((1, 8), (2, 8)), ((1, 8), (3, 5)), ((1, 13),), ((-1, 3), (1, 8))]

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("allocate"),
            st.integers(0, 3),
            st.integers(0, len(POOLS) - 1),
            st.sampled_from([-1, 5]),
            st.integers(1, 8),
            st.integers(0, 8),
        ),
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(0, 8)),
        st.tuples(st.just("free"), st.integers(0, 5)),
        st.tuples(st.just("fork"), st.integers(0, 3), st.integers(4, 5)),  # a sample of 0..3
        st.tuples(st.just("evict"), st.just(99), st.integers(1, 24)),  # a unique burst
    ),
    min_size=10,
    max_size=50,
)


def tokens(shape: SeqShape, n: int) -> list[tuple[int, int]]:
    """The first n tokens one by one, as (content, offset): the brute-force view."""
    return [(c, o + i) for c, o, length in shape.runs(0, n) for i in range(length)]


def common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and a[n][0] != -1:
        n += 1
    return n


def run_ops(alloc, ops, cached_model=None):
    """Apply ops, checking invariants after each; `cached_model(shape, n, history)`
    (for pools too big to evict) gives the match expected from the token history."""
    held: dict[int, tuple[SeqShape, int]] = {}
    history = {"filled": [], "inserted": []}
    for op, seq_id, *args in ops:
        if op == "allocate" and seq_id not in held:
            pool, tail, rest, output = args
            s = SeqShape(sum(n for _, n in POOLS[pool]) + rest, output, POOLS[pool], tail)
            k = alloc.match_prefix(s, s.prompt_tokens)
            assert 0 <= k < s.prompt_tokens
            if cached_model:
                assert k == cached_model(s, s.prompt_tokens, history)
            if alloc.allocate(seq_id, s, s.prompt_tokens):
                held[seq_id] = (s, s.prompt_tokens)
                history["filled"].append(tokens(s, s.prompt_tokens))
        elif op == "grow" and seq_id in held:
            s, n = held[seq_id]
            if alloc.grow(seq_id, n + args[0]):
                held[seq_id] = (s, n + args[0])
                history["filled"].append(tokens(s, n + args[0]))
                # The prompt tokens held before: computed by now (a radix insertion).
                history["inserted"].append(tokens(s, min(n, s.prompt_tokens)))
        elif op == "free" and seq_id in held:
            s, n = held.pop(seq_id)
            alloc.free(seq_id)
            history["inserted"].append(tokens(s, n))
        elif op == "fork" and seq_id in held and args[0] not in held:
            before = alloc.breakdown(None)
            if alloc.fork(seq_id, args[0]):
                held[args[0]] = held[seq_id]
                history["inserted"].append(tokens(*held[seq_id]))
            else:
                assert alloc.breakdown(None) == before
        elif op == "evict" and alloc.allocate(seq_id, SeqShape(args[0], 0), args[0]):
            alloc.check_invariants()
            alloc.free(seq_id)  # unique content: leaves nothing cached
        alloc.check_invariants()
        b = alloc.breakdown(None)
        # Forks may share a partial block: its unfilled slots are shared slots too.
        assert b.token <= sum(n for _, n in held.values()) <= b.token + b.shared
        if isinstance(alloc, RadixCacheAllocator):  # token granular: all shared are tokens
            assert b.token + b.shared == sum(n for _, n in held.values())
        assert alloc.breakdown((SeqShape(16, 0, POOLS[2]), 17, 0)).capacity == alloc.capacity
    for seq_id in list(held):
        alloc.free(seq_id)
        alloc.check_invariants()
    assert alloc.breakdown(None) == Breakdown(0, 0, 0, 0, 0, alloc.capacity)


@pytest.mark.parametrize("num_blocks, block_size", [(6, 4), (12, 2), (40, 1)])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_hash_cache_random_operations(num_blocks, block_size, ops):
    alloc = PrefixCachingPagedAllocator(num_blocks, block_size)
    run_ops(alloc, ops)
    assert sorted(alloc.free_blocks) == list(range(num_blocks))
    assert all(alloc.ref_count(b) == 0 for b in range(num_blocks))


class Twins:
    """Two allocators driven alike: every answer, and the free queue and cached blocks
    after each call, must agree."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __getattr__(self, name):
        fa, fb = getattr(self.a, name), getattr(self.b, name)
        if not callable(fa):
            assert fa == fb, name
            return fa

        def both(*args):
            ra, rb = fa(*args), fb(*args)
            assert ra == rb, name
            assert self.a.free_blocks == self.b.free_blocks and self.a.cached_blocks == self.b.cached_blocks
            return ra

        return both


@pytest.mark.parametrize("num_blocks, block_size", [(6, 4), (12, 2), (40, 1)])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_forgetting_keys_nothing_holds_changes_no_answer(num_blocks, block_size, ops):
    forgetful, keeping = (PrefixCachingPagedAllocator(num_blocks, block_size) for _ in range(2))
    free = forgetful.free

    def free_and_forget(seq_id):  # at every free, not only once the keys have grown
        free(seq_id)
        forgetful._forget_keys()

    forgetful.free = free_and_forget
    keeping._forget_keys = lambda: None
    run_ops(Twins(forgetful, keeping), ops)


def test_a_running_sequence_keeps_the_keys_of_blocks_it_has_yet_to_fill():
    # A has prefilled the first of its prompt's two documents; its chain already names
    # the second's blocks, which no block holds yet. Forgetting keys (at the other
    # request's free) must keep them, or A would cache them under keys that a later
    # lookup of the same prompt no longer makes.
    forgetful, keeping = (PrefixCachingPagedAllocator(num_blocks=16, block_size=4) for _ in range(2))
    keeping._forget_keys = lambda: None
    twins = Twins(forgetful, keeping)
    prompt = SeqShape(16, 0, ((1, 8), (2, 8)), -1)
    assert twins.allocate(0, prompt, 8)
    assert twins.allocate(1, SeqShape(12, 0, ((3, 12),), -1), 12)
    twins.free(1)
    forgetful._forget_keys()
    assert twins.grow(0, 16)
    assert twins.match_prefix(SeqShape(17, 0, ((1, 8), (2, 8)), -1), 17) == 16


@pytest.mark.parametrize(
    "case",
    ["vllm-v1", "v1 prefix groups", "v1 rag", "v1 conversation", "v1 samples", "v0 beams", "sglang lpm prefix groups"],
)
def test_forgetting_keys_at_every_free_changes_no_table(case, monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario(**CASES[case], policies=[p for p in POLICIES if p["name"] == "paged-8-prefix"])
    forget, free = PrefixCachingPagedAllocator._forget_keys, PrefixCachingPagedAllocator.free
    monkeypatch.setattr(PrefixCachingPagedAllocator, "_forget_keys", lambda self: None)
    keeping = run(doc, exact=False)

    def free_and_forget(self, seq_id):
        free(self, seq_id)
        forget(self)

    monkeypatch.setattr(PrefixCachingPagedAllocator, "free", free_and_forget)
    assert_same(keeping, run(doc, exact=False))


def test_keys_are_kept_in_proportion_to_the_pool_not_to_the_requests_seen():
    alloc = PrefixCachingPagedAllocator(num_blocks=8, block_size=4)
    for i in range(400):  # the system prompt, then 8 tokens no other request has
        assert alloc.allocate(i, shaped(16, 0, tail=1000 + i), 16)
        alloc.free(i)
    names = alloc._names
    assert names.next > 800  # two keys for each request's own blocks
    assert sum(map(len, names.runs.values())) + len(names.ids) <= (KEYS_SLACK + 2) * 8
    assert alloc.match_prefix(shaped(16, 0, tail=1), 16) == 8  # the system prompt still hits
    assert alloc.match_prefix(shaped(16, 0, tail=1399), 16) == 12  # and the last request's blocks
    alloc.check_invariants()


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=150, deadline=None)
@given(pages=st.integers(20, 60), ops=OPS)
def test_radix_random_operations(page, pages, ops):
    alloc = RadixCacheAllocator(pages // page * page, page)
    run_ops(alloc, ops)
    assert all(ref == 0 for _, _, ref in alloc.nodes())


def hash_model(block_size: int):
    def expected(s: SeqShape, n: int, history) -> int:
        # Every full block ever filled stays cached: the pool never has to evict.
        best = max((common(tokens(s, n - 1), seen) for seen in history["filled"]), default=0)
        return best // block_size * block_size

    return expected


def radix_model(page: int):
    def expected(s: SeqShape, n: int, history) -> int:
        # The tree holds exactly the whole pages of what was inserted (freed or forked
        # sequences' tokens, running ones' prefilled prompts) up to the first unique
        # token; a lookup matches whole pages of the first n - 1 tokens.
        query = tokens(s, n - 1)
        query = query[: len(query) // page * page]
        best = max((common(query, seen[: len(seen) // page * page]) for seen in history["inserted"]), default=0)
        return best // page * page

    return expected


@pytest.mark.parametrize("block_size", [1, 4])
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_hash_cache_matches_every_filled_block(block_size, ops):
    run_ops(PrefixCachingPagedAllocator(5000, block_size), ops, hash_model(block_size))


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_radix_matches_every_inserted_prefix(page, ops):
    run_ops(RadixCacheAllocator(5000 // page * page, page), ops, radix_model(page))
