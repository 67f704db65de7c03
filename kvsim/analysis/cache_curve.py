"""Cache curves: the hit rate a prefix cache of capacity C reaches on a request stream,
from the prompts alone (no engine, no timing), for many capacities at once.

The cache holds at most C blocks (kvsim.analysis.block_refs says what a block is). Each
request first looks up its prompt: its hits are the blocks of its longest cached prefix.
Then every block of its prompt is offered to the cache and the policy decides what
stays. Hits are tokens of full blocks, as a share of all prompt tokens. Left out: the
last prompt token that an engine always recomputes, a request's output (never looked up
by another prompt here), the time a running request pins its blocks, and partly filled
blocks (never cached, as in vLLM).

Policies (`POLICIES`), each a total order on blocks (the cache keeps the highest):
  lru     least recently used goes first (vLLM's free queue, SGLang's default); a
          request's own blocks rank as vLLM frees them, deepest first, so its first
          block is the most recent and a prefix outlives what follows it.
  lfu     perfect LFU (Breslau et al., "Web caching and Zipf-like distributions",
          INFOCOM 1999): references counted over the whole stream, resident or not;
          ties to the more recent. A block enters only by outranking the lowest resident
          one (LFU that always admits, as SGLang's LFUStrategy in
          python/sglang/srt/mem_cache/evict_policy.py, keeps counts only while a block is
          cached and is not a stack policy; it is not modelled).
  belady  Belady's MIN: the block used again soonest stays, one used never again goes
          first. With the cache free to drop any block it was offered, this is the
          optimum knowing the future: no policy hits more, at any capacity.
Ties go to the shallower block, so every policy keeps prefixes whole.

LRU and LFU are stack policies (Mattson et al., "Evaluation techniques for storage
hierarchies", IBM Systems Journal 1970): an order that only references change, and
that raises what is referenced, makes the cache of C blocks the C highest blocks seen so
far, for every C at once. One pass then gives each reference's rank (blocks above it)
and every capacity's hits. MIN's order lowers what is referenced (its next use moves
away), so it runs once per capacity.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import pandas as pd

from kvsim.analysis.block_refs import BlockReferences

POLICIES = ("lru", "lfu", "belady")
COLUMNS = ("policy", "capacity_tokens", "hit_rate", "hit_tokens", "prompt_tokens")


def cache_curve(refs: BlockReferences, capacities_tokens, policies=POLICIES) -> pd.DataFrame:
    """One row per (policy, capacity): hit_rate = hit_tokens / prompt_tokens. Capacities
    are tokens (math.inf: unlimited), rounded down to whole blocks."""
    # a capacity beyond every distinct block is an unlimited one (and stays inside int64)
    most = distinct_tokens(refs) // refs.block_size
    caps = [math.inf if c >= (most + 1) * refs.block_size else int(c // refs.block_size) for c in capacities_tokens]
    prev = refs.previous()
    rows = []
    for policy in policies:
        if policy == "belady":
            blocks = [_min_hits(refs, prev, c) for c in caps]
        else:
            ranks = _stack_ranks(refs, prev, _positions(policy, refs, prev))
            blocks = _stack_hits(ranks, refs.weight, caps)
        for cap, hit in zip(capacities_tokens, blocks):
            tokens = hit * refs.block_size
            rows.append(
                (policy, cap, tokens / refs.prompt_tokens if refs.prompt_tokens else 0.0, tokens, refs.prompt_tokens)
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def distinct_tokens(refs: BlockReferences) -> int:
    """Tokens in the stream's distinct blocks: what an unlimited cache ends up holding."""
    _, first = np.unique(refs.item, return_index=True)
    return int(refs.weight[first].sum()) * refs.block_size


# ------------------------------------------------------------------ stack policies


def _positions(policy: str, refs: BlockReferences, prev: np.ndarray) -> np.ndarray:
    """Each reference's place in the policy's order of every reference's new standing
    (0 lowest): after request r, LRU ranks by (r, shallower first), LFU by (references so
    far, r, shallower first)."""
    keys = [-refs.depth, refs.request]
    if policy == "lfu":
        order = np.argsort(refs.item, kind="stable")
        group = np.r_[0, np.flatnonzero(refs.item[order][1:] != refs.item[order][:-1]) + 1]
        seen = np.arange(len(order)) - np.repeat(group, np.diff(np.r_[group, len(order)]))
        count = np.empty(len(order), dtype=np.int64)
        count[order] = seen + 1
        keys.append(count)
    elif policy != "lru":
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    pos = np.empty(len(refs.item), dtype=np.int64)
    pos[np.lexsort(keys)] = np.arange(len(refs.item))
    return pos


