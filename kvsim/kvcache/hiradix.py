"""SGLang's hierarchical cache (HiCache, `--enable-hierarchical-cache`): the radix
prefix cache (kvsim.kvcache.radix) with a host-memory pool behind it, as in SGLang
0.5.23 (python/sglang/srt/mem_cache/unified_radix_cache.py, pool_host/base.py,
managers/schedule_policy.py, arg_groups/fields/memory.py; the tree's rules are in
kvsim.kvcache.host_tree).

- The host pool (`HostKVCache.__init__`): `hicache_ratio` times the GPU pool's tokens
  (default 2.0 in the default host-memory mode, `cache`:
  arg_groups/hicache_hook.py `handle_hicache_ratio_default`), or `--hicache-size`,
  which overrides the ratio (kvsim: kv_offload's cpu_gib, the replica's host memory);
  then rounded down to pages and one page added (`page_num = size // page_size + 1`).
  Its page is the GPU pool's (--page-size).
- Write policy (`--hicache-write-policy`, default write_through): when a node is copied
  to host (kvsim.kvcache.host_tree).
- A lookup (match_prefix) finds the GPU's match and the host-only nodes that continue
  it (`host_hit_length`). At admission, a host hit of at least `load_back_threshold`
  (10) tokens is loaded back onto the GPU, GPU leaves evicted first if the free slots
  are too few; a smaller one, or one that cannot get the slots, is computed instead
  (`init_load_back`, `load_back`). kvsim loads only where the admission then fits: the
  loaded tokens count among those to allocate (`prepare_load_back`), so an admission
  that cannot hold them fails, changing nothing.
- Costs: a load's bytes cross the host link (the GPU spec's pcie_gb_s times the
  replica's GPUs) and the step that admits the request waits for them (SGLang loads
  layer by layer, overlapped with the step's compute: kvsim's step is one unit, so
  this is an upper bound). Copies to host run on their own stream (the write stream)
  while the GPU computes and cost no step time.

What differs from SGLang: copies and loads are done at once (SGLang's write-through
locks a node until its copy is acknowledged, and a load until it lands); the host
pool's storage layer (`--hicache-storage-backend`: file, mooncake, 3fs, ...) and its
prefetch are not modelled, nor host memory as a buffer only
(`--hicache-host-memory-mode buffer_only`); SGLang's admission budget counts loaded
tokens among those to allocate, the SGLang rules here among those cached.

Invariants: those of the radix cache and of the tree (kvsim.kvcache.host_tree): the GPU
nodes a subtree from the root, the host pool's slots those of the nodes holding a copy
and never above its capacity, every node in at least one pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.host_tree import HostRadixTree
from kvsim.kvcache.radix import RadixCacheAllocator
from kvsim.kvcache.runs import cacheable_runs
from kvsim.kvcache.tiers import TierSpec

LOAD_BACK_THRESHOLD = 10  # tokens: a smaller host hit is computed again
DEFAULT_RATIO = 2.0


def host_slots(gpu_slots: int, page: int, bytes_per_token: float, host_bytes: float, ratio: float | None) -> int:
    """The host pool's token slots, as HostKVCache sizes itself: `host_bytes` of KV if
    given (--hicache-size), else `ratio` (default 2.0) times the GPU pool; whole pages,
    plus one."""
    size = (
        int(host_bytes // bytes_per_token)
        if host_bytes > 0
        else int(gpu_slots * (DEFAULT_RATIO if ratio is None else ratio))
    )
    return (size // page + 1) * page


@dataclass(frozen=True)
class HiCacheSpec:
    """A replica's HiCache host pool: its token slots, write policy, and the host link's
    bytes/s."""

    host_slots: int
    write_policy: str
    link_bytes_s: float


class HostPoolTier:
    """The host pool, as the run's tally reads a tier (kvsim.kvcache.tiers.tally): named
    `cpu`, counted in pages."""

    def __init__(self, tree: HostRadixTree, page: int, bytes_per_token: float):
        self._tree, self._page = tree, page
        self.spec = TierSpec("cpu", tree.host_capacity // page)
        self.tiers = [self]  # the tally's view of a store: this one tier ...
        self.chunk_bytes = page * bytes_per_token  # ... of pages of this many bytes

    @property
    def written(self) -> int:
        return self._tree.written // self._page

    @property
    def read(self) -> int:
        return self._tree.loaded // self._page


class HiRadixCacheAllocator(RadixCacheAllocator):
    """The radix cache with SGLang's host pool behind it."""

    _tree: HostRadixTree
    store: HostPoolTier  # type: ignore[assignment]  # the plain radix cache has none

    def __init__(self, capacity: int, page_size: int, spec: HiCacheSpec, bytes_per_token: float):
        super().__init__(capacity, page_size)
        self._tree = HostRadixTree(page_size, spec.host_slots, spec.write_policy)
        self.store = HostPoolTier(self._tree, page_size, bytes_per_token)
        self.bytes_per_token = bytes_per_token
        self.link_bytes_s = spec.link_bytes_s
        self.pending_load_s = 0.0  # taken by the scheduler (take_load_s)
        self.tier_load_s = 0.0  # this engine's loads, in all
        self.tier_hit_tokens = [0]  # tokens loaded from the host pool

    def take_load_s(self) -> float:
        """Seconds of loads since the last call (the step admitting them waits for them)."""
        seconds, self.pending_load_s = self.pending_load_s, 0.0
        return seconds

    def tier_occupancy(self) -> tuple[int, int]:
        """Pages held in host memory, and none on disk."""
        return self._tree.host_size // self.page_size, 0

    def _host_hit(self, shape: SeqShape, num_tokens: int):
        """The match anywhere of the shape's first num_tokens - 1 tokens, and its host
        tokens if they are enough to load (else 0)."""
        match, host = self._tree.host_match(cacheable_runs(shape, max(num_tokens - 1, 0)))
        return match, host if host >= LOAD_BACK_THRESHOLD else 0

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        gpu = super().match_prefix(shape, num_tokens)
        return gpu + self._host_hit(shape, num_tokens)[1]

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        match, host = self._host_hit(shape, num_tokens)
        if host and seq_id not in self._seqs:
            gpu = self._tree.walk(cacheable_runs(shape, max(num_tokens - 1, 0)))
            need = self._pages(num_tokens) - gpu.matched
            if need + keep_free <= self._free + self._tree.evictable - gpu.locked:
                self._load(gpu, match, host, shape, num_tokens)
        return super().allocate(seq_id, shape, num_tokens, keep_free)

    def _load(self, gpu, match, host: int, shape: SeqShape, num_tokens: int) -> None:
        """Load the host hit onto the GPU, evicting GPU leaves (never the GPU's match,
        locked meanwhile) where the free slots are too few."""
        if host > self._free:
            end = self._tree.touch(gpu)
            self._tree.lock(end, +1)
            self._free += self._tree.evict(host - self._free)
            self._tree.lock(end, -1)
            # a write-back copy made while evicting may have dropped host leaves
            match, host = self._host_hit(shape, num_tokens)
            if not host or host > self._free:
                return
        loaded = self._tree.load(match)
        if loaded != host:
            raise InvariantError(f"loaded {loaded} host tokens of a hit of {host}")
        self._free -= loaded
        seconds = loaded * self.bytes_per_token / self.link_bytes_s
        self.pending_load_s += seconds
        self.tier_load_s += seconds
        self.tier_hit_tokens[0] += loaded
