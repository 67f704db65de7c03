"""`kvsim memory --gpu`: one model's KV pool on one GPU as each engine would size it."""

from __future__ import annotations

from kvsim.config.engine_defaults import resolve
from kvsim.config.errors import InputError
from kvsim.model.engine_log import engine_log
from kvsim.config.scenario import SchedulerSettings
from kvsim.model.specs import GIB, KVSpec, resolve_kv_dtype

RELEASES = {
    "vllm-v1": "vLLM 0.33.0",
    "vllm-v0": "vLLM V0",
    "sglang": "SGLang 0.5.23",
    "trtllm": "TensorRT-LLM 1.2.0rc2",
}


def pool_reports(
    model,
    gpu,
    engines,
    *,
    tp: int,
    max_model_len: int | None,
    kv_dtype: str,
    gpu_memory_utilization: float,
    mem_fraction_static: float | None,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    block_size: int | None,
) -> list[dict]:
    """Each engine's accounting of one GPU and what it would log of the pool."""
    from kvsim.model import sglang_pool, trtllm_pool, vllm_pool
    from kvsim.config.scenario import check_parallel

    max_model_len = max_model_len or model.max_position_embeddings
    if max_model_len is None:
        raise InputError("command line", "--max-model-len", "required: the model gives no context length")
    check_parallel(tp, model, "command line", "--tensor-parallel-size")
    kv = KVSpec(model, resolve_kv_dtype(kv_dtype, model))
    out = []
    for engine in engines:
        s = resolve(
            engine,
            SchedulerSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            max_model_len=max_model_len,
            gpu_name=gpu.name,
            gpu_memory_gib=gpu.memory_gib,
        )
        if engine == "sglang":
            pool = sglang_pool.size_pool(
                model,
                gpu,
                tp=tp,
                mem_fraction_static=mem_fraction_static,
                chunked_prefill_size=max_num_batched_tokens,
                max_running_requests=max_num_seqs,
            )
            kind, options = "radix", {"page_size": block_size or 1}
        elif engine == "trtllm":  # KvCacheConfig's default free_gpu_memory_fraction
            pool = trtllm_pool.size_pool(
                model,
                gpu,
                tp=tp,
                free_gpu_memory_fraction=0.9,
                max_num_tokens=s.max_num_batched_tokens,
                max_batch_size=s.max_num_seqs,
            )
            kind, options = "trtllm", {"block_size": block_size or 32}
        else:
            pool = vllm_pool.size_pool(
                model,
                gpu,
                tp=tp,
                gpu_memory_utilization=gpu_memory_utilization,
                max_num_batched_tokens=s.max_num_batched_tokens,
                max_num_seqs=s.max_num_seqs,
                cuda_graphs=engine == "vllm-v1",
                engine=engine,
            )
            kind, options = "paged", {"block_size": block_size or 16}
            if engine == "vllm-v1":  # KV cache groups; a window's admission cap counts the batches in flight
                options["hybrid_groups"] = True
                options["vllm_in_flight_tokens"] = (2 if s.async_scheduling else 1) * s.max_num_batched_tokens
        parts = {
            "weights": pool.weight_bytes,
            "non_torch": pool.non_torch_bytes,
            "activations": pool.activation_bytes,
            "cuda_graphs": pool.cudagraph_bytes,
            "kv_cache": max(pool.per_gpu_bytes, 0.0),
        }
        out.append(
            {
                "engine": engine,
                "release": RELEASES[engine],
                "tensor_parallel_size": tp,
                "max_model_len": max_model_len,
                "kv_cache_dtype": kv.kv_cache_dtype,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "max_num_seqs": s.max_num_seqs,
                "budget_source": pool.source,
                "gpu_bytes": pool.gpu_bytes,
                "budget_bytes": pool.usable_bytes,
                "bytes_per_gpu": parts,
                "log": engine_log(pool, kv, kind, options, max_model_len) if pool.per_gpu_bytes > 0 else [],
            }
        )
    return out


def describe(report: dict) -> list[str]:
    """A report as the lines `kvsim memory` prints."""
    p = report["bytes_per_gpu"]
    gib = {k: v / GIB for k, v in p.items()}
    head = (
        f"{report['engine']} ({report['release']}, tp {report['tensor_parallel_size']}, "
        f"max_num_batched_tokens {report['max_num_batched_tokens']:,}, max_num_seqs {report['max_num_seqs']:,}): "
        f"{report['budget_bytes'] / GIB:.2f} GiB per GPU from {report['budget_source']}"
    )
    others = {
        "sglang": " (reserved)",  # TensorRT-LLM captures its CUDA graphs after the pool
        "trtllm": f" + non-torch {gib['non_torch']:.2f}",
    }.get(report["engine"], f" + non-torch {gib['non_torch']:.2f} + CUDA graphs {gib['cuda_graphs']:.2f}")
    parts = (
        f"  weights {gib['weights']:.2f} + activations {gib['activations']:.2f}"
        + others
        + f" + KV cache {gib['kv_cache']:.2f} GiB"
    )
    from kvsim.cli.table import wrap  # lines of at most 100 columns, as every command prints

    lines = [*wrap(head), *wrap(parts, indent="    ")] + [
        x for line in report["log"] for x in wrap(f"  {line}", indent="    ")
    ]
    if not report["log"]:
        lines.append("  no memory left for the KV cache")
    return lines
