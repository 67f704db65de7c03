"""The request stream: seeded, independent arrival and length streams, bounds, traces.

Statistical checks use one fixed seed (so they are deterministic) and a tolerance of
five standard errors from the central limit theorem, stated beside each check: a correct
sampler fails such a check with probability below 1e-6 for a fresh seed.
"""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import with_changes
from kvsim.config.errors import InputError
from kvsim.config.scenario import load_scenario
from kvsim.workload.requests import RequestSpec, generate_requests

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.csv"
# tests/data/tiny_trace.csv: (arrived_at, num_prefill_tokens, num_decode_tokens)
TINY_ROWS = [
    (0.0, 374, 44),
    (0.21, 396, 109),
    (0.45, 879, 55),
    (0.9, 1200, 8),
    (1.32, 64, 310),
    (1.33, 2048, 17),
    (2.05, 512, 256),
    (2.8, 95, 1),
    (3.6, 4000, 120),
    (4.5, 17, 600),
]

BASE = {
    "name": "wl",
    "seed": 0,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 4096,
    "cost_model": "roofline",
    # the pool is given: these tests only draw requests, and with max_model_len 2^21 the
    # default token budget's activations would leave a sized pool no room (refused at load)
    "kv_cache_memory_gib": 20,
    "workload": {
        "num_requests": 200,
        "arrival": {"process": "poisson", "rate_per_s": 2.0},
        "prompt_tokens": {"dist": "uniform", "min": 10, "max": 1000},
        "output_tokens": {"dist": "lognormal", "mean": 200, "cv": 1.0, "min": 1, "max": 2000},
    },
    "policies": [{"name": "paged-16", "allocator": "paged"}],
}


def make_requests(tmp_path: Path, *, seed: int = 0, max_model_len: int = 4096, **workload):
    """Write a scenario whose workload keys are replaced by `workload` (None drops a key),
    load it, and return (requests, scenario path)."""
    raw = with_changes(
        BASE, seed=seed, max_model_len=max_model_len, **{f"workload__{key}": value for key, value in workload.items()}
    )
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(raw))
    scn, base_dir = load_scenario(path)
    return generate_requests(scn, base_dir, str(path)), path


def columns(requests: list[RequestSpec]):
    return (
        np.array([r.arrival_s for r in requests]),
        np.array([r.prompt_tokens for r in requests]),
        np.array([r.output_tokens for r in requests]),
    )


def gaps(requests):
    arrivals = columns(requests)[0]
    return np.diff(arrivals, prepend=0.0)  # the first request comes one gap after t = 0


# --- seeding ---------------------------------------------------------------------------
def test_same_seed_same_stream(tmp_path):
    a, _ = make_requests(tmp_path, seed=7)
    b, _ = make_requests(tmp_path, seed=7)
    assert a == b
    assert [r.id for r in a] == list(range(200))


def test_different_seeds_differ(tmp_path):
    a, _ = make_requests(tmp_path, seed=1)
    b, _ = make_requests(tmp_path, seed=2)
    for x, y in zip(columns(a), columns(b)):
        assert not np.array_equal(x, y)


def test_arrival_rate_does_not_change_lengths(tmp_path):
    slow, _ = make_requests(tmp_path, arrival={"process": "poisson", "rate_per_s": 1.0})
    fast, _ = make_requests(tmp_path, arrival={"process": "gamma", "rate_per_s": 50.0, "cv": 3.0})
    _, p1, o1 = columns(slow)
    _, p2, o2 = columns(fast)
    assert np.array_equal(p1, p2) and np.array_equal(o1, o2)
    assert not np.array_equal(columns(slow)[0], columns(fast)[0])


def test_lengths_do_not_change_arrivals(tmp_path):
    a, _ = make_requests(tmp_path)
    b, _ = make_requests(tmp_path, prompt_tokens={"dist": "fixed", "value": 5})
    assert np.array_equal(columns(a)[0], columns(b)[0])


def test_arrival_times_are_sorted_and_positive(tmp_path):
    requests, _ = make_requests(tmp_path, arrival={"process": "gamma", "rate_per_s": 5.0, "cv": 2.0})
    arrivals = columns(requests)[0]
    assert arrivals[0] > 0 and np.all(np.diff(arrivals) >= 0)


# --- arrival processes -----------------------------------------------------------------
N_STATS = 100_000


