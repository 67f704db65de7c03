"""Engine command lines as scenarios: `vllm serve` flags and SGLang's launch flags.

A scenario's `vllm_args: "--tensor-parallel-size 2 --max-model-len 4096 ..."` (or
`kvsim run --vllm-args "..."`) sets what those flags set in vLLM 0.33.0; `sglang_args`
does the same for SGLang 0.5.23 (engine: sglang). What the flags leave unset takes
the engine's defaults (kvsim.config.engine_defaults), as the server would.

Every flag of the release is known (kvsim/data/engine_flags.json, derived from the
releases' own parsers by scripts/derive_engine_flags.py) and falls in one of three kinds,
listed in VLLM and SGLANG below, the table the documentation renders:

* sets: the flag sets a scenario field (top level, `scheduler.`, or every paged policy's);
* not modelled: the flag changes what the server does in a way kvsim does not simulate
  (pipeline parallelism, speculative decoding, quantized weights...): an input error that
  says so, unless its value is the release's default;
* ignored: every other known flag (ports, logging, tokenizers, kernel choices kvsim's step
  costs do not tell apart); accepted and listed in run.json as ignored.

An unknown flag is an input error naming the closest known one. Flags are read as the
servers read them: vLLM's FlexibleArgumentParser (vllm/utils/argparse_utils.py) takes
--name=value, underscores for dashes, --no-NAME for a boolean, -O<level> and dotted
--config.key value; SGLang's argparse takes unique prefixes of a flag (--tp for --tp-size)
and --no-NAME for its few BooleanOptionalAction flags, and reads sizes with SI and IEC
suffixes (16k = 16,000, 16Ki = 16,384).
A leading `vllm serve` or `python -m sglang.launch_server` is dropped.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

from kvsim.config.errors import InputError

DATA = Path(__file__).parent.parent / "data" / "engine_flags.json"
RELEASES = {"vllm": "vllm 0.33.0", "sglang": "sglang 0.5.23"}
HICACHE = "policy.kv_offload.hicache"  # --enable-hierarchical-cache: a switch of the two below
DEFAULT_HICACHE_RATIO = 2.0
KV_DTYPES = {
    "auto": "auto",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


@dataclass(frozen=True)
class Flag:
    """What one flag does in kvsim. field: the scenario field it sets ("policy.x" for
    every paged policy); value: how its value reads (int, size: vLLM's human-readable
    integer, float, bool, str, or a {flag value: kvsim value} table); scale multiplies a
    number on its way in; refused: why kvsim does not model it (then `default` is the one
    value it accepts, the release's default, as a switch's "true"/"false" for switches)."""

    field: str | None
    value: object
    note: str
    scale: float = 1.0
    refused: str | None = None
    default: str | None = None
    invert: bool = False  # a switch that turns its field off (SGLang's --disable-radix-cache)


def refuse(why: str, default: str | None = None) -> Flag:
    return Flag(None, "str", why, refused=why, default=default)


VLLM: dict[str, Flag] = {
    "--model": Flag("model", "str", "the model: a kvsim preset, its Hugging Face id, or a local folder or config.json"),
    "--tensor-parallel-size": Flag("tensor_parallel_size", "int", "GPUs the model is split over"),
    "--max-model-len": Flag("max_model_len", "size", "longest request (prompt + output) in tokens"),
    "--max-num-batched-tokens": Flag("scheduler.max_num_batched_tokens", "size", "tokens one step may hold"),
    "--max-num-seqs": Flag("scheduler.max_num_seqs", "int", "requests one step may hold"),
    "--gpu-memory-utilization": Flag("gpu_memory_utilization", "float", "share of GPU memory vLLM may use"),
    "--kv-cache-memory-bytes": Flag(
        "kv_cache_memory_gib", "size", "the KV cache per GPU, fixed (skips the profile)", scale=2**-30
    ),
    "--enable-prefix-caching": Flag("policy.enable_prefix_caching", "bool", "prefix caching (V1's default: on)"),
    "--block-size": Flag("policy.block_size", "int", "tokens per KV block (default 16)"),
    "--kv-cache-dtype": Flag(
        "policy.kv_cache_dtype",
        {k: v for k, v in KV_DTYPES.items() if k not in ("bf16", "fp16")},
        "KV cache dtype: auto (the model's), bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2",
    ),
    "--enable-chunked-prefill": Flag("scheduler.enable_chunked_prefill", "bool", "split long prompts over steps"),
    "--async-scheduling": Flag(
        "scheduler.async_scheduling", "bool", "plan the next step while this one runs (V1's default: on)"
    ),
    "--enforce-eager": Flag("enforce_eager", "bool", "no CUDA graphs, so none counted in the pool"),
    # what vLLM 0.33.0 does that kvsim does not simulate
    "--pipeline-parallel-size": refuse("pipeline parallelism", "1"),
    "--data-parallel-size": refuse("data parallelism inside one server (kvsim's replicas are separate engines)", "1"),
    "--decode-context-parallel-size": refuse("decode context parallelism", "1"),
    "--prefill-context-parallel-size": refuse("prefill context parallelism", "1"),
    "--enable-expert-parallel": refuse("expert parallelism (kvsim splits experts by tensor parallelism)", "false"),
    "--quantization": refuse("quantized weights"),
    "--dtype": refuse("a weight dtype other than the model's own", "auto"),
    "--speculative-config": refuse("speculative decoding"),
    "--cpu-offload-gb": refuse("weights offloaded to CPU memory", "0"),
    "--kv-offloading-size": refuse("KV offloaded to CPU memory"),
    "--kv-offloading-backend": refuse("KV offloading"),
    "--kv-transfer-config": refuse("KV transfer between engines (disaggregated serving, LMCache)"),
    "--num-gpu-blocks-override": refuse("a fixed block count (give --kv-cache-memory-bytes instead)"),
    "--compilation-config": refuse("a compilation or CUDA-graph mode other than the default"),
    "--optimization-level": refuse("an optimization level other than the default", "2"),
    "--cudagraph-capture-sizes": refuse("CUDA-graph capture sizes other than the default"),
    "--max-cudagraph-capture-size": refuse("a CUDA-graph capture limit other than the default"),
    "--long-prefill-token-threshold": refuse("a cap on one request's prefill tokens per step", "0"),
    "--scheduling-policy": refuse("priority scheduling", "fcfs"),
    "--performance-mode": refuse("a performance mode other than balanced (it changes the batch defaults)", "balanced"),
    "--stream-interval": refuse("streaming more than one token per chunk", "1"),
    "--disable-sliding-window": refuse("sliding-window models run with full attention", "false"),
    "--disable-hybrid-kv-cache-manager": refuse("the unified KV manager for hybrid models", "false"),
    "--max-num-queued-reqs": refuse("a limit on waiting requests"),
    "--max-num-queued-tokens": refuse("a limit on waiting tokens"),
    "--max-num-scheduled-tokens": refuse("a scheduled-token limit apart from max_num_batched_tokens"),
    "--enable-lora": refuse("LoRA adapters", "false"),
    "--enable-dbo": refuse("dual-batch overlap", "false"),
    "--enable-eplb": refuse("expert load balancing", "false"),
    "--kv-cache-dtype-skip-layers": refuse("layers that keep an unquantized KV cache"),
}
# V0's flags (vLLM 0.6.3.post1), where the scenario's engine is vllm-v0; 0.33.0 has neither
VLLM_V0 = {
    "--swap-space": Flag("scheduler.swap_space_gib", "float", "CPU memory per GPU for swapped-out KV, GiB"),
    "--preemption-mode": Flag(
        "scheduler.preemption_mode", {"recompute": "recompute", "swap": "swap"}, "recompute or swap preempted requests"
    ),
}

SGLANG_KV_DTYPES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# SGLang 0.5.23's flags (srt/arg_groups/fields/*.py, srt/server_args.py): parallelism's long
# names are now the short ones (--tp-size, with --tensor-parallel-size its alias);
# --cuda-graph-max-bs became --cuda-graph-max-bs-decode and -prefill; --disable-cuda-graph
# is deprecated for --cuda-graph-backend-{decode,prefill} disabled
SGLANG: dict[str, Flag] = {
    "--model-path": Flag(
        "model", "str", "the model: a kvsim preset, its Hugging Face id, or a local folder or config.json"
    ),
    "--tp-size": Flag("tensor_parallel_size", "int", "GPUs the model is split over"),
    "--context-length": Flag("max_model_len", "size", "longest request in tokens"),
    "--mem-fraction-static": Flag("mem_fraction_static", "float", "share of GPU memory for weights and the KV pool"),
    "--chunked-prefill-size": Flag(
        "scheduler.max_num_batched_tokens", "int", "prefill tokens per step (-1: no chunking)"
    ),
    "--max-running-requests": Flag("scheduler.max_num_seqs", "int", "requests running at once"),
    "--page-size": Flag("policy.block_size", "int", "tokens per KV page (default 1)"),
    "--schedule-policy": Flag(
        "scheduler.schedule_policy",
        {"fcfs": "fcfs", "lpm": "lpm"},
        "order of the waiting queue: fcfs or lpm (longest prefix match); kvsim models no other",
    ),
    "--kv-cache-dtype": Flag(
        "policy.kv_cache_dtype", SGLANG_KV_DTYPES, "KV cache dtype: auto, bf16, bfloat16, fp8_e4m3, fp8_e5m2"
    ),
    "--disable-radix-cache": Flag("policy.enable_prefix_caching", "bool", "no prefix cache", invert=True),
    "--enable-hierarchical-cache": Flag(
        HICACHE, "bool", "HiCache: a host-memory pool behind the radix cache (hicache_ratio 2.0 unless given)"
    ),
    "--hicache-ratio": Flag(
        "policy.kv_offload.hicache_ratio", "float", "HiCache's host pool over the GPU pool (with the flag above)"
    ),
    "--hicache-write-policy": Flag(
        "policy.kv_offload.write_policy",
        {k: k for k in ("write_through", "write_through_selective", "write_back")},
        "when HiCache copies a node to host: write_through, write_through_selective or write_back",
    ),
    # what SGLang 0.5.23 does that kvsim does not simulate
    "--pp-size": refuse("pipeline parallelism", "1"),
    "--dp-size": refuse("data parallelism inside one server", "1"),
    "--attn-dp-size": refuse("data-parallel attention", "1"),
    "--moe-dp-size": refuse("data-parallel MoE", "1"),
    "--ep-size": refuse("expert parallelism", "1"),
    "--enable-dp-attention": refuse("data-parallel attention", "false"),
    "--enable-prefill-cp": refuse("context parallelism in prefill", "false"),
    "--quantization": refuse("quantized weights"),
    "--dtype": refuse("a weight dtype other than the model's own", "auto"),
    "--speculative-algorithm": refuse("speculative decoding"),
    "--cpu-offload-gb": refuse("weights offloaded to CPU memory", "0"),
    "--max-total-tokens": refuse("a token pool capped below what the memory holds"),
    "--max-prefill-tokens": refuse("a prefill-token cap other than the default", "16384"),
    "--prefill-max-requests": refuse("a cap on the requests of one prefill batch"),
    "--max-queued-requests": refuse("a limit on waiting requests"),
    "--prefill-decode-interval": refuse("decode rounds forced between prefills", "0"),
    "--enable-dynamic-chunking": refuse("chunk sizes fitted per step", "false"),
    "--schedule-conservativeness": refuse("a scheduling conservativeness other than the default", "1.0"),
    "--retraction-policy": refuse("retraction by priority", "length"),
    "--radix-eviction-policy": refuse("a radix eviction policy other than LRU", "lru"),
    "--cuda-graph-max-bs-decode": refuse("a decode CUDA-graph batch limit other than the default"),
    "--cuda-graph-max-bs-prefill": refuse("a prefill CUDA-graph limit other than the default"),
    "--cuda-graph-bs-decode": refuse("decode CUDA-graph batch sizes other than the default"),
    "--cuda-graph-bs-prefill": refuse("prefill CUDA-graph sizes other than the default"),
    "--cuda-graph-backend-decode": refuse("a decode CUDA-graph mode other than the default"),
    "--cuda-graph-backend-prefill": refuse("a prefill CUDA-graph mode other than the default"),
    "--disable-decode-cuda-graph": refuse("decoding without CUDA graphs", "false"),
    "--disable-prefill-cuda-graph": refuse("prefilling without CUDA graphs", "false"),
    "--disable-cuda-graph": refuse("running without CUDA graphs", "false"),
    "--hicache-size": refuse(
        "a HiCache host pool in GB per rank (give the policy's kv_offload cpu_gib, the replica's host memory)"
    ),
    "--hicache-host-memory-mode": refuse("host memory as a staging buffer only", "cache"),
    "--hicache-storage-backend": refuse("HiCache's storage layer"),
    "--enable-lora": refuse("LoRA adapters", "false"),
    "--lora-paths": refuse("LoRA adapters"),
    "--enable-mixed-chunk": refuse("mixing decodes into chunked-prefill steps", "false"),
    "--enable-priority-scheduling": refuse("priority scheduling", "false"),
}
TABLES = {"vllm": VLLM, "sglang": SGLANG}
DROP = (
    ("vllm", "serve"),
    ("python", "-m", "vllm.entrypoints.openai.api_server"),
    ("python3", "-m", "vllm.entrypoints.openai.api_server"),
    ("python", "-m", "sglang.launch_server"),
    ("python3", "-m", "sglang.launch_server"),
    ("sglang", "serve"),
)


@lru_cache(maxsize=None)
def known(engine: str) -> dict[str, dict]:
    """Every flag of the release: {long name: {aliases, switch}}."""
    return json.loads(DATA.read_text())[RELEASES[engine]]


@lru_cache(maxsize=None)
def _aliases(engine: str) -> dict[str, str]:
    out = {name: name for name in known(engine)}
    for name, info in known(engine).items():
        out.update({alias: name for alias in info["aliases"]})
    return out


@dataclass(frozen=True)
class Parsed:
    """What a command line sets ({field: value}), and the flags it gave that kvsim ignores."""

    sets: dict
    ignored: tuple[str, ...]


def parse(text: str, engine: str, src: str, where: str, v0: bool = False) -> Parsed:
    """Read one engine's command line ("vllm" or "sglang"); v0: vLLM V0's flags too."""
    table = TABLES[engine] | (VLLM_V0 if v0 else {})
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise InputError(src, where, f"cannot be read as a command line ({e})") from None
    for prefix in DROP:
        if tuple(tokens[: len(prefix)]) == prefix:
            tokens = tokens[len(prefix) :]
    sets, ignored, seen = {}, [], set()
    i = 0
    while i < len(tokens):
        token, i = tokens[i], i + 1
        if not token.startswith("-") or _number(token):
            if "model" in sets or engine != "vllm":
                raise InputError(
                    src,
                    where,
                    f"unexpected '{token}': flags start with --"
                    + ("" if engine != "vllm" else "; give the model once, first or after --model"),
                )
            sets["model"] = token
            continue
        name, value = _name(token, engine)
        canonical, negated = _canonical(name, engine, table, src, where)
        if canonical in seen:
            raise InputError(src, where, f"{canonical} appears twice")
        seen.add(canonical)
        switch = known(engine).get(canonical, {}).get("switch", False)
        if value is None and not switch:
            if i >= len(tokens) or (tokens[i].startswith("-") and not _number(tokens[i])):
                raise InputError(src, where, f"{canonical} needs a value")
            value, i = tokens[i], i + 1
        given = f"--no-{canonical[2:]}" if negated else canonical if value is None else f"{canonical} {value}"
        if switch:
            value = "false" if negated else (value or "true")
        flag = table.get(canonical)
        if flag is None:
            ignored.append(given)
            continue
        if flag.refused is not None:
            if flag.default is not None and _is_default(value, flag.default, engine):
                ignored.append(given)
                continue
            raise InputError(
                src,
                where,
                f"{canonical}: kvsim does not model {flag.refused}"
                + (f" (only {flag.default}, the default)" if flag.default is not None else ""),
            )
        if flag.field in sets:
            raise InputError(src, where, f"{canonical} sets {flag.field}, given already")
        sets[flag.field] = _value(flag, canonical, value, src, where)
    if engine == "sglang" and sets.get("scheduler.max_num_batched_tokens") == -1:
        del sets["scheduler.max_num_batched_tokens"]  # SGLang: -1 turns chunking off
        sets["scheduler.enable_chunked_prefill"] = False
    if engine == "sglang":
        _hicache(sets, ignored)
    return Parsed(sets, tuple(ignored))


def _hicache(sets: dict, ignored: list) -> None:
    """HiCache's flags as the policy's kv_offload: --enable-hierarchical-cache makes the
    host pool, of --hicache-ratio times the GPU pool or 2.0 (arg_groups/hicache_hook.py,
    handle_hicache_ratio_default, host memory mode `cache`); without it SGLang builds no
    host pool, and the ratio and write policy change nothing."""
    on = sets.pop(HICACHE, False)
    for field, flag in (("hicache_ratio", "--hicache-ratio"), ("write_policy", "--hicache-write-policy")):
        key = f"policy.kv_offload.{field}"
        if not on and key in sets:
            ignored.append(f"{flag} {sets.pop(key)} (no --enable-hierarchical-cache)")
    if on:
        sets.setdefault("policy.kv_offload.hicache_ratio", DEFAULT_HICACHE_RATIO)


def _is_default(value: str, default: str, engine: str) -> bool:
    """Whether a refused flag's value is the release's default, as its parser reads both."""
    if value.lower() == default:
        return True
    try:
        read = sglang_size if engine == "sglang" else size
        return float(read(value) if not re.fullmatch(r"[\d.]+", value) else value) == float(default)
    except ValueError:
        return False


def _number(token: str) -> bool:
    return re.fullmatch(r"-\d+(\.\d+)?", token) is not None


def _name(token: str, engine: str) -> tuple[str, str | None]:
    """(flag name, value given with =) as the engine's parser reads the token."""
    if engine == "vllm" and re.fullmatch(r"-O(=?\w+)", token):
        return "--optimization-level", token[2:].lstrip("=")
    name, _, value = token.partition("=")
    if engine == "vllm":
        name = name.split(".", 1)[0]  # --compilation-config.mode: the flag, one key of it
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
    return name, (value if "=" in token else None)


