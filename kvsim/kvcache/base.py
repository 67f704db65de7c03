"""The interface between the scheduler and KV-cache memory.

An allocator is a plain synchronous object: no SimPy, no clock. The scheduler calls it
through `KVAllocator` only; block tables, holes and free lists stay inside.

Units are token slots: the space for one token's KV. A paged pool of N blocks of B
tokens has N*B slots; a contiguous pool has one slot per token of address space.
Byte sizes come from the frozen KVSpec (slots * bytes_per_token).

Accounting of one sequence that holds `tokens` slots of KV, has `allocated` slots
assigned to it, and will end at `final` tokens (prompt + every output token):
  token        = tokens                                   (KV of tokens that exist)
  reservation  = max(0, min(allocated, final) - tokens)   (will be filled later)
  internal     = allocated - max(tokens, min(allocated, final))   (never to be used)
Slots a placement adds on top of what was asked (a buddy region's round-up) are
`padding` and count as external fragmentation, as in the vLLM paper's
"external fragmentation & others".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvsim.kvcache.tiers import TierStore


@dataclass(frozen=True, slots=True)
class SeqShape:
    """What the allocator may know of a request: its lengths and its tokens' identity.

    Token identity is given as content runs, not token ids: `segments` lists
    (content id, length) runs that make up the start of the prompt (a shared system
    prompt, retrieved documents, an earlier turn), and every later token — the rest of
    the prompt and all output — is content `tail_id` from offset 0. Two tokens are the
    same token, whose KV can be shared, when they are at the same position after the
    same preceding tokens (the caches match whole prefixes, so position is implied).
    Content ids are plain ints handed out by the workload; tail_id -1 means "unique,
    never shared" for callers that do not model sharing.
    """

    prompt_tokens: int
    output_tokens: int
    segments: tuple[tuple[int, int], ...] = ()
    tail_id: int = -1

    @property
    def final_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def runs(self, start: int, end: int) -> tuple[tuple[int, int, int], ...]:
        """Tokens [start, end) as (content id, offset in that content, length) runs."""
        out, pos = [], 0
        for content, length in self.segments:
            lo, hi = max(start, pos), min(end, pos + length)
            if lo < hi:
                out.append((content, lo - pos, hi - lo))
            pos += length
        if end > pos:
            lo = max(start, pos)
            out.append((self.tail_id, lo - pos, end - lo))
        return tuple(out)


@dataclass(frozen=True)
class Breakdown:
    """The pool at one instant, in slots. The six parts sum to `capacity`.

    `padding` (slots a placement added to a region) and `unusable` (free space the next
    waiting sequence cannot use) together make the external fragmentation.
    """

    token: int
    reservation: int
    internal: int
    padding: int
    unusable: int
    free: int
    shared: int = 0  # not a part: slots saved by sharing (logical - physical slots in use)
    starved: bool = False  # not a part: the next sequence could not be admitted now

    @property
    def external(self) -> int:
        return self.padding + self.unusable

    @property
    def allocated(self) -> int:
        """Slots held by sequences, used or not."""
        return self.token + self.reservation + self.internal + self.padding

    @property
    def capacity(self) -> int:
        return self.allocated + self.unusable + self.free


def split_used(tokens: int, allocated: int, final: int) -> tuple[int, int, int]:
    """(token, reservation, internal) slots of one sequence; see the module docstring."""
    usable = min(allocated, final)
    reservation = max(0, usable - tokens)
    return tokens, reservation, allocated - tokens - reservation


NextSeq = tuple[SeqShape, int, int]  # (shape, tokens it needs, slots to keep free)


class KVAllocator(Protocol):
    """What every registered allocator provides.

    Every method that can fail returns False and leaves the allocator unchanged. What it
    can do beyond this is declared, not probed: `counted` (it is a CountedAllocator) and
    `takes_blocks_in_bulk` (it is a BulkBlockAllocator).
    """

    capacity: int  # slots

    @property
    def block_size(self) -> int | None:
        """Tokens per block handed out whole; None: not a pool of blocks."""

    @property
    def counted(self) -> bool:
        """Whether it is a CountedAllocator."""

    @property
    def takes_blocks_in_bulk(self) -> bool:
        """Whether it is a BulkBlockAllocator."""

    @property
    def store(self) -> TierStore | None:
        """The KV tiers behind its cache (kvsim.kvcache.tiered), or None."""

    def take_load_s(self) -> float:
        """Seconds of loads from KV tiers since the last call, which the step admitting
        them waits for (0.0 without tiers)."""

    def unfit_reason(self, shape: SeqShape) -> str | None:
        """Why this sequence could never run even in an empty pool, or None if it can."""

    def footprint(self, shape: SeqShape) -> int:
        """Slots one sequence of this shape holds at its final length, alone in the pool
        (what a full pool divides by to give the concurrency it holds)."""

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        """How many leading tokens of the sequence's first `num_tokens` already have KV in
        the cache, reusable by `allocate` right now (0 for allocators without a cache).
        At most num_tokens - 1: the last token is always computed, to produce output.
        A lookup may count as a use of what it matches (the radix cache refreshes its
        recency, as SGLang's does); `breakdown` looks without using."""

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        """Admit a sequence holding `num_tokens` tokens of KV (its matched prefix reused),
        unless that would leave fewer than `keep_free` slots free (the watermark)."""

    def fork(self, parent_id: int, child_id: int) -> bool:
        """Start sequence `child_id` as a copy of `parent_id` (a parallel sample or a beam),
        sharing its KV where the allocator can."""

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Let a sequence hold `num_tokens` tokens in all (never fewer than it holds)."""

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        """Free slots `grow(seq_id, num_tokens)` would take (0 inside a reservation)."""

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """The step computing the sequence's prefill (or a chunk of it) has run: its
        first `num_tokens` tokens have KV. A cache that shares a prompt once it is
        computed (the radix cache, as SGLang) makes them matchable; others ignore it."""

    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds."""

    def drop(self, seq_id: int) -> None:
        """Release it without caching what it computed (SGLang's retraction); an
        allocator whose free caches nothing a retraction would skip frees it."""

    @property
    def page_size(self) -> int:
        """Slots a sequence's KV grows by at a time: its pages or blocks, 1 where it takes
        slots one by one or holds one region."""

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        """Evictable slots that admitting the sequence with `num_tokens` would lock (its
        cached prefix's unlocked part, in a radix cache); 0 where nothing is evictable."""

    def evict_to_free(self, slots: int) -> None:
        """Evict unused cached KV until `slots` are free, where it can (SGLang's
        evict_to_free_tokens); an allocator that evicts as it allocates does nothing."""

    def tokens_of(self, seq_id: int) -> int | None:
        """Tokens of KV the sequence holds, or None if it holds nothing."""

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """The pool split into the five parts; `next_seq` (the head of the waiting
        queue, the tokens it needs this step and the slots admission keeps free, the
        watermark) decides which free space is usable: free space it could not use is
        external fragmentation, and `starved` says it could not be admitted."""

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        """(unusable, free, starved) as `breakdown(next_seq)` gives them, without its walk
        over every sequence (the scheduler asks this at every admission)."""

    def check_invariants(self) -> None:
        """Raise InvariantError if the internal structures disagree."""


class CountedAllocator(KVAllocator, Protocol):
    """An allocator the fast path (kvsim.sim.lazy) can advance decoding sequences in: it
    says how far a sequence may grow by counting alone, and splits its breakdown into
    per-sequence shares and the free part, so that a step's breakdown is kept up to
    date without a walk over every sequence. (The radix cache takes a free slot per
    token, so it has no room: its runs go step by step.)"""

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still gain by `grow` that change nothing in the
        allocator but its token count, each turning one reserved slot into a token slot."""

    def slots_of(self, seq_id: int) -> tuple[int, int]:
        """(slots assigned to the sequence, padding its placement added): its share of
        `breakdown` is split_used(tokens, slots, final) plus the padding."""


class BulkBlockAllocator(CountedAllocator, Protocol):
    """A counted pool of blocks whose sequences may also take whole blocks ahead, in bulk:
    the fast path takes the blocks a tick's boundary crossings need in one call and
    hands them to each sequence when it next looks at it."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    def block_room(self, seq_id: int, tails_private: bool = False) -> int:
        """Tokens the sequence can gain where each only counts or, on a full last block,
        takes the next free block (taken later by take_free and attached by extend).
        tails_private: no request's tail content is another's (what a prefix cache needs
        to let its blocks go in bulk)."""

    def take_free(self, count: int) -> list[int]:
        """`count` blocks off the free queue's head, to be attached by `extend`; the free
        part of `pool_free(None)` is `count` blocks smaller after it."""

    def extend(self, seq_id: int, num_tokens: int, blocks: list[int]) -> None:
        """Grow a sequence to `num_tokens` tokens with `blocks` from take_free, in order."""


def check_growth(seq_id: int, held: int, num_tokens: int) -> None:
    """grow() only grows: asking a sequence to hold fewer tokens is a caller's bug."""
    if num_tokens < held:
        raise ValueError(f"sequence {seq_id} holds {held} tokens; cannot grow to {num_tokens}")


class InvariantError(AssertionError):
    """Memory accounting is broken: a block lost, double-owned, or overlapping."""
