"""The waiting queue, with the requests deep in a long queue kept as numbers.

An overloaded server's queue grows with the run: at 40 requests a second into a server
that serves eight, a million-request run ends its arrivals with most of them waiting.
A request that has just arrived is fully described by its arrival index (the engine
rebuilds it from the request table: `rebuild`), and nothing looks at a waiting request
but the engines' rules, which look at the head. So past the first KEEP waiting requests,
an arrival is kept as its index, and made an object again when it nears the head, in
its place. Iterating the queue makes every request an object (SGLang's order, the
invariant checks), so identities stay stable.

The operations are the deque's that the engines use; the order is the queue's.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator

# Waiting requests kept as objects before later arrivals are kept as indices: a few MB
# of objects at most, and a queue that stays shorter (vidur_10k's peaks at 2,617) never
# builds a request twice.
KEEP = 4096


class WaitingQueue:
    """A deque of waiting sequences (kvsim.sim.scheduler.Seq) whose tail may hold arrival
    indices; `rebuild(index)` makes the sequence that arrived as `index`, as it arrived."""

    def __init__(self, rebuild: Callable[[int], object] | None = None, keep: int | None = None):
        self.rebuild = rebuild
        self.keep = KEEP if keep is None else keep
        self._seqs: deque = deque()  # the head: objects
        self._rest: deque = deque()  # after them, in order: indices, or objects requeued at the back
        self._objects_in_rest = 0

    # --- arrivals and requeues -----------------------------------------------------
    def arrived(self, seq, index: int) -> None:
        """Queue a sequence that has just arrived as the index-th (kept as that index
        where the queue is long and it can be rebuilt)."""
        if self.rebuild is not None and (self._rest or len(self._seqs) >= self.keep):
            self._rest.append(index)
        else:
            self.append(seq)

    def append(self, seq) -> None:
        if self._rest:
            self._rest.append(seq)
            self._objects_in_rest += 1
        else:
            self._seqs.append(seq)

    def appendleft(self, seq) -> None:
        self._seqs.appendleft(seq)

    def extendleft(self, seqs: Iterable) -> None:
        self._seqs.extendleft(seqs)

    # --- the head ------------------------------------------------------------------
    def _fill(self, n: int) -> None:
        """Make the first n requests objects (as many as there are)."""
        while len(self._seqs) < n and self._rest:
            item = self._rest.popleft()
            if isinstance(item, int):
                item = self.rebuild(item)
            else:
                self._objects_in_rest -= 1
            self._seqs.append(item)

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        self._fill(i + 1)
        return self._seqs[i]

    def popleft(self):
        self._fill(1)
        return self._seqs.popleft()

    def remove(self, seq) -> None:
        try:
            self._seqs.remove(seq)
        except ValueError:
            if not self._objects_in_rest:
                raise
            self._rest.remove(seq)
            self._objects_in_rest -= 1

    def take(self, index: int, index_of: Callable[[object], int]):
        """Remove and return the sequence that arrived as `index` (index_of gives a queued
        object's), made an object again if it was kept as its index; None if not queued.
        The search runs from the head, where the oldest requests wait."""
        for queue in (self._seqs, self._rest):
            for item in queue:
                if item == index if isinstance(item, int) else index_of(item) == index:
                    queue.remove(item)
                    if queue is self._rest and not isinstance(item, int):
                        self._objects_in_rest -= 1
                    return self.rebuild(item) if isinstance(item, int) else item
        return None

    def __contains__(self, seq) -> bool:
        return seq in self._seqs or (self._objects_in_rest > 0 and seq in self._rest)

    # --- the whole queue -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._seqs) + len(self._rest)

    def __bool__(self) -> bool:
        return bool(self._seqs) or bool(self._rest)

    def __iter__(self) -> Iterator:
        self._fill(len(self))
        return iter(self._seqs)
