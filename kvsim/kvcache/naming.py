"""Names for stretches of content: ints such that equal names mean equal prefixes.

The GPU prefix cache (kvsim.kvcache.prefix) keys its full blocks this way and the KV
tiers (kvsim.kvcache.tiers) their chunks, as vLLM chains block hashes: a stretch of
`size` tokens is named by the name before it and its own tokens. Names are interned
ints, so lookups are exact (no hash collisions) and deterministic.

A stretch that straddles content pieces is named by (name before it, its token runs).
A run of whole stretches inside one piece is named as a run: (name before it, content,
offset where the run starts) maps to a list of names, one per stretch, that grows when
a longer run is seen, so n stretches cost one lookup. Names stay canonical: whether a
stretch lies inside one piece, and where such a run starts, follow from the tokens
before and in it (an offset restarts at 0 with each piece), so equal prefixes get equal
names and unequal ones unequal names. Content -1 ("unique, never shared") is never
named, nor is anything after it.
"""

from __future__ import annotations

from typing import NamedTuple

from kvsim.kvcache.base import SeqShape

ROOT = -1  # the name "before" a sequence's first stretch


class Chain(NamedTuple):
    """The names of a shape's first stretches, and whether one holding unique content
    (-1) ended them (no later stretch is named, however long the shape grows)."""

    keys: list[int]
    ended: bool


class ContentNames:
    """The interning tables. Their owner forgets entries nothing holds (it alone knows
    what is held); `fresh` is the one place new names are made."""

    def __init__(self, size: int):
        self.size = size
        self.ids: dict[tuple, int] = {}  # (parent, runs) -> name
        self.runs: dict[tuple[int, int, int], list[int]] = {}  # (parent, content, offset) -> names
        self.next = 0

    def fresh(self, n: int, parent: int) -> range:
        """`n` new names, each the parent of the next, the first's being `parent`."""
        names = range(self.next, self.next + n)
        self.next += n
        return names

    def walk(self, shape: SeqShape, total: int) -> Chain:
        """The names of the shape's first `total` stretches, in one walk over its content
        pieces (its segments, then the tail, which runs on past the final length where
        `total` asks for more), and whether content -1 ended them first (no later
        stretch is named)."""
        size = self.size
        pieces = [*shape.segments, (shape.tail_id, max(shape.final_tokens, total * size))]
        names: list[int] = []
        part: list[tuple[int, int, int]] = []
        room, parent = size, ROOT
        for content, length in pieces:
            offset = 0
            while offset < length and len(names) < total:
                if content == -1:
                    return Chain(names, True)  # this stretch and every later one stay unnamed
                if not part and length - offset >= size:  # whole stretches of one piece
                    n = min((length - offset) // size, total - len(names))
                    run = self.runs.setdefault((parent, content, offset), [])
                    if len(run) < n:
                        run.extend(self.fresh(n - len(run), run[-1] if run else parent))
                    names.extend(run[:n])
                    parent, offset = names[-1], offset + n * size
                    continue
                take = min(room, length - offset)
                part.append((content, offset, take))
                offset, room = offset + take, room - take
                if not room:
                    ident = (parent, tuple(part))
                    name = self.ids.get(ident)
                    if name is None:
                        name = self.ids[ident] = self.fresh(1, parent)[0]
                    names.append(name)
                    part, room, parent = [], size, name
        return Chain(names, False)
