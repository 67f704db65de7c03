"""Workload length presets.

A preset says how long a request's prompt and output are. Two kinds ship in
``kvsim/data/datasets.json`` (written by ``scripts/derive_datasets.py``):

``quantiles`` -- derived from real traces: the marginal quantiles of prompt and output
    tokens plus their Spearman rank correlation rho_s. Sampling joins the marginals with
    a Gaussian copula: draw standard normals (z1, z2) with Pearson correlation
    r = 2 sin(pi rho_s / 6) (the Gaussian copula whose Spearman correlation is rho_s),
    map each to u = Phi(z), and invert the piecewise-linear quantile function at u.
    Presets: ``sharegpt-multiturn``, ``arxiv-summarization`` (microsoft/vidur processed
    traces, MIT), ``azure-conv``, ``azure-code`` (Azure LLM inference trace 2023,
    CC-BY-4.0); the Azure ones also carry their arrival rate and inter-arrival CV.

``lognormal`` -- from published means only: ``sharegpt`` and ``alpaca`` as in the vLLM
    paper (Kwon et al., SOSP 2023). Each marginal is lognormal with the published mean
    and an ASSUMED coefficient of variation c (see the json ``note``):
    sigma^2 = ln(1 + c^2), mu = ln(mean) - sigma^2 / 2. Prompt and output are
    independent; draws are rounded to whole tokens, and pairs that vLLM's benchmark
    filter would drop (either < 4, prompt > 1024, prompt + output > 2048) are redrawn.

All randomness comes from the ``numpy.random.Generator`` passed in, so a given
generator state gives the same lengths. Traces are read by kvsim.workload.traces.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class Dataset:
    """One preset's metadata; ``params`` holds the raw json entry used for sampling."""

    name: str
    kind: str  # "quantiles" or "lognormal"
    source: str
    note: str
    prompt_mean: float  # stored (real-trace or published) mean
    output_mean: float
    spearman: float  # 0 for the independent lognormal presets
    count: int | None  # rows in the source trace, None when published-only
    arrival: tuple[float, float] | None  # (rate_per_s, inter-arrival cv)
    params: Mapping = field(repr=False, compare=False)


def _load() -> dict[str, Dataset]:
    text = resources.files("kvsim").joinpath("data/datasets.json").read_text("utf-8")
    out = {}
    for name, e in json.loads(text)["datasets"].items():
        lognormal = e["kind"] == "lognormal"
        arrival = e.get("arrival")
        out[name] = Dataset(
            name=name,
            kind=e["kind"],
            source=e["source"],
            note=e.get("note", ""),
            prompt_mean=e["prompt"]["mean"] if lognormal else e["prompt_mean"],
            output_mean=e["output"]["mean"] if lognormal else e["output_mean"],
            spearman=0.0 if lognormal else e["spearman"],
            count=None if lognormal else e["count"],
            arrival=(arrival["rate_per_s"], arrival["interarrival_cv"]) if arrival else None,
            params=MappingProxyType(e),
        )
    return out


DATASETS: Mapping[str, Dataset] = MappingProxyType(_load())

_erf = np.frompyfunc(math.erf, 1, 1)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(z / math.sqrt(2.0)).astype(np.float64))


def _get(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(sorted(DATASETS))}") from None


def _sample_quantiles(p: Mapping, n: int, rng: np.random.Generator):
    r = 2.0 * math.sin(math.pi * p["spearman"] / 6.0)
    z = rng.standard_normal((n, 2))
    z2 = r * z[:, 0] + math.sqrt(1.0 - r * r) * z[:, 1]
    probs = np.asarray(p["quantile_probs"], dtype=np.float64)

    def invert(zs, quantiles):
        x = np.interp(_normal_cdf(zs), probs, np.asarray(quantiles, dtype=np.float64))
        return np.maximum(np.rint(x), 1).astype(np.int64)

    return invert(z[:, 0], p["prompt_quantiles"]), invert(z2, p["output_quantiles"])


def _lognormal(spec: Mapping, z: np.ndarray) -> np.ndarray:
    sigma2 = math.log1p(spec["cv"] ** 2)
    mu = math.log(spec["mean"]) - sigma2 / 2.0
    return np.rint(np.exp(mu + math.sqrt(sigma2) * z)).astype(np.int64)


def _sample_lognormal(p: Mapping, n: int, rng: np.random.Generator):
    f = p["filter"]
    prompts, outputs, have = [], [], 0
    while have < n:
        # Draw more than needed: the filter keeps most pairs (about 90%), so one or two
        # rounds suffice; the loop depends only on rng, so it stays deterministic.
        z = rng.standard_normal((2 * (n - have) + 64, 2))
        prompt, output = _lognormal(p["prompt"], z[:, 0]), _lognormal(p["output"], z[:, 1])
        keep = (
            (prompt >= f["min_tokens"])
            & (output >= f["min_tokens"])
            & (prompt <= f["max_prompt"])
            & (prompt + output <= f["max_total"])
        )
        prompts.append(prompt[keep])
        outputs.append(output[keep])
        have += int(keep.sum())
    return np.concatenate(prompts)[:n], np.concatenate(outputs)[:n]


_SAMPLERS = {"quantiles": _sample_quantiles, "lognormal": _sample_lognormal}


def sample_lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n`` (prompt, output) token counts from preset ``name``: two int64 arrays,
    every value >= 1. Unknown name -> ValueError listing the valid ones."""
    dataset = _get(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return _SAMPLERS[dataset.kind](dataset.params, int(n), rng)


def arrival_stats(name: str) -> tuple[float, float] | None:
    """(mean arrival rate in req/s, coefficient of variation of inter-arrival times)
    measured over the source trace's hour, or None for presets without arrivals."""
    return _get(name).arrival
