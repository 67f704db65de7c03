"""Engine overheads and tensor-parallel communication: the model, its fit, the
shipped file, the transfer to other GPUs, BLOOM-176B and the A100-40GB.

Expected values are worked out by hand from the formulas in kvsim/cost/overhead.py.
Tests that read the measured serving data skip when ../shared/data/serving is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvsim.cost.generalize import model_shape, synthesize
from kvsim.cost.model import Profiled, StepBatch, make_cost_model
from kvsim.cost.overhead import NONE, SHIPPED, Comm, Overhead, from_file, load_overhead
from kvsim.cost.overhead_fit import configurations, fit_overhead, nnls, predict
from kvsim.config.errors import InputError
from kvsim.config.scenario import InlineOverhead, ProfileCost
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, GPUSpec, KVSpec
from helpers import kvsim
from test_cost_cli import SCENARIO

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "serving"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data/serving not present")
SHIPPED_DOC = json.loads((SHIPPED / "splitwise-a100-v2.json").read_text())


def cost(choice="calibrated", model="llama-2-70b", gpu="a100-80gb", tp=2):
    m = MODEL_PRESETS[model]
    return make_cost_model(choice, m, GPU_PRESETS[gpu], KVSpec(m, "fp16"), tp)


# --- the model ----------------------------------------------------------------------
def test_comm_is_two_ring_all_reduces_per_layer_with_a_large_step_term():
    comm = Comm(latency_per_hop_s=10e-6, bus_gb_s=100)
    # tp 4: 3 hops x 10 us, plus 2 x 3/4 x 1,000 x 2 B = 3,000 B per token x 100 tokens / 100 GB/s = 3 us;
    # two all-reduces in each of 2 layers.
    assert comm.seconds(4, 2, 1000, 100) == pytest.approx(4 * 33e-6)
    large = Comm(latency_per_hop_s=10e-6, bus_gb_s=100, large_step_tokens=60, large_step_bus_gb_s=10)
    # 40 tokens beyond the knee: 40 x 3,000 B / 10 GB/s = 12 us more per all-reduce.
    assert large.seconds(4, 2, 1000, 100) == pytest.approx(4 * 45e-6)
    assert large.seconds(4, 2, 1000, 60) == pytest.approx(4 * (30e-6 + 1.8e-6))
    assert large.seconds(1, 2, 1000, 100) == 0.0


def test_host_part_and_transfer_to_other_gpus():
    o = Overhead(
        "overhead:x",
        1e-3,
        0.5e-3,
        1e-6,
        Comm(latency_per_hop_s=10e-6, bus_gb_s=240, large_step_tokens=2048, large_step_bus_gb_s=40),
        gpu="a100-80gb",
    )
    assert o.host(3, 100) == pytest.approx(
        {"overhead_step": 1e-3, "overhead_seqs": 1.5e-3, "overhead_prompt_tokens": 1e-4}
    )
    h100 = o.for_gpu(GPU_PRESETS["h100-80gb"])  # NVLink 900 / 600 GB/s
    assert (h100.comm.bus_gb_s, h100.comm.large_step_bus_gb_s) == pytest.approx((360, 60))
    assert h100.comm.latency_per_hop_s == 10e-6 and h100.host(3, 100) == o.host(3, 100)
    assert h100.label == "overhead:x (on h100-80gb: links x1.5)"
    assert o.for_gpu(GPU_PRESETS["a100-40gb"]).comm == o.comm  # the same NVLink 3
    assert o.for_gpu(GPU_PRESETS["a100-80gb"]) is o
    custom = o.for_gpu(GPUSpec("custom", 80, 2.0, 300))
    assert custom.comm == o.comm and "no NVLink figure for custom" in custom.label


def test_kernel_launches_show_only_where_the_device_is_faster():
    o = Overhead("overhead:x", launch_per_layer_s=0.5e-3, comm=Comm(bus_gb_s=240), gpu="a100-80gb")
    # 10 layers x 0.5 ms = 5 ms of launches: a 3 ms device step waits 2 ms for them, a 6 ms one none.
    assert o.launch_wait(10, 3e-3) == pytest.approx(2e-3)
    assert o.launch_wait(10, 6e-3) == 0.0
    assert o.for_gpu(GPU_PRESETS["h100-80gb"]).launch_per_layer_s == 0.5e-3  # CPU time: carried as is


def test_calibrated_names_the_overhead_and_none_gives_the_kernel_step():
    calibrated, none = cost(), cost(ProfileCost(overhead="none"))
    assert calibrated.label == "profile:a100-llama-2-70b + overhead:splitwise-a100-v2"
    assert none.label == "profile:a100-llama-2-70b + overhead:none"
    step = StepBatch.build([], [576])
    parts = none.breakdown(step)
    # The profile's assumed ring: 80 layers x 2 x (8 us + 1 x 8,192 x 2 B / 240 GB/s); no host part.
    assert parts["allreduce"] == pytest.approx(160 * (8e-6 + 8192 * 2 / 240e9))
    assert parts["overhead_step"] == parts["overhead_seqs"] == parts["overhead_prompt_tokens"] == 0
    assert parts["overhead_launch"] == 0
    host, comm = SHIPPED_DOC["host"], SHIPPED_DOC["comm"]
    with_it = calibrated.breakdown(step)
    assert with_it["overhead_step"] == pytest.approx(host["step_ms"] * 1e-3)
    assert with_it["overhead_seqs"] == pytest.approx(host["per_seq_ms"] * 1e-3)
    assert with_it["allreduce"] == pytest.approx(160 * (comm["latency_per_hop_us"] * 1e-6 + 8192 * 2 / 240e9))
    device = sum(v for k, v in with_it.items() if not k.startswith("overhead"))
    assert with_it["overhead_launch"] == pytest.approx(max(0.0, 80 * host["launch_per_layer_ms"] * 1e-3 - device))
    small = cost(tp=8).breakdown(step)  # tp 8: the kernels and all-reduces take less than the launches
    device8 = sum(v for k, v in small.items() if not k.startswith("overhead"))
    assert small["overhead_launch"] == pytest.approx(80 * host["launch_per_layer_ms"] * 1e-3 - device8)
    assert small["overhead_launch"] > 0 and sum(small.values()) == pytest.approx(
        small["overhead_step"] + small["overhead_seqs"] + 80 * host["launch_per_layer_ms"] * 1e-3
    )
    kernels = {k: v for k, v in parts.items() if k != "allreduce"}
    assert kernels == {k: v for k, v in with_it.items() if k in kernels and not k.startswith("overhead")} | {
        k: 0.0 for k in kernels if k.startswith("overhead")
    }


def test_inline_overhead_and_its_deprecated_spelling():
    inline = cost(ProfileCost(overhead=InlineOverhead(step_ms=2, per_seq_ms=0.5)))
    parts = inline.breakdown(StepBatch.build([], [100] * 4))
    assert (parts["overhead_step"], parts["overhead_seqs"]) == pytest.approx((2e-3, 2e-3))
    assert parts["allreduce"] == pytest.approx(160 * (8e-6 + 4 * 8192 * 2 / 240e9))  # the profile's
    assert inline.label == "profile:a100-llama-2-70b + overhead:step 2 ms, per seq 0.5 ms"
    launched = cost(ProfileCost(overhead=InlineOverhead(launch_per_layer_ms=1)), tp=8)
    assert launched.label.endswith("overhead:launch per layer 1 ms")
    step = launched.breakdown(StepBatch.build([], [100]))
    device = sum(v for k, v in step.items() if not k.startswith("overhead"))
    assert device < 80e-3 and step["overhead_launch"] == pytest.approx(80e-3 - device)  # 80 layers x 1 ms
    old = cost(ProfileCost(step_overhead_ms=2))
    assert old.breakdown(StepBatch.build([], [100]))["overhead_step"] == pytest.approx(2e-3)
    with pytest.raises(InputError, match="not both"):
        cost(ProfileCost.model_construct(step_overhead_ms=2, overhead="none", profile=None))


def test_the_roofline_takes_no_overhead():
    assert cost("roofline").label == "roofline"


# --- the fit ------------------------------------------------------------------------
def test_nnls_clips_at_zero_and_otherwise_solves():
    assert nnls(np.eye(2), np.array([1.0, -1.0])) == pytest.approx([1.0, 0.0])
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nnls(a, a @ np.array([2.0, 0.5])) == pytest.approx([2.0, 0.5])


def synthetic_points(
    step_ms=5.0, per_seq_ms=0.2, per_token_ms=0.01, hop_us=20.0, bus=240.0, knee=2048, large_bus=50.0, launch_ms=0.0
) -> pd.DataFrame:
    """Steps priced by hand with known coefficients (the module docstring's formula)."""
    rows = []
    for layers, hidden in ((80, 8192), (70, 14336)):
        for tp in (2, 4, 8):
            for seqs, prompt in ((1, 0), (32, 0), (1, 512), (4, 1024), (1, 8192), (16, 512)):
                tokens = seqs * prompt or seqs
                gb = 2 * layers * 2 * (tp - 1) / tp * hidden * 2 / 1e9
                host = step_ms + per_seq_ms * seqs + per_token_ms * seqs * prompt
                kernel = 10.0 + 0.1 * tokens
                device = (
                    kernel
                    + 2 * layers * (tp - 1) * hop_us / 1e3
                    + gb * tokens / bus * 1e3
                    + gb * max(tokens - knee, 0) / large_bus * 1e3
                )
                rows.append(
                    {
                        "layers": layers,
                        "hidden": hidden,
                        "tp": tp,
                        "seqs": seqs,
                        "prefill_tokens": seqs * prompt,
                        "new_tokens": tokens,
                        "kernel_ms": kernel,
                        "measured_ms": host + max(device, layers * launch_ms),
                    }
                )
    return pd.DataFrame(rows)


def test_fit_recovers_known_coefficients():
    fit = fit_overhead(synthetic_points(), 240.0)
    assert fit["host"] == pytest.approx(
        {"step_ms": 5.0, "per_seq_ms": 0.2, "per_prefill_token_ms": 0.01, "launch_per_layer_ms": 0.0}, rel=1e-6
    )
    assert fit["comm"]["latency_per_hop_us"] == pytest.approx(20.0, rel=1e-6)
    assert fit["comm"]["large_step_tokens"] == 2048
    assert fit["comm"]["large_step_bus_gb_s"] == pytest.approx(50.0, rel=1e-6)
    assert fit["mape"] < 1e-9
    free = fit_overhead(synthetic_points(bus=100.0), None)
    assert free["comm"]["bus_gb_s"] == pytest.approx(100.0, rel=1e-6)
    pts = synthetic_points()
    assert predict(fit, pts) == pytest.approx(pts.measured_ms.to_numpy())


def test_fit_recovers_a_launch_time_that_hides_small_steps():
    # 0.4 ms x 80 layers = 32 ms of launches: single decodes at tp 4 (10.1 + 9.6 ms hop latency) are
    # launch-bound, those at tp 8 (10.1 + 22.4 ms) device-bound, and prefills device-bound.
    pts = synthetic_points(launch_ms=0.4)
    fit = fit_overhead(pts, 240.0)
    assert fit["host"]["launch_per_layer_ms"] == pytest.approx(0.4)
    assert fit["host"]["step_ms"] == pytest.approx(5.0, rel=1e-6)
    assert fit["comm"]["latency_per_hop_us"] == pytest.approx(20.0, rel=1e-6)
    assert fit["mape"] < 1e-9
    assert fit_overhead(pts, 240.0, launches_ms=(0.0,))["mape"] > 0.01  # the additive form cannot


def test_fit_never_returns_negative_time_terms():
    pts = synthetic_points(per_token_ms=0.0)
    pts["measured_ms"] -= 0.002 * pts.prefill_tokens  # a negative per-token cost in the data
    fit = fit_overhead(pts, 240.0)
    assert fit["host"]["per_prefill_token_ms"] == 0.0 and min(fit["host"].values()) >= 0


def raw_runs(model="m", tp=2, prompt=512, batch=1, tokens=128, prompt_ms=100.0, token_ms=10.0, e2e=None, n=5):
    e2e = prompt_ms + tokens * token_ms if e2e is None else e2e
    return [
        {
            "model": model,
            "tensor_parallel": tp,
            "prompt_size": prompt,
            "batch_size": batch,
            "token_size": tokens,
            "prompt_time": prompt_ms,
            "token_time": token_ms,
            "e2e_time": e2e,
        }
    ] * n


def test_configurations_take_medians_and_apply_the_stated_rules():
    raw = (
        raw_runs(batch=1, prompt_ms=100)
        + raw_runs(batch=2, prompt_ms=190)
        + raw_runs(batch=4, prompt_ms=150)  # faster than batch 2
        + raw_runs(batch=8, prompt_ms=700, e2e=1.2 * (700 + 128 * 10))  # 20% more than its steps
        + raw_runs(batch=16, prompt_ms=1400, e2e=0.5 * (1400 + 128 * 10))  # stopped early: kept
        + raw_runs(batch=32, prompt_ms=2800, n=4)
        + [{**raw_runs(batch=32, prompt_ms=2800)[0], "e2e_time": 10.0, "prompt_time": 1.0}]
    )
    cfg = configurations(pd.DataFrame(raw)).set_index("batch_size")
    assert cfg.prefill_excluded.tolist() == [False, False, True, False, False, False]
    assert cfg.decode_excluded.tolist() == [False, False, False, True, False, False]
    assert cfg.loc[32, "prompt_ms"] == 2800 and cfg.loc[32, "repeats"] == 5 and cfg.loc[32, "e2e_low_runs"] == 1
    assert "half the batch" in cfg.loc[4, "why"] and "1.20x" in cfg.loc[8, "why"]


# --- the shipped file ---------------------------------------------------------------
def test_shipped_overhead_is_documented_versioned_and_consistent():
    doc = SHIPPED_DOC
    assert (doc["format"], doc["version"], doc["gpu"]) == ("kvsim-overhead/2", 2, "a100-80gb")
    assert "splitwise" in doc["source"] and "MIT" in doc["license"]
    assert {"host", "comm", "points", "fit", "error", "rules", "transfer", "what_is_measured"} <= set(doc)
    assert len(doc["points"]) == 152 and sum("excluded" in p for p in doc["points"]) == 3
    o = from_file(doc)
    for p in doc["points"]:  # the stored fitted times are the code's, from the stored coefficients
        model = MODEL_PRESETS[p["model"]]
        prefill = p["phase"] == "prefill"
        tokens = p["batch"] * p["prompt"] if prefill else p["batch"]
        device = p["kernel_ms"] * 1e-3 + o.comm.seconds(p["tp"], model.num_layers, model.hidden_size, tokens)
        host = sum(o.host(p["batch"], tokens if prefill else 0).values())
        step = host + max(device, model.num_layers * o.launch_per_layer_s)
        assert p["fitted_ms"] == pytest.approx(step * 1e3, rel=2e-3)


def test_the_first_shipped_overhead_still_loads_as_purely_additive():
    v1 = load_overhead("splitwise-a100-v1")
    assert v1.label == "overhead:splitwise-a100-v1" and v1.launch_per_layer_s == 0.0
    assert v1.launch_wait(80, 0.0) == 0.0


def test_recorded_accuracy_is_what_the_readme_reports():
    acc = json.loads((SHIPPED / "accuracy.json").read_text())
    assert acc["held_out_mape"] < acc["held_out_additive_mape"] < 0.10 < acc["before_overhead_mape"]
    assert acc["held_out"]["bloom-176b tp8 decode"] < acc["held_out_additive"]["bloom-176b tp8 decode"]
    # stated as a known shortfall: a single 8,192-token prompt and 16 prompts of 512
    assert abs(acc["worst"]["error"]) < 0.30 and len(acc["points_over_25pct"]) == 2
    assert len(acc["excluded"]) == 3


@needs_data
def test_derive_script_reproduces_the_shipped_overhead(tmp_path):
    import runpy

    derive = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "derive_overheads.py"))
    derive["main"](DATA / "splitwise_a100.csv", tmp_path)
    for name in ("splitwise-a100-v2.json", "accuracy.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), name


# --- bad input ----------------------------------------------------------------------
def write(tmp_path, cost_model) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, "cost_model": cost_model}))
    return path


