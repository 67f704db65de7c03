"""Exact block ids, holes and breakdowns on small hand-worked cases, per allocator."""

import random

import pytest

from kvsim.kvcache import (
    ALLOCATORS,
    Breakdown,
    ContiguousAllocator,
    InvariantError,
    PagedAllocator,
    SeqShape,
    make_allocator,
)
from kvsim.kvcache.contiguous import next_power_of_two
from kvsim.model.specs import MODEL_PRESETS, KVSpec


def shape(prompt: int, output: int) -> SeqShape:
    return SeqShape(prompt, output)


def contiguous(
    capacity: int, reserve: str = "oracle", placement: str = "first-fit", max_model_len: int = 64
) -> ContiguousAllocator:
    return ContiguousAllocator(capacity, max_model_len, reserve, placement)


def admit(alloc, seq_id: int, prompt: int, output: int = 0) -> bool:
    """Admit a sequence with its whole prompt, as the scheduler does."""
    return alloc.allocate(seq_id, shape(prompt, output), prompt)


# -- paged ------------------------------------------------------------------------------


@pytest.fixture
def paged():
    """8 blocks of 4 slots, holding seq 2 (5 of 13 tokens) and seq 3 (9 of 9),
    after seq 1 was freed: free queue [5, 6, 7]."""
    alloc = PagedAllocator(num_blocks=8, block_size=4)
    assert admit(alloc, 1, 5, 3)
    assert admit(alloc, 2, 3, 10)
    assert alloc.block_table(1) == [0, 1]
    assert alloc.block_table(2) == [2]
    assert alloc.free_blocks == [3, 4, 5, 6, 7]
    assert alloc.grow(1, 8)  # last block fills: no new block
    assert alloc.grow(2, 5)  # crosses a block boundary
    assert alloc.block_table(1) == [0, 1]
    assert alloc.block_table(2) == [2, 3]
    alloc.free(1)
    assert alloc.free_blocks == [1, 0, 4, 5, 6, 7]  # deepest first, at the head (vLLM 0.33.0)
    assert admit(alloc, 3, 9)
    assert alloc.block_table(3) == [1, 0, 4]
    alloc.check_invariants()
    return alloc


def test_paged_tables_and_free_queue(paged):
    assert paged.free_blocks == [5, 6, 7]
    assert paged.capacity == 32


def test_paged_breakdown(paged):
    # seq 2: 5 tokens in 8 slots, final 13 -> 3 reserved; seq 3: 9 in 12, final 9.
    assert paged.breakdown(None) == Breakdown(14, 3, 3, 0, 0, 12)
    # 3 free blocks serve a 12-token request but not a 13-token one.
    assert paged.breakdown((shape(12, 0), 12, 0)) == Breakdown(14, 3, 3, 0, 0, 12)
    assert paged.breakdown((shape(13, 0), 13, 0)) == Breakdown(14, 3, 3, 0, 12, 0, starved=True)


def test_paged_failures_change_nothing(paged):
    assert not paged.grow(2, 21)  # needs 4 more blocks, 3 free
    assert not admit(paged, 4, 13)
    assert paged.block_table(2) == [2, 3]
    assert paged.free_blocks == [5, 6, 7]
    assert paged.breakdown(None) == Breakdown(14, 3, 3, 0, 0, 12)
    assert paged.grow(2, 20)  # exactly the 3 free blocks
    assert paged.block_table(2) == [2, 3, 5, 6, 7]
    assert paged.free_blocks == []


def test_paged_free_all_returns_every_block(paged):
    paged.free(3)
    paged.free(2)
    assert paged.free_blocks == [3, 2, 4, 0, 1, 5, 6, 7]
    assert paged.breakdown(None) == Breakdown(0, 0, 0, 0, 0, 32)


def test_paged_unfit_reason():
    alloc = PagedAllocator(num_blocks=8, block_size=4)
    assert alloc.unfit_reason(shape(30, 2)) is None
    assert alloc.unfit_reason(shape(30, 3)) == "final length exceeds KV pool"


def test_paged_invariants_name_the_block(paged):
    paged._seqs[2].table.append(7)  # also still in the free queue
    with pytest.raises(InvariantError, match="block 7"):
        paged.check_invariants()


