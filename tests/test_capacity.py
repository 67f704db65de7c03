"""Capacity: the bracket-and-split search on made-up probes, and a scenario whose answer
is known by hand, end to end through `kvsim capacity` and its --rate inverse.

The hand-made scenario (CONSTANT) makes every step take 10 ms whatever it holds: the
roofline prices a step as max(FLOPs / peak, bytes / HBM bandwidth); the model's 1e10
bf16 parameters are 2e10 bytes to read per step, at 2 TB/s 10 ms; its KV (one layer, one
KV head of 64: 256 B per token) adds under 1e-6 of that, and at 1e9 TFLOPs compute adds
less still. Each request has a 16-token prompt and 5 output tokens: a prefill step that
gives the first token, then 4 decode steps, so it holds its place for 5 steps = 50 ms.
- paged: max_num_seqs = 2 binds (the 0.0001 GiB pool = 419 slots = 26 blocks of 16; a
  request needs 2), so it serves mu = 2 / 50 ms = 40 requests/s;
- contiguous (reserve max): each request reserves max_model_len = 256 of the 419
  slots, so one runs at a time: mu = 20 requests/s.
Arrivals are gamma with cv 0.001, i.e. evenly spaced. Below mu nothing queues for more
than a step: TTFT <= 2 steps = 20 ms, far below the 0.2 s target, so every rate below mu
meets it. Above mu, request i is admitted no earlier than floor(i / 2) x 50 ms (paged;
i x 50 ms contiguous) but arrives at i / rate; p99 of 400 TTFTs is about request 395's,
so a rate misses once 197 x 0.05 - 395 / rate + 0.01 > 0.2 (paged: rate > 40.89) or
395 x 0.05 - 395 / rate + 0.01 > 0.2 (contiguous: rate > 20.19). With tolerance 2% the
highest met rate is at least mu / 1.02 (the lowest missed rate is at least mu) and at
most those bounds: paged in [39.2, 41.0], contiguous in [19.6, 20.25].
"""

from __future__ import annotations

import copy
import io
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvsim.cli.app import main
from kvsim.sweep.capacity import Probe, Search

CONSTANT = {
    "name": "constant",
    "seed": 0,
    "model": {
        "name": "flat",
        "num_layers": 1,
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 64,
        "hidden_size": 64,
        "intermediate_size": 64,
        "params": 1.0e10,
    },
    "gpu": {"name": "slow", "memory_gib": 80, "hbm_tb_s": 2.0, "bf16_tflops": 1.0e9},
    "max_model_len": 256,
    "kv_cache_memory_gib": 0.0001,
    "activation_memory_gib": 0,
    "cost_model": "roofline",
    "workload": {
        "num_requests": 400,
        "arrival": {"process": "gamma", "rate_per_s": 3.0, "cv": 0.001},
        "prompt_tokens": {"dist": "fixed", "value": 16},
        "output_tokens": {"dist": "fixed", "value": 5},
    },
    "scheduler": {"max_num_seqs": 2},
    "slo": {"ttft_p99_s": 0.2},
    "policies": [
        {"name": "contiguous", "allocator": "contiguous", "reserve": "max"},
        {"name": "paged", "allocator": "paged", "block_size": 16},
    ],
}


def write(folder: Path, **changes) -> Path:
    raw = copy.deepcopy(CONSTANT)
    raw.update(changes)
    path = folder / "constant.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def kvsim(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def search(start: float, *results: tuple[float, bool]) -> Search:
    s = Search("p", start)
    s.probes = [Probe("p", rate, 1, 1, met, "", {}) for rate, met in results]
    return s


# --- the search ------------------------------------------------------------------
def test_first_rates_start_at_the_scenarios_rate_then_spread_by_doubling():
    assert search(4).next_rates(1) == [4]
    assert search(4).next_rates(3) == [4, 8, 2]


def test_all_met_doubles_up_all_missed_halves_down():
    assert search(4, (4, True)).next_rates(2) == [8, 16]
    assert search(4, (4, False), (2, False)).next_rates(1) == [1]


def test_a_bracket_is_split_geometrically():
    assert search(4, (2, True), (8, False)).next_rates(1) == pytest.approx([4])
    assert search(4, (2, True), (8, False)).next_rates(3) == pytest.approx([2 * 2**0.5, 4, 4 * 2**0.5])


def test_it_stops_within_the_tolerance_and_reports_the_highest_met_rate():
    s = search(4, (2, True), (2.09, False))
    assert s.done(0.05) and not s.done(0.04)
    assert s.row() == {"policy": "p", "max_rate_per_s": 2, "lowest_missed_rate_per_s": 2.09, "probes": 2, "note": ""}


def test_a_met_rate_above_a_missed_one_does_not_move_the_bracket_and_is_noted():
    s = search(4, (2, True), (3, False), (3.5, True))
    assert (s.highest_met, s.lowest_missed) == (2, 3)
    assert s.row()["note"].startswith("not monotone")


def test_the_bracket_widens_at_most_2_to_the_20_either_way():
    assert search(1, (2.0**20, True)).done(0.05)
    assert "met the targets at every rate tried" in search(1, (2.0**20, True)).row()["note"]
    assert search(1, (2.0**-20, False)).done(0.05)
    row = search(1, (2.0**-20, False)).row()
    assert row["max_rate_per_s"] == 0 and "missed the targets at every rate" in row["note"]
    assert not search(1, (2.0**19, True)).done(0.05)


