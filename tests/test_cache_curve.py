"""Cache curves (kvsim.analysis.block_refs, kvsim.analysis.cache_curve, `kvsim cache-curve`).

Each policy is checked against a plain block-by-block cache written here: LRU exactly on
the given Mooncake trace (skipped when the reference data is absent), all three on
random prefix trees; Belady never below LRU, every curve monotone in capacity."""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import kvsim, one_error_line
from kvsim.analysis.block_refs import block_references
from kvsim.analysis.cache_curve import POLICIES, cache_curve, distinct_tokens
from kvsim.workload.requests import RequestSpec
from kvsim.workload.traces import trace_requests

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="no Mooncake synthetic trace")


# ------------------------------------------------------------------ plain caches, block by block
# Each request: hits are its longest cached prefix; then all its blocks are offered, and
# the cache keeps what the policy ranks highest (LRU: the request's blocks on top, its
# first block topmost).


def plain_lru(prompts: list[list], capacity: int) -> int:
    cache, hits = collections.OrderedDict(), 0
    for keys in prompts:
        for key in keys:
            if key not in cache:
                break
            hits += 1
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def plain_ranked(prompts: list[list], capacity: int, rank) -> int:
    """Keep the `capacity` highest of (cached + offered) blocks by rank(request, depth, key)."""
    cache, hits = {}, 0
    for r, keys in enumerate(prompts):
        for key in keys:
            if key not in cache:
                break
            hits += 1
        for depth, key in enumerate(keys):
            cache[key] = rank(r, depth, key)
        cache = dict(sorted(cache.items(), key=lambda kv: kv[1], reverse=True)[:capacity])
    return hits


def plain_belady(prompts, capacity):
    nxt, later = {}, {}
    for r in range(len(prompts) - 1, -1, -1):
        for key in prompts[r]:
            nxt[r, key] = later.get(key, math.inf)
            later[key] = r
    return plain_ranked(prompts, capacity, lambda r, depth, key: (-nxt[r, key], -depth))


def plain_lfu(prompts, capacity):
    uses = collections.Counter()

    def rank(r, depth, key):
        uses[key] += 1
        return (uses[key], r, -depth)

    return plain_ranked(prompts, capacity, rank)


PLAIN = {"lru": plain_lru, "lfu": plain_lfu, "belady": plain_belady}


# ------------------------------------------------------------------ traces as prompts