# -- contiguous, first-fit ---------------------------------------------------------------


def test_first_fit_carves_lowest_hole_and_coalesces():
    alloc = contiguous(16)
    assert admit(alloc, 1, 3, 1) and alloc.region(1) == (0, 4)
    assert admit(alloc, 2, 4, 2) and alloc.region(2) == (4, 6)
    assert admit(alloc, 3, 2, 2) and alloc.region(3) == (10, 4)
    assert alloc.holes() == [(14, 2)]
    alloc.free(2)
    assert alloc.holes() == [(4, 6), (14, 2)]
    assert admit(alloc, 4, 2, 1) and alloc.region(4) == (4, 3)
    assert alloc.holes() == [(7, 3), (14, 2)]
    alloc.free(1)
    assert alloc.holes() == [(0, 4), (7, 3), (14, 2)]
    alloc.free(4)  # merges left and right
    assert alloc.holes() == [(0, 10), (14, 2)]
    alloc.free(3)
    assert alloc.holes() == [(0, 16)]
    alloc.check_invariants()


def test_first_fit_external_fragmentation_from_real_holes():
    alloc = contiguous(16)
    for seq_id, (prompt, output) in enumerate([(3, 1), (4, 2), (2, 2)]):
        assert admit(alloc, seq_id, prompt, output)
    alloc.free(1)
    assert alloc.holes() == [(4, 6), (14, 2)]
    # 8 slots are free, but no hole holds the 7 this request reserves.
    assert not admit(alloc, 9, 5, 2)
    assert alloc.holes() == [(4, 6), (14, 2)]
    assert alloc.breakdown(None) == Breakdown(5, 3, 0, 0, 0, 8)
    assert alloc.breakdown((shape(5, 2), 5, 0)) == Breakdown(5, 3, 0, 0, 8, 0, starved=True)
    # A 6-slot request fits the middle hole only: the 2-slot tail is unusable.
    assert alloc.breakdown((shape(4, 2), 4, 0)) == Breakdown(5, 3, 0, 0, 2, 6)


# -- reserve rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reserve, size, internal",
    [
        ("max", 100, 65),  # max_model_len whatever the request
        ("pow2", 42, 7),  # 10 + 32: the 25-token output rounds up to 32
        ("oracle", 35, 0),  # exactly prompt + output
    ],
)
def test_reserve_rules(reserve, size, internal):
    alloc = contiguous(256, reserve, max_model_len=100)
    assert admit(alloc, 1, 10, 25)
    assert alloc.region(1) == (0, size)
    assert alloc.breakdown(None) == Breakdown(10, 25, internal, 0, 0, 256 - size)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 25, 32, 33)] == [1, 1, 2, 4, 32, 32, 64]


def test_pow2_is_capped_at_max_model_len():
    alloc = contiguous(256, "pow2", max_model_len=100)
    assert admit(alloc, 1, 80, 25)  # 80 + 32 = 112 > 100
    assert alloc.region(1) == (0, 100)


def test_reservation_never_below_tokens_held():
    alloc = contiguous(64, "oracle")
    assert alloc.allocate(1, shape(10, 5), 20)
    assert alloc.region(1) == (0, 20)


def test_grow_stops_at_the_reservation():
    alloc = contiguous(64, "oracle")
    assert admit(alloc, 1, 10, 25)
    assert alloc.grow(1, 35)
    before = alloc.breakdown(None)
    assert not alloc.grow(1, 36)  # regions never move or grow
    assert alloc.breakdown(None) == before == Breakdown(35, 0, 0, 0, 0, 29)


def test_contiguous_unfit_reason():
    assert contiguous(256, "max", max_model_len=300).unfit_reason(shape(1, 1)) == "reservation exceeds KV pool"
    assert contiguous(256, "max", max_model_len=256).unfit_reason(shape(1, 1)) is None
    # 9 slots fit a 12-slot first-fit pool, but buddy rounds to 16 > its 8-slot arena.
    assert contiguous(12, "oracle", "first-fit").unfit_reason(shape(9, 0)) is None
    assert contiguous(12, "oracle", "buddy").unfit_reason(shape(9, 0)) == "reservation exceeds KV pool"
    assert contiguous(12, "oracle", "buddy").unfit_reason(shape(8, 0)) is None


