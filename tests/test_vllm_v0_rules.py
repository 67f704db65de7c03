"""vLLM V0's (0.6.3.post1) defaults and chunked scheduling, on cases derived by hand from
the cited code (kvsim/engines/vllm_v0.py, kvsim/config/engine_defaults.py)."""

from types import SimpleNamespace

import pytest

from kvsim.config.engine_defaults import resolve
from kvsim.engines.base import Request, Step
from kvsim.engines.vllm_v0 import VllmV0
from kvsim.kvcache import PagedAllocator, SeqShape
from kvsim.sim.scheduler import Scheduler, SwapSpace
from kvsim.workload.requests import RequestSpec

UNSET = SimpleNamespace(
    max_num_seqs=None,
    max_num_batched_tokens=None,
    enable_chunked_prefill=None,
    preemption_mode=None,
    watermark=None,
    schedule_policy=None,
    async_scheduling=None,
)


@pytest.mark.parametrize("max_model_len, chunked, budget", [(32768, False, 32768), (32769, True, 512)])
def test_v0_turns_chunked_prefill_on_over_32k_contexts(max_model_len, chunked, budget):
    # EngineArgs.create_engine_config: max_model_len > 32768 and enable_chunked_prefill
    # unset turn it on; SchedulerConfig then gives the budget 512 tokens.
    s = resolve("vllm-v0", UNSET, max_model_len=max_model_len, gpu_name="H100", gpu_memory_gib=80)
    assert (s.enable_chunked_prefill, s.max_num_batched_tokens) == (chunked, budget)
    given = resolve(
        "vllm-v0",
        SimpleNamespace(**{**vars(UNSET), "enable_chunked_prefill": False}),
        max_model_len=max_model_len,
        gpu_name="H100",
        gpu_memory_gib=80,
    )
    assert not given.enable_chunked_prefill


@pytest.mark.parametrize(
    "model, chunked",
    [
        ({"sliding_window": 4096}, False),  # a window on every layer: the default stays off
        ({"hybrid_window": 4096, "hybrid_window_layers": 16}, True),  # interleaved: window off, default on
        ({}, True),
        ({"sliding_window": 4096, "given": True}, True),  # a scenario's own setting stands
    ],
)
def test_v0s_long_context_default_leaves_chunking_off_under_a_sliding_window(model, chunked):
    from kvsim.config.scenario import validate_scenario

    given = model.pop("given", None)
    raw = {
        "name": "long",
        "engine": "vllm-v0",
        "model": {
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "params": 7e9,
            "max_position_embeddings": 65536,
            **model,
        },
        "gpu": "h100-80gb",
        "cost_model": "roofline",
        "scheduler": {"enable_chunked_prefill": True} if given else {},
        "workload": {
            "num_requests": 2,
            "arrival": {"process": "burst"},
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 10},
        },
        "policies": [{"name": "paged", "allocator": "paged", "block_size": 16}],
    }
    s = validate_scenario(raw, "s.yaml").engine_settings()
    assert s.enable_chunked_prefill == chunked
    assert s.max_num_batched_tokens == (512 if chunked else 65536)


def test_v0_chunked_prefills_while_a_group_is_swapped_out():
    # 5 blocks of 4. A (12 tokens, 3 blocks) decodes into a 4th block; B, swapped out
    # with 8 tokens, needs 3 blocks to come back and 1 is free, so it stays out; C's 3
    # prompt tokens and its sampled token's slot take the last block in the same step
    # (_schedule_chunked_prefill schedules prefills whether or not groups are swapped).
    alloc = PagedAllocator(5, 4)
    swap = SwapSpace(capacity_bytes=1000, bytes_per_token=1.0, bandwidth_bytes_s=1e9)
    s = Scheduler(
        alloc,
        VllmV0(),
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=True,
        watermark=0.0,
        swap=swap,
    )
    a, b, c = (Request(RequestSpec(i, 0.0, p, 5), SeqShape(p, 5)) for i, p in enumerate((11, 7, 3)))
    for i, req in enumerate((a, b, c)):
        s.arrive(req, 0.0, i)
    assert s.admit(a, 0, 11, 12, Step(), 0.0)
    a.prefilled, a.generated, a.held = 11, 1, 12
    s.waiting.remove(b)
    b.swapped, b.prefilled, b.generated, b.held = True, 7, 1, 8
    s.swapped.append(b)
    s.swap_used = 8.0
    step = s.schedule(1.0)
    assert [(r.spec.id, n) for r, n in step.work] == [(0, 1), (2, 3)]
    assert list(s.swapped) == [b] and alloc.free_blocks == []
    assert step.limit == "preemption"
