"""vLLM 0.33.0's V1 rules, exact block ids derived by hand from its source, for kvsim's
native `vllm-v1` rules and, where vLLM is installed, for vLLM's own scheduler too.

Block ids are vLLM's: kvsim's block b is vLLM's b + 1 (block 0 is vLLM's null block).
Each case steps a small stream (kvsim.sim.differential) and reads the records.
"""

from __future__ import annotations

import pytest

from kvsim.kvcache import SeqShape
from kvsim.sim.differential import Arrival, Setup, run_native, run_reference
from kvsim.engines.vllm_reference import VllmMissing, load_vllm


def prompt(doc_tokens: int, output: int, tail: int, doc: int = 7) -> SeqShape:
    return SeqShape(doc_tokens, output, ((doc, doc_tokens),), tail)


def both(stream, setup):
    """kvsim's records, checked equal to vLLM's own where vLLM is installed."""
    native = run_native(stream, setup)
    try:
        load_vllm()
    except VllmMissing:
        return native
    assert run_reference(stream, setup) == native
    return native


SMALL = Setup(num_blocks=11, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


def test_a_fully_cached_prompt_recomputes_its_last_block():
    # get_computed_blocks: hits of at most num_tokens - 1 = 7 tokens, whole blocks: one.
    # r0 ran alone: [1, 2], then 3 for its first sampled token fed back at step 1, where
    # it finished; freed deepest first, the full blocks 2, 1 to the tail, the partly
    # filled 3 to the head (BlockPool.free_blocks). r1 hits block 1 and recomputes its
    # second block into the head block, 3, which is cached as well: 2 and 3 hold the same
    # hash (BlockHashToBlockMap: "we don't de-duplicate").
    stream = [Arrival(0, 0, prompt(8, 2, 100)), Arrival(3, 1, prompt(8, 2, 101))]
    rec = both(stream, SMALL)
    assert rec[0].tables == {0: [1, 2]} and rec[0].free_blocks == 8  # no slot yet for the sample
    assert rec[1].finished == [0] and rec[1].free_blocks == 10
    assert rec[3].admitted == [(1, 4)] and rec[3].scheduled == {1: 4}
    assert rec[3].tables == {1: [1, 3]}
    assert rec[3].cached_blocks == {1, 2, 3}  # 2 still cached, queued, not in r1's table


def test_a_request_admitted_with_an_identical_one_hits_its_first_blocks_only():
    # allocate_slots caches r0's two full blocks as it admits it; r1, admitted next in
    # the same step, hits the first (7 tokens at most) and takes its own second block.
    stream = [Arrival(0, 0, prompt(8, 2, 100)), Arrival(0, 1, prompt(8, 2, 101))]
    rec = both(stream, SMALL)
    assert rec[0].admitted == [(0, 0), (1, 4)]
    assert rec[0].scheduled == {0: 8, 1: 4}
    assert rec[0].tables == {0: [1, 2], 1: [1, 3]}
    assert rec[0].free_blocks == 7


def test_admission_needs_the_whole_prompt_to_fit():
    # scheduler_reserve_full_isl: 5 usable blocks, a budget of 4 tokens. r0 (12 + 4) is
    # prefilled in three chunks of 4; at step 3 it decodes into its 4th block, and r1's
    # 12-token prompt needs 3 blocks where 1 is free: it waits (vLLM 0.10.1.1 would have
    # admitted a 3-token chunk into that block). r0 finishes at step 5; r1 comes in at 6.
    setup = Setup(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64)
    stream = [Arrival(0, 0, SeqShape(12, 4, (), 100)), Arrival(0, 1, SeqShape(12, 4, (), 101))]
    rec = both(stream, setup)
    assert [r.scheduled for r in rec[:4]] == [{0: 4}, {0: 4}, {0: 4}, {0: 1}]
    assert rec[3].free_blocks == 1 and rec[3].tables == {0: [1, 2, 3, 4]}
    assert rec[5].finished == [0]
    assert rec[6].admitted == [(1, 0)] and rec[6].scheduled == {1: 4}


def test_without_chunking_a_prompt_over_the_budget_stops_the_queue():
    # Two decodes leave 14 of 16 tokens; r2's 15-token prompt does not fit them, and the
    # 2-token prompt behind it waits as well (vLLM 0.33.0 `break`s; 0.10.1.1 skipped r2).
    # Once r0 and r1 are done (step 9), r2 takes 15 of the 16 tokens and r3 waits again.
    setup = Setup(
        num_blocks=40,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
        max_model_len=16,
    )
    stream = [
        Arrival(0, 0, SeqShape(4, 10, (), 100)),
        Arrival(0, 1, SeqShape(4, 10, (), 101)),
        Arrival(1, 2, SeqShape(15, 1, (), 102)),
        Arrival(1, 3, SeqShape(2, 2, (), 103)),
    ]
    rec = both(stream, setup)
    assert rec[0].scheduled == {0: 4, 1: 4}
    assert rec[1].scheduled == {0: 1, 1: 1} and rec[1].admitted == []
    assert all(r.admitted == [] for r in rec[1:10]) and rec[9].finished == [0, 1]
    assert rec[10].admitted == [(2, 0)] and rec[10].finished == [2]
    assert rec[11].admitted == [(3, 0)]


def test_preempted_request_hits_its_own_blocks_when_it_comes_back():
    # 6 usable blocks of 4. Both prompts (8 tokens) are in at step 0; at step 5 r0's 13th
    # token wants a 4th block and r1 is preempted: its three blocks, all full, go to the
    # tail deepest first with their hashes, so r0 takes (and evicts) the deepest, which
    # held r1's first outputs. Back at step 8 with 8 + 5 tokens to recompute, r1 finds
    # its own prompt's two blocks cached.
    setup = Setup(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    stream = [Arrival(0, 0, SeqShape(8, 8, (), 100)), Arrival(0, 1, SeqShape(8, 8, (), 101))]
    rec = both(stream, setup)
    assert rec[5].preempted == [1]
    assert rec[7].finished == [0]
    assert rec[8].admitted == [(1, 8)] and rec[8].scheduled == {1: 5}


@pytest.mark.parametrize("case", ["vllm-missing"])
def test_without_vllm_the_reference_says_how_to_install_it(case, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(VllmMissing, match=r"pip install 'kvsim\[vllm\]' && pip install --no-deps vllm==0\.33\.0"):
        load_vllm()
