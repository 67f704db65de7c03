"""vLLM's prefix cache with KV tiers behind it (`kv_offload`): the GPU blocks of
kvsim.kvcache.prefix, and a TierStore (kvsim.kvcache.tiers) that keeps copies of
whole chunks in host memory and on disk.

What is stored when, from vLLM 0.33.0's offloading connector
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py,
`_build_store_jobs`): a request's prompt chunks are stored as its blocks are computed
(kvsim: when the GPU cache keys them, at the allocation that covers them); the chunks
past the prompt when it ends ("the final sampled token's slot is never committed", so
up to its last token but one; kvsim also stores them when a request is preempted).

What is loaded: a lookup takes the GPU cache's hits first, then the tiers' chunks from
the first block the GPU lacks on (`get_num_new_matched_tokens` counts tokens "beyond
the num_computed_tokens"), block-aligned and at most the prompt but one token, as the
GPU cache's own hits. The loaded blocks take fresh GPU blocks and are cached in the
GPU as computed ones are. The load's seconds (TierStore.load) wait in `pending_load_s`
for the scheduler to charge them to the step that computes the request: the request
waits for its prefix. (vLLM loads asynchronously and runs the other requests
meanwhile; SGLang overlaps the load with the step's layers. kvsim's step is one unit,
so the whole step waits: an upper bound on what a load costs the others.)

The same store may serve several replicas (a shared tier): each replica's GPU cache is
its own; names and chunks are the store's.
"""

from __future__ import annotations

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.paged import blocks_for
from kvsim.kvcache.prefix import PrefixCachingPagedAllocator, _CachedSeq
from kvsim.kvcache.tiers import TierStore


class TieredPrefixCachingAllocator(PrefixCachingPagedAllocator):
    """Paged blocks, vLLM's prefix cache, and KV tiers behind them."""

    store: TierStore

    def __init__(self, num_blocks: int, block_size: int, store: TierStore, block_bytes: float):
        super().__init__(num_blocks, block_size)
        if store.chunk_tokens % block_size:
            raise ValueError(
                f"a tier's chunk ({store.chunk_tokens} tokens) must be a whole number of blocks of {block_size}"
            )
        self.store = store
        self.per_chunk = store.chunk_tokens // block_size
        self.block_bytes = block_bytes
        self.pending_load_s = 0.0  # taken by the scheduler (take_load_s)
        self.tier_load_s = 0.0  # this engine's loads, in all
        self.tier_hit_tokens = [0] * len(store.tiers)  # tokens loaded from each tier
        # what each step records of the tiers: the chunks host memory and disk hold
        by_name = {t.spec.name: t.held.members for t in store.tiers}
        self._cpu, self._disk = by_name.get("cpu", {}), by_name.get("disk", {})

    def take_load_s(self) -> float:
        """Seconds of loads since the last call (the step admitting them waits for them)."""
        seconds, self.pending_load_s = self.pending_load_s, 0.0
        return seconds

    def _tier_blocks(self, shape: SeqShape, num_tokens: int, gpu_blocks: int) -> tuple[int, int]:
        """(the first chunk the tiers supply, blocks they supply beyond the GPU's
        `gpu_blocks`, block-aligned and at most num_tokens - 1 tokens)."""
        limit = max(num_tokens - 1, 0) // self.block_size
        if gpu_blocks >= limit or not self.store.tiers:
            return 0, 0
        first = gpu_blocks // self.per_chunk
        end = min((first + self.store.count(shape, first)) * self.per_chunk, limit)
        return first, max(end - gpu_blocks, 0)

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        gpu = len(self._hits(shape, num_tokens))
        return (gpu + self._tier_blocks(shape, num_tokens, gpu)[1]) * self.block_size

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        gpu = len(self._hits(shape, num_tokens))
        first, blocks = self._tier_blocks(shape, num_tokens, gpu)
        if blocks:
            # load first (the store the allocation makes may evict what it loads), and
            # only where the allocation will succeed: a failed one changes nothing
            short = self._new_blocks_needed(shape, num_tokens)[1]
            if seq_id in self._seqs or short + blocks_for(keep_free, self.block_size) > 0:
                return super().allocate(seq_id, shape, num_tokens, keep_free)
            hits = self.store.find(shape, first, blocks_for(gpu + blocks, self.per_chunk) - first)
            seconds = self.store.load(hits, blocks * self.block_bytes)
            self.pending_load_s += seconds
            self.tier_load_s += seconds
            for block in range(gpu, gpu + blocks):
                _, tier = hits[block // self.per_chunk - first]  # (chunk name, tier index)
                self.tier_hit_tokens[tier] += self.block_size
        if not super().allocate(seq_id, shape, num_tokens, keep_free):
            if blocks:
                raise InvariantError(f"sequence {seq_id}: an allocation found to fit did not")
            return False
        return True

    def tier_occupancy(self) -> tuple[int, int]:
        """Chunks held in host memory and on disk (0 for a tier of no bytes)."""
        return len(self._cpu), len(self._disk)

    def _cache_full_blocks(self, seq: _CachedSeq) -> None:
        super()._cache_full_blocks(seq)
        # prompt chunks as they are keyed; the rest when the sequence is freed
        self._offer(seq, min(seq.keyed * self.block_size, seq.shape.prompt_tokens))

    def _offer(self, seq: _CachedSeq, tokens: int) -> None:
        upto = tokens // self.store.chunk_tokens
        if upto > seq.offered:
            self.store.store(self.store.names.of(seq.shape)[seq.offered : upto])
            seq.offered = upto

    def free(self, seq_id: int) -> None:
        seq: _CachedSeq = self._seqs[seq_id]  # type: ignore[assignment]  # all _CachedSeq
        self._offer(seq, min(seq.keyed * self.block_size, seq.tokens - 1))
        super().free(seq_id)

    def check_invariants(self) -> None:
        super().check_invariants()
        self.store.check_invariants()
