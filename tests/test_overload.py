"""Overload: the run always ends, and every request is accounted for.

Arrival rates far beyond what the GPU serves, prompts longer than the whole pool,
preemption storms (a tiny paged pool and long outputs), and bursts, under every kind of
policy and both preemption modes. For each: the run ends within a wall-clock bound,
requests_completed + requests_rejected + requests_unfinished == requests_total for
every policy, nothing is unfinished without a time limit, and no request is stranded:
each one preempted later completes or is rejected (no livelock). A time limit cuts the
run and counts what it cut off as unfinished. Invariants are checked after every step.
"""
from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import pytest

from helpers import wall_limit
from kvsim.runner import run_scenario
from kvsim.scenario import Paged, Scheduler, validate_scenario

WALL_LIMIT_S = 60

# Llama-3-8B holds 128 KiB of KV per token: 0.0625 GiB is 512 token slots.
SLOTS_GIB = 0.0625 / 512


def every_policy() -> list[dict]:
    policies = [{"name": f"contiguous-{r}-{p}", "allocator": "contiguous", "reserve": r, "placement": p}
                for r in ("max", "pow2", "oracle") for p in ("first-fit", "buddy")]
    policies += [{"name": "paged-1", "allocator": "paged", "block_size": 1},
                 {"name": "paged-16", "allocator": "paged", "block_size": 16}]
    if "enable_prefix_caching" in Paged.model_fields:
        policies.append({"name": "paged-16-prefix", "allocator": "paged", "block_size": 16,
                         "enable_prefix_caching": True})
    if "prefix_cache" in Paged.model_fields:
        policies.append({"name": "radix", "allocator": "paged", "enable_prefix_caching": True,
                         "prefix_cache": "radix"})
    return policies


BASE = {
    "name": "overload",
    "seed": 11,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 2048 * SLOTS_GIB,
    "max_model_len": 1024,
    "workload": {
        "num_requests": 40,
        "arrival": {"process": "poisson", "rate_per_s": 10_000.0},    # ~1,000x what it serves
        "prompt_tokens": {"dist": "uniform", "min": 16, "max": 700},
        "output_tokens": {"dist": "uniform", "min": 1, "max": 150},
    },
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024},
    "policies": every_policy(),
}


def scenario(**changes) -> dict:
    """BASE with changes; a key a__b sets BASE[a][b]."""
    raw = copy.deepcopy(BASE)
    for key, value in changes.items():
        *path, last = key.split("__")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


# 16 blocks of 16 slots; every request is admitted with one or two blocks and grows to
# 7 to 15, so the pool overflows again and again.
STORM = dict(kv_cache_memory_gib=256 * SLOTS_GIB, max_model_len=256, workload__num_requests=16,
             workload__prompt_tokens={"dist": "uniform", "min": 8, "max": 24},
             workload__output_tokens={"dist": "uniform", "min": 90, "max": 200})
SCENARIOS = {
    "rate far beyond capacity": scenario(),
    "prompts longer than the pool": scenario(max_model_len=8192, scheduler__max_num_batched_tokens=8192,
                                             workload__prompt_tokens={"dist": "uniform", "min": 16, "max": 4000}),
    "preemption storm": scenario(**STORM),
    "preemption storm, chunked prefill": scenario(**STORM, scheduler__enable_chunked_prefill=True,
                                                  scheduler__max_num_batched_tokens=48),
    "burst": scenario(workload__arrival={"process": "burst"}),
}
if "swap" in Scheduler.model_fields["preemption_mode"].annotation.__args__:
    # a little CPU space: some victims swap, the rest fall back to recompute
    SCENARIOS["preemption storm, swap"] = scenario(**STORM, scheduler__preemption_mode="swap",
                                                   scheduler__swap_space_gib=100 * SLOTS_GIB)
if "watermark" in Scheduler.model_fields:
    SCENARIOS["burst, no watermark"] = scenario(workload__arrival={"process": "burst"}, scheduler__watermark=0.0)
    SCENARIOS["preemption storm, high watermark"] = scenario(**STORM, scheduler__watermark=0.5)


