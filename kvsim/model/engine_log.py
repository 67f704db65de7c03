"""What an engine logs about a policy's KV pool once it has sized it."""
from __future__ import annotations

from kvsim.model.memory import PoolSizing
from kvsim.model.sglang_pool import tokens_of
from kvsim.model.vllm_pool import KVCapacity


def engine_log(pool: PoolSizing, kv, kind: str, options: dict, max_model_len: int) -> list[str]:
    """What the engine logs about one policy's pool: vLLM's "GPU KV cache size" and
    "Maximum concurrency" lines (kvsim.model.vllm_pool.KVCapacity), SGLang's "KV Cache is
    allocated" (kvsim.model.sglang_pool.tokens_of); none for a contiguous policy, which no
    engine runs."""
    if kind == "contiguous":
        return []
    if pool.engine == "sglang":
        return [f"KV Cache is allocated. #tokens: {tokens_of(pool, kv, options.get('page_size', 1))}"]
    block = options.get("block_size", options.get("page_size", 1))    # a radix cache's pages
    return list(KVCapacity.of(pool, kv, block, max_model_len).lines())
