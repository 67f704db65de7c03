"""The radix tree of SGLang's hierarchical cache (HiCache): nodes whose KV is in the GPU
pool, in the host pool, or in both, as in SGLang 0.5.23
(python/sglang/srt/mem_cache/unified_cache/unified_tree_core.py, UnifiedTreeCore;
unified_radix_cache.py, UnifiedRadixCache). It counts slots of both pools; the pools
are the allocator's (kvsim.kvcache.hiradix).

A node is on the GPU (SGLang: not `evicted`), has a host copy (`backuped`), or both; a
node with neither is removed. The nodes on the GPU are a subtree from the root: only a
GPU leaf (no child on the GPU) leaves the GPU, and what comes back comes back along a
path from the root. Below them hang host-only nodes.

The rules, each from those files:
- Copies to host (`_inc_hit_count_and_check`): an insert counts a hit on each node it
  walks that ends beyond what the same request inserted before
  (`_finish_insert_walk_node`, `inserted_len`), and on the leaf it adds
  (`_should_backup_after_insert`); a node without a host copy whose hits reach the
  write-through threshold is copied: 1 for write_through, 2 for
  write_through_selective (`write_through_threshold`). write_back copies nothing then.
- A copy needs the node's slots in the host pool; if too few are free, host-only leaves
  are evicted for the shortfall, and if that is not enough the node stays without a
  copy (`_execute_kv_backup`, `evict_host`).
- GPU eviction (`evict_device_leaf`): unlocked GPU leaves, least recently used first,
  until the amount is freed; one with a host copy is demoted (it stays, host-only), one
  without is deleted (with write_back it is first copied, if the host pool can make
  room; SGLang drops its subtree when it cannot: `drop_subtree_no_host`). A parent
  left without children on the GPU joins the candidates.
- Host eviction (`drive_host_eviction`, `_is_host_leaf`): host-only leaves, least
  recently used first (the radix cache's default eviction policy, lru).
- A split (`_split_node`) gives both halves the node's places and hit count (the plain
  tree's split copies them).
- A load (`load_back`) brings the host-only nodes of a match back onto the GPU; they
  keep their host copy.
Recency is the radix tree's logical clock, shared by both pools.
"""

from __future__ import annotations

import heapq

from kvsim.kvcache.base import InvariantError
from kvsim.kvcache.radix_tree import Match, Node, RadixTree
from kvsim.kvcache.runs import Runs, runs_length, split_runs

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": None}


