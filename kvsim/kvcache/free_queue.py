"""The paged allocators' free block queues: allocation takes from the head; released
blocks join the tail (vLLM V1) or the head (vLLM V0), one after the other.

`FreeQueue` serves the plain paged allocator, which never takes a block out of the
middle: a list, so that a run of blocks is taken or returned in one slice at C speed
(a request takes and frees hundreds). With releases to the tail, the head is an index
into the list (the list is cut when the head has passed half of it); with releases to
the head, the queue is a stack whose head is the list's end.

`LinkedFreeQueue` serves the prefix cache, whose hit on a queued block takes it out of
the middle, as vLLM V1's doubly linked FreeKVCacheBlockQueue does (kv_cache_utils.py:
"to remove from the middle in O(1)"). Here the block stays in the list, counted as
removed, and is skipped when the head reaches it: a block's removed entries always come
before its live one (the list is in release order), so the next entry of a block with
removals pending is one of them. Runs are still taken and returned in slices; only a
run that holds a removed entry is walked in Python. Blocks that hold no cached prefix
go back to the head instead (`put_front`, vLLM 0.33.0's FreeKVCacheBlockQueue.prepend_n):
they take the places of the taken entries before the head index, so that a take is
one slice wherever its blocks were released; they are never taken out of the middle
(only cached blocks are hit).
"""

from __future__ import annotations

from typing import Iterable, Iterator


class FreeQueue:
    """Free block ids 0..n-1 in queue order; `to_head`: released blocks go to the head."""

    def __init__(self, n: int, to_head: bool = False):
        self.to_head = to_head
        self._ids = list(range(n - 1, -1, -1) if to_head else range(n))
        self._head = 0  # to the tail: the head's index (before it: taken)

    def __len__(self) -> int:
        return len(self._ids) - self._head

    def __iter__(self) -> Iterator[int]:
        """Block ids, the head first."""
        return reversed(self._ids) if self.to_head else iter(self._ids[self._head :])

    def take(self, count: int) -> list[int]:
        """The first `count` blocks (the caller has checked there are that many)."""
        ids = self._ids
        if self.to_head:
            taken = ids[len(ids) - count :][::-1]
            del ids[len(ids) - count :]
            return taken
        head = self._head
        taken = ids[head : head + count]
        self._head = head = head + count
        if head > 1024 and head * 2 > len(ids):
            del ids[:head]
            self._head = 0
        return taken

    def put(self, blocks: Iterable[int]) -> None:
        """Released blocks, one after the other, at the end the queue releases to."""
        self._ids.extend(blocks)  # the tail, or (a stack) the head: the last put is taken first


class LinkedFreeQueue(FreeQueue):
    """Free block ids 0..n-1 in queue order, released to the tail or (`put_front`) the
    head; any may be taken out of the middle (`remove`)."""

    def __init__(self, n: int):
        super().__init__(n)
        self._skip: dict[int, int] = {}  # block -> its removed entries still in the list
        self._removed = 0  # their total

    def __len__(self) -> int:  # each step asks
        return len(self._ids) - self._head - self._removed

    def __iter__(self) -> Iterator[int]:
        """The live blocks, the head first."""
        skip = dict(self._skip)
        for b in super().__iter__():
            if skip.get(b):
                skip[b] -= 1
            else:
                yield b

    def put_front(self, blocks: list[int]) -> None:
        """Released blocks to the head, as one run: the first given is taken first. They
        take the places before the head, whose blocks were taken (the list grows only when
        there are too few). None may have removed entries left, which would then follow
        its live one: only cached blocks are hit, and they go to the tail."""
        if self._skip and not self._skip.keys().isdisjoint(blocks):
            raise ValueError(f"blocks {blocks} still have removed entries: they cannot go to the head")
        head = self._head
        self._head = start = max(head - len(blocks), 0)
        self._ids[start:head] = blocks

    def take(self, count: int) -> list[int]:
        skip, kept = self._skip, []
        run = FreeQueue.take(self, count)  # (not super(): the fast path takes every step)
        while skip and not skip.keys().isdisjoint(run):  # drop removed entries, take more
            for b in run:
                n = skip.get(b)
                if n is None:
                    kept.append(b)
                    continue
                if n == 1:
                    del skip[b]
                else:
                    skip[b] = n - 1
                self._removed -= 1
            run = FreeQueue.take(self, count - len(kept))
        return kept + run if kept else run

    def remove(self, block: int) -> None:
        """Take a queued block out (the caller knows it is queued). When removed entries
        are most of the list, it is rebuilt without them: where hits take blocks back
        faster than allocations pass them, they would pile up."""
        self._skip[block] = self._skip.get(block, 0) + 1
        self._removed += 1
        if self._removed > 1024 and self._removed * 2 > len(self._ids) - self._head:
            self._ids, self._head = list(self), 0
            self._skip, self._removed = {}, 0