def _canonical(name: str, engine: str, table: dict, src: str, where: str) -> tuple[str, bool]:
    """The flag's long name, and whether it was given as --no-NAME."""
    aliases = _aliases(engine) | {n: n for n in table}
    if name in aliases:
        return aliases[name], False
    if engine == "vllm" and name.startswith("--no-") and "--" + name[5:] in aliases:
        target = aliases["--" + name[5:]]
        if known(engine).get(target, {}).get("switch"):
            return target, True
    if engine == "sglang" and name.startswith("--no-") and known(engine).get("--" + name[5:], {}).get("negatable"):
        return "--" + name[5:], True  # a BooleanOptionalAction's --no-NAME
    if engine == "sglang" and name.startswith("--"):  # argparse's unique prefixes
        matches = sorted({v for k, v in aliases.items() if k.startswith(name)})
        if len(matches) == 1:
            return matches[0], False
    if engine == "vllm" and name in ("--swap-space", "--preemption-mode"):
        raise InputError(
            src,
            where,
            f"{name} is vLLM V0's (engine: vllm-v0); vLLM 0.33.0 has no such flag (V1 preempts by recomputation)",
        )
    close = difflib.get_close_matches(name, list(aliases), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise InputError(src, where, f"unknown flag {name}{hint}; {RELEASES[engine]} has no such flag")


def _value(flag: Flag, name: str, value: str, src: str, where: str):
    kind = flag.value
    try:
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError("must be true or false")
            return (value.lower() in ("true", "1")) != flag.invert
        if isinstance(kind, dict):
            if value not in kind:
                raise ValueError(f"choose from: {', '.join(kind)}")
            return kind[value]
        if kind == "int":
            return int(value)
        if kind == "size":
            read = sglang_size if name in SGLANG else size
            return read(value) * flag.scale if flag.scale != 1 else read(value)
        if kind == "float":
            return float(value)
        return value
    except ValueError as e:
        why = (
            str(e)
            if kind in ("bool",) or isinstance(kind, dict)
            else f"must be {'a whole number' if kind in ('int', 'size') else 'a number'}"
        )
        raise InputError(src, where, f"{name} {value}: {why}") from None


def size(value: str) -> int:
    """vLLM's human-readable integer (vllm/utils/argparse_utils.py, human_readable_int):
    1k = 1,000, 1K = 1,024, 25.6k = 25,600; likewise m/M, g/G, t/T."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not match:
        return int(value)
    number, suffix = match.groups()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(suffix) or 2 ** (10 * "KMGT".index(suffix) + 10)
    return int(float(number) * mult)


def sglang_size(value: str) -> int:
    """SGLang's human-readable integer (srt/utils/common.py, human_readable_int): SI
    suffixes k, M, G, T (decimals allowed: 25.6k = 25,600) and IEC ones Ki, Mi, Gi, Ti
    (1Ki = 1,024), case-sensitive."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value.strip())
    if not match:
        return int(value)
    number, suffix = match.groups()
    if suffix.endswith("i"):
        if "." in number:
            raise ValueError("decimals are not allowed with IEC suffixes")
        return int(number) * 2 ** (10 * ("KMGT".index(suffix[0]) + 1))
    return int(Decimal(number) * 10 ** (3 * ("kMGT".index(suffix) + 1)))


# Hugging Face ids of kvsim's model presets (their config.json give the presets' shapes;
# chat and instruct variants share them)
HF_IDS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/Llama-2-13b-hf": "llama-2-13b",
    "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b",
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistral-7b",
    "Qwen/Qwen2-7B": "qwen2-7b",
    "Qwen/Qwen2-7B-Instruct": "qwen2-7b",
    "facebook/opt-13b": "opt-13b",
    "deepseek-ai/DeepSeek-V2": "deepseek-v2",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "bigscience/bloom": "bloom-176b",
}
ARGS_FIELDS = {"vllm_args": "vllm", "sglang_args": "sglang"}


