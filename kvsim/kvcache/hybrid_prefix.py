"""vLLM V1's prefix cache over a hybrid model's KV cache groups (vLLM 0.33.0,
vllm/v1/core/kv_cache_coordinator.py `HybridKVCacheCoordinator`, kv_cache_manager.py
`get_computed_blocks` and `allocate_slots`, single_type_kv_cache_manager.py
`FullAttentionManager`, `SlidingWindowManager`, block_pool.py `BlockPool`), for one
full-attention group beside windowed groups of one window (gpt-oss, Gemma 3).

On top of kvsim.kvcache.hybrid's tables, each group caches its own full blocks under the
chained key of their content (a key per group: vLLM's BlockHashWithGroupId), all groups'
blocks waiting in one free queue that doubles as the LRU. The rules, each from vLLM
0.33.0:
- A lookup (at most num_tokens - 1 tokens) first finds the full-attention group's
  longest cached prefix, L_f; then, within it, the windowed groups' rightmost run of
  ceil((window - 1) / block_size) blocks cached in every windowed group (or their
  cached run from the first block): the hit, L, where both end (one pass: "simple
  hybrid"); the full-attention hits are cut to L. Where L_f > L, L_f is the request's
  shared-prefix boundary (`shared_prefix_boundary`).
- Admission counts, per group, the blocks its table lacks beyond the hits (a windowed
  group's hits start after the blocks its window skips), plus the hits that wait in the
  free queue (`get_num_blocks_to_allocate`); the windowed groups' share is capped at
  their admission cap. Hits are taken out of the queue group by group, then each group
  takes its new blocks from the head (`add_local_computed_blocks`, `allocate_new_blocks`).
- Caching (`cache_blocks`), after each allocation, of the blocks the computed tokens
  have filled: every one in the full-attention group; in a windowed group only the
  ceil((window - 1) / block_size) blocks that end at the prompt's replay boundary
  (block (P - 1) // block_size) and those that end at the shared-prefix boundary
  (`reachable_block_mask`, retention interval 0).
- A block taken from the queue loses its key (evicted); freed blocks (a finished
  request's, group by group, each deepest first; a window's skipped ones) that hold a
  hash join the tail, the others the head.

Keys are kvsim's content names (kvsim.kvcache.naming) and are never forgotten here.
Content -1 gets no key, where vLLM hashes every block (such a block still goes to the
tail). kvsim.sim.differential checks these rules against vLLM's own coordinator, block
id by block id.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.free_queue import LinkedFreeQueue
from kvsim.kvcache.hybrid import HybridPagedAllocator, _HybridSeq
from kvsim.kvcache.naming import ContentNames
from kvsim.kvcache.paged import blocks_for
from kvsim.kvcache.sliding import skipped_blocks


@dataclass
class _Seq(_HybridSeq):
    cached: list[int] = field(default_factory=list)  # each group's blocks looked at for caching
    boundary: int = 0  # its shared-prefix boundary, in tokens (0: none)
    chain: list[int] = field(default_factory=list)  # its blocks' keys, as far as made


@dataclass(frozen=True)
class _Hit:
    tokens: int  # the hit, L
    blocks: tuple[list[int], ...]  # each group's hit blocks (a windowed group's: its run)
    boundary: int


class HybridPrefixCache(HybridPagedAllocator):
    """vLLM V1's hybrid KV cache groups with prefix caching."""

    _free: LinkedFreeQueue  # a hit takes its block out of the middle

    def __init__(self, num_blocks: int, block_size: int, windows: tuple[int | None, ...], caps: tuple[int, ...]):
        super().__init__(num_blocks, block_size, windows, caps)
        full = [g for g, w in enumerate(windows) if w is None]
        windowed = {w for w in windows if w is not None}
        if len(full) != 1 or len(windowed) != 1:
            raise ValueError(f"one full-attention group beside windowed ones of one window, got {windows}")
        self.full_group = full[0]
        self.window_groups = [g for g, w in enumerate(windows) if w is not None]
        self.width = windowed.pop()
        self.need = blocks_for(self.width - 1, block_size)  # a windowed hit's run
        self._free = LinkedFreeQueue(num_blocks)
        self._ref = [0] * num_blocks
        self._key_of: list[tuple[int, int] | None] = [None] * num_blocks  # block -> (group, key)
        self._hashed = bytearray(num_blocks)  # blocks vLLM holds a hash for (keyed or not)
        self._copies: dict[tuple[int, int], list[int]] = {}  # (group, key) -> its blocks, first cached first
        self._names = ContentNames(block_size)
        self._targets: dict[SeqShape, int] = {}  # a shape's tokens at its last lookup (vLLM's num_tokens)

    @property
    def cached_blocks(self) -> list[int]:
        return [b for b, k in enumerate(self._key_of) if k is not None]

    # -- lookups ----------------------------------------------------------------------

    def _cached(self, group: int, key: int) -> int | None:
        copies = self._copies.get((group, key))
        return copies[0] if copies else None

    def _lookup(self, shape: SeqShape, num_tokens: int) -> _Hit:
        """HybridKVCacheCoordinator.find_longest_cache_hit at most num_tokens - 1 tokens."""
        bs = self.block_size
        chain = self._names.walk(shape, max(num_tokens - 1, 0) // bs).keys
        full: list[int] = []
        for key in chain:
            block = self._cached(self.full_group, key)
            if block is None:
                break
            full.append(block)
        run: list[list[int]] = []  # the windowed groups' blocks, one list per block index
        end = 0
        for i in range(len(full) - 1, -1, -1):
            found = [self._cached(g, chain[i]) for g in self.window_groups]
            if None in found:
                run = []
                continue
            run.insert(0, found)  # type: ignore[arg-type]  # None is not in it
            if len(run) >= self.need:
                end = i + len(run)
                break
        else:
            end = len(run)  # no run long enough: the cached run from the first block
        per_window = [list(col) for col in zip(*run)] if run else [[] for _ in self.window_groups]
        blocks: list[list[int]] = [[] for _ in self.windows]
        blocks[self.full_group] = full[:end]
        for g, hits in zip(self.window_groups, per_window):
            blocks[g] = hits
        boundary = len(full) * bs if len(full) > end else 0
        return _Hit(end * bs, tuple(blocks), boundary)

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        self._targets[shape] = num_tokens
        return self._lookup(shape, num_tokens).tokens

    def _admission(self, shape: SeqShape, num_tokens: int, hit: _Hit, capped: bool) -> int:
        """Blocks to take from the queue (get_num_blocks_to_allocate, summed over groups)."""
        bs, total = self.block_size, 0
        required = blocks_for(num_tokens, bs)
        for g, (window, cap) in enumerate(zip(self.windows, self.caps)):
            hits = hit.blocks[g]
            need = min(required, cap) if capped and window is not None else required
            skipped = 0 if window is None else skipped_blocks(hit.tokens, window, bs)
            local = hit.tokens // bs  # the hits, a windowed group's skipped ones included
            revived = sum(1 for b in hits if not self._ref[b])
            total += max(need - max(skipped, local), 0) + revived
        return total

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        self._targets[shape] = num_tokens
        return self._admission(shape, num_tokens, self._lookup(shape, num_tokens), True) - len(self._free)

    # -- tables -----------------------------------------------------------------------

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        hit = self._lookup(shape, self._targets.get(shape, num_tokens))
        if self._admission(shape, num_tokens, hit, False) + blocks_for(keep_free, self.block_size) > len(self._free):
            return False
        bs, n = self.block_size, len(self.windows)
        seq = _Seq(shape, num_tokens, [[] for _ in range(n)], [0] * n, [hit.tokens // bs] * n, hit.boundary)
        for g, hits in enumerate(hit.blocks):  # touch every group's hits first
            for b in hits:
                if not self._ref[b]:
                    self._free.remove(b)
                self._ref[b] += 1
            seq.tables[g] = list(hits)
            seq.dropped[g] = hit.tokens // bs - len(hits)  # a window's skipped blocks
        full = blocks_for(num_tokens, bs)
        for g in range(n):
            seq.tables[g].extend(self._take(full - len(seq.tables[g]) - seq.dropped[g]))
        self._seqs[seq_id] = seq
        self._cache(seq)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        if not super().grow(seq_id, num_tokens):
            return False
        self._cache(self._seqs[seq_id])  # type: ignore[arg-type]  # its sequences are _Seq
        return True

    def _take(self, count: int) -> list[int]:
        """Blocks off the head; a cached one loses its key (evicted)."""
        taken = self._free.take(count) if count > 0 else []
        for b in taken:
            self._ref[b] = 1
            self._hashed[b] = 0
            owner = self._key_of[b]
            if owner is not None:
                self._key_of[b] = None
                copies = self._copies[owner]
                copies.remove(b)
                if not copies:
                    del self._copies[owner]
        return taken

    def _release_run(self, blocks: list[int]) -> None:
        """One reference fewer on each of a run of a table's blocks, the deepest first;
        those nobody holds to the tail if hashed, else to the head (BlockPool.free_blocks)."""
        front: list[int] = []
        back: list[int] = []
        for b in reversed(blocks):
            self._ref[b] -= 1
            if not self._ref[b]:
                (back if self._hashed[b] else front).append(b)
        self._free.put_front(front)
        self._free.put(back)

    def _cache(self, seq: _Seq) -> None:
        """cache_blocks: each group's newly filled blocks, a windowed group's masked."""
        bs = self.block_size
        full = seq.tokens // bs
        if len(seq.chain) < full:
            seq.chain = self._names.walk(seq.shape, max(full, seq.shape.final_tokens // bs)).keys
        keys = seq.chain
        ends = [(seq.shape.prompt_tokens - 1) // bs] + ([seq.boundary // bs] if seq.boundary else [])
        for g, window in enumerate(self.windows):
            start = seq.cached[g]
            if start >= full:
                continue
            seq.cached[g] = full
            for j in range(start, full):
                if window is not None and not any(e - self.need <= j < e for e in ends):
                    continue
                if j < seq.dropped[g]:
                    continue  # a skipped (null) block
                block = seq.tables[g][j - seq.dropped[g]]
                self._hashed[block] = 1
                if j < len(keys) and self._key_of[block] is None:
                    self._key_of[block] = (g, keys[j])
                    self._copies.setdefault((g, keys[j]), []).append(block)

    def _check_holders(self, held: list[int], queued: list[int]) -> None:
        """Every block is free (count 0) or held by as many tables as its count says."""
        counts = Counter(held)
        if set(queued) & counts.keys() or len(set(queued)) + len(counts) != self.num_blocks:
            raise InvariantError("a block is both free and held, or neither")
        if any(self._ref[b] != n for b, n in counts.items()) or any(self._ref[b] for b in queued):
            raise InvariantError("a block's reference count is not its tables'")
        self._check_cache()

    def _check_cache(self) -> None:
        for owner, copies in self._copies.items():
            for b in copies:
                if self._key_of[b] != owner or not self._hashed[b]:
                    raise InvariantError(f"{owner} maps to block {b}, whose key is {self._key_of[b]}")
        if sum(map(len, self._copies.values())) != self.num_blocks - self._key_of.count(None):
            raise InvariantError("a block holds a key the cache does not map to it")
