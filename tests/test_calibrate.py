"""`kvsim calibrate` on CPU with PyTorch (skipped without torch): a quick profile that
loads, reports its held-out error and drives a run."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from helpers import kvsim
from kvsim.cost.profiles import load_profile

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "prof"
    code, stdout, err = kvsim("calibrate", "--model", "llama-3-8b", "--device", "cpu", "--quick", "--out", out)
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}/")
    return out


@pytest.mark.slow
def test_quick_cpu_profile_has_the_documented_format(quick_profile):
    prof = load_profile(quick_profile)
    meta = prof.meta
    assert meta["gpu"] == "cpu" and meta["shape_scale"] == 8 and meta["model"]["hidden_size"] == 4096
    assert meta["measured_shape"]["hidden_size"] == 512
    assert {"torch", "python", "kvsim"} <= set(meta["tools"]) and meta["date"]
    assert sorted(prof.tps) == [1, 2] and (prof.linear.drop(columns=["tp", "num_tokens"]) > 0).all().all()
    rows = prof.attention_rows
    decode = rows[rows.phase == "decode"]
    assert set(decode.block_size) == {16, 32} and set(decode.kv_dtype) == {"bf16", "fp8", "int8"}
    assert set(rows[rows.phase == "prefill"].context) == {0, 128}
    assert set(meta["attention"]["decode_by_dtype"]) == {"bf16", "fp8", "int8"}
    assert "per_block_s" in meta["attention"]["decode"]


@pytest.mark.slow
def test_quick_profile_reports_and_drives_a_run(quick_profile, tmp_path):
    code, out, _ = kvsim("calibrate", "--report", quick_profile, "--json")
    res = json.loads(out)
    assert code == 0 and res["overall_mape"] > 0 and "attn_decode" in res["mape"]
    code, out, _ = kvsim("cost", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--decode-batch", "4",
                         "--context", "100", "--profile", quick_profile, "--json")
    # the quick profile measured shapes 8x narrower, so the real model's KV reads lie beyond it
    label = json.loads(out)["cost_model"]
    # the profile's all-reduce is measured (two gloo workers) unless this machine has one core
    assert label.startswith("profile:cpu-llama-3-8b-quick (measured on cpu) + overhead:splitwise-a100-v2 (")
    assert label.endswith(") [extrapolated in 1/1 steps: decode attention beyond measured work; "
                          "engine overhead at tp 1 (measured 2-8)]")
    scn = tmp_path / "s.yaml"
    scn.write_text(
        "name: t\nmodel: llama-3-8b\ngpu: h100-80gb\nmax_model_len: 1024\nkv_cache_memory_gib: 1\n"
        "workload: {num_requests: 5, arrival: {process: burst}, prompt_tokens: {dist: fixed, value: 100},"
        " output_tokens: {dist: fixed, value: 5}}\npolicies: [{name: p, allocator: paged}]\n")
    code, _, err = kvsim("run", scn, "--out", tmp_path / "o", "--quiet", "--profile", quick_profile)
    assert code == 0, err
    label = pd.read_csv(tmp_path / "o" / "summary.csv").cost_model[0]
    assert label.startswith("profile:cpu-llama-3-8b-quick (measured on cpu)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_without_a_gpu_is_an_input_error(tmp_path):
    code, _, err = kvsim("calibrate", "--model", "llama-3-8b", "--device", "cuda", "--out", tmp_path / "x")
    assert code == 2 and err.startswith("kvsim: error: command line: --device: CUDA is not available")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_quick_profile_times_whole_steps_against_its_prediction(quick_profile):
    """The stored end-to-end check covers prompts, decode batches and a mixed step, and the
    sum of parts lands within 50% of every measured step (forgetting to multiply the
    per-layer parts by 32 layers would miss by over 90%)."""
    if os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
        pytest.skip("other work is loading the machine: CPU timings taken moments apart disagree")
    e2e = load_profile(quick_profile).meta["validation"]
    labels = [r["step"] for r in e2e["steps"]]
    assert labels[0] == "prefill 16" and "decode 4 x 256" in labels and labels[-1].startswith("prefill 64 + decode")
    for r in e2e["steps"]:
        assert r["measured_ms"] > 0 and abs(r["predicted_ms"] / r["measured_ms"] - 1 - r["error"]) < 1e-3
        assert abs(r["error"]) < 0.5, r
    code, out, _ = kvsim("calibrate", "--report", quick_profile)
    assert code == 0 and f"whole forward steps, predicted vs measured: MAPE {e2e['mape']:.1%}" in out


def test_forward_decode_attends_each_sequence_through_its_block_table():
    """Paged decode in kvsim.calibrate.validate equals attention over K and V read slot by slot."""
    from kvsim.cost.model import StepBatch
    from kvsim.calibrate.validate import BLOCK, Forward

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "head_dim": 8, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2,
             "num_layers": 2, "vocab_size": 50}
    net = Forward(torch, shape, "cpu", torch.float32, max_kv_tokens=40 * BLOCK)
    s = net.prepare(StepBatch.build([(20, 0)], [37] * 3))
    slots = s["slots"].tolist()
    assert len(slots) == len(set(slots)) == 23
    kv = torch.randn(2, 40 * BLOCK, 2, 8)
    q = torch.randn(3, 4, 8)
    got = net._decode(kv, q, s["table"], 37)
    for i in range(3):
        at = [int(s["table"][i, t // BLOCK]) * BLOCK + t % BLOCK for t in range(37)]
        assert at[-1] == slots[20 + i]           # the new token is written where it is read
        k, v = (kv[j, at].repeat_interleave(2, dim=1).transpose(0, 1) for j in (0, 1))   # heads, 37, 8
        ref = torch.softmax(q[i][:, None] @ k.transpose(1, 2) / 8 ** 0.5, -1) @ v
        assert torch.allclose(got[i], ref.reshape(-1), atol=1e-5)
    assert net(s).shape == (4, 50)               # logits for the prompt's last token and 3 decodes


@pytest.mark.slow
def test_all_reduce_is_measured_across_cpu_processes_and_charged_per_layer(quick_profile):
    """Two gloo workers time the all-reduce; the cost model charges exactly the fit."""
    from kvsim.calibrate.allreduce import fit

    ar = load_profile(quick_profile).meta["allreduce"]
    if ar["source"].endswith("one core"):
        pytest.skip("one CPU core: no second worker")
    assert ar["source"].startswith("measured: torch.distributed all_reduce (gloo)")
    assert [p["num_tokens"] for p in ar["points"]] == [1, 4, 8, 64, 256] and all(p["time_s"] > 0 for p in ar["points"])
    assert fit(ar["points"], 512) == {k: ar[k] for k in ("latency_s", "bus_gb_s", "fit_mape")}
    code, out, _ = kvsim("cost", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--tp", "2",
                         "--prefill-tokens", "64", "--profile", quick_profile, "--json")
    expected = 32 * 2 * (ar["latency_s"] + 2 * (2 - 1) / 2 * 64 * 4096 * 2 / (ar["bus_gb_s"] * 1e9))
    assert code == 0 and json.loads(out)["parts_s"]["allreduce"] == pytest.approx(expected)


def test_all_reduce_fit_recovers_a_known_ring():
    from kvsim.calibrate.allreduce import fit

    rows = [{"tp": tp, "num_tokens": n, "time_s": 5e-6 + 2 * (tp - 1) / tp * n * 1024 * 2 / 100e9}
            for tp in (2, 4) for n in (1, 64, 4096)]
    got = fit(rows, 1024)
    assert got["latency_s"] == pytest.approx(5e-6) and got["bus_gb_s"] == pytest.approx(100.0)
    assert got["fit_mape"] < 1e-9
