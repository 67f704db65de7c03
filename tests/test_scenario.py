"""Scenario files: the shipped ones load, and every kind of bad file is one located InputError.

An error's text is "<file>: <dotted field>: <what is allowed>"; unknown keys and unknown
preset names carry the closest valid name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kvsim.config.errors import InputError
from kvsim.sim.plan import plan_pool
from kvsim.config.scenario import HFModel, Scenario, load_scenario
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
SHARED_TRACE = REPO.parent / "shared" / "data" / "traces" / "splitwise_conv.csv"
NEEDS_SHARED_DATA = {
    "azure_conv_replay.yaml": SHARED_TRACE,
    "mooncake_synthetic.yaml": SHARED_TRACE.with_name("mooncake_synthetic_trace.jsonl"),
    "mooncake_shared_tiers.yaml": SHARED_TRACE.with_name("mooncake_synthetic_trace.jsonl"),
}

BASE = {
    "name": "base",
    "seed": 0,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 4096,
    "workload": {
        "num_requests": 10,
        "arrival": {"process": "poisson", "rate_per_s": 2.0},
        "prompt_tokens": {"dist": "uniform", "min": 10, "max": 100},
        "output_tokens": {"dist": "fixed", "value": 20},
    },
    "policies": [
        {"name": "contiguous", "allocator": "contiguous", "reserve": "max", "placement": "first-fit"},
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
    ],
}
DROP = object()  # an override value that removes the key


def merged(base: dict, overrides: dict) -> dict:
    """Deep-merge; keys may be dotted ('workload.arrival.rate_per_s') and DROP removes a key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is DROP:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def write_scenario(tmp_path: Path, filename: str = "scenario.yaml", **overrides) -> Path:
    """A valid scenario file with `overrides` applied (dotted keys via **{'a.b': v})."""
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(merged(BASE, overrides), sort_keys=False))
    return path


def load_error(path: Path) -> str:
    with pytest.raises(InputError) as info:
        load_scenario(path)
    text = str(info.value)
    assert text.startswith(f"{path}: "), text
    assert "\n" not in text
    return text


# --- shipped scenarios ---------------------------------------------------------------
@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_shipped_scenarios_load(path):
    needs = NEEDS_SHARED_DATA.get(path.name)
    if needs is not None and not needs.is_file():
        pytest.skip(f"needs {needs} (reference data beside the checkout)")
    scn, base_dir = load_scenario(path)
    assert isinstance(scn, Scenario)
    assert base_dir == path.parent
    assert scn.name == path.stem  # so results/<name>/ matches the file
    assert plan_pool(scn, scn.model_spec(base_dir), scn.gpu_spec(), str(path)).pool_bytes > 0


def test_at_least_the_documented_scenarios_ship():
    names = {p.name for p in SCENARIOS}
    assert {
        "rag_8k.yaml",
        "chat_sharegpt.yaml",
        "vllm_paper_opt13b.yaml",
        "azure_conv.yaml",
        "azure_conv_replay.yaml",
    } <= names


def test_base_scenario_loads_with_defaults(tmp_path):
    scn, base_dir = load_scenario(write_scenario(tmp_path))
    assert base_dir == tmp_path
    assert (scn.tensor_parallel_size, scn.gpu_memory_utilization) == (1, 0.9)
    # unset engine settings take vLLM V1's defaults for an H100 (80 GiB, not an A100)
    s = scn.engine_settings()
    assert (s.engine, s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill) == (
        "vllm-v1",
        1024,
        8192,
        True,
    )
    assert (s.preemption_mode, s.watermark) == ("recompute", 0.0)
    assert [p.name for p in scn.policies] == ["contiguous", "paged-16"]
    assert scn.model_spec(base_dir) is MODEL_PRESETS["llama-3-8b"]
    assert scn.gpu_spec() is GPU_PRESETS["h100-80gb"]


