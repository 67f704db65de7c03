"""The KV tiers as plain objects: replacement order, write-through, loads and names."""

import random

import pytest

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.tier_policies import ARCPolicy, LRUPolicy
from kvsim.kvcache.tiers import ChunkNames, TierSpec, TierStore


def make_store(cpu=4, disk=0, policy="lru", chunk_tokens=16, chunk_bytes=100.0, link=1000.0, disk_bytes_s=50.0):
    specs = [TierSpec("cpu", cpu, policy), TierSpec("disk", disk, "lru", disk_bytes_s)]
    return TierStore(specs, chunk_tokens, chunk_bytes, link)


def shape(content: int, tokens: int) -> SeqShape:
    return SeqShape(tokens, 1, ((content, tokens),), -1)


# --- policies ---------------------------------------------------------------------


def test_lru_evicts_the_least_recent_and_skips_protected():
    p = LRUPolicy(3)
    for k in (1, 2, 3):
        p.insert(k)
    p.touch(1)
    assert list(p) == [2, 3, 1]
    assert p.victims(1) == [2]
    assert p.victims(2, {2}) == [3, 1]
    assert p.victims(3, {2}) is None and p.victims(0) == []
    p.evict(2)
    assert list(p) == [3, 1]


def test_arc_promotes_reuse_and_learns_from_ghosts():
    p = ARCPolicy(2)
    p.insert(1)
    p.insert(2)
    p.touch(1)  # seen twice: T2
    assert list(p.t1) == [2] and list(p.t2) == [1]
    assert p.victims(1) == [2]  # |T1| = 1 >= target 0: T1's oldest
    assert p.victims(2) == [2, 1]  # then T1 is below its target: T2's
    p.evict(2)
    assert list(p.b1) == [2]
    p.insert(2)  # a B1 ghost: T1's target grows by max(1, 0/1)
    assert p.target_t1 == 1.0 and 2 in p.t1 and not p.b1
    p.insert(3)
    assert p.victims(1) == [2]  # |T1| = 2 >= 1
    p.evict(2)
    p.evict(3)
    assert list(p.b1) == [2, 3]
    p.touch(1)
    p.evict(1)
    assert list(p.b2) == [1]
    p.insert(1)  # a B2 ghost: the target shrinks by max(1, 2/1)
    assert p.target_t1 == 0.0


def test_arc_bounds_its_ghost_lists_by_capacity():
    p = ARCPolicy(2)
    for k in range(5):
        p.insert(k)
        p.evict(k)
    assert list(p.b1) == [3, 4]


# --- names -------------------------------------------------------------------------


def test_equal_prefixes_get_equal_names_and_unique_content_none():
    names = ChunkNames(16)
    a = SeqShape(40, 8, ((7, 32),), 100)
    b = SeqShape(40, 8, ((7, 32),), 200)
    na, nb = names.of(a), names.of(b)
    assert len(na) == 3 and na[:2] == nb[:2] and na[2] != nb[2]
    assert names.of(SeqShape(40, 8, ((7, 20),), -1)) == [na[0]]  # chunk 2 holds content -1
    # the same tokens split into pieces differently are the same chunks
    assert names.of(SeqShape(32, 1, ((7, 32),), -1))[:2] == na[:2]


def test_pruning_forgets_only_what_no_tier_holds():
    names = ChunkNames(16)
    names._prune_after = 0
    kept = names.of(shape(1, 48))
    gone = names.of(shape(2, 48))
    names.prune({kept[2]})  # its parents hang above it: kept too
    assert all(names.known(n) for n in kept) and not any(names.known(n) for n in gone)
    assert names.of(shape(1, 48)) == kept
    assert names.of(shape(2, 48))[0] > max(kept + gone)  # seen again: a new name


# --- the store ----------------------------------------------------------------------


def test_write_through_fills_every_tier_and_evicts_the_tail_first():
    s = make_store(cpu=3, disk=4)
    a, b = s.names.of(shape(1, 48)), s.names.of(shape(2, 32))
    s.store(a)
    s.store(b)  # the host tier evicts a's tail, then the disk
    cpu, disk = s.tiers
    assert list(cpu.held) == [a[0], b[1], b[0]]
    assert list(disk.held) == [a[1], a[0], b[1], b[0]]
    assert (cpu.written, cpu.evicted, disk.written, disk.evicted) == (5, 2, 5, 1)
    assert s.find(shape(1, 48), 0) == ((a[0], 0), (a[1], 1))
    assert s.find(shape(1, 48), 1) == ((a[1], 1),)


