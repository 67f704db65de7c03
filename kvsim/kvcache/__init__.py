"""KV-cache allocators, one module per family, and the registry that builds them.

A scenario names an allocator by its YAML key and gives a byte budget; the builders
here turn bytes into slots with the frozen KVSpec, so allocators only count slots.

  paged       vLLM-style fixed blocks (options: block_size, prefix_caching = false |
              true: vLLM's automatic prefix caching of full blocks, vllm_in_flight_tokens:
              given, a model's sliding window follows vLLM V1's rules with that many
              tokens in flight, kvsim.kvcache.sliding)
  radix       prefix cache on a radix tree (SGLang's RadixAttention; options: page_size,
              SGLang's default 1; tiers: a HiCacheSpec, SGLang's host pool behind it,
              kvsim.kvcache.hiradix)
  contiguous  one region per sequence (options: reserve = max | pow2 | oracle,
              placement = first-fit | buddy)
  trtllm      TensorRT-LLM's block manager: block reuse, partial reuse, a host pool
              (options: block_size, prefix_caching, partial_reuse, copy_on_partial_reuse,
              host_cache_bytes, link_bytes_s, offload_min_priority, retention_priority)

A paged prefix cache may have KV tiers behind it (option tiers: a TierStore,
kvsim.kvcache.tiers; the allocator is then kvsim.kvcache.tiered's).
"""

from __future__ import annotations

from typing import Callable

from kvsim.kvcache.base import (
    BulkBlockAllocator,
    Breakdown,
    CountedAllocator,
    InvariantError,
    KVAllocator,
    NextSeq,
    SeqShape,
)
from kvsim.kvcache.contiguous import ContiguousAllocator
from kvsim.kvcache.hiradix import HiCacheSpec, HiRadixCacheAllocator
from kvsim.kvcache.hybrid import HybridPagedAllocator
from kvsim.kvcache.hybrid_prefix import HybridPrefixCache
from kvsim.kvcache.paged import PagedAllocator
from kvsim.kvcache.prefix import PrefixCachingPagedAllocator
from kvsim.kvcache.radix import RadixCacheAllocator
from kvsim.kvcache.sliding import SlidingWindowPagedAllocator, SlidingWindowPrefixCache, admission_cap
from kvsim.kvcache.tiered import TieredPrefixCachingAllocator
from kvsim.kvcache.tiers import TierStore
from kvsim.kvcache.trtllm import TrtllmBlockManager
from kvsim.kvcache.trtllm_host import TrtllmHostPoolManager
from kvsim.model.kv_groups import kv_cache_groups
from kvsim.model.specs import KVSpec