def test_unknown_reserve_or_placement_lists_valid_names():
    with pytest.raises(ValueError, match="max, oracle, pow2"):
        contiguous(16, "median")
    with pytest.raises(ValueError, match="buddy, first-fit"):
        contiguous(16, placement="best-fit")


# -- contiguous, buddy -------------------------------------------------------------------


def test_buddy_splits_pads_and_coalesces():
    alloc = contiguous(16, placement="buddy")
    assert admit(alloc, 1, 3) and alloc.region(1) == (0, 4)  # 16 -> 8 -> 4
    assert alloc.holes() == [(4, 4), (8, 8)]
    assert admit(alloc, 2, 5) and alloc.region(2) == (8, 8)
    assert admit(alloc, 3, 2) and alloc.region(3) == (4, 2)  # splits [4, 8)
    assert alloc.holes() == [(6, 2)]
    # Round-ups 1 + 3 + 0 are padding; the 2-slot block is too small for 3 tokens.
    assert alloc.breakdown(None) == Breakdown(10, 0, 0, 4, 0, 2)
    assert alloc.breakdown((shape(3, 0), 3, 0)) == Breakdown(10, 0, 0, 4, 2, 0, starved=True)
    alloc.free(1)  # buddy [4, 8) is split: no merge
    assert alloc.holes() == [(0, 4), (6, 2)]
    alloc.free(3)  # [4,6)+[6,8), then +[0,4)
    assert alloc.holes() == [(0, 8)]
    alloc.free(2)
    assert alloc.holes() == [(0, 16)]
    alloc.check_invariants()


def test_buddy_fragmentation_between_non_buddies():
    alloc = contiguous(16, placement="buddy")
    for seq_id in range(4):
        assert admit(alloc, seq_id, 4)
    alloc.free(1)
    alloc.free(2)  # [4, 8) and [8, 12) are not buddies
    assert alloc.holes() == [(4, 4), (8, 4)]
    assert not admit(alloc, 9, 8)
    assert alloc.holes() == [(4, 4), (8, 4)]
    assert alloc.breakdown((shape(8, 0), 8, 0)) == Breakdown(8, 0, 0, 0, 8, 0, starved=True)
    assert admit(alloc, 5, 3) and alloc.region(5) == (4, 4)  # lowest address
    assert alloc.holes() == [(8, 4)]


def test_buddy_non_power_of_two_pool_uses_arenas():
    alloc = contiguous(12, placement="buddy")
    assert alloc.holes() == [(0, 8), (8, 4)]
    assert admit(alloc, 1, 4) and alloc.region(1) == (8, 4)  # smallest order first
    assert admit(alloc, 2, 4) and alloc.region(2) == (0, 4)
    assert alloc.holes() == [(4, 4)]
    alloc.free(1)  # its buddy [12, 16) is off the pool
    assert alloc.holes() == [(4, 4), (8, 4)]
    alloc.free(2)
    assert alloc.holes() == [(0, 8), (8, 4)]
    alloc.check_invariants()


def test_contiguous_invariants_catch_overlap():
    alloc = contiguous(16)
    assert admit(alloc, 1, 4) and admit(alloc, 2, 4)
    alloc._regions[2].start = 2  # corrupt: [2, 6) over [0, 4)
    with pytest.raises(InvariantError, match=r"seq 2 \[2, 6\) overlaps seq 1"):
        alloc.check_invariants()


# -- registry ----------------------------------------------------------------------------

KV = KVSpec(MODEL_PRESETS["llama-3-8b"], "bf16")  # 131072 bytes per token


def test_make_allocator_sizes_pools_from_bytes():
    pool = 100.5 * KV.bytes_per_token
    paged = make_allocator("paged", pool, KV, 64, block_size=16)
    assert (paged.num_blocks, paged.capacity) == (6, 96)
    flat = make_allocator("contiguous", pool, KV, 64, reserve="pow2", placement="buddy")
    assert flat.capacity == 100
    assert flat.holes() == [(0, 64), (64, 32), (96, 4)]


def test_make_allocator_unknown_kind_lists_valid_names():
    assert list(ALLOCATORS) == ["contiguous", "paged", "radix", "trtllm"]
    with pytest.raises(ValueError, match="contiguous, paged, radix, trtllm"):
        make_allocator("slab", 1e9, KV, 64)


