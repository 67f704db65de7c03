"""Paged KV cache with automatic prefix caching, as in vLLM V1 (0.33.0,
vllm/v1/core/block_pool.py, kv_cache_manager.py, single_type_kv_cache_manager.py,
kv_cache_utils.py; one full-attention KV cache group, vLLM's default hash block size).

The pool is the paged allocator's (this class extends it: the free queue, reference
counts, fork and copy-on-write growth are its): `num_blocks` blocks of `block_size`
token slots and a block table per sequence. On top of it, a FULL block whose tokens are
all identified is cached under a chained key: (key of the previous block in the table,
the block's token runs). Equal keys mean equal whole prefixes, so a new request reuses
every cached block of its longest cached prefix instead of recomputing it. Keys are
interned to ints in a dict, so lookups are exact (no hash collisions) and
deterministic; a block containing content -1 ("unique, never shared") gets no key, nor
does any block after it.

The rules, each from vLLM 0.33.0:
- A block is cached when its sequence fills it, at the allocate or grow that covers it
  (KVCacheManager.allocate_slots calls cache_blocks for the tokens it makes room for),
  so a request admitted later in the same step already hits it. Only full blocks are
  cached; a partial last block is never shared between requests.
- A lookup (`match_prefix(shape, n)`) finds whole cached blocks of at most n - 1
  tokens; vLLM asks for a request's num_tokens - 1 (get_computed_blocks), so a prompt
  whose every block is cached recomputes its last one (kvsim.engines.vllm_v1).
- A key may map to several blocks (BlockPool.cached_block_hash_to_block is
  {hash: {block id: block}}, "we don't de-duplicate"): where a match leaves a cached
  block to be recomputed, the copy is cached under the same key. A lookup takes the
  first copy still cached (get_cached_block); evicting one copy leaves the others, so
  the key still hits.
- Blocks no table holds wait in the free queue, which doubles as the LRU. A request's
  blocks are freed deepest first (BlockPool.free_blocks): its full blocks, which vLLM
  has hashed whatever their content, join the tail; its partly filled last block, which
  holds no hash, goes to the head, to be reused first (vLLM 0.10.1.1 sent it to the
  tail too). A new block comes off the head and, if cached, loses its key (evicted:
  _maybe_evict_cached_block); a hit on a queued block takes it out of the middle of the
  queue and bumps its count (touch). Hits on queued blocks count against the free
  blocks when admitting (get_num_blocks_to_allocate).
Sequences of one request (parallel samples, beams) share every block through `fork`,
as in the plain paged allocator: a partly filled block they share is copied on write by
the first of them to add a token.

What differs from vLLM: no "extra keys" (LoRA ids, multimodal hashes) and no per-block
hash of token ids: the workload's content runs stand in for the tokens. No null block
(vLLM's block 0). Content -1 is never keyed, where vLLM hashes every full block; a
request whose tokens are its own (kvsim's workloads give every request and sample
content ids of its own) is keyed like any other, so a request recomputed after a
preemption finds its own blocks, as in vLLM. Not modelled: vLLM's fine-grained hits
inside a block (a hash block size smaller than the block, off by default). A model whose
every layer has a sliding window is kvsim.kvcache.sliding's; hybrid KV cache groups
(sliding-window layers beside full attention) are kvsim.kvcache.hybrid_prefix's. vLLM V0's prefix cache (0.6.3.post1,
vllm/core/block/prefix_caching_block.py) is not modelled: it keeps freed cached blocks
in a separate LRU evictor ordered by the scheduler's access times, hands out uncached
free blocks first and de-duplicates a block when it fills.

kvsim.sim.differential checks these rules against vLLM's own BlockPool and
KVCacheManager, block id by block id.

Invariants: each block is either queued (refcount 0) or used (refcount = the number of
tables holding it, counted with multiplicity); a cached block holds exactly one key and
sits in that key's list of copies; a table's blocks hold exactly its own key chain's
keys up to the first block not cached (full blocks it filled or hit), and no key after;
a block partly filled in one table is the last block of every table holding it; a
table covers its tokens and holds no block beyond the last one it needs; the prefix key
of a cached key (the key of the block before it) is cached too (tables are keyed in order
and free their deepest block first, so a copy of the block before a cached one is in a
table or queued behind it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress
from operator import not_
from typing import cast

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.free_queue import LinkedFreeQueue
from kvsim.kvcache.naming import ROOT, Chain, ContentNames
from kvsim.kvcache.paged import PagedAllocator, _Seq, blocks_for

CHAINS_KEPT = 256  # shapes whose key chains are kept for lookups

KEYS_SLACK = 4  # keys made between two prunings: at least this many per block of the pool

NO_ANSWER = (None, 0, (), None)  # no lookup's answer kept


@dataclass(slots=True)
class _CachedSeq(_Seq):
    keyed: int = 0  # leading blocks that hold their keys: chain[:keyed]
    hashed: int = 0  # full blocks looked at so far
    chain: list[int] = field(default_factory=list)  # its shape's keys, as far as they were made
    offered: int = 0  # chunks offered to KV tiers (kvsim.kvcache.tiered)


class PrefixCachingPagedAllocator(PagedAllocator):
    """Paged blocks shared between sequences through a chained-key block cache."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)  # cached blocks stay whole: no window
        # Reference counts are kept from the first hit or fork on, as in the plain paged
        # allocator: until then a block outside the queue has one holder.
        # The free queue doubles as the LRU of cached blocks: a hit takes its block
        # back out of the middle (PagedAllocator._share), a new block comes off the head.
        self._key_of: list[int | None] = [None] * num_blocks  # cached block -> key
        # key -> its first cached copy still cached (the one a lookup takes), and, for
        # the few keys with more, key -> the later copies in the order they were cached.
        self._first: dict[int, int] = {}
        self._more: dict[int, list[int]] = {}
        # The blocks' keys (kvsim.kvcache.naming). Content gets the same key for as long
        # as anything holds it: once they have grown by more than they held after the
        # last pruning (and by KEYS_SLACK keys per block of the pool at least), entries
        # whose keys nothing holds are forgotten (_forget_keys); a prefix seen again then
        # gets a new key.
        self._names = ContentNames(block_size)
        self._forget_after = KEYS_SLACK * num_blocks  # free() forgets past it
        # id(shape) -> _make_chain's answer: by identity, as a request keeps its shape
        # object, and hashing a shape (a dataclass) runs Python code; the shapes are kept
        # with them, so that no other shape takes one of their ids meanwhile
        self._chains: dict[int, Chain] = {}
        self._chained: deque[SeqShape] = deque()  # oldest first
        # The last lookup's answer, good while its hits' keys keep their first copies
        # (_first_changed) and the key it missed is still not cached: admitting a request
        # looks its prefix up three times (its need, whether it fits, allocate), and a
        # request that waits for memory is looked up every step.
        self._last_hits: tuple = NO_ANSWER  # (shape, blocks, hits, the key missed or None)
        self._read: set[int] = set()  # its hits' keys

    @property
    def cached_blocks(self) -> list[int]:
        """Block ids that hold a cached key, ascending."""
        return [b for b, key in enumerate(self._key_of) if key is not None]

    def copies(self, block: int) -> list[int]:
        """The cached blocks holding `block`'s key, first cached first ([] if uncached)."""
        key = self._key_of[block]
        return [] if key is None else [self._first[key], *self._more.get(key, ())]

    def _make_queue(self) -> LinkedFreeQueue:
        """A hit on a queued block takes it out of the middle of the queue."""
        return LinkedFreeQueue(self.num_blocks)

    # -- keys -----------------------------------------------------------------------

    def _chain(self, shape: SeqShape, blocks: int = 0) -> list[int]:
        """Keys of the shape's full blocks up to the first uncacheable one: the blocks of
        its final length, or its first `blocks` where a sequence grew past that length.
        A shape's keys change only when unheld keys are forgotten (_forget_keys, which
        drops the kept chains), so the chains of the shapes looked up lately are kept: a
        waiting request is looked up every step."""
        chain = self._chains.get(id(shape))
        if chain is not None and (len(chain.keys) >= blocks or chain.ended):
            return chain.keys
        chain = self._make_chain(shape, max(blocks, shape.final_tokens // self.block_size))
        if len(self._chained) >= CHAINS_KEPT:
            self._chains.pop(id(self._chained.popleft()), None)  # (None: kept twice, gone)
        self._chains[id(shape)] = chain
        self._chained.append(shape)
        return chain.keys

    def _make_chain(self, shape: SeqShape, total: int) -> Chain:
        """The keys of the shape's first `total` full blocks, and whether a block holding
        content -1 ended them first (kvsim.kvcache.naming: one walk over its content)."""
        return self._names.walk(shape, total)

    def _hits(self, shape: SeqShape, num_tokens: int) -> list[int]:
        """Cached blocks of the longest cached prefix, at most num_tokens - 1 tokens. The
        last lookup of the same shape answers for any length whose answer it holds: one
        within its hits, or any if a miss ended them (a chunk's lookup then the whole
        prompt's, a recompute's after a shorter one)."""
        blocks = (num_tokens - 1) // self.block_size if num_tokens > 0 else 0
        last_shape, last_blocks, hits, missed = self._last_hits
        if last_shape is shape and (blocks <= len(hits) or len(hits) < last_blocks) and missed not in self._first:
            return list(hits[:blocks])
        chain = self._chain(shape, blocks)[:blocks]
        if chain and chain[0] in self._first:
            hits = list(map(self._first.get, chain))
            if None in hits:
                del hits[hits.index(None) :]
        else:  # most lookups miss at once
            hits = []
        # it holds while the hits keep their first copies and the next key stays uncached
        missed = chain[len(hits)] if len(hits) < len(chain) else None
        self._last_hits, self._read = (shape, blocks, tuple(hits), missed), set(chain[: len(hits)])
        return hits

    def _cache_full_blocks(self, seq: _CachedSeq) -> None:
        """Give keys to the blocks the sequence has filled since the last call."""
        full = seq.tokens // self.block_size
        start = seq.hashed
        if start >= full or seq.keyed != start:  # nothing new, or uncacheable
            seq.hashed = max(start, full)
            return
        # keys up to the first uncacheable block; it and every later one stay uncached
        if len(seq.chain) < full:
            seq.chain = self._chain(seq.shape, full)
        keys = seq.chain[start:full]
        seq.keyed = start + len(keys)
        seq.hashed = full
        if not keys:
            return
        blocks = seq.table[start : start + len(keys)]
        key_of, first = self._key_of, self._first
        if first.keys().isdisjoint(keys):  # the usual case, in bulk: keys no block holds yet
            # (and the blocks hold none: a table's blocks past `keyed` have no key)
            first.update(zip(keys, blocks))
            for block, key in zip(blocks, keys):
                key_of[block] = key
            if self._read:
                self._first_changed(keys)
            return
        for block, key in zip(blocks, keys):
            if key_of[block] is None:  # a hit keeps the key it has: this one
                self._cache_block(block, key)

    def _cache_block(self, block: int, key: int) -> None:
        """Key a block: its key's first copy, or a later one (vLLM does not de-duplicate)."""
        if key in self._first:
            self._more.setdefault(key, []).append(block)
        else:
            self._first[key] = block
            self._first_changed((key,))
        self._key_of[block] = key

    def _take(self, count: int) -> list[int]:
        """Blocks from the queue head; a cached one loses its key (it is evicted)."""
        taken = PagedAllocator._take(self, count)  # (by name, not super(): taken every step)
        key_of = self._key_of
        # (no `:=` in the comprehension: Cython, which the compiled build uses, would give it
        # another variable than the `key` below, cython/cython#6547)
        keys = cast("list[int]", [key_of[b] for b in taken if key_of[b] is not None])
        if not keys:
            return taken
        if self._more and not self._more.keys().isdisjoint(keys):  # some have other copies
            for b in taken:
                key = key_of[b]
                if key is not None:
                    key_of[b] = None
                    self._evict(b, key)
            return taken
        for b in taken:
            key_of[b] = None
        list(map(self._first.pop, keys))  # each key's only copy is the block taken (one pass)
        if self._read:
            self._first_changed(keys)
        return taken

    def _evict(self, block: int, key: int) -> None:
        """The cache forgets `block` as a copy of `key`; the next copy, if any, is the
        one lookups take."""
        later = self._more.get(key)
        if self._first[key] != block:
            assert later is not None  # a copy that lookups do not take is a later one
            later.remove(block)
        elif later:
            self._first[key] = later.pop(0)
            self._first_changed((key,))
        else:
            del self._first[key]
            self._first_changed((key,))
        if later is not None and not later:
            del self._more[key]

    def _first_changed(self, keys: Iterable[int]) -> None:
        """These keys' first copies changed: the last lookup's answer goes if one is a hit's."""
        if not self._read.isdisjoint(keys):
            self._last_hits = NO_ANSWER

    def _grown(self, seq: _CachedSeq) -> None:  # type: ignore[override]  # its sequences are _CachedSeq
        self._cache_full_blocks(seq)

    def _held_keys(self) -> set[int]:
        """The keys a cached block or a live sequence's chain holds."""
        held = set(self._first)
        for seq in self._seqs.values():
            held.update(seq.chain)  # type: ignore[attr-defined]  # its sequences are _CachedSeq
        return held

    def _forget_keys(self) -> None:
        """Drop the key entries that nothing holds, so that they take memory in proportion
        to the pool and the live sequences, not to every prefix ever seen (a million
        requests with unique content would otherwise keep tens of millions of keys).

        An entry is kept while a cached block or a live sequence's chain holds one of its
        keys. Both hold whole prefixes (a chain runs from the table's start, and a cached
        key's prefix key is cached too: the module's invariants), so every entry that a
        kept one hangs below is kept with it (checked here: its parent key is held), and
        equal prefixes keep equal keys wherever they can still meet. For the same reason a
        run's entry (kvsim.kvcache.naming: keys each the parent of the next) holds a held
        key only if its first key is held: only that one is looked up. Forgetting the
        rest is exact: a prefix seen again gets a new key, and no block or chain holds the
        old one to tell the difference. The chains kept for lookups and the last lookup's
        answer go too (a waiting request's chain is made again, from what is kept, when
        it is next looked up)."""
        held = self._held_keys()
        names = self._names
        names.runs = {ident: run for ident, run in names.runs.items() if run[0] in held}
        names.ids = {ident: key for ident, key in names.ids.items() if key in held}
        held.add(ROOT)
        orphans = [ident for ident in [*names.runs, *names.ids] if ident[0] not in held]
        if orphans:
            raise InvariantError(f"key entries {orphans[:3]} are kept, but not the keys they hang below")
        self._chains.clear()
        self._chained.clear()
        self._last_hits = NO_ANSWER
        kept = sum(map(len, names.runs.values())) + len(names.ids)
        self._forget_after = names.next + max(KEYS_SLACK * self.num_blocks, kept)

    def free(self, seq_id: int) -> None:
        """Release the table deepest block first (BlockPool.free_blocks, vLLM 0.33.0): of the
        blocks nobody holds any more, the full ones, which vLLM has hashed whatever their
        content, join the tail as the LRU's newest; the partly filled last block, which
        no prefix can match, goes to the head, to be reused first."""
        seq = self._seqs.pop(seq_id)
        table = seq.table[::-1]
        partial = len(table) - seq.tokens // self.block_size  # leading entries of `table`
        if self._ref is None:  # nothing shared yet: every block loses its only holder
            self._free.put_front(table[:partial])
            self._free.put(table[partial:])
        else:
            left = self._unref(table)
            self._free.put_front([b for b, n in zip(table[:partial], left) if not n])
            self._free.put(compress(table[partial:], map(not_, left[partial:])))
        if self._names.next > self._forget_after:
            self._forget_keys()

    def _new_blocks_needed(self, shape: SeqShape, num_tokens: int) -> tuple[list[int], int]:
        """(cache hits, new blocks needed beyond the free queue left after the hits)."""
        hits = self._hits(shape, num_tokens)
        need = blocks_for(num_tokens, self.block_size) - len(hits)
        if not hits:
            return hits, need - len(self._free)
        if self._ref is None:  # counts from the first hit on: a hit shares its blocks
            self._ref = self._counts()
        revived = list(map(self._ref.__getitem__, hits)).count(0)
        return hits, need - (len(self._free) - revived)

    # -- KVAllocator ----------------------------------------------------------------

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return len(self._hits(shape, num_tokens)) * self.block_size

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        hits, short = self._new_blocks_needed(shape, num_tokens)
        if short + blocks_for(keep_free, self.block_size) > 0:  # the watermark stays free
            return False
        if hits:  # counts are kept from the first hit on
            self._share(hits)
        table = hits + self._take(blocks_for(num_tokens, self.block_size) - len(hits))
        # the hits hold their keys already: the chain's first ones
        chain = self._chain(shape)
        self._seqs[seq_id] = seq = _CachedSeq(shape, num_tokens, table, keyed=len(hits), hashed=len(hits), chain=chain)
        self._cache_full_blocks(seq)
        return True

    def room(self, seq_id: int) -> int:
        """The paged room, short of the token that fills the last block: filling a block
        caches it, which is more than a count."""
        room = super().room(seq_id)
        seq = self._seqs[seq_id]
        return room - 1 if room and seq.tokens + room == seq.logical_blocks() * self.block_size else room

    def block_room(self, seq_id: int, tails_private: bool = False) -> int:
        """Where tails are private (no request's tail content is another's: the
        workload's RequestTable.private_tails), the paged block room: the fast path
        (kvsim.sim.lazy) may then fill blocks and take new ones in bulk, keying the filled
        blocks when it catches the sequence up (`extend`, `grow`). That is exact because
        nothing reads those keys in between: a filled block holds output, whose key only
        this sequence's chain has (and it looks nothing up while it runs), and a block in
        a table is in no queue, so it cannot be evicted. The blocks come off the queue
        head in the same order, with the same evictions; which new block goes to which
        sequence is a relabelling of ids, on which nothing depends. Elsewhere, only the
        room: the block that fills is keyed at once, as a later turn may look it up."""
        return super().block_room(seq_id) if tails_private else self.room(seq_id)

    def _blocks_short(self, shape: SeqShape, num_tokens: int) -> int:
        return self._new_blocks_needed(shape, num_tokens)[1]

    def _check_table(self, seq_id: int, seq: _CachedSeq) -> None:  # type: ignore[override]
        keys = list(map(self._key_of.__getitem__, seq.table))
        n = seq.keyed
        if keys[:n] != seq.chain[:n] or keys[n:].count(None) != len(keys[n:]):
            raise InvariantError(f"seq {seq_id}'s blocks hold keys {keys}, but its own chain is {seq.chain[:n]}")

    def _check_cache(self) -> None:
        copies = 0
        for key, first in self._first.items():
            blocks = [first, *self._more.get(key, ())]
            for block in blocks:
                if self._key_of[block] != key:
                    raise InvariantError(f"key {key} maps to block {block}, whose key is {self._key_of[block]}")
            copies += len(blocks)
        if not self._more.keys() <= self._first.keys() or not all(self._more.values()):
            raise InvariantError("a key has later copies but no first one")
        if self.num_blocks - self._key_of.count(None) != copies:
            raise InvariantError("a block holds a key the cache does not map to it")
