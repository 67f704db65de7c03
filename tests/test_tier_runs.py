"""KV tiers in a run: what they change and what they must not, the fast path against the
plain one, fleets with shared tiers, and bad input."""

import copy
from pathlib import Path

import pytest
import yaml

from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario

from helpers import kvsim, one_error_line

PREFIX = {"name": "prefix", "allocator": "paged", "block_size": 16, "enable_prefix_caching": True}
# A 0.25 GiB pool (2,048 Llama-3-8B token slots) against a corpus of 24,000 tokens.
BASE = {
    "name": "tiers",
    "seed": 5,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 0.25,
    "max_model_len": 2048,
    "cost_model": "calibrated",
    "workload": {
        "num_requests": 80,
        "arrival": {"process": "poisson", "rate_per_s": 8.0},
        "rag": {
            "system_tokens": 64,
            "corpus_docs": 60,
            "doc_tokens": 400,
            "docs_per_request": 2,
            "popularity": "zipf",
            "zipf_s": 1.2,
        },
        "prompt_tokens": {"dist": "lognormal", "mean": 60, "cv": 0.5, "min": 8, "max": 200},
        "output_tokens": {"dist": "lognormal", "mean": 40, "cv": 0.6, "min": 2, "max": 120},
    },
    "policies": [PREFIX],
}


def scenario(policies=None, **top) -> dict:
    doc = copy.deepcopy(BASE)
    if policies is not None:
        doc["policies"] = policies
    doc.update(top)
    return doc


def tiered(name="tiered", **offload) -> dict:
    return {**PREFIX, "name": name, "kv_offload": offload}


def run(doc, **kw):
    return run_scenario(validate_scenario(copy.deepcopy(doc), "tiers"), Path("."), "tiers", **kw)


def test_a_host_tier_gives_back_what_the_gpu_evicted():
    r = run(scenario([PREFIX, tiered(cpu_gib=1.0), tiered("disk", cpu_gib=0.2, disk_gib=1.0)]))
    s = r.summary.set_index("policy")
    gpu, cpu, disk = s.loc["prefix"], s.loc["tiered"], s.loc["disk"]
    assert gpu.prefix_hit_rate_cpu == 0 and gpu.prefix_hit_rate_gpu == gpu.prefix_hit_rate
    assert cpu.prefix_hit_rate_cpu > 0.1 and cpu.prefix_hit_rate > gpu.prefix_hit_rate
    assert disk.prefix_hit_rate_disk > 0 and disk.tier_disk_read_gib > 0
    for row in (cpu, disk):
        parts = row.prefix_hit_rate_gpu + row.prefix_hit_rate_cpu + row.prefix_hit_rate_disk
        assert parts == pytest.approx(row.prefix_hit_rate, abs=1e-9)
        assert 0 < row.tier_load_s and 0 < row.tier_load_share < 1
        assert 0 < row.tier_cpu_occupancy <= 1
    ts = r.timeseries
    assert ts[ts.policy == "disk"].tier_disk_occupancy.max() <= 1


RADIX = {"name": "radix", "allocator": "paged"}  # under engine: sglang, SGLang's radix cache


@pytest.mark.parametrize("policy, top", [(PREFIX, {}), (RADIX, {"engine": "sglang"})], ids=["hash", "hicache"])
def test_a_tier_of_zero_bytes_writes_what_no_tier_writes(tmp_path, policy, top):
    paths = []
    for name, policy in (("none", policy), ("zero", {**policy, "kv_offload": {"cpu_gib": 0}})):
        scn = tmp_path / f"{name}.yaml"
        scn.write_text(yaml.safe_dump(scenario([policy], **top)))
        out = tmp_path / name
        assert kvsim("run", scn, "--out", out, "--quiet")[0] == 0
        paths.append(out)
    for table in ("summary.csv", "summary.json", "timeseries.parquet", "requests.parquet"):
        assert (paths[0] / table).read_bytes() == (paths[1] / table).read_bytes(), table


