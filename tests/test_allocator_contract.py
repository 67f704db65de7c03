"""One contract every registered allocator keeps, in every configuration.

Only the KVAllocator Protocol is used here: whatever the allocator does inside, the
breakdown must account for every slot, failures must change nothing, and freeing
everything must give back an empty pool.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kvcache import ALLOCATORS, Breakdown, KVAllocator, SeqShape, make_allocator
from kvsim.kvcache.contiguous import PLACEMENTS, RESERVES
from kvsim.model.specs import MODEL_PRESETS, KVSpec

KV = KVSpec(MODEL_PRESETS["llama-3-8b"], "bf16")
POOL_SLOTS = 200  # not a power of two: buddy gets arenas 128 + 64 + 8
MAX_MODEL_LEN = 64

CONFIGS = (
    [("paged", {"block_size": b}) for b in (1, 16, 32)]
    + [("paged", {"block_size": b, "prefix_caching": True}) for b in (1, 16)]
    + [("radix", {}), ("radix", {"page_size": 16})]
    + [("contiguous", {"reserve": r, "placement": p}) for r in RESERVES for p in PLACEMENTS]
    # TensorRT-LLM's block manager: blocks of 8 split the pool exactly (it rounds blocks up)
    + [
        ("trtllm", {"block_size": 8}),
        ("trtllm", {"block_size": 8, "prefix_caching": False}),
        ("trtllm", {"block_size": 4, "partial_reuse": False}),
        ("trtllm", {"block_size": 8, "copy_on_partial_reuse": False, "host_cache_bytes": 48 * KV.bytes_per_token}),
    ]
)
IDS = ["-".join([kind, *(k if v is True else str(v) for k, v in opts.items())]) for kind, opts in CONFIGS]


def make(config):
    kind, options = config
    return make_allocator(kind, POOL_SLOTS * KV.bytes_per_token, KV, MAX_MODEL_LEN, **options)


@pytest.fixture(params=CONFIGS, ids=IDS)
def alloc(request):
    return make(request.param)


def empty(alloc) -> Breakdown:
    return Breakdown(0, 0, 0, 0, 0, alloc.capacity)


def checked(alloc, next_seq=(SeqShape(16, 16), 16, 0)) -> Breakdown:
    """Check invariants and that both views of the pool account for every slot."""
    alloc.check_invariants()
    for view in (None, next_seq):
        assert alloc.breakdown(view).capacity == alloc.capacity
    return alloc.breakdown(None)


def test_every_registered_allocator_is_covered():
    assert {kind for kind, _ in CONFIGS} == set(ALLOCATORS)


def test_it_has_everything_the_protocol_declares(alloc):
    """What an allocator can do is declared in KVAllocator, so nothing probes for it."""
    declared = {n for n in vars(KVAllocator) if not n.startswith("_")} | set(KVAllocator.__annotations__)
    assert sorted(n for n in declared if not hasattr(alloc, n)) == []


def test_new_pool_is_empty(alloc):
    assert alloc.capacity > 0
    assert checked(alloc) == empty(alloc)


def test_round_trip_returns_an_empty_pool(alloc):
    shapes = {1: SeqShape(10, 20), 2: SeqShape(5, 3), 3: SeqShape(30, 2)}
    for seq_id, s in shapes.items():
        assert alloc.allocate(seq_id, s, s.prompt_tokens)
        checked(alloc)
    for seq_id, s in shapes.items():
        for n in range(s.prompt_tokens + 1, s.final_tokens + 1):
            assert alloc.grow(seq_id, n)
            checked(alloc)
    assert checked(alloc).token == sum(s.final_tokens for s in shapes.values())
    for seq_id in (2, 1, 3):
        alloc.free(seq_id)
        checked(alloc)
    assert checked(alloc) == empty(alloc)


def fill(alloc, s: SeqShape) -> int:
    """Admit copies of `s` until one fails; return how many fit."""
    for seq_id in range(alloc.capacity + 1):
        if not alloc.allocate(seq_id, s, s.prompt_tokens):
            return seq_id
    raise AssertionError("pool never filled")


def test_failed_allocate_changes_nothing(alloc):
    s = SeqShape(20, 10)
    admitted = fill(alloc, s)
    assert admitted > 0
    before = [alloc.breakdown(None), alloc.breakdown((s, 20, 0))]
    assert not alloc.allocate(admitted, s, s.prompt_tokens)
    assert [alloc.breakdown(None), alloc.breakdown((s, 20, 0))] == before
    checked(alloc)


def test_failed_grow_changes_nothing(alloc):
    fill(alloc, SeqShape(20, 10))
    before = alloc.breakdown(None)
    assert not alloc.grow(0, alloc.capacity + 1)
    assert alloc.breakdown(None) == before
    checked(alloc)


def test_unfit_reason(alloc):
    assert alloc.unfit_reason(SeqShape(16, 16)) is None
    assert isinstance(alloc.unfit_reason(SeqShape(POOL_SLOTS + 1, 0)), str)


# Prompts start with one of a few shared segments (none, a system prompt, the same
# prompt with more after it) so that prefix caches hit; the rest is unique or shared.
SEGMENTS = [(), ((1, 16),), ((1, 16), (2, 8)), ((1, 24),)]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("allocate"),
            st.integers(0, 5),
            st.integers(1, 32),
            st.integers(0, 32),
            st.sampled_from(SEGMENTS),
            st.sampled_from([-1, 7]),
        ),
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(0, 24)),
        st.tuples(st.just("free"), st.integers(0, 5)),
        st.tuples(st.just("prefilled"), st.integers(0, 5), st.integers(0, 40)),
    ),
    max_size=30,
)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_random_operations_keep_invariants(config, ops):
    alloc = make(config)
    held: dict[int, int] = {}  # seq id -> tokens it holds
    for op, seq_id, *args in ops:
        before = checked(alloc)
        if op == "allocate" and seq_id not in held:
            rest, output, segments, tail = args
            prompt = sum(n for _, n in segments) + rest
            shape = SeqShape(prompt, output, segments, tail)
            assert 0 <= alloc.match_prefix(shape, prompt) < prompt
            if alloc.allocate(seq_id, shape, prompt):
                held[seq_id] = prompt
            else:
                assert checked(alloc) == before
        elif op == "grow" and seq_id in held:
            target = held[seq_id] + args[0]
            if alloc.grow(seq_id, target):
                held[seq_id] = target
            else:
                assert checked(alloc) == before
        elif op == "free" and seq_id in held:
            alloc.free(seq_id)
            del held[seq_id]
        elif op == "prefilled" and seq_id in held:
            alloc.cache_prefilled(seq_id, args[0])  # the step that computed them ran
            assert alloc.tokens_of(seq_id) == held[seq_id]
        b = checked(alloc)  # sharing: logical tokens = physical + shared
        assert b.token + b.shared == sum(held.values())
    for seq_id in list(held):
        alloc.free(seq_id)
    assert checked(alloc) == empty(alloc)
