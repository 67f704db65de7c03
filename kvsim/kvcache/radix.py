"""Prefix cache on a radix tree, as in SGLang's RadixAttention (SGLang 0.5.23).

RadixAttention (Zheng et al., "SGLang", NeurIPS 2024): a radix tree of token sequences, reference counts on the
nodes in use, LRU eviction of leaves. The pool is `capacity` token slots in pages of
`page_size` slots (SGLang's --page-size, default 1); a sequence holds whole pages, so
with pages > 1 its last page may be partly empty. The tree itself (radix_tree.py) holds
whole pages only.

A sequence is admitted with the longest cached prefix of its tokens (at most
num_tokens - 1, in whole pages: Req.init_next_round_input in managers/schedule_batch.py,
RadixCache.match_prefix in mem_cache/radix_cache.py); it locks that path and holds its
other tokens in its private part. Its tokens enter the tree, so that others can match
them, at two moments:
- after each prefill chunk (checkpoint_kv_cache in mem_cache/common.py, called from
  scheduler_components/batch_result_processor.py and Scheduler.stash_chunked_request;
  RadixCache.checkpoint): the tokens computed so far. An engine says so with
  `cache_prefilled` once the step has run. Without that call, `grow` does it for the
  prompt tokens the sequence held before: allocate and grow come before the step that
  computes the tokens, so what a sequence held at its previous call has been computed by
  its next. Either way a request admitted in the step that prefills the same prompt does
  not share it.
- when it finishes (release_kv_cache with checkpoint=True, mem_cache/common.py): every
  token it holds (under SGLang's rules, all but the last sampled, which is never fed in;
  an engine that gives that token a slot has it inserted too).
Inserting moves the sequence's tokens the tree lacks into it, frees its private copies
of the tokens the tree already had (another request computed them first) and moves its
lock to the end of what it inserted. A retracted request is released without inserting
(`drop`: release_kv_cache with checkpoint=False): what it put in the tree after its
prefill stays there, unlocked, and its generated tokens are freed.

Eviction (evict_to_free_tokens in mem_cache/allocator/base.py, called by
alloc_token_slots in mem_cache/allocation.py): when the free slots cannot hold an
allocation, the tree evicts the shortfall, unlocked leaves least recently used first.
With pages of more than one token SGLang's allocation asks for more than it takes
(alloc_paged_token_slots_extend: the new tokens and a page per request; the decode's,
alloc_paged_token_slots_decode: a page per request, which the SGLang rules evict for), and
the tree evicts for that demand.
A lookup refreshes the recency of the path it matches (match_prefix), an insert that of
the path it walks; `match_prefix` here is that lookup, so it may split an edge.

What differs from SGLang: kvsim allocates per sequence (SGLang per batch: the sum of a
prefill batch's new tokens, or one token per running request in decode; its paged
prefill also asks for one page per request more), so a shortfall is evicted per
sequence. Forking inserts the parent's tokens at once, so samples share them. The
eviction priority is LRU (SGLang also offers LFU and others).

Invariants: tree + private + free slots == capacity; a node's lock count equals the
number of running sequences whose path passes through it; only unlocked leaves are
evicted; each sequence's path spells its own first `matched` tokens, whole pages that
cover the tokens it offered once computed; no edge holds content -1.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.kvcache.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth, split_used
from kvsim.kvcache.radix_tree import Node, RadixTree
from kvsim.kvcache.runs import Runs, cacheable_runs, common_length, runs_length


@dataclass
class _Seq:
    shape: SeqShape
    tokens: int
    node: Node  # where its part in the tree ends (the root if none)
    matched: int  # its leading tokens in the tree, whole pages, locked through node
    offered: int = 0  # its first tokens offered to the tree once computed


class RadixCacheAllocator:
    """Token slots in pages, shared through a radix tree of cached prefixes."""

    counted = False  # every token takes a free slot: no room to count in
    takes_blocks_in_bulk = False
    store = None  # no KV tiers behind it
    block_size = None  # pages are taken one by one as tokens need them

    def __init__(self, capacity: int, page_size: int = 1):
        if capacity < 0 or page_size < 1 or capacity % page_size:
            raise ValueError(f"need whole pages: capacity {capacity}, page_size {page_size}")
        self.capacity = capacity
        self.page_size = page_size
        self._tree = RadixTree(page_size)
        self._private = 0  # slots of sequences' pages beyond their match
        self._free = capacity
        self._seqs: dict[int, _Seq] = {}

    # -- views for tests and reports ------------------------------------------------

    def nodes(self) -> list[tuple[int, Runs, int]]:
        """Every node as (tokens before it, edge runs, refcount), depth first."""
        return [(depth, node.runs, node.ref) for node, depth in self._tree.all_nodes()]

    @property
    def free_slots(self) -> int:
        """Slots held by nothing (evictable tree slots not included)."""
        return self._free

    @property
    def evictable_slots(self) -> int:
        """Slots of the tree no running sequence locks."""
        return self._tree.evictable

    @property
    def cached_slots(self) -> int:
        """Slots the tree holds, locked or not."""
        return self._tree.size

    def take_load_s(self) -> float:
        return 0.0  # no KV tiers: nothing to load

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    # -- pages and eviction -------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        """Slots of the whole pages that hold `tokens` tokens."""
        return -(-tokens // self.page_size) * self.page_size

    def _reserve(self, need: int) -> None:
        """Move `need` slots to private parts, first evicting the shortfall when too few
        are free. The caller has checked that free + evictable slots suffice."""
        self.evict_to_free(need)
        self._free -= need
        self._private += need

    def evict_to_free(self, slots: int) -> None:
        """Evict least recently used leaves until `slots` are free, or nothing is
        evictable (evict_to_free_tokens: the shortfall only)."""
        if slots > self._free:
            self._free += self._tree.evict(slots - self._free)

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        """Evictable slots that admitting the sequence with `num_tokens` would lock: its
        cached prefix's unlocked part (SGLang locks it while it tests the admission)."""
        return self._tree.walk(cacheable_runs(shape, max(num_tokens - 1, 0))).locked

    def _cache(self, seq: _Seq, runs: Runs) -> None:
        """Insert the sequence's first tokens `runs` (whole pages) and lock it there
        (cache_unfinished_req): its copies of tokens the tree had are freed."""
        node, known = self._tree.insert(runs, seq.offered)
        self._tree.lock(node, +1)
        self._tree.lock(seq.node, -1)
        inserted = runs_length(runs)
        self._private -= inserted - seq.matched
        self._free += known - seq.matched
        seq.node, seq.matched = node, inserted

    def _to_insert(self, seq: _Seq, done: int) -> Runs:
        """The whole pages of the sequence's first `done` (computed) tokens, if the tree
        lacks some for it and they were not offered before; else ()."""
        if done <= seq.offered:
            return ()
        runs = self._tree.whole_pages(cacheable_runs(seq.shape, done))
        return runs if runs_length(runs) > seq.matched else ()

    def _gain(self, seq: _Seq, runs: Runs) -> int:
        """Slots that inserting `runs` for `seq` makes available: its copies of what the
        tree has are freed, minus the unlocked cached slots it locks."""
        if not runs:
            return 0
        match = self._tree.walk(runs)
        return match.matched - seq.matched - match.locked

    # -- KVAllocator ----------------------------------------------------------------

    def unfit_reason(self, shape: SeqShape) -> str | None:
        if self._pages(shape.final_tokens) > self.capacity:
            return "final length exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        return self._pages(shape.final_tokens)

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return self._tree.lookup(cacheable_runs(shape, max(num_tokens - 1, 0))).matched

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """The step computing the sequence's prefill (chunk) has run: its first
        `num_tokens` tokens (at most what it holds) enter the tree, as SGLang's
        cache_unfinished_req does after every prefill chunk. Never fails: inserting
        takes no slots."""
        seq = self._seqs[seq_id]
        done = min(num_tokens, seq.tokens)
        runs = self._to_insert(seq, done)
        if runs:
            self._cache(seq, runs)
        seq.offered = max(seq.offered, done)

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        match = self._tree.walk(cacheable_runs(shape, max(num_tokens - 1, 0)))
        need = self._pages(num_tokens) - match.matched
        # The match itself cannot be evicted to make room; the watermark stays free.
        if need + keep_free > self._free + self._tree.evictable - match.locked:
            return False
        end = self._tree.touch(match)
        self._tree.lock(end, +1)
        if self.page_size > 1:  # SGLang's paged extend evicts for its tokens and a page more
            self.evict_to_free(num_tokens - match.matched + self.page_size)
        self._reserve(need)
        self._seqs[seq_id] = _Seq(shape, num_tokens, end, match.matched)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        done = min(seq.tokens, seq.shape.prompt_tokens)  # computed by now
        runs = self._to_insert(seq, done)
        need = self._pages(num_tokens) - self._pages(seq.tokens)
        if need > self._free + self._tree.evictable + self._gain(seq, runs):
            return False
        if runs:
            self._cache(seq, runs)
        seq.offered = max(seq.offered, done)
        self._reserve(need)
        seq.tokens = num_tokens
        return True

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        return self._pages(num_tokens) - self._pages(self._seqs[seq_id].tokens)

    def fork(self, parent_id: int, child_id: int) -> bool:
        """The parent's tokens go into the tree (whole pages) and both sequences lock
        them; the child copies the parent's other pages, which fails, changing nothing,
        if even eviction cannot make room for them."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated")
        parent = self._seqs[parent_id]
        runs = self._tree.whole_pages(cacheable_runs(parent.shape, parent.tokens))
        copy = self._pages(parent.tokens) - runs_length(runs)
        if copy > self._free + self._tree.evictable + self._gain(parent, runs):
            return False
        self._cache(parent, runs)
        self._tree.lock(parent.node, +1)
        self._reserve(copy)
        self._seqs[child_id] = _Seq(parent.shape, parent.tokens, parent.node, parent.matched, parent.offered)
        return True

    def free(self, seq_id: int) -> None:
        """Insert every token it holds (cache_finished_req, whole pages), free the rest
        of its pages and release its lock."""
        seq = self._seqs.pop(seq_id)
        runs = self._tree.whole_pages(cacheable_runs(seq.shape, seq.tokens))
        _, known = self._tree.insert(runs, seq.offered)
        held = self._pages(seq.tokens) - seq.matched
        self._private -= held
        self._free += held - (runs_length(runs) - known)
        self._tree.lock(seq.node, -1)

    def drop(self, seq_id: int) -> None:
        """Release without caching (a retraction: release_kv_cache with checkpoint=False):
        what it put into the tree stays there, unlocked; its other pages are freed."""
        seq = self._seqs.pop(seq_id)
        held = self._pages(seq.tokens) - seq.matched
        self._private -= held
        self._free += held
        self._tree.lock(seq.node, -1)

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """A running sequence's tree part is token slots (shared ones counted once); its
        private pages split as any allocation (split_used): with pages > 1 the unfilled
        part of its last page is reservation or internal. Unlocked tree slots are
        evictable and count as free (or unusable, with the free slots, when the next
        sequence could not be admitted after its match)."""
        token = self._tree.size - self._tree.evictable
        reservation = internal = logical = 0
        for seq in self._seqs.values():
            logical += seq.tokens
            t, r, i = split_used(
                seq.tokens - seq.matched, self._pages(seq.tokens) - seq.matched, seq.shape.final_tokens - seq.matched
            )
            token, reservation, internal = token + t, reservation + r, internal + i
        unusable, free, starved = self.pool_free(next_seq)
        return Breakdown(
            token,
            reservation,
            internal,
            padding=0,
            unusable=unusable,
            free=free,
            shared=logical - token,
            starved=starved,
        )

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        """(unusable, free, starved) as `breakdown` gives them, without its walk over sequences."""
        available = self._free + self._tree.evictable
        if next_seq is not None:
            shape, tokens, keep_free = next_seq
            match = self._tree.walk(cacheable_runs(shape, max(tokens - 1, 0)))
            if self._pages(tokens) - match.matched + keep_free > available - match.locked:
                return available, 0, True
        return 0, available, False

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        private = 0
        for seq_id, seq in self._seqs.items():
            node, depth, spelled = seq.node, 0, ()
            while node is not self._tree.root:
                refs[node.id] = refs.get(node.id, 0) + 1
                depth, spelled, node = depth + node.length, node.runs + spelled, node.parent
            if (
                depth != seq.matched
                or seq.matched % self.page_size
                or seq.tokens < seq.matched
                or common_length(spelled, seq.shape.runs(0, seq.matched)) != seq.matched
            ):
                raise InvariantError(
                    f"seq {seq_id} matched {seq.matched} tokens and holds "
                    f"{seq.tokens}, but its path spells {depth} of its own"
                )
            offered = self._tree.whole_pages(cacheable_runs(seq.shape, seq.offered))
            if runs_length(offered) > seq.matched or seq.offered > seq.tokens:
                raise InvariantError(
                    f"seq {seq_id} offered {seq.offered} tokens to the tree but is matched on {seq.matched}"
                )
            private += self._pages(seq.tokens) - seq.matched
        self._tree.check(refs)
        if private != self._private:
            raise InvariantError(f"counted {private} private slots, kept {self._private}")
        if self._free < 0 or self._tree.size + private + self._free != self.capacity:
            raise InvariantError(
                f"tree {self._tree.size} + private {private} + free {self._free} != capacity {self.capacity}"
            )
