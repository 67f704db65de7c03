"""Replicas behind a router: hand-derived routing decisions, a fleet of one as a plain
run, and the fleet's rows as its replicas' sums."""

from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvsim.kvcache import PagedAllocator
from kvsim.sim.loop import simulate
from kvsim.sim.router import LeastLoaded, PrefixAware, RoundRobin
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps, kvsim, one_error_line

FLEET = {
    "name": "fleet",
    "seed": 3,
    "model": "llama-3-8b",
    "gpu": "a100-80gb",
    "kv_cache_memory_gib": 0.5,
    "max_model_len": 2048,
    "cost_model": "roofline",  # routing, not step costs, is under test
    "workload": {
        "num_requests": 120,
        "arrival": {"process": "poisson", "rate_per_s": 12},
        "prompt_tokens": {"dist": "uniform", "min": 50, "max": 600},
        "output_tokens": {"dist": "uniform", "min": 10, "max": 200},
        "prefix": {"groups": 4, "tokens": 600},
    },
    "policies": [
        {"name": "paged-16", "allocator": "paged", "block_size": 16, "enable_prefix_caching": True},
        {"name": "contiguous", "allocator": "contiguous"},
    ],
}


def write(folder: Path, **changes) -> Path:
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump({**FLEET, **changes}, sort_keys=False))
    return path


def run_cli(tmp_path: Path, name: str, *flags, **changes) -> Path:
    out = tmp_path / name
    code, _, err = kvsim("run", write(tmp_path, **changes), "--out", out, "--quiet", *flags)
    assert code == 0, err
    return out


def test_least_loaded_sends_a_request_to_the_replica_with_fewest_unfinished():
    # One-second steps, two replicas. r0 (t=0) -> replica 0 (loads 0, 0): prefill [0,1],
    # decodes to 3. r1 (0.5) -> replica 1 (loads 1, 0): [0.5, 3.5]. r2 (0.6) -> replica 0
    # (loads 1, 1: the lower index); prefilled beside r0's decode in [1,2], it ends at 2
    # (one output token). r3 (3.2): replica 0 has finished both (load 0), replica 1 still
    # runs r1 (load 1) -> replica 0, idle since 3: [3.2, 6.2]. Round-robin sends it to 1.
    requests = [
        RequestSpec(0, 0.0, 4, 3),
        RequestSpec(1, 0.5, 4, 3),
        RequestSpec(2, 0.6, 4, 1),
        RequestSpec(3, 3.2, 4, 3),
    ]
    fleet = [PagedAllocator(100, 4), PagedAllocator(100, 4)]
    run = simulate(
        "p",
        requests,
        fleet,
        OneSecondSteps(),
        router="least-loaded",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=False,
        check_invariants=True,
    )
    assert run.replica.tolist() == [0, 1, 0, 0]
    assert [(s.admitted_s, s.first_token_s, s.finish_s) for s in run.seqs] == [
        (0.0, 1.0, 3.0),
        (0.5, 1.5, 3.5),
        (1.0, 2.0, 2.0),
        (3.2, 4.2, 6.2),
    ]
    assert [len(p.steps) for p in run.parts] == [3 + 3, 3] and len(run.steps) == 9
    rr = simulate(
        "p",
        requests,
        [PagedAllocator(100, 4), PagedAllocator(100, 4)],
        OneSecondSteps(),
        router="round-robin",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=False,
    )
    assert rr.replica.tolist() == [0, 1, 0, 1]


def shared(i: int, prompt: int, *segments) -> RequestSpec:
    return RequestSpec(i, 0.0, prompt, 10, tuple(segments))


