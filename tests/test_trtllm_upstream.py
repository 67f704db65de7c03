"""TensorRT-LLM's own block-manager test cases, replayed on kvsim's block manager.

TensorRT-LLM's C++ unit tests (cpp/tests/unit_tests/batch_manager/kvCacheManagerTest.cpp,
NVIDIA/TensorRT-LLM) drive its BlockManager and KVCacheManager with token sequences and
state the block ids, reused token counts (getContextCurrentPosition) and free-block
counts they expect. Each test below replays one of them on kvsim.kvcache.trtllm and
checks TensorRT-LLM's expected values, named after the upstream test. Files read: the
test file at commit fb6d3613550d (whose tests use the KV cache manager interface of the
kvCacheManager.cpp kvsim follows, holdSequence and all) and, for BlockManagerReuseTest,
at commit 000a01de66f0, whose tensorrt_llm/version.py reads 1.0.0rc4.

How a test maps onto kvsim:
- Tokens: a token is kvsim content of its own prefix (the token ids up to and including
  it), so two tokens are equal where the prefixes up to them are, as the caches compare
  them; a token list names every token the test gives its request, prompt and output.
- addSequence(P) is `allocate(seq, shape, P)`; its getContextCurrentPosition is
  `reused_tokens(seq)` after it; kvCacheManager.addToken is `grow` by one token;
  storeContextBlocks is `store_context_blocks`; releaseBlocks / removeSequence is `free`.
- A retention priority (KvCacheRetentionConfig) is kvsim's `retention_priority` for the
  blocks a call takes; a token range's priority is set on the blocks it covers, as
  claimBlock sets it (kvsim has no per-range setting of its own).

What this checks and what it does not: kvsim's reuse lookup, partial reuse (copy or take
over), storing, the free queues' order by priority and release, eviction with the
stored blocks below an evicted one, and offload/onboard between the pools give the
block ids and counts TensorRT-LLM's tests state. It does not run TensorRT-LLM, and where
a test sits outside kvsim's model it is left out (beam search, LoRA task ids, token
extra ids, cache salts, retention durations, sliding windows, events, copying data). One
difference shows in the tests' set-up, not in their expected values: the tests release a
request whose last token has no KV yet (its llmRequest holds as many tokens as its
sequence), and TensorRT-LLM stores all tokens but that last one; kvsim's sequences hold
only tokens with KV (a sampled token takes its slot when it is fed back), so kvsim
stores that one token more. In serving, TensorRT-LLM releases a request after sampling
its last token, where the two store the same tokens.
"""

import pytest

from kvsim.engines.trtllm import GUARANTEED_NO_EVICT, MAX_UTILIZATION
from kvsim.kvcache import SeqShape
from kvsim.kvcache.trtllm import TrtllmBlockManager
from kvsim.kvcache.trtllm_eviction import PRIMARY, SECONDARY
from kvsim.sim.loop import simulate
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps
from test_engine import timeline


class Tokens:
    """Token lists as kvsim shapes: each token is the content of its own prefix."""

    def __init__(self):
        self._ids: dict[tuple[int, ...], int] = {}

    def shape(self, tokens: list[int], prompt: int | None = None) -> SeqShape:
        prompt = len(tokens) if prompt is None else prompt
        segments = tuple(
            (self._ids.setdefault(tuple(tokens[: i + 1]), 1000 + len(self._ids)), 1) for i in range(len(tokens))
        )
        return SeqShape(prompt, len(tokens) - prompt, segments, 999_999)


def add(m: TrtllmBlockManager, seq: int, shape: SeqShape) -> int:
    """addSequence, then the tokens it reused (getContextCurrentPosition)."""
    assert m.allocate(seq, shape, shape.prompt_tokens)
    return m.reused_tokens(seq)


def free_count(m: TrtllmBlockManager) -> int:
    return m.free_queues.free_count(PRIMARY)


def allocated(m: TrtllmBlockManager) -> int:
    return m.num_blocks - free_count(m)