def test_scenario_is_frozen(tmp_path):
    scn, _ = load_scenario(write_scenario(tmp_path))
    with pytest.raises(Exception):
        scn.seed = 3


# --- unknown keys, with the closest suggestion -----------------------------------------
@pytest.mark.parametrize(
    "overrides, field, hint",
    [
        ({"modle": "llama-3-8b"}, "modle", "model"),
        ({"workload.num_request": 5}, "workload.num_request", "num_requests"),
        ({"workload.arrival.rate_per_sec": 5}, "workload.arrival.rate_per_sec", "rate_per_s"),
        ({"workload.prompt_tokens.mx": 5}, "workload.prompt_tokens.mx", "max"),
        ({"scheduler": {"max_num_seq": 8}}, "scheduler.max_num_seq", "max_num_seqs"),
        ({"policies.1": {"name": "p", "allocator": "paged", "blok_size": 8}}, "policies[1].blok_size", "block_size"),
        ({"policies.0": {"name": "c", "allocator": "contiguous", "reserv": "max"}}, "policies[0].reserv", "reserve"),
        ({"gpu": {"memory_gib": 80, "hbm_tb_s": 3, "bf16_tflops": 900, "pcie_gbs": 1}}, "gpu.pcie_gbs", "pcie_gb_s"),
    ],
)
def test_unknown_key_names_the_closest(tmp_path, overrides, field, hint):
    text = load_error(write_scenario(tmp_path, **overrides))
    assert f": {field}: unknown key" in text
    assert f"did you mean '{hint}'?" in text
    assert "choose from:" in text


def test_unknown_key_without_a_close_match_lists_the_allowed_keys(tmp_path):
    # contiguous policies have no block_size: no suggestion, but the valid keys are listed
    text = load_error(
        write_scenario(tmp_path, **{"policies.0": {"name": "c", "allocator": "contiguous", "blok_size": 8}})
    )
    assert text.endswith(
        "policies[0].blok_size: unknown key 'blok_size'; "
        "choose from: allocator, enable_prefix_caching, kv_cache_dtype, kv_offload, kv_scale, kv_scale_group_size, "
        "name, placement, reserve"
    )


def test_misspelt_required_key_names_the_typo(tmp_path):
    path = tmp_path / "scenario.yaml"
    raw = merged(BASE, {"model": DROP, "modle": "llama-3-8b"})
    path.write_text(yaml.safe_dump(raw))
    assert "did you mean 'model'?" in load_error(path)


