"""TensorRT-LLM's eviction policy: free blocks in LRU queues by cache level and priority.

As in TensorRT-LLM's C++ batch manager (cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp,
`LRUEvictionPolicy`, NVIDIA/TensorRT-LLM at commits 05a919198033 and fc07e755f805, which
agree on every rule here; TensorRT-LLM 1.2.0rc2's kvCacheManager.cpp drives it, as
kvsim.kvcache.trtllm says): every block nobody holds waits in one queue per cache level
(0: the GPU's primary pool, 1: the host's secondary pool) and retention priority
(KvCacheRetentionConfig in cpp/include/tensorrt_llm/executor/executor.h, commit
0165bd7ac275: kMinRetentionPriority 0, kMaxRetentionPriority 100,
kDefaultRetentionPriority 35). A free block is taken from the front of
the lowest non-empty priority's queue of its level (`getFreeBlock`); a released block
joins the back of its level and priority's queue (`releaseBlock`); a hit takes a block
out of the middle of its queue (`claimBlock`). Within one priority that is least
recently used first. A block taken from the primary level may be offloaded only if its
priority is at least `secondary_offload_min_priority` (30 by default,
kDefaultSecondaryOffloadMinPriority), so by default every block of the default priority
may go to the host.

Not modelled: retention durations (a priority that expires back to the default after
`durationMs`, `refresh`): kvsim's requests carry no retention config.

The queues are dicts (insertion-ordered, O(1) removal from the middle), as the
std::list iterators TensorRT-LLM keeps per block. Owned here: a block is in at most one
queue, the one `where` records.
"""

from __future__ import annotations

from kvsim.kvcache.base import InvariantError

MIN_PRIORITY, MAX_PRIORITY = 0, 100  # KvCacheRetentionConfig's range
DEFAULT_PRIORITY = 35  # kDefaultRetentionPriority
DEFAULT_OFFLOAD_MIN_PRIORITY = 30  # kDefaultSecondaryOffloadMinPriority
PRIMARY, SECONDARY = 0, 1  # cache levels


class PriorityLRU:
    """Free blocks of each cache level, by priority, least recently released first."""

    def __init__(self, primary: int, secondary: int):
        # level -> priority -> {block: None}; blocks 0..primary-1 start in the primary
        # level, the next `secondary` in the host level, all at the default priority
        self._queues: list[dict[int, dict[int, None]]] = [{}, {}]
        self._count = [0, 0]
        self.where: dict[int, tuple[int, int]] = {}  # block -> (level, priority)
        for b in range(primary):
            self.push(b, PRIMARY, DEFAULT_PRIORITY)
        for b in range(primary, primary + secondary):
            self.push(b, SECONDARY, DEFAULT_PRIORITY)

    def free_count(self, level: int) -> int:
        return self._count[level]

    def __contains__(self, block: int) -> bool:
        return block in self.where

    def front(self, level: int) -> tuple[int, int]:
        """(block, priority) that `getFreeBlock` takes next from `level` (not removed)."""
        queues = self._queues[level]
        priority = min(queues)
        return next(iter(queues[priority])), priority

    def push(self, block: int, level: int, priority: int) -> None:
        """Release `block` into `level` at `priority`, at the back of its queue."""
        self._queues[level].setdefault(priority, {})[block] = None
        self.where[block] = (level, priority)
        self._count[level] += 1

    def remove(self, block: int) -> bool:
        """Take `block` out of its queue (`claimBlock`); False if it was in none."""
        spot = self.where.pop(block, None)
        if spot is None:
            return False
        level, priority = spot
        queue = self._queues[level][priority]
        del queue[block]
        if not queue:
            del self._queues[level][priority]
        self._count[level] -= 1
        return True

    def order(self, level: int) -> list[int]:
        """The level's free blocks in the order they would be taken."""
        return [b for p in sorted(self._queues[level]) for b in self._queues[level][p]]

    def check(self, level_of: list[int]) -> None:
        """Each queued block sits in its own level's queue, once; the counts agree."""
        seen = 0
        for level, queues in enumerate(self._queues):
            n = 0
            for priority, queue in queues.items():
                if not queue or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
                    raise InvariantError(f"level {level} keeps an empty or out-of-range queue {priority}")
                for b in queue:
                    if self.where.get(b) != (level, priority) or level_of[b] != level:
                        raise InvariantError(
                            f"free block {b} is queued at level {level} priority "
                            f"{priority} but belongs to level {level_of[b]}"
                        )
                n += len(queue)
            if n != self._count[level]:
                raise InvariantError(f"level {level} counts {self._count[level]} free blocks, holds {n}")
            seen += n
        if seen != len(self.where):
            raise InvariantError("a free block is queued twice or not at all")
