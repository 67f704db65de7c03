"""Mooncake's published prefix-cache figures (Qin et al., "Mooncake: Trading More Storage
for Less Computation", FAST 2025), measured by kvsim's cache curve on the trace Mooncake
released with them (kvcache-ai/Mooncake FAST25-release/traces/synthetic_trace.jsonl).

Only the synthetic trace is measured: Mooncake's conversation and tool&agent traces are
held out to check kvsim's predictions, so their rows say "not measured". Without the
synthetic trace in the traces folder (`kvsim reproduce --traces DIR`) both rows say so.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from kvsim.reproduce.claims import Claim, Context

SOURCE = "Mooncake (Qin et al., FAST 2025)"
NAMES = ("synthetic_trace.jsonl", "mooncake_synthetic_trace.jsonl")   # Mooncake's name, or with a prefix
BLOCK = 16                # vLLM's default block size
POINTS_TOL = 0.03         # a share "holds" within ±3 percentage points
LOCAL, LARGE = 3e6, 50e6  # Fig. 9's local cache and the size said to reach nearly all


def _trace(ctx: Context):
    folder = ctx.traces
    return next((folder / n for n in NAMES if folder is not None and (folder / n).is_file()), None)


@lru_cache(maxsize=4)
def _curve(path: Path, block: int = BLOCK):
    """The synthetic trace's cache curve at Fig. 9's sizes and a grid around them."""
    from kvsim.analysis.block_refs import block_references
    from kvsim.analysis.cache_curve import cache_curve
    from kvsim.workload.traces import trace_requests
    sizes = sorted({1e5, 3e5, 1e6, LOCAL, 1e7, 3e7, LARGE, 1e8, math.inf})
    return cache_curve(block_references(trace_requests(path), block), sizes)


def _hit(table, policy: str, capacity: float) -> float:
    rows = table[(table.policy == policy) & (table.capacity_tokens == capacity)]
    return float(rows.hit_rate.iloc[0])


def _absent(ctx: Context) -> str:
    return (f"not measured: no {NAMES[0]} in {ctx.traces}" if ctx.traces else
            f"not measured: no traces folder given (kvsim reproduce --traces DIR with {NAMES[0]})")


def table2(ctx: Context) -> list[Claim]:
    claim = ("Prefix cache ratio (share of prompt tokens an unlimited cache finds): conversation 40%, "
             "tool&agent 59%, synthetic 66%")
    expected = f"synthetic 66% ± {100 * POINTS_TOL:.0f} points"
    held_out = "conversation and tool&agent not measured (those traces are held out to check kvsim)"
    path = _trace(ctx)
    if path is None:
        return [Claim("10", claim, f"{SOURCE}, Table 2", "Mooncake synthetic trace", f"{_absent(ctx)}; {held_out}",
                      expected, "not measured")]
    table = _curve(path)
    unlimited = _hit(table, "lru", math.inf)
    whole = _hit(_curve(path, 512), "lru", math.inf)      # the trace's own blocks
    verdict = ("holds for synthetic" if abs(unlimited - 0.66) <= POINTS_TOL else
               "does not hold for synthetic") + "; conversation and tool&agent not measured"
    return [Claim("10", claim, f"{SOURCE}, Table 2", f"kvsim cache-curve {path.name} (blocks of {BLOCK})",
                  f"synthetic {unlimited:.1%}; {held_out}", expected, verdict,
                  f"An unlimited cache finds every full {BLOCK}-token block whose hash chain appeared in an "
                  f"earlier prompt: {unlimited:.2%} of the trace's prompt tokens, {66 - 100 * unlimited:.1f} "
                  f"points under the paper's 66%; with the trace's own 512-token blocks (a partly filled last "
                  f"block never cached) {whole:.2%}. The paper does not say how it counts.")]


def fig9(ctx: Context) -> list[Claim]:
    claim = (f"A {LOCAL / 1e6:.0f}M-token local cache reaches under half of the unlimited hit rate on most "
             f"workloads; about {LARGE / 1e6:.0f}M tokens reach nearly all of it")
    expected = f"{LOCAL / 1e6:.0f}M: < 50% of unlimited; {LARGE / 1e6:.0f}M: >= 95% of unlimited"
    path = _trace(ctx)
    if path is None:
        return [Claim("11", claim, f"{SOURCE}, Fig. 9", "Mooncake synthetic trace", _absent(ctx), expected,
                      "not measured")]
    table = _curve(path)
    unlimited = _hit(table, "lru", math.inf)
    share = {c: _hit(table, "lru", c) / unlimited for c in (LOCAL, LARGE)}
    best = _hit(table, "belady", LOCAL) / unlimited
    holds = share[LOCAL] < 0.5 and share[LARGE] >= 0.95
    _figure(ctx, table)
    return [Claim("11", claim, f"{SOURCE}, Fig. 9", f"kvsim cache-curve {path.name} (LRU, blocks of {BLOCK})",
                  f"synthetic: {LOCAL / 1e6:.0f}M {_hit(table, 'lru', LOCAL):.1%} = {share[LOCAL]:.0%} of unlimited "
                  f"({unlimited:.1%}); {LARGE / 1e6:.0f}M {share[LARGE]:.0%} of unlimited",
                  expected, ("holds" if holds else "does not hold") + " on synthetic (the other traces are held out)",
                  f"With LRU, a cache of {LOCAL / 1e6:.0f}M tokens keeps {share[LOCAL]:.0%} of what an unlimited one "
                  f"finds (just under half): the rest of the trace's reuse comes back after more than "
                  f"{LOCAL / 1e6:.0f}M tokens of other prompts. Belady's MIN, knowing the future, keeps "
                  f"{best:.0%} at the same size, so the shortfall is LRU's as much as the size's.")]


def _figure(ctx: Context, table) -> None:
    from kvsim.plots.cache_curve import cache_curve_figure
    ctx.save("11", cache_curve_figure(table, f"Mooncake synthetic trace, blocks of {BLOCK} tokens"),
             "claim11_cache_curve.png")
    ctx.tables.append(("claims 10-11: the Mooncake synthetic trace's cache curve", table))