def run(raw: dict):
    scn = validate_scenario(raw, "overload.yaml")
    with wall_limit(WALL_LIMIT_S):
        return run_scenario(scn, Path("."), "overload.yaml", check_invariants=True)


@functools.lru_cache(maxsize=None)
def run_named(name: str):
    return run(SCENARIOS[name])


@pytest.fixture(params=list(SCENARIOS))
def overloaded(request):
    return request.param, run_named(request.param)


def test_every_request_is_accounted_for(overloaded):
    name, res = overloaded
    s = res.summary
    assert list(s.policy) == [p["name"] for p in SCENARIOS[name]["policies"]]
    assert (s.requests_completed + s.requests_rejected + s.requests_unfinished == s.requests_total).all()
    assert (s.requests_unfinished == 0).all(), "nothing is cut off without a time limit"
    assert (s.requests_total == SCENARIOS[name]["workload"]["num_requests"]).all()
    counts = res.requests.groupby("policy").outcome.value_counts().unstack(fill_value=0)
    for _, row in s.iterrows():
        assert counts.loc[row.policy].get("completed", 0) == row.requests_completed
        assert counts.loc[row.policy].get("rejected", 0) == row.requests_rejected


def test_no_request_is_stranded(overloaded):
    """No livelock: every preempted request later ran to completion or was rejected, and
    every completed one has its whole timeline."""
    _, res = overloaded
    req = res.requests
    assert set(req.outcome) <= {"completed", "rejected"}
    preempted = req[req.preemptions > 0]
    assert preempted.outcome.isin(["completed", "rejected"]).all()
    done = req[req.outcome == "completed"]
    assert (done.arrival_s <= done.admitted_s).all() and (done.admitted_s <= done.first_token_s).all()
    assert (done.first_token_s <= done.finish_s).all()
    rejected = req[req.outcome == "rejected"]
    assert (rejected.reason.str.len() > 0).all(), "a rejection must say why"


def test_the_overload_is_real(overloaded):
    """Each scenario stresses what it claims to."""
    name, res = overloaded
    s, req = res.summary.set_index("policy"), res.requests
    if "storm" in name:
        paged = [p for p in s.index if p.startswith("paged")]
        assert (s.loc[paged, "preemptions"] > 0).all(), s.preemptions
    if name == "prompts longer than the pool":
        reasons = set(req[req.outcome == "rejected"].reason)
        assert any("KV pool" in r for r in reasons), reasons
        assert (s.requests_rejected > 0).all()
        # max reservation (1,024... 8,192 slots > 2,048) rejects everyone; the rest serve some
        assert (s.requests_completed[~s.index.str.startswith("contiguous-max")] > 0).all()
    if name.startswith("rate"):
        assert (s.fraction_basis == "waiting").all()       # a queue formed under every policy


def test_time_limit_counts_the_unfinished_separately():
    full = run_named("rate far beyond capacity")
    cut = run(scenario(time_limit_s=0.5))
    s, req = cut.summary, cut.requests
    assert (s.requests_unfinished > 0).all()
    assert (s.requests_completed + s.requests_rejected + s.requests_unfinished == s.requests_total).all()
    assert (s.requests_completed <= full.summary.requests_completed).all()
    unfinished = req[req.outcome == "unfinished"]
    assert unfinished.finish_s.isna().all()
    assert (req[req.outcome == "completed"].finish_s <= 0.5).all()
    # rejections happen on arrival, so the cut keeps exactly those that arrived before it
    for policy, group in req.groupby("policy"):
        assert set(group[group.outcome == "rejected"].request_id) <= set(
            full.requests[(full.requests.policy == policy) & (full.requests.outcome == "rejected")].request_id)


def test_a_time_limit_before_the_first_arrival_leaves_everything_unfinished():
    cut = run(scenario(time_limit_s=1e-9))
    s = cut.summary
    assert (s.requests_unfinished == s.requests_total).all()
    assert (s.requests_completed == 0).all() and (s.steps == 0).all()
    assert s.throughput_tok_s.map(lambda x: x == 0 or math.isnan(x)).all()