def apply(raw: dict, key: str, text: str, src: str, base: Path, override: bool = False) -> tuple[dict, Parsed]:
    """The scenario mapping with what `key`'s command line sets written into it. A field the
    scenario also gives must agree, unless override (the command line's --vllm-args wins)."""
    engine = ARGS_FIELDS[key]
    named = raw.get("engine") or (raw.get("scheduler") or {}).get("engine")
    if engine == "sglang" and named not in (None, "sglang"):
        raise InputError(src, key, f"SGLang's flags, but engine is {named}; drop one")
    if engine == "vllm" and named == "sglang":
        raise InputError(src, key, "vLLM's flags, but engine is sglang; give sglang_args instead")
    parsed = parse(text, engine, src, key, v0=named == "vllm-v0")
    raw = json.loads(json.dumps(raw))  # a deep copy of plain YAML data
    if engine == "sglang" and named is None:
        raw["engine"] = "sglang"
    raw.setdefault("policies", [{"name": engine, "allocator": "paged"}])  # the server's own

    def put(holder: dict, name: str, value, shown: str) -> None:
        if name in holder and holder[name] != value and not override:
            raise InputError(
                src, key, f"sets {shown} to {value!r}, but the scenario gives {holder[name]!r}; give it once"
            )
        holder[name] = value

    for field, value in parsed.sets.items():
        if field == "model":
            put(raw, "model", _model(value, base, absolute=override), "model")
        elif field.startswith("scheduler."):
            put(raw.setdefault("scheduler", {}), field.split(".", 1)[1], value, field)
        elif field.startswith("policy."):
            paged = [p for p in raw["policies"] if isinstance(p, dict) and p.get("allocator") == "paged"]
            if not paged:
                raise InputError(
                    src,
                    key,
                    f"{field.split('.', 1)[1]} is set per paged policy, and the scenario "
                    "has none (add one with allocator: paged)",
                )
            for policy in paged:
                name = field.split(".", 1)[1]
                if name.startswith("kv_offload."):  # HiCache's flags: fields of the policy's kv_offload
                    holder, name = policy.setdefault("kv_offload", {}), name.split(".", 1)[1]
                    put(holder, name, value, f"kv_offload.{name} of policy {policy.get('name')}")
                else:
                    put(policy, name, value, f"{name} of policy {policy.get('name')}")
        else:
            put(raw, field, value, field)
    return raw, parsed


