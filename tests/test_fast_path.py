"""The fast path (the default: kvsim.sim.lazy, decoding requests advanced in sums)
against the plain path (`--exact-steps`): the same summary, step table and request table,
to the last bit, for every allocator, engine and sharing mode; the check mode still checks
at every step; a run in time buckets keeps the summary's sums.

The plain path is the oracle: it visits every running request in every step.
"""

import copy
import math
import random
from pathlib import Path

import numpy as np
import pytest

from kvsim.sim import lazy
from kvsim.kvcache import InvariantError, PagedAllocator, PrefixCachingPagedAllocator, SeqShape
from kvsim.sim.loop import COMPLETE, StepLoop, simulate
from kvsim.config.errors import InputError
from kvsim.analysis.results import run_scenario
from kvsim.sim.scheduler import Scheduler
from kvsim.config.scenario import validate_scenario
from kvsim.workload.requests import RequestSpec, RequestTable

from helpers import OneSecondSteps

POLICIES = [
    {"name": "contiguous", "allocator": "contiguous", "reserve": "max"},
    {"name": "pow2-buddy", "allocator": "contiguous", "reserve": "pow2", "placement": "buddy"},
    {"name": "oracle", "allocator": "contiguous", "reserve": "oracle"},
    {"name": "paged-16", "allocator": "paged", "block_size": 16, "enable_prefix_caching": False},
    {"name": "paged-8-prefix", "allocator": "paged", "block_size": 8, "enable_prefix_caching": True},
    {"name": "radix", "allocator": "paged", "enable_prefix_caching": True, "prefix_cache": "radix"},
]
# A 0.25 GiB pool (2,048 Llama-3-8B token slots) that 60 requests at 30/s overflow.
BASE = {
    "name": "fast",
    "seed": 3,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 0.25,
    "max_model_len": 1024,
    "cost_model": "calibrated",
    "workload": {
        "num_requests": 60,
        "arrival": {"process": "poisson", "rate_per_s": 30.0},
        "prompt_tokens": {"dist": "lognormal", "mean": 200, "cv": 0.6, "min": 8, "max": 600},
        "output_tokens": {"dist": "lognormal", "mean": 80, "cv": 0.8, "min": 1, "max": 300},
    },
    "policies": POLICIES,
}
SMALL_WINDOW = {
    "name": "windowed",
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "params": 7.24e9,
    "sliding_window": 64,
}
BURST_SWAP = {
    "engine": "vllm-v0",
    "kv_cache_memory_gib": 0.02,
    "scheduler": {"preemption_mode": "swap", "swap_space_gib": 0.01, "max_num_seqs": 16},
    "workload__arrival": {"process": "burst"},
    "workload__num_requests": 16,
    "workload__prompt_tokens": {"dist": "uniform", "min": 20, "max": 60},
    "workload__output_tokens": {"dist": "uniform", "min": 100, "max": 300},
}
CASES = {
    "vllm-v1": {"engine": "vllm-v1"},
    "vllm-v0": {"engine": "vllm-v0"},
    "sglang": {"engine": "sglang"},
    "roofline": {"cost_model": "roofline"},
    "v1 prefix groups": {"workload__prefix": {"groups": 3, "tokens": 100}},
    "v1 rag": {"workload__rag": {"system_tokens": 50, "corpus_docs": 20, "doc_tokens": 40, "docs_per_request": 3}},
    "v1 conversation": {"workload__conversation": {"turns": 3, "think_time_s": 0.5}},
    "v1 samples": {"workload__n": 3},
    "v1 unchunked, small budget": {
        "scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024, "max_num_seqs": 8}
    },
    "v0 chunked": {"engine": "vllm-v0", "scheduler": {"enable_chunked_prefill": True}},
    "v0 samples": {
        "engine": "vllm-v0",
        "workload__n": 3,
        "scheduler": {"enable_chunked_prefill": False, "preemption_mode": "recompute"},
    },
    "v0 beams": {"engine": "vllm-v0", "workload__beam_width": 3, "scheduler": {"preemption_mode": "recompute"}},
    "v0 swap": BURST_SWAP,
    "sglang lpm prefix groups": {
        "engine": "sglang",
        "scheduler": {"schedule_policy": "lpm"},
        "workload__prefix": {"groups": 3, "tokens": 100},
    },
    "sliding window": {"model": SMALL_WINDOW, "cost_model": "roofline"},
    "time limit": {"time_limit_s": 1.5},
    # one KV store behind three replicas: each reads what the others wrote, in time order
    "fleet, shared KV tier": {
        "replicas": 3,
        "workload__prefix": {"groups": 3, "tokens": 100},
        "policies": [
            {
                "name": "shared-tier",
                "allocator": "paged",
                "block_size": 8,
                "enable_prefix_caching": True,
                "kv_offload": {"cpu_gib": 0.02, "chunk_tokens": 8, "shared": True},
            }
        ],
    },
    # every request at one instant: each replica plans then, in turn, before any runs ahead
    "fleet, shared KV tier, one burst": {
        "replicas": 3,
        "workload__arrival": {"process": "burst"},
        "workload__prefix": {"groups": 3, "tokens": 100},
        "policies": [
            {
                "name": "shared-tier",
                "allocator": "paged",
                "block_size": 8,
                "enable_prefix_caching": True,
                "kv_offload": {"cpu_gib": 0.02, "chunk_tokens": 8, "shared": True},
            }
        ],
    },
}


