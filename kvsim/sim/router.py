"""Routers: which replica of a fleet (`replicas: N`) serves each arriving request.

A router sees what a real one sees: the requests it sent and how many of them each
replica has not finished yet (its *load*, in requests; a router counts a request from
sending it to its response). It never reads a replica's KV cache.

- round-robin: request i goes to replica i mod N, whatever the replicas hold.
- least-loaded: the replica with the fewest unfinished requests (the lowest index of
  those tied).
- prefix-aware: SGLang's cache-aware policy (sglang-router 0.2.4,
  src/policies/cache_aware.rs, select_worker; defaults from src/policies/mod.rs,
  CacheAwareConfig). The router keeps an approximate tree per replica of the prompts it
  sent there. When the loads are imbalanced (max - min > 32 and max > 1.1 x min) it
  sends the request to the least-loaded replica; otherwise to the replica whose tree
  holds the longest prefix of the prompt if that prefix is more than half of it
  (cache_threshold 0.5), else to the least-loaded one. Either way the prompt joins the
  chosen replica's tree. SGLang's tree holds text and names the first tenant of the
  deepest matching node; kvsim's holds content runs (kvsim.kvcache.SeqShape) and
  names the lowest index among the replicas with the longest match. Not modelled:
  the tree's periodic LRU trim (max_tree_size 10,000 nodes every 30 s), so the router
  may believe a replica still holds a prefix its cache has since evicted; vLLM's
  production-stack router, which routes by the same idea, is not imitated separately.
  With a KV tier shared by the fleet (`kv_offload: {shared: true}`), the router also
  reads that store's index, as Mooncake's Conductor reads its global cache's: a prefix
  the store holds counts for every replica (each can load it), so a replica is
  preferred only for holding more of the prompt than the store, else the least-loaded
  one serves.
"""

from __future__ import annotations

CACHE_THRESHOLD = 0.5  # sglang-router 0.2.4 CacheAwareConfig defaults
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.1


class RoundRobin:
    def __init__(self, replicas: int):
        self.n, self.sent = replicas, 0

    def pick(self, spec, loads: list[int]) -> int:
        r = self.sent % self.n
        self.sent += 1
        return r


class LeastLoaded:
    def __init__(self, replicas: int):
        self.n = replicas

    def pick(self, spec, loads: list[int]) -> int:
        return loads.index(min(loads))


class PrefixAware:
    """The prompt as content runs; the trees as one map from (the runs before, a run's
    content id) to the longest run of that content each replica was sent there."""

    def __init__(self, replicas: int, shared=None):
        self.n = replicas
        self.seen: dict[tuple, dict[int, int]] = {}
        self.shared = shared  # spec -> prompt tokens a shared KV store holds, or None

    def matched(self, runs) -> list[int]:
        """Tokens of the prompt each replica's tree holds as a prefix."""
        tokens, live = [0] * self.n, set(range(self.n))
        for j, (content, length) in enumerate(runs):
            sent = self.seen.get((runs[:j], content), {})
            for r in list(live):
                held = min(sent.get(r, 0), length)
                tokens[r] += held
                if held < length:
                    live.discard(r)
            if not live:
                break
        return tokens

    def pick(self, spec, loads: list[int]) -> int:
        runs = spec.prompt_runs
        lo, hi = min(loads), max(loads)
        choice = loads.index(lo)
        if not (hi - lo > BALANCE_ABS_THRESHOLD and hi > lo * BALANCE_REL_THRESHOLD) and spec.prompt_tokens:
            tokens = self.matched(runs)
            best = tokens.index(max(tokens))
            everywhere = self.shared(spec) if self.shared else 0
            if tokens[best] / spec.prompt_tokens > CACHE_THRESHOLD and tokens[best] > everywhere:
                choice = best
        for j, (content, length) in enumerate(runs):
            sent = self.seen.setdefault((runs[:j], content), {})
            sent[choice] = max(sent.get(choice, 0), length)
        return choice


ROUTERS = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "prefix-aware": PrefixAware,
}


def make_router(name: str, replicas: int, shared=None):
    """shared: where the fleet shares a KV store, what of a prompt it holds (spec -> tokens),
    for the prefix-aware router."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; valid: {', '.join(ROUTERS)}")
    return PrefixAware(replicas, shared) if name == "prefix-aware" else ROUTERS[name](replicas)
