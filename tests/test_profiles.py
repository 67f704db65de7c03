"""Profiles, fitted forms and the profiled cost model.

Tests that read the measured source data skip cleanly when ../shared/data is absent.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.cost.model import PARTS, Profiled, Roofline, StepBatch, describe, make_cost_model
from kvsim.config.errors import InputError
from kvsim.cost.generalize import find_shipped, model_shape, synthesize, token_grid
from kvsim.cost.fit import (
    fit_elementwise,
    fit_gemm,
    fit_ramp,
    gemm_work,
    predict_elementwise,
    predict_gemm,
    predict_ramp,
)
from kvsim.cost.profiles import SHIPPED, Profile, load_profile, save_profile, shipped_names
from kvsim.config.scenario import ProfileCost, validate_scenario
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, GPUSpec, KVSpec

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "profiling"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data/profiling not present")
NAMES = [f"{g}-{m}" for g in ("a100", "h100") for m in ("llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b")]


def cost(model="llama-3-8b", gpu="a100-80gb", tp=1, kv_dtype="bf16", **kw):
    m = MODEL_PRESETS[model]
    return make_cost_model(kw.pop("choice", "calibrated"), m, GPU_PRESETS[gpu], KVSpec(m, kv_dtype), tp, **kw)


def tiny_profile(tps=(1, 2)) -> Profile:
    """Every op takes 1 ms at 1 token and 2 ms at 100 tokens."""
    rows = [
        {
            "tp": tp,
            "num_tokens": n,
            **{
                op: v
                for op in (
                    "emb",
                    "input_layernorm",
                    "attn_pre_proj",
                    "attn_rope",
                    "attn_post_proj",
                    "post_attention_layernorm",
                    "mlp_up_proj",
                    "mlp_act",
                    "mlp_down_proj",
                    "add",
                    "lm_head",
                )
            },
        }
        for tp in tps
        for n, v in ((1, 1.0), (100, 2.0))
    ]
    return Profile({"name": "tiny", "gpu": "a100-80gb"}, pd.DataFrame(rows))


# --- the shipped profiles -----------------------------------------------------------
def test_shipped_profiles_cover_a100_and_h100_llama_2_and_3_and_stay_small():
    assert set(NAMES) <= set(shipped_names())
    assert sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file()) < 600_000
    for name in NAMES:
        meta = load_profile(name).meta
        assert {"device", "model", "dtype", "date", "tools", "source", "license"} <= set(meta)
        assert "vidur" in meta["source"] and "MIT" in meta["license"]
    assert load_profile("h100-llama-3-8b").meta["origin"]["linear"].startswith("predicted")
    assert load_profile("h100-llama-3-70b").meta["origin"]["linear"].startswith("borrowed")


def test_find_shipped_matches_gpu_and_model_shape():
    assert find_shipped(MODEL_PRESETS["llama-3-70b"], GPU_PRESETS["a100-80gb"]).name == "a100-llama-3-70b"
    assert find_shipped(MODEL_PRESETS["opt-13b"], GPU_PRESETS["a100-80gb"]) is None
    assert find_shipped(MODEL_PRESETS["llama-3-8b"], GPU_PRESETS["h200"]) is None


# --- interpolation and extrapolation ------------------------------------------------
def test_interpolation_is_piecewise_linear_and_proportional_beyond_the_last_point():
    prof = tiny_profile()
    assert prof.op_time("mlp_up_proj", 1, 1) == (pytest.approx(1e-3), None)
    assert prof.op_time("mlp_up_proj", 50.5, 1)[0] == pytest.approx(1.5e-3)
    t, why = prof.op_time("mlp_up_proj", 300, 1)
    assert t == pytest.approx(6e-3) and "beyond 100 measured tokens" in why


def test_the_envelope_takes_a_time_above_one_measured_at_more_tokens_as_that_one():
    """A GEMM over fewer tokens can run as the kernel measured at more (an overhead's
    `linear: envelope`); as measured is the default."""
    rows = [
        {
            "tp": 1,
            "num_tokens": n,
            **{
                op: v
                for op in (
                    "emb",
                    "input_layernorm",
                    "attn_pre_proj",
                    "attn_rope",
                    "attn_post_proj",
                    "post_attention_layernorm",
                    "mlp_up_proj",
                    "mlp_act",
                    "mlp_down_proj",
                    "add",
                    "lm_head",
                )
            },
        }
        for n, v in ((1, 1.0), (64, 1.0), (80, 1.6), (104, 1.2), (128, 1.4))
    ]
    prof = Profile({"name": "bump", "gpu": "h100-80gb"}, pd.DataFrame(rows))
    assert prof.op_time("attn_pre_proj", 80, 1)[0] == pytest.approx(1.6e-3)
    assert prof.op_time("attn_pre_proj", 80, 1, envelope=True)[0] == pytest.approx(1.2e-3)  # as at 104
    assert prof.op_time("attn_pre_proj", 72, 1, envelope=True)[0] == pytest.approx(1.1e-3)  # 64 to 80's
    assert prof.op_time("attn_pre_proj", 128, 1, envelope=True)[0] == pytest.approx(1.4e-3)  # rises kept
    assert prof.op_time("attn_pre_proj", 80, 1)[0] == pytest.approx(1.6e-3)  # the cache keeps both
    h100 = load_profile("h100-llama-2-7b")
    assert h100.op_time("attn_pre_proj", 88, 1)[0] > h100.op_time("attn_pre_proj", 104, 1)[0]
    assert h100.op_time("attn_pre_proj", 88, 1, True)[0] <= h100.op_time("attn_pre_proj", 104, 1, True)[0]


def test_unmeasured_tp_scales_sharded_ops_only_and_says_so():
    prof = tiny_profile(tps=(1, 2))
    t, why = prof.op_time("mlp_up_proj", 1, 4)
    assert t == pytest.approx(0.5e-3) and why == "tp 4 not measured (scaled from tp 2)"
    assert prof.op_time("input_layernorm", 1, 4)[0] == pytest.approx(1e-3)  # replicated


def test_save_and_load_round_trip(tmp_path):
    prof = load_profile("a100-llama-3-8b")
    again = load_profile(save_profile(prof, tmp_path / "p"))
    assert again.meta == prof.meta
    pd.testing.assert_frame_equal(again.linear, prof.linear, rtol=1e-4)
    assert len(again.attention_rows) == 665


def test_unknown_or_broken_profile_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no profile 'nope'"):
        load_profile("nope", tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "meta.json").write_text('{"format": "other"}')
    (tmp_path / "bad" / "linear.csv").write_text("tp,num_tokens\n1,1\n")
    with pytest.raises(InputError, match="format must be"):
        load_profile("bad", tmp_path)


# --- fitted forms recover known parameters ------------------------------------------
def test_fit_ramp_recovers_its_parameters():
    truth = {"a_s": 1e-5, "e_max": 0.6, "w_half": 1e10, "k": 0.5}
    work = np.geomspace(1e8, 1e13, 40)
    fit = fit_ramp(work, predict_ramp(truth, work, 312e12), 312e12)
    assert fit["e_max"] == pytest.approx(0.6, rel=0.02) and fit["k"] == pytest.approx(0.5)
    assert fit["w_half"] == pytest.approx(1e10, rel=0.05)


def test_fit_gemm_and_elementwise_recover_their_parameters():
    truth = {"a_s": 4e-6, "p": 1.5, "bw_eff": 0.8, "flops_eff": 0.7}
    m = np.tile(np.geomspace(1, 32768, 30), 3)  # three shapes: launch time and bandwidth separate
    flops, nbytes = gemm_work(m, np.repeat([4096, 8192, 1024], 30), np.repeat([14336, 28672, 1024], 30))
    t = predict_gemm(truth, flops, nbytes, 312e12, 2.039e12)
    fit = fit_gemm(flops, nbytes, t, 312e12, 2.039e12)
    assert fit == pytest.approx(truth, rel=0.01)
    ew = fit_elementwise(nbytes, predict_elementwise({"a_s": 2e-6, "bw_eff": 0.5}, nbytes, 2e12), 2e12)
    assert ew == pytest.approx({"a_s": 2e-6, "bw_eff": 0.5}, rel=1e-6)


def test_model_shape_infers_gated_mlp_and_dense_equivalent_moe():
    assert model_shape(MODEL_PRESETS["llama-3-8b"])["gated_mlp"] is True
    assert model_shape(MODEL_PRESETS["opt-13b"])["gated_mlp"] is False
    # active parameters without the experts that give them: a dense MLP of equal work
    ds = model_shape(replace(MODEL_PRESETS["deepseek-v2"], num_experts=0, experts_per_token=0))
    assert ds["dense_equivalent"] and 5000 < ds["intermediate_size"] < 15000
    assert "dense_equivalent" not in model_shape(MODEL_PRESETS["deepseek-v2"])  # priced by experts
    assert token_grid(64, 4) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


# --- the cost model -----------------------------------------------------------------
def test_breakdown_sums_to_step_time_and_parts_behave():
    c = cost()
    decode = StepBatch.build([], [1024] * 64)
    parts = c.breakdown(decode)
    assert c.step_time(decode) == pytest.approx(sum(parts.values()))
    assert parts["attention_prefill"] == 0 and parts["allreduce"] == 0 and parts["attention_decode"] > 0
    longer = c.breakdown(StepBatch.build([], [4096] * 64))["attention_decode"]
    fp8 = cost(kv_dtype="fp8").breakdown(decode)["attention_decode"]
    assert fp8 < parts["attention_decode"] < longer
    assert c.label == "profile:a100-llama-3-8b + overhead:splitwise-a100-v2"
    tp2 = cost(tp=2).breakdown(decode)
    assert tp2["allreduce"] > 0 and tp2["linear"] < parts["linear"]


def test_price_is_the_sum_of_the_parts_to_the_last_bit():
    """A step's price sums its parts in PARTS order, whether its counts were priced before
    (the parts they alone decide are kept per counts) or not, and the same as a model
    that priced nothing before: eager steps (the launch wait), graph steps, piecewise
    ones, with a kernel factor, tp 1 and 2."""
    makers = (
        lambda: cost(),  # splitwise-a100-v2: no graphs, every step eager
        lambda: cost("llama-2-7b", "h100-80gb", engine="vllm-v1", limits=(128, 2048)),  # graphs, kernel factors
        lambda: cost("llama-2-70b", "h100-80gb", 2, engine="vllm-v1", limits=(128, 2048)),
    )
    batches = [
        StepBatch.build([], [700] * 80),
        StepBatch.build([], [701] * 80),  # the same counts, other contexts
        StepBatch.build([(1, 0)], [700] * 79),  # the same tokens and sequences, a decode fewer
        StepBatch.build([(150, 0)], [700] * 80),  # piecewise
        StepBatch.build([(300, 512), (40, 0)], [900] * 3),
        StepBatch.build([(4000, 0)], []),  # beyond the captured sizes: eager
        StepBatch.build([], [1]),
    ]
    for make in makers:
        c = make()
        for batch in batches * 2:
            parts, why = c.parts(batch)
            assert tuple(parts) == PARTS
            assert c.price(batch) == (sum(parts.values()), why)
            assert c.price(batch) == make().price(batch)  # what it kept is what a fresh model computes
    assert makers[1]().scale  # the H100 overhead scales some kernels


def test_profiled_is_slower_than_the_roofline_bound():
    for batch in (StepBatch.build([(2048, 0)], []), StepBatch.build([], [2048] * 32)):
        for model, gpu, tp in (("llama-2-70b", "a100-80gb", 2), ("llama-2-70b", "h100-80gb", 2)):
            bound = cost(model, gpu, tp, choice="roofline").step_time(batch)
            assert cost(model, gpu, tp).step_time(batch) > bound


def test_extrapolation_is_named_per_step_and_described_for_a_run():
    c = cost(tp=2)  # the shipped overhead was measured at tp 2-8 and up to 32,768 tokens
    inside, beyond = (c.price(StepBatch.build([(n, 0)], []))[1] for n in (100, 40000))
    assert inside == () and set(beyond) == {
        "linear ops beyond 32768 measured tokens (scaled in proportion)",
        "engine overhead at more tokens than measured (1-32768)",
        "prefill_fresh attention beyond measured work",
    }
    assert c.label == "profile:a100-llama-3-8b + overhead:splitwise-a100-v2"  # no history: fixed
    assert describe(c.label, 1, 2, beyond) == (
        "profile:a100-llama-3-8b + overhead:splitwise-a100-v2 [extrapolated in 1/2 steps: engine overhead at "
        "more tokens than measured (1-32768); linear ops beyond 32768 measured tokens (scaled in proportion); "
        "prefill_fresh attention beyond measured work]"
    )


def test_fallbacks_and_predictions_are_named():
    custom = GPUSpec("custom", 80, 2.0, 300)
    m = MODEL_PRESETS["llama-3-8b"]
    fallback = make_cost_model("calibrated", m, custom, KVSpec(m, "bf16"), 1)
    assert isinstance(fallback, Roofline) and fallback.label == "roofline (no profile for custom/llama-3-8b)"
    assert synthesize(MODEL_PRESETS["qwen2-7b"], custom) is None
    opt = cost("opt-13b", choice=ProfileCost(overhead="none"))
    assert isinstance(opt, Profiled)
    assert opt.label == "predicted:a100-80gb/opt-13b (GPU shape model) + overhead:none"


def test_profile_by_name_must_match_the_model():
    assert (
        cost(choice=ProfileCost(profile="a100-llama-3-8b")).label
        == "profile:a100-llama-3-8b + overhead:splitwise-a100-v2"
    )
    with pytest.raises(InputError, match="measured for llama-2-7b"):
        cost(choice=ProfileCost(profile="a100-llama-2-7b"))
    on_h100 = cost(gpu="h100-80gb", choice=ProfileCost(profile="a100-llama-3-8b", step_overhead_ms=2))
    assert on_h100.label == "profile:a100-llama-3-8b (measured on a100-80gb) + overhead:step 2 ms"
    assert on_h100.breakdown(StepBatch.build([], [10]))["overhead_step"] == pytest.approx(2e-3)


def test_scenario_accepts_cost_model_profile_and_rejects_unknown_keys():
    base = {
        "name": "s",
        "model": "llama-3-8b",
        "gpu": "a100-80gb",
        "max_model_len": 1024,
        "workload": {
            "num_requests": 1,
            "arrival": {"process": "burst"},
            "prompt_tokens": {"dist": "fixed", "value": 8},
            "output_tokens": {"dist": "fixed", "value": 8},
        },
        "policies": [{"name": "p", "allocator": "paged"}],
    }
    assert validate_scenario(base, "s.yaml").cost_model == "calibrated"  # the shipped scenarios' too
    scn = validate_scenario({**base, "cost_model": {"profile": "a100-llama-3-8b"}}, "s.yaml")
    assert scn.cost_model.profile == "a100-llama-3-8b"
    with pytest.raises(InputError, match="profil"):
        validate_scenario({**base, "cost_model": {"profil": "x"}}, "s.yaml")


def test_a_scenario_without_cost_model_is_priced_as_calibrated(tmp_path):
    """A new user's first scenario (Llama-3-8B on one H100, vLLM V1, no cost_model) gets the
    step costs the shipped scenarios name: the same summary as `cost_model: calibrated`,
    whose column names the profile and vLLM V1's H100 overhead, and slower steps than the
    roofline's lower bound."""
    import yaml
    from helpers import kvsim

    doc = {
        "name": "first",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 4096,
        "workload": {
            "num_requests": 20,
            "arrival": {"process": "poisson", "rate_per_s": 4},
            "prompt_tokens": {"dist": "fixed", "value": 500},
            "output_tokens": {"dist": "fixed", "value": 50},
        },
        "policies": [{"name": "paged", "allocator": "paged"}],
    }
    summaries = {}
    for name, choice in (("default", None), ("calibrated", "calibrated"), ("roofline", "roofline")):
        scn = doc if choice is None else {**doc, "cost_model": choice}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(scn))
        code, _, err = kvsim("run", tmp_path / f"{name}.yaml", "--out", tmp_path / name, "--quiet")
        assert code == 0, err
        summaries[name] = (tmp_path / name / "summary.csv").read_bytes()
    assert summaries["default"] == summaries["calibrated"]
    default, roofline = (pd.read_csv(tmp_path / n / "summary.csv").iloc[0] for n in ("default", "roofline"))
    assert default.cost_model == "profile:h100-llama-3-8b + overhead:vllm-v1-h100-v1"
    meta = json.loads((tmp_path / "default" / "run.json").read_text())
    assert meta["cost_model"] == {"paged": default.cost_model}
    assert yaml.safe_load((tmp_path / "default" / "scenario.yaml").read_text())["cost_model"] == "calibrated"
    assert roofline.cost_model == "roofline"
    assert default.tpot_p50_s > roofline.tpot_p50_s


