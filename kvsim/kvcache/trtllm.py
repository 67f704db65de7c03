"""TensorRT-LLM's KV cache block manager: block reuse across requests, and a host pool
that keeps evicted blocks for later reuse.

Follows TensorRT-LLM 1.2.0rc2's C++ batch manager (NVIDIA/TensorRT-LLM,
cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp at commit b35ac1b64368, whose
tensorrt_llm/version.py reads 1.2.0rc2: `WindowBlockManager` `addSequence`,
`loadOrAllocateBlocks`, `getFreeBlock`, `onboardBlock`, `storeBlocks`,
`storeBlocksForReuse`, `releaseBlocks`). The tag v1.2.0rc2 is commit 31116825b39f (the
commit triton-inference-server/tensorrtllm_backend's "v1.2.0rc2 release" pins as its
tensorrt_llm submodule); that b35ac1b64368's kvCacheManager.cpp is the tag's is not
proven: the repository is too big to fetch here and no copy of the file at the tag
could be read, so b35ac1b64368 is a commit of 1.2.0rc2's development, the tag's
contents unchecked. Also read: evictionPolicy.cpp (commit 05a919198033) and
kvCacheTransferManager.cpp (commit 03d4aac90be1), which no release tag can be tied to
(docs/engines.md says why). One attention window, beam width 1, no LoRA. TensorRT-LLM's own unit tests of this
manager are replayed on it in tests/test_trtllm_upstream.py. The pools: `num_blocks` primary
blocks of `block_size` tokens in GPU memory (KvCacheConfig.tokens_per_block, 32 by
default) and `secondary_blocks` in host memory (KvCacheConfig.host_cache_size bytes).
Block ids are TensorRT-LLM's: 0..P-1 start in the GPU, P..P+S-1 in the host, and a block
keeps its id and its content when it moves between them (the two swap their memory).

- Reuse (KvCacheConfig.enable_block_reuse, on by default). A new sequence of L tokens
  looks up the tokens it could skip, at most L - 1 (`addSequence` chops L - 1 tokens
  into blocks, the last one partial): down the tree of stored blocks
  (kvsim.kvcache.trtllm_tree) one block at a time; a full match goes on, a partial one
  (KvCacheConfig.enable_partial_reuse, on) ends the walk. A fully matched block is
  shared. A partially matched one that another sequence holds or that has children is
  copied into a new block (copy_on_partial_reuse, on); a free leaf is taken over and
  leaves the tree. Blocks matched in host memory are onboarded: a GPU block is taken
  for each and the content copied back. The matches are taken one by one, each looked up
  after the one before was claimed and onboarded, so an onboarding can evict a block the
  same prompt would have matched next; what the allocation reused is what the request
  skips (`reused_tokens`: addSequence's prepopulated prompt length), which the scheduler
  reads after taking the blocks (`load_prefix`), as TensorRT-LLM's does. The rest of the
  prompt takes new blocks.
- What is stored, when. A prompt's full blocks are stored once its context has run
  (`storeContextBlocks`: the engine calls `store_context_blocks`); all of a sequence's
  blocks, the partly filled last one too, when it is freed (`storeBlocksForReuse`: up to
  its tokens but the last, which kvsim's slot count already leaves out). Storing walks
  the tree: a block whose key is there already is not stored again (the sequence's copy
  stays outside the tree).
- Freeing: a sequence's blocks drop a reference, deepest first; those nobody holds join
  the back of their queue (kvsim.kvcache.trtllm_eviction): least recently used first.
- Eviction and offload (`getFreeBlock`): a new GPU block is the front of the free
  queue. If it holds content, its priority allows it (secondary_offload_min_priority,
  30; blocks take the retention priority, 35 by default: executor.h's
  kDefaultRetentionPriority) and the host pool has a free
  block, its content moves to the host pool (the host's least recently used block is
  dropped for it) and the freed host block's memory is returned instead; otherwise its
  content is dropped. Either way whatever was stored below the dropped block leaves the
  tree with it.
- Transfers: offloads and onboards go over the GPU's host link (`link_bytes_s`) on two
  streams of their own, which the next step's compute waits for
  (KVCacheTransferManager::syncTransfers): a step waits max(offloaded, onboarded bytes)
  over the link (`take_transfer_s`).

Where kvsim differs: whatever is stored below an evicted block leaves the tree but its
free blocks stay queued (TensorRT-LLM's freeChildren claims them out of the queue); a
partial copy takes the retention priority, not its source's; content -1 (kvsim's
"never shared") is never stored. With chunked context TensorRT-LLM allocates a prompt's blocks at its first
chunk; kvsim allocates them chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsim.kvcache.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth
from kvsim.kvcache.paged import blocks_for, tables_breakdown
from kvsim.kvcache.trtllm_eviction import (
    DEFAULT_OFFLOAD_MIN_PRIORITY,
    DEFAULT_PRIORITY,
    PRIMARY,
    SECONDARY,
    PriorityLRU,
)
from kvsim.kvcache.trtllm_tree import ROOT, BlockTree, Match, Runs, block_keys, never_shared


@dataclass
class _Seq:
    shape: SeqShape
    tokens: int
    table: list[int]
    reused: int = 0  # tokens its allocation reused


class TrtllmBlockManager:
    """TensorRT-LLM's paged KV cache with block reuse and a host pool."""

    counted = False  # its runs go step by step (kvsim.sim.lazy)
    takes_blocks_in_bulk = False
    store: Any = None  # no KV tiers; a host pool is reported as one (kvsim.kvcache.trtllm_host)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        secondary_blocks: int = 0,
        block_bytes: float = 0.0,
        link_bytes_s: float = float("inf"),
        reuse: bool = True,
        partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
        retention_priority: int = DEFAULT_PRIORITY,
    ):
        if num_blocks < 0 or secondary_blocks < 0 or block_size < 1:
            raise ValueError(
                f"need block counts >= 0 and block_size >= 1, got {num_blocks}, {secondary_blocks} and {block_size}"
            )
        self.num_blocks, self.secondary_blocks, self.block_size = num_blocks, secondary_blocks, block_size
        self.capacity = num_blocks * block_size
        self.block_bytes, self.link_bytes_s = block_bytes, link_bytes_s
        self.reuse, self.partial_reuse, self.copy_on_partial_reuse = reuse, partial_reuse, copy_on_partial_reuse
        self.offload_min_priority = offload_min_priority
        self.retention_priority = retention_priority  # given to the blocks a sequence takes from now on
        total = num_blocks + secondary_blocks
        self.level = [PRIMARY] * num_blocks + [SECONDARY] * secondary_blocks
        self.ref = [0] * total
        self.priority = [DEFAULT_PRIORITY] * total
        self.content: list[Runs | None] = [None] * total  # a block's tokens (its BlockKey), if any
        self.free_queues = PriorityLRU(num_blocks, secondary_blocks)
        self.tree = BlockTree()
        self._seqs: dict[int, _Seq] = {}
        self._loaded: dict[int, tuple[list[int], int]] = {}  # load_prefix's blocks, until allocate
        # bytes moved since the last take_transfer_s, and in all
        self._pending_off = self._pending_on = 0.0
        self.offloaded_bytes = self.onboarded_bytes = 0.0
        self.host_hit_tokens = 0  # tokens reused from blocks onboarded from the host
        self.host_held = 0  # host blocks holding content (reachable or not)
        self.transfer_s = 0.0

    # -- views for tests and reports ------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].table)

    def free_blocks(self, level: int = PRIMARY) -> list[int]:
        """A level's free blocks in the order getFreeBlock takes them."""
        return self.free_queues.order(level)

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    # -- the lookup ------------------------------------------------------------------
    def lookup(self, shape: SeqShape, num_tokens: int) -> list[Match]:
        """What a sequence of `num_tokens` tokens would reuse now (nothing changes): its
        first num_tokens - 1 tokens, the last block partial (addSequence)."""
        if not self.reuse or num_tokens <= 1:
            return []
        keys = block_keys(shape, num_tokens - 1, self.block_size, partial=True)
        return self.tree.walk(keys, self.block_size, self.partial_reuse, self._partial_source)

    def _partial_source(self, block: int) -> bool:
        return self.copy_on_partial_reuse or (self.ref[block] == 0 and self.tree.is_leaf(block))

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        """Tokens of the first `num_tokens` a new sequence would reuse: at most num_tokens - 1."""
        return sum(m.tokens for m in self.lookup(shape, num_tokens))

    def new_context_block(self, shape: SeqShape, num_tokens: int) -> tuple | None:
        """The first full block of the first `num_tokens` tokens not stored, named by where
        it would hang (`findNewContextBlock`); None if every full block is stored or the
        block is content kvsim never shares."""
        return self.tree.first_missing(block_keys(shape, num_tokens, self.block_size, partial=False))

    # -- blocks ------------------------------------------------------------------------
    def _claim(self, block: int) -> None:
        self.free_queues.remove(block)

    def _release(self, block: int) -> None:
        self.free_queues.push(block, self.level[block], self.priority[block])

    def _drop(self, block: int) -> None:
        """The block's content goes, and what was stored below it leaves the tree."""
        self.tree.detach(block)
        self.content[block] = None

    def _free_block(self, priority: int) -> int:
        """A GPU block for new content (`getFreeBlock`): the free queue's front, its content
        offloaded to the host pool where it may be, else dropped."""
        block, queued_at = self.free_queues.front(PRIMARY)
        self._claim(block)
        if (
            self.content[block] is not None
            and queued_at >= self.offload_min_priority
            and self.free_queues.free_count(SECONDARY) > 0
        ):
            host, _ = self.free_queues.front(SECONDARY)
            self._claim(host)
            self.host_held += self.content[host] is None  # the host's least recently used content goes
            self._drop(host)
            self.level[block], self.level[host] = SECONDARY, PRIMARY
            self._release(block)  # its content waits in the host pool, still stored
            self._moved(off=self.block_bytes)
            block = host
        else:
            self._drop(block)
        self.priority[block] = priority
        return block

    def _onboard(self, block: int) -> None:
        """Bring a claimed host block's content back into a GPU block's memory."""
        gpu = self._free_block(DEFAULT_PRIORITY)
        self.level[block], self.level[gpu] = PRIMARY, SECONDARY
        self._release(gpu)  # its memory, empty, joins the host's free queue
        self.host_held -= 1
        self._moved(on=self.block_bytes)

    def _moved(self, off: float = 0.0, on: float = 0.0) -> None:
        self._pending_off += off
        self._pending_on += on
        self.offloaded_bytes += off
        self.onboarded_bytes += on

    def take_load_s(self) -> float:
        """0.0: the step's transfers are taken once it is planned (take_transfer_s), since
        a step waits for the larger of its offloads and onboards, not their sum."""
        return 0.0

    def take_transfer_s(self) -> float:
        """Seconds the next step waits for the offloads and onboards since the last call."""
        moved = max(self._pending_off, self._pending_on)
        seconds = moved / self.link_bytes_s if moved else 0.0
        self._pending_off = self._pending_on = 0.0
        self.transfer_s += seconds
        return seconds

    # -- KVAllocator ----------------------------------------------------------------
    def unfit_reason(self, shape: SeqShape) -> str | None:
        if blocks_for(shape.final_tokens, self.block_size) > self.num_blocks:
            return "final length exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        return blocks_for(shape.final_tokens, self.block_size) * self.block_size

    def _new_blocks_needed(self, shape: SeqShape, num_tokens: int) -> tuple[list[Match], int]:
        """(what the lookup finds, free GPU blocks a new sequence takes at most): every block
        but the full matches other sequences hold, which it shares, counted only up to the
        first match in the host pool (onboarding it may evict what the lookup found after it)."""
        matches = self.lookup(shape, num_tokens)
        shared = 0
        for m in matches:
            if self.level[m.block] == SECONDARY:
                break
            shared += not m.partial and self.ref[m.block] > 0
        return matches, blocks_for(num_tokens, self.block_size) - shared

    def reused_tokens(self, seq_id: int) -> int:
        """Tokens the sequence's allocation reused (its prepopulated prompt length:
        `getContextCurrentPosition` after `addSequence`), what its first step skips."""
        return self._seqs[seq_id].reused

    def load_prefix(self, seq_id: int, shape: SeqShape, num_tokens: int) -> int | None:
        """Take the blocks a new sequence of `num_tokens` tokens reuses, as
        `loadOrAllocateBlocks` does before it takes new ones, and return the tokens they
        hold; `allocate(seq_id, ...)` then adds the rest. None, changing nothing, where
        the blocks it may take are not free."""
        if seq_id in self._seqs or seq_id in self._loaded:
            raise ValueError(f"sequence {seq_id} is already allocated")
        _, need = self._new_blocks_needed(shape, num_tokens)
        if need > self.free_queues.free_count(PRIMARY):
            return None
        self._loaded[seq_id] = table, reused = self._load(shape, num_tokens)
        return reused

    def _load(self, shape: SeqShape, num_tokens: int) -> tuple[list[int], int]:
        """Claim the matched blocks one by one, down the tree (`loadOrAllocateBlocks`): each
        is looked up after the one before it was claimed and onboarded, so onboarding a host
        block (which takes a GPU block, whose content may push the host's oldest out) can
        evict a block this prompt would have matched next. Returns (blocks, tokens reused)."""
        if not self.reuse or num_tokens <= 1:
            return [], 0
        node, table, reused = ROOT, [], 0
        for runs in block_keys(shape, num_tokens - 1, self.block_size, partial=True):
            m = self.tree.match(node, runs, self.block_size, self.partial_reuse, self._partial_source)
            if m is None:
                break
            table.append(self._take(m))
            reused += m.tokens
            if m.partial:
                break
            node = m.block
        return table, reused

    def _take(self, m: Match) -> int:
        """The GPU block a sequence holds for one match (`loadOrAllocateBlocks`): the
        matched block itself, claimed and, from the host, onboarded; or, for a partial
        match of a block another sequence holds or that has children, a copy of its
        matched tokens into a block getFreeBlock gives. The copy's source is not claimed
        first, so that block may be the matched one: its content then goes to the host
        pool and is copied back from there, or, without room there, stays where it is
        and the copy is onto its own memory."""
        block = m.block
        if m.partial and (self.ref[block] > 0 or not self.tree.is_leaf(block)):
            block = self._free_block(self.retention_priority)
            if block != m.block and self.level[m.block] == SECONDARY:
                self._moved(on=self.block_bytes * m.tokens / self.block_size)
                self.host_hit_tokens += m.tokens
        else:
            if self.ref[block] == 0:
                self._claim(block)
            if m.partial:  # a free leaf: it becomes this sequence's own
                self.tree.detach(block)
            if self.level[block] == SECONDARY:
                self._onboard(block)
                self.host_hit_tokens += m.tokens
        self.ref[block] += 1
        return block

    def _unload(self, table: list[int]) -> None:
        for block in reversed(table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._release(block)

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        """`addSequence`: the blocks it reuses (those `load_prefix` took, else taken now),
        then new blocks for the rest of its `num_tokens` tokens."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        keep = blocks_for(keep_free, self.block_size)
        loaded = self._loaded.pop(seq_id, None)
        if loaded is None:
            _, need = self._new_blocks_needed(shape, num_tokens)
            if need + keep > self.free_queues.free_count(PRIMARY):
                return False
            loaded = self._load(shape, num_tokens)
        table, reused = loaded
        total = blocks_for(num_tokens, self.block_size)
        if total - len(table) + keep > self.free_queues.free_count(PRIMARY):
            self._unload(table)  # the blocks go back to the free queues, onboarded ones on the GPU
            return False
        keys = block_keys(shape, num_tokens - 1, self.block_size, partial=True)
        table = list(table)
        for i in range(len(table), total):
            block = self._free_block(self.retention_priority)
            self.content[block] = keys[i] if i < len(keys) else None
            self.ref[block] = 1
            table.append(block)
        self._seqs[seq_id] = _Seq(shape, num_tokens, table, reused)
        return True

    def fork(self, parent_id: int, child_id: int) -> bool:
        """The child shares every block of the parent (a partly filled last block is
        copied by the first of them to write into it)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated")
        parent = self._seqs[parent_id]
        for b in parent.table:
            self.ref[b] += 1
        self._seqs[child_id] = _Seq(parent.shape, parent.tokens, list(parent.table), parent.reused)
        return True

    def _copies_last(self, seq: _Seq, num_tokens: int) -> bool:
        """Whether the tokens go into a copy of the partly filled last block: it is shared,
        or stored for reuse (a parallel sample that finished first stored it), whose stored
        content must stay what its key says."""
        if num_tokens <= seq.tokens or seq.tokens % self.block_size == 0:
            return False
        last = seq.table[-1]
        return self.ref[last] > 1 or last in self.tree

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        seq = self._seqs[seq_id]
        extra = blocks_for(num_tokens, self.block_size) - len(seq.table) + self._copies_last(seq, num_tokens)
        return extra * self.block_size

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """New blocks as tokens cross block boundaries (`addToken`, `allocateBlock`)."""
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        cow = self._copies_last(seq, num_tokens)
        extra = blocks_for(num_tokens, self.block_size) - len(seq.table)
        if extra + cow > self.free_queues.free_count(PRIMARY):
            return False
        if cow:
            old = seq.table[-1]
            seq.table[-1] = self._free_block(self.retention_priority)
            self.ref[seq.table[-1]] = 1
            self.ref[old] -= 1
            if self.ref[old] == 0:
                self._release(old)
        for _ in range(extra):
            block = self._free_block(self.retention_priority)
            self.ref[block] = 1
            seq.table.append(block)
        seq.tokens = num_tokens
        return True

    def cache_prefilled(self, seq_id: int, num_tokens: int) -> None:
        """Nothing: prompts are stored when their context has run (store_context_blocks)."""

    def store_context_blocks(self, seq_id: int) -> None:
        """Store the full blocks of a sequence whose context has run (`storeContextBlocks`)."""
        if self.reuse:
            seq = self._seqs[seq_id]
            self._store(seq, block_keys(seq.shape, seq.tokens, self.block_size, partial=False))

    def _store(self, seq: _Seq, keys: list[Runs]) -> None:
        """`storeBlocks`: down the tree along the keys; from the first key not there, the
        sequence's own blocks are stored (content -1 is given its block, never stored)."""
        node, matching, storing = ROOT, True, True
        for runs, block in zip(keys, seq.table):
            if storing and never_shared(runs):
                storing = False
            if matching and storing:
                found = self.tree.child(node, runs)
                if found is not None:
                    node = found
                    continue
                matching = False
            self.content[block] = runs
            if storing and block not in self.tree:
                self.tree.insert(node, runs, block)
                node = block

    def free(self, seq_id: int) -> None:
        """Store the sequence's blocks for reuse, then release them deepest first."""
        seq = self._seqs.pop(seq_id)
        if self.reuse:
            self._store(seq, block_keys(seq.shape, seq.tokens, self.block_size, partial=True))
        for block in reversed(seq.table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._release(block)

    # -- what SGLang's rules ask of an allocator (KVAllocator): nothing TensorRT-LLM needs --

    @property
    def page_size(self) -> int:
        return self.block_size

    def drop(self, seq_id: int) -> None:
        self.free(seq_id)  # released as a finished request is (the reusable blocks stay stored)

    def lockable(self, shape: SeqShape, num_tokens: int) -> int:
        return 0  # a reused block is taken back from the free queues: nothing to lock

    def evict_to_free(self, slots: int) -> None:
        pass  # an allocation evicts the free queues' least recently used block as it takes it

    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        free_slots = self.free_queues.free_count(PRIMARY) * self.block_size
        if next_seq is None:
            return 0, free_slots, False
        shape, tokens, keep_free = next_seq
        _, need = self._new_blocks_needed(shape, tokens)
        if need + blocks_for(keep_free, self.block_size) > self.free_queues.free_count(PRIMARY):
            return free_slots, 0, True
        return 0, free_slots, False

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """As the paged allocator's (tables_breakdown): blocks held by several sequences
        count once; the free queues' GPU blocks are free."""
        tables = ((seq.table, seq.tokens, seq.shape.final_tokens) for seq in self._seqs.values())
        used = self.num_blocks - self.free_queues.free_count(PRIMARY)
        return tables_breakdown(tables, self.block_size, used, self.pool_free(next_seq))

    def check_invariants(self) -> None:
        """Every block is queued (nobody holds it) or held by as many tables as its count
        says, held blocks are GPU blocks, the pools keep their sizes, tables cover their
        tokens, stored blocks carry the content they are stored under."""
        holders = [0] * len(self.ref)
        for seq_id, seq in self._seqs.items():
            if len(seq.table) != blocks_for(seq.tokens, self.block_size) or len(set(seq.table)) != len(seq.table):
                raise InvariantError(f"seq {seq_id} holds {seq.tokens} tokens in blocks {seq.table}")
            for b in seq.table:
                holders[b] += 1
        for table, _ in self._loaded.values():
            for b in table:
                holders[b] += 1
        for b, (n, ref) in enumerate(zip(holders, self.ref)):
            if n != ref or (ref == 0) != (b in self.free_queues):
                raise InvariantError(
                    f"block {b} has {ref} references, {n} tables and is {'' if b in self.free_queues else 'not '}queued"
                )
            if ref and self.level[b] != PRIMARY:
                raise InvariantError(f"host block {b} is held by a sequence")
        if self.level.count(SECONDARY) != self.secondary_blocks:
            raise InvariantError("the host pool changed size")
        held = sum(1 for lvl, runs in zip(self.level, self.content) if lvl == SECONDARY and runs is not None)
        if held != self.host_held:
            raise InvariantError(f"{held} host blocks hold content; {self.host_held} counted")
        self.free_queues.check(self.level)
        self.tree.check()
        for b, runs in self.tree.key.items():
            if self.content[b] != runs:
                raise InvariantError(f"stored block {b} holds {self.content[b]}, stored as {runs}")
        split = self.breakdown(None)
        if min(split.token, split.reservation, split.internal, split.free, split.shared) < 0 or (
            split.capacity != self.capacity
        ):
            raise InvariantError(f"breakdown {split} does not split the pool of {self.capacity}")
