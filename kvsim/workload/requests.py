"""The request stream: arrival times and prompt/output lengths, drawn once per run.

Every policy replays the same stream. Randomness comes from one SeedSequence built from
the scenario's seed, split into independent streams for arrivals and for lengths, so
changing the arrival rate does not change the lengths drawn (and vice versa).

Lengths outside a distribution's [min, max] are redrawn, and so is any request whose
prompt + output exceeds max_model_len. A trace is replayed as it is (kvsim.workload.traces:
its first num_requests requests, arrivals scaled by time_scale): its requests that
exceed max_model_len are later rejected with that reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.workload import sharing as share
from kvsim.config.errors import InputError
from kvsim.config.scenario import (
    Burst,
    Constant,
    Conversation,
    Empirical,
    Fixed,
    Gamma,
    Lognormal,
    Poisson,
    Scenario,
    Staged,
    Uniform,
)
from kvsim.workload.stages import plan_of, staged_arrivals
from kvsim.workload.table import RequestSpec, RequestTable  # noqa: F401 (RequestSpec: re-exported)
from kvsim.workload.traces import trace_requests

MAX_REDRAW_ROUNDS = 200


def generate_requests(scn: Scenario, base_dir: Path, src: str = "scenario") -> RequestTable:
    wl = scn.workload
    arrival_ss, length_ss, sharing_ss = np.random.SeedSequence(scn.seed).spawn(3)
    if wl.trace is not None:
        return trace_requests(base_dir / wl.trace, wl.num_requests, wl.time_scale or 1.0)
    plan = stage = None
    if isinstance(wl.arrival, Staged):
        plan = plan_of(wl.arrival)
        arrivals, stage = staged_arrivals(wl.arrival.stages, plan, np.random.default_rng(arrival_ss))
        largest = max(plan.counts)
        if wl.num_requests is not None and wl.num_requests < len(arrivals):
            plan, arrivals, stage = (
                plan.truncated(wl.num_requests),
                arrivals[: wl.num_requests],
                stage[: wl.num_requests],
            )
        n = len(arrivals)
        if n == 0:
            raise InputError(
                src, "workload.arrival.stages", "no stage sends a request (each sends int(rate_per_s * duration_s))"
            )
    else:
        n = wl.num_requests
        arrivals = draw_arrivals(wl.arrival, n, np.random.default_rng(arrival_ss))
    length_rng = np.random.default_rng(length_ss)
    if wl.inference_perf is not None:
        from kvsim.workload.inference_perf import inference_perf_requests

        prompt, output, segments = inference_perf_requests(wl.inference_perf, stage, largest, n, length_rng, src)
        return RequestTable(arrivals, prompt, output, segments, stage=stage, plan=plan)
    shared = share.shared_tokens(wl.sharing)
    if shared >= scn.max_model_len:
        raise InputError(
            src,
            "workload",
            f"shared prompt content ({shared} tokens) leaves no room under max_model_len ({scn.max_model_len})",
        )
    prompt, output = _draw_lengths(scn, n, length_rng, base_dir, src, scn.max_model_len - shared)
    if isinstance(wl.sharing, Conversation):
        if plan is not None:
            raise InputError(
                src,
                "workload.arrival.stages",
                "conversations time their turns by think_time_s; give them one arrival process, not stages",
            )
        turns = share.conversations(wl.sharing, arrivals, prompt, output, scn.max_model_len)
        a, p, o, seg, tail = zip(*turns) if turns else ((),) * 5
        return RequestTable(a, p, o, list(seg), tail)
    segments = share.shared_segments(wl.sharing, n, np.random.default_rng(sharing_ss)) if wl.sharing else None
    return RequestTable(arrivals, prompt + shared, output, segments, stage=stage, plan=plan)


def draw_arrivals(arrival: Poisson | Gamma | Burst | Constant, n: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds; the first request comes one gap after t = 0."""
    if isinstance(arrival, Burst):
        return np.zeros(n)
    if isinstance(arrival, Constant):
        return np.arange(1, n + 1) / arrival.rate_per_s
    if isinstance(arrival, Poisson):
        gaps = rng.exponential(1.0 / arrival.rate_per_s, n)
    else:  # gamma with mean 1/rate and the given coefficient of variation
        shape = 1.0 / arrival.cv**2
        gaps = rng.gamma(shape, 1.0 / (arrival.rate_per_s * shape), n)
    return np.cumsum(gaps)


