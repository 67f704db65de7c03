"""`engine: vllm-reference`: vLLM 0.33.0's own scheduler deciding kvsim's steps
(kvsim.engines.vllm_reference_rules). Where vLLM is installed, its runs must match
kvsim's native vllm-v1 rules request by request and step by step (the two agree in the
differential test, so any difference is the engine's wiring); without it, the engine is
an input error that says how to install it."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from kvsim.config.errors import InputError
from kvsim.config.scenario import validate_scenario
from kvsim.sim.differential import Setup, native_allocator, random_stream
from kvsim.sim.loop import simulate
from kvsim.workload.requests import RequestSpec

from helpers import OneSecondSteps

SCENARIO = Path(__file__).parent / "data" / "golden_tiny.yaml"


def vllm_or_skip():
    from kvsim.engines.vllm_reference import VllmMissing, load_vllm

    try:
        load_vllm()
    except VllmMissing as e:
        pytest.skip(str(e))


def run(engine, reqs, alloc, setup):
    return simulate(
        "p",
        reqs,
        alloc,
        OneSecondSteps(),
        engine=engine,
        max_model_len=setup.max_model_len,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        chunked_prefill=setup.enable_chunked_prefill,
        check_invariants=True,
        async_scheduling=False,
        sliding_window=setup.sliding_window,
    )


@pytest.mark.parametrize("seed", range(12))
def test_vllm_reference_runs_as_the_native_rules_request_by_request(seed):
    """Seeds 8 and 9: a sliding window on every layer (vLLM's SlidingWindowManager);
    10 and 11: a hybrid model's groups, a window's and full attention's, with prefix
    caching and without (kvsim.kvcache.hybrid_prefix, hybrid)."""
    vllm_or_skip()
    rng = np.random.default_rng(seed)
    chunked = bool(seed % 4)  # without chunking every prompt fits the budget
    budget = int(rng.choice([32, 64, 256])) if chunked else 256
    bs = int(rng.choice([4, 16]))
    setup = Setup(
        num_blocks=int(rng.integers(16, 48)),
        block_size=bs,
        max_num_seqs=int(rng.integers(2, 8)),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=seed % 3 != 2,
        max_model_len=4096 if chunked else budget,
        sliding_window=2 * bs + 3 if seed in (8, 9) else None,
        groups=(2 * bs + 3, None) if seed >= 10 else (),
    )
    stream = random_stream(rng, setup, 24)
    reqs = [
        RequestSpec(i, float(a.step), a.shape.prompt_tokens, a.shape.output_tokens, a.shape.segments, a.shape.tail_id)
        for i, a in enumerate(stream)
    ]
    native, ref = (run(e, reqs, native_allocator(setup), setup) for e in ("vllm-v1", "vllm-reference"))
    timeline = lambda r: [(s.admitted_s, s.first_token_s, s.finish_s, s.preemptions, s.outcome) for s in r.seqs]  # noqa: E731
    assert timeline(ref) == timeline(native)
    assert np.array_equal(ref.steps.array(), native.steps.array())  # every step's record
    assert (ref.preemptions, ref.cached_tokens) == (native.preemptions, native.cached_tokens)


def scenario(**changes):
    raw = yaml.safe_load(SCENARIO.read_text())
    raw.update(engine="vllm-reference", policies=[{"name": "paged-16", "allocator": "paged", "block_size": 16}])
    raw.update(changes)
    return raw


def test_a_scenario_runs_under_vllm_reference():
    vllm_or_skip()
    from kvsim.analysis.results import run_scenario

    raw = scenario()
    raw["workload"] = {**raw["workload"], "num_requests": 12}
    results = run_scenario(validate_scenario(raw, str(SCENARIO)), SCENARIO.parent, str(SCENARIO))
    row = results.summary.iloc[0]
    assert row["engine"] == "vllm-reference" and row["requests_completed"] == 12


def test_vllm_reference_without_vllm_is_an_input_error(monkeypatch):
    from importlib import metadata

    real = metadata.version

    def missing(name):
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(InputError, match=r"engine.*pip install 'kvsim\[vllm\]'"):
        validate_scenario(scenario(), str(SCENARIO))


def test_vllm_reference_needs_a_paged_pool():
    vllm_or_skip()
    raw = scenario(policies=[{"name": "c", "allocator": "contiguous"}])
    with pytest.raises(InputError, match=r"policies\[0\].*paged"):
        validate_scenario(raw, str(SCENARIO))
