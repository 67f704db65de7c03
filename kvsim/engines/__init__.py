"""Engine rules: how vLLM V0, vLLM V1, SGLang and TensorRT-LLM decide what one step holds,
and vLLM's own V1 scheduler deciding it (vllm-reference).

Exports: ENGINES (the registry keyed by the scenario's `engine:`), make_rules; base (EngineRules,
the protocol each implements, and what they work with); each engine's defaults are
kvsim.config.engine_defaults' (re-exported here).
"""

from __future__ import annotations

from typing import Callable

from kvsim.engines.base import EngineRules
from kvsim.config.engine_defaults import DEFAULT_ENGINE, EngineSettings, resolve
from kvsim.engines.sglang import SGLang
from kvsim.engines.trtllm import TensorRTLLM
from kvsim.engines.vllm_v0 import VllmV0
from kvsim.engines.vllm_reference_rules import VllmReferenceRules
from kvsim.engines.vllm_v1 import VllmV1

ENGINES: dict[str, Callable[[], EngineRules]] = {
    "vllm-v0": VllmV0,
    "vllm-v1": VllmV1,
    "sglang": SGLang,
    "vllm-reference": VllmReferenceRules,  # vLLM 0.33.0's own scheduler (kvsim[vllm])
    "trtllm": TensorRTLLM,
}


def make_rules(engine: str) -> EngineRules:
    """A fresh rules object for one run (rules may keep state, as SGLang's ratio)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    return ENGINES[engine]()


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineRules", "EngineSettings", "make_rules", "resolve"]
