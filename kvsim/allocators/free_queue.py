"""The paged allocators' free block queues: allocation takes from the head; released
blocks join the tail (vLLM V1) or the head (vLLM V0), one after the other.

`FreeQueue` serves the plain paged allocator, which never takes a block out of the
middle: a list, so that a run of blocks is taken or returned in one slice at C speed
(a request takes and frees hundreds). With releases to the tail, the head is an index
into the list (the list is cut when the head has passed half of it); with releases to
the head, the queue is a stack whose head is the list's end.

`LinkedFreeQueue` serves the prefix cache, whose hit on a queued block takes it out of
the middle: an OrderedDict, as vLLM V1's doubly linked FreeKVCacheBlockQueue
(kv_cache_utils.py: "to remove from the middle in O(1)").
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator


class FreeQueue:
    """Free block ids 0..n-1 in queue order; `to_head`: released blocks go to the head."""

    def __init__(self, n: int, to_head: bool = False):
        self.to_head = to_head
        self._ids = list(range(n - 1, -1, -1) if to_head else range(n))
        self._head = 0              # to the tail: the head's index (before it: taken)

    def __len__(self) -> int:
        return len(self._ids) - self._head

    def __iter__(self) -> Iterator[int]:
        """Block ids, the head first."""
        return reversed(self._ids) if self.to_head else iter(self._ids[self._head:])

    def take(self, count: int) -> list[int]:
        """The first `count` blocks (the caller has checked there are that many)."""
        ids = self._ids
        if self.to_head:
            taken = ids[len(ids) - count:][::-1]
            del ids[len(ids) - count:]
            return taken
        head = self._head
        taken = ids[head:head + count]
        self._head = head = head + count
        if head > 1024 and head * 2 > len(ids):
            del ids[:head]
            self._head = 0
        return taken

    def put(self, blocks: Iterable[int]) -> None:
        """Released blocks, one after the other, at the end the queue releases to."""
        self._ids.extend(blocks)      # the tail, or (a stack) the head: the last put is taken first


class LinkedFreeQueue:
    """Free block ids 0..n-1 in queue order, released to the tail; any may be taken out
    of the middle (`remove`)."""
    to_head = False

    def __init__(self, n: int):
        self._ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def take(self, count: int) -> list[int]:
        pop = self._ids.popitem
        return [pop(False)[0] for _ in range(count)]

    def put(self, blocks: Iterable[int]) -> None:
        ids = self._ids
        for b in blocks:        # (faster than OrderedDict.update)
            ids[b] = None

    def remove(self, block: int) -> None:
        del self._ids[block]
