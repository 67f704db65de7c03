"""Token-granularity prefix cache on a radix tree, as in SGLang's RadixAttention.

FACTS.md ("Prefix caching"): a radix tree of token sequences, reference counts on the
nodes in use, LRU eviction of leaves. The pool is `capacity` token slots (page size 1).

Each tree node holds the KV slots of the tokens on its incoming edge, a tuple of
(content id, offset, length) runs; children are keyed by their edge's first token
(content, offset), so a path from the root spells a prefix. A sequence is admitted with
the longest cached prefix of its tokens (at most num_tokens - 1), splitting the last
edge if the match ends inside it; every node from there up to the root gets one
reference. Its other tokens live in its private part, counted against capacity. When
it is freed its tokens are inserted (what the tree has already is dropped, the rest
becomes a new leaf) and its references are released, so the next turn of a
conversation, or another request with the same system prompt, can match them. Content
-1 is never inserted or matched. When too few slots are free, unreferenced leaves are
evicted, least recently used first (a parent left a childless unreferenced node becomes
a leaf in turn). Recency is a per-allocator access counter bumped along a sequence's
path when it is freed; ties go to the older node id.

What differs from SGLang: SGLang also inserts at chunked-prefill boundaries and while
decoding, so running requests share what they just computed; here only `free` inserts.
SGLang's match_prefix splits nodes and bumps access times; here it is a pure query,
`allocate` splits, and only `free` bumps (a running path is referenced, so bumping it
at admission too would change no eviction order). SGLang's eviction priority is
pluggable (LRU, LFU); here it is LRU.

Invariants: tree + private + free slots == capacity; a node's count equals the number
of running sequences whose path passes through it; no count is negative; only
unreferenced leaves are evicted; no edge holds content -1.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvsim.allocators.base import Breakdown, InvariantError, NextSeq, SeqShape, check_growth
from kvsim.allocators.runs import Runs, cacheable_runs, common_length, runs_length, split_runs


class _Node:
    __slots__ = ("id", "runs", "parent", "children", "ref", "last_access")

    def __init__(self, node_id: int, runs: Runs, parent: _Node | None):
        self.id, self.runs, self.parent = node_id, runs, parent
        self.children: dict[tuple[int, int], _Node] = {}   # by their edge's first token
        self.ref = self.last_access = 0

    @property
    def length(self) -> int:
        return runs_length(self.runs)

    @property
    def edge_key(self) -> tuple[int, int]:
        return self.runs[0][:2]


@dataclass
class _Seq:
    shape: SeqShape
    tokens: int
    node: _Node        # where its matched prefix ends (the root if nothing matched)
    matched: int


class RadixCacheAllocator:
    """Token slots shared through a radix tree of cached prefixes, LRU leaf eviction."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"need capacity >= 0, got {capacity}")
        self.capacity = capacity
        self._root = _Node(0, (), None)    # holds no slots, never evicted
        self._next_id = 1                  # node ids: the LRU tie-break
        self._clock = 0                    # access counter: the LRU order, no wall clock
        self._tree = 0                     # slots held by tree nodes
        self._evictable = 0                # slots held by unreferenced nodes
        self._private = 0                  # slots held by sequences beyond their match
        self._free = capacity
        self._seqs: dict[int, _Seq] = {}

    # -- views for tests and reports ------------------------------------------------

    def nodes(self) -> list[tuple[int, Runs, int]]:
        """Every node as (tokens before it, edge runs, refcount), depth first."""
        return [(depth, node.runs, node.ref) for node, depth in self._all_nodes()]

    @property
    def free_slots(self) -> int:
        """Slots held by nothing (evictable tree slots not included)."""
        return self._free

    def tokens_of(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.tokens

    # -- the tree -------------------------------------------------------------------

    def _walk(self, runs: Runs) -> tuple[list[_Node], int, int, int]:
        """The longest cached prefix of `runs`: (its nodes, tokens matched in the last
        (its whole edge unless the match ends inside it), tokens matched, and the slots
        referencing them would take out of the evictable ones)."""
        node, path, into = self._root, [], 0
        while runs and (child := node.children.get(runs[0][:2])) is not None:
            into = common_length(child.runs, runs)
            path.append(child)
            if into < child.length:
                break
            runs, node = split_runs(runs, into)[1], child
        matched = sum(n.length for n in path[:-1]) + into
        locked = sum(n.length for n in path[:-1] if n.ref == 0)
        if path and path[-1].ref == 0:
            locked += into
        return path, into, matched, locked

    def _match(self, shape: SeqShape, num_tokens: int) -> tuple[list[_Node], int, int, int]:
        return self._walk(cacheable_runs(shape, max(num_tokens - 1, 0)))

    def _end(self, path: list[_Node], into: int) -> _Node:
        """The node a walk ends on, splitting its last edge if the walk ends inside it:
        the new upper node takes the first `into` tokens and the node's references; the
        lower part keeps its object (sequences point at it) and its children."""
        if not path:
            return self._root
        node = path[-1]
        if into == node.length:
            return node
        head, tail = split_runs(node.runs, into)
        upper = self._new_node(head, node.parent)
        upper.ref, upper.last_access = node.ref, node.last_access
        node.runs, node.parent = tail, upper
        upper.children[node.edge_key] = node
        return upper

    def _new_node(self, runs: Runs, parent: _Node) -> _Node:
        node = _Node(self._next_id, runs, parent)
        self._next_id += 1
        parent.children[node.edge_key] = node
        return node

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not self._root:
            node.last_access = self._clock
            node = node.parent

    def _add_ref(self, node: _Node, delta: int) -> None:
        """Add `delta` references to `node` and every node above it."""
        while node is not self._root:
            if node.ref == 0:
                self._evictable -= node.length
            node.ref += delta
            if node.ref == 0:
                self._evictable += node.length
            node = node.parent

    def _evict(self, need: int) -> None:
        """Evict unreferenced leaves, least recently used first, until `need` slots are
        free. A heap of the leaves, as SGLang's evict does; a parent left childless and
        unreferenced joins it."""
        heap = [(n.last_access, n.id, n) for n, _ in self._all_nodes()
                if not n.children and n.ref == 0]
        heapq.heapify(heap)
        while self._free < need:
            _, _, leaf = heapq.heappop(heap)
            if leaf.ref != 0 or leaf.children:
                raise InvariantError(f"evicting node {leaf.id}, which is in use")
            parent = leaf.parent
            del parent.children[leaf.edge_key]
            self._tree -= leaf.length
            self._evictable -= leaf.length
            self._free += leaf.length
            if parent is not self._root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _all_nodes(self) -> list[tuple[_Node, int]]:
        """Every node but the root and the tokens before it, depth first, children
        in order of their first token."""
        out, stack = [], [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self._root:
                out.append((node, depth))
            for key in sorted(node.children, reverse=True):
                stack.append((node.children[key], depth + node.length))
        return out

    def _reserve(self, need: int) -> None:
        """Move `need` slots to private parts, evicting first if too few are free.
        The caller has checked that free + evictable slots suffice."""
        if need > self._free:
            self._evict(need)
        self._free -= need
        self._private += need

    # -- KVAllocator ----------------------------------------------------------------

    def unfit_reason(self, shape: SeqShape) -> str | None:
        if shape.final_tokens > self.capacity:
            return "final length exceeds KV pool"
        return None

    def footprint(self, shape: SeqShape) -> int:
        return shape.final_tokens

    def match_prefix(self, shape: SeqShape, num_tokens: int) -> int:
        return self._match(shape, num_tokens)[2]

    def allocate(self, seq_id: int, shape: SeqShape, num_tokens: int, keep_free: int = 0) -> bool:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        path, into, matched, locked = self._match(shape, num_tokens)
        need = num_tokens - matched
        # The match itself cannot be evicted to make room; the watermark stays free.
        if need + keep_free > self._free + self._evictable - locked:
            return False
        end = self._end(path, into)
        self._add_ref(end, +1)
        self._reserve(need)
        self._seqs[seq_id] = _Seq(shape, num_tokens, end, matched)
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        seq = self._seqs[seq_id]
        check_growth(seq_id, seq.tokens, num_tokens)
        need = num_tokens - seq.tokens
        if need > self._free + self._evictable:
            return False
        self._reserve(need)
        seq.tokens = num_tokens
        return True

    def slots_to_grow(self, seq_id: int, num_tokens: int) -> int:
        return num_tokens - self._seqs[seq_id].tokens

    def fork(self, parent_id: int, child_id: int) -> bool:
        """The parent's cacheable tokens go into the tree (as SGLang caches a prompt
        once it is computed) and both sequences reference them; only the tokens that
        cannot be cached (content -1) are copied into the child's private part, which
        fails, changing nothing, if even eviction cannot make room for them."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated")
        parent = self._seqs[parent_id]
        runs = cacheable_runs(parent.shape, parent.tokens)
        _, _, known, locked = self._walk(runs)
        copy = parent.tokens - runs_length(runs)
        # Inserting frees the parent's private copies of tokens the tree already has.
        if copy > self._free + (known - parent.matched) + self._evictable - locked:
            return False
        node = self._insert(parent, runs)
        self._add_ref(node, +2)
        self._add_ref(parent.node, -1)
        parent.node, parent.matched = node, runs_length(runs)
        self._reserve(copy)
        self._seqs[child_id] = _Seq(parent.shape, parent.tokens, node, parent.matched)
        return True

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        runs = cacheable_runs(seq.shape, seq.tokens)
        node = self._insert(seq, runs)
        uncached = seq.tokens - runs_length(runs)
        self._private -= uncached
        self._free += uncached
        self._touch(node)
        self._add_ref(seq.node, -1)

    def _insert(self, seq: _Seq, runs: Runs) -> _Node:
        """Put the sequence's cacheable tokens `runs` in the tree: the ones it lacks
        move from the private part to a new leaf, the private copies of the others
        are freed. Returns the node the tokens end on; the sequence's own fields and
        references are the caller's to update."""
        path, into, known, _ = self._walk(runs)   # at least its own match: referenced
        node = self._end(path, into)
        new = runs_length(runs) - known
        if new > 0:
            node = self._new_node(split_runs(runs, known)[1], node)
            self._tree += new
            self._evictable += new
        self._private -= runs_length(runs) - seq.matched
        self._free += known - seq.matched
        return node

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """Token granular: a running sequence holds exactly its tokens, so there is no
        reservation or internal fragmentation. token = referenced tree slots + private
        slots; unreferenced tree slots are evictable and count as free (or unusable, with
        the free slots, when the next sequence could not be admitted after its match)."""
        logical = sum(seq.tokens for seq in self._seqs.values())
        token = self._tree - self._evictable + self._private
        available = self._free + self._evictable
        starved = False
        if next_seq is not None:
            shape, tokens, keep_free = next_seq
            _, _, matched, locked = self._match(shape, tokens)
            starved = tokens - matched + keep_free > available - locked
        return Breakdown(token, 0, 0, padding=0, unusable=available if starved else 0,
                         free=0 if starved else available, shared=logical - token, starved=starved)

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            node, depth = seq.node, 0
            while node is not self._root:
                refs[node.id] = refs.get(node.id, 0) + 1
                depth, node = depth + node.length, node.parent
            if depth != seq.matched or seq.tokens < seq.matched:
                raise InvariantError(f"seq {seq_id} matched {seq.matched} tokens and holds "
                                     f"{seq.tokens}, but its path spells {depth}")
        tree = evictable = 0
        for node, _ in self._all_nodes():
            if node.ref != refs.get(node.id, 0) or node.ref < 0:
                raise InvariantError(f"node {node.id} has refcount {node.ref}; "
                                     f"{refs.get(node.id, 0)} running paths pass through it")
            if node.length <= 0 or any(c == -1 for c, _, _ in node.runs):
                raise InvariantError(f"node {node.id} has edge {node.runs}")
            if node.parent.children.get(node.edge_key) is not node:
                raise InvariantError(f"node {node.id} is not its parent's child")
            tree += node.length
            evictable += node.length if node.ref == 0 else 0
        private = sum(seq.tokens - seq.matched for seq in self._seqs.values())
        if (tree, evictable, private) != (self._tree, self._evictable, self._private):
            raise InvariantError(f"counted tree/evictable/private {tree}/{evictable}/{private}, "
                                 f"kept {self._tree}/{self._evictable}/{self._private}")
        if self._free < 0 or tree + private + self._free != self.capacity:
            raise InvariantError(f"tree {tree} + private {private} + free {self._free} "
                                 f"!= capacity {self.capacity}")
