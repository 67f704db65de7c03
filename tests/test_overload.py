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

import functools
import math
from pathlib import Path

import pytest

from helpers import wall_limit, with_changes
from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario

WALL_LIMIT_S = 60

# Llama-3-8B holds 128 KiB of KV per token: 0.0625 GiB is 512 token slots.
SLOTS_GIB = 0.0625 / 512


def every_policy() -> list[dict]:
    policies = [
        {"name": f"contiguous-{r}-{p}", "allocator": "contiguous", "reserve": r, "placement": p}
        for r in ("max", "pow2", "oracle")
        for p in ("first-fit", "buddy")
    ]
    return policies + [
        {"name": "paged-1", "allocator": "paged", "block_size": 1},
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
        {"name": "paged-16-prefix", "allocator": "paged", "block_size": 16, "enable_prefix_caching": True},
        {"name": "radix", "allocator": "paged", "enable_prefix_caching": True, "prefix_cache": "radix"},
    ]


BASE = {
    "name": "overload",
    "seed": 11,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 2048 * SLOTS_GIB,
    "max_model_len": 1024,
    "cost_model": "roofline",  # memory under overload, not step costs, is under test
    "workload": {
        "num_requests": 40,
        "arrival": {"process": "poisson", "rate_per_s": 10_000.0},  # ~1,000x what it serves
        "prompt_tokens": {"dist": "uniform", "min": 16, "max": 700},
        "output_tokens": {"dist": "uniform", "min": 1, "max": 150},
    },
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024},
    "policies": every_policy(),
}


def scenario(**changes) -> dict:
    """BASE with changes; a key a__b sets BASE[a][b]."""
    return with_changes(BASE, **changes)


# 16 blocks of 16 slots; every request is admitted with one or two blocks and grows to
# 7 to 15, so the pool overflows again and again.
STORM = dict(
    kv_cache_memory_gib=256 * SLOTS_GIB,
    max_model_len=256,
    workload__num_requests=16,
    workload__prompt_tokens={"dist": "uniform", "min": 8, "max": 24},
    workload__output_tokens={"dist": "uniform", "min": 90, "max": 200},
)
SCENARIOS = {
    "rate far beyond capacity": scenario(),
    "prompts longer than the pool": scenario(
        max_model_len=8192,
        scheduler__max_num_batched_tokens=8192,
        workload__prompt_tokens={"dist": "uniform", "min": 16, "max": 4000},
    ),
    "preemption storm": scenario(**STORM),
    "preemption storm, chunked prefill": scenario(
        **STORM, scheduler__enable_chunked_prefill=True, scheduler__max_num_batched_tokens=48
    ),
    "burst": scenario(workload__arrival={"process": "burst"}),
    # a little CPU space (100 slots, less than most victims hold): some victims swap, the
    # rest fall back to recompute
    "preemption storm, swap": scenario(
        **STORM, engine="vllm-v0", scheduler__preemption_mode="swap", scheduler__swap_space_gib=100 * SLOTS_GIB
    ),
    "burst, no watermark": scenario(workload__arrival={"process": "burst"}, engine="vllm-v0", scheduler__watermark=0.0),
    "preemption storm, high watermark": scenario(**STORM, engine="vllm-v0", scheduler__watermark=0.5),
    "burst, sglang": scenario(workload__arrival={"process": "burst"}, engine="sglang"),
}


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_no_request_is_stranded(overloaded):
    """No livelock: every request, preempted ones included, ran to completion or was
    rejected, and every completed one has its whole timeline."""
    _, res = overloaded
    req = res.requests
    assert set(req.outcome) <= {"completed", "rejected"}
    done = req[req.outcome == "completed"]
    assert (done.arrival_s <= done.admitted_s).all() and (done.admitted_s <= done.first_token_s).all()
    assert (done.first_token_s <= done.finish_s).all()
    rejected = req[req.outcome == "rejected"]
    assert (rejected.reason.str.len() > 0).all(), "a rejection must say why"


# --- what each scenario claims to stress: a check per scenario, on (summary by policy, requests)
def queue_forms(s, req):
    assert (s.limited_by_arrivals < 1).all(), s.limited_by_arrivals  # under every policy


def all_arrive_at_once(s, req):
    assert (req.arrival_s == 0).all()
    queue_forms(s, req)


def growing_policies_preempt(s, req):
    """Paged and radix pools hand out slots as sequences grow, so a full pool preempts;
    contiguous ones reserve at admission and never do."""
    growing = ~s.index.str.startswith("contiguous")
    assert growing.sum() == 4 and (s.preemptions[growing] > 0).all(), s.preemptions


def some_victims_swap(s, req):
    growing_policies_preempt(s, req)
    growing = ~s.index.str.startswith("contiguous")
    swaps, preemptions = s.swaps[growing], s.preemptions[growing]
    assert ((swaps > 0) & (swaps < preemptions)).all(), s[["preemptions", "swaps"]]


def pool_smaller_than_requests(s, req):
    """A request is rejected on arrival exactly when what its policy needs at admission
    exceeds the 2,048-slot pool: max_model_len (8,192) for contiguous max, so everyone;
    prompt + output rounded up to a power of two for pow2; prompt + output otherwise
    (a paged pool of 16-slot blocks and the buddy arena are whole multiples of it)."""
    final = req.prompt_tokens + req.output_tokens
    pow2 = req.prompt_tokens + req.output_tokens.map(lambda n: 1 << (n - 1).bit_length())
    for policy, group in req.groupby("policy"):
        need = (
            8192
            if policy.startswith("contiguous-max")
            else pow2[group.index]
            if policy.startswith("contiguous-pow2")
            else final[group.index]
        )
        assert ((group.outcome == "rejected") == (need > 2048)).all(), policy
    assert req[req.outcome == "rejected"].reason.str.contains("KV pool").all()
    assert (s.requests_rejected > 0).all()
    assert (s.requests_completed[~s.index.str.startswith("contiguous-max")] > 0).all()


CLAIMS = {
    "rate far beyond capacity": queue_forms,
    "prompts longer than the pool": pool_smaller_than_requests,
    "preemption storm": growing_policies_preempt,
    "preemption storm, chunked prefill": growing_policies_preempt,
    "burst": all_arrive_at_once,
    "preemption storm, swap": some_victims_swap,
    "burst, no watermark": all_arrive_at_once,
    "burst, sglang": all_arrive_at_once,
    "preemption storm, high watermark": growing_policies_preempt,
}


@pytest.mark.slow
def test_the_overload_is_real(overloaded):
    """Each scenario stresses what it claims to (CLAIMS has a check for every one)."""
    name, res = overloaded
    CLAIMS[name](res.summary.set_index("policy"), res.requests)


@pytest.mark.slow
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
            full.requests[(full.requests.policy == policy) & (full.requests.outcome == "rejected")].request_id
        )


def test_a_time_limit_before_the_first_arrival_leaves_everything_unfinished():
    cut = run(scenario(time_limit_s=1e-9))
    s = cut.summary
    assert (s.requests_unfinished == s.requests_total).all()
    assert (s.requests_completed == 0).all() and (s.steps == 0).all()
    assert s.throughput_tok_s.map(lambda x: x == 0 or math.isnan(x)).all()
