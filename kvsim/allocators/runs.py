"""Token identity as content runs: measuring, comparing and cutting them.

A sequence's tokens are given by `SeqShape.runs` as (content id, offset, length) runs
(see base.py); the prefix caches compare them without expanding them token by token.
Content -1 means "unique, never shared": no cache stores or matches it.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import repeat

from kvsim.allocators.base import SeqShape

Runs = tuple[tuple[int, int, int], ...]


def runs_length(runs: Runs) -> int:
    return sum(length for _, _, length in runs)


def common_length(a: Runs, b: Runs) -> int:
    """Tokens at the start of `a` and `b` that are the same token (content and offset)."""
    i = j = n = 0
    da = db = 0                        # tokens consumed of a[i] and b[j]
    while i < len(a) and j < len(b):
        (ca, oa, la), (cb, ob, lb) = a[i], b[j]
        if ca != cb or ca == -1 or oa + da != ob + db:
            break
        step = min(la - da, lb - db)
        n, da, db = n + step, da + step, db + step
        if da == la:
            i, da = i + 1, 0
        if db == lb:
            j, db = j + 1, 0
    return n


def split_runs(runs: Runs, k: int) -> tuple[Runs, Runs]:
    """The first `k` tokens of `runs`, and the rest."""
    head, tail = [], []
    for content, offset, length in runs:
        take = min(k, length)
        if take:
            head.append((content, offset, take))
        if take < length:
            tail.append((content, offset + take, length - take))
        k -= take
    return tuple(head), tuple(tail)


def cacheable_runs(shape: SeqShape, num_tokens: int) -> Runs:
    """Tokens [0, num_tokens) up to the first one of content -1 (never shared)."""
    runs = shape.runs(0, num_tokens)
    cut = next((i for i, (content, _, _) in enumerate(runs) if content == -1), len(runs))
    return runs[:cut]


@lru_cache(maxsize=512)
def full_block_runs(shape: SeqShape, block_size: int) -> tuple[Runs, ...]:
    """`shape.runs` of each full block of the shape's final sequence, up to the first
    block holding content -1 (no later block can be cached). The prefix cache
    asks for a block's runs on every lookup, and a waiting request is looked up every
    step, so they are made once per shape, in one walk over its segments (the cache is
    bounded; the value depends on the arguments alone)."""
    pieces = [(content, length) for content, length in shape.segments if length]
    pieces.append((shape.tail_id, shape.final_tokens))       # the tail runs to the end
    total = shape.final_tokens // block_size
    blocks, block, room = [], [], block_size
    for content, length in pieces:
        offset = 0
        while offset < length and len(blocks) < total:
            if content == -1:
                return tuple(blocks)
            if not block and length - offset >= block_size:   # whole blocks of one content
                n = min((length - offset) // block_size, total - len(blocks))
                end = offset + n * block_size
                # ((content, o, block_size),) for each o, made in C
                blocks.extend(zip(zip(repeat(content), range(offset, end, block_size), repeat(block_size))))
                offset = end
                continue
            take = min(room, length - offset)
            block.append((content, offset, take))
            offset, room = offset + take, room - take
            if not room:
                blocks.append(tuple(block))
                block, room = [], block_size
    return tuple(blocks)