def test_the_fast_path_gives_the_plain_paths_tables_with_tiers(monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    for workload in ({}, {"conversation": {"turns": 3, "think_time_s": 0.5}}):
        doc = scenario([tiered(cpu_gib=0.2, disk_gib=0.5, policy="arc")])
        if workload:
            doc["workload"].pop("rag")
            doc["workload"].update(workload)
        plain, fast = run(doc, exact_steps=True), run(doc, check_invariants=True)
        for table in ("summary", "timeseries", "requests"):
            a, b = getattr(plain, table), getattr(fast, table)
            assert a.equals(b), table


def test_a_fleet_of_one_with_a_shared_tier_is_one_replica_with_its_own():
    local = run(scenario([tiered(cpu_gib=0.5)]))
    shared = run(scenario([tiered(cpu_gib=0.5, shared=True)], replicas=1))
    drop = ["kv_offload_shared"]
    assert local.summary.drop(columns=drop).equals(shared.summary.drop(columns=drop))
    assert local.timeseries.equals(shared.timeseries)


def test_a_shared_tier_serves_every_replica():
    doc = scenario(
        [tiered("local", cpu_gib=0.25), tiered("shared", cpu_gib=0.25, shared=True)], replicas=3, router="round-robin"
    )
    r = run(doc, check_invariants=True)
    s = r.summary.set_index("policy")
    assert s.loc["shared", "prefix_hit_rate_cpu"] > s.loc["local", "prefix_hit_rate_cpu"]
    # occupancy is of the store each replica sees: its own, or the pooled one
    for policy in ("local", "shared"):
        assert 0.5 < s.loc[policy, "tier_cpu_occupancy"] <= 1
    assert r.timeseries.tier_cpu_occupancy.max() <= 1
    per = r.per_replica.set_index(["policy", "replica"])
    assert per.loc["shared"].tier_cpu_written_gib.nunique() == 1  # one store, counted once


SGLANG = {"engine": "sglang"}


@pytest.mark.parametrize(
    "policy, message, top",
    [
        ({**RADIX, "kv_offload": {"cpu_gib": 1, "disk_gib": 4}}, "disk_gib: SGLang HiCache", SGLANG),
        ({**RADIX, "kv_offload": {"cpu_gib": 1, "shared": True}}, "shared: SGLang HiCache", SGLANG),
        (
            {**RADIX, "prefix_cache": "radix", "kv_offload": {"cpu_gib": 1, "policy": "arc"}},
            "policy: SGLang HiCache",
            {},
        ),
        (
            {**RADIX, "prefix_cache": "hash", "kv_offload": {"hicache_ratio": 2}},
            "hicache_ratio and write_policy",
            SGLANG,
        ),
        ({**PREFIX, "kv_offload": {"cpu_gib": 1, "write_policy": "write_back"}}, "hicache_ratio and write_policy", {}),
        ({**RADIX, "kv_offload": {"hicache_ratio": -1}}, "greater than 0", SGLANG),
        ({**RADIX, "kv_offload": {"cpu_gib": 1, "write_policy": "write_around"}}, "write_through", SGLANG),
        ({**PREFIX, "kv_offload": {"cpu_gib": -1}}, "greater than or equal to 0", {}),
        # sizes whose bytes overflow a float
        ({**PREFIX, "kv_offload": {"cpu_gib": 1e300}}, "cpu_gib: Input should be less than or equal to", {}),
        ({**PREFIX, "kv_offload": {"cpu_gib": 1, "disk_gib": 1e300}}, "disk_gib: Input should be less than", {}),
        ({**RADIX, "kv_offload": {"hicache_ratio": 6.7e299}}, "hicache_ratio: Input should be less than", SGLANG),
        (
            {"name": "c", "allocator": "contiguous", "kv_offload": {"cpu_gib": 1}},
            "contiguous allocation cannot share",
            {},
        ),
        ({**PREFIX, "enable_prefix_caching": False, "kv_offload": {"cpu_gib": 1}}, "set enable_prefix_caching", {}),
        (
            {"name": "r", "allocator": "paged", "prefix_cache": "radix", "kv_offload": {"cpu_gib": 1, "disk_gib": 1}},
            "disk_gib: SGLang HiCache",
            {},
        ),
        ({**PREFIX, "kv_offload": {"cpu_gib": 1, "chunk_tokens": 24}}, "multiple of block_size", {}),
        ({**PREFIX, "kv_offload": {"cpu_gb": 1}}, "cpu_gib", {}),
        ({**PREFIX, "kv_offload": {"cpu_gib": 1, "policy": "mru"}}, "lru", {}),
    ],
)
def test_bad_tiers_are_one_line_errors_and_nothing_is_written(tmp_path, policy, message, top):
    scn = tmp_path / "bad.yaml"
    scn.write_text(yaml.safe_dump(scenario([policy], **top)))
    out = tmp_path / "out"
    line = one_error_line(*kvsim("run", scn, "--out", out))
    assert "kv_offload" in line and message in line
    assert not out.exists()
