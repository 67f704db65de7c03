"""What the commands print fits 100 columns: `kvsim run`'s table, notes and verdict
(`--wide` for everything), `kvsim sweep`'s table per swept field, `kvsim compare`'s
verdict, `kvsim capacity`'s answer, `kvsim reproduce`'s claims, and what `kvsim memory`,
`kvsim flags` and `kvsim cache-curve` print."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from helpers import kvsim
from kvsim.cli.table import WIDTH, capacity_lines, claim_lines, layout, run_table, seconds, sweep_tables

LONG = "paged-16-prefix-with-a-rather-long-policy-name"
COST = (
    "profile:h100-llama-3-8b + overhead:splitwise-a100-v2 (on h100-80gb: links x1.5) [extrapolated "
    "in 4542/4542 steps: engine overhead at tp 1 (measured 2-8); prefill_cached attention beyond "
    "measured work]"
)

SCENARIO = {
    "name": "tiny",
    "seed": 3,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 4096,
    "kv_cache_memory_gib": 1,
    "cost_model": "calibrated",
    "workload": {
        "num_requests": 40,
        "arrival": {"process": "poisson", "rate_per_s": 20.0},
        "prompt_tokens": {"dist": "lognormal", "mean": 800, "cv": 0.5, "min": 16, "max": 3000},
        "output_tokens": {"dist": "lognormal", "mean": 100, "cv": 0.5, "min": 4, "max": 500},
    },
    "slo": {"ttft_p99_s": 2.0, "tpot_p50_s": 0.1},
    "policies": [
        {"name": "contiguous-oracle", "allocator": "contiguous", "reserve": "oracle"},
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
        {"name": LONG, "allocator": "paged", "block_size": 16, "enable_prefix_caching": True},
    ],
}


def summary_row(policy: str, **values) -> dict:
    row = dict(
        policy=policy,
        kv_utilization=0.993,
        mean_batch_size=141.4,
        achievable_batch_size=150.0,
        limited_by_memory=0.1,
        limited_by_token_budget=0.67,
        limited_by_arrivals=0.23,
        throughput_tok_s=12345.0,
        ttft_p50_s=73.6,
        ttft_p99_s=1234.5,
        tpot_p50_s=0.2061,
        tpot_p99_s=0.0123,
        prefix_hit_rate=0.209,
        preemptions=305,
        requests_rejected=2,
        fraction_basis="memory",
        engine="vllm-v1",
        cost_model=COST,
    )
    return {**row, **values}


def widest(text: str) -> int:
    """The longest line, not counting the last one, which names the output folder."""
    return max(len(line) for line in text.splitlines()[:-1])


def test_seconds_keep_latencies_short():
    assert [seconds(x) for x in (0.144, 0.0073, 70.8, 1234.5, float("nan"))] == [
        "144ms",
        "7.3ms",
        "70.8s",
        "1,234s",
        "n/a",
    ]


def test_a_table_too_wide_cuts_only_the_first_column_and_groups_sit_under_their_heading():
    lines = layout(["policy", ("TTFT", "p50"), ("TTFT", "p99")], [["x" * 200, "1s", "2s"]], width=30)
    assert max(map(len, lines)) <= 30 and lines[2].startswith("x" * 10) and "…" in lines[2]
    assert lines[0].strip() == "TTFT" and lines[1].endswith("p50 p99")


def test_the_run_table_fits_with_targets_long_names_and_every_optional_column_that_fits():
    summary = pd.DataFrame([summary_row("contiguous"), summary_row(LONG)])
    lines = run_table(summary, {"ttft_p99_s": 2.0}, caching=True)
    assert max(map(len, lines)) <= WIDTH
    head = lines[0] + lines[1]
    for heading in ("util", "batch", "limited by", "tok/s", "TTFT", "TPOT", "p50", "p99", "SLO"):
        assert heading in head, heading
    assert "token budget 67%" in lines[2] and "miss" in lines[2] and "1,234s" in lines[2]
    short = run_table(pd.DataFrame([summary_row("a")]), caching=True)
    assert "prefix" in short[0] and "preempt" in short[1] and "rejected" in short[1]


def test_kvsim_run_prints_essentials_within_100_columns_and_everything_with_wide(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    code, out, err = kvsim("run", path, "--out", tmp_path / "a")
    assert code == 0, err
    assert widest(out) <= WIDTH, out
    assert "verdict: " in out and "TTFT" in out and "SLO" in out and "step costs:" in out
    assert out.rstrip().endswith("wrote " + str(tmp_path / "a") + "/")
    code, wide, err = kvsim("run", path, "--out", tmp_path / "a", "--wide")
    assert code == 0, err
    for heading in ("internal", "external", "achv batch", "e2e p99 s", "ttft p90 s", "basis"):
        assert heading in wide, heading
    assert widest(wide) > WIDTH and f"step costs of {LONG}:" in wide
    assert LONG + " at 20 req/s" in wide  # each policy's sentence


def test_compare_echoes_its_verdict(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    assert kvsim("run", path, "--out", tmp_path / "a", "--quiet")[0] == 0
    code, out, err = kvsim("compare", tmp_path / "a", "--out", tmp_path / "cmp")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("verdict: Pick ") or lines[0].startswith("verdict: No policy meets")
    assert any(line.startswith(f"- {LONG} at 20 req/s") for line in lines)
    assert widest(out) <= WIDTH


def test_sweep_prints_a_compact_table_per_swept_field(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**SCENARIO, "policies": SCENARIO["policies"][:2]}))
    (tmp_path / "grid.yaml").write_text(
        yaml.safe_dump(
            {
                "scenario": "tiny.yaml",
                "set": {"workload.num_requests": 20},
                "grid": {"workload.arrival.rate_per_s": [5, 10], "policies[allocator=paged].block_size": [16, 32]},
                "seeds": [0],
            }
        )
    )
    code, out, err = kvsim("sweep", tmp_path / "grid.yaml", "--out", tmp_path / "sw", "--workers", 1)
    assert code == 0, err
    assert widest(out) <= WIDTH, out
    assert "arrival rate (req/s): means over block_size (paged policies) and seeds" in out
    assert "block_size (paged policies): means over arrival rate (req/s) and seeds" in out
    assert out.count("policy") >= 2 and "tok/s" in out


def test_sweep_tables_average_over_the_other_fields():
    summary = pd.DataFrame(
        {
            "a": [1, 1, 2, 2],
            "b": ["x", "y", "x", "y"],
            "policy": ["p"] * 4,
            "throughput_tok_s": [10.0, 20.0, 30.0, 50.0],
        }
    )
    lines = sweep_tables(summary, ["a", "b"])
    rows = [line.split() for line in lines if line.startswith("p ")]
    assert rows == [["p", "1", "15"], ["p", "2", "40"], ["p", "x", "20"], ["p", "y", "35"]]


def test_capacity_and_claims_lines_fit():
    table = pd.DataFrame(
        {
            "policy": [LONG],
            "max_rate_per_s": [25.76784531],
            "lowest_missed_rate_per_s": [26.9],
            "probes": [9],
            "note": ["not monotone: a higher rate met the targets " * 3],
        }
    )
    lines = capacity_lines("highest arrival rate within ttft_p99_s <= 1 s " * 3, table)
    assert max(map(len, lines)) <= WIDTH and "25.77" in "\n".join(lines)
    claims = pd.DataFrame(
        {
            "id": ["8b"],
            "verdict": ["holds"],
            "claim": ["beam search " * 30],
            "measured": ["x" * 300],
            "expected": ["y " * 80],
        }
    )
    lines = claim_lines(claims)
    assert max(map(len, lines)) <= WIDTH and lines[0].startswith("8b: holds: beam search")
    assert any(line.startswith("    measured: ") for line in lines)


@pytest.mark.slow
def test_reproduce_prints_lines_that_fit(tmp_path):
    code, out, err = kvsim("reproduce", "--quick", "--claim", "2", "--out", tmp_path / "claims")
    assert code == 0, err
    assert widest(out) <= WIDTH and out.startswith("2: ")


def test_memory_flags_and_cache_curve_print_within_100_columns(tmp_path):
    """kvsim memory (each engine's pool and vLLM's log lines), kvsim flags (each flag's
    meaning, wrapped under its column) and kvsim cache-curve's summary line."""
    code, out, err = kvsim("memory", "--model", "gemma-3-27b", "--context", "8192", "--gpu", "h100-80gb")
    assert code == 0, err
    assert widest(out) <= WIDTH and "per GPU from" in " ".join(out.split())
    for engine in ("vllm", "sglang"):
        code, out, err = kvsim("flags", "--engine", engine, "--all")
        assert code == 0 and widest(out) <= WIDTH, err
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 100}, "input_length": 1024, "output_length": 8, "hash_ids": [{i % 3}, {i}]}}\n'
            for i in range(20)
        )
    )
    code, out, err = kvsim("cache-curve", trace, "--out", tmp_path / "cc")
    assert code == 0, err
    assert widest(out) <= WIDTH and "block references" in out