# --- a scenario with a known answer ----------------------------------------------
def test_the_highest_rate_matches_the_hand_derived_bracket(tmp_path):
    out = tmp_path / "cap"
    code, stdout, stderr = kvsim(
        "capacity", write(tmp_path), "--out", out, "--workers", "2", "--tolerance", "0.02", "--quiet"
    )
    assert code == 0, stderr
    table = pd.read_csv(out / "capacity.csv").set_index("policy")
    assert list(table.columns) == ["max_rate_per_s", "lowest_missed_rate_per_s", "probes", "note"]
    assert 19.6 <= table.max_rate_per_s["contiguous"] <= 20.25
    assert 39.2 <= table.max_rate_per_s["paged"] <= 41.0
    assert (table.lowest_missed_rate_per_s / table.max_rate_per_s <= 1.02).all()
    probes = pd.read_csv(out / "probes.csv")
    assert (probes[probes.met].ttft_p99_s <= 0.2).all() and (probes[~probes.met].ttft_p99_s > 0.2).all()
    assert {p.name for p in out.iterdir()} == {"capacity.csv", "probes.csv", "capacity.png", "capacity.json"}


def test_the_fewest_gpus_for_a_rate(tmp_path):
    # 30/s: paged serves 40/s on one GPU; contiguous 20/s on one. Two GPUs serve it both
    # ways: as tp 2 (steps of 5 ms, a pool of 838 slots holds 3 regions, max_num_seqs caps
    # it at 2: 2 / 25 ms = 80/s), and as two tp-1 replicas, round-robin sending each an
    # evenly spaced 15/s, below its 20/s. The smaller tp is reported, the other noted.
    out = tmp_path / "gpus"
    code, stdout, stderr = kvsim("capacity", write(tmp_path), "--rate", "30", "--out", out, "--workers", "2")
    assert code == 0, stderr
    table = pd.read_csv(out / "capacity.csv").set_index("policy")
    assert table.gpus.to_dict() == {"contiguous": 2, "paged": 1}
    assert table.loc["contiguous", ["tensor_parallel_size", "replicas"]].tolist() == [1, 2]
    assert table.note["contiguous"] == "also met: tp 2 x 1"
    assert "x replicas 1, 2, 3, 4, 6, 8; round-robin router" in stdout
    probes = pd.read_csv(out / "probes.csv")
    # paged: 1 GPU (met); contiguous: 1 GPU (missed), then both layouts of 2
    assert sorted(zip(probes.policy, probes.tensor_parallel_size, probes.replicas, probes.met)) == [
        ("contiguous", 1, 1, False),
        ("contiguous", 1, 2, True),
        ("contiguous", 2, 1, True),
        ("paged", 1, 1, True),
    ]


def test_slo_on_the_command_line_replaces_the_scenarios(tmp_path):
    # A 10 s TTFT target is met up to about 20 / (1 - 20 x 10 / 395) = 40.5/s contiguous, so
    # the lowest rate tried (3/s) meets it; --policy runs one policy.
    out = tmp_path / "cap"
    code, stdout, _ = kvsim(
        "capacity",
        write(tmp_path),
        "--slo",
        "ttft_p99_s=10",
        "--policy",
        "contiguous",
        "--out",
        out,
        "--workers",
        "1",
        "--tolerance",
        "0.1",
    )
    assert code == 0
    table = pd.read_csv(out / "capacity.csv")
    assert list(table.policy) == ["contiguous"] and 20 < table.max_rate_per_s[0] <= 40.6
    assert "ttft_p99_s <= 10 s" in stdout


@pytest.mark.parametrize(
    "changes, args, message",
    [
        ({"slo": None}, [], "command line: --slo: the scenario has no slo: block"),
        ({}, ["--slo", "ttft=1"], "command line: --slo: 'ttft=1' is not NAME=SECONDS"),
        (
            {"workload": {**CONSTANT["workload"], "arrival": {"process": "burst"}}},
            [],
            "workload.arrival: capacity varies the arrival rate",
        ),
        ({}, ["--policy", "nope"], "--policy: no policy 'nope'"),
        ({"kv_cache_memory_gib": 1.0e-7}, [], "holds not even one block"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, changes, args, message):
    code, _, stderr = kvsim("capacity", write(tmp_path, **changes), "--out", tmp_path / "out", "--workers", "1", *args)
    assert code == 2 and message in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_tp_whose_weights_do_not_fit_is_a_miss_with_its_reason(tmp_path):
    # 60e9 bf16 parameters = 111.8 GiB: at tp 1 they exceed 0.9 x 80 GiB, at tp 2 (55.9 GiB
    # per GPU) they leave 16 GiB per GPU for KV. Steps take 60 ms / tp, so at tp 2 paged
    # serves 2 / (5 x 30 ms) = 13/s, above 1/s. (A pool given as kv_cache_memory_gib is
    # taken as given, so this scenario sizes it from gpu_memory_utilization; 32 KiB of KV
    # per token keeps the pool's blocks few.)
    model = {**CONSTANT["model"], "params": 6.0e10, "num_kv_heads": 64, "head_dim": 128}
    out = tmp_path / "gpus"
    code, _, stderr = kvsim(
        "capacity",
        write(tmp_path, model=model, kv_cache_memory_gib=None),
        "--rate",
        "1",
        "--out",
        out,
        "--workers",
        "2",
        "--policy",
        "paged",
        "--quiet",
    )
    assert code == 0, stderr
    probes = pd.read_csv(out / "probes.csv")
    first = probes[probes.tensor_parallel_size == 1].iloc[0]
    assert not first.met and "no memory left for the KV cache" in first.why
    assert pd.read_csv(out / "capacity.csv").gpus[0] == 2
    assert math.isnan(first.ttft_p99_s)
