"""Contiguous KV cache: one region per sequence, reserved at admission (pre-vLLM systems).

Before paging, serving systems (FasterTransformer, Orca) gave each request one
contiguous chunk of KV memory sized when the request was admitted, because the
attention kernel wanted each sequence's KV in one piece. The chunk never moves or
grows, so it must cover every token the request might produce. The vLLM paper
(Kwon et al., SOSP 2023, Fig. 2 and Sec. 6) compares three reservation rules:

  max     max_model_len slots, whatever the request (Orca (Max));
  pow2    the prompt plus the output length rounded up to a power of two, at most
          2x over the output (Orca (Pow2)): a 25-token output reserves 32 slots;
  oracle  exactly prompt + output, as if the output length were known (Orca (Oracle)).

Reserved-but-unfilled slots are `reservation` (filled later) or `internal` (never
filled). Where a region goes in the address space [0, capacity) is a placement
strategy; freed regions leave holes, and a hole too small for the next waiting
request is external fragmentation (`unusable`). Buddy placement also rounds each
region up to a power of two; that round-up is `padding`.

Invariants: live regions and free holes tile [0, capacity) exactly, without overlap;
free space is fully coalesced; a sequence never holds more tokens than it asked for.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from typing import NamedTuple

from kvsim.kvcache.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth, split_used


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


# -- reservation rules: slots a request asks for at admission -----------------------


def reserve_max(shape: SeqShape, max_model_len: int) -> int:
    return max_model_len


def reserve_pow2(shape: SeqShape, max_model_len: int) -> int:
    return min(max_model_len, shape.prompt_tokens + next_power_of_two(shape.output_tokens))


def reserve_oracle(shape: SeqShape, max_model_len: int) -> int:
    return shape.final_tokens


RESERVES = {"max": reserve_max, "pow2": reserve_pow2, "oracle": reserve_oracle}


# -- placement strategies: where a region of a given size goes ----------------------


class Span(NamedTuple):
    """Slots [start, start + size): a free hole, a buddy arena, a sequence's region.
    Ordered by start first, as the sorted hole list needs."""

    start: int
    size: int


class FirstFit:
    """The lowest-address hole that fits; the region is carved from the hole's start.

    Holes are a list of Spans sorted by start, kept coalesced: a freed region
    merges with the holes that touch it, so no two holes are adjacent.
    """

    def __init__(self, capacity: int):
        self._holes: list[Span] = [Span(0, capacity)] if capacity else []
        self.largest = capacity  # biggest region an empty pool can hold

    def placed_size(self, size: int) -> int:
        return size

    def place(self, size: int) -> int | None:
        for i, (start, hole) in enumerate(self._holes):
            if hole >= size:
                if hole == size:
                    del self._holes[i]
                else:
                    self._holes[i] = Span(start + size, hole - size)
                return start
        return None

    def release(self, start: int, size: int) -> None:
        i = bisect_left(self._holes, (start,))  # the first hole after the region
        end = start + size
        if i < len(self._holes) and self._holes[i].start == end:
            end += self._holes.pop(i).size
        if i > 0:
            prev_start, prev_size = self._holes[i - 1]
            if prev_start + prev_size == start:
                i, start = i - 1, prev_start
                del self._holes[i]
        self._holes.insert(i, Span(start, end - start))

    def holes(self) -> list[Span]:
        return list(self._holes)

    def hole_sizes(self) -> list[int]:
        return [size for _, size in self._holes]

    def check(self) -> None:
        for (a, a_size), (b, _) in zip(self._holes, self._holes[1:]):
            if a + a_size == b:
                raise InvariantError(f"holes at {a} and {b} are adjacent, not coalesced")


class Buddy:
    """Binary buddy system: regions are power-of-two blocks aligned at their size.

    A pool that is not a power of two is covered by top-level arenas from its binary
    decomposition, largest first, each aligned at its own size (12 slots: [0, 8) and
    [8, 12)). Free blocks sit in one sorted address list per order (size 2**order).
    A request takes the smallest order that has a free block, the lowest address in
    it, and splits it down, freeing the upper halves. A freed block merges with its
    buddy (address XOR size) while the buddy is free and the merged block stays
    inside its arena, so an empty pool is its arenas again.
    """

    def __init__(self, capacity: int):
        self._arenas: list[Span] = []
        self._free: dict[int, list[int]] = {}
        start = 0
        for order in reversed(range(capacity.bit_length())):
            if capacity >> order & 1:
                self._arenas.append(Span(start, 1 << order))
                self._free[order] = [start]
                start += 1 << order
        self._arena_starts = [a.start for a in self._arenas]
        self.largest = self._arenas[0].size if self._arenas else 0

    def placed_size(self, size: int) -> int:
        return next_power_of_two(size)

    def _arena_size(self, addr: int) -> int:
        return self._arenas[bisect_right(self._arena_starts, addr) - 1].size

    def place(self, size: int) -> int | None:
        want = self.placed_size(size).bit_length() - 1
        order = next((o for o in sorted(self._free) if o >= want and self._free[o]), None)
        if order is None:
            return None
        addr = self._free[order].pop(0)
        while order > want:
            order -= 1
            insort(self._free.setdefault(order, []), addr + (1 << order))
        return addr

    def release(self, addr: int, size: int) -> None:
        order = size.bit_length() - 1
        arena = self._arena_size(addr)
        while 2 << order <= arena:  # the merged block must stay in the arena
            buddy = addr ^ (1 << order)
            peers = self._free.get(order, [])
            i = bisect_left(peers, buddy)
            if i == len(peers) or peers[i] != buddy:
                break
            del peers[i]
            addr, order = min(addr, buddy), order + 1
        insort(self._free.setdefault(order, []), addr)

    def holes(self) -> list[Span]:
        return sorted(Span(a, 1 << o) for o, addrs in self._free.items() for a in addrs)

    def hole_sizes(self) -> list[int]:
        """The free blocks' sizes, in no order (what `holes` sorts)."""
        return [1 << o for o, addrs in self._free.items() for _ in addrs]

    def check(self) -> None:
        for order, addrs in self._free.items():
            size = 1 << order
            for addr in addrs:
                if addr % size or size > self._arena_size(addr):
                    raise InvariantError(f"free block at {addr} of size {size} is misaligned or outside its arena")
                if 2 * size <= self._arena_size(addr) and (addr ^ size) in addrs:
                    raise InvariantError(
                        f"free block at {addr} and its buddy at {addr ^ size} (size {size}) are not coalesced"
                    )


