"""Token identity as content runs: measuring, comparing and cutting them.

A sequence's tokens are given by `SeqShape.runs` as (content id, offset, length) runs
(see base.py); the prefix caches compare them without expanding them token by token.
Content -1 means "unique, never shared": no cache stores or matches it.
"""

from __future__ import annotations

from kvsim.kvcache.base import SeqShape

Runs = tuple[tuple[int, int, int], ...]


def runs_length(runs: Runs) -> int:
    return sum(length for _, _, length in runs)


def common_length(a: Runs, b: Runs) -> int:
    """Tokens at the start of `a` and `b` that are the same token (content and offset)."""
    i = j = n = 0
    da = db = 0  # tokens consumed of a[i] and b[j]
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
