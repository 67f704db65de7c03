"""`kvsim calibrate` on CPU with PyTorch (skipped without torch): a quick profile that
loads, reports its held-out error and drives a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from helpers import kvsim
from kvsim.cost.profiles import load_profile

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """A quick CPU profile, timed on one thread: PyTorch's threads wait for each other at
    every op, so on a machine the suite shares with other work the default (a thread per
    core) took minutes instead of seconds."""
    out = tmp_path_factory.mktemp("cal") / "prof"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, stdout, err = kvsim("calibrate", "--model", "llama-3-8b", "--device", "cpu", "--quick", "--out", out)
    finally:
        torch.set_num_threads(threads)
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
    # vLLM V0: the engine whose default overhead (splitwise-a100-v2) was measured at tp 2-8
    code, out, _ = kvsim(
        "cost",
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100-80gb",
        "--decode-batch",
        "4",
        "--context",
        "100",
        "--profile",
        quick_profile,
        "--engine",
        "vllm-v0",
        "--json",
    )
    # the quick profile measured shapes 8x narrower, so the real model's KV reads lie beyond it
    label = json.loads(out)["cost_model"]
    # the profile's all-reduce is measured (two gloo workers) unless this machine has one core
    assert label.startswith("profile:cpu-llama-3-8b-quick (measured on cpu) + overhead:splitwise-a100-v2 (")
    assert label.endswith(
        ") [extrapolated in 1/1 steps: decode attention beyond measured work; engine overhead at tp 1 (measured 2-8)]"
    )
    scn = tmp_path / "s.yaml"
    scn.write_text(
        "name: t\nmodel: llama-3-8b\ngpu: h100-80gb\nmax_model_len: 1024\nkv_cache_memory_gib: 1\n"
        "workload: {num_requests: 5, arrival: {process: burst}, prompt_tokens: {dist: fixed, value: 100},"
        " output_tokens: {dist: fixed, value: 5}}\npolicies: [{name: p, allocator: paged}]\n"
    )
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
    shape = {
        "hidden_size": 32,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "num_layers": 2,
        "vocab_size": 50,
    }
    net = Forward(torch, shape, "cpu", torch.float32, max_kv_tokens=40 * BLOCK)
    s = net.prepare(StepBatch.build([(20, 0)], [37] * 3))
    slots = s["slots"].tolist()
    assert len(slots) == len(set(slots)) == 23
    kv = torch.randn(2, 40 * BLOCK, 2, 8)
    q = torch.randn(3, 4, 8)
    got = net._decode(kv, q, s["table"], 37)
    for i in range(3):
        at = [int(s["table"][i, t // BLOCK]) * BLOCK + t % BLOCK for t in range(37)]
        assert at[-1] == slots[20 + i]  # the new token is written where it is read
        k, v = (kv[j, at].repeat_interleave(2, dim=1).transpose(0, 1) for j in (0, 1))  # heads, 37, 8
        ref = torch.softmax(q[i][:, None] @ k.transpose(1, 2) / 8**0.5, -1) @ v
        assert torch.allclose(got[i], ref.reshape(-1), atol=1e-5)
    assert net(s).shape == (4, 50)  # logits for the prompt's last token and 3 decodes


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
    code, out, _ = kvsim(
        "cost",
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100-80gb",
        "--tp",
        "2",
        "--prefill-tokens",
        "64",
        "--profile",
        quick_profile,
        "--json",
    )
    expected = 32 * 2 * (ar["latency_s"] + 2 * (2 - 1) / 2 * 64 * 4096 * 2 / (ar["bus_gb_s"] * 1e9))
    assert code == 0 and json.loads(out)["parts_s"]["allreduce"] == pytest.approx(expected)


def test_all_reduce_fit_recovers_a_known_ring():
    from kvsim.calibrate.allreduce import fit

    rows = [
        {"tp": tp, "num_tokens": n, "time_s": 5e-6 + 2 * (tp - 1) / tp * n * 1024 * 2 / 100e9}
        for tp in (2, 4)
        for n in (1, 64, 4096)
    ]
    got = fit(rows, 1024)
    assert got["latency_s"] == pytest.approx(5e-6) and got["bus_gb_s"] == pytest.approx(100.0)
    assert got["fit_mape"] < 1e-9


class _FakeGPU:
    """A host and a GPU on one virtual clock (seconds): each timed call takes the host
    `host_s` to enqueue and the GPU `kernel_s` to run; _sleep spins 2e9 cycles a second."""

    def __init__(self, host_s: float, kernel_s: float):
        self.host, self.free, self.host_s, self.kernel_s = 0.0, 0.0, host_s, kernel_s
        gpu = self

        class Event:
            def __init__(self, enable_timing):
                self.at = None

            def record(self):
                self.at = gpu.free = max(gpu.free, gpu.host)

            def query(self):
                return self.at <= gpu.host

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        self.Event = Event

    def _sleep(self, cycles):
        self.free = max(self.free, self.host) + cycles / 2e9

    def synchronize(self):
        self.host = max(self.host, self.free)

    def call(self):
        self.host += self.host_s  # the last kernel is enqueued when the host is done
        self.free = max(self.free, self.host) + self.kernel_s


def test_cuda_timer_keeps_the_hosts_launch_latency_out():
    from types import SimpleNamespace
    from kvsim.calibrate.measure import Timer

    gpu = _FakeGPU(host_s=3e-3, kernel_s=0.5e-3)
    fed = Timer(SimpleNamespace(cuda=gpu), "cuda", warmup=0, reps=3)
    assert fed(gpu.call) == pytest.approx(0.5e-3)
    assert fed.spin == 4 * Timer.SPIN_CYCLES  # 1 and 2 ms spins ended before the 3 ms enqueue
    launched = Timer(SimpleNamespace(cuda=gpu), "cuda", warmup=0, reps=3, launched=True)
    assert launched(gpu.call) == pytest.approx(3.5e-3)


H200 = Path(__file__).parent / "data" / "h200-calibrate"


def test_against_prediction_reads_the_error_of_kvsims_prediction_before_a_gpu_was_measured(tmp_path):
    """A profile whose every linear op takes 0.8 of kvsim's prediction: predicted / measured
    - 1 = +25% for each op and for a step, at any token count."""
    from kvsim.cost.accuracy import report
    from kvsim.cost.generalize import fits_for, model_shape, predict_linear
    from kvsim.cost.profiles import Profile, save_profile
    from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS

    shape = model_shape(MODEL_PRESETS["llama-3-8b"])
    linear = predict_linear(fits_for(GPU_PRESETS["h200"]), shape, [1, 2], [1, 64, 512, 4096])
    ops = [c for c in linear.columns if c not in ("tp", "num_tokens")]
    linear[ops] *= 0.8
    meta = {**load_profile("a100-llama-3-8b").meta, "name": "mine", "gpu": "h200", "origin": {}}
    save_profile(Profile(meta, linear), tmp_path / "mine")
    vs = report(load_profile(tmp_path / "mine"))["against_prediction"]
    assert "scaled to h200's 4.8 TB/s HBM" in vs["prediction"]
    assert {e["median"] for e in vs["ops"].values()} == {0.25}
    assert vs["step"] == {k: {"median": 0.25, "mape": 0.25} for k in ("<= 128 tokens", "> 128 tokens")}
    code, out, _ = kvsim("calibrate", "--report", tmp_path / "mine")
    assert code == 0 and out.splitlines()[-1].split() == "a step's linear ops, > 128 tokens +25.0% 25.0%".split()
    assert "against_prediction" not in report(load_profile("a100-llama-3-8b"))  # shipped: in-sample


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-7b"])
def test_h200_profiles_measured_here_predict_their_recorded_steps(model):
    """The profiles `kvsim calibrate` measured on a lent H200 (tests/data/h200-calibrate,
    scripts/device_calibrate.sh) load, and the cost model, reading them back from disk,
    predicts the whole steps they recorded as calibrate did before writing them."""
    from kvsim.calibrate.validate import BLOCK, steps
    from kvsim.cost.model import Profiled
    from kvsim.model.specs import GPU_PRESETS, KVSpec, MODEL_PRESETS

    prof = load_profile(H200 / model)
    assert prof.meta["device"] == "NVIDIA H200" and prof.meta["tools"]["cuda"]
    m = MODEL_PRESETS[model]
    cost = Profiled(m, GPU_PRESETS["h200"], KVSpec(m, "bf16"), 1, prof, BLOCK)
    recorded = {r["step"]: r["predicted_ms"] for r in prof.meta["validation"]["steps"]}
    assert set(recorded) == {label for label, _ in steps(quick=False)}
    for label, batch in steps(quick=False):
        assert cost.step_time(batch) * 1e3 == pytest.approx(recorded[label], rel=1e-3), label


def test_whole_steps_are_timed_only_where_the_models_weights_fit():
    """Llama-3-70B: 70,552,387,584 weights (kvsim.calibrate.validate's layers, embedding and
    LM head) x 2 B = 131.4 GiB, against 90% of the GPU's free memory."""
    from types import SimpleNamespace
    from kvsim.calibrate.validate import no_room
    from kvsim.cost.generalize import model_shape
    from kvsim.model.specs import MODEL_PRESETS

    shape = model_shape(MODEL_PRESETS["llama-3-70b"])

    def gpu(free_gib):
        return SimpleNamespace(tensor=torch.tensor, cuda=SimpleNamespace(mem_get_info=lambda: (free_gib * 2**30, 0)))

    assert (
        no_room(gpu(139), shape, "cuda", torch.bfloat16)
        == "the model's 131 GiB of weights do not fit in 90% of the GPU's 139 GiB free"
    )
    assert no_room(gpu(147), shape, "cuda", torch.bfloat16) is None
    assert no_room(gpu(139), shape, "cpu", torch.bfloat16) is None


def test_a_profile_without_whole_steps_reports_its_ops_and_the_prediction():
    """Llama-3-70B measured on the H200, whose weights did not fit for the whole-step check."""
    code, out, _ = kvsim("calibrate", "--report", H200 / "llama-3-70b")
    assert code == 0 and "whole forward steps" not in out
    assert out.startswith("h200-llama-3-70b: held-out MAPE") and "kvsim's prediction without this profile" in out
