"""The search structure of TensorRT-LLM's block reuse: stored blocks in a tree by content.

As in TensorRT-LLM 1.2.0rc2's KVCacheBlock (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp
at commit b35ac1b64368, not proven to be the tag's (kvsim.kvcache.trtllm):
`addNextBlock`, `findMatchingBlock`, `freeLeafBlock`;
BlockKey::partialMatch): each
stored block hangs under the block before it in its sequence (the root for a first
block), keyed by its own tokens (its BlockKey), so a path from the root spells a prefix.
A lookup goes down one block at a time: a child whose key equals the block's tokens is
a match (a partial match if that stored block is not full); failing that, with partial
reuse on, the child sharing the longest run of leading tokens with it (among the
children `eligible` allows; BlockKey::partialMatch) is a partial match of that many tokens. Ties go to the
child stored first (TensorRT-LLM's std::map order of BlockKeys; kvsim's keys are
content runs, not token ids).

Tokens are kvsim's content runs (kvsim.kvcache.base.SeqShape.runs): a block's key is
the tuple of (content, offset, length) runs of its tokens. Two tokens are equal where
content and offset are; content -1 never equals anything.

Children are also indexed by their first token, so a partial lookup reads only the
children that share it (the root may have a child per distinct prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.runs import Runs, common_length, runs_length

ROOT = -1


@dataclass(frozen=True)
class Match:
    """One block a lookup found: its id, the tokens it gives, and whether the match is
    partial (the walk ends there)."""

    block: int
    tokens: int
    partial: bool


def block_keys(shape: SeqShape, tokens: int, block_size: int, partial: bool) -> list[Runs]:
    """The keys of a sequence's first `tokens` tokens, block by block; the last partial
    one only where `partial` (chopVectorIntoBlocks's allowPartial)."""
    last = tokens if partial else tokens - tokens % block_size
    return [shape.runs(start, min(start + block_size, last)) for start in range(0, last, block_size)]


def never_shared(runs: Runs) -> bool:
    """Content kvsim never shares (-1): such a block is never stored nor matched."""
    return any(content == -1 for content, _, _ in runs)


def _head(runs: Runs) -> tuple[int, int]:
    return runs[0][0], runs[0][1]


class BlockTree:
    """Stored blocks: who hangs under whom, by key. Owned here: `parent` and `key` of a
    stored block, and every node's children."""

    def __init__(self):
        self._children: dict[int, dict[Runs, int]] = {ROOT: {}}
        self._by_head: dict[int, dict[tuple[int, int], list[int]]] = {ROOT: {}}
        self.parent: dict[int, int] = {}  # stored block -> the node it hangs under
        self.key: dict[int, Runs] = {}  # stored block -> its key there

    def __contains__(self, block: int) -> bool:
        return block in self.parent

    def is_leaf(self, block: int) -> bool:
        return not self._children.get(block)

    def child(self, node: int, runs: Runs) -> int | None:
        """The child of `node` whose key is exactly `runs`, if any."""
        kids = self._children.get(node)
        return kids.get(runs) if kids else None

    def best_partial(self, node: int, runs: Runs, eligible: Callable[[int], bool]) -> tuple[int | None, int]:
        """(child, tokens): the eligible child of `node` sharing the most leading tokens
        with `runs` (None, 0 where none shares one)."""
        heads = self._by_head.get(node)
        if not heads or not runs:
            return None, 0
        best, best_n = None, 0
        for block in heads.get(_head(runs), ()):
            if eligible(block):
                n = common_length(self.key[block], runs)
                if n > best_n:
                    best, best_n = block, n
        return best, best_n

    def insert(self, node: int, runs: Runs, block: int) -> None:
        """Hang `block` under `node` with key `runs` (addNextBlock: a key taken stays)."""
        kids = self._children.setdefault(node, {})
        if runs in kids:
            return
        kids[runs] = block
        self._by_head.setdefault(node, {}).setdefault(_head(runs), []).append(block)
        self._children.setdefault(block, {})
        self._by_head.setdefault(block, {})
        self.parent[block], self.key[block] = node, runs

    def detach(self, block: int) -> list[int]:
        """Take `block` and everything below it out of the tree; returns them, `block`
        first (TensorRT-LLM's freeChildren, which runs before a block is repurposed)."""
        if block not in self.parent:
            return []
        out, stack = [], [block]
        node, runs = self.parent[block], self.key[block]
        del self._children[node][runs]
        heads = self._by_head[node][_head(runs)]
        heads.remove(block)
        if not heads:
            del self._by_head[node][_head(runs)]
        while stack:
            b = stack.pop()
            out.append(b)
            stack.extend(self._children.pop(b, {}).values())
            self._by_head.pop(b, None)
            del self.parent[b], self.key[b]
        return out

    def match(
        self, node: int, runs: Runs, block_size: int, partial_reuse: bool, eligible: Callable[[int], bool]
    ) -> Match | None:
        """The stored block under `node` that a block with key `runs` reuses, if any
        (`findMatchingBlock`): the child with that very key, else, with partial reuse on,
        the eligible child sharing the most leading tokens with it (a partial match)."""
        if never_shared(runs):
            return None
        block = self.child(node, runs)
        if block is not None:
            size = runs_length(runs)
            return Match(block, size, size < block_size)  # a stored partial block matched exactly is partial
        if partial_reuse:
            block, n = self.best_partial(node, runs, eligible)
            if block is not None:
                return Match(block, n, True)
        return None

    def walk(
        self, keys: list[Runs], block_size: int, partial_reuse: bool, eligible: Callable[[int], bool]
    ) -> list[Match]:
        """The blocks a sequence with these keys would reuse if nothing changed on the way
        (loadOrAllocateBlocks' matching): full matches from the root down, then at most
        one partial match."""
        node, out = ROOT, []
        for runs in keys:
            m = self.match(node, runs, block_size, partial_reuse, eligible)
            if m is None:
                break
            out.append(m)
            if m.partial:
                break
            node = m.block
        return out

    def first_missing(self, keys: list[Runs]) -> tuple[int, Runs] | None:
        """(node, key) of the first of these full keys not stored, or None."""
        node = ROOT
        for runs in keys:
            if never_shared(runs):
                return None
            block = self.child(node, runs)
            if block is None:
                return node, runs
            node = block
        return None

    def check(self) -> None:
        """Every stored block hangs under a stored block or the root, by its key, once."""
        seen = 0
        for node, kids in self._children.items():
            if node != ROOT and node not in self.parent:
                raise InvariantError(f"block {node} has children but is not stored")
            heads = self._by_head.get(node, {})
            if sum(map(len, heads.values())) != len(kids):
                raise InvariantError(f"block {node}'s first-token index disagrees with its children")
            for runs, b in kids.items():
                if self.parent.get(b) != node or self.key.get(b) != runs or b not in heads.get(_head(runs), ()):
                    raise InvariantError(f"stored block {b} is not where its key says")
                seen += 1
        if seen != len(self.parent):
            raise InvariantError(f"{len(self.parent)} blocks are stored, {seen} hang in the tree")