# --- bad values ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (
            {"policies.0": {"name": "c", "allocator": "contiguous", "reserve": "maximum"}},
            "policies[0].reserve",
            "'max', 'pow2' or 'oracle'",
        ),
        (
            {"policies.0": {"name": "c", "allocator": "contiguous", "placement": "best-fit"}},
            "policies[0].placement",
            "'first-fit' or 'buddy'",
        ),
        (
            {"policies.1": {"name": "p", "allocator": "paged", "kv_cache_dtype": "fp9"}},
            "policies[1].kv_cache_dtype",
            "'fp8'",
        ),
        ({"workload.arrival.process": "poison"}, "workload.arrival", "'poisson', 'gamma', 'burst'"),
        (
            {"workload.prompt_tokens.dist": "normal"},
            "workload.prompt_tokens",
            "unknown dist 'normal' (did you mean 'lognormal'?); choose from: empirical, fixed, lognormal, uniform",
        ),
        (
            {"policies.0": {"name": "c", "allocator": "buddy"}},
            "policies[0]",
            "unknown allocator 'buddy'; choose from: contiguous, paged",
        ),
        ({"scheduler": {"preemption_mode": "swapp"}}, "scheduler.preemption_mode", "'recompute' or 'swap'"),
    ],
)
def test_bad_enum_value_lists_the_allowed_ones(tmp_path, overrides, field, allowed):
    text = load_error(write_scenario(tmp_path, **overrides))
    assert f": {field}: " in text and allowed in text


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"workload.arrival.rate_per_s": -1.0}, "workload.arrival.rate_per_s", "greater than 0"),
        ({"workload.arrival.rate_per_s": 0}, "workload.arrival.rate_per_s", "greater than 0"),
        ({"workload.num_requests": 0}, "workload.num_requests", "greater than or equal to 1"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"max_model_len": 0}, "max_model_len", "greater than or equal to 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", "greater than or equal to 1"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "greater than 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "less than or equal to 1"),
        ({"kv_cache_memory_gib": -2}, "kv_cache_memory_gib", "greater than 0"),
        (
            {"policies.1": {"name": "p", "allocator": "paged", "block_size": 0}},
            "policies[1].block_size",
            "greater than or equal to 1",
        ),
        ({"workload.output_tokens.value": 0}, "workload.output_tokens.value", "greater than or equal to 1"),
        (
            {"workload.arrival": {"process": "gamma", "rate_per_s": 1, "cv": 0}},
            "workload.arrival.cv",
            "greater than or equal to 0.001",
        ),
        (
            {"workload.arrival": {"process": "gamma", "rate_per_s": 1, "cv": 1e-200}},
            "workload.arrival.cv",
            "greater than or equal to 0.001",
        ),
        (
            {"workload.output_tokens": {"dist": "lognormal", "mean": 20, "cv": 1e300, "min": 1, "max": 100}},
            "workload.output_tokens.cv",
            "less than or equal to 1000",
        ),
        (
            {"workload.prompt_tokens": {"dist": "uniform", "min": 100, "max": 10}},
            "workload.prompt_tokens",
            "min (100) must not exceed max (10)",
        ),
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs", "greater than or equal to 1"),
    ],
)
def test_out_of_range_numbers(tmp_path, overrides, field, allowed):
    text = load_error(write_scenario(tmp_path, **overrides))
    assert f": {field}: " in text and allowed in text


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"workload.num_requests": "ten"}, "workload.num_requests", "valid integer"),
        ({"workload.num_requests": 10.5}, "workload.num_requests", "valid integer"),
        ({"max_model_len": [4096]}, "max_model_len", "valid integer"),
        ({"policies": "paged-16"}, "policies", "valid list"),
        ({"policies": []}, "policies", "at least 1 item"),
        ({"workload": 3}, "workload", "needs a mapping of keys, not 3: {num_requests, arrival,"),
        ({"scheduler": {"enable_chunked_prefill": "maybe"}}, "scheduler.enable_chunked_prefill", "valid boolean"),
        ({"model": 3}, "model", "needs a preset's name, {hf_config: path to a config.json} or the model's keys"),
        ({"gpu": 3}, "gpu", "needs a preset's name or the gpu's keys (bf16_tflops,"),
        ({"cost_model": 3}, "cost_model", "needs 'roofline', 'calibrated' or {profile, overhead}, not 3"),
        ({"name": "two words"}, "name", "pattern"),
        ({"name": DROP}, "name", "Field required"),
        ({"policies.0": {"name": 3, "allocator": "paged"}}, "policies[0].name", "valid string"),
        ({"policies.0": {"allocator": "paged"}}, "policies[0].name", "Field required"),
    ],
)
def test_wrong_types(tmp_path, overrides, field, allowed):
    text = load_error(write_scenario(tmp_path, **overrides))
    assert f": {field}: " in text and allowed in text


# --- cross-field rules -----------------------------------------------------------------
def test_duplicate_policy_names(tmp_path):
    path = write_scenario(
        tmp_path, policies=[{"name": "a", "allocator": "paged"}, {"name": "a", "allocator": "contiguous"}]
    )
    assert load_error(path) == f"{path}: policies: policy names must be unique; repeated: a"