def test_free_queues_keep_their_order_in_bulk():
    from kvsim.kvcache.free_queue import FreeQueue, LinkedFreeQueue

    tail = FreeQueue(3000)  # released blocks join the tail
    assert tail.take(2000) == list(range(2000))  # the head has passed half: the list is cut
    tail.put([5, 7])
    assert list(tail) == [*range(2000, 3000), 5, 7] and len(tail) == 1002
    assert tail.take(1001) == [*range(2000, 3000), 5] and list(tail) == [7]
    head = FreeQueue(4, to_head=True)  # each released block goes to the head
    assert list(head) == [0, 1, 2, 3] and head.take(2) == [0, 1]
    head.put([9, 8])
    assert list(head) == [8, 9, 2, 3] and head.take(3) == [8, 9, 2] and len(head) == 1
    linked = LinkedFreeQueue(4)
    linked.remove(2)
    linked.put([9])
    assert list(linked) == [0, 1, 3, 9] and linked.take(2) == [0, 1]


@pytest.mark.parametrize("seed", range(6))
def test_the_linked_queue_keeps_a_linked_lists_order(seed):
    """Removed entries stay in the list and are skipped: takes, puts and removals give
    what a doubly linked list (here an OrderedDict) gives, through many rebuilds when
    hits take blocks back faster than allocations pass them (removals dominate)."""
    from collections import OrderedDict

    from kvsim.kvcache.free_queue import LinkedFreeQueue

    rng = random.Random(seed)
    n = 3000
    queue, linked, out = LinkedFreeQueue(n), OrderedDict.fromkeys(range(n)), []
    rebuilds = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.1 and linked:
            count = rng.randint(1, len(linked))
            taken = queue.take(count)
            assert taken == [linked.popitem(last=False)[0] for _ in range(count)]
            out += taken
        elif op < 0.55 and out:
            rng.shuffle(out)
            blocks, out = out[:300], out[300:]
            queue.put(blocks)
            linked.update(dict.fromkeys(blocks))
        elif linked:
            for block in rng.sample(list(linked), min(len(linked), 200)):
                queue.remove(block)
                del linked[block]
                out.append(block)
                rebuilds += queue._removed == 0
        assert len(queue) == len(linked)
    assert list(queue) == list(linked)
    assert rebuilds > 3 and len(queue._ids) < 3 * n


def test_reference_counts_are_kept_from_the_first_shared_block():
    """Until a block is shared, the queue says every count (1 outside it, 0 in it), so
    none is kept; the first fork makes them, blocks taken for later growth included."""
    alloc = PagedAllocator(8, 4)
    assert admit(alloc, 1, 6, 6) and admit(alloc, 2, 4)
    alloc.free(2)
    taken = alloc.take_free(1)
    assert alloc._ref is None
    assert [alloc.ref_count(b) for b in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0] and taken == [2]
    alloc.extend(1, 9, taken)
    assert alloc.fork(1, 3) and alloc._ref == [2, 2, 2, 0, 0, 0, 0, 0]
    assert alloc.grow(3, 10) and alloc.block_table(3) == [0, 1, 3]  # copy on write
    assert [alloc.ref_count(b) for b in range(5)] == [2, 2, 1, 1, 0]
    alloc.check_invariants()
    alloc.free(1)
    alloc.free(3)
    assert alloc._ref == [0] * 8 and alloc.free_blocks == [3, 1, 0, 2, 4, 5, 6, 7]
    alloc.check_invariants()


def test_a_table_that_holds_a_block_twice_is_an_invariant_violation():
    """Sharing and dropping count each block of a table once (in bulk): a table naming a
    block twice must be caught, though every reference count agrees with the tables."""
    alloc = PagedAllocator(8, 4)
    assert alloc.allocate(1, shape(8, 0), 8) and alloc.block_table(1) == [0, 1]
    alloc._seqs[1].table = [0, 0]  # block 0 twice, its count 2; block 1 back in the queue
    alloc._ref, alloc._shared = [2] + [0] * 7, 1
    alloc._free.put([1])
    with pytest.raises(InvariantError, match=r"seq 1's table \[0, 0\] holds a block twice"):
        alloc.check_invariants()