def test_block_manager_reuse_test():
    """BlockManagerReuseTest: 8 blocks of 4 tokens, no host pool. Its first four parts:
    the fifth reuses the block its third part stored from a request released with its
    last token still without KV, which kvsim stores one token longer (module docstring)."""
    m, t = TrtllmBlockManager(8, 4), Tokens()
    # [0..8] and two generated tokens (9, 10): new blocks 0, 1, 2
    seq0 = t.shape(list(range(11)), prompt=9)
    assert add(m, 0, seq0) == 0 and m.block_table(0) == [0, 1, 2]
    assert m.grow(0, 10) and allocated(m) == 3 and free_count(m) == 5
    m.free(0)  # stores [0..3], [4..7], [8, 9]
    assert allocated(m) == 0 and free_count(m) == 8
    # the same tokens: reuse blocks 0, 1, new block 3
    seq1 = t.shape(list(range(11)), prompt=9)
    assert add(m, 1, seq1) == 8 and m.block_table(1) == [0, 1, 3]
    assert m.grow(1, 10) and allocated(m) == 3
    m.free(1)  # block 3 matches block 2 and is not stored
    assert free_count(m) == 8
    # [0..9]: blocks 0, 1 and block 2 partly ([8]): a free leaf, taken over
    seq0 = t.shape(list(range(10)))
    assert add(m, 0, seq0) == 9 and m.block_table(0) == [0, 1, 2]
    assert allocated(m) == 3
    # [0..10]: blocks 0, 1 and a new block 4 (block 2 left the tree with its takeover)
    seq1 = t.shape(list(range(11)))
    assert add(m, 1, seq1) == 8 and m.block_table(1) == [0, 1, 4]
    assert allocated(m) == 4 and free_count(m) == 4
    m.free(0)
    assert allocated(m) == 3
    m.free(1)
    assert allocated(m) == 0 and free_count(m) == 8
    # [0..4] and one generated token: block 0 and a new block 5
    seq2 = t.shape(list(range(6)), prompt=5)
    assert add(m, 2, seq2) == 4 and m.block_table(2) == [0, 5]
    assert allocated(m) == 2 and free_count(m) == 6
    m.check_invariants()


def test_block_manager_block_priority_test():
    """BlockManagerBlockPriorityTest: 4 blocks; a request's first block at priority 90,
    its second at 10; lower priorities are evicted first."""
    m, t = TrtllmBlockManager(4, 4), Tokens()
    add(m, 0, t.shape(list(range(8))))
    m.priority[0], m.priority[1] = 90, 10  # TokenRangeRetentionConfig(0, 4, 90), (4, 8, 10)
    add(m, 1, t.shape(list(range(8, 16))))
    m.free(0)
    m.free(1)
    m.retention_priority = 20
    add(m, 2, t.shape(list(range(16, 24))))
    m.free(2)
    m.retention_priority = 35
    # request 1's second block was overwritten, its first was not
    assert add(m, 3, t.shape(list(range(8, 16)))) == 4
    m.free(3)
    assert free_count(m) == 4
    # request 0's first block (priority 90) survived
    assert add(m, 4, t.shape(list(range(8)))) == 4
    # request 2's first block has been evicted
    assert add(m, 5, t.shape(list(range(16, 24)))) == 0
    m.check_invariants()


def test_kv_cache_manager_decode_block_priority_test():
    """KVCacheManagerDecodeBlockPriorityTest: 8 blocks; context and decode blocks of two
    requests at priorities 90 and 5; a third request evicts the lowest priority first,
    in the order they were released."""
    m, t = TrtllmBlockManager(8, 4), Tokens()
    assert free_count(m) == 8
    m.retention_priority = 90
    add(m, 0, t.shape(list(range(12)) + [0], prompt=12))
    assert free_count(m) == 5
    assert m.grow(0, 13) and free_count(m) == 4  # a new block 3
    m.retention_priority = 5
    add(m, 1, t.shape(list(range(12, 24)) + [0], prompt=12))
    assert free_count(m) == 1
    assert m.grow(1, 13) and free_count(m) == 0  # a new block 7
    m.free(0)
    m.free(1)
    assert free_count(m) == 8
    m.retention_priority = 35
    # evicts 7, 6, 5: the lowest priority, in release order
    add(m, 2, t.shape(list(range(24, 36))))
    assert m.block_table(2) == [7, 6, 5]
    m.free(2)
    # blocks 0 and 1 and, partly, 2 are still there: at most all tokens but the last
    assert add(m, 3, t.shape(list(range(12)))) == 11
    m.check_invariants()


def test_kv_cache_manager_secondary_block_primary_child_test():
    """KVCacheManagerSecondaryBlockPrimaryChildTest: 4 GPU blocks and 4 host blocks; a
    host block with a GPU block below it."""
    m, t = TrtllmBlockManager(4, 4, secondary_blocks=4), Tokens()
    add(m, 0, t.shape(list(range(12))))  # blocks 0, 1, 2
    m.free(0)
    # takes blocks 3, 4, 5: blocks 2 and 1 go to the host pool, whose 4 and 5 come in
    add(m, 1, t.shape([1, 1] + list(range(2, 12))))
    assert m.block_table(1) == [3, 4, 5]
    assert m.level[2] == m.level[1] == SECONDARY and m.level[4] == m.level[5] == PRIMARY
    m.free(1)
    # [0, 1, 2, 3] reuses 3 tokens of block 0 (a copy: block 0 has a stored block below)
    req2 = t.shape([0, 1, 2, 3, 4, 5, 6, 7, 0, 0], prompt=4)
    assert add(m, 2, req2) == 3
    m.store_context_blocks(2)
    for n in range(5, 11):  # decodes 4, 5, 6, 7, then 0, 0
        assert m.grow(2, n)
    m.free(2)
    # only block 0 is reused: taking the second block sends block 3's content to the host
    assert add(m, 3, t.shape([0, 1, 2, 3, 4, 5, 6, 7, 0, 0])) == 4
    m.check_invariants()