def _paged(
    pool_bytes: float,
    kv: KVSpec,
    max_model_len: int,
    block_size: int = 16,
    prefix_caching: bool = False,
    tiers: TierStore | None = None,
    vllm_in_flight_tokens: int | None = None,
    hybrid_groups: bool = False,
) -> PagedAllocator | PrefixCachingPagedAllocator | HybridPagedAllocator:
    if hybrid_groups:  # vLLM V1's KV cache groups of a hybrid model
        groups = kv_cache_groups(kv.model)
        in_flight = vllm_in_flight_tokens or 0
        return (HybridPrefixCache if prefix_caching else HybridPagedAllocator)(
            int(pool_bytes // groups.block_bytes(kv, block_size)),
            block_size,
            tuple(g.window for g in groups.groups),
            tuple(
                0 if g.window is None else admission_cap(g.window, block_size, in_flight, max_model_len)
                for g in groups.groups
            ),
        )
    # Whole blocks only: the remainder of the pool is never handed out.
    num_blocks = int(pool_bytes // (block_size * kv.bytes_per_token))
    window = kv.model.sliding_window
    if tiers is not None:  # cached blocks stay whole: no sliding-window release here
        if not prefix_caching:
            raise ValueError("KV tiers hold what a prefix cache shares: enable prefix caching")
        return TieredPrefixCachingAllocator(num_blocks, block_size, tiers, block_size * kv.bytes_per_token)
    if window is not None and vllm_in_flight_tokens is not None:
        cap = admission_cap(window, block_size, vllm_in_flight_tokens, max_model_len)
        return (SlidingWindowPrefixCache if prefix_caching else SlidingWindowPagedAllocator)(
            num_blocks, block_size, window, cap
        )
    if prefix_caching:  # cached blocks stay whole: no sliding-window release here
        return PrefixCachingPagedAllocator(num_blocks, block_size)
    return PagedAllocator(num_blocks, block_size, window=window)


def _radix(
    pool_bytes: float, kv: KVSpec, max_model_len: int, page_size: int = 1, tiers: HiCacheSpec | None = None
) -> RadixCacheAllocator:
    # Whole pages only, as SGLang rounds its token pool down to pages (model_runner.py).
    pages = int(pool_bytes // (page_size * kv.bytes_per_token))
    if tiers is not None:
        return HiRadixCacheAllocator(pages * page_size, page_size, tiers, kv.bytes_per_token)
    return RadixCacheAllocator(pages * page_size, page_size)


def _contiguous(
    pool_bytes: float, kv: KVSpec, max_model_len: int, reserve: str = "max", placement: str = "first-fit"
) -> ContiguousAllocator:
    capacity = int(pool_bytes // kv.bytes_per_token)
    return ContiguousAllocator(capacity, max_model_len, reserve, placement)


def _trtllm(
    pool_bytes: float,
    kv: KVSpec,
    max_model_len: int,
    block_size: int = 32,
    prefix_caching: bool = True,
    host_cache_bytes: float = 0.0,
    **options,
) -> TrtllmBlockManager:
    # TensorRT-LLM's calculateMaxNumBlocks (1.2.0rc2's kvCacheManager.cpp): primary blocks round the
    # pool's tokens up (ceilDiv(maxTokens, tokensPerBlock)), the host pool's down.
    tokens = int(pool_bytes // kv.bytes_per_token)
    secondary = int(host_cache_bytes // kv.bytes_per_token) // block_size
    block_bytes = block_size * kv.bytes_per_token
    cls = TrtllmHostPoolManager if secondary else TrtllmBlockManager
    return cls(
        -(-tokens // block_size),
        block_size,
        secondary_blocks=secondary,
        block_bytes=block_bytes,
        reuse=prefix_caching,
        **options,
    )


# kind -> builder(pool_bytes, kv, max_model_len, **options): a new allocator registers here
ALLOCATORS: dict[str, Callable[..., KVAllocator]] = {
    "contiguous": _contiguous,
    "paged": _paged,
    "radix": _radix,
    "trtllm": _trtllm,
}


def make_allocator(kind: str, pool_bytes: float, kv: KVSpec, max_model_len: int, **options) -> KVAllocator:
    """Build the allocator registered as `kind` over a pool of `pool_bytes` bytes."""
    if kind not in ALLOCATORS:
        raise ValueError(f"unknown allocator {kind!r}; valid: {', '.join(sorted(ALLOCATORS))}")
    return ALLOCATORS[kind](pool_bytes, kv, max_model_len, **options)


__all__ = [
    "ALLOCATORS",
    "Breakdown",
    "BulkBlockAllocator",
    "ContiguousAllocator",
    "CountedAllocator",
    "HiRadixCacheAllocator",
    "HybridPagedAllocator",
    "HybridPrefixCache",
    "InvariantError",
    "KVAllocator",
    "NextSeq",
    "PagedAllocator",
    "PrefixCachingPagedAllocator",
    "RadixCacheAllocator",
    "SeqShape",
    "SlidingWindowPagedAllocator",
    "SlidingWindowPrefixCache",
    "TieredPrefixCachingAllocator",
    "TierStore",
    "TrtllmBlockManager",
    "make_allocator",
]