def _stack_ranks(refs: BlockReferences, prev: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Blocks ranked above each reference's item when its request looks up (-1: never
    seen before). Every seen item holds its weight at its latest reference's position;
    a request's lookups read the sums above, then its references move its items up.

    Requests are taken in chunks of about sqrt(n) references: the sums above each
    position are computed once per chunk, and what earlier requests of the same chunk
    changed is added pairwise (a chunk's references against each other), so the whole
    costs about n * sqrt(n) array operations and no per-reference Python."""
    n = len(pos)
    held = np.zeros(n + 1, dtype=np.int64)  # weight at each position
    ranks = np.full(n, -1, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, refs.request[1:] != refs.request[:-1]])
    step = max(64, int(math.sqrt(n)))
    marks = np.searchsorted(starts, np.arange(step, n, step), side="right") - 1
    cuts = np.unique(np.r_[0, starts[marks], n])  # whole requests only
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        above = np.cumsum(held[::-1])[::-1]  # above[p] = weight at positions >= p
        seen = prev[a:b] >= 0
        q = np.where(seen, pos[np.maximum(prev[a:b], 0)], -1)  # each item's standing now
        rank = above[q + 1]
        req = refs.request[a:b]
        if req[0] != req[-1]:  # what earlier requests of the chunk moved: onto positions
            earlier = req[None, :] < req[:, None]  # above q, and away from positions above q
            w = refs.weight[a:b]
            rank = rank + ((earlier & (pos[a:b][None, :] > q[:, None])) @ w - (earlier & (q[None, :] > q[:, None])) @ w)
        ranks[a:b] = np.where(seen, rank, -1)
        held[q[seen]] -= refs.weight[a:b][seen]
        held[pos[a:b]] += refs.weight[a:b]
    return ranks


def _stack_hits(ranks: np.ndarray, weight: np.ndarray, caps) -> list[int]:
    """Hit blocks per capacity: an item ranked below r blocks keeps C - r of its blocks."""
    seen = ranks >= 0
    r, w = ranks[seen], weight[seen]
    return [int(w.sum()) if math.isinf(c) else int(np.clip(c - r, 0, w).sum()) for c in caps]


# ------------------------------------------------------------------ Belady's MIN


def _min_hits(refs: BlockReferences, prev: np.ndarray, capacity) -> int:
    """Hit blocks of MIN at `capacity` blocks: after each request the cache keeps the
    blocks used again soonest among what it held and what the request offered (ties: the
    shallower), dropping an item's deepest blocks first. A block never used again would be
    dropped before any other, so it is never stored; and a cache that can hold every block
    awaiting its next use at once hits as an unlimited one does."""
    again = prev >= 0
    if math.isinf(capacity) or capacity >= _peak_awaited(refs, prev):
        return int(refs.weight[again].sum())
    nxt = np.full(len(prev), -1, dtype=np.int64)  # the request that uses it next; -1: none
    nxt[prev[again]] = refs.request[again]
    cuts = np.flatnonzero(np.r_[True, refs.request[1:] != refs.request[:-1], True]).tolist()
    item, weight, depth, nxt = (a.tolist() for a in (refs.item, refs.weight, refs.depth, nxt))
    held: dict[int, int] = {}  # item -> blocks cached
    due: dict[int, int] = {}  # item -> the request that uses it next
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, item): the first to drop on top
    push, pop = heapq.heappush, heapq.heappop
    total = hits = 0
    for i, j in zip(cuts[:-1], cuts[1:]):
        for k in range(i, j):  # the longest cached prefix
            got = held.get(item[k], 0)
            hits += got
            if got < weight[k]:
                break
        for k in range(i, j):
            it, w = item[k], weight[k]
            total -= held.pop(it, 0)
            if nxt[k] < 0:
                due.pop(it, None)
                continue
            held[it], due[it] = w, nxt[k]
            total += w
            push(heap, (-nxt[k], -depth[k], it))
        while total > capacity:
            use, _, it = heap[0]
            if due.get(it) != -use:  # an entry from an earlier standing
                pop(heap)
                continue
            drop = min(held[it], total - capacity)
            held[it] -= drop
            total -= drop
            if not held[it]:
                del held[it], due[it]
                pop(heap)
    return hits


def _peak_awaited(refs: BlockReferences, prev: np.ndarray) -> int:
    """The most blocks that, between two requests, await a later use."""
    again = np.flatnonzero(prev >= 0)
    opened = np.bincount(refs.request[prev[again]], weights=refs.weight[again], minlength=refs.num_requests)
    closed = np.bincount(refs.request[again], weights=refs.weight[again], minlength=refs.num_requests)
    return int(np.cumsum(opened - closed).max()) if len(again) else 0
