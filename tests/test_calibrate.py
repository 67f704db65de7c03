"""`kvsim calibrate` on CPU with PyTorch (skipped without torch): a quick profile that
loads, reports its held-out error and drives a run."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pandas as pd
import pytest

from kvsim.cli import main
from kvsim.profiles import load_profile

torch = pytest.importorskip("torch")


def kvsim(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "prof"
    code, stdout, err = kvsim("calibrate", "--model", "llama-3-8b", "--device", "cpu", "--quick", "--out", out)
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}/")
    return out


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


def test_quick_profile_reports_and_drives_a_run(quick_profile, tmp_path):
    code, out, _ = kvsim("calibrate", "--report", quick_profile, "--json")
    res = json.loads(out)
    assert code == 0 and res["overall_mape"] > 0 and "attn_decode" in res["mape"]
    code, out, _ = kvsim("cost", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--decode-batch", "4",
                         "--context", "100", "--profile", quick_profile, "--json")
    # the quick profile measured shapes 8x narrower, so the real model's KV reads lie beyond it
    assert json.loads(out)["cost_model"] == ("profile:cpu-llama-3-8b-quick (measured on cpu) "
                                             "[extrapolated in 1/1 steps: decode attention beyond measured work]")
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
