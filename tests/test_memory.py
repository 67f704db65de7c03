"""KV-cache footprint: the published worked examples, exactly, through the library and `kvsim memory`.

bytes per token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes; MLA models cache
(kv_lora_rank + qk_rope_head_dim) = 576 elements per layer instead (DeepSeek-V2's config.json).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from helpers import kvsim_command, one_error_line
from kvsim.cli.app import main
from kvsim.model.memory import kv_footprint
from kvsim.model.specs import DTYPE_BITS, GPU_PRESETS, MODEL_PRESETS

LLAMA_70B = MODEL_PRESETS["llama-3-70b"]
SEED_70B = dict(per_token_bytes=327_680, per_request_bytes=2_684_354_560, total_bytes=85_899_345_920)


def memory_json(capsys, *args: str) -> dict:
    """`kvsim memory ... --json` in-process; returns the parsed object."""
    assert main(["memory", *args, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def assert_one_error_line(capsys, code: int) -> str:
    return one_error_line(code, *capsys.readouterr())


def write_config(tmp_path, name="config.json", **fields) -> str:
    folder = tmp_path / "my-model"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(fields))
    return str(path)


# Llama-3-70B's Hugging Face config.json, trimmed to what kvsim reads.
LLAMA_70B_CONFIG = dict(
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    hidden_size=8192,
    intermediate_size=28672,
    vocab_size=128256,
    torch_dtype="bfloat16",
    hidden_act="silu",
)


# --- the worked examples, through the library --------------------------------------
def test_llama_3_70b_8k_context_batch_32_is_85_9_gb():
    fp = kv_footprint(LLAMA_70B, context=8192, batch=32, kv_dtype="fp16")
    assert (fp.per_token_bytes, fp.per_request_bytes, fp.total_bytes) == (
        SEED_70B["per_token_bytes"],
        SEED_70B["per_request_bytes"],
        SEED_70B["total_bytes"],
    )
    assert fp.elements_per_token == 2 * 80 * 8 * 128 == 163_840
    assert fp.attention == "GQA"


def test_32k_context_batch_8_is_the_same_85_9_gb():
    fp = kv_footprint(LLAMA_70B, context=32768, batch=8, kv_dtype="fp16")
    assert fp.per_request_bytes == 10_737_418_240
    assert fp.total_bytes == 85_899_345_920


def test_mha_with_64_kv_heads_is_8x():
    mha = replace(LLAMA_70B, num_kv_heads=64)
    fp = kv_footprint(mha, context=32768, batch=8, kv_dtype="fp16")
    assert fp.total_bytes == 687_194_767_360 == 8 * 85_899_345_920
    assert fp.attention == "MHA"


def test_opt_13b_is_800_kib_per_token():
    fp = kv_footprint(MODEL_PRESETS["opt-13b"], context=1, batch=1, kv_dtype="fp16")
    assert fp.per_token_bytes == 819_200 == 800 * 1024
    assert fp.attention == "MHA"


@pytest.mark.parametrize("name, layers", [("deepseek-v2", 60), ("deepseek-v3", 61)])
def test_mla_caches_576_elements_per_layer(name, layers):
    model = MODEL_PRESETS[name]
    fp = kv_footprint(model, context=1, batch=1, kv_dtype="fp16")
    assert fp.attention == "MLA"
    assert fp.elements_per_token == layers * 576
    assert fp.per_token_bytes == layers * 576 * 2
    per_dtype = {d: kv_footprint(model, 1, 1, d).per_token_bytes for d in ("fp32", "fp16", "fp8", "int4")}
    assert per_dtype == {
        "fp32": layers * 576 * 4,
        "fp16": layers * 576 * 2,
        "fp8": layers * 576,
        "int4": layers * 576 // 2,
    }


def test_dtype_scales_bytes_linearly():
    fp16 = kv_footprint(LLAMA_70B, 8192, 32, "fp16").total_bytes
    assert kv_footprint(LLAMA_70B, 8192, 32, "bf16").total_bytes == fp16
    assert kv_footprint(LLAMA_70B, 8192, 32, "fp32").total_bytes == 2 * fp16
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert kv_footprint(LLAMA_70B, 8192, 32, dtype).total_bytes == fp16 // 2
    assert kv_footprint(LLAMA_70B, 8192, 32, "int4").total_bytes == fp16 // 4


@pytest.mark.parametrize("kv_heads, label", [(64, "MHA"), (8, "GQA"), (1, "MQA")])
def test_attention_labels(kv_heads, label):
    assert replace(LLAMA_70B, num_kv_heads=kv_heads).attention_kind == label


def test_preset_attention_labels():
    kinds = {name: m.attention_kind for name, m in MODEL_PRESETS.items()}
    assert kinds["llama-2-7b"] == kinds["opt-13b"] == kinds["llama-2-13b"] == "MHA"
    assert kinds["llama-3-8b"] == kinds["llama-3-70b"] == kinds["qwen2-7b"] == "GQA"
    assert kinds["deepseek-v2"] == kinds["deepseek-v3"] == "MLA"


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_model_preset_has_positive_sizes(name, capsys):
    model = MODEL_PRESETS[name]
    assert model.name == name
    assert model.dtype in DTYPE_BITS
    assert model.weight_bytes() > 0
    fp = kv_footprint(model, context=1024, batch=2, kv_dtype="fp16")
    assert 0 < fp.per_token_bytes < fp.per_request_bytes < fp.total_bytes
    assert fp.total_bytes == 2 * 1024 * fp.per_token_bytes
    assert memory_json(capsys, "--model", name, "--context", "1024", "--batch", "2") == fp.as_dict()


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_every_gpu_preset_has_positive_sizes(name):
    gpu = GPU_PRESETS[name]
    assert gpu.name == name
    assert gpu.memory_gib > 0 and gpu.hbm_tb_s > 0 and gpu.bf16_tflops > 0 and gpu.pcie_gb_s > 0
    assert gpu.fp8_tflops is None or gpu.fp8_tflops > gpu.bf16_tflops


# --- the worked examples, through `kvsim memory` -----------------------------------
def test_cli_llama_3_70b_seed(capsys):
    got = memory_json(capsys, "--model", "llama-3-70b", "--context", "8192", "--batch", "32")
    assert got == {
        "model": "llama-3-70b",
        "attention": "GQA",
        "kv_dtype": "fp16",
        "context": 8192,
        "batch": 32,
        "elements_per_token": 163_840,
        **SEED_70B,
    }


def test_cli_32k_context_and_mha_override(capsys):
    gqa = memory_json(capsys, "--model", "llama-3-70b", "--context", "32768", "--batch", "8")
    mha = memory_json(capsys, "--model", "llama-3-70b", "--context", "32768", "--batch", "8", "--num-kv-heads", "64")
    assert gqa["total_bytes"] == 85_899_345_920
    assert (mha["total_bytes"], mha["attention"]) == (687_194_767_360, "MHA")
    mqa = memory_json(capsys, "--model", "llama-3-70b", "--context", "1", "--num-kv-heads", "1")
    assert (mqa["per_token_bytes"], mqa["attention"]) == (40_960, "MQA")


def test_cli_opt_13b_and_mla_dtypes(capsys):
    assert memory_json(capsys, "--model", "opt-13b", "--context", "1")["per_token_bytes"] == 819_200
    got = {
        d: memory_json(capsys, "--model", "deepseek-v3", "--context", "1", "--kv-dtype", d)
        for d in ("fp32", "fp16", "fp8", "int4")
    }
    assert {d: g["per_token_bytes"] for d, g in got.items()} == {
        "fp32": 61 * 576 * 4,
        "fp16": 61 * 576 * 2,
        "fp8": 61 * 576,
        "int4": 61 * 576 // 2,
    }
    assert {g["attention"] for g in got.values()} == {"MLA"}


def test_cli_text_output_names_the_numbers(capsys):
    assert main(["memory", "--model", "llama-3-70b", "--context", "8192", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "llama-3-70b (GQA: 80 layers, 8 KV heads x 128), KV in fp16"
    assert "327,680 B" in out and "2,684,354,560 B" in out and "85,899,345,920 B" in out


def test_cli_executable_end_to_end():
    proc = subprocess.run(
        [*kvsim_command(), "memory", "--model", "llama-3-70b", "--context", "8192", "--batch", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    got = json.loads(proc.stdout)
    assert {k: got[k] for k in SEED_70B} == SEED_70B


# --- Hugging Face config.json via --model PATH -------------------------------------
def test_hf_config_with_kv_heads_matches_the_preset(tmp_path, capsys):
    path = write_config(tmp_path, **LLAMA_70B_CONFIG)
    got = memory_json(capsys, "--model", path, "--context", "8192", "--batch", "32")
    assert {k: got[k] for k in SEED_70B} == SEED_70B
    assert (got["attention"], got["model"]) == ("GQA", "my-model")


def test_hf_config_without_kv_heads_is_mha(tmp_path, capsys):
    cfg = {k: v for k, v in LLAMA_70B_CONFIG.items() if k != "num_key_value_heads"}
    got = memory_json(capsys, "--model", write_config(tmp_path, **cfg), "--context", "32768", "--batch", "8")
    assert (got["attention"], got["total_bytes"]) == ("MHA", 687_194_767_360)


def test_hf_config_head_dim_defaults_to_hidden_over_heads(tmp_path, capsys):
    # OPT-13B-like: 40 layers x 40 heads, hidden 5120 -> head_dim 128 -> 800 KiB per token
    path = write_config(
        tmp_path,
        num_hidden_layers=40,
        num_attention_heads=40,
        hidden_size=5120,
        ffn_dim=20480,
        torch_dtype="float16",
        hidden_act="relu",
    )
    assert memory_json(capsys, "--model", path, "--context", "1")["per_token_bytes"] == 819_200


def test_hf_config_mla(tmp_path, capsys):
    path = write_config(
        tmp_path,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        hidden_size=7168,
        intermediate_size=18432,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    got = memory_json(capsys, "--model", path, "--context", "1")
    assert (got["attention"], got["elements_per_token"], got["per_token_bytes"]) == ("MLA", 61 * 576, 61 * 576 * 2)


# --- bad input: one line, exit 2 ---------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-3-71b", "--context", "1"], "unknown model 'llama-3-71b'"),
        (["--model", "llama-3-8b", "--context", "1", "--kv-dtype", "fp9"], "--kv-dtype"),
        (["--model", "llama-3-8b", "--context", "0"], "--context"),
        (["--model", "llama-3-8b", "--context", "1", "--batch", "0"], "--batch"),
        (["--model", "llama-3-8b", "--context", "1", "--num-kv-heads", "0"], "--num-kv-heads"),
        (["--model", "llama-3-8b", "--context", "many"], "--context"),
        (["--context", "1"], "--model"),
        (["--model", "llama-3-8b", "--context", "1", "--bogus"], "--bogus"),
        (["--model", "missing/config.json", "--context", "1"], "missing/config.json"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    line = assert_one_error_line(capsys, main(["memory", *args]))
    assert needle in line


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "not JSON (line 1, column 2"),
        ("{}", "num_attention_heads"),
        ("[1, 2]", "config.json"),
        ('{"num_attention_heads": 32, "hidden_size": 4096}', "num_hidden_layers"),
        ('{"num_attention_heads": "32", "hidden_size": 4096, "num_hidden_layers": 32}', "config.json"),
    ],
)
def test_broken_config_json_exits_2_naming_the_file(tmp_path, content, needle, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    line = assert_one_error_line(capsys, main(["memory", "--model", str(path), "--context", "1"]))
    assert str(path) in line and needle in line


def test_binary_config_json_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(bytes(range(256)))
    line = assert_one_error_line(capsys, main(["memory", "--model", str(path), "--context", "1"]))
    assert str(path) in line


def test_config_with_zero_heads_exits_2(tmp_path, capsys):
    path = write_config(tmp_path, num_hidden_layers=32, num_attention_heads=0, hidden_size=4096)
    assert_one_error_line(capsys, main(["memory", "--model", path, "--context", "1"]))


def test_config_with_negative_layers_exits_2(tmp_path, capsys):
    path = write_config(tmp_path, num_hidden_layers=-32, num_attention_heads=32, hidden_size=4096)
    assert_one_error_line(capsys, main(["memory", "--model", path, "--context", "1"]))


def test_bad_flag_through_the_executable_is_one_line_exit_2():
    proc = subprocess.run(
        [*kvsim_command(), "memory", "--model", "nope", "--context", "1"], capture_output=True, text=True, timeout=60
    )
    line = one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert line.startswith("kvsim: error: command line: --model: unknown model 'nope'")