def test_a_store_larger_than_what_can_be_evicted_stores_nothing():
    s = make_store(cpu=2, disk=4)
    s.store(s.names.of(shape(1, 48)))  # three new chunks, room for two
    assert s.occupancy() == [0, 0]


def test_a_load_takes_link_and_disk_time_and_promotes_disk_hits():
    s = make_store(cpu=3, disk=4, chunk_bytes=100.0, link=1000.0, disk_bytes_s=50.0)
    a, b = s.names.of(shape(1, 48)), s.names.of(shape(2, 32))
    s.store(a)
    s.store(b)
    hits = s.find(shape(1, 48), 0)
    seconds = s.load(hits, 150.0)  # a chunk and a half copied, one read off disk
    assert seconds == pytest.approx(150 / 1000 + 100 / 50)
    cpu, disk = s.tiers
    assert list(cpu.held) == [b[0], a[1], a[0]]  # a[1] promoted: b's tail went
    assert s.hit_chunks == [1, 1] and (cpu.read, disk.read) == (1, 1)
    assert s.load_s == pytest.approx(seconds)


def test_storing_what_a_tier_holds_is_a_reuse_not_a_write():
    s = make_store(cpu=4)
    a = s.names.of(shape(1, 32))
    s.store(a)
    s.store(a)
    assert s.tiers[0].written == 2


def test_a_zero_sized_tier_is_no_tier():
    s = make_store(cpu=0, disk=0)
    assert s.tiers == []
    s.store(s.names.of(shape(1, 32)))
    assert s.find(shape(1, 32), 0) == ()


def test_a_disk_only_store_reads_at_the_disks_bandwidth():
    s = make_store(cpu=0, disk=4, chunk_bytes=100.0, link=1000.0, disk_bytes_s=50.0)
    s.store(s.names.of(shape(1, 16)))
    assert s.load(s.find(shape(1, 16), 0), 100.0) == pytest.approx(0.1 + 2.0)


def test_invariants_catch_an_overfull_tier():
    s = make_store(cpu=1)
    s.tiers[0].held.insert(5)
    s.tiers[0].held.insert(6)
    with pytest.raises(InvariantError):
        s.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_random_walk_against_a_reference(policy):
    """Stores and loads at random: capacity holds, and every hit is of a chunk some tier
    holds by the reference's account (which replays every put and eviction)."""
    rng = random.Random(3)
    s = make_store(cpu=5, disk=9, policy=policy)
    s.names._prune_after = 8
    shapes = [SeqShape(16 * rng.randint(1, 6), 1, ((rng.randint(0, 3), 16 * 6),), -1) for _ in range(12)]
    for _ in range(400):
        sh = rng.choice(shapes)
        if rng.random() < 0.5:
            s.store(s.names.of(sh))
        else:
            hits = s.find(sh, rng.randint(0, 2))
            held = [set(t.held) for t in s.tiers]
            assert all(name in held[where] for name, where in hits)
            s.load(hits, 100.0 * len(hits))
        s.check_invariants()
        for t in s.tiers:
            assert len(t) <= t.spec.capacity_chunks


# --- the GPU prefix cache with tiers behind it ---------------------------------------

from kvsim.kvcache.tiered import TieredPrefixCachingAllocator  # noqa: E402


def make_tiered(num_blocks=4, block_size=4, cpu=8, disk=0, chunk_tokens=4):
    store = TierStore(
        [TierSpec("cpu", cpu), TierSpec("disk", disk, "lru", 10.0)], chunk_tokens, chunk_tokens * 1.0, 100.0
    )
    return TieredPrefixCachingAllocator(num_blocks, block_size, store, block_size * 1.0)


def test_prompt_chunks_go_to_the_tier_as_they_are_cached_and_come_back_after_eviction():
    a = make_tiered(num_blocks=4)
    doc = SeqShape(13, 2, ((5, 12),), 100)  # three full blocks of shared content
    assert a.allocate(0, doc, 13)
    assert a.store.occupancy() == [3]  # the prompt's full chunks, at once
    a.free(0)  # the tail's chunk: content of its own
    assert a.store.occupancy() == [3]
    other = SeqShape(16, 1, ((9, 16),), -1)
    assert a.allocate(1, other, 16)  # takes every block: the GPU forgets doc
    a.free(1)
    assert a.match_prefix(doc, 13) == 12  # all from the tier
    assert a.allocate(2, doc, 13)
    assert a.tier_hit_tokens == [12]
    assert a.take_load_s() == pytest.approx(12 / 100) and a.take_load_s() == 0.0
    a.check_invariants()