def test_batched_tokens_below_max_model_len_needs_chunked_prefill(tmp_path):
    text = load_error(
        write_scenario(tmp_path, scheduler={"max_num_batched_tokens": 2048, "enable_chunked_prefill": False})
    )
    assert ": scheduler.max_num_batched_tokens: 2048 is smaller than max_model_len (4096)" in text
    assert "enable_chunked_prefill" in text
    scn, _ = load_scenario(
        write_scenario(tmp_path, scheduler={"max_num_batched_tokens": 2048, "enable_chunked_prefill": True})
    )
    assert scn.batched_token_budget == 2048


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"workload.prompt_tokens": DROP, "workload.output_tokens": DROP}, "give exactly one length source"),
        ({"workload.output_tokens": DROP}, "prompt_tokens and output_tokens go together"),
        ({"workload.dataset": "sharegpt"}, "give exactly one length source"),
        ({"workload.arrival": DROP}, "arrival is required without a trace"),
        ({"workload.num_requests": DROP}, "num_requests is required without a trace or stages"),
    ],
)
def test_length_and_arrival_sources(tmp_path, overrides, message):
    path = write_scenario(tmp_path, **overrides)
    assert load_error(path).startswith(f"{path}: workload: {message}")


def test_trace_with_arrival_is_refused(tmp_path):
    (tmp_path / "trace.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,10\n")
    path = write_scenario(
        tmp_path, **{"workload.prompt_tokens": DROP, "workload.output_tokens": DROP, "workload.trace": "trace.csv"}
    )
    assert load_error(path) == f"{path}: workload: a trace brings its own arrival times: drop arrival"


@pytest.mark.parametrize(
    "overrides, field, wrong, hint",
    [
        ({"model": "llama-3-8"}, "model", "preset 'llama-3-8'", "llama-3-8b"),
        ({"gpu": "h100-80"}, "gpu", "preset 'h100-80'", "h100-80gb"),
        (
            {"workload.prompt_tokens": DROP, "workload.output_tokens": DROP, "workload.dataset": "sharegtp"},
            "workload.dataset",
            "dataset 'sharegtp'",
            "sharegpt",
        ),
    ],
)
def test_unknown_preset_names_the_closest(tmp_path, overrides, field, wrong, hint):
    text = load_error(write_scenario(tmp_path, **overrides))
    assert f": {field}: unknown {wrong} (did you mean '{hint}'?); choose from: " in text


def test_missing_trace_file(tmp_path):
    path = write_scenario(
        tmp_path,
        **{
            "workload.prompt_tokens": DROP,
            "workload.output_tokens": DROP,
            "workload.arrival": DROP,
            "workload.trace": "traces/none.csv",
        },
    )
    text = load_error(path)
    assert ": workload.trace: " in text and "none.csv" in text and "not found" in text


def test_missing_empirical_file(tmp_path):
    path = write_scenario(
        tmp_path, **{"workload.prompt_tokens": {"dist": "empirical", "file": "lens.csv", "column": "prompt"}}
    )
    text = load_error(path)
    assert ": workload.prompt_tokens.file: " in text and "lens.csv" in text and "not found" in text


def test_relative_files_resolve_against_the_scenario_folder(tmp_path, monkeypatch):
    sub = tmp_path / "scenarios"
    sub.mkdir()
    (sub / "lens.csv").write_text("prompt\n10\n20\n")
    path = write_scenario(
        sub, **{"workload.prompt_tokens": {"dist": "empirical", "file": "lens.csv", "column": "prompt"}}
    )
    monkeypatch.chdir(tmp_path)  # the file is found from the scenario's folder, not the cwd
    scn, base_dir = load_scenario(Path("scenarios") / path.name)
    assert base_dir == Path("scenarios")
    assert scn.workload.prompt_tokens.file == "lens.csv"


# --- files that are not scenarios ------------------------------------------------------
def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel: llama-3-8b\n  gpu: h100-80gb\n")
    assert load_error(path) == f"{path}: line 3: invalid YAML: mapping values are not allowed here"


