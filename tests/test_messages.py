"""What a user reads when something is wrong: one plain sentence per mistake (no Python
reprs such as FileNotFoundError(2, ...) or KeyError('...')), the likeliest mistake said
first, no library warnings, and a run that completes nothing says why, writes nothing
and exits with status 3."""

from __future__ import annotations

import json
import re
import subprocess
import warnings

import pytest
import yaml

from helpers import kvsim, kvsim_command, one_error_line
from kvsim.config.scenario import load_scenario

REPR = re.compile(r"\b[A-Z]\w*(Error|Exception)\(")  # FileNotFoundError(2, ...), KeyError('x')

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def scenario(tmp_path, **changes) -> str:
    doc = {
        "name": "m",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "workload": {
            "num_requests": 20,
            "arrival": {"process": "poisson", "rate_per_s": 2.0},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 10},
        },
        "policies": [{"name": "paged", "allocator": "paged"}],
    }
    doc.update(changes)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def error(*args) -> str:
    line = one_error_line(*kvsim(*args))
    assert not REPR.search(line), line
    return line


def test_a_scenario_with_an_hf_config_is_written_back_without_a_serializer_warning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    scn, _ = load_scenario(scenario(tmp_path, model={"hf_config": "config.json"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dumped = scn.model_dump(mode="json", exclude_none=True)
    assert dumped["model"] == {"hf_config": "config.json"}


def test_the_command_shows_no_library_warning(tmp_path):
    """Through the executable, as a user runs it (no -W flag): nothing on stderr."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    path = scenario(tmp_path, model={"hf_config": "config.json"})
    done = subprocess.run(
        [*kvsim_command(), "run", path, "--quiet", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_warnings_raised_inside_a_command_do_not_reach_the_user(tmp_path, monkeypatch):
    def noisy(*args, **kwargs):
        warnings.warn("a library's internal complaint", UserWarning)
        warnings.warn("deprecated somewhere deep", FutureWarning)

    monkeypatch.setattr("kvsim.cli.app.print_run", noisy)
    code, out, err = kvsim("run", scenario(tmp_path), "--out", tmp_path / "o")
    assert code == 0 and "Warning" not in err and "complaint" not in err


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "command line: --model: {path}: file not found"),
        (
            '{"hidden_size": 4096}',
            "command line: --model: {path}: no num_attention_heads in it; is this a transformer model's config.json",
        ),
        ("[1", "command line: --model: {path}: not JSON (line 1, column 3"),
        ('[1, 2]', "command line: --model: {path}: must hold a JSON object (a config.json), not a list"),
        (
            '{"num_attention_heads": "32", "hidden_size": 4096, "num_hidden_layers": 2}',
            "command line: --model: {path}: num_attention_heads must be a whole number >= 1, not \"32\"",
        ),
    ],
)
def test_a_bad_config_json_is_named_in_plain_words(tmp_path, content, expected):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    line = error("memory", "--model", path, "--context", 100)
    assert line.startswith("kvsim: error: " + expected.format(path=path)), line


def test_a_scenario_s_bad_hf_config_names_the_field_and_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 4096}')
    line = error("run", scenario(tmp_path, model={"hf_config": "config.json"}))
    assert line.startswith(
        f"kvsim: error: {tmp_path}/m.yaml: model.hf_config: {tmp_path}/config.json: no num_attention_heads in it"
    ), line
    line = error("run", scenario(tmp_path, model={"hf_config": "missing.json"}))
    assert line == f"kvsim: error: {tmp_path}/m.yaml: model.hf_config: file {tmp_path}/missing.json not found"


def test_a_missing_file_is_said_before_any_other_complaint(tmp_path):
    """A trace path that is wrong, in a workload that also (wrongly) gives arrivals: the
    path is the likelier mistake, and fixing the other first would not help."""
    workload = {"trace": "missing.csv", "arrival": {"process": "poisson", "rate_per_s": 3.0}, "num_requests": 5}
    line = error("run", scenario(tmp_path, workload=workload))
    assert line == f"kvsim: error: {tmp_path}/m.yaml: workload.trace: file {tmp_path}/missing.csv not found"
    empirical = {
        "num_requests": 5,
        "arrival": {"process": "poisson", "rate_per_s": 3.0},
        "prompt_tokens": {"dist": "empirical", "file": "lengths.csv", "column": "n", "typo": 1},
        "output_tokens": {"dist": "fixed", "value": 10},
    }
    line = error("run", scenario(tmp_path, workload=empirical))
    assert line.endswith(f"workload.prompt_tokens.file: file {tmp_path}/lengths.csv not found")
    (tmp_path / "folder").mkdir()
    line = error("run", scenario(tmp_path, workload={**workload, "trace": "folder"}))
    assert line.endswith(f"workload.trace: file {tmp_path}/folder is a folder, not a file")


def test_a_run_that_completes_nothing_says_why_writes_nothing_and_exits_3(tmp_path):
    path = scenario(tmp_path, time_limit_s=0.001)
    code, out, err = kvsim("run", path, "--out", tmp_path / "o")
    assert code == 3 and out == ""
    assert err == (
        f"kvsim: warning: {path}: no request completed under any policy: time_limit_s (0.001 s "
        "of simulated time) ended the run before any of 20 request(s) finished: raise it or "
        "drop it; nothing written\n"
    )
    assert not (tmp_path / "o").exists()


def test_a_run_whose_requests_are_all_rejected_says_the_reason(tmp_path):
    workload = {
        "num_requests": 4,
        "arrival": {"process": "poisson", "rate_per_s": 2.0},
        "prompt_tokens": {"dist": "fixed", "value": 3000},
        "output_tokens": {"dist": "fixed", "value": 10},
    }
    path = scenario(tmp_path, workload=workload, kv_cache_memory_gib=0.05, max_model_len=4096)
    code, out, err = kvsim("run", path, "--out", tmp_path / "o")
    assert code == 3 and out == "" and not (tmp_path / "o").exists()
    assert "no request completed under any policy: 4 request(s) were rejected (most: " in err, err


@pytest.mark.parametrize(
    "extra, window",
    [
        ({}, None),
        ({"sliding_window": 4096}, 4096),
        ({"sliding_window": 131072, "use_sliding_window": False}, None),
        # gpt-oss's pattern: the window is a hybrid one, on half the layers
        ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 16}, None),
    ],
)
def test_a_config_s_sliding_window_counts_only_where_every_layer_uses_it(tmp_path, extra, window):
    from kvsim.model.specs import model_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    m = model_from_hf_config(tmp_path / "config.json")
    assert m.sliding_window == window
    assert (m.hybrid_window, m.hybrid_window_layers) == ((128, 16) if "layer_types" in extra else (None, 0))


def test_a_config_whose_layer_types_miscount_its_layers_is_an_input_error(tmp_path):
    cfg = {**LLAMA, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = scenario(tmp_path, model={"hf_config": str(tmp_path / "config.json")})
    code, out, err = kvsim("run", path, "--out", tmp_path / "o")
    assert code == 2 and "model.hf_config" in err and "layer_types names 2 layers, num_hidden_layers 32" in err


@pytest.mark.parametrize(
    "changes, expected",
    [
        # a length as a bare number: each form a length takes
        (
            {"workload_prompt": 100},
            "workload.prompt_tokens: needs a mapping of keys, not 100: one of "
            "{dist: fixed, value}, {dist: uniform}, {dist: lognormal, mean, cv}, {dist: empirical, file, column}",
        ),
        (
            {"workload_prompt": {"dist": "constant", "value": 100}},
            "workload.prompt_tokens: unknown dist 'constant'; choose from: empirical, fixed, lognormal, uniform",
        ),
        (
            {"policies": [{"name": "p", "allocator": "pagd"}]},
            "policies[0]: unknown allocator 'pagd' (did you mean 'paged'?); choose from: contiguous, paged",
        ),
        (
            {"policies": ["paged"]},
            "policies[0]: needs a mapping of keys, not 'paged': one of "
            "{allocator: contiguous, name}, {allocator: paged, name}",
        ),
        (
            {"slo": 2},
            "slo: needs a mapping of keys, not 2: {ttft_p50_s, ttft_p90_s, ttft_p99_s, tpot_p50_s, "
            "tpot_p90_s, tpot_p99_s, e2e_p50_s, e2e_p99_s}",
        ),
    ],
)
def test_a_value_of_the_wrong_shape_names_the_shapes_allowed(tmp_path, changes, expected):
    """pydantic's words ("Input should be a valid dictionary", "Input tag ... found using")
    become what the key takes."""
    if "workload_prompt" in changes:
        workload = yaml.safe_load(open(scenario(tmp_path)))["workload"]
        changes = {"workload": {**workload, "prompt_tokens": changes.pop("workload_prompt")}}
    line = error("run", scenario(tmp_path, **changes))
    assert line == f"kvsim: error: {tmp_path}/m.yaml: {expected}"