def scenario(**changes) -> dict:
    doc = copy.deepcopy(BASE)
    for key, value in changes.items():
        *path, last = key.split("__")
        node = doc
        for part in path:
            node = node[part]
        node[last] = value
    return doc


def run(doc: dict, *, exact: bool, check: bool = False, bucket_s=None):
    return run_scenario(
        validate_scenario(copy.deepcopy(doc), "fast"),
        Path("."),
        "fast",
        check_invariants=check,
        exact_steps=exact,
        bucket_s=bucket_s,
    )


def assert_same(plain, fast) -> None:
    for table in ("summary", "timeseries", "requests"):
        a, b = getattr(plain, table), getattr(fast, table)
        assert a.equals(b), f"{table} differs:\n{a.compare(b) if a.shape == b.shape else (a.shape, b.shape)}"


@pytest.mark.parametrize("case", CASES)
def test_fast_path_gives_the_plain_paths_tables_to_the_last_bit(case, monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario(**CASES[case])
    plain = run(doc, exact=True)
    assert plain.summary.steps.sum() > 0
    assert_same(plain, run(doc, exact=False, check=True))


def counted_run(monkeypatch, doc):
    """A fast run that counts the steps, the checks and the decodes done lazily."""
    counts = {"checks": 0, "lazy": 0, "decodes": 0}
    check, schedule = lazy.LazyRunningSet.check, Scheduler.schedule

    def counted_check(self):
        counts["checks"] += 1
        return check(self)

    def counted_schedule(self, now):
        step = schedule(self, now)
        counts["lazy"] += step.lazy
        counts["decodes"] += step.cost.decodes
        return step

    def counted_quiet_step(self, now):  # a step planned without the rules: all lazy
        batch = quiet_step(self, now)
        counts["lazy"] += batch.decodes
        counts["decodes"] += batch.decodes
        return batch

    quiet_step = Scheduler.quiet_step
    monkeypatch.setattr(lazy.LazyRunningSet, "check", counted_check)
    monkeypatch.setattr(Scheduler, "schedule", counted_schedule)
    monkeypatch.setattr(Scheduler, "quiet_step", counted_quiet_step)
    return run(doc, exact=False, check=True), counts


def test_check_mode_checks_every_step_twice_on_the_fast_path(monkeypatch):
    doc = scenario(policies=[POLICIES[3]])
    result, counts = counted_run(monkeypatch, doc)
    steps = int(result.summary.steps.iloc[0])
    assert counts["checks"] == 2 * steps  # after planning and after completing each step
    # and the lazy machinery did the work: most decodes were lazy ones
    assert counts["lazy"] > counts["decodes"] / 2 > 0


def test_vllm_v0_decodes_lazily_while_the_head_is_kept_out(monkeypatch):
    """vLLM V0 without chunking, its pool full: in most decode steps the waiting head is
    kept out, and the running requests still decode lazily in them (the running set's
    decode pass); the tables stay the plain path's."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario(engine="vllm-v0", policies=[POLICIES[3]])
    limits = []
    schedule = Scheduler.schedule

    def noted(self, now):
        step = schedule(self, now)
        if step.lazy and not step.work and self.waiting:
            limits.append(step.limit)
        return step

    monkeypatch.setattr(Scheduler, "schedule", noted)
    fast = run(doc, exact=False, check=True)
    assert limits and set(limits) <= {"memory", "watermark", "token_budget", "max_num_seqs"}
    assert_same(run(doc, exact=True), fast)


@pytest.mark.parametrize("engine", ["vllm-v1", "vllm-v0"])
def test_quiet_steps_go_without_the_rules_and_the_event_queue(engine, monkeypatch):
    """A light load with short steps: most steps have nothing waiting and only lazy
    decodes, so they are planned without the engine's rules, and most of those end
    before the next arrival, so the next step follows without an event; the tables stay
    the plain path's."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario(
        engine=engine,
        cost_model="roofline",
        policies=[POLICIES[3]],
        workload__arrival={"process": "poisson", "rate_per_s": 2.0},
    )
    counts = {"quiet": 0, "events": 0}
    quiet_step, push = Scheduler.quiet_step, StepLoop._push

    def counted_quiet_step(self, now):
        counts["quiet"] += 1
        return quiet_step(self, now)

    def counted_push(self, time, phase, rep=None):
        counts["events"] += phase == COMPLETE
        return push(self, time, phase, rep)

    monkeypatch.setattr(Scheduler, "quiet_step", counted_quiet_step)
    monkeypatch.setattr(StepLoop, "_push", counted_push)
    fast = run(doc, exact=False)
    steps = int(fast.summary.steps.iloc[0])
    assert counts["quiet"] > steps * 0.8
    assert counts["events"] < steps * 0.2
    assert_same(run(doc, exact=True), fast)


