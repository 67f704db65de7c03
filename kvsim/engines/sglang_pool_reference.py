"""SGLang's token-to-KV pool allocator under its radix cache (SGLang 0.5.23,
python/sglang/srt/mem_cache/allocator/token.py TokenToKVPoolAllocator, allocator/paged.py
PagedTokenToKVPoolAllocator, allocation.py, radix_cache.py, common.py), driven beside
kvsim's radix pool (kvsim.kvcache.radix.RadixCacheAllocator) request by request.

Both run on CPU: SGLang's allocators hold their free slots (pages) in a torch tensor and,
without Triton, hand them out with alloc_extend_naive and alloc_decode_naive. Each
request's life is given to both, as SGLang's scheduler drives it:
- admit: the longest cached prefix of its first n - 1 tokens, in whole pages
  (RadixCache.match_prefix), locked; the rest allocated, SGLang evicting first what its
  demand needs beyond the free slots (alloc_token_slots for pages of 1 token, the exact
  count; alloc_paged_token_slots_extend for larger pages, the tokens plus a page);
- checkpoint: after its prefill the prompt enters the tree (RadixCache.checkpoint, which
  frees the request's copies of what the tree had, splits the leaf at the prompt and moves
  the lock);
- decode: one slot more (alloc_token_slots(1), or alloc_paged_token_slots_decode, which
  evicts a page's worth first);
- finish: release_kv_cache with checkpoint (every token it holds inserted, whole pages; the
  rest of its row freed, its lock dropped);
- retract: release_kv_cache without checkpoint (its row beyond the tree's part freed);
- evict: evict_to_free_tokens.
Before an admission both look its prefix up, as the scheduler does for a waiting request
(refreshing the path and splitting the edge it ends inside); a request kvsim refuses
must be one SGLang's allocator could not serve either (its pages beyond the free and
unlocked evictable slots), and SGLang is then not asked, as its scheduler would not ask. After every operation both must hold the same free slots, evictable and
cached slots, and each request the same number of slots.

Which slots: kvsim counts slots and does not name them, so the slots SGLang hands out
(its free list: freed token slots appended, freed pages put first) are not compared.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvsim.engines.sglang_reference import ids_of, load_sglang


@dataclass
class _KV:
    """The part of SGLang's request record (Req.kv) its tree and frees read."""

    req_pool_idx: int
    cache_protected_len: int = 0  # the row's first tokens the tree owns
    cache_inserted_len: int = 0
    swa_evict_floor: int = 0

    def get_evicted_seqlen(self, component) -> int:
        return 0  # no sliding window

    def swa_dead_lo(self, page_size: int) -> int:
        return 0


@dataclass
class _Req:
    """A request as RadixCache.checkpoint reads it."""

    kv: _KV
    origin_input_ids: array
    ids: list[int]  # prompt and output token ids
    held: int = 0  # row positions filled (KV slots it holds)
    lock: object = None
    last_node: object = None
    extra_key: object = None
    cache_salt: object = None
    priority: int | None = None
    output_ids: list = field(default_factory=list)

    @property
    def full_untruncated_fill_ids(self) -> array:
        return array("q", self.ids[: self.held])


class SGLangPool:
    """SGLang's allocator (token or paged) and radix cache, with kvsim's pool's operations."""

    def __init__(self, capacity: int, page_size: int, *, rows: int = 64, context: int = 512):
        import torch

        self.sg = load_sglang()
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.torch, self.allocation, self.page = torch, allocation, page_size
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(capacity, torch.int64, "cpu", None, False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(capacity, page_size, torch.int64, "cpu", None, False)
        self.rows = ReqToTokenPool(rows, context, "cpu", False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator, page_size=page_size
        )
        self.tree = self.sg.RadixCache(params)
        self.reqs: dict[int, _Req] = {}

    def _t(self, *values: int):
        return self.torch.tensor(values, dtype=self.torch.int64)

    def _row(self, req: _Req):
        return self.rows.req_to_token[req.kv.req_pool_idx]

    def admit(self, seq: int, ids: list[int], prompt: int, n: int) -> None:
        match = self.tree.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(array("q", ids[: n - 1]))))
        cached = match.device_prefix_len
        prefix = self.tree.path_device_indices(match.last_device_node)[:cached]
        req = _Req(_KV(self.rows.free_slots.pop(0), cached, cached), array("q", ids[:prompt]), ids)
        req.lock, req.last_node = self.tree.lock(match.last_device_node), match.last_device_node
        if self.page == 1:
            out = self.allocation.alloc_token_slots(self.tree, n - cached)
        else:
            last = int(prefix[-1]) if cached else -1
            out = self.allocation.alloc_paged_token_slots_extend(
                self.tree, self._t(cached), self._t(cached), self._t(n), self._t(n), self._t(last), n - cached
            )
        self.rows.write((req.kv.req_pool_idx, slice(0, n)), self.torch.cat([prefix.to(self.torch.int64), out]))
        req.held = n
        self.reqs[seq] = req

    def fits(self, seq: int | None, ids: list[int], n: int) -> bool:
        """Whether the allocator could serve the admission (seq None) or the decode."""
        if seq is None:
            match = self.tree.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(array("q", ids[: n - 1]))))
            lock = self.tree.lock(match.last_device_node)
            need = -(-n // self.page) * self.page - match.device_prefix_len
        else:
            lock, held = None, self.reqs[seq].held
            need = self.page if held % self.page == 0 else 0
        room = self.allocator.available_size() + self.tree.evictable_size()
        self.tree.unlock(lock)
        return need <= room

    def checkpoint(self, seq: int, upto: int) -> None:
        self.tree.checkpoint(self.reqs[seq], up_to=upto)

    def decode(self, seq: int) -> None:
        req = self.reqs[seq]
        if self.page == 1:
            out = self.allocation.alloc_token_slots(self.tree, 1)
        else:
            last = int(self._row(req)[req.held - 1])
            out = self.allocation.alloc_paged_token_slots_decode(
                self.tree, self._t(req.held + 1), self._t(req.held + 1), self._t(last)
            )
        self.rows.write((req.kv.req_pool_idx, slice(req.held, req.held + 1)), out)
        req.held += 1

    def release(self, seq: int, checkpoint: bool) -> None:
        """release_kv_cache: with checkpoint, what it holds goes into the tree first."""
        req = self.reqs.pop(seq)
        if checkpoint:
            self.tree.checkpoint(req, up_to=req.held)
        self.tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.held)])
        self.tree.unlock(req.lock)
        self.rows.free_slots.append(req.kv.req_pool_idx)

    def evict(self, slots: int) -> None:
        self.allocator.evict_to_free_tokens(self.tree, slots)

    def state(self) -> tuple[int, int, int]:
        """(free slots, evictable slots, cached slots)."""
        return self.allocator.available_size(), self.tree.evictable_size(), self.tree.total_size()


