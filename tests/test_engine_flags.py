"""Engine command lines as scenarios: vLLM's serve flags and SGLang's launch flags."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import kvsim, one_error_line
from kvsim.config.engine_flags import SGLANG, VLLM, known, parse, size, table
from kvsim.config.errors import InputError
from kvsim.config.scenario import KVOffload, Scenario, load_scenario

WORKLOAD = {
    "num_requests": 10,
    "arrival": {"process": "burst"},
    "prompt_tokens": {"dist": "fixed", "value": 100},
    "output_tokens": {"dist": "fixed", "value": 10},
}


def vllm(text, v0=False):
    return parse(text, "vllm", "s.yaml", "vllm_args", v0=v0)


def error(fn, *args, **kw) -> str:
    with pytest.raises(InputError) as e:
        fn(*args, **kw)
    return str(e.value)


# --- reading a vLLM command line -----------------------------------------------------------
def test_every_flag_kvsim_models_sets_its_field():
    got = vllm(
        "vllm serve meta-llama/Llama-2-7b-hf --tensor-parallel-size 2 --max-model-len 4096 "
        "--max-num-batched-tokens 2048 --max-num-seqs 128 --gpu-memory-utilization 0.85 "
        "--kv-cache-memory-bytes 8G --enable-prefix-caching --block-size 32 --kv-cache-dtype fp8_e5m2 "
        "--enable-chunked-prefill --enforce-eager"
    )
    assert got.sets == {
        "model": "meta-llama/Llama-2-7b-hf",
        "tensor_parallel_size": 2,
        "max_model_len": 4096,
        "scheduler.max_num_batched_tokens": 2048,
        "scheduler.max_num_seqs": 128,
        "gpu_memory_utilization": 0.85,
        "kv_cache_memory_gib": 8.0,
        "policy.enable_prefix_caching": True,
        "policy.block_size": 32,
        "policy.kv_cache_dtype": "fp8_e5m2",
        "scheduler.enable_chunked_prefill": True,
        "enforce_eager": True,
    }
    assert got.ignored == ()


def test_flags_read_as_vllms_parser_reads_them():
    got = vllm(
        "--model=llama-3-8b -tp 4 --max_model_len=16k --no-enable-prefix-caching "
        "--kv-cache-dtype bfloat16 --port 8000 --trust-remote-code --served-model-name m -O2"
    )
    assert got.sets == {
        "model": "llama-3-8b",
        "tensor_parallel_size": 4,
        "max_model_len": 16000,
        "policy.enable_prefix_caching": False,
        "policy.kv_cache_dtype": "bf16",
    }
    assert got.ignored == ("--port 8000", "--trust-remote-code", "--served-model-name m", "--optimization-level 2")
    # flags at their defaults that kvsim would otherwise refuse are accepted and ignored
    assert vllm("--pipeline-parallel-size 1 --no-enable-expert-parallel").ignored == (
        "--pipeline-parallel-size 1",
        "--no-enable-expert-parallel",
    )
    assert vllm("--no-async-scheduling").sets == {"scheduler.async_scheduling": False}


@pytest.mark.parametrize(
    "text, want", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1M", 1 << 20), ("2g", 2 * 10**9)]
)
def test_human_readable_sizes(text, want):
    assert size(text) == want


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "--max-model-lenn 4096",
            "unknown flag --max-model-lenn (did you mean --max-model-len?); vllm 0.33.0 has no such flag",
        ),
        ("--disable-log-requests", "unknown flag --disable-log-requests (did you mean --enable-log-requests?)"),
        ("--swap-space 4", "--swap-space is vLLM V0's (engine: vllm-v0); vLLM 0.33.0 has no such flag"),
        (
            "--pipeline-parallel-size 2",
            "--pipeline-parallel-size: kvsim does not model pipeline parallelism (only 1, the default)",
        ),
        ("--quantization fp8", "--quantization: kvsim does not model quantized weights"),
        ("--speculative-config '{\"method\": \"ngram\"}'", "--speculative-config: kvsim does not model speculative"),
        ("-cc.cudagraph_mode FULL", "--compilation-config: kvsim does not model"),
        ("--enable-expert-parallel", "--enable-expert-parallel: kvsim does not model expert parallelism"),
        ("--kv-cache-dtype int8", "--kv-cache-dtype int8: choose from: auto, bfloat16, float16, fp8"),
        ("--max-num-seqs many", "--max-num-seqs many: must be a whole number"),
        ("--gpu-memory-utilization", "--gpu-memory-utilization needs a value"),
        ("--block-size 16 --block-size 32", "--block-size appears twice"),
        ("llama-3-8b --model llama-2-7b", "--model sets model, given already"),
        ("--model llama-3-8b llama-2-7b", "unexpected 'llama-2-7b': flags start with --; give the model once"),
        ("--enable-prefix-caching=maybe", "--enable-prefix-caching maybe: must be true or false"),
        ("--model 'unclosed", "cannot be read as a command line"),
    ],
)
def test_vllm_rejections(text, message):
    assert message in error(vllm, text)
    assert error(vllm, text).startswith("s.yaml: vllm_args: ")


def test_v0_flags_where_the_engine_is_v0():
    assert vllm("--swap-space 8 --preemption-mode swap", v0=True).sets == {
        "scheduler.swap_space_gib": 8.0,
        "scheduler.preemption_mode": "swap",
    }


# --- reading an SGLang command line ---------------------------------------------------------
def test_sglang_flags():
    got = parse(
        "python -m sglang.launch_server --model-path llama-3-8b --tp 2 --mem-fraction-static 0.8 "
        "--chunked-prefill-size 4096 --max-running-requests 64 --page-size 16 --schedule-policy lpm "
        "--context-length 8192 --kv-cache-dtype fp8_e4m3 --disable-radix-cache --host 0.0.0.0 --port 30000",
        "sglang",
        "s.yaml",
        "sglang_args",
    )
    assert got.sets == {
        "model": "llama-3-8b",
        "tensor_parallel_size": 2,
        "mem_fraction_static": 0.8,
        "scheduler.max_num_batched_tokens": 4096,
        "scheduler.max_num_seqs": 64,
        "policy.block_size": 16,
        "scheduler.schedule_policy": "lpm",
        "max_model_len": 8192,
        "policy.kv_cache_dtype": "fp8_e4m3",
        "policy.enable_prefix_caching": False,
    }
    assert got.ignored == ("--host 0.0.0.0", "--port 30000")
    # -1 turns chunked prefill off; --model is --model-path's alias; a unique prefix is the flag;
    # the defaults of flags kvsim does not model are accepted
    assert parse("--model x --chunked-prefill-size -1 --mem-frac 0.7", "sglang", "s", "a").sets == {
        "model": "x",
        "scheduler.enable_chunked_prefill": False,
        "mem_fraction_static": 0.7,
    }


def test_sglang_0_5_23_names():
    """SGLang 0.5.23's names: --tp-size with --tensor-parallel-size its alias, sizes with SI
    and IEC suffixes (human_readable_int), --no-NAME for a BooleanOptionalAction, and the
    defaults of flags kvsim does not model accepted (--pp-size 1, --max-prefill-tokens 16Ki)."""
    got = parse(
        "sglang serve --model meta-llama/Meta-Llama-3-8B --tensor-parallel-size 4 --context-length 32k "
        "--max-prefill-tokens 16Ki --no-enable-tp-lm-head-all-to-all",
        "sglang",
        "s.yaml",
        "sglang_args",
    )
    assert got.sets == {"model": "meta-llama/Meta-Llama-3-8B", "tensor_parallel_size": 4, "max_model_len": 32000}
    assert got.ignored == ("--max-prefill-tokens 16Ki", "--no-enable-tp-lm-head-all-to-all")
    assert parse("--context-length 8Ki --pp-size 1 --ep 1", "sglang", "s", "a").sets == {"max_model_len": 8192}
    assert "--tp-size appears twice" in error(parse, "--tp 2 --tensor-parallel-size 2", "sglang", "s", "a")


def test_sglang_hicache_flags():
    """--enable-hierarchical-cache makes kv_offload's host pool: --hicache-ratio times the
    GPU pool (2.0 unless given) and --hicache-write-policy; without the switch SGLang
    builds no host pool, so the two change nothing."""
    on = parse("--enable-hicache --hicache-write-policy write_back", "sglang", "s", "a")
    assert on.sets == {"policy.kv_offload.write_policy": "write_back", "policy.kv_offload.hicache_ratio": 2.0}
    assert parse("--enable-hierarchical-cache --hicache-ratio 3", "sglang", "s", "a").sets == {
        "policy.kv_offload.hicache_ratio": 3.0
    }
    off = parse("--hicache-ratio 3 --hicache-write-policy write_back", "sglang", "s", "a")
    assert off.sets == {}
    assert off.ignored == (
        "--hicache-ratio 3.0 (no --enable-hierarchical-cache)",
        "--hicache-write-policy write_back (no --enable-hierarchical-cache)",
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("--schedule-policy dfs-weight", "--schedule-policy dfs-weight: choose from: fcfs, lpm"),
        ("--kv-cache-dtype nvfp4", "--kv-cache-dtype nvfp4: choose from: auto, bf16, bfloat16, fp8_e4m3, fp8_e5m2"),
        ("--kv-cache-dtype fp16", "--kv-cache-dtype fp16: choose from"),  # vLLM's name, not SGLang's
        ("--max-total-tokens 1000", "--max-total-tokens: kvsim does not model a token pool capped"),
        ("--max-prefill-tokens 16k", "--max-prefill-tokens: kvsim does not model a prefill-token cap"),
        (
            "--mem-fraction-statc 0.8",
            "unknown flag --mem-fraction-statc (did you mean --mem-fraction-static?); sglang 0.5.23",
        ),
        ("--dp-size 2", "--dp-size: kvsim does not model data parallelism inside one server (only 1"),
        ("--data-parallel-size 2", "--dp-size: kvsim does not model data parallelism"),
        ("--attn-dp-size 2", "--attn-dp-size: kvsim does not model data-parallel attention"),
        ("--cuda-graph-max-bs 64", "unknown flag --cuda-graph-max-bs (did you mean --cuda-graph-max-bs-"),
        ("--cuda-graph-max-bs-decode 64", "--cuda-graph-max-bs-decode: kvsim does not model a decode CUDA-graph"),
        ("--disable-cuda-graph", "--disable-cuda-graph: kvsim does not model running without CUDA graphs"),
        ("--radix-eviction-policy lfu", "--radix-eviction-policy: kvsim does not model a radix eviction policy"),
        ("--retraction-policy priority", "--retraction-policy: kvsim does not model retraction by priority"),
        ("--prefill-max-requests 4", "--prefill-max-requests: kvsim does not model a cap on the requests"),
        ("--hicache-size 100", "--hicache-size: kvsim does not model a HiCache host pool in GB per rank"),
        ("--hicache-host-memory-mode buffer_only", "kvsim does not model host memory as a staging buffer"),
        ("--enable-hierarchical-cache --hicache-ratio x", "--hicache-ratio x: must be a number"),
        ("llama-3-8b", "unexpected 'llama-3-8b': flags start with --"),
    ],
)
def test_sglang_rejections(text, message):
    assert message in error(parse, text, "sglang", "s.yaml", "sglang_args")


# --- into a scenario -------------------------------------------------------------------------
def write(tmp_path, **doc):
    raw = {"name": "f", "gpu": "h100-80gb", "workload": WORKLOAD} | doc
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_scenario_from_vllm_flags_alone(tmp_path):
    scn, _ = load_scenario(
        write(
            tmp_path,
            vllm_args="vllm serve meta-llama/Llama-2-7b-hf --max-model-len 4096 "
            "--max-num-seqs 128 --block-size 32 --enforce-eager",
        )
    )
    assert (scn.model, scn.max_model_len, scn.scheduler.max_num_seqs, scn.enforce_eager) == (
        "llama-2-7b",
        4096,
        128,
        True,
    )
    assert [(p.name, p.allocator, p.block_size) for p in scn.policies] == [("vllm", "paged", 32)]
    assert scn.engine_name == "vllm-v1"


def test_sglang_hicache_flags_make_the_policys_host_pool(tmp_path):
    scn, _ = load_scenario(
        write(tmp_path, model="llama-3-8b", sglang_args="--enable-hierarchical-cache --hicache-write-policy write_back")
    )
    (policy,) = scn.policies
    assert (policy.kv_offload.hicache_ratio, policy.kv_offload.write_policy) == (2.0, "write_back")
    path = write(
        tmp_path,
        model="llama-3-8b",
        policies=[{"name": "p", "allocator": "paged", "kv_offload": {"hicache_ratio": 4.0}}],
        sglang_args="--enable-hicache",
    )
    assert "sglang_args: sets kv_offload.hicache_ratio of policy p to 2.0, but the scenario gives 4.0" in error(
        load_scenario, path
    )


def test_flags_and_fields_must_agree_but_the_command_line_wins(tmp_path):
    path = write(tmp_path, model="llama-3-8b", tensor_parallel_size=1, vllm_args="--tensor-parallel-size 2")
    assert "vllm_args: sets tensor_parallel_size to 2, but the scenario gives 1; give it once" in error(
        load_scenario, path
    )
    path = write(tmp_path, model="llama-3-8b", tensor_parallel_size=1, vllm_args="--max-num-seqs 8")
    scn, _ = load_scenario(path, {"vllm_args": "-tp 2 --max-num-seqs 16"})
    assert (scn.tensor_parallel_size, scn.scheduler.max_num_seqs, scn.vllm_args) == (2, 16, "-tp 2 --max-num-seqs 16")


def test_policy_flags_set_every_paged_policy(tmp_path):
    policies = [
        {"name": "a", "allocator": "paged"},
        {"name": "b", "allocator": "paged", "block_size": 16},
        {"name": "c", "allocator": "contiguous"},
    ]
    scn, _ = load_scenario(
        write(tmp_path, model="llama-3-8b", policies=policies, vllm_args="--kv-cache-dtype fp8 --block-size 16")
    )
    assert [(p.name, p.kv_cache_dtype, getattr(p, "block_size", None)) for p in scn.policies] == [
        ("a", "fp8", 16),
        ("b", "fp8", 16),
        ("c", "auto", None),
    ]
    path = write(tmp_path, model="llama-3-8b", policies=policies[2:], vllm_args="--block-size 32")
    assert "block_size is set per paged policy, and the scenario has none" in error(load_scenario, path)


def test_model_folders_and_engines(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "hidden_size": 256,
                "intermediate_size": 512,
                "max_position_embeddings": 2048,
            }
        )
    )
    scn, base = load_scenario(write(tmp_path, vllm_args="m --max-num-seqs 4"))
    assert scn.model.hf_config == "m/config.json" and scn.model_spec(base).num_layers == 2
    scn, _ = load_scenario(write(tmp_path, model="llama-3-8b", sglang_args="--tp 2 --mem-fraction-static 0.8"))
    assert (scn.engine_name, scn.mem_fraction_static, scn.tensor_parallel_size) == ("sglang", 0.8, 2)
    path = write(tmp_path, model="llama-3-8b", engine="vllm-v1", sglang_args="--tp 2")
    assert "sglang_args: SGLang's flags, but engine is vllm-v1; drop one" in error(load_scenario, path)
    path = write(tmp_path, model="llama-3-8b", vllm_args="--max-num-seqs 4", sglang_args="--tp 2")
    assert "give vLLM's flags or SGLang's, not both" in error(load_scenario, path)


def test_run_json_lists_what_the_flags_set_and_ignored(tmp_path):
    path = write(tmp_path, vllm_args="vllm serve llama-2-7b --max-model-len 4096 --port 8000 --trust-remote-code")
    assert kvsim("run", path, "--out", tmp_path / "out", "--quiet", "--vllm-args", "--max-num-seqs 32 --port 9")[0] == 0
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert meta["engine_args"] == {
        "vllm_args": "--max-num-seqs 32 --port 9",
        "sets": {"scheduler.max_num_seqs": 32},
        "ignored": ["--port 9"],
    }
    written = yaml.safe_load((tmp_path / "out" / "scenario.yaml").read_text())
    assert (written["max_model_len"], written["scheduler"]["max_num_seqs"]) == (4096, 32)
    assert kvsim("run", tmp_path / "out" / "scenario.yaml", "--out", tmp_path / "again", "--quiet")[0] == 0
    line = one_error_line(*kvsim("run", path, "--out", tmp_path / "x", "--vllm-args", "--max-num-seqz 4"))
    assert line == (
        "kvsim: error: command line: vllm_args: unknown flag --max-num-seqz (did you mean "
        "--max-num-seqs?); vllm 0.33.0 has no such flag"
    )


# --- the table the documentation renders ---------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_table_lists_every_known_flag_once(engine):
    rows = table(engine)
    names = [r["flag"] for r in rows]
    assert len(names) == len(set(names)) and set(known(engine)) <= set(names)
    assert {r["kind"] for r in rows} == {"sets", "not modelled", "ignored"}
    fields = (
        set(Scenario.model_fields)
        | {"scheduler." + f for f in Scenario.model_fields["scheduler"].annotation.model_fields}
        | {"policy.block_size", "policy.kv_cache_dtype", "policy.enable_prefix_caching"}
        | {"policy.kv_offload." + f for f in KVOffload.model_fields}
    )
    assert all(r["field"] in fields for r in rows if r["kind"] == "sets")
    # every flag kvsim models or refuses is one the release has (or V0's)
    assert set(VLLM if engine == "vllm" else SGLANG) <= set(known(engine))


def test_flags_command():
    code, out, err = kvsim("flags")
    assert (code, err) == (0, "") and "--max-num-seqs" in out and "--pipeline-parallel-size" in out
    assert "--port" not in out  # the ignored ones only with --all
    code, out, _ = kvsim("flags", "--engine", "sglang", "--json")
    rows = json.loads(out)
    assert {
        "flag": "--mem-fraction-static",
        "kind": "sets",
        "field": "mem_fraction_static",
        "note": "share of GPU memory for weights and the KV pool",
    } in rows
    assert len(rows) == len(known("sglang"))