def test_quiet_steps_with_requests_the_step_cannot_see_yet(monkeypatch):
    """vLLM V1 schedules asynchronously: a request that arrives while a step runs waits
    one more step unseen, so that step still only decodes and is planned as a quiet step
    (its limit "arrivals", its row recording the unseen head's need); the tables stay the
    plain path's, checked at every step. Without asynchronous scheduling no quiet step has
    a request waiting."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    waiting = []
    quiet_step = Scheduler.quiet_step

    def noted(self, now):
        waiting.append(bool(self.waiting))
        return quiet_step(self, now)

    monkeypatch.setattr(Scheduler, "quiet_step", noted)
    doc = scenario(engine="vllm-v1", cost_model="roofline", policies=[POLICIES[3], POLICIES[4]])
    fast = run(doc, exact=False, check=True)
    assert sum(waiting) >= 10
    assert_same(run(doc, exact=True), fast)
    waiting.clear()
    doc["scheduler"] = {"async_scheduling": False}
    fast = run(doc, exact=False)
    assert waiting and not any(waiting)
    assert_same(run(doc, exact=True), fast)


def test_check_mode_catches_a_stale_lazy_sum(monkeypatch):
    """A breakdown kept in sums is checked against the allocator's own at every step."""
    original = lazy.LazyRunningSet._lazy_tick

    def off_by_one(self, crossing):
        original(self, crossing)
        if self.tick == 50:
            self.sums.reservation += 1  # what a bug in the sums would do

    monkeypatch.setattr(lazy.LazyRunningSet, "_lazy_tick", off_by_one)
    with pytest.raises(InvariantError, match="breakdown"):
        run(scenario(policies=[POLICIES[3]]), exact=False, check=True)


def test_a_lone_request_decodes_lazily_and_ends_on_time():
    """One request, 4-token blocks, one-second steps: prefilled in [0, 1] (held 4 of 4
    slots: vLLM V1 gives the first sampled token its slot as it feeds it back), then
    lazy through its 9 decodes (blocks taken in bulk at 5, 9 and 13 tokens), finishing
    at t = 10 holding prompt + output - 1 = 13 tokens."""
    cost = OneSecondSteps()
    alloc = PagedAllocator(10, 4)
    result = simulate(
        "p",
        [RequestSpec(0, 0.0, 4, 10)],
        alloc,
        cost,
        engine="vllm-v1",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=True,
        check_invariants=True,
    )
    seq = result.seqs[0]
    assert (seq.admitted_s, seq.first_token_s, seq.finish_s, seq.outcome) == (0.0, 1.0, 10.0, "completed")
    assert [b.decodes for b in cost.batches] == [0] + [1] * 9
    assert [b.decode_total for b in cost.batches[1:]] == list(range(5, 14))
    assert all(b.extra is not None for b in cost.batches[1:])  # none of them visited
    assert alloc.free_blocks and len(alloc.free_blocks) == 10  # all returned


