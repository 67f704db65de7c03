"""Sliding-window attention in vLLM V1's KV cache (0.33.0, vllm/v1/core/
single_type_kv_cache_manager.py `SlidingWindowManager`, kv_cache_manager.py
`allocate_slots`, kv_cache_coordinator.py, kv_cache_interface.py `SlidingWindowSpec`),
for a model whose every layer attends to the last `window` tokens (Mistral-7B v0.1's
4096): one KV cache group, with prefix caching on or off.

The rules, each from vLLM 0.33.0:
- Blocks leave before a step allocates. `allocate_slots` first frees the blocks a
  request no longer attends to (`remove_skipped_blocks`, on the tokens computed so far,
  even when the allocation then fails): of c computed tokens the first c - window + 1
  are skipped (`get_num_skipped_tokens`), so that many whole blocks leave, the deepest
  first (`_remove_blocks_in_range`). A prompt allocated whole holds all its blocks until
  the request's next step.
- Admission's whole-sequence check is capped (`apply_admission_cap`,
  `SlidingWindowSpec.max_admission_blocks_per_request`): a request needs at most
  ceil(min(window - 1 + in-flight tokens, max_model_len) / block_size) + 1 blocks free,
  where the in-flight tokens are max_num_batched_tokens times the batches in flight (2
  with asynchronous scheduling, else 1; VllmConfig.max_in_flight_tokens). The step's own
  allocation is not capped.
- With prefix caching, only blocks a later request can hit are hashed
  (`reachable_block_mask` under CacheConfig.prefix_cache_retention_interval's default
  0): a prompt of P tokens hashes the ceil((window - 1) / block_size) blocks that end
  at its replay boundary, block (P - 1) // block_size; its other blocks and its output
  stay unhashed.
- A lookup (`SlidingWindowManager.find_longest_cache_hit`, at most num_tokens - 1
  tokens) scans the prompt's blocks from the right for ceil((window - 1) / block_size)
  consecutive cached ones: the hit ends with them, and the blocks before them are never
  read (they are the new table's skipped blocks). Without such a run it is the cached
  run from the first block, if any.
- A freed or skipped block nobody holds goes to the free queue's head if it holds no
  hash, to the tail (the LRU's newest) if it does (BlockPool.free_blocks), the deepest
  first either way.

Models whose layers mix sliding windows and full attention (vLLM's hybrid KV cache
groups, e.g. gpt-oss, Gemma 3) are kvsim.kvcache.hybrid's and hybrid_prefix's.
Not modelled: a retention interval other than 0, EAGLE's dropped block, KV tiers behind
a windowed cache. kvsim.sim.differential checks these rules against vLLM's own
SlidingWindowManager block id by block id.
"""

from __future__ import annotations

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.naming import ROOT
from kvsim.kvcache.paged import PagedAllocator, _Seq, blocks_for
from kvsim.kvcache.prefix import PrefixCachingPagedAllocator, _CachedSeq
from kvsim.model.kv_groups import admission_cap

__all__ = ["SlidingWindowPagedAllocator", "SlidingWindowPrefixCache", "admission_cap", "skipped_blocks"]


def skipped_blocks(computed: int, window: int, block_size: int) -> int:
    """Leading blocks a request with `computed` tokens no longer reads (vLLM's
    get_num_skipped_tokens: the first computed - window + 1 tokens, in whole blocks)."""
    return max(0, computed - window + 1) // block_size