class HostRadixTree(RadixTree):
    """A radix tree over a GPU pool and a host pool of `host_capacity` slots."""

    def __init__(self, page: int, host_capacity: int, write_policy: str = "write_through"):
        if write_policy not in WRITE_THRESHOLD:
            raise ValueError(f"unknown write policy {write_policy!r}; valid: {', '.join(WRITE_THRESHOLD)}")
        super().__init__(page)
        self.host_capacity = host_capacity
        self.write_policy = write_policy
        self.threshold = WRITE_THRESHOLD[write_policy]
        self.host_size = 0  # slots of the host pool held by nodes
        self.written = 0  # slots copied to the host pool, in all
        self.loaded = 0  # slots loaded back from it, in all

    def on_gpu(self, node: Node) -> bool:
        return node.gpu

    def host_match(self, runs: Runs) -> tuple[Match, int]:
        """The longest prefix of `runs` held anywhere, and the tokens of it only the host
        pool holds (those past the GPU's match), changing nothing."""
        match = self.walk(runs, everywhere=True)
        gpu = sum(n.length for n in match.path if n.gpu)
        if match.path and match.path[-1].gpu:
            gpu += match.into - match.path[-1].length
        return match, match.matched - gpu

    # -- inserting and copying ------------------------------------------------------------

    def insert(self, runs: Runs, inserted: int = 0) -> tuple[Node, int]:
        """Insert as the plain tree does, walking host-only nodes too: the sequence's
        copy becomes their GPU copy (it is not one the tree had). Counts the hits and
        makes the copies write-through asks for."""
        runs = self.whole_pages(runs)
        match = self.walk(runs, everywhere=True)
        end = self.touch(match)
        walked = [*match.path[:-1], end] if match.path else []
        known = 0
        for node in walked:
            if node.gpu:
                known += node.length
            else:  # back on the GPU, from the sequence's own copy
                node.gpu = True
                self.size += node.length
                self.evictable += node.length if node.ref == 0 else 0
        new = runs_length(runs) - match.matched
        if new > 0:
            end = self._new_node(split_runs(runs, match.matched)[1], end)
            walked.append(end)
            self.size += new
            self.evictable += new
        # then the copies, as SGLang runs the walk's backups after it: a copy may evict
        # host-only leaves, none of them on this path now
        depth = 0
        for node in walked:
            depth += node.length
            if depth > inserted:
                self._hit(node)
        return end, known

    def _hit(self, node: Node) -> None:
        if self.threshold is None:
            return
        node.hits += 1
        if not node.host and node.hits >= self.threshold:
            self.copy_to_host(node)

    def copy_to_host(self, node: Node) -> bool:
        """Give the node a host copy, evicting host-only leaves for room; False if the
        host pool cannot make room (the node stays without one)."""
        short = self.host_size + node.length - self.host_capacity
        if short > 0 and self.evict_host(short) < short:
            return False
        node.host = True
        self.host_size += node.length
        self.written += node.length
        return True

    # -- eviction -------------------------------------------------------------------------

    def _gpu_leaf(self, node: Node) -> bool:
        return node is not self.root and node.gpu and node.ref == 0 and not any(c.gpu for c in node.children.values())

    def evict(self, amount: int) -> int:
        """Take unlocked GPU leaves off the GPU, least recently used first, until at
        least `amount` slots are freed or none is left; returns the slots freed."""
        heap = [(n.last_access, n.id, n) for n, _ in self.all_nodes() if self._gpu_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < amount and heap:
            _, _, leaf = heapq.heappop(heap)
            if not self._gpu_leaf(leaf):  # a write-back copy's host eviction cannot
                continue  # touch it, but stay safe
            if not leaf.host and self.write_policy == "write_back":
                self.copy_to_host(leaf)
            leaf.gpu = False
            self.size -= leaf.length
            self.evictable -= leaf.length
            freed += leaf.length
            parent = leaf.parent
            if not leaf.host:  # no copy anywhere: gone, with what hangs below
                self._remove(leaf)
            if self._gpu_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _host_leaf(self, node: Node) -> bool:
        return node is not self.root and not node.gpu and node.host and not node.children

    def evict_host(self, amount: int) -> int:
        """Drop host-only leaves, least recently used first, until at least `amount` host
        slots are freed or none is left; returns the slots freed."""
        heap = [(n.last_access, n.id, n) for n, _ in self.all_nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < amount and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove(leaf)
            if self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _remove(self, node: Node) -> int:
        """Take a node off the GPU (none of its subtree is there) out of the tree, with
        its subtree; returns the host slots freed."""
        del node.parent.children[self.key(node.runs)]
        freed, stack = 0, [node]
        while stack:
            n = stack.pop()
            freed += n.length if n.host else 0
            stack.extend(n.children.values())
        self.host_size -= freed
        return freed

    # -- loading --------------------------------------------------------------------------

    def load(self, match: Match) -> int:
        """Bring the host-only nodes of `match` (a walk everywhere) onto the GPU, the path
        refreshed and split where the match ends; returns the slots loaded."""
        end = self.touch(match)
        loaded = 0
        for node in [*match.path[:-1], end] if match.path else []:
            if not node.gpu:
                node.gpu = True
                loaded += node.length
        self.size += loaded
        self.evictable += loaded  # unlocked until the sequence locks its match
        self.loaded += loaded
        return loaded

    # -- invariants -----------------------------------------------------------------------

    def check(self, refs: dict[int, int]) -> None:
        super().check(refs)
        host = 0
        for node, _ in self.all_nodes():
            if not (node.gpu or node.host):
                raise InvariantError(f"node {node.id} is neither on the GPU nor in host memory")
            if node.gpu and node.parent is not self.root and not node.parent.gpu:
                raise InvariantError(f"node {node.id} is on the GPU below host-only node {node.parent.id}")
            if not node.gpu and node.ref:
                raise InvariantError(f"host-only node {node.id} is locked by {node.ref} sequences")
            host += node.length if node.host else 0
        if host != self.host_size or host > self.host_capacity:
            raise InvariantError(f"counted {host} host slots, kept {self.host_size} (capacity {self.host_capacity})")
