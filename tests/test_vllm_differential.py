"""kvsim's `vllm-v1` rules step by step against vLLM 0.33.0's own scheduler
(kvsim.sim.differential): random streams (full attention, and a sliding window on every
layer) and every shipped scenario's stream must agree in every step. Needs the
`kvsim[vllm]` extra and vLLM itself (see kvsim.engines.vllm_reference); skipped without
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvsim.sim.differential import Setup, compare, random_stream, run_native, run_reference, scenario_stream
from kvsim.engines.vllm_reference import VllmMissing, load_vllm
from kvsim.config.errors import InputError

try:
    load_vllm()
except VllmMissing as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.slow
SCENARIOS = sorted(p for p in (Path(__file__).parent.parent / "scenarios").rglob("*.yaml") if "sweeps" not in p.parts)
# scripts/vllm_differential.py counts them
RANDOM_SEEDS, WINDOWED_SEEDS, HYBRID_SEEDS = range(300), range(1000, 1100), range(2000, 2100)


def random_setup(rng: np.random.Generator) -> Setup:
    """Small pools (preemption), budgets and max_num_seqs that bind, chunking on and off,
    prefix caching on and off, blocks of 4 and 16 tokens."""
    budget, chunked = int(rng.choice([32, 64, 256])), bool(rng.random() < 0.7)
    return Setup(
        num_blocks=int(rng.integers(12, 60)),
        block_size=int(rng.choice([4, 16])),
        max_num_seqs=int(rng.integers(2, 9)),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=bool(rng.random() < 0.8),
        max_model_len=1024 if chunked else budget,
    )


def windowed_setup(rng: np.random.Generator) -> Setup:
    """As random_setup, with a sliding window on every layer: one block, a few blocks and
    a bit, or longer than most prompts (vLLM's SlidingWindowManager)."""
    setup = random_setup(rng)
    bs = setup.block_size
    return dataclasses.replace(setup, sliding_window=int(rng.choice([bs, 2 * bs + 3, 40, 100])))


def hybrid_setup(rng: np.random.Generator) -> Setup:
    """As windowed_setup, for a hybrid model: a windowed group beside a full-attention one
    (gpt-oss's pattern), or three beside one (Gemma 3's, shortened); the pool as many
    times larger as there are groups."""
    setup = windowed_setup(rng)
    windowed = int(rng.choice([1, 3]))
    return dataclasses.replace(
        setup,
        sliding_window=None,
        groups=(setup.sliding_window,) * windowed + (None,),
        num_blocks=setup.num_blocks * (windowed + 1),
    )


def agree(seeds, make_setup) -> None:
    for seed in seeds:
        rng = np.random.default_rng(seed)
        setup = make_setup(rng)
        stream = random_stream(rng, setup, 20)
        native, reference = run_native(stream, setup), run_reference(stream, setup)
        assert compare(native, reference) == [], f"seed {seed}, {setup}"
        assert sum(len(r.finished) for r in native) == len(stream)


@pytest.mark.parametrize("batch", range(10))
def test_random_streams_agree_step_by_step(batch):
    agree(RANDOM_SEEDS[batch::10], random_setup)


@pytest.mark.parametrize("batch", range(4))
def test_sliding_window_streams_agree_step_by_step(batch):
    agree(WINDOWED_SEEDS[batch::4], windowed_setup)


@pytest.mark.parametrize("batch", range(4))
def test_hybrid_streams_agree_step_by_step(batch):
    agree(HYBRID_SEEDS[batch::4], hybrid_setup)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenario_streams_agree_step_by_step(path):
    try:
        stream, setup = scenario_stream(path)
    except InputError as e:  # a scenario that replays data this checkout lacks
        pytest.skip(str(e))
    native, reference = run_native(stream, setup), run_reference(stream, setup)
    assert compare(native, reference) == []
    assert sum(len(r.finished) for r in native) == len(stream)
