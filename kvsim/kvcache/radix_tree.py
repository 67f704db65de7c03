"""The radix tree of SGLang's RadixAttention, as in SGLang 0.5.23
(sglang/srt/mem_cache/radix_cache.py, class RadixCache): the structure the radix
prefix cache (radix.py) keeps its cached tokens in. It counts slots; the pool is the
allocator's.

A node holds the KV of the tokens on its incoming edge, a tuple of (content id, offset,
length) runs, so a path from the root spells a prefix. With page size P > 1 every edge
is whole pages and children are keyed by their edge's first page, so a lookup or an
insert matches whole pages only (`_key_match_paged`, `get_child_key_fn`); P = 1 keys
children by their first token. What is looked up or inserted is cut to whole pages
first (match_prefix's and cache_*_req's `page_aligned_len`).

Rules, each from radix_cache.py:
- `lookup` (match_prefix / _match_prefix_helper) stamps every node it visits as just
  used, and splits the edge a match ends inside (_split_node: the new upper node takes
  the matched part and the lower part's lock count; the lower part keeps its object).
- `insert` (_insert_helper) stamps the nodes it walks, splits likewise, and adds what
  the tree lacks as a new leaf; it returns how many tokens the tree had already, whose
  copies the caller frees.
- `lock` adds to a node's and all its ancestors' lock counts (inc_lock_ref /
  dec_lock_ref); a node locked by nobody is evictable.
- `evict(n)` frees unlocked leaves, least recently used first, until at least n slots
  are freed or none is left; a parent left childless joins the candidates (evict).
Recency is a logical clock: each stamp is the next tick, visited nodes root first, a
split's upper node when made, a new leaf when made, so no wall clock enters the model.
SGLang stamps the nodes of one lookup or insert with one `time.monotonic()` reading;
that orders the leaves alike, since two leaves are never stamped by the same call.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from kvsim.kvcache.base import InvariantError
from kvsim.kvcache.runs import Runs, common_length, runs_length, split_runs


class Node:
    __slots__ = ("id", "runs", "length", "parent", "children", "ref", "last_access", "gpu", "host", "hits")

    def __init__(self, node_id: int, runs: Runs, parent: Node | None, stamp: int):
        self.id, self.runs, self.parent = node_id, runs, parent
        self.length = runs_length(runs)
        self.children: dict[Runs, Node] = {}  # by the first page of their edge
        self.ref = 0  # running sequences whose path passes here
        self.last_access = stamp
        # where a host pool backs the tree (kvsim.kvcache.host_tree): whether its KV is in
        # the GPU pool, whether it has a host copy, and the inserts that counted it
        self.gpu, self.host, self.hits = True, False, 0


class Match(NamedTuple):
    """The longest cached prefix of some runs: the nodes it passes, how far into the last
    it goes (the whole edge unless the match ends inside it), the tokens matched, and
    the unlocked slots that locking them would take out of the evictable ones."""

    path: list[Node]
    into: int
    matched: int
    locked: int


class RadixTree:
    def __init__(self, page: int):
        if page < 1:
            raise ValueError(f"need page_size >= 1, got {page}")
        self.page = page
        self.root = Node(0, (), None, 0)  # holds no slots, never evicted
        self._next_id = 1
        self._clock = 0
        self.size = 0  # slots held by nodes
        self.evictable = 0  # slots held by nodes no running sequence passes through

    # -- views --------------------------------------------------------------------------

    def whole_pages(self, runs: Runs) -> Runs:
        """The longest prefix of `runs` made of whole pages."""
        n = runs_length(runs)
        return runs if n % self.page == 0 else split_runs(runs, n - n % self.page)[0]

    def key(self, runs: Runs) -> Runs:
        """A child's key: its edge's first page (the runs of whole-page tuples are
        canonical: two equal token sequences give equal runs)."""
        return split_runs(runs, self.page)[0]

    def all_nodes(self) -> list[tuple[Node, int]]:
        """Every node but the root and the tokens before it, depth first, children in
        order of their key."""
        out, stack = [], [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root:
                out.append((node, depth))
            for key in sorted(node.children, reverse=True):
                stack.append((node.children[key], depth + node.length))
        return out

    # -- matching and inserting -----------------------------------------------------------

    def walk(self, runs: Runs, everywhere: bool = False) -> Match:
        """The longest cached prefix of `runs` (whole pages only), changing nothing: of
        the nodes on the GPU, or (`everywhere`) of all the nodes, where a subclass keeps
        some elsewhere (kvsim.kvcache.host_tree)."""
        node, path, into = self.root, [], 0
        runs = self.whole_pages(runs)
        while runs and (child := node.children.get(self.key(runs))) is not None and (everywhere or self.on_gpu(child)):
            into = common_length(child.runs, runs) // self.page * self.page
            path.append(child)
            if into < child.length:
                break
            runs, node = split_runs(runs, into)[1], child
        matched = sum(n.length for n in path[:-1]) + into
        locked = sum(n.length for n in path[:-1] if n.ref == 0)
        if path and path[-1].ref == 0:
            locked += into
        return Match(path, into, matched, locked)

    def touch(self, match: Match) -> Node:
        """Refresh the nodes a walk visited and split the edge it ends inside; returns
        the node the match ends on (the root if nothing matched)."""
        for node in match.path:
            node.last_access = self._tick()
        if not match.path:
            return self.root
        node = match.path[-1]
        if match.into == node.length:
            return node
        head, tail = split_runs(node.runs, match.into)
        parent = node.parent
        upper = self._new_node(head, parent)  # replaces node under its key
        upper.ref, upper.gpu, upper.host, upper.hits = node.ref, node.gpu, node.host, node.hits
        node.runs, node.length, node.parent = tail, node.length - match.into, upper
        upper.children[self.key(tail)] = node
        return upper

    def lookup(self, runs: Runs) -> Match:
        """SGLang's match_prefix: the match, with its path refreshed and split."""
        match = self.walk(runs)
        self.touch(match)
        return match

    def on_gpu(self, node: Node) -> bool:
        """Whether the node's KV is in the GPU pool (every node is, here)."""
        return True

    def insert(self, runs: Runs, inserted: int = 0) -> tuple[Node, int]:
        """Put `runs` (whole pages) in the tree; returns the node they end on and how
        many of their tokens the tree had already. A new leaf is unlocked (evictable).
        `inserted`: the tokens the same sequence inserted before (a subclass counts
        hits beyond them)."""
        runs = self.whole_pages(runs)
        match = self.walk(runs)
        node = self.touch(match)
        new = runs_length(runs) - match.matched
        if new > 0:
            node = self._new_node(split_runs(runs, match.matched)[1], node)
            self.size += new
            self.evictable += new
        return node, match.matched

    def _new_node(self, runs: Runs, parent: Node) -> Node:
        node = Node(self._next_id, runs, parent, self._tick())
        self._next_id += 1
        parent.children[self.key(runs)] = node
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- locks and eviction ---------------------------------------------------------------

    def lock(self, node: Node, delta: int) -> None:
        """Add `delta` to the lock count of `node` and every node above it."""
        while node is not self.root:
            if node.ref == 0:
                self.evictable -= node.length
            node.ref += delta
            if node.ref == 0:
                self.evictable += node.length
            node = node.parent

    def evict(self, amount: int) -> int:
        """Evict unlocked leaves, least recently used first, until at least `amount`
        slots are freed or nothing is evictable; returns the slots freed."""
        heap = [(n.last_access, n.id, n) for n, _ in self.all_nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < amount and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self.key(leaf.runs)]
            self.size -= leaf.length
            self.evictable -= leaf.length
            freed += leaf.length
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # -- invariants -----------------------------------------------------------------------

    def check(self, refs: dict[int, int]) -> None:
        """`refs`: node id -> running sequences whose path passes through it."""
        size = evictable = 0
        stamps: set[int] = set()
        for node, _ in self.all_nodes():
            if node.ref != refs.get(node.id, 0) or node.ref < 0:
                raise InvariantError(
                    f"node {node.id} has refcount {node.ref}; {refs.get(node.id, 0)} running paths pass through it"
                )
            if (
                node.length != runs_length(node.runs)
                or node.length <= 0
                or node.length % self.page
                or any(c == -1 for c, _, _ in node.runs)
            ):
                raise InvariantError(
                    f"node {node.id} has edge {node.runs} of length {node.length} (page size {self.page})"
                )
            if node.parent.children.get(self.key(node.runs)) is not node:
                raise InvariantError(f"node {node.id} is not its parent's child under its first page")
            if not 0 < node.last_access <= self._clock or node.last_access in stamps:
                raise InvariantError(
                    f"node {node.id} has stamp {node.last_access} (clock {self._clock}, or shared with another node)"
                )
            stamps.add(node.last_access)
            slots = node.length if self.on_gpu(node) else 0
            size += slots
            evictable += slots if node.ref == 0 else 0
        if (size, evictable) != (self.size, self.evictable):
            raise InvariantError(f"counted tree/evictable {size}/{evictable}, kept {self.size}/{self.evictable}")
