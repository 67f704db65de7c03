"""How fast `kvsim cache-curve` computes: block references per second, per policy, with
every capacity of the default grid in each pass.

A block reference is one full cache block of one prompt (Mooncake's synthetic trace:
3.8M of 16 tokens). Reading the trace is timed apart; the rest (the prompts' block
references and their merging into items, then each policy) is what the rate counts.
Workloads:
  mooncake      Mooncake's synthetic trace (kvcache-ai/Mooncake FAST25-release), when the
                reference data is beside the checkout (--trace FILE for another)
  chains        generated: 4,000 prompts of 30 hash blocks walking a random tree, like
                Mooncake's traces (always available)
  conversation  generated: conversations whose every turn adds one hash block to the
                last, so no two neighbouring blocks share their users and merging saves
                nothing (the worst case for the item count)
The machine is shared and noisy: read the medians of --repeats runs (the spread, fastest
to slowest run, is printed beside them). --write also writes them to
benchmarks/CACHE_CURVE_RESULTS.md (never edited by hand).

    python benchmarks/bench_cache_curve.py [--repeats 5] [--block-size 16] [--trace FILE] [--write]
"""

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvsim.analysis.block_refs import block_references
from kvsim.analysis.cache_curve import POLICIES, cache_curve, distinct_tokens
from kvsim.cli.cache_curve import default_capacities
from kvsim.workload.requests import RequestSpec
from kvsim.workload.traces import trace_requests

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
TARGET = 1e6  # block references per second
RESULTS = ROOT / "benchmarks" / "CACHE_CURVE_RESULTS.md"


def chains(n: int = 4000, depth: int = 30, seed: int = 0) -> list[RequestSpec]:
    rng, children, specs, fresh = random.Random(seed), {}, [], itertools.count(n)
    for i in range(n):
        node, runs = None, []
        for _ in range(depth):
            kids = children.setdefault(node, [])
            if kids and rng.random() < 0.6:
                node = rng.choice(kids)
            else:
                node = next(fresh)
                kids.append(node)
            runs.append((node, 512))
        specs.append(RequestSpec(i, float(i), 512 * depth, 1, tuple(runs), -1))
    return specs


def conversation(turns: int = 40, talks: int = 150) -> list[RequestSpec]:
    specs = []
    for t in range(turns):  # turn t of every conversation, then turn t + 1
        for c in range(talks):
            runs = tuple((10_000 + c * turns + k, 512) for k in range(t + 1))
            specs.append(RequestSpec(len(specs), float(len(specs)), 512 * (t + 1), 1, runs, -1))
    return specs


def measure(name: str, requests, block: int, repeats: int) -> list[str]:
    """Times the workload; prints and returns its lines of the report."""
    prep, per_policy = [], {p: [] for p in POLICIES}
    for _ in range(repeats):
        t0 = time.perf_counter()
        refs = block_references(requests, block)
        prep.append(time.perf_counter() - t0)
        caps = default_capacities(distinct_tokens(refs))
        for policy in POLICIES:
            t0 = time.perf_counter()
            cache_curve(refs, caps, [policy])
            per_policy[policy].append(time.perf_counter() - t0)
    blocks, refs_prep = refs.blocks, statistics.median(prep)
    lines = [
        f"{name}: {refs.num_requests:,} requests, {blocks:,} block references of {block} tokens, "
        f"{len(refs.item):,} items, {len(caps)} capacities",
        f"  block references and items: {refs_prep:.3f} s ({blocks / refs_prep / 1e6:.1f}M/s; "
        f"runs {min(prep):.3f}-{max(prep):.3f} s)",
    ]
    for policy, times in per_policy.items():
        t = statistics.median(times)
        rate = blocks / (refs_prep + t)
        flag = "" if rate >= TARGET else f"  BELOW {TARGET / 1e6:g}M/s"
        lines.append(
            f"  {policy:7s} {t:.3f} s (runs {min(times):.3f}-{max(times):.3f} s); with the references "
            f"{rate / 1e6:.1f}M block references per second{flag}"
        )
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--trace", type=Path, default=MOONCAKE)
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    lines = []
    if args.trace.is_file():
        t0 = time.perf_counter()
        requests = list(trace_requests(args.trace))
        print(f"reading {args.trace.name}: {time.perf_counter() - t0:.2f} s (not counted below)")
        lines += measure(args.trace.stem, requests, args.block_size, args.repeats)
    else:
        print(f"no {args.trace}: the generated workloads only")
    lines += measure("chains", chains(), args.block_size, args.repeats)
    lines += measure("conversation", conversation(), args.block_size, args.repeats)
    if args.write:
        load_after = os.getloadavg()
        command = " ".join(["python", "benchmarks/bench_cache_curve.py", *sys.argv[1:]])
        head = [
            "# kvsim cache-curve: block references per second",
            "",
            f"Written by `{command}` on {started} (load average {load_before[0]:.1f} before, "
            f"{load_after[0]:.1f} after; {os.cpu_count()} CPUs). Medians of {args.repeats} runs; the "
            f"target is {TARGET / 1e6:g}M block references per second, the references and items "
            "included, every capacity of the default grid in one pass per policy.",
            "",
            "```",
        ]
        RESULTS.write_text("\n".join(head + lines + ["```", ""]))


if __name__ == "__main__":
    main()