class SlidingWindowPagedAllocator(PagedAllocator):
    """vLLM V1's paged blocks under a sliding window, without prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, window: int, cap: int):
        super().__init__(num_blocks, block_size, window=window)
        self.width, self.cap = window, cap  # the window, as an int

    def _grown(self, seq: _Seq) -> None:
        """Nothing: blocks leave before the next allocation, not after this one."""

    def _slide(self, seq: _Seq) -> None:
        out = min(skipped_blocks(seq.tokens, self.width, self.block_size) - seq.dropped, len(seq.table))
        if out > 0:
            self._release(seq.table[:out])  # to the head, the deepest first
            del seq.table[:out]
            seq.dropped += out

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        self._slide(self._seqs[seq_id])
        return super().grow(seq_id, num_tokens)

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        return min(blocks_for(num_tokens, self.block_size), self.cap) - len(self._free)


class SlidingWindowPrefixCache(PrefixCachingPagedAllocator):
    """vLLM V1's prefix cache under a sliding window: sparse hashing, hits that end in a
    window's worth of cached blocks, skipped blocks released into the LRU."""

    _ref: list[int]  # kept from the start: its lookups and releases read them

    def __init__(self, num_blocks: int, block_size: int, window: int, cap: int):
        super().__init__(num_blocks, block_size)
        self._ref = [0] * num_blocks
        self.window = self.width = window  # width: the window, as an int
        self.cap = cap
        self.need = blocks_for(window - 1, block_size)  # a hit's run of cached blocks
        self._hashed = bytearray(num_blocks)  # blocks vLLM holds a hash for (keyed or not)

    def _take(self, count: int) -> list[int]:
        taken = super()._take(count)
        for b in taken:
            self._hashed[b] = 0  # a block handed out loses its hash (evicted)
        return taken

    # -- lookups ----------------------------------------------------------------------

    def _window_hits(self, shape: SeqShape, num_tokens: int) -> tuple[int, list[int]]:
        """(blocks the hit covers, the cached blocks read: its last `need` or fewer)."""
        chain = self._chain(shape, max(num_tokens - 1, 0) // self.block_size)
        chain = chain[: max(num_tokens - 1, 0) // self.block_size]
        first, run = self._first, 0
        for i in range(len(chain) - 1, -1, -1):
            if chain[i] in first:
                run += 1
                if run >= self.need:
                    return i + run, [first[k] for k in chain[i : i + run]]
            else:
                run = 0
        return run, [first[k] for k in chain[:run]]

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return self._window_hits(shape, num_tokens)[0] * self.block_size

    def _short(self, shape: SeqShape, num_tokens: int, capped: bool) -> tuple[int, list[int], int]:
        """(hit blocks, the cached blocks read, blocks needed beyond the free queue);
        `capped`: admission's whole-sequence check."""
        covered, hits = self._window_hits(shape, num_tokens)
        need = blocks_for(num_tokens, self.block_size)
        if capped:
            need = min(need, self.cap)
        revived = list(map(self._ref.__getitem__, hits)).count(0)
        return covered, hits, max(need - covered, 0) + revived - len(self._free)

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        return self._short(shape, num_tokens, True)[2]

    # -- tables -----------------------------------------------------------------------

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        covered, hits, short = self._short(shape, num_tokens, False)
        if short + blocks_for(keep_free, self.block_size) > 0:
            return False
        self._share(hits)
        table = hits + self._take(blocks_for(num_tokens, self.block_size) - covered)
        self._seqs[seq_id] = seq = _CachedSeq(
            shape, num_tokens, table, dropped=covered - len(hits), hashed=covered, chain=self._chain(shape)
        )
        self._cache_full_blocks(seq)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        out = min(skipped_blocks(seq.tokens, self.width, self.block_size) - seq.dropped, len(seq.table))
        if out > 0:
            self._free_deepest_first(seq.table[out - 1 :: -1])
            del seq.table[:out]
            seq.dropped += out
        return super().grow(seq_id, num_tokens)

    def _cache_full_blocks(self, seq: _CachedSeq) -> None:
        """Hash the newly full blocks that a later request can hit: those ending at the
        prompt's replay boundary (reachable_block_mask)."""
        full = seq.tokens // self.block_size
        start = seq.hashed
        if full <= start:
            return
        seq.hashed = full
        end = (seq.shape.prompt_tokens - 1) // self.block_size
        lo, hi = max(start, end - self.need, 0), min(full, end)
        if lo >= hi:
            return
        if len(seq.chain) < hi:
            seq.chain = self._chain(seq.shape, hi)
        for j in range(lo, hi):
            block = seq.table[j - seq.dropped]
            self._hashed[block] = 1
            if j < len(seq.chain) and self._key_of[block] is None:
                self._cache_block(block, seq.chain[j])

    def _free_deepest_first(self, blocks: list[int]) -> None:
        """One reference fewer on each; those nobody holds to the head without a hash, to
        the tail with one, in the order given (BlockPool.free_blocks)."""
        ref, hashed = self._ref, self._hashed
        front: list[int] = []
        back: list[int] = []
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 1:
                self._shared -= 1
            elif not ref[b]:
                (back if hashed[b] else front).append(b)
        self._free.put_front(front)
        self._free.put(back)

    def free(self, seq_id: int) -> None:
        self._free_deepest_first(self._seqs.pop(seq_id).table[::-1])
        if self._names.next > self._forget_after:
            self._forget_keys()

    def _held_keys(self) -> set[int]:
        """Keys held, with every key they hang below: a block hashed here may be the only
        one of its prefix that is, and its key must outlive its prefix's to be met again."""
        held = super()._held_keys()
        parent: dict[int, int] = {key: ident[0] for ident, key in self._names.ids.items()}
        for (above, _, _), run in self._names.runs.items():
            for key in run:
                parent[key], above = above, key
        todo = list(held)
        while todo:
            up = parent.get(todo.pop(), ROOT)
            if up != ROOT and up not in held:
                held.add(up)
                todo.append(up)
        return held

    def _check_table(self, seq_id: int, seq: _CachedSeq) -> None:  # type: ignore[override]
        for j, block in enumerate(seq.table, start=seq.dropped):
            key = self._key_of[block]
            if key is not None and (j >= len(seq.chain) or seq.chain[j] != key):
                raise InvariantError(f"seq {seq_id}'s block {block} holds key {key}, not its chain's")