def test_poisson_mean_gap_is_one_over_rate(tmp_path):
    rate = 4.0
    requests, _ = make_requests(
        tmp_path,
        num_requests=N_STATS,
        max_model_len=1 << 21,
        arrival={"process": "poisson", "rate_per_s": rate},
        prompt_tokens={"dist": "fixed", "value": 1},
        output_tokens={"dist": "fixed", "value": 1},
    )
    g = gaps(requests)
    # Exponential gaps: sd = mean, so the sample mean's relative standard error is 1/sqrt(n)
    # (0.32% at n = 1e5); allow five of them.
    assert g.mean() == pytest.approx(1 / rate, rel=5 / math.sqrt(N_STATS))
    # and the gaps are exponential: cv = 1 (relative s.e. of the sample sd about sqrt(2/n) for
    # excess kurtosis 6 -> sqrt((2 + 6) / 4n) plus the mean's 1/sqrt(n))
    assert g.std() / g.mean() == pytest.approx(1.0, rel=5 * math.sqrt((8 / 4 + 1) / N_STATS))


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_cv_matches_the_request(tmp_path, cv):
    rate = 5.0
    requests, _ = make_requests(
        tmp_path,
        num_requests=N_STATS,
        max_model_len=1 << 21,
        arrival={"process": "gamma", "rate_per_s": rate, "cv": cv},
        prompt_tokens={"dist": "fixed", "value": 1},
        output_tokens={"dist": "fixed", "value": 1},
    )
    g = gaps(requests)
    assert g.mean() == pytest.approx(1 / rate, rel=5 * cv / math.sqrt(N_STATS))
    # Delta method: var(log sd) ~ (2 + kurtosis_excess) / 4n with excess kurtosis 6 cv^2 for a
    # gamma, var(log mean) = cv^2 / n; their covariance is positive, so the sum bounds
    # var(log cv_hat) from above.
    se = math.sqrt(((2 + 6 * cv**2) / 4 + cv**2) / N_STATS)
    assert g.std() / g.mean() == pytest.approx(cv, rel=5 * se)


def test_burst_arrives_all_at_zero(tmp_path):
    requests, _ = make_requests(tmp_path, arrival={"process": "burst"})
    assert len(requests) == 200
    assert all(r.arrival_s == 0.0 for r in requests)


# --- length distributions --------------------------------------------------------------
def test_fixed_lengths(tmp_path):
    requests, _ = make_requests(
        tmp_path, prompt_tokens={"dist": "fixed", "value": 300}, output_tokens={"dist": "fixed", "value": 7}
    )
    assert {(r.prompt_tokens, r.output_tokens) for r in requests} == {(300, 7)}


def test_uniform_covers_its_bounds_inclusively(tmp_path):
    requests, _ = make_requests(tmp_path, num_requests=2000, prompt_tokens={"dist": "uniform", "min": 10, "max": 20})
    prompt = columns(requests)[1]
    assert set(prompt.tolist()) == set(range(10, 21))


def test_lognormal_respects_tight_bounds(tmp_path):
    requests, _ = make_requests(
        tmp_path,
        num_requests=2000,
        prompt_tokens={"dist": "lognormal", "mean": 500, "cv": 1.0, "min": 400, "max": 600},
        output_tokens={"dist": "lognormal", "mean": 50, "cv": 2.0, "min": 8, "max": 64},
    )
    _, prompt, output = columns(requests)
    assert prompt.min() >= 400 and prompt.max() <= 600
    assert output.min() >= 8 and output.max() <= 64
    assert prompt.dtype.kind == "i"


def test_lognormal_mean_matches_the_request(tmp_path):
    # mean 500, cv 0.5: sigma = sqrt(ln 1.25) = 0.47, mu = ln 500 - sigma^2/2 = 6.10. The bounds
    # [1, 2^20] and max_model_len 2^21 sit 14 and 11 sigma from mu, so truncation and the
    # max_model_len redraw remove nothing measurable; rounding to whole tokens shifts the mean by
    # far less than the tolerance. Standard error of the mean = 0.5 * 500 / sqrt(n) = 0.79.
    requests, _ = make_requests(
        tmp_path,
        num_requests=N_STATS,
        max_model_len=1 << 21,
        prompt_tokens={"dist": "lognormal", "mean": 500, "cv": 0.5, "min": 1, "max": 1 << 20},
        output_tokens={"dist": "fixed", "value": 1},
    )
    prompt = columns(requests)[1]
    assert prompt.mean() == pytest.approx(500, abs=5 * 0.5 * 500 / math.sqrt(N_STATS))
    assert prompt.std() / prompt.mean() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("max_model_len", [300, 1024, 4096])
def test_every_request_fits_max_model_len(tmp_path, max_model_len):
    requests, _ = make_requests(
        tmp_path,
        num_requests=500,
        max_model_len=max_model_len,
        prompt_tokens={"dist": "uniform", "min": 1, "max": 1000},
        output_tokens={"dist": "lognormal", "mean": 200, "cv": 1.0, "min": 1, "max": 2000},
    )
    assert len(requests) == 500
    assert max(r.prompt_tokens + r.output_tokens for r in requests) <= max_model_len
    assert min(min(r.prompt_tokens, r.output_tokens) for r in requests) >= 1