def test_buckets_keep_the_summary(monkeypatch):
    """Steps summed per 0.05 s bucket: counts exact, time-weighted means and shares
    within 1e-9 of the per-step summary (they are summed in another order)."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario()
    steps, buckets = run(doc, exact=False), run(doc, exact=False, bucket_s=0.05)
    assert steps.requests.equals(buckets.requests)
    for a, b in zip(steps.summary.to_dict("records"), buckets.summary.to_dict("records")):
        for column, x in a.items():
            y = b[column]
            if isinstance(x, float) and not math.isnan(x):
                assert y == pytest.approx(x, rel=1e-9, abs=1e-12), column
            else:
                assert str(y) == str(x), column
    ts, bt = steps.timeseries, buckets.timeseries
    for policy in ts.policy.unique():
        s, b = ts[ts.policy == policy], bt[bt.policy == policy]
        assert b.steps.sum() == len(s)
        assert b.step_s.sum() == pytest.approx(s.step_s.sum(), rel=1e-12)
        assert (b.running * b.step_s).sum() == pytest.approx((s.running * s.step_s).sum(), rel=1e-12)
        assert b.prefill_tokens.sum() == s.prefill_tokens.sum()
        assert (np.diff(b.time_s) > 0).all() and b.max_running.max() == s.running.max()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_random_configurations_agree(seed, monkeypatch):
    """Random engines, pools, budgets, arrival processes, sharing, samples, beams, swap and
    time limits; configurations kvsim refuses, or that the plain path cannot run, are skipped."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    rng = random.Random(seed)
    engine = rng.choice(["vllm-v0", "vllm-v1", "sglang"])
    doc = scenario(
        engine=engine,
        seed=rng.randrange(100),
        kv_cache_memory_gib=rng.choice([0.01, 0.05, 0.3]),
        cost_model=rng.choice(["calibrated", "roofline"]),
    )
    wl = doc["workload"]
    wl["num_requests"] = rng.randrange(5, 50)
    wl["arrival"] = rng.choice(
        [
            {"process": "poisson", "rate_per_s": rng.choice([5.0, 100.0])},
            {"process": "burst"},
            {"process": "gamma", "rate_per_s": 30.0, "cv": 3.0},
        ]
    )
    sharing = rng.choice([None, "prefix", "rag", "conversation"])
    if sharing:
        wl[sharing] = {
            "prefix": {"groups": 2, "tokens": 32},
            "rag": {"system_tokens": 32, "corpus_docs": 10, "doc_tokens": 40, "docs_per_request": 2},
            "conversation": {"turns": 3, "think_time_s": rng.choice([0.0, 0.3])},
        }[sharing]
    sched = doc.setdefault("scheduler", {})
    if rng.random() < 0.5:
        sched["max_num_seqs"] = rng.choice([2, 8, 64])
    if rng.random() < 0.5:
        sched["max_num_batched_tokens"] = rng.choice([1024, 2048])
    if engine == "vllm-v0" and rng.random() < 0.4:
        sched["preemption_mode"] = rng.choice(["swap", "recompute"])
    if rng.random() < 0.2:
        doc["time_limit_s"] = rng.choice([0.2, 1.0])
    try:
        plain = run(doc, exact=True)
    except (InputError, RuntimeError, ValueError) as e:
        pytest.skip(f"the plain path does not run this configuration: {e}")
    assert_same(plain, run(doc, exact=False, check=True))


def test_a_prefix_cache_takes_blocks_in_bulk_only_where_tails_are_private(monkeypatch):
    """A prefix cache's lazy requests fill blocks and take new ones in bulk, keying the
    filled ones when caught up, only where no request's tail content is another's
    (RequestTable.private_tails). In a conversation a later turn looks up the blocks of an
    earlier turn still decoding: keying them late there changes the tables."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    taken = []
    take_free = PrefixCachingPagedAllocator.take_free
    monkeypatch.setattr(
        PrefixCachingPagedAllocator, "take_free", lambda self, count: taken.append(count) or take_free(self, count)
    )
    rag = scenario(workload__rag=CASES["v1 rag"]["workload__rag"], policies=[POLICIES[4]])
    assert_same(run(rag, exact=True), run(rag, exact=False, check=True))
    assert sum(taken) > 0
    taken.clear()
    conversation = scenario(workload__conversation={"turns": 3, "think_time_s": 0.0}, policies=[POLICIES[4]])
    plain = run(conversation, exact=True)
    assert_same(plain, run(conversation, exact=False, check=True))
    assert not taken
    monkeypatch.setattr(RequestTable, "private_tails", lambda self: True)  # what the rule prevents
    assert not plain.timeseries.equals(run(conversation, exact=False).timeseries)


def test_lazy_running_set_is_used_where_it_applies():
    from kvsim.kvcache import RadixCacheAllocator
    from kvsim.engines import make_rules

    v1 = make_rules("vllm-v1")
    assert lazy.applies(PagedAllocator(4, 4), v1, {})
    assert not lazy.applies(RadixCacheAllocator(16), v1, {})  # no room
    assert not lazy.applies(PagedAllocator(4, 4), v1, {"sliding_window": 8})
    assert not lazy.applies(PagedAllocator(4, 4), make_rules("vllm-v0"), {"width": 2})  # groups
    assert lazy.applies(PagedAllocator(4, 4), v1, {"width": 2})  # samples run as requests
    assert not lazy.applies(PagedAllocator(4, 4), v1, {}, cost_block_size=8)
    assert SeqShape(1, 1).final_tokens == 2