def _draw_lengths(scn: Scenario, n: int, rng: np.random.Generator, base_dir: Path, src: str, limit: int):
    """n (prompt, output) pairs with prompt + output <= limit."""
    wl = scn.workload
    if wl.dataset is not None:
        from kvsim.workload.datasets import sample_lengths

        draw = lambda k: sample_lengths(wl.dataset, k, rng)  # noqa: E731
    else:
        prompt = _sampler(wl.prompt_tokens, base_dir, src, "workload.prompt_tokens")
        output = _sampler(wl.output_tokens, base_dir, src, "workload.output_tokens")
        draw = lambda k: (prompt(k, rng), output(k, rng))  # noqa: E731
    prompts, outputs, have = [], [], 0
    for _ in range(MAX_REDRAW_ROUNDS):
        p, o = draw(max(n - have, 16))
        keep = (p + o) <= limit
        p, o = p[keep][: n - have], o[keep][: n - have]
        prompts.append(p)
        outputs.append(o)
        have += len(p)
        if have == n:
            return np.concatenate(prompts), np.concatenate(outputs)
    room = (
        f"max_model_len ({scn.max_model_len})"
        if limit == scn.max_model_len
        else f"the {limit} tokens that max_model_len ({scn.max_model_len}) leaves after shared content"
    )
    raise InputError(
        src,
        "workload",
        f"too few drawn requests fit {room} after prompt + output; widen max_model_len or shorten the lengths",
    )


def _sampler(dist, base_dir: Path, src: str, field: str):
    """A function (k, rng) -> k integer lengths inside the distribution's bounds."""
    if isinstance(dist, Fixed):
        return lambda k, rng: np.full(k, dist.value, dtype=np.int64)
    if isinstance(dist, Uniform):
        return lambda k, rng: rng.integers(dist.min, dist.max + 1, k)
    if isinstance(dist, Lognormal):
        sigma2 = np.log1p(dist.cv**2)  # moments of the underlying normal
        mu = np.log(dist.mean) - sigma2 / 2

        # draws past max become max + 1 before the cast (rejected all the same): a draw past
        # int64's range would cast to garbage, with a RuntimeWarning
        def raw(k, rng):
            return np.minimum(np.rint(rng.lognormal(mu, np.sqrt(sigma2), k)), dist.max + 1).astype(np.int64)
    else:
        values = _read_column(dist, base_dir, src, field)
        raw = lambda k, rng: rng.choice(values, k)  # noqa: E731
    return lambda k, rng: _bounded(raw, k, rng, dist.min, dist.max, src, field)


def _bounded(raw, k, rng, lo, hi, src, field) -> np.ndarray:
    out, have = [], 0
    for _ in range(MAX_REDRAW_ROUNDS):
        x = raw(max(k - have, 16), rng)
        x = x[(x >= lo) & (x <= hi)][: k - have]
        out.append(x)
        have += len(x)
        if have == k:
            return np.concatenate(out)
    raise InputError(src, field, f"almost no draws fall inside [min {lo}, max {hi}]; widen the bounds")


def _read_column(dist: Empirical, base_dir: Path, src: str, field: str) -> np.ndarray:
    import pandas as pd

    path = base_dir / dist.file
    try:
        df = pd.read_csv(path)
    except Exception as e:  # pandas raises many types for bad files; all are bad input here
        raise InputError(str(path), "file", f"not a readable CSV ({type(e).__name__})") from None
    if dist.column not in df.columns:
        raise InputError(
            str(path), f"column '{dist.column}'", f"not found; columns are: {', '.join(map(str, df.columns))}"
        )
    col = pd.to_numeric(df[dist.column], errors="coerce")
    bad = col.isna() | (col < 1) | (col != np.floor(col))
    if bad.any():
        line = int(np.flatnonzero(bad.to_numpy())[0]) + 2  # header is line 1
        raise InputError(str(path), f"line {line}", f"column '{dist.column}' must hold whole numbers >= 1")
    if col.empty:
        raise InputError(str(path), f"column '{dist.column}'", "has no rows")
    return col.to_numpy(dtype=np.int64)