def test_unclosed_bracket_names_a_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\npolicies: [a, b\n")
    assert load_error(path).startswith(f"{path}: line ")


@pytest.mark.parametrize(
    "content",
    ["", "# only a comment\n", "- name: t\n- model: x\n", "just text\n", "42\n"],
    ids=["empty", "comment", "list", "string", "number"],
)
def test_not_a_mapping(tmp_path, content):
    path = tmp_path / "s.yaml"
    path.write_text(content)
    assert load_error(path) == f"{path}: top level: must be a mapping of scenario keys (name, model, ...)"


def test_binary_garbage(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    assert load_error(path) == f"{path}: file: cannot be read as UTF-8 text (UnicodeDecodeError)"


def test_control_characters_give_a_one_line_error(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"name: t\x00\x01\n")
    load_error(path)


def test_missing_scenario_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert load_error(path) == f"{path}: file: not found"


def test_folder_instead_of_file(tmp_path):
    assert ": file: " in load_error(tmp_path)


# --- inline and Hugging Face specs -----------------------------------------------------
INLINE_MODEL = dict(
    name="tiny",
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=512,
    intermediate_size=1024,
    params=1e8,
)


def test_inline_model_and_gpu(tmp_path):
    gpu = dict(name="mygpu", memory_gib=24, hbm_tb_s=1.0, bf16_tflops=150)
    scn, base_dir = load_scenario(write_scenario(tmp_path, model=INLINE_MODEL, gpu=gpu))
    model = scn.model_spec(base_dir)
    assert (model.name, model.num_layers, model.num_kv_heads, model.attention_kind) == ("tiny", 4, 2, "GQA")
    assert model.kv_elements_per_token == 2 * 4 * 2 * 64
    g = scn.gpu_spec()
    assert (g.name, g.memory_gib, g.fp8_tflops, g.pcie_gb_s) == ("mygpu", 24, None, 64.0)


@pytest.mark.parametrize(
    "model, field, allowed",
    [
        ({**INLINE_MODEL, "num_layers": 0}, "model.num_layers", "greater than or equal to 1"),
        ({**INLINE_MODEL, "dtype": "fp8"}, "model.dtype", "'fp32', 'fp16' or 'bf16'"),
        ({k: v for k, v in INLINE_MODEL.items() if k != "params"}, "model.params", "Field required"),
        ({**INLINE_MODEL, "num_layer": 4}, "model.num_layer", "did you mean 'num_layers'?"),
    ],
)
def test_bad_inline_model(tmp_path, model, field, allowed):
    text = load_error(write_scenario(tmp_path, model=model))
    assert f": {field}: " in text and allowed in text


def test_bad_inline_gpu(tmp_path):
    text = load_error(write_scenario(tmp_path, gpu={"memory_gib": -1, "hbm_tb_s": 1, "bf16_tflops": 1}))
    assert ": gpu.memory_gib: Input should be greater than 0" in text


def test_hf_config_relative_to_the_scenario_file(tmp_path, monkeypatch):
    models = tmp_path / "models" / "llama70"
    models.mkdir(parents=True)
    (models / "config.json").write_text(
        json.dumps(
            dict(
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
                hidden_size=8192,
                intermediate_size=28672,
                vocab_size=128256,
                torch_dtype="bfloat16",
            )
        )
    )
    sub = tmp_path / "scenarios"
    sub.mkdir()
    path = write_scenario(sub, model={"hf_config": "../models/llama70/config.json"}, tensor_parallel_size=4)
    monkeypatch.chdir(models)  # not the folder the path is relative to
    scn, base_dir = load_scenario(path)
    assert isinstance(scn.model, HFModel)
    model = scn.model_spec(base_dir)
    assert (model.name, model.num_layers, model.num_kv_heads, model.head_dim) == ("llama70", 80, 8, 128)
    assert model.kv_elements_per_token * 2 == 327_680


def test_missing_or_broken_hf_config(tmp_path):
    text = load_error(write_scenario(tmp_path, model={"hf_config": "config.json"}))
    assert text.endswith(f": model.hf_config: file {tmp_path}/config.json not found")
    (tmp_path / "config.json").write_text('{"hidden_size": 4096}')
    text = load_error(write_scenario(tmp_path, model={"hf_config": "config.json"}))
    assert ": model.hf_config: " in text and "num_attention_heads" in text


def test_hf_model_with_an_extra_key(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    text = load_error(write_scenario(tmp_path, model={"hf_config": "c.json", "hf_confg": "x"}))
    assert ": model.hf_confg: unknown key 'hf_confg' (did you mean 'hf_config'?)" in text


# --- what a vLLM user types, and where kvsim wants it ------------------------------
@pytest.mark.parametrize(
    "key, where",
    [
        ("max_num_seqs", "belongs under scheduler:"),
        ("enable_chunked_prefill", "belongs under scheduler:"),
        ("swap_space", "scheduler: {swap_space_gib: ...}"),
        ("block_size", "is set per policy"),
        ("kv_cache_dtype", "is set per policy"),
        ("enable_prefix_caching", "is set per policy"),
    ],
)
def test_a_top_level_engine_setting_says_where_it_belongs(tmp_path, key, where):
    text = load_error(write_scenario(tmp_path, **{key: 16}))
    assert text.startswith(f"{tmp_path / 'scenario.yaml'}: {key}: '{key}' ") and where in text


def test_a_hugging_face_id_asks_for_its_config_and_names_the_close_preset(tmp_path):
    text = load_error(write_scenario(tmp_path, model="meta-llama/Meta-Llama-3-70B"))
    assert ": model: 'meta-llama/Meta-Llama-3-70B' looks like a Hugging Face model id" in text
    assert "the preset 'llama-3-70b'" in text and "{hf_config: path/to/config.json}" in text


def test_max_model_len_defaults_to_the_models_context_length(tmp_path):
    scn, _ = load_scenario(write_scenario(tmp_path, max_model_len=DROP))
    assert scn.max_model_len == 8192  # Meta-Llama-3-8B's max_position_embeddings
    scn, _ = load_scenario(write_scenario(tmp_path, max_model_len=DROP, model="opt-13b", gpu="a100-40gb"))
    assert (scn.max_model_len, scn.batched_token_budget) == (2048, 2048)
    inline = {
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 2,
        "head_dim": 64,
        "hidden_size": 128,
        "intermediate_size": 256,
        "params": 1.0e6,
    }
    text = load_error(write_scenario(tmp_path, max_model_len=DROP, model=inline))
    assert text.endswith(
        ": max_model_len: required: the model does not give its context length (max_position_embeddings)"
    )
    scn, _ = load_scenario(
        write_scenario(tmp_path, max_model_len=DROP, model=inline | {"max_position_embeddings": 1024})
    )
    assert scn.max_model_len == 1024


def test_weights_no_gpu_can_hold_name_the_tp_that_fits(tmp_path):
    # Llama-3-70B: 70.6e9 x 2 B = 131.5 GiB of weights, more than an H100's 79.6 GiB; at tp 2,
    # 65.7 GiB of weights + ~0.5 GiB of activations per GPU fit under 90% of it (71.6 GiB)
    # (refused when the pool is planned, before any simulation: a sweep or a capacity
    # search over tp can still load the scenario)
    from kvsim.sim.plan import plan_pool

    def plan(**extra):
        scn, base = load_scenario(write_scenario(tmp_path, model="llama-3-70b", **extra))
        return plan_pool(scn, scn.model_spec(base), scn.gpu_spec(), "scenario.yaml")

    with pytest.raises(InputError) as info:
        plan()
    text = str(info.value)
    assert ": tensor_parallel_size: no memory left for the KV cache: 131.5 GiB of weights" in text
    assert "raising gpu_memory_utilization cannot help; needs tensor_parallel_size 2 or a GPU" in text
    assert plan(tensor_parallel_size=2).pool_bytes > 0
