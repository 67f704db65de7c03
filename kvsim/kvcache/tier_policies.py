"""Replacement policies of a KV tier: which stored chunk makes room for a new one.

A policy orders the keys a tier holds and names the next one to drop; the tier
(kvsim.kvcache.tiers) owns capacity and counts. Both policies are those of vLLM's
CPU offloading manager (vllm 0.33.0, vllm/v1/kv_offload/cpu/policies/lru.py, arc.py),
chosen with `kv_offload: {policy: lru | arc}` as vLLM's `eviction_policy`:

  lru  a store and every reuse make a chunk the most recent; the least recent goes.
       (A request's chunks are inserted and touched deepest first, as vLLM's `touch`
       walks them reversed, so that a prefix's tail goes before its head.)
  arc  Adaptive Replacement Cache (Megiddo and Modha, FAST 2003) as vLLM writes it: new
       chunks enter T1 (seen once); a reuse moves a chunk to T2 (seen again) or to T2's
       recent end. Evicted keys are remembered in ghost lists B1 and B2 (at most the
       tier's capacity each); storing a key found in B1 grows T1's target size by
       max(1, |B2|/|B1|), one found in B2 shrinks it by max(1, |B1|/|B2|). The victim is
       T1's oldest while |T1| >= the target, else T2's oldest (else T1's).

`victims(n, protected)` skips the keys a caller is using (vLLM's `protected` set: chunks of
the transfer being planned). No clock, no randomness: the order is that of the calls.

The orders are plain dicts, which keep their keys in insertion order (a key popped and
set again goes to the end), not OrderedDicts as vLLM's: the same order, and the bulk
updates a tier makes for every prompt (hundreds of chunks each) run about twice as fast.
"""

from __future__ import annotations

from collections import deque
from itertools import filterfalse, islice
from typing import Callable, Iterator, Mapping, Protocol


