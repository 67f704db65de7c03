"""The memory breakdown kept in sums, for the fast path (kvsim.sim.lazy).

An allocator's `breakdown` walks every sequence. The fast path keeps its parts instead:
each running request's share (reservation, internal, padding, slots), as split_used
and the allocator's `slots_of` give it, summed over the running requests, plus the free
part of the pool from the allocator's `pool_free`, which needs no walk. From these:

  allocated = capacity - unusable - free        (slots held, padding included)
  token     = allocated - reservation - internal - padding
  shared    = slots + padding - allocated       (logical - physical; 0 without sharing)

which is how the paged and contiguous allocators split their pools. The sums follow
lazy requests tick by tick (their owner moves them: a decode turns a reserved slot into
a token slot, a crossing adds a block's slots); a request's own share is updated when
it is seen again. `version` counts changes to the pool: the free part alone (no next
sequence; O(holes) in a contiguous pool) is asked again only after one, except blocks
taken in bulk for the lazy requests' crossings, which it follows (`took`). Asked for a next
sequence, the allocator is asked each time: the same question seldom comes back before
the pool changes.
"""

from __future__ import annotations

from typing import NamedTuple

from kvsim.kvcache import Breakdown, NextSeq
from kvsim.kvcache.base import split_used
from kvsim.sim.records import PoolParts


class Share(NamedTuple):
    """One request's part of the sums, in slots."""

    reservation: int
    internal: int
    padding: int
    slots: int


NO_SHARE = Share(0, 0, 0, 0)


class PoolSums:
    def __init__(self, allocator):
        self.allocator = allocator
        self.share: dict = {}  # request -> its Share
        self.reservation = self.internal = self.padding = self.slots = 0
        self.version = 0
        self._version: int | None = None  # the free part at that version
        self._free: tuple[int, int, bool] = (0, 0, False)

    def update(self, seq) -> None:
        """A request's share as it stands now (at its `held` tokens), in the sums."""
        slots, pad = self.allocator.slots_of(seq.ids[0])
        _, res, internal = split_used(seq.held, slots, seq.shape.final_tokens)
        self.replace(seq, Share(res, internal, pad, slots))

    def replace(self, seq, share: Share) -> None:
        old = self.share.get(seq, NO_SHARE)
        self.reservation += share.reservation - old.reservation
        self.internal += share.internal - old.internal
        self.padding += share.padding - old.padding
        self.slots += share.slots - old.slots
        self.share[seq] = share

    def drop(self, seq) -> None:
        res, internal, pad, slots = self.share.pop(seq)
        self.reservation -= res
        self.internal -= internal
        self.padding -= pad
        self.slots -= slots

    def recount(self, running) -> None:
        """Every share again, from the requests' and the allocator's state."""
        self.share.clear()
        self.reservation = self.internal = self.padding = self.slots = 0
        for seq in running:
            self.update(seq)
        self.version += 1

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        if next_seq is not None:
            return self.allocator.pool_free(next_seq)
        if self._version != self.version:
            self._version, self._free = self.version, self.allocator.pool_free(None)
        return self._free

    def took(self, slots: int) -> None:
        """`slots` free slots were taken off the free queue in whole blocks (a bulk
        allocator's take_free): the free part, where it is known, follows without asking."""
        if self._version == self.version:
            unusable, free, starved = self._free
            self._free = (unusable, free - slots, starved)

    def free_slots(self) -> int:
        """Free slots in the pool, evictable ones too (RunningSet.free_slots)."""
        unusable, free, _ = self.pool_free(None)
        return free + unusable

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        unusable, free, starved = self.pool_free(next_seq)
        used = self.allocator.capacity - unusable - free
        return Breakdown(
            used - self.reservation - self.internal - self.padding,
            self.reservation,
            self.internal,
            self.padding,
            unusable,
            free,
            shared=self.slots + self.padding - used,
            starved=starved,
        )

    def recorded_parts(self, next_seq: NextSeq | None) -> PoolParts:
        """What a step records, from the sums (the breakdown's parts, without building it)."""
        unusable, free, _ = self.pool_free(next_seq)
        used = self.allocator.capacity - unusable - free
        res, internal, pad = self.reservation, self.internal, self.padding
        return PoolParts(
            used - res - internal - pad, res, internal, pad + unusable, free, used, self.slots + pad - used
        )