def test_kv_cache_manager_leaf_block_test():
    """KVCacheManagerLeafBlockTest: 4 blocks; a partly filled decode block."""
    m, t = TrtllmBlockManager(4, 4), Tokens()
    add(m, 0, t.shape([0, 1, 2, 3, 0], prompt=4))
    m.store_context_blocks(0)
    assert m.grow(0, 5)
    m.free(0)  # the second block (released first) is first in line for eviction
    assert add(m, 1, t.shape([1, 1, 2, 3])) == 0
    assert m.block_table(1) == [2]
    add(m, 2, t.shape([2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]))  # the other 3 blocks
    m.free(1)
    m.free(2)
    assert add(m, 3, t.shape([2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0], prompt=12)) == 11
    assert free_count(m) == 1
    assert m.grow(3, 13) and free_count(m) == 0
    assert not m.allocate(4, t.shape([42]), 1)  # no block left
    m.check_invariants()


def test_kv_cache_manager_leaf_block_with_dependent_test():
    """KVCacheManagerLeafBlockWithDependentTest: 4 GPU blocks and 1 host block; a block
    offloaded while a block below it in the tree stays on the GPU."""
    m, t = TrtllmBlockManager(4, 4, secondary_blocks=1), Tokens()
    req0 = t.shape(list(range(12)), prompt=4)
    add(m, 0, req0)
    m.store_context_blocks(0)
    for n in range(5, 13):  # two more blocks of generated tokens
        assert m.grow(0, n)
    assert m.block_table(0) == [0, 1, 2]
    m.priority[1] = 75  # setPriority(75) on the middle block
    req1 = t.shape(list(range(100, 109)), prompt=4)
    add(m, 1, req1)  # block 3
    m.store_context_blocks(1)
    assert free_count(m) == 0
    m.free(0)
    assert free_count(m) == 3
    # one generated token: block 2 is offloaded; host block 4 comes in
    assert m.grow(1, 5)
    assert m.tree.parent.get(2) == 1 and m.level[2] == SECONDARY
    for n in range(6, 9):
        assert m.grow(1, n)
    assert m.block_table(1) == [3, 4]
    # one more: block 0 goes to the host in place of block 2, which leaves the tree
    assert m.grow(1, 9)
    assert 2 not in m.tree
    assert m.level[0] == SECONDARY
    m.free(1)
    m.check_invariants()


# --- the capacity scheduler (capacitySchedulerTest.cpp at commit 08c2acfa25d0) ----------
# Its runTest calls the capacity scheduler once an iteration and gives every scheduled
# request one token (a context its first); a paused request is removed from the KV cache
# and comes back as a context of its prompt and the tokens it had. Here an iteration is
# one step of a second, and the micro-batch limits are left out of the way.
def iterations(policy, num_blocks, *requests):
    cost = OneSecondSteps()
    result = simulate(
        "p",
        [RequestSpec(i, 0.0, prompt, new) for i, (prompt, new) in enumerate(requests)],
        TrtllmBlockManager(num_blocks, 10, reuse=False),  # getKvCacheManager: reuse off
        cost,
        engine="trtllm",
        max_model_len=90,  # kvCacheMaxNumTokensPerSeq
        max_num_seqs=2,  # maxNumRequests
        max_num_batched_tokens=10_000,
        chunked_prefill=False,
        schedule_policy=policy,
        check_invariants=True,
    )
    return result, cost.batches


@pytest.mark.parametrize("policy", [GUARANTEED_NO_EVICT, MAX_UTILIZATION])
def test_capacity_scheduler_simple_should_fit(policy):
    """SimpleShouldFit: 200 tokens of KV in blocks of 10; two requests of 10 + 80 tokens
    run together for all of their 80 iterations."""
    result, steps = iterations(policy, 20, (10, 80), (10, 80))
    assert timeline(result) == [(0, 0.0, 1.0, 80.0, 0, "completed"), (1, 0.0, 1.0, 80.0, 0, "completed")]
    assert len(steps) == 80


def test_capacity_scheduler_simple_doesnt_fit_max_utilization():
    """SimpleDoesntFitMaxUtilization: 100 tokens of KV; both run until iteration 41,
    where request 1 is paused; request 0 ends at 80; request 1 comes back as a context of
    51 tokens with 39 to go; 119 iterations in all."""
    result, steps = iterations(MAX_UTILIZATION, 10, (10, 80), (10, 80))
    assert timeline(result) == [(0, 0.0, 1.0, 80.0, 0, "completed"), (1, 0.0, 1.0, 119.0, 1, "completed")]
    assert [len(b.prefills) + b.decodes for b in steps[:42]] == [2] * 41 + [1]
    assert steps[80].prefills == ((51, 0),)
    assert len(steps) == 119