class TierPolicy(Protocol):
    """What a tier asks of its replacement policy (LRUPolicy and ARCPolicy are two)."""

    capacity: int

    @property
    def members(self) -> Mapping[int, None]:
        """Every key held, for membership tests at C speed."""

    def __contains__(self, key: int) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[int]: ...
    def insert(self, key: int) -> None: ...
    def insert_all(self, keys: list[int]) -> None:
        """Store new keys, in the order given (the last the most recent)."""

    def use_all(self, keys: list[int]) -> None:
        """Reuse held keys, in the order given."""

    def touch(self, key: int) -> None: ...
    def victims(self, n: int, protected: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
        """The next n keys to drop, none of `protected`; None where there are not n."""

    def evict(self, key: int) -> None: ...
    def evict_all(self, keys: list[int]) -> None: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: dict[int, None] = {}  # oldest first
        self.members = self._order  # every key held, for membership tests at C speed

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def insert(self, key: int) -> None:
        self._order[key] = None

    def insert_all(self, keys: list[int]) -> None:
        """insert() of each key, in order."""
        self._order.update(dict.fromkeys(keys))

    def use_all(self, keys: list[int]) -> None:
        """insert() of each key not held, touch() of the others, in order: either way the
        key becomes the most recent."""
        order = self._order
        deque(map(order.pop, list(filter(order.__contains__, keys))), maxlen=0)
        order.update(dict.fromkeys(keys))

    def touch(self, key: int) -> None:
        self._order[key] = self._order.pop(key)

    def victims(self, n: int, protected: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
        """The next `n` keys to evict, oldest first, or None if fewer can go."""
        if n <= 0:
            return []
        oldest = list(islice(self._order, n))
        if len(oldest) == n and protected.isdisjoint(oldest):  # the usual case
            return oldest
        # at most len(protected) of the oldest n + len(protected) keys are skipped
        out = [k for k in islice(self._order, n + len(protected)) if k not in protected][:n]
        return out if len(out) == n else None

    def evict(self, key: int) -> None:
        del self._order[key]

    def evict_all(self, keys: list[int]) -> None:
        """evict() of each key."""
        deque(map(self._order.pop, keys), maxlen=0)  # pop each, at C speed


class ARCPolicy:
    """Adaptive Replacement Cache (see the module docstring)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: dict[int, None] = {}  # seen once, oldest first
        self.t2: dict[int, None] = {}  # seen again
        self.b1: dict[int, None] = {}  # ghosts evicted from T1
        self.b2: dict[int, None] = {}  # ghosts evicted from T2
        self.members: dict[int, None] = {}  # T1 and T2, for membership tests at C speed

    def __contains__(self, key: int) -> bool:
        return key in self.members

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[int]:
        yield from self.t1
        yield from self.t2

    def insert(self, key: int) -> None:
        self._adapt(key)
        self.t1[key] = None
        self.members[key] = None

    def _adapt(self, key: int) -> None:
        """A ghost hit adapts the target first (vLLM: on_store_miss, then insert)."""
        if key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            del self.b1[key]
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]

    def insert_all(self, keys: list[int]) -> None:
        """insert() of each key, in order, in bulk: only ghost hits change the target
        (in their order), and inserting others changes no ghost list."""
        if not (self.b1.keys().isdisjoint(keys) and self.b2.keys().isdisjoint(keys)):
            ghosts = (self.b1.keys() | self.b2.keys()) & set(keys)
            for key in filter(ghosts.__contains__, keys):
                self._adapt(key)
        new = dict.fromkeys(keys)
        self.t1.update(new)
        self.members.update(new)

    def use_all(self, keys: list[int]) -> None:
        """insert() of each key not held, touch() of the others, in order, in bulk:
        touches move keys to T2's recent end, inserts to T1's, and neither reads the other."""
        members, t1 = self.members, self.t1
        held = list(filter(members.__contains__, keys))
        if not held:
            self.insert_all(keys)
            return
        # split before anything moves: a held key not in T1 is in T2
        in_t1 = list(filter(t1.__contains__, held))
        in_t2 = [] if len(in_t1) == len(held) else list(filterfalse(t1.__contains__, held))
        if len(held) < len(keys):
            self.insert_all(list(filterfalse(members.__contains__, keys)))
        deque(map(t1.pop, in_t1), maxlen=0)
        deque(map(self.t2.pop, in_t2), maxlen=0)
        self.t2.update(dict.fromkeys(held))

    def touch(self, key: int) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2[key] = self.t2.pop(key)

    def victims(self, n: int, protected: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
        """The next `n` keys to evict, or None if fewer can go: vLLM's batch `evict`,
        which counts T1 down as it chooses and scans each list once."""
        # while |T1| >= the target T1 gives its oldest, then T2: in one slice each when
        # no protected key is among them (the usual case)
        k1 = min(max(n, 0), max(0, len(self.t1) - int(self.target_t1) + 1))
        a, b = list(islice(self.t1, k1)), list(islice(self.t2, max(n - k1, 0)))
        if len(a) + len(b) == max(n, 0) and protected.isdisjoint(a) and protected.isdisjoint(b):
            return a + b

        def idle(part):
            return (k for k in part if k not in protected)

        t1, t2 = idle(self.t1), idle(self.t2)
        out, size = [], len(self.t1)
        for _ in range(n):
            key = next(t1, None) if size >= int(self.target_t1) else None
            if key is None:
                key = next(t2, None)
                if key is None:
                    key = next(t1, None)
                    if key is None:
                        return None
            if key in self.t1:
                size -= 1
            out.append(key)
        return out

    def evict(self, key: int) -> None:
        if key in self.t1:
            del self.t1[key]
            ghosts = self.b1
        else:
            del self.t2[key]
            ghosts = self.b2
        del self.members[key]
        ghosts[key] = None
        if len(ghosts) > self.capacity:
            del ghosts[next(iter(ghosts))]

    def evict_all(self, keys: list[int]) -> None:
        """evict() of each key, in bulk."""
        in_t1 = list(filter(self.t1.__contains__, keys))  # every key is held: the rest in T2
        in_t2 = [] if len(in_t1) == len(keys) else list(filterfalse(self.t1.__contains__, keys))
        for part, ghosts, mine in ((self.t1, self.b1, in_t1), (self.t2, self.b2, in_t2)):
            deque(map(part.pop, mine), maxlen=0)
            deque(map(self.members.pop, mine), maxlen=0)
            ghosts.update(dict.fromkeys(mine))
            excess = list(islice(ghosts, max(len(ghosts) - self.capacity, 0)))
            deque(map(ghosts.pop, excess), maxlen=0)


POLICIES: dict[str, Callable[[int], TierPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
