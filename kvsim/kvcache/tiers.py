"""KV tiers behind the GPU: host memory (cpu) and local disk holding KV chunks the
GPU's prefix cache stored, loaded back when a later prompt starts with them.

A plain synchronous object, like the allocators: no clock. The GPU prefix cache
(kvsim.kvcache.prefix) offers it chunks and asks it for the ones it lacks; a load
returns the seconds it takes, which the step that computes the request waits for.

A chunk is `chunk_tokens` consecutive tokens (a multiple of the GPU block size), named
by its content and everything before it (`ChunkNames`), so equal names mean equal
prefixes, as vLLM's chained block hashes do. Only whole chunks are stored (vLLM's
offloading connector stores complete chunks, `storable_chunks`; LMCache's default
`save_unfull_chunk: false`).

The rules, from named releases:
- Write-through to every tier: a chunk offered is stored in host memory and, from
  there, on disk (vLLM 0.33.0 vllm/v1/kv_offload/tiering/manager.py: "always offload
  to all tiers ... cascaded to ALL secondary tiers"; LMCache 0.5.6
  lmcache/v1/storage_backend/storage_manager.py `batched_put` puts into every
  backend). A chunk already held is not written again: it counts as a reuse (vLLM's
  `prepare_store` records ready existing chunks as reused). A request's chunks are
  stored and reused deepest first, so its head is the most recent and its tail goes
  first (vLLM's LRU ranks a request's chunks "so tails precede heads"; its `touch`
  walks them reversed).
- Each tier evicts by its policy (kvsim.kvcache.tier_policies: vLLM's `lru` or
  `arc` for host memory; LRU on disk, LMCache's `cache_policy` default). A full tier
  evicts only what no transfer in progress uses (vLLM's `protected`).
- Lookup walks the chunks in prefix order, host memory first, then disk, and stops at
  the first chunk neither holds (vLLM's tiering manager looks tiers up in order; LMCache
  searches its backends in order, local CPU first).
- A hit in host memory is copied to the GPU over the host link; a hit on disk is first
  read into host memory (it stays there, where the host tier can make room for all of
  a load's disk hits: vLLM's staged promotion, "chunks in secondary tiers must be
  promoted to the primary tier before GPU can access them", a store into host memory,
  all or nothing; LMCache's `get` puts a disk hit into LocalCPUBackend), then copied. A load's time is bytes over
  the host link, plus the disk's bytes over the disk's bandwidth, read before they are
  copied. Stores cost no step time: they run on their own stream while the GPU computes
  (vLLM's store jobs; SGLang's write stream), over the other direction of a full-duplex
  link.
- Shared by a fleet (`kv_offload: {shared: true}`: one store for every replica, as
  Mooncake Store or LMCache's remote backend), a load also crosses the network: the
  host-link figure is then the slower of the network and the host link.

Not modelled: chunks being stored are readable at once (vLLM reports them
HIT_PENDING until their store completes); vLLM's `store_threshold` (a chunk stored only
after it was offered N times; 0, off, by default); disk writes limited by the disk's
bandwidth.

Invariants (`check_invariants`): each tier holds at most its capacity in chunks, its
counts match its policy's keys, and every chunk a tier holds has a name the namer still
knows, so a hit is always of content some tier holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import filterfalse, islice, takewhile

from kvsim.kvcache.base import InvariantError, SeqShape
from kvsim.kvcache.naming import ContentNames
from kvsim.kvcache.tier_policies import POLICIES

NAMES_SLACK = 8  # names made between two prunings: at least this many per chunk held
MIN_NAMES = 1 << 16
SHAPES_KEPT = 256  # shapes whose names are kept for lookups


@dataclass(frozen=True)
class TierSpec:
    """One tier: its capacity in chunks, its replacement policy
    (kvsim.kvcache.tier_policies), and the bandwidth a load reads it with before the
    copy into the GPU (bytes/s; None for host memory, which the copy reads directly)."""

    name: str
    capacity_chunks: int
    policy: str = "lru"
    read_bytes_s: float | None = None


class Tier:
    """The chunks one tier holds, in its policy's order, and what moved in and out."""

    def __init__(self, spec: TierSpec):
        if spec.policy not in POLICIES:
            raise ValueError(f"unknown tier policy {spec.policy!r}; valid: {', '.join(sorted(POLICIES))}")
        self.spec = spec
        self.held = POLICIES[spec.policy](spec.capacity_chunks)
        self.written = 0  # chunks stored into it
        self.read = 0  # chunks loaded out of it
        self.evicted = 0

    def __contains__(self, name: int) -> bool:
        return name in self.held

    def __len__(self) -> int:
        return len(self.held)

    def put(self, names: list[int], protected: set[int]) -> list[int]:
        """Store those of `names` it lacks, all or none (vLLM's `prepare_store` returns
        None when it cannot evict enough), evicting by the policy but never a protected
        chunk; reuses those it holds. Returns the chunks written. `names` in prefix
        order; they enter deepest first, so the head is the most recent."""
        members = self.held.members
        new = names if members.keys().isdisjoint(names) else list(filterfalse(members.__contains__, names))
        short = len(self.held) + len(new) - self.spec.capacity_chunks
        victims = self.held.victims(short, protected) if new else []
        if victims is None:
            new = []  # cannot make room: stores nothing
        elif new:
            self.held.evict_all(victims)
            self.evicted += len(victims)
        if len(new) == len(names):  # the usual case: every chunk is new
            self.held.insert_all(new[::-1])
        elif new:
            self.held.use_all(names[::-1])
        else:  # nothing stored: those held are reused all the same
            self.held.use_all(list(filter(members.__contains__, reversed(names))))
        self.written += len(new)
        return new


