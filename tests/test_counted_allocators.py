"""What the fast path asks allocators (kvsim.kvcache.base.CountedAllocator): how far a
sequence may grow by counting alone (room), by counting and taking whole blocks in bulk
(block_room, take_free, extend), its share of the breakdown (slots_of) and the free part
of the breakdown alone (pool_free). Expected values are worked out by hand from the
allocators' documented accounting (kvsim/kvcache/base.py, paged.py, contiguous.py).
"""

import random

import pytest

from kvsim.kvcache import ContiguousAllocator, PagedAllocator, PrefixCachingPagedAllocator, SeqShape
from kvsim.kvcache.base import split_used


def test_paged_room_is_the_rest_of_its_last_block_up_to_its_final_length():
    a = PagedAllocator(10, 4)
    a.allocate(1, SeqShape(5, 5), 5)  # 5 tokens in 2 blocks of 4: 3 slots left
    assert a.room(1) == 3
    a.allocate(2, SeqShape(5, 1), 5)  # final 6: only 1 more token ever
    assert a.room(2) == 1
    a.allocate(3, SeqShape(8, 4), 8)  # a full last block: the next token needs a block
    assert a.room(3) == 0
    assert (a.block_room(1), a.block_room(2), a.block_room(3)) == (5, 1, 4)  # to the final length
    assert a.slots_of(1) == (8, 0)


def test_paged_room_is_zero_where_the_next_token_copies_or_slides():
    a = PagedAllocator(10, 4)
    a.allocate(1, SeqShape(5, 5), 5)
    a.fork(1, 2)  # the partly filled last block is shared
    assert a.room(1) == a.room(2) == 0 == a.block_room(1)
    w = PagedAllocator(10, 4, window=8)
    w.allocate(1, SeqShape(5, 20), 5)
    assert w.room(1) == 0 == w.block_room(1)


def test_prefix_cache_room_stops_before_the_token_that_fills_a_block():
    a = PrefixCachingPagedAllocator(10, 4)
    a.allocate(1, SeqShape(5, 5, (), 7), 5)  # 3 slots left; filling the 3rd caches the block
    assert a.room(1) == 2
    assert a.block_room(1) == 2  # a block off the queue may be a cached one
    a.allocate(2, SeqShape(5, 1, (), 8), 5)  # never fills its block: no stop
    assert a.room(2) == 1


@pytest.mark.parametrize("reserve, room", [("max", 10), ("pow2", 10), ("oracle", 10)])
def test_contiguous_room_is_up_to_its_final_length_within_its_region(reserve, room):
    a = ContiguousAllocator(200, 64, reserve, "first-fit")
    a.allocate(1, SeqShape(5, 10), 5)  # final 15; max 64, pow2 5+16=21, oracle 15
    assert a.room(1) == room
    requested = {"max": 64, "pow2": 21, "oracle": 15}[reserve]
    assert a.slots_of(1) == (requested, 0)
    b = ContiguousAllocator(200, 64, "oracle", "buddy")
    b.allocate(1, SeqShape(5, 10), 5)  # 15 asked, a buddy block of 16: 1 slot padding
    assert b.slots_of(1) == (15, 1)


def test_pool_free_is_the_breakdowns_free_part():
    a = PagedAllocator(10, 4)
    a.allocate(1, SeqShape(20, 5), 20)  # 5 blocks used, 5 free
    assert a.pool_free(None) == (0, 20, False)
    assert a.pool_free((SeqShape(16, 1), 17, 0)) == (0, 20, False)  # 5 blocks: fits
    assert a.pool_free((SeqShape(24, 1), 21, 0)) == (20, 0, True)  # 6 blocks: starved
    assert a.pool_free((SeqShape(16, 1), 16, 4)) == (0, 20, False)  # 4 + 1 kept free: fits
    assert a.pool_free((SeqShape(16, 1), 16, 5)) == (20, 0, True)  # 4 + 2 kept free: starved
    c = ContiguousAllocator(100, 64, "oracle", "first-fit")
    c.allocate(1, SeqShape(30, 10), 30)  # [0, 40) used, one hole of 60
    c.allocate(2, SeqShape(10, 10), 10)  # [40, 60)
    c.free(1)  # holes: 40 at the start, 40 at the end
    assert c.pool_free((SeqShape(35, 10), 35, 0)) == (80, 0, True)  # 45 fits neither
    assert c.pool_free((SeqShape(20, 10), 20, 0)) == (0, 80, False)


def test_take_free_and_extend_grow_a_sequence_as_grow_does():
    a, b = PagedAllocator(20, 4), PagedAllocator(20, 4)
    for x in (a, b):
        x.allocate(1, SeqShape(5, 20), 5)
    a.grow(1, 13)  # 5 -> 13 tokens: blocks 2 -> 4
    b.extend(1, 13, b.take_free(2))
    assert a.breakdown(None) == b.breakdown(None)
    assert b.tokens_of(1) == 13 and len(b.block_table(1)) == 4
    b.check_invariants()


def test_extend_refuses_the_wrong_number_of_blocks():
    a = PagedAllocator(20, 4)
    a.allocate(1, SeqShape(5, 20), 5)
    with pytest.raises(ValueError):
        a.extend(1, 13, a.take_free(1))  # 13 tokens need 2 more blocks


@pytest.mark.parametrize(
    "make",
    [
        lambda: PagedAllocator(64, 4),
        lambda: PrefixCachingPagedAllocator(64, 4),
        lambda: ContiguousAllocator(256, 64, "pow2", "buddy"),
        lambda: ContiguousAllocator(256, 64, "max", "first-fit"),
    ],
    ids=["paged", "prefix", "contiguous-buddy", "contiguous-max"],
)
def test_growing_within_room_turns_reservation_into_tokens_and_nothing_else(make):
    """The contract the lazy scheduler relies on, over random sequences and growth."""
    rng = random.Random(3)
    a = make()
    shapes = {}
    for sid in range(6):
        shape = SeqShape(rng.randint(1, 20), rng.randint(1, 20), (), sid)
        if a.allocate(sid, shape, shape.prompt_tokens):
            shapes[sid] = shape
    for _ in range(200):
        sid = rng.choice(list(shapes))
        room = a.room(sid)
        before = a.breakdown(None)
        slots = a.slots_of(sid)
        if room:
            d = rng.randint(1, room)
            a.grow(sid, a.tokens_of(sid) + d)
            after = a.breakdown(None)
            assert after.token == before.token + d and after.reservation == before.reservation - d
            assert (after.internal, after.padding, after.free, after.shared) == (
                before.internal,
                before.padding,
                before.free,
                before.shared,
            )
            assert a.slots_of(sid) == slots
        elif a.tokens_of(sid) < shapes[sid].final_tokens:
            a.grow(sid, a.tokens_of(sid) + 1)
        # every sequence's share of the breakdown, as slots_of gives it
        shares = [split_used(a.tokens_of(s), *a.slots_of(s)[:1], shapes[s].final_tokens) for s in shapes]
        b = a.breakdown(None)
        assert b.reservation == sum(r for _, r, _ in shares) and b.internal == sum(i for _, _, i in shares)
        assert b.padding == sum(a.slots_of(s)[1] for s in shapes)
        assert a.pool_free(None) == (b.unusable, b.free, False)
