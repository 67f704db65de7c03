"""What an engine logs about a policy's KV pool once it has sized it."""

from __future__ import annotations

from kvsim.model.memory import PoolSizing
from kvsim.model.sglang_pool import tokens_of
from kvsim.model.vllm_pool import KVCapacity


def engine_log(pool: PoolSizing, kv, kind: str, options: dict, max_model_len: int) -> list[str]:
    """What the engine logs about one policy's pool: vLLM's "GPU KV cache size" and
    "Maximum concurrency" lines (kvsim.model.vllm_pool.KVCapacity), SGLang's "KV Cache is
    allocated" (kvsim.model.sglang_pool.tokens_of), TensorRT-LLM's lines of
    KVCacheManager::allocatePools (trtllm_lines); none for a contiguous policy, which no
    engine runs."""
    if kind == "contiguous":
        return []
    if kind == "trtllm":
        return trtllm_lines(pool, kv, options.get("block_size", 32))
    if pool.engine == "sglang":
        return [f"KV Cache is allocated. #tokens: {tokens_of(pool, kv, options.get('page_size', 1))}"]
    block = options.get("block_size", options.get("page_size", 1))  # a radix cache's pages
    in_flight = options.get("vllm_in_flight_tokens")  # vLLM V1's, where a window caps admission
    hybrid = bool(options.get("hybrid_groups"))  # vLLM V1's groups for a hybrid model's layers
    return list(KVCapacity.of(pool, kv, block, max_model_len, in_flight, hybrid).lines())


def trtllm_lines(pool: PoolSizing, kv, tokens_per_block: int) -> list[str]:
    """TensorRT-LLM's log of its primary pool (TensorRT-LLM 1.2.0rc2's
    cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, `KVCacheManager::allocatePools`): tokens per block, and one GPU's bytes for the pool's
    blocks, which round its tokens up (`calculateMaxNumBlocks`)."""
    blocks = -(-int(pool.pool_bytes // kv.bytes_per_token) // tokens_per_block)
    per_gpu = blocks * tokens_per_block * kv.bytes_per_token / pool.kv_shards
    return [
        f"Number of tokens per block: {tokens_per_block}.",
        f"[MemUsageChange] Allocated {per_gpu / 2**30:.2f} GiB for max tokens in paged KV cache "
        f"({blocks * tokens_per_block}).",
    ]