class ChunkNames(ContentNames):
    """Ints naming chunk contents (kvsim.kvcache.naming, the GPU prefix cache's scheme),
    so that equal names mean equal prefixes in every replica that shares the namer, with
    each name's parent recorded, for pruning.

    Names take memory in proportion to what the tiers hold: once more names were made
    than NAMES_SLACK per chunk held since the last pruning, the ones no tier holds (and
    that no held name hangs below) are forgotten; content seen again then gets a new
    name, and since nothing holds the old one, nothing can tell."""

    def __init__(self, chunk_tokens: int):
        super().__init__(chunk_tokens)
        self.chunk_tokens = chunk_tokens
        self._parent: dict[int, int] = {}  # name -> the name before it (-1: none)
        self._shapes: OrderedDict[SeqShape, list[int]] = OrderedDict()
        self._prune_after = MIN_NAMES

    def of(self, shape: SeqShape) -> list[int]:
        """Names of the shape's whole chunks, up to the first holding content -1."""
        names = self._shapes.pop(shape, None)
        if names is None:
            names = self.walk(shape, shape.final_tokens // self.chunk_tokens)[0]
        self._shapes[shape] = names
        if len(self._shapes) > SHAPES_KEPT:
            del self._shapes[next(iter(self._shapes))]
        return names

    def fresh(self, n: int, parent: int) -> range:
        names = super().fresh(n, parent)
        self._parent.update(zip(names, [parent, *names[:-1]]))
        return names

    def known(self, name: int) -> bool:
        return name in self._parent

    def due(self) -> bool:
        """Whether enough names were made since the last pruning to prune again."""
        return self.next >= self._prune_after

    def prune(self, held: set[int]) -> None:
        """Forget names unless a tier holds them or a held one hangs below them."""
        keep, stack = set(), list(held)
        while stack:
            name = stack.pop()
            if name >= 0 and name not in keep:
                keep.add(name)
                stack.append(self._parent[name])
        self._parent = {n: self._parent[n] for n in keep}  # lookups only: the order is free
        self.ids = {i: n for i, n in self.ids.items() if n in keep}
        runs = {}
        for ident, run in self.runs.items():
            kept = list(map(keep.__contains__, reversed(run)))
            if True in kept:  # the names before a kept one are kept: its ancestors
                runs[ident] = run[: len(run) - kept.index(True)]
        self.runs = runs
        self._shapes.clear()
        self._prune_after = self.next + max(MIN_NAMES, NAMES_SLACK * len(keep))


class TierStore:
    """The tiers behind one engine's GPU, or behind every replica of a fleet (shared).

    `tiers` in lookup order (host memory, then disk); `link_bytes_s` the bandwidth of a
    copy into the GPU (host link, or the network where the store is shared);
    `chunk_bytes` the KV bytes of one chunk."""

    def __init__(self, tiers: list[TierSpec], chunk_tokens: int, chunk_bytes: float, link_bytes_s: float):
        self.tiers = [Tier(spec) for spec in tiers if spec.capacity_chunks > 0]
        self.chunk_tokens, self.chunk_bytes = chunk_tokens, chunk_bytes
        self.link_bytes_s = link_bytes_s
        self.names = ChunkNames(chunk_tokens)
        self.hit_chunks = [0] * len(self.tiers)  # chunks found in each tier by loads
        self.load_s = 0.0  # seconds spent loading, in all
        self._version = 0  # bumped by every change to what is held
        self._last: tuple[SeqShape | None, int, int, int] = (
            None,
            0,
            -1,
            0,
        )  # the last count: (shape, start, version, count)

    def tier_names(self) -> list[str]:
        return [t.spec.name for t in self.tiers]

    def occupancy(self) -> list[int]:
        """Chunks held, per tier."""
        return [len(t) for t in self.tiers]

    def count(self, shape: SeqShape, start: int) -> int:
        """How many of the shape's chunks from chunk `start` on some tier holds, in prefix
        order, up to the first that none holds (len(find(...)), without the pairs)."""
        last_shape, last_start, version, found = self._last
        if last_shape == shape and last_start == start and version == self._version:
            return found
        names = self.names.of(shape)
        end = start
        while True:  # each tier's run of held names in turn, until none goes further:
            before = end  # the work is the run's length (at C speed), not the prompt's
            for tier in self.tiers:
                end += len(list(takewhile(tier.held.members.__contains__, islice(names, end, None))))
            if end == before:
                break
        found = end - start
        self._last = (shape, start, self._version, found)
        return found

    def find(self, shape: SeqShape, start: int, limit: int | None = None) -> tuple[tuple[int, int], ...]:
        """(name, tier index) of the shape's chunks that `count` counts (at most `limit`),
        each in the first tier holding it (host memory before disk). Changes nothing."""
        n = self.count(shape, start)
        names = self.names.of(shape)[start : start + (n if limit is None else min(n, limit))]
        where: dict[int, int] = {}
        for i in range(len(self.tiers) - 1, -1, -1):  # the first tier holding it wins
            where.update(dict.fromkeys(filter(self.tiers[i].held.members.__contains__, names), i))
        return tuple(zip(names, map(where.__getitem__, names)))

    def load(self, hits: tuple[tuple[int, int], ...], blocks_bytes: float) -> float:
        """Load `hits` (from `find`) into the GPU, of which `blocks_bytes` bytes are copied
        (the chunk the GPU holds part of is copied in part); returns the seconds it takes."""
        if not hits:
            return 0.0
        self._version += 1
        names = [name for name, _ in hits]
        slow = 0.0  # seconds reading chunks off lower tiers
        for i, tier in enumerate(self.tiers):
            mine = [name for name, where in hits if where == i]
            tier.read += len(mine)
            self.hit_chunks[i] += len(mine)
            if mine and tier.spec.read_bytes_s is not None:
                slow += len(mine) * self.chunk_bytes / tier.spec.read_bytes_s
            if i:  # reused where it was found ...
                tier.held.use_all(mine[::-1])
        # ... and in host memory, where a disk hit stays if there is room (the head the
        # most recent, the tail first to go)
        self.tiers[0].put(names, set(names))
        seconds = slow + blocks_bytes / self.link_bytes_s
        self.load_s += seconds
        return seconds

    def store(self, names: list[int]) -> None:
        """Write-through, `names` in prefix order: the top tier stores those it lacks and
        each lower tier those the one above it wrote (vLLM's cascade of new primary
        chunks to the secondary tiers); a tier that holds a chunk reuses it."""
        if not names:
            return
        self._version += 1
        # each tier writes what the one above it wrote (the top: what it lacks), evicting
        # none of the batch (a load of some of them may follow: kvsim.kvcache.tiered)
        protected = set(names)
        for tier in self.tiers:
            names = tier.put(names, protected)
            if not names:
                break
        if self.names.due():
            self.names.prune({n for t in self.tiers for n in t.held})

    def check_invariants(self) -> None:
        for tier in self.tiers:
            keys = list(tier.held)
            if len(keys) > tier.spec.capacity_chunks:
                raise InvariantError(
                    f"tier {tier.spec.name} holds {len(keys)} chunks; its capacity is {tier.spec.capacity_chunks}"
                )
            if len(set(keys)) != len(keys) or len(keys) != len(tier):
                raise InvariantError(f"tier {tier.spec.name} holds a chunk twice")
            lost = [k for k in keys if not self.names.known(k)]
            if lost:
                raise InvariantError(
                    f"tier {tier.spec.name} holds chunks {lost[:3]} whose content names were forgotten"
                )


def build_stores(
    *,
    replicas: int,
    shared: bool,
    cpu_bytes: float,
    disk_bytes: float,
    policy: str,
    chunk_tokens: int,
    bytes_per_token: float,
    link_bytes_s: float,
    network_bytes_s: float,
    disk_bytes_s: float,
) -> list[TierStore]:
    """Each replica's store: its own, or (shared) one store holding every replica's
    share of host memory and disk, whose loads cross the network where the fleet has
    more than one replica (a fleet of one reaches its own memory over its host link)."""
    chunk_bytes = chunk_tokens * bytes_per_token
    pooled = replicas if shared else 1

    def store(link: float) -> TierStore:
        specs = [
            TierSpec("cpu", int(cpu_bytes * pooled // chunk_bytes), policy),
            TierSpec("disk", int(disk_bytes * pooled // chunk_bytes), "lru", disk_bytes_s),
        ]
        return TierStore(specs, chunk_tokens, chunk_bytes, link)

    if shared:
        one = store(min(link_bytes_s, network_bytes_s) if replicas > 1 else link_bytes_s)
        return [one] * replicas
    return [store(link_bytes_s) for _ in range(replicas)]


TIER_NAMES = ("cpu", "disk")


def tally(allocators: list) -> dict[str, float]:
    """What the tiers behind `allocators` (one engine's, or a fleet's) did, by tier name:
    tokens found (`hit_tokens_cpu`), bytes written and read, capacity in chunks (in all,
    and of the store one replica sees: `seen_chunks_cpu`, what its occupancy is a share
    of), and the seconds loads took; a store shared by several replicas counted once."""
    out = {
        f"{what}_{t}": 0.0
        for what in ("hit_tokens", "written_bytes", "read_bytes", "capacity_chunks")
        for t in TIER_NAMES
    }
    out["load_s"] = 0.0
    for tier in allocators[0].store.tiers:  # what each replica sees (all see the same size)
        out[f"seen_chunks_{tier.spec.name}"] = float(tier.spec.capacity_chunks)
    stores = {}
    for alloc in allocators:
        stores[id(alloc.store)] = alloc.store
        for tier, tokens in zip(alloc.store.tiers, alloc.tier_hit_tokens):
            out[f"hit_tokens_{tier.spec.name}"] += tokens
        out["load_s"] += alloc.tier_load_s
    for store in stores.values():
        for tier in store.tiers:
            name = tier.spec.name
            out[f"written_bytes_{name}"] += tier.written * store.chunk_bytes
            out[f"read_bytes_{name}"] += tier.read * store.chunk_bytes
            out[f"capacity_chunks_{name}"] += tier.spec.capacity_chunks
    return out