def test_gpu_hits_come_first_and_the_tier_continues_where_they_stop():
    a = make_tiered(num_blocks=6, chunk_tokens=8)
    doc = SeqShape(17, 1, ((5, 16),), -1)
    assert a.allocate(0, doc, 17)
    a.free(0)
    assert a.store.occupancy() == [2]
    # one request evicts doc's deepest blocks from the GPU: its head stays
    assert a.allocate(1, SeqShape(16, 1, ((9, 16),), -1), 16)
    a.free(1)
    assert a.match_prefix(doc, 17) == 16  # blocks 0-1 on the GPU, 2-3 from the tier
    assert a.allocate(2, doc, 17)
    assert a.tier_hit_tokens == [8]
    assert a.take_load_s() == pytest.approx(8 / 100)  # only the blocks the GPU lacked
    a.check_invariants()


def test_a_chunk_the_gpu_holds_in_part_is_copied_in_part():
    a = make_tiered(num_blocks=8, chunk_tokens=8)
    doc = SeqShape(17, 1, ((5, 16),), -1)
    assert a.allocate(0, doc, 17)
    a.free(0)
    # evict doc's fourth block but not its third: the next 5 blocks are the uncached
    # tail block (freed to the head), the three never used and doc's block 3
    queue = list(a._free)
    assert queue[:5] == [4, 5, 6, 7, 3]
    assert a.allocate(1, SeqShape(20, 1, ((9, 20),), -1), 20)
    a.free(1)
    assert a.match_prefix(doc, 17) == 16
    assert a.allocate(2, doc, 17)
    assert a.tier_hit_tokens == [4]  # chunk 1's first half was on the GPU
    assert a.take_load_s() == pytest.approx(4 / 100)


def test_tiers_of_zero_bytes_change_nothing():
    from kvsim.kvcache.prefix import PrefixCachingPagedAllocator

    plain, tiered = PrefixCachingPagedAllocator(4, 4), make_tiered(num_blocks=4, cpu=0)
    for alloc in (plain, tiered):
        for i, content in enumerate((5, 9, 5)):
            sh = SeqShape(13, 2, ((content, 12),), 100 + i)
            assert alloc.allocate(i, sh, 13)
            alloc.free(i)
    assert plain.match_prefix(SeqShape(13, 1, ((5, 12),), -1), 13) == tiered.match_prefix(
        SeqShape(13, 1, ((5, 12),), -1), 13
    )
    assert tiered.take_load_s() == 0.0


def reference_victims(p, n, protected):
    """The victims one at a time: LRU's oldest unprotected; ARC's T1 while it is at or
    above its target (counted down), else T2, else T1."""
    if isinstance(p, LRUPolicy):
        idle = [k for k in p if k not in protected]
        return idle[:n] if len(idle) >= n else None
    t1 = [k for k in p.t1 if k not in protected]
    t2 = [k for k in p.t2 if k not in protected]
    out, size = [], len(p.t1)
    for _ in range(n):
        if size >= int(p.target_t1) and t1:
            out.append(t1.pop(0))
            size -= 1
        elif t2:
            out.append(t2.pop(0))
        elif t1:
            out.append(t1.pop(0))
            size -= 1
        else:
            return None
    return out


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_bulk_operations_are_the_one_key_operations_in_order(cls):
    """insert_all, use_all, victims and evict_all against insert, touch and evict one key
    at a time (the reference), over random batches."""
    rng = random.Random(11)
    bulk, ref = cls(6), cls(6)
    for _ in range(300):
        keys = rng.sample(range(20), rng.randint(1, 5))
        held = [k for k in keys if k in ref]
        room = len(ref) + len(keys) - len(held) - 6
        victims = reference_victims(ref, room, set(keys)) if room > 0 else []
        assert bulk.victims(room, set(keys)) == victims
        if victims is None:
            continue
        for v in victims:
            ref.evict(v)
        bulk.evict_all(victims)
        for k in keys:
            ref.touch(k) if k in held else ref.insert(k)
        if held:
            bulk.use_all(keys)
        else:
            bulk.insert_all(keys)
        assert list(bulk) == list(ref) and len(bulk) == len(ref)
        if cls is ARCPolicy:
            assert (list(bulk.b1), list(bulk.b2), bulk.target_t1) == (list(ref.b1), list(ref.b2), ref.target_t1)