PLACEMENTS = {"first-fit": FirstFit, "buddy": Buddy}


def _choose(registry: dict, name: str, what: str):
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]


# -- the allocator --------------------------------------------------------------------


@dataclass
class _Region:
    shape: SeqShape
    tokens: int
    start: int
    requested: int  # slots the reserve rule asked for
    placed: int  # slots the placement gave (>= requested)


class ContiguousAllocator:
    """One fixed region per sequence, sized by a reserve rule, placed by a strategy."""

    counted = True  # a CountedAllocator
    takes_blocks_in_bulk = False
    store = None  # no KV tiers behind it
    block_size = None  # regions, not blocks
    page_size = 1

    def __init__(self, capacity: int, max_model_len: int, reserve: str, placement: str):
        self.capacity = capacity
        self.max_model_len = max_model_len
        self._reserve = _choose(RESERVES, reserve, "reserve rule")
        self._placement = _choose(PLACEMENTS, placement, "placement")(capacity)
        self._regions: dict[int, _Region] = {}

    def _request(self, shape: SeqShape, num_tokens: int) -> int:
        # Never less than what the sequence already holds; at least one slot, so every
        # live sequence owns an address.
        return max(self._reserve(shape, self.max_model_len), num_tokens, 1)

    # -- views for tests and reports ------------------------------------------------

    def region(self, seq_id: int) -> Span:
        """Where a sequence's region lies: its start and placed size."""
        r = self._regions[seq_id]
        return Span(r.start, r.placed)

    def holes(self) -> list[Span]:
        """Free runs sorted by start; for buddy, the free blocks."""
        return self._placement.holes()

    def take_load_s(self) -> float:
        return 0.0  # no KV tiers: nothing to load

    def tokens_of(self, seq_id: int) -> int | None:
        r = self._regions.get(seq_id)
        return None if r is None else r.tokens

    # -- KVAllocator ----------------------------------------------------------------

    def unfit_reason(self, shape: SeqShape) -> str | None:
        needed = self._placement.placed_size(self._request(shape, shape.prompt_tokens))
        if needed > self._placement.largest:
            return "reservation exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        return self._placement.placed_size(self._request(shape, shape.final_tokens))

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # no cache: nothing is shared

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to do: no cache."""

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._regions:
            raise ValueError(f"sequence {seq_id} is already allocated")
        requested = self._request(shape, num_tokens)
        placed = self._placement.placed_size(requested)
        if keep_free and sum(self._placement.hole_sizes()) - placed < keep_free:
            return False
        start = self._placement.place(requested)
        if start is None:
            return False
        self._regions[seq_id] = _Region(shape, num_tokens, start, requested, placed)
        return True

    def fork(self, parent_id: int, child_id: int) -> bool:
        """A region cannot be shared: the child gets a copy, a new region of the same size."""
        if child_id in self._regions:
            raise ValueError(f"sequence {child_id} is already allocated")
        p = self._regions[parent_id]
        start = self._placement.place(p.requested)
        if start is None:
            return False
        self._regions[child_id] = _Region(p.shape, p.tokens, start, p.requested, p.placed)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        r = self._regions[seq_id]
        check_growth(seq_id, r.tokens, num_tokens)
        # A region never moves or grows: past its reservation the sequence must wait.
        if num_tokens > r.requested:
            return False
        r.tokens = num_tokens
        return True

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        return 0  # within its region; past it, grow fails whatever is free

    def free(self, seq_id: int) -> None:
        r = self._regions.pop(seq_id)
        self._placement.release(r.start, r.placed)

    def drop(self, seq_id: int) -> None:
        self.free(seq_id)  # nothing is cached

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # no cache to evict from

    def evict_to_free(self, slots: int) -> None:
        pass

    # -- what the fast path asks (kvsim.sim.lazy): one sequence's share, the pool alone ----

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still gain by `grow` that change nothing but its token
        count: up to its reservation (or its final length, if that comes first)."""
        r = self._regions[seq_id]
        return max(0, min(r.requested, r.shape.final_tokens) - r.tokens)

    def slots_of(self, seq_id: int) -> tuple[int, int]:
        """(slots the sequence asked for, placement padding): its part of `breakdown`."""
        r = self._regions[seq_id]
        return r.requested, r.placed - r.requested

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        """(unusable, free, starved): holes too small for the next sequence's region are
        unusable; all of them are when the region would eat into the watermark."""
        sizes = self._placement.hole_sizes()
        free = sum(sizes)
        if next_seq is None:
            return 0, free, False
        shape, tokens, keep_free = next_seq
        need = self._placement.placed_size(self._request(shape, tokens))
        unusable = sum(size for size in sizes if size < need)
        if unusable == free or free - need < keep_free:
            return free, 0, True
        return unusable, free - unusable, False

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """Each region split by split_used, its placement padding, and the holes
        (`pool_free`)."""
        token = reservation = internal = padding = 0
        for r in self._regions.values():
            t, res, i = split_used(r.tokens, r.requested, r.shape.final_tokens)
            token, reservation, internal = token + t, reservation + res, internal + i
            padding += r.placed - r.requested
        unusable, free, starved = self.pool_free(next_seq)
        return Breakdown(token, reservation, internal, padding, unusable, free, starved=starved)

    def check_invariants(self) -> None:
        pieces = [(r.start, r.placed, f"seq {s}") for s, r in self._regions.items()]
        pieces += [(start, size, f"hole at {start}") for start, size in self.holes()]
        end, last = 0, "the pool start"
        for start, size, name in sorted(pieces):
            if start != end:
                kind = "overlaps" if start < end else "leaves a gap after"
                raise InvariantError(f"{name} [{start}, {start + size}) {kind} {last}")
            end, last = start + size, name
        if end != self.capacity:
            raise InvariantError(f"regions and holes cover [0, {end}), not [0, {self.capacity})")
        self._placement.check()
        for seq_id, r in self._regions.items():
            if not r.tokens <= r.requested <= r.placed:
                raise InvariantError(
                    f"seq {seq_id} holds {r.tokens} tokens in a region of {r.requested} asked, {r.placed} placed"
                )