# --- empirical distributions -----------------------------------------------------------
def test_empirical_reads_a_column_relative_to_the_scenario(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lens.csv").write_text("prompt,output\n100,5\n200,6\n300,7\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    requests, _ = make_requests(
        tmp_path,
        num_requests=300,
        prompt_tokens={"dist": "empirical", "file": "data/lens.csv", "column": "prompt"},
        output_tokens={"dist": "empirical", "file": "data/lens.csv", "column": "output", "min": 6},
    )
    _, prompt, output = columns(requests)
    assert set(prompt.tolist()) == {100, 200, 300}
    assert set(output.tolist()) == {6, 7}  # the 5 is below min and never drawn


@pytest.mark.parametrize(
    "content, field",
    [
        ("prompt,output\n100,5\n", "column 'tokens'"),
        ("tokens\n100\n-3\n", "line 3"),
        ("tokens\n100\nabc\n", "line 3"),
        ("tokens\n100\n2.5\n", "line 3"),
        ("", "file"),
    ],
)
def test_bad_empirical_file_names_the_file(tmp_path, content, field):
    (tmp_path / "lens.csv").write_text(content)
    with pytest.raises(InputError) as info:
        make_requests(tmp_path, prompt_tokens={"dist": "empirical", "file": "lens.csv", "column": "tokens"})
    assert info.value.source == str(tmp_path / "lens.csv")
    assert info.value.field == field
    assert str(info.value).startswith(f"{tmp_path / 'lens.csv'}: {field}: ")


def test_missing_column_lists_the_columns(tmp_path):
    (tmp_path / "lens.csv").write_text("prompt,output\n100,5\n")
    with pytest.raises(InputError, match="not found; columns are: prompt, output"):
        make_requests(tmp_path, prompt_tokens={"dist": "empirical", "file": "lens.csv", "column": "tokens"})


# --- dataset presets -------------------------------------------------------------------
@pytest.mark.parametrize(
    "dataset, max_model_len", [("sharegpt", 2048), ("alpaca", 2048), ("azure-conv", 8192), ("sharegpt-multiturn", 4096)]
)
def test_dataset_presets(tmp_path, dataset, max_model_len):
    requests, _ = make_requests(
        tmp_path, num_requests=500, max_model_len=max_model_len, dataset=dataset, prompt_tokens=None, output_tokens=None
    )
    again, _ = make_requests(
        tmp_path, num_requests=500, max_model_len=max_model_len, dataset=dataset, prompt_tokens=None, output_tokens=None
    )
    assert requests == again
    _, prompt, output = columns(requests)
    assert len(requests) == 500
    assert prompt.min() >= 1 and output.min() >= 1
    assert (prompt + output).max() <= max_model_len


def test_sharegpt_preset_keeps_vllm_benchmark_filter(tmp_path):
    requests, _ = make_requests(
        tmp_path, num_requests=2000, max_model_len=4096, dataset="sharegpt", prompt_tokens=None, output_tokens=None
    )
    _, prompt, output = columns(requests)
    assert prompt.min() >= 4 and output.min() >= 4
    assert prompt.max() <= 1024 and (prompt + output).max() <= 2048


# --- trace replay ----------------------------------------------------------------------
def trace_workload(tmp_path, **extra):
    (tmp_path / "traces").mkdir(exist_ok=True)
    shutil.copy(TINY_TRACE, tmp_path / "traces" / "tiny.csv")
    return dict(
        trace="traces/tiny.csv", arrival=None, num_requests=None, prompt_tokens=None, output_tokens=None, **extra
    )


def test_trace_replays_times_and_lengths_as_given(tmp_path):
    requests, _ = make_requests(tmp_path, **trace_workload(tmp_path))
    # replayed as is: times not shifted, and the 4000 + 120 request that exceeds
    # max_model_len (4096) is kept for the scheduler to reject
    assert requests == [RequestSpec(i, *row) for i, row in enumerate(TINY_ROWS)]


def test_num_requests_truncates_a_trace(tmp_path):
    wl = trace_workload(tmp_path)
    wl["num_requests"] = 4
    requests, _ = make_requests(tmp_path, **wl)
    assert requests == [RequestSpec(i, *row) for i, row in enumerate(TINY_ROWS[:4])]


def test_trace_ignores_the_seed(tmp_path):
    a, _ = make_requests(tmp_path, seed=1, **trace_workload(tmp_path))
    b, _ = make_requests(tmp_path, seed=2, **trace_workload(tmp_path))
    assert a == b


def test_bad_trace_content_names_the_trace(tmp_path):
    wl = trace_workload(tmp_path)
    (tmp_path / "traces" / "tiny.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,x\n")
    with pytest.raises(InputError) as info:
        make_requests(tmp_path, **wl)
    assert info.value.source == str(tmp_path / "traces" / "tiny.csv")
    assert info.value.field == "line 2"


# --- impossible combinations end, with a located error ---------------------------------
@pytest.mark.parametrize(
    "prompt",
    [
        {"dist": "fixed", "value": 5000},
        {"dist": "uniform", "min": 5000, "max": 6000},
        {"dist": "lognormal", "mean": 6000, "cv": 0.1, "min": 5000, "max": 7000},
    ],
)
def test_prompt_longer_than_max_model_len_is_an_input_error(tmp_path, prompt):
    with pytest.raises(InputError) as info:
        make_requests(tmp_path, num_requests=1000, prompt_tokens=prompt)
    assert info.value.field == "workload"
    assert "max_model_len (4096)" in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "scenario.yaml"))


