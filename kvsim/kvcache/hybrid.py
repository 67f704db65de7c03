"""vLLM V1's KV cache for hybrid models: one block table per KV cache group, all tables
drawing from one pool (vLLM 0.33.0, vllm/v1/core/kv_cache_coordinator.py
`KVCacheCoordinator`, kv_cache_manager.py `allocate_slots`, single_type_kv_cache_manager.py
`FullAttentionManager`, `SlidingWindowManager`).

A model whose layers mix a sliding window and full attention (gpt-oss, Gemma 3) has
several KV cache groups (kvsim.model.kv_groups): a block is block_size tokens of one
group's layers, and a request holds one table per group. Each group's table covers the
request's tokens; a windowed group's leading blocks leave once the window has passed
them. The rules, each from vLLM 0.33.0:
- Blocks leave before a step allocates: `allocate_slots` first frees, group by group,
  each windowed table's blocks that the computed tokens so far no longer attend to
  (`remove_skipped_blocks`, the deepest first, to the free queue's head; even when the
  allocation then fails), as kvsim.kvcache.sliding does for one group.
- The step's need is the sum over groups of the blocks each table lacks
  (`get_num_blocks_to_allocate`); admission's whole-sequence check caps a windowed
  group's share at its admission cap (`max_admission_blocks_per_request`), full
  attention's not at all.
- New blocks come off the free queue's head group by group, in group order
  (`allocate_new_blocks`); a finished request frees its tables group by group, each
  deepest first, to the head (`KVCacheCoordinator.free`, `BlockPool.free_blocks`: no
  block holds a hash without prefix caching), so the last group's blocks are reused
  first.

A slot here is one token of one group's layers: the pool's capacity is its blocks
times block_size, and a request of n tokens holds n slots in each full-attention group
and about a window's worth in each windowed one.

With prefix caching it is kvsim.kvcache.hybrid_prefix's. Not modelled: parallel samples
sharing blocks (vLLM V1 runs samples as requests of their own), KV tiers. kvsim.sim.differential
checks these rules against vLLM's own coordinator, block id by block id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.kvcache.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth
from kvsim.kvcache.free_queue import FreeQueue
from kvsim.kvcache.paged import blocks_for, tables_breakdown
from kvsim.kvcache.sliding import skipped_blocks


@dataclass
class _HybridSeq:
    shape: SeqShape
    tokens: int
    tables: list[list[int]]  # live blocks of each group, in logical order
    dropped: list[int] = field(default_factory=list)  # each group's leading blocks released


class HybridPagedAllocator:
    """Paged blocks of one pool, one table per KV cache group (vLLM V1's hybrid models)."""

    counted = False  # no fast path: each step is taken group by group
    takes_blocks_in_bulk = False
    store = None

    def __init__(self, num_blocks: int, block_size: int, windows: tuple[int | None, ...], caps: tuple[int, ...]):
        """windows: each group's sliding window (None: full attention), in vLLM's group
        order; caps: each group's admission cap in blocks (kvsim.kvcache.sliding.admission_cap)."""
        if num_blocks < 0 or block_size < 1 or len(windows) != len(caps) or not windows:
            raise ValueError(f"need num_blocks >= 0, block_size >= 1 and a cap per group, got {windows}, {caps}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows, self.caps = tuple(windows), tuple(caps)
        self.window = None  # the scheduler's own window rules do not apply: the groups have theirs
        self.tables_per_sequence = len(self.windows)  # a token takes a slot in each group's table
        self.capacity = num_blocks * block_size
        self._free = FreeQueue(num_blocks, to_head=True)
        self._seqs: dict[int, _HybridSeq] = {}

    # -- views for tests and reports ------------------------------------------------

    @property
    def free_blocks(self) -> list[int]:
        return list(self._free)

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """Each group's live blocks."""
        return [list(t) for t in self._seqs[seq_id].tables]

    def released(self, seq_id: int) -> list[int]:
        """Each group's leading blocks released as they left its window."""
        return list(self._seqs[seq_id].dropped)

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    def take_load_s(self) -> float:
        return 0.0

    @property
    def page_size(self) -> int:
        return self.block_size

    # -- the rules --------------------------------------------------------------------

    def _need(self, seq: _HybridSeq | None, num_tokens: int, capped: bool) -> int:
        """Blocks the tables lack for num_tokens tokens, summed over groups; `capped`:
        admission's whole-sequence check."""
        full = blocks_for(num_tokens, self.block_size)
        if seq is None:
            return sum(min(full, cap) if capped and w is not None else full for w, cap in zip(self.windows, self.caps))
        return sum(max(full - len(t) - d, 0) for t, d in zip(seq.tables, seq.dropped))

    def _slide(self, seq: _HybridSeq) -> None:
        """Release, group by group, the windowed tables' blocks the computed tokens no
        longer attend to (the deepest first, to the head)."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = seq.tables[g]
            out = min(skipped_blocks(seq.tokens, window, self.block_size) - seq.dropped[g], len(table))
            if out > 0:
                self._release_run(table[:out])
                del table[:out]
                seq.dropped[g] += out

    def unfit_reason(self, shape: SeqShape) -> str | None:
        if self._need(None, shape.final_tokens, False) > self.num_blocks:
            return "final length exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        """Slots the request holds at its final length: every block of each full-attention
        table, a windowed table's blocks since its window's start."""
        final, bs = shape.final_tokens, self.block_size
        return bs * sum(
            blocks_for(final, bs) - (0 if w is None else skipped_blocks(final, w, bs)) for w in self.windows
        )

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # no prefix cache

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        return self._need(None, num_tokens, True) - len(self._free)

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if self._need(None, num_tokens, False) + blocks_for(keep_free, self.block_size) > len(self._free):
            return False
        n = blocks_for(num_tokens, self.block_size)
        self._seqs[seq_id] = _HybridSeq(
            shape, num_tokens, [self._take(n) for _ in self.windows], [0] * len(self.windows)
        )
        return True

    def fork(self, parent_id: int, child_id: int) -> bool:
        raise NotImplementedError("vLLM V1 runs parallel samples as requests of their own: nothing forks")

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        self._slide(seq)
        if self._need(seq, num_tokens, False) > len(self._free):
            return False
        full = blocks_for(num_tokens, self.block_size)
        for table, dropped in zip(seq.tables, seq.dropped):
            extra = full - len(table) - dropped
            if extra > 0:
                table.extend(self._take(extra))
        seq.tokens = num_tokens
        return True

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        return self._need(self._seqs[seq_id], num_tokens, False) * self.block_size

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """Nothing: no prefix cache."""

    def _take(self, count: int) -> list[int]:
        """Blocks off the free queue's head."""
        return self._free.take(count)

    def _release_run(self, blocks: list[int]) -> None:
        """A run of a table's blocks, in table order, to the head, the deepest first
        (`put` stacks them: the last put is taken first)."""
        self._free.put(blocks)

    def free(self, seq_id: int) -> None:
        for table in self._seqs.pop(seq_id).tables:  # group by group
            self._release_run(table)

    def drop(self, seq_id: int) -> None:
        self.free(seq_id)

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        return 0

    def evict_to_free(self, slots: int) -> None:
        pass

    # -- the pool's parts -------------------------------------------------------------

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        free_slots = len(self._free) * self.block_size
        if next_seq is None:
            return 0, free_slots, False
        shape, tokens, keep_free = next_seq
        if self._blocks_short(shape, tokens) + blocks_for(keep_free, self.block_size) > 0:
            return free_slots, 0, True
        return 0, free_slots, False

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """Each group's table counted as a table of its own (kvsim.kvcache.paged.tables_breakdown)."""
        bs = self.block_size
        tables = (
            (table, seq.tokens - d * bs, seq.shape.final_tokens - d * bs)
            for seq in self._seqs.values()
            for table, d in zip(seq.tables, seq.dropped)
        )
        return tables_breakdown(tables, bs, self.num_blocks - len(self._free), self.pool_free(next_seq))

    def _check_holders(self, held: list[int], queued: list[int]) -> None:
        """Every block is free or in one table."""
        every = held + queued
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            raise InvariantError(f"blocks held {sorted(held)} and free {sorted(queued)} do not split the pool")

    def check_invariants(self) -> None:
        """Every block is free or in exactly one table; each table covers its tokens."""
        held: list[int] = []
        for seq_id, seq in self._seqs.items():
            need = blocks_for(seq.tokens, self.block_size)
            for g, (table, d) in enumerate(zip(seq.tables, seq.dropped)):
                if len(table) + d != need:
                    raise InvariantError(
                        f"seq {seq_id}'s group {g} holds {seq.tokens} tokens in blocks {table} ({d} released)"
                    )
                held += table
        self._check_holders(held, list(self._free))
        b = self.breakdown(None)
        if min(b.token, b.reservation, b.internal, b.free, b.shared) < 0 or b.capacity != self.capacity:
            raise InvariantError(f"breakdown {b} does not split the pool of {self.capacity}")