def _model(value: str, base: Path, absolute: bool):
    """--model's value as a scenario model: a preset, a preset's Hugging Face id, or a
    config.json (a file, or a folder holding one, relative to `base`: kept relative to
    the scenario, or made absolute for one given on the command line)."""
    from kvsim.model.specs import MODEL_PRESETS

    if value in MODEL_PRESETS or value in HF_IDS:
        return HF_IDS.get(value, value)
    path = base / value
    if path.is_dir() and (path / "config.json").is_file():
        path, value = path / "config.json", str(Path(value) / "config.json")
    if path.is_file():
        return {"hf_config": str(path.resolve()) if absolute else value}
    return value  # the scenario's own message for an unknown model then names it


# known flags kvsim ignores though a server runs differently with them: kernel and backend choices
KERNEL_CHOICES = (
    "--attention-backend",
    "--moe-backend",
    "--linear-backend",
    "--mamba-backend",
    "--all2all-backend",
    "--disable-custom-all-reduce",
    "--enable-flashinfer-autotune",
    "--kernel-config",
    "--distributed-executor-backend",
    "--attention-config",
    "--prefill-attention-backend",
    "--decode-attention-backend",
    "--sampling-backend",
    "--grammar-backend",
    "--moe-runner-backend",
    "--disable-custom-all-reduce",
)


def table(engine: str) -> list[dict]:
    """Every flag kvsim understands for the engine, for the documentation: what it sets,
    what kvsim does not model, and what it ignores."""
    flags = TABLES[engine] | (VLLM_V0 if engine == "vllm" else {})
    rows = [
        {
            "flag": name,
            "kind": "not modelled" if f.refused else "sets",
            "field": "policy.kv_offload.hicache_ratio" if f.field == HICACHE else f.field,
            "note": f.note + (" (engine: vllm-v0)" if name in VLLM_V0 else ""),
        }
        for name, f in flags.items()
    ]
    rows += [
        {
            "flag": name,
            "kind": "ignored",
            "field": None,
            "note": "a kernel choice kvsim's step costs do not tell apart"
            if name in KERNEL_CHOICES
            else "no simulated quantity",
        }
        for name in known(engine)
        if name not in flags
    ]
    return rows