def test_bounds_no_draw_can_meet_are_an_input_error(tmp_path):
    with pytest.raises(InputError) as info:
        make_requests(tmp_path, prompt_tokens={"dist": "lognormal", "mean": 50, "cv": 0.1, "min": 3000, "max": 4000})
    assert info.value.field == "workload.prompt_tokens"
    assert "[min 3000, max 4000]" in str(info.value)
    with warnings.catch_warnings(), pytest.raises(InputError) as info:  # draws past int64's range
        warnings.simplefilter("error")
        make_requests(tmp_path, prompt_tokens={"dist": "lognormal", "mean": 1e30, "cv": 0.1, "max": 4000})
    assert "[min 1, max 4000]" in str(info.value)


# --- whose tail content is whose -------------------------------------------------------
@pytest.mark.parametrize(
    "sharing, private",
    [
        (None, True),
        ({"prefix": {"groups": 3, "tokens": 100}}, True),
        ({"rag": {"system_tokens": 50, "corpus_docs": 20, "doc_tokens": 40, "docs_per_request": 3}}, True),
        ({"conversation": {"turns": 3, "think_time_s": 1.0}}, False),  # a later turn holds an earlier one
    ],
)
def test_private_tails_of_drawn_workloads(tmp_path, sharing, private):
    requests, _ = make_requests(tmp_path, **(sharing or {}))
    assert requests.private_tails() is private


def test_private_tails_of_given_specs():
    from kvsim.workload.requests import RequestTable

    one = RequestSpec(0, 0.0, 10, 5, ((100, 8),))
    assert RequestTable.of([one, RequestSpec(1, 0.0, 10, 5, ((100, 8),))]).private_tails()
    assert not RequestTable.of([one, RequestSpec(1, 0.0, 10, 5, tail_id=0)]).private_tails()  # the same tail
    assert not RequestTable.of([one, RequestSpec(1, 0.0, 10, 5, ((0, 4),))]).private_tails()  # 0's tail as a run
    assert RequestTable.of(
        [RequestSpec(0, 0.0, 10, 5, tail_id=-1), RequestSpec(1, 0.0, 10, 5, tail_id=-1)]
    ).private_tails()  # unique content


# --- documents drawn for RAG -----------------------------------------------------------
@pytest.mark.parametrize(
    "size, k, law, s",
    [
        (2000, 5, "zipf", 1.1),  # scenarios/rag_8k.yaml's draw
        (20, 3, "zipf", 1.1),
        (5, 4, "zipf", 3.0),  # nearly every draw repeats an item: many rounds
        (6, 6, "uniform", 1.0),  # the whole population
    ],
)
def test_draw_distinct_is_numpys_choice(size, k, law, s):
    """The same items, in the same order, from the same draws as numpy's
    Generator.choice without replacement; the stream after it is the same too."""
    from kvsim.workload.sharing import cumulative, draw_distinct, popularity

    class Counting:
        def __init__(self):
            self.rng, self.draws = np.random.default_rng(7), 0

        def random(self, n):
            self.draws += n
            return self.rng.random(n)

    p = popularity(size, law, s)
    ours, numpys = Counting(), np.random.default_rng(7)
    for _ in range(300):
        assert draw_distinct(ours, p, cumulative(p), k) == numpys.choice(size, k, replace=False, p=p).tolist()
    assert ours.rng.bit_generator.state == numpys.bit_generator.state
    assert ours.draws > 300 * k  # some draws repeated an item and were drawn again