def test_prefix_aware_follows_sglangs_cache_aware_rules():
    router = PrefixAware(2)
    a, b = (100, 1000), (101, 1000)
    assert router.pick(shared(0, 1100, a), [0, 0]) == 0  # nothing seen: least loaded
    assert router.pick(shared(1, 1100, b), [1, 0]) == 1  # no match: least loaded
    assert router.pick(shared(2, 1100, a), [3, 1]) == 0  # 1000 / 1100 > 0.5: the match
    assert router.pick(shared(3, 2500, a), [3, 1]) == 1  # 1000 / 2500 <= 0.5: least loaded
    assert router.pick(shared(4, 1100, a), [2, 1]) == 0  # both hold 1000: the lower index
    assert router.pick(shared(5, 1100, a), [40, 5]) == 1  # imbalanced: 35 > 32 and 40 > 5.5
    assert router.pick(shared(6, 1100, b), [40, 37]) == 1  # 3 <= 32: balanced, the match
    # A conversation's next turn holds the answer the router never saw: the earlier
    # prompt (1,000 shared + 50 own tokens of content 7) matches, its answer does not.
    router = PrefixAware(3)
    assert router.pick(RequestSpec(7, 0.0, 1050, 30, (a,)), [0, 0, 0]) == 0
    assert router.matched(RequestSpec(8, 0.0, 1100, 10, (a, (7, 80))).prompt_runs) == [1050, 0, 0]


def test_round_robin_and_least_loaded_ignore_content():
    rr = RoundRobin(3)
    assert [rr.pick(None, [9, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert LeastLoaded(3).pick(None, [2, 1, 1]) == 1


def test_a_fleet_of_one_is_a_plain_run_byte_for_byte(tmp_path):
    plain = run_cli(tmp_path, "plain")
    one = run_cli(tmp_path, "one", replicas=1, router="least-loaded")
    for name in ("summary.csv", "summary.json", "requests.parquet", "timeseries.parquet"):
        assert (plain / name).read_bytes() == (one / name).read_bytes(), name
    assert not (one / "replica_summary.csv").exists()


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "prefix-aware"])
def test_fleet_rows_add_up_their_replicas_and_the_fast_path_is_exact(tmp_path, router):
    out = run_cli(tmp_path, "fast", replicas=3, router=router)
    exact = run_cli(tmp_path, "exact", "--exact-steps", replicas=3, router=router)
    for name in ("summary.csv", "replica_summary.csv", "requests.parquet", "timeseries.parquet"):
        assert (out / name).read_bytes() == (exact / name).read_bytes(), name
    fleet = pd.read_csv(out / "summary.csv").set_index("policy")
    parts = pd.read_csv(out / "replica_summary.csv")
    requests = pd.read_parquet(out / "requests.parquet")
    assert (fleet.replicas == 3).all() and (fleet.router == router).all()
    assert set(requests.replica) <= {0, 1, 2}
    for policy, rows in parts.groupby("policy"):
        row = fleet.loc[policy]
        assert list(rows.replica) == [0, 1, 2]
        assert rows.requests_routed.sum() == row.requests_total == 120
        assert rows.requests_completed.sum() == row.requests_completed
        assert rows.preemptions.sum() == row.preemptions and rows.steps.sum() == row.steps
        assert rows.max_batch_size.max() == row.max_batch_size
        assert (rows.kv_capacity_tokens * 3 == row.kv_capacity_tokens).all()
        mine = requests[requests.policy == policy]
        assert mine.groupby("replica").size().tolist() == rows.requests_routed.tolist()
    if router == "round-robin":
        mine = requests[requests.policy == "contiguous"].sort_values("arrival_s", kind="stable")
        assert mine.replica.tolist() == [i % 3 for i in range(120)]


def test_prefix_aware_routing_raises_the_hit_rate_over_round_robin(tmp_path):
    # Four shared prefixes of 600 tokens over three replicas: round-robin sends every
    # prefix to every replica, so each computes each prefix at least once (12 misses,
    # more where a small pool evicts one); prefix-aware keeps a prefix on the replica it
    # went to first while the loads stay within 32 requests of each other.
    rates = {}
    for router in ("round-robin", "prefix-aware"):
        out = run_cli(tmp_path, router, replicas=3, router=router, policies=FLEET["policies"][:1])
        rates[router] = pd.read_csv(out / "summary.csv").prefix_hit_rate[0]
    assert rates["prefix-aware"] > rates["round-robin"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"replicas": 0}, "fleet.yaml: replicas: "),
        ({"router": "random"}, "fleet.yaml: router: "),
    ],
)
def test_bad_fleet_settings_are_one_line_errors(tmp_path, changes, message):
    line = one_error_line(*kvsim("run", write(tmp_path, **changes), "--out", tmp_path / "out"))
    assert message in line
    assert not (tmp_path / "out").exists()
