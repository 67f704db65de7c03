"""Paged KV cache, as in vLLM's PagedAttention.

The pool is `num_blocks` physical blocks of `block_size` token slots each. A sequence
owns a block table: the list of physical block ids that hold its tokens, in logical
order. It takes a new block only when its last block is full, so at most one block per
sequence is partly empty (internal fragmentation under one block), and any free block
serves any sequence: there are no holes, and free slots are unusable only when the
next waiting request needs more blocks than are free.

Free blocks wait in a queue that starts as 0..N-1; allocation takes from its head, and
released blocks go back to the head, so the blocks just released are reused first, a
finished sequence's deepest block first: vLLM V1 (0.33.0, vllm/v1/core/: without prefix
caching SingleTypeKVCacheManager.free passes a request's blocks deepest first and
BlockPool.free_blocks prepends them as one run, "LIFO reuse of non-cached blocks"; vLLM
0.10.1.1 appended them to the tail) and vLLM V0 (0.6.3.post1, vllm/core/block/:
BlockTable.free releases them in table order, NaiveBlockAllocator._free_block_id puts
each at the head) give the same order.

Sequences of one request (parallel samples, beams) share blocks through `fork`: the
child's table is a copy of the parent's and every block's reference count goes up. A
shared block that is only partly filled is copied on write: the first sequence to add
a token to it gets a fresh block instead (vLLM's copy-on-write), so only the prompt's
(and common history's) full blocks stay shared. A block returns to the free queue when
its count drops to zero.

With sliding-window attention (`window`, e.g. Mistral-7B's 4096) a token attends only
to the last `window` tokens, so a block whose tokens all lie before them is released as
the sequence grows (in the same order as `free`): a sequence then holds at most about
window / block_size blocks. Here a block leaves right after the growth that pushes it
out (kvsim's rule for vLLM V0, not checked against its code); vLLM V1's own rules,
which release before allocating, are kvsim.kvcache.sliding's.

Not modelled: vLLM V1 keeps block 0 out of the pool as its "null block" (the
placeholder for skipped sliding-window blocks; block_pool.py BlockPool.__init__), so
its pool has one usable block fewer than kvsim's.

Reference counts are kept from the first shared block on (a fork, a prefix-cache hit):
until then every block outside the queue has one holder, which the queue says, so
taking and releasing a run of blocks is a slice of the queue alone.

Invariants: each block id is either in the free queue (count 0) or in as many block
tables as its reference count says; a table (with its released leading blocks) covers
its tokens and holds no block beyond the last one it needs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import compress
from operator import not_
from typing import TYPE_CHECKING

from kvsim.kvcache.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth, split_used
from kvsim.kvcache.free_queue import FreeQueue

if TYPE_CHECKING:
    from kvsim.kvcache.tiers import TierStore


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` slots (ceil division)."""
    return -(-tokens // block_size)


@dataclass(slots=True)
class _Seq:
    shape: SeqShape
    tokens: int
    table: list[int]  # live blocks, in logical order
    dropped: int = 0  # leading blocks released because they left the window

    def logical_blocks(self) -> int:
        return self.dropped + len(self.table)

    def copy(self) -> "_Seq":
        """A forked sequence's record: the same blocks, its own table."""
        return replace(self, table=list(self.table))


def tables_breakdown(
    tables: Iterable[tuple[list[int], int, int]], block_size: int, used_blocks: int, pool_free: tuple[int, int, bool]
) -> Breakdown:
    """A pool of blocks held by tables (block ids, tokens held, tokens the sequence will
    reach), in O(tables): a table's unfilled slots all sit in its last block, which only
    its forks may share, so reservation and internal come from split_used once per
    distinct last block, and every other used slot holds a token. shared = logical -
    physical slots in use; `pool_free` is the allocator's (unusable, free, starved)."""
    reservation = internal = logical = 0
    last_blocks: set[int] = set()
    for table, tokens, final_tokens in tables:
        allocated = len(table) * block_size
        logical += allocated
        if table and table[-1] not in last_blocks:
            last_blocks.add(table[-1])
            _, r, i = split_used(tokens, allocated, final_tokens)
            reservation, internal = reservation + r, internal + i
    used = used_blocks * block_size
    unusable, free_slots, starved = pool_free
    return Breakdown(
        used - reservation - internal,
        reservation,
        internal,
        padding=0,
        unusable=unusable,
        free=free_slots,
        shared=logical - used,
        starved=starved,
    )


class PagedAllocator:
    """Fixed-size blocks handed out from the head of a free queue."""

    counted = True  # a CountedAllocator ...
    takes_blocks_in_bulk = True  # ... that also takes blocks for later growth (block_room)
    store: TierStore | None = None  # no KV tiers behind it (kvsim.kvcache.tiered has)

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.capacity = num_blocks * block_size
        # Owned here only: a block is in this queue (count 0) or in `ref[b]` tables; the
        # head is the next block handed out (kvsim.kvcache.free_queue).
        self._free = self._make_queue()
        # Reference counts, None until a block is first shared (the queue says them till then)
        self._ref: list[int] | None = None
        self._shared = 0  # blocks with count > 1: the breakdown's slow path
        self._seqs: dict[int, _Seq] = {}

    # -- views for tests and reports ------------------------------------------------

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids in queue order (the next allocation takes the first)."""
        return list(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].table)

    def released_blocks(self, seq_id: int) -> int:
        """Leading blocks of the sequence's table released as they left the window."""
        return self._seqs[seq_id].dropped

    def ref_count(self, block: int) -> int:
        return self._counts()[block]

    def _counts(self) -> list[int]:
        """The reference counts, made from the queue where none are kept yet."""
        if self._ref is not None:
            return self._ref
        counts = [1] * self.num_blocks
        for b in self._free:
            counts[b] = 0
        return counts

    def take_load_s(self) -> float:
        return 0.0  # no KV tiers: nothing to load

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    # -- reference counts -------------------------------------------------------------

    def _make_queue(self):
        """The free queue: no block ever leaves it from the middle here (a prefix cache's do)."""
        return FreeQueue(self.num_blocks, to_head=True)

    def _take(self, count: int) -> list[int]:
        """Hand out `count` blocks from the queue head."""
        blocks = self._free.take(count)
        ref = self._ref
        if ref is not None:
            for b in blocks:
                ref[b] = 1
        return blocks

    def _share(self, blocks: list[int]) -> None:
        """One reference more on each block (distinct blocks: a table holds none twice);
        queued ones (prefix-cache hits) leave the queue. In bulk: a request shares hundreds."""
        if self._ref is None:
            self._ref = self._counts()
        ref = self._ref
        before = [ref[b] for b in blocks]
        for b in compress(blocks, map(not_, before)):
            self._free.remove(b)
        for b, n in zip(blocks, before):
            ref[b] = n + 1
        self._shared += before.count(1)

    def _drop(self, blocks) -> None:
        """One reference fewer on each block (distinct), in the order given; blocks nobody
        holds rejoin the queue's head, one after the other."""
        ref = self._ref
        if ref is None:  # never shared: each had one holder, its last
            self._free.put(blocks)
            return
        blocks = list(blocks)
        if not self._shared:
            for b in blocks:
                ref[b] = 0
            self._free.put(blocks)
            return
        self._free.put(compress(blocks, map(not_, self._unref(blocks))))

    def _unref(self, blocks: list[int]) -> list[int]:
        """One reference fewer on each block (distinct), where counts are kept: their counts left."""
        ref = self._ref
        assert ref is not None
        left = [ref[b] - 1 for b in blocks]
        for b, n in zip(blocks, left):
            ref[b] = n
        self._shared -= left.count(1)
        return left

    def _release(self, blocks: list[int]) -> None:
        """Drop a run of a table's blocks in table order: the deepest ends at the head."""
        self._drop(blocks)

    def _grown(self, seq: _Seq) -> None:
        """After a sequence gained tokens: release blocks that left the window."""
        self._slide(seq)

    # -- KVAllocator ----------------------------------------------------------------

    def unfit_reason(self, shape: SeqShape) -> str | None:
        # A sequence that cannot finish even alone would be preempted and re-admitted
        # forever, so the scheduler must reject it up front. Even with a window, a
        # recompute prefills the whole context in one allocation.
        if blocks_for(shape.final_tokens, self.block_size) > self.num_blocks:
            return "final length exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        return blocks_for(shape.final_tokens, self.block_size) * self.block_size

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # no cache: nothing is shared between requests

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        need = blocks_for(num_tokens, self.block_size)
        if need + blocks_for(keep_free, self.block_size) > len(self._free):
            return False
        self._seqs[seq_id] = seq = _Seq(shape, num_tokens, self._take(need))
        self._grown(seq)
        return True

    def fork(self, parent_id: int, child_id: int) -> bool:
        """The child shares every block the parent holds (never fails: nothing is copied yet)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated")
        parent = self._seqs[parent_id]
        self._share(parent.table)
        self._seqs[child_id] = parent.copy()
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        extra = blocks_for(num_tokens, self.block_size) - seq.logical_blocks()
        # Writing into a partly filled block that others share: copy it first.
        cow = num_tokens > seq.tokens and self._shares_partial_last(seq)
        if extra + cow > len(self._free):
            return False
        if cow:
            self._drop([seq.table[-1]])
            seq.table[-1] = self._take(1)[0]
        if extra:
            seq.table.extend(self._take(extra))
        seq.tokens = num_tokens
        self._grown(seq)
        return True

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        seq = self._seqs[seq_id]
        extra = blocks_for(num_tokens, self.block_size) - seq.logical_blocks()
        cow = num_tokens > seq.tokens and self._shares_partial_last(seq)
        return (extra + cow) * self.block_size

    def _shares_partial_last(self, seq: _Seq) -> bool:
        """Whether the sequence's last block is partly filled and others hold it too (its
        next token copies it). No block is shared while `_shared` is 0, counts kept or not."""
        return bool(
            seq.tokens % self.block_size and self._shared and self._ref is not None and self._ref[seq.table[-1]] > 1
        )

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to do: vLLM caches a full block when it allocates it (prefix.py)."""

    # -- what the fast path asks (kvsim.sim.lazy): one sequence's share, the pool alone ----

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still gain by `grow` that change nothing here but its
        token count, each filling a reserved slot of its last block. 0 with a sliding
        window or a shared, partly filled last block: the next token slides or copies."""
        seq = self._seqs[seq_id]
        if self.window is not None or self._shares_partial_last(seq):
            return 0
        return max(0, min(seq.logical_blocks() * self.block_size, seq.shape.final_tokens) - seq.tokens)

    def block_room(self, seq_id: int, tails_private: bool = False) -> int:
        """Tokens the sequence can gain where each token only counts or, on a full last
        block, takes the next block of the free queue for itself (`take_free` and `extend`
        do that later, in bulk): up to its final length, unless a window or a shared
        last block limits it to its room. (tails_private: see the prefix cache's.)"""
        seq = self._seqs[seq_id]
        if self.window is not None or self._shares_partial_last(seq):
            return self.room(seq_id)
        return max(0, seq.shape.final_tokens - seq.tokens)

    def take_free(self, count: int) -> list[int]:
        """`count` blocks off the free queue's head, for growth the caller attaches later
        (`extend`); until then they are in no table, which check_invariants reports."""
        return self._take(count)

    def extend(self, seq_id: int, num_tokens: int, blocks: list[int]) -> None:
        """Grow a sequence to `num_tokens` tokens with `blocks` from take_free, in order."""
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        if blocks_for(num_tokens, self.block_size) - seq.logical_blocks() != len(blocks):
            raise ValueError(
                f"sequence {seq_id} needs {blocks_for(num_tokens, self.block_size)} "
                f"blocks for {num_tokens} tokens; it has {seq.logical_blocks()} and "
                f"was given {len(blocks)}"
            )
        seq.table.extend(blocks)
        seq.tokens = num_tokens
        self._grown(seq)

    def slots_of(self, seq_id: int) -> tuple[int, int]:
        """(slots of the sequence's blocks, placement padding): its part of `breakdown`."""
        return len(self._seqs[seq_id].table) * self.block_size, 0

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        """(unusable, free, starved): the free part of `breakdown`, without the walk over
        sequences (O(1); O(cache hits) with a prefix cache and a next sequence)."""
        free_slots = len(self._free) * self.block_size
        if next_seq is None:
            return 0, free_slots, False
        shape, tokens, keep_free = next_seq
        if self._blocks_short(shape, tokens) + blocks_for(keep_free, self.block_size) > 0:
            return free_slots, 0, True
        return 0, free_slots, False

    def _slide(self, seq: _Seq) -> None:
        """Release leading blocks whose tokens are all outside the attention window."""
        if self.window is None:
            return
        out = max(0, (seq.tokens - self.window) // self.block_size - seq.dropped)
        if out:
            self._release(seq.table[:out])
            del seq.table[:out]
            seq.dropped += out

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        self._release(seq.table)

    @property
    def page_size(self) -> int:
        return self.block_size

    def drop(self, seq_id: int) -> None:
        self.free(seq_id)  # a retraction frees as a preemption does (what the cache keeps stays)

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # a cached block is taken back from the free queue: nothing to lock

    def evict_to_free(self, slots: int) -> None:
        pass  # an allocation evicts the free queue's head as it takes it

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        """Blocks a sequence admitted with `num_tokens` tokens needs beyond the free queue."""
        return blocks_for(num_tokens, self.block_size) - len(self._free)

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """Physical blocks counted once, in O(sequences) (tables_breakdown). Queued
        blocks (cached or not) are free, or unusable when the next sequence needs more
        blocks than the queue keeps beyond the watermark (after its cache hits, with a
        prefix cache)."""
        bs = self.block_size
        tables = (  # a window's tokens in blocks that left it count neither as held nor as needed
            (seq.table, seq.tokens - seq.dropped * bs, seq.shape.final_tokens - seq.dropped * bs)
            for seq in self._seqs.values()
        )
        return tables_breakdown(tables, bs, self.num_blocks - len(self._free), self.pool_free(next_seq))

    def check_invariants(self) -> None:
        """Checks per table and over the pool at C speed (check mode runs this after
        every engine step, on pools of tens of thousands of blocks); the block-by-block
        walk that names the culprit runs only when they fail. Block ids enter the free
        queue only from tables (range-checked here) or the initial 0..N-1."""
        bs = self.block_size
        holders: Counter[int] = Counter()
        for seq_id, seq in self._seqs.items():
            if seq.table and not 0 <= min(seq.table) <= max(seq.table) < self.num_blocks:
                raise InvariantError(f"seq {seq_id}'s table {seq.table} has a block out of range")
            if len(set(seq.table)) != len(seq.table):  # _share and _drop count on it
                raise InvariantError(f"seq {seq_id}'s table {seq.table} holds a block twice")
            holders.update(seq.table)
        queued = set(self._free)
        ref = self._counts()
        fast_ok = (
            len(holders) + len(self._free) == self.num_blocks
            and len(queued) == len(self._free)
            and holders.keys().isdisjoint(queued)
            and all(ref[b] == n for b, n in holders.items())
            and sum(ref) == holders.total()
            and min(ref, default=0) >= 0
            and self._shared == sum(n > 1 for n in holders.values())
        )
        if not fast_ok:  # find and name the culprit
            self._diagnose(holders, ref)
        filled_in: dict[int, int] = {}  # partly filled last block -> the tokens in it
        ending: Counter[int] = Counter()  # partly filled last block -> the tables it ends
        for seq_id, seq in self._seqs.items():
            table = seq.table
            if seq.logical_blocks() != blocks_for(seq.tokens, bs):
                raise InvariantError(
                    f"seq {seq_id} holds {seq.tokens} tokens in blocks {table} ({seq.dropped} released)"
                )
            self._check_table(seq_id, seq)
            filled = seq.tokens - (seq.logical_blocks() - 1) * bs
            if table and filled < bs:
                seen = filled_in.setdefault(table[-1], filled)
                if seen != filled:
                    raise InvariantError(
                        f"block {table[-1]} holds {filled} tokens for seq {seq_id} but {seen} for another"
                    )
                ending[table[-1]] += 1
        for block, tables in ending.items():
            if tables != holders[block]:  # a fork's partial block, full for another table
                raise InvariantError(f"partly filled block {block} is not the last block of every table holding it")
        self._check_cache()
        b = self.breakdown(None)
        if min(b.token, b.reservation, b.internal, b.free, b.shared) < 0 or b.capacity != self.capacity:
            raise InvariantError(f"breakdown {b} does not split the pool of {self.capacity}")

    def _check_table(self, seq_id: int, seq: _Seq) -> None:
        """A subclass's checks of one table (a prefix cache: its blocks' keys)."""

    def _check_cache(self) -> None:
        """A subclass's checks of what it keeps beside the tables."""

    def _diagnose(self, counts: Counter, ref: list[int]) -> None:
        queued: set[int] = set()
        for b in self._free:
            if not 0 <= b < self.num_blocks:
                raise InvariantError(f"block {b} in the free queue is out of range")
            if b in queued or b in counts:
                where = "twice in the free queue" if b in queued else "both free and in a table"
                raise InvariantError(f"block {b} is {where}")
            if ref[b] != 0:
                raise InvariantError(f"free block {b} has reference count {ref[b]}")
            queued.add(b)
        for seq_id, seq in self._seqs.items():
            for b in seq.table:
                if not 0 <= b < self.num_blocks:
                    raise InvariantError(f"block {b} in seq {seq_id}'s table is out of range")
                if ref[b] != counts[b]:
                    raise InvariantError(
                        f"block {b} (in seq {seq_id}'s table) has reference count {ref[b]} but {counts[b]} owners"
                    )
        lost = sorted(set(range(self.num_blocks)) - queued - counts.keys())
        if lost:
            raise InvariantError(f"blocks {lost} are neither free nor in a table")
        raise InvariantError(f"shared-block count {self._shared} is stale")