def random_trace(rng: random.Random, n: int, block: int) -> tuple[list[RequestSpec], list[list]]:
    """Prompts that walk a random tree of hash blocks (a Mooncake trace in miniature), as
    RequestSpecs and as the lists of block keys a plain cache sees: (hash id, block)."""
    children: dict[int | None, list[int]] = {}
    specs, prompts = [], []
    for i in range(n):
        node, runs, keys = None, [], []
        for _ in range(rng.randint(1, 5)):
            kids = children.setdefault(node, [])
            if kids and rng.random() < 0.75:
                node = rng.choice(kids)
            else:
                node = 1000 + sum(map(len, children.values()))
                kids.append(node)
            runs.append(node)
        tokens = [4 * block] * len(runs)
        tokens[-1] = rng.randint(1, 4 * block)  # a partly filled last hash block
        for h, t in zip(runs, tokens):
            keys += [(h, j) for j in range(t // block)]
        specs.append(RequestSpec(i, float(i), sum(tokens), 1, tuple(zip(runs, tokens)), -1))
        prompts.append(keys)
    return specs, prompts


def mooncake_prompts(block: int, n: int | None = None) -> tuple[list[list], int]:
    """The given trace's prompts as block keys (hash id, block in it), read here directly."""
    prompts, tokens = [], 0
    for text in MOONCAKE.read_text().splitlines()[:n]:
        row = json.loads(text)
        size = [min(512, row["input_length"] - 512 * i) for i in range(len(row["hash_ids"]))]
        prompts.append([(h, j) for h, s in zip(row["hash_ids"], size) for j in range(s // block)])
        tokens += row["input_length"]
    return prompts, tokens


# ------------------------------------------------------------------ checks


@needs_mooncake
@pytest.mark.parametrize(
    "block, n, capacities",
    [
        pytest.param(16, None, [3e6], marks=pytest.mark.slow),  # 3.8M blocks through the plain LRU
        (128, None, [1e5, 1e6, 1e7]),
        (16, 500, [3e4, 1e6]),
    ],
)
def test_lru_equals_a_plain_lru_on_the_given_trace(block, n, capacities):
    prompts, tokens = mooncake_prompts(block, n)
    refs = block_references(trace_requests(MOONCAKE, n), block)
    assert refs.prompt_tokens == tokens and refs.blocks == sum(map(len, prompts))
    got = cache_curve(refs, capacities, ["lru"])
    assert got.hit_tokens.tolist() == [block * plain_lru(prompts, int(c // block)) for c in capacities]


@needs_mooncake
def test_on_the_given_trace_belady_bounds_lru_and_every_curve_rises():
    refs = block_references(trace_requests(MOONCAKE), 16)
    capacities = [1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, math.inf]
    curve = cache_curve(refs, capacities).set_index(["policy", "capacity_tokens"]).hit_rate
    for policy in POLICIES:
        assert curve[policy].is_monotonic_increasing
    assert (curve["belady"] >= curve["lru"]).all() and (curve["belady"] >= curve["lfu"]).all()
    assert curve["lru"][math.inf] == curve["belady"][math.inf] == curve["lfu"][math.inf]
    assert 0.64 < curve["lru"][math.inf] < 0.66  # the reference data's README: about 65%
    assert len(refs.item) < refs.blocks / 100  # 3.8M blocks, a few thousand items


@pytest.mark.parametrize("seed", range(40))
def test_every_policy_equals_a_plain_cache_on_random_trees(seed):
    rng = random.Random(seed)
    block = rng.choice([1, 2, 4])
    specs, prompts = random_trace(rng, rng.randint(1, 30), block)
    refs = block_references(specs, block)
    capacities = [1, 2, 3, 5, 8, 13, 21, 50, 1000]
    curve = cache_curve(refs, [block * c for c in capacities])
    for policy, plain in PLAIN.items():
        got = curve[curve.policy == policy].hit_tokens.tolist()
        assert got == [block * plain(prompts, c) for c in capacities], policy


def test_three_prompts_by_hand():
    """Blocks a-b-c, then a-d, then a-b-c again. With two blocks, LRU and LFU keep a and d
    after the second request (d: one use, like b, but more recent), so the third finds a
    only; MIN keeps a and b, which come back soonest. With three, LRU and LFU drop c, MIN
    keeps a, b and c."""
    specs = [
        RequestSpec(0, 0.0, 3, 1, ((10, 1), (11, 1), (12, 1)), -1),
        RequestSpec(1, 1.0, 2, 1, ((10, 1), (13, 1)), -1),
        RequestSpec(2, 2.0, 3, 1, ((10, 1), (11, 1), (12, 1)), -1),
    ]
    curve = cache_curve(block_references(specs, 1), [2, 3, math.inf]).pivot(
        index="capacity_tokens", columns="policy", values="hit_tokens"
    )
    assert curve.loc[2].to_dict() == {"belady": 3, "lfu": 2, "lru": 2}
    assert curve.loc[3].to_dict() == {"belady": 4, "lfu": 3, "lru": 3}
    assert curve.loc[math.inf].to_dict() == {"belady": 4, "lfu": 4, "lru": 4}


def test_blocks_used_together_become_one_item():
    # two prompts share hash block 7 (512 tokens = 32 blocks), then each has its own block
    specs = [
        RequestSpec(0, 0.0, 1024, 1, ((7, 512), (8, 512)), -1),
        RequestSpec(1, 1.0, 600, 1, ((7, 512), (9, 88)), -1),
    ]
    refs = block_references(specs, 16)
    assert refs.request.tolist() == [0, 0, 1, 1]
    assert refs.weight.tolist() == [32, 32, 32, 5] and refs.depth.tolist() == [0, 32, 0, 32]
    assert refs.item[0] == refs.item[2] and len(set(refs.item.tolist())) == 3
    assert refs.blocks == 101 and refs.prompt_tokens == 1624 and distinct_tokens(refs) == 69 * 16


# ------------------------------------------------------------------ the command


def write_trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 100 * i, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 2 + i % 3]}
        for i in range(12)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_kvsim_cache_curve_writes_the_csv_and_the_figure(tmp_path):
    out = tmp_path / "out"
    code, text, err = kvsim("cache-curve", write_trace(tmp_path), "--capacities", "512,2048,inf", "--out", out)
    assert code == 0, err
    table = pd.read_csv(out / "cache_curve.csv")
    assert list(table.columns) == ["policy", "capacity_tokens", "hit_rate", "hit_tokens", "prompt_tokens"]
    assert table.policy.tolist() == ["lru"] * 3 + ["lfu"] * 3 + ["belady"] * 3
    assert table.capacity_tokens.tolist() == [512, 2048, math.inf] * 3
    # unlimited: the first 1,024 tokens of 11 prompts, and the third block of 9
    unlimited = (11 * 1024 + 9 * 272) / (12 * 1300)
    assert np.allclose(table[table.capacity_tokens == math.inf].hit_rate, unlimited)
    assert (out / "cache_curve.png").stat().st_size > 10_000
    assert "block references per second" in text and f"wrote {out}/cache_curve.csv" in text


def test_capacities_in_gib_of_a_models_kv(tmp_path):
    out = tmp_path / "out"
    code, _, err = kvsim(
        "cache-curve",
        write_trace(tmp_path),
        "--model",
        "llama-3-8b",
        "--capacities",
        "0.0625,inf",
        "--policies",
        "lru",
        "--out",
        out,
        "--quiet",
    )
    assert code == 0, err
    table = pd.read_csv(out / "cache_curve.csv")
    # llama-3-8b: 131,072 B of fp16 KV per token, so 1/16 GiB holds 512 tokens
    assert table.capacity_tokens.tolist() == [512, math.inf] and table.capacity_gib.tolist()[0] == 0.0625


@pytest.mark.parametrize(
    "args, words",
    [
        (["--capacities", "1e5,-3"], "--capacities: '-3'"),
        (["--capacities", "lots"], "--capacities: 'lots'"),
        (["--policies", "lru,arc"], "--policies: unknown policy 'arc'"),
        (["--model", "gpt-9"], "--model: unknown model 'gpt-9'"),
    ],
)
def test_bad_flags_are_one_line_errors_and_write_nothing(tmp_path, args, words):
    out = tmp_path / "out"
    line = one_error_line(*kvsim("cache-curve", write_trace(tmp_path), *args, "--out", out))
    assert words in line
    assert not out.exists()


@pytest.mark.parametrize(
    "content, words",
    [
        ("when,in,out\n0,1,1\n", "columns: missing column for arrival_s"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hashes": [1]}\n', "unknown field 'hashes'"),
        ("", "columns"),
    ],
)
def test_bad_traces_are_one_line_errors_and_write_nothing(tmp_path, content, words):
    (tmp_path / "t.jsonl").write_text(content)
    out = tmp_path / "out"
    line = one_error_line(*kvsim("cache-curve", tmp_path / "t.jsonl", "--out", out))
    assert words in line and str(tmp_path / "t.jsonl") in line
    assert not out.exists()


# ------------------------------------------------------------------ kvsim reproduce's Mooncake rows


def test_without_the_trace_the_mooncake_rows_say_not_measured(tmp_path):
    from kvsim.reproduce import mooncake
    from kvsim.reproduce.claims import Context, default_scenarios

    for traces in (None, tmp_path):
        ctx = Context(default_scenarios(), quick=True, out=tmp_path, traces=traces)
        (t2,), (f9,), (f10,) = mooncake.table2(ctx), mooncake.fig9(ctx), mooncake.fig10(ctx)
        assert t2.verdict == f9.verdict == f10.verdict == "not measured" and "not measured" in t2.measured
        assert "held out" in t2.measured and not ctx.figures


@needs_mooncake
def test_the_mooncake_rows_report_the_cache_curve(tmp_path):
    from kvsim.reproduce import mooncake
    from kvsim.reproduce.claims import Context, default_scenarios

    ctx = Context(default_scenarios(), quick=True, out=tmp_path, traces=MOONCAKE.parent)
    (t2,), (f9,) = mooncake.table2(ctx), mooncake.fig9(ctx)
    curve = cache_curve(block_references(trace_requests(MOONCAKE), 16), [3e6, 50e6, math.inf], ["lru"])
    unlimited, local = curve.hit_rate.iloc[2], curve.hit_rate.iloc[0]
    assert t2.measured.startswith(f"synthetic {unlimited:.1%};") and "conversation and tool&agent not" in t2.measured
    assert (
        t2.verdict
        == ("holds for synthetic" if abs(unlimited - 0.66) <= 0.03 else "does not hold for synthetic")
        + "; conversation and tool&agent not measured"
    )
    assert f"3M {local:.1%} = {local / unlimited:.0%} of unlimited" in f9.measured
    assert f9.verdict.startswith("holds" if local / unlimited < 0.5 else "does not hold")
    assert [png.name for _, png in ctx.figures] == ["claim11_cache_curve.png"]


@needs_mooncake
def test_the_fig10_row_compares_local_and_shared_tiers_of_equal_bytes(tmp_path):
    """Mooncake (FAST 2025) Fig. 10: a global cache up to 2.36x the per-node caches' hit
    rate. The row runs the trace's first requests on four replicas, each host-memory size
    once per replica and once pooled; the verdict follows the measured ratios."""
    from kvsim.reproduce import mooncake
    from kvsim.reproduce.claims import Context, default_scenarios

    ctx = Context(default_scenarios(), quick=True, out=tmp_path, traces=MOONCAKE.parent)
    (row,) = mooncake.fig10(ctx)
    ((title, table),) = ctx.tables
    assert list(table.cpu_gib_per_replica) == [32, 128, 512]
    assert (table.shared > table.local).all() and table.local.is_monotonic_increasing
    assert table.shared_over_local.tolist() == pytest.approx((table.shared / table.local).tolist())
    top = table.shared_over_local.max()
    assert row.verdict.startswith("holds" if abs(top / 2.36 - 1) <= 0.2 else "does not hold")
    assert f"largest ratio {top:.2f}x" in row.verdict and "the first 800 requests" in row.scenario
    assert [png.name for _, png in ctx.figures] == ["claim12_shared_tiers.png"]
