"""What is served: model and GPU specs, the KV cache's bytes per token, and the GPU memory arithmetic.

Exports: specs (ModelSpec, GPUSpec, KVSpec, presets); memory (kv_footprint, size_pool).
"""