# --- against the measured source data -------------------------------------------------
@needs_data
def test_derive_script_reproduces_the_shipped_profiles(tmp_path):
    import runpy

    derive = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "derive_profiles.py"))
    derive["main"](DATA, tmp_path)
    for path in SHIPPED.rglob("*"):
        if path.is_file():
            assert (tmp_path / path.relative_to(SHIPPED)).read_bytes() == path.read_bytes(), path


@needs_data
def test_shipped_profile_matches_the_source_medians():
    src = pd.read_csv(DATA / "a100_Meta-Llama-3-8B.mlp.csv")
    prof = load_profile("a100-llama-3-8b")
    row = src[(src.num_tokens == 1024) & (src.num_tensor_parallel_workers == 2)].iloc[0]
    assert prof.op_time("mlp_up_proj", 1024, 2)[0] == pytest.approx(row["time_stats.mlp_up_proj.median"] * 1e-3)


def test_recorded_accuracy_is_what_the_readme_reports():
    acc = json.loads((SHIPPED / "accuracy.json").read_text())
    assert max(v["all_ops"] for v in acc["interpolation"].values()) < 0.03
    assert max(e["gemm_mape"] for g in acc["leave_one_shape_out"].values() for e in g.values()) < 0.11
    assert acc["attention"]["all"]["mape"] < 0.11