def pool_differential(seed: int, page_size: int, ops: int = 200) -> tuple[dict[str, int], list[str]]:
    """Random request lives on kvsim's radix pool and SGLang's allocator and tree: the
    operations of each kind done, and the disagreements found (none where they agree)."""
    import numpy as np
    from kvsim.kvcache import SeqShape
    from kvsim.kvcache.radix import RadixCacheAllocator

    rng = np.random.default_rng(seed)
    capacity = page_size * int(rng.integers(24, 64) if page_size > 1 else rng.integers(60, 200))
    ours, theirs = RadixCacheAllocator(capacity, page_size), SGLangPool(capacity, page_size)
    shapes = [
        SeqShape(
            int(rng.integers(4, 40)),
            int(rng.integers(1, 24)),
            tuple((int(rng.integers(0, 4)), int(rng.integers(1, 16))) for _ in range(int(rng.integers(0, 3)))),
            tail_id=100 + i,
        )
        for i in range(10)
    ]
    live: dict[int, SeqShape] = {}  # running requests: their shapes
    counts = {k: 0 for k in ("admit", "refused", "checkpoint", "decode", "finish", "retract", "evict")}
    found: list[str] = []
    for step in range(ops):
        op = rng.choice(["admit", "decode", "finish", "retract", "evict"], p=[0.3, 0.4, 0.12, 0.08, 0.1])
        seq = int(rng.choice(list(live))) if live else None
        if op == "admit" or seq is None:
            op, seq = "admit", 1000 + step
            shape = shapes[int(rng.integers(len(shapes)))]
            ids = ids_of(shape.runs(0, shape.final_tokens))  # its prompt's and output's token ids
            ours.match_prefix(shape, shape.prompt_tokens)  # the scheduler's lookup, admitted or not
            ok = ours.allocate(seq, shape, shape.prompt_tokens)
            if ok != theirs.fits(None, ids, shape.prompt_tokens):
                found.append(f"seed {seed} step {step} admit: kvsim {'fits' if ok else 'refuses'}, SGLang not")
                break
            if not ok:
                counts["refused"] += 1
                continue
            theirs.admit(seq, ids, shape.prompt_tokens, shape.prompt_tokens)
            ours.cache_prefilled(seq, shape.prompt_tokens)
            theirs.checkpoint(seq, shape.prompt_tokens)
            live[seq] = shape
            counts["checkpoint"] += 1
        elif op == "decode":
            tokens = ours.tokens_of(seq) or 0  # a live request's: never None
            if tokens >= live[seq].final_tokens - 1:
                op = "finish"
            else:
                ours.evict_to_free(ours.slots_to_grow(seq, tokens + 1))  # check_decode_mem
                if page_size > 1:
                    ours.evict_to_free(page_size)  # the decode's allocation, as the SGLang rules evict
                ok = ours.grow(seq, tokens + 1)
                if ok != theirs.fits(seq, [], 0):
                    found.append(f"seed {seed} step {step} decode: kvsim {'fits' if ok else 'refuses'}, SGLang not")
                    break
                if not ok:
                    op = "retract"
                else:
                    theirs.decode(seq)
        if op == "finish":
            ours.free(seq)
            theirs.release(seq, checkpoint=True)
            del live[seq]
        elif op == "retract":
            ours.drop(seq)
            theirs.release(seq, checkpoint=False)
            del live[seq]
        elif op == "evict":
            amount = int(rng.integers(1, 3 * page_size + 8))
            ours.evict_to_free(ours.free_slots + amount)
            theirs.evict(theirs.allocator.available_size() + amount)
        counts[op] += 1
        a = (ours.free_slots, ours.evictable_slots, ours.cached_slots)
        b = theirs.state()
        if a != b:
            found.append(f"seed {seed} step {step} {op}: kvsim (free, evictable, cached) {a}, SGLang {b}")
        held = {s: (ours.tokens_of(s), theirs.reqs[s].held) for s in live}
        if any(x != y for x, y in held.values()):
            found.append(f"seed {seed} step {step} {op}: tokens held differ {held}")
        if found:
            break
    return counts, found


RUNS = ((1, range(100)), (4, range(100)))  # (page size, seeds): what the test and the script run


def run_all() -> tuple[dict[str, int], list[str]]:
    """Every run of RUNS: the operations done by kind (and "runs"), and the disagreements."""
    total: dict[str, int] = {"runs": 0}
    found: list[str] = []
    for page, seeds in RUNS:
        for seed in seeds:
            counts, bad = pool_differential(seed, page)
            total["runs"] += 1
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
            found += bad
    return total, found
