"""A request stream's prompts as references to cacheable KV blocks, for cache curves.

A prefix cache stores a prompt's full blocks of `block_size` tokens under chained keys:
a block's key stands for every token up to its end, so two prompts share a block only
when they agree on everything before it too (vLLM's prefix caching, kvsim's caches).
Here a key is built from the prompt's content runs (kvsim.kvcache.SeqShape): a run
(content c from offset o, for l tokens) that starts after the prefix P gets the id
g = intern((P, c, o)); its blocks are (g, j) for the block indices j whose last token
lies in the run (a block straddling two runs belongs to the second), and the prefix
after it is (g, o + l). The prompt's own tail is a run like any other; content -1
("never shared") ends the cacheable part.

Blocks that every request references together need not be told apart: within one
prompt, a block and the next have equal reference counts only if every request holding
the second also holds the first (the second's key fixes the first), so the two are
referenced by the same requests. Runs of such blocks become one *item* of `weight`
blocks. An item's blocks share their whole history, so a cache keeps the shallowest of
them and drops the deepest first (as it drops a child before its parent); a stream of
millions of block references becomes a few thousand item references (Mooncake's
synthetic trace: 3.8M blocks of 16 tokens, about six thousand items).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.kvcache.runs import cacheable_runs

_SPAN = 1 << 32  # block indices (and offsets) per run id, packed into one int64


@dataclass(frozen=True)
class BlockReferences:
    """Item references in stream order: request by request, each prompt's items in order.
    Arrays are int64 and of one length; `depth` is an item's first block's index in the
    prompt (the same in every prompt holding it)."""

    request: np.ndarray
    item: np.ndarray
    weight: np.ndarray
    depth: np.ndarray
    block_size: int
    num_requests: int
    prompt_tokens: int  # every prompt token of the stream, cacheable or not

    @property
    def blocks(self) -> int:
        """Block references: the full blocks of every prompt, one per block per request."""
        return int(self.weight.sum())

    def previous(self) -> np.ndarray:
        """Index of the same item's previous reference, -1 for its first."""
        order = np.argsort(self.item, kind="stable")
        again = np.flatnonzero(self.item[order][1:] == self.item[order][:-1]) + 1
        prev = np.full(len(self.item), -1, dtype=np.int64)
        prev[order[again]] = order[again - 1]
        return prev


def block_references(requests, block_size: int) -> BlockReferences:
    """The prompts of `requests` (RequestSpecs, or a RequestTable) as item references."""
    intern: dict[tuple[int, int, int], int] = {}
    run_id, first, last, owner = [], [], [], []
    prompt_tokens = count = 0
    for count, spec in enumerate(requests, start=1):
        prompt_tokens += spec.prompt_tokens
        prefix, pos = -1, 0
        for content, offset, length in cacheable_runs(spec.shape, spec.prompt_tokens):
            g = intern.setdefault((prefix, content, offset), len(intern))
            b0, b1 = pos // block_size, (pos + length) // block_size
            if b1 > b0:
                run_id.append(g)
                first.append(b0)
                last.append(b1)
                owner.append(count - 1)
            prefix, pos = g * _SPAN + offset + length, pos + length
    g, b0, b1 = (np.asarray(x, dtype=np.int64) for x in (run_id, first, last))
    request = np.asarray(owner, dtype=np.int64)

    # Pieces: a run id's blocks cut wherever one of its references ends, so that every
    # block of a piece is held by the same references.
    start, end = g * _SPAN + b0, g * _SPAN + b1
    bounds = np.unique(np.concatenate([start, end]))
    p0, p1 = np.searchsorted(bounds, start), np.searchsorted(bounds, end)
    n = p1 - p0
    piece = np.repeat(p0 - np.cumsum(n) + n, n) + np.arange(n.sum())
    piece_request = np.repeat(request, n)
    counts = np.bincount(piece, minlength=len(bounds))[piece]

    # Items: consecutive pieces of one prompt with equal reference counts.
    new = np.ones(len(piece), dtype=bool)
    new[1:] = (piece_request[1:] != piece_request[:-1]) | (counts[1:] != counts[:-1])
    heads = np.flatnonzero(new)
    sizes = bounds[piece + 1] - bounds[piece] if len(piece) else np.zeros(0, np.int64)
    return BlockReferences(
        request=piece_request[heads],
        item=piece[heads],
        weight=np.add.reduceat(sizes, heads) if len(heads) else sizes,
        depth=bounds[piece[heads]] % _SPAN,
        block_size=block_size,
        num_requests=count,
        prompt_tokens=prompt_tokens,
    )
