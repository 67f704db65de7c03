"""TensorRT-LLM's host pool reported as a run's host-memory KV tier.

The block manager (kvsim.kvcache.trtllm) keeps evicted blocks in a secondary pool in
host memory (KvCacheConfig.host_cache_size). A run reports it in the columns of KV
tiers (kvsim.kvcache.tiers.tally, kvsim.analysis.metrics.tier_columns) as its `cpu`
tier: tokens reused from it (prefix_hit_rate_cpu), bytes offloaded to it (written) and
onboarded from it (read), the blocks holding content (occupancy), and the seconds steps
waited for the transfers (tier_load_s). A chunk is one block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.kvcache.trtllm import TrtllmBlockManager


@dataclass(frozen=True)
class _TierSpec:
    name: str
    capacity_chunks: int


class _HostTier:
    """The host pool as the tier columns read it: written, blocks offloaded; read,
    blocks onboarded (a partial copy counts its share of a block)."""

    def __init__(self, manager: "TrtllmHostPoolManager"):
        self.manager = manager
        self.spec = _TierSpec("cpu", manager.secondary_blocks)

    @property
    def written(self) -> float:
        return self.manager.offloaded_bytes / self.manager.block_bytes

    @property
    def read(self) -> float:
        return self.manager.onboarded_bytes / self.manager.block_bytes


class _HostStore:
    def __init__(self, manager: "TrtllmHostPoolManager"):
        self.tiers = [_HostTier(manager)]
        self.chunk_bytes = manager.block_bytes
        self.chunk_tokens = manager.block_size


class TrtllmHostPoolManager(TrtllmBlockManager):
    """The block manager with a host pool, which a run reports as its cpu tier."""

    def __init__(self, num_blocks: int, block_size: int, **options):
        super().__init__(num_blocks, block_size, **options)
        if self.secondary_blocks < 1 or self.block_bytes <= 0:
            raise ValueError("a host pool needs at least one block and the bytes of one")
        self.store = _HostStore(self)

    @property
    def tier_hit_tokens(self) -> list[int]:
        return [self.host_hit_tokens]

    @property
    def tier_load_s(self) -> float:
        return self.transfer_s

    def tier_occupancy(self) -> tuple[int, int]:
        """Host blocks holding content, and no disk."""
        return self.host_held, 0
