"""Paged KV cache, as in vLLM's PagedAttention.

The pool is `num_blocks` physical blocks of `block_size` token slots each. A sequence
owns a block table: the list of physical block ids that hold its tokens, in logical
order. It takes a new block only when its last block is full, so at most one block per
sequence is partly empty (internal fragmentation under one block), and any free block
serves any sequence: there are no holes, and free slots are unusable only when the
next waiting request needs more blocks than are free.

Free blocks wait in a FIFO queue. It starts as 0..N-1; allocation takes from the left.
`free` appends a sequence's blocks to the right tail-first (reverse table order), as
vLLM's block pool does, so the blocks at the end of a finished sequence, which hold the
least shareable prefix, are handed out again first among them.

With sliding-window attention (`window`, e.g. Mistral-7B's 4096) a token attends only
to the last `window` tokens, so a block whose tokens all lie before them is released as
the sequence grows: a sequence then holds at most about window / block_size blocks.

Invariants: each block id is in exactly one place (the free queue or one block table);
a table (with its released leading blocks) covers its tokens and holds no block beyond
the last one it needs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvsim.allocators.base import Breakdown, InvariantError, SeqShape, split_used


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` slots (ceil division)."""
    return -(-tokens // block_size)


@dataclass
class _Seq:
    shape: SeqShape
    tokens: int
    table: list[int]     # live blocks, in logical order
    dropped: int = 0     # leading blocks released because they left the window

    def logical_blocks(self) -> int:
        return self.dropped + len(self.table)


class PagedAllocator:
    """Fixed-size blocks handed out one at a time from a FIFO free queue."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.capacity = num_blocks * block_size
        # Owned here only: every block id is either in this queue or in one table.
        self._free: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _Seq] = {}

    # -- views for tests and reports ------------------------------------------------

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids in queue order (the next allocation takes the first)."""
        return list(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].table)

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    # -- KVAllocator ----------------------------------------------------------------

    def unfit_reason(self, shape: SeqShape) -> str | None:
        # A sequence that cannot finish even alone would be preempted and re-admitted
        # forever, so the scheduler must reject it up front.
        # Even with a window, a recompute prefills the whole context in one allocation.
        if blocks_for(shape.final_tokens, self.block_size) > self.num_blocks:
            return "final length exceeds KV pool"
        return None

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return 0   # no cache: nothing is shared

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        need = blocks_for(num_tokens, self.block_size)
        if need + blocks_for(keep_free, self.block_size) > len(self._free):
            return False
        table = [self._free.popleft() for _ in range(need)]
        self._seqs[seq_id] = seq = _Seq(shape, num_tokens, table)
        self._slide(seq)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        if num_tokens < seq.tokens:
            raise ValueError(f"sequence {seq_id} holds {seq.tokens} tokens; "
                             f"cannot grow to {num_tokens}")
        extra = blocks_for(num_tokens, self.block_size) - seq.logical_blocks()
        if extra > len(self._free):
            return False
        seq.table.extend(self._free.popleft() for _ in range(extra))
        seq.tokens = num_tokens
        self._slide(seq)
        return True

    def _slide(self, seq: _Seq) -> None:
        """Release leading blocks whose tokens are all outside the attention window."""
        if self.window is None:
            return
        out = max(0, (seq.tokens - self.window) // self.block_size - seq.dropped)
        if out:
            self._free.extend(seq.table[:out])
            del seq.table[:out]
            seq.dropped += out

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        self._free.extend(reversed(seq.table))

    def breakdown(self, next_seq: tuple[SeqShape, int] | None) -> Breakdown:
        token = reservation = internal = 0
        for seq in self._seqs.values():
            gone = seq.dropped * self.block_size
            t, r, i = split_used(seq.tokens - gone, len(seq.table) * self.block_size,
                                 seq.shape.final_tokens - gone)
            token, reservation, internal = token + t, reservation + r, internal + i
        free_slots = len(self._free) * self.block_size
        starved = (next_seq is not None
                   and len(self._free) < blocks_for(next_seq[1], self.block_size))
        return Breakdown(token, reservation, internal, padding=0,
                         unusable=free_slots if starved else 0,
                         free=0 if starved else free_slots)

    def check_invariants(self) -> None:
        owned = [b for seq in self._seqs.values() for b in seq.table]
        everywhere = set(self._free).union(owned)
        fast_ok = (len(everywhere) == len(self._free) + len(owned) == self.num_blocks
                   and (not everywhere or (min(everywhere) >= 0 and max(everywhere) < self.num_blocks))
                   and all(blocks_for(s.tokens, self.block_size) == s.logical_blocks()
                           for s in self._seqs.values()))
        if not fast_ok:   # find and name the culprit
            self._diagnose()

    def _diagnose(self) -> None:
        owner: dict[int, str] = {}

        def claim(block: int, where: str) -> None:
            if not 0 <= block < self.num_blocks:
                raise InvariantError(f"block {block} in {where} is out of range")
            if block in owner:
                raise InvariantError(f"block {block} is in both {owner[block]} and {where}")
            owner[block] = where

        for block in self._free:
            claim(block, "the free queue")
        for seq_id, seq in self._seqs.items():
            for block in seq.table:
                claim(block, f"seq {seq_id}'s table")
            held = seq.logical_blocks() * self.block_size
            if held < seq.tokens:
                raise InvariantError(f"seq {seq_id} holds {seq.tokens} tokens in "
                                     f"{held} slots (blocks {seq.table})")
            if seq.logical_blocks() > blocks_for(seq.tokens, self.block_size):
                raise InvariantError(f"seq {seq_id} keeps block {seq.table[-1]} "
                                     f"beyond its {seq.tokens} tokens")
        if len(owner) != self.num_blocks:
            lost = sorted(set(range(self.num_blocks)) - owner.keys())
            raise InvariantError(f"blocks {lost} are neither free nor in a table")