@pytest.mark.parametrize(
    "cost_model, message",
    [
        ({"overhead": "splitwise-h100"}, "cost_model.overhead: no overhead 'splitwise-h100'"),
        ({"overhead": {"step_ms": -1}}, "cost_model.overhead.step_ms: Input should be greater than or equal to 0"),
        ({"overhead": {"stepms": 1}}, "cost_model.overhead.stepms: unknown key 'stepms' (did you mean 'step_ms'?)"),
        ({"overhead": "none", "step_overhead_ms": 1}, "cost_model: give overhead: {step_ms: X}"),
    ],
)
def test_bad_overhead_is_one_line_and_writes_nothing(tmp_path, cost_model, message):
    code, _, err = kvsim("run", write(tmp_path, cost_model), "--out", tmp_path / "out", "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("kvsim: error: ") and message in err
    assert not (tmp_path / "out").exists()


def test_an_overhead_file_must_be_a_kvsim_overhead(tmp_path):
    (tmp_path / "o.json").write_text(json.dumps({**SHIPPED_DOC, "format": "other"}))
    with pytest.raises(InputError, match="format must be one of kvsim-overhead/1, kvsim-overhead/2"):
        load_overhead("o.json", tmp_path)
    (tmp_path / "o.json").write_text(json.dumps({**SHIPPED_DOC, "name": "mine"}))
    assert load_overhead("o.json", tmp_path).label == "overhead:mine"
    assert load_overhead("none") is NONE


def test_deprecated_step_overhead_ms_still_runs_and_says_so(tmp_path):
    code, _, err = kvsim("run", write(tmp_path, {"step_overhead_ms": 1.5}), "--out", tmp_path / "out", "--quiet")
    assert code == 0 and err.startswith("kvsim: note:") and "overhead: {step_ms: 1.5}" in err
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert summary.cost_model.tolist() == ["profile:a100-llama-3-8b + overhead:step 1.5 ms"] * 2


# --- BLOOM-176B and the GPUs without kernel measurements ------------------------------
def test_bloom_is_mha_alibi_with_a_plain_mlp():
    bloom = MODEL_PRESETS["bloom-176b"]
    shape = model_shape(bloom)
    assert shape["gated_mlp"] is False and shape["rope"] is False and bloom.attention_kind == "MHA"
    assert KVSpec(bloom, "fp16").bytes_per_token == 2 * 70 * 112 * 128 * 2
    prof = synthesize(bloom, GPU_PRESETS["a100-80gb"])
    assert (prof.linear.attn_rope == 0).all() and (prof.linear.mlp_up_proj > 0).all()
    c = cost(model="bloom-176b", tp=8)
    assert c.label == "predicted:a100-80gb/bloom-176b (GPU shape model) + overhead:splitwise-a100-v2"


def test_a100_40gb_takes_the_a100_shape_model_scaled_by_bandwidth():
    c40, c80 = (cost(ProfileCost(overhead="none"), "opt-13b", g, 1) for g in ("a100-40gb", "a100-80gb"))
    assert isinstance(c40, Profiled)
    assert c40.label == "predicted:a100-40gb/opt-13b (a100-80gb shape model, HBM-scaled) + overhead:none"
    decode = StepBatch.build([], [1024] * 32)  # memory-bound: close to 2.039 / 1.555 = 1.311 slower
    ratio = c40.breakdown(decode)["attention_decode"] / c80.breakdown(decode)["attention_decode"]
    assert 1.25 < ratio <= 2.039 / 1.555 + 1e-9
    prefill = StepBatch.build([(8192, 0)], [])  # compute-bound: nearly unchanged
    assert c40.breakdown(prefill)["linear"] / c80.breakdown(prefill)["linear"] < 1.05
    h200 = cost(model="llama-3-8b", gpu="h200", tp=1)
    assert h200.label == (
        "predicted:h200/llama-3-8b (h100-80gb shape model, HBM-scaled) + "
        "overhead:splitwise-a100-v2 (on h200: links x1.5)"
    )


def test_steps_beyond_the_measured_ones_are_named_as_extrapolation():
    c = cost()  # llama-2-70b, tp 2: inside the measured tp
    assert c.price(StepBatch.build([], [100] * 64))[1] == ()
    assert c.price(StepBatch.build([], [100] * 65))[1] == ("engine overhead at more sequences than measured (1-64)",)
    tp1 = cost(model="llama-2-7b", tp=1)
    assert "engine overhead at tp 1 (measured 2-8)" in tp1.price(StepBatch.build([], [100]))[1]
    inline = cost(ProfileCost(overhead=InlineOverhead(step_ms=1)), model="llama-2-7b", tp=1)
    assert inline.price(StepBatch.build([], [100] * 100))[1] == ()  # a user's own figures: no range
