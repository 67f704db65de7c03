"""Rate sweeps: the same scenario at several arrival rates, and the classic curves.

The vLLM paper (Kwon et al., SOSP 2023, §6) compares systems by normalized latency —
the mean over requests of end-to-end latency divided by output length, in seconds
per output token — against the request rate: flat while the server keeps up, then
rising steeply once the queue grows without bound. kvsim calls a rate *sustained* by
a policy when its normalized latency stays within DIVERGENCE times the sweep's
unloaded level (the lowest normalized latency any policy shows at the lowest rate);
the sustained rate is the highest swept rate before the first one that is not. With a
finite number of requests the queue, and so the latency, is bounded: the rise is
steep but finite, and the threshold is a choice, stated with every result.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvsim.config.errors import InputError, positive_number

DIVERGENCE = 4.0
MAX_RATES = 64


def parse_rates(text: str, src: str = "command line", field: str = "--rates") -> list[float]:
    """'0.5,1,2,4' or 'START:STOP:STEP' (STOP included) -> sorted distinct rates."""

    def number(item: str) -> float:
        return positive_number(item, src, field, f"'{item}' is not a positive number of requests per second")

    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise InputError(src, field, f"'{text}' is not START:STOP:STEP (e.g. 0.5:8:0.5)")
        start, stop, step = map(number, parts)
        if stop < start:
            raise InputError(src, field, f"STOP ({stop:g}) is below START ({start:g})")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        if count > MAX_RATES:
            raise InputError(src, field, f"'{text}' gives {count} rates; at most {MAX_RATES}")
        rates = [round(start + i * step, 12) for i in range(count)]
    else:
        rates = [number(item.strip()) for item in text.split(",") if item.strip()]
    if not rates or len(rates) > MAX_RATES:
        raise InputError(src, field, f"give 1 to {MAX_RATES} rates, e.g. 0.5,1,2,4 or 0.5:8:0.5")
    return sorted(set(rates))


def with_rate(scn, rate: float, src: str = "command line"):
    """The scenario with its arrival rate replaced (Poisson, gamma or constant arrivals only)."""
    arrival = scn.workload.arrival
    if arrival is None or not hasattr(arrival, "rate_per_s"):
        what = (
            "a trace's own arrivals"
            if arrival is None
            else "load stages"
            if hasattr(arrival, "stages")
            else f"'{arrival.process}' arrivals"
        )
        raise InputError(
            src,
            "--rates",
            f"the scenario has {what}; a rate sweep needs workload.arrival.process poisson, gamma or constant",
        )
    workload = scn.workload.model_copy(update={"arrival": arrival.model_copy(update={"rate_per_s": rate})})
    return scn.model_copy(update={"workload": workload})


def normalized_latency(requests: pd.DataFrame) -> pd.Series:
    """Per policy: mean over completed requests of (finish - arrival) / output tokens."""
    done = requests[requests["outcome"] == "completed"]
    per = (done["finish_s"] - done["arrival_s"]) / done["output_tokens"].clip(lower=1)
    return per.groupby(done["policy"].astype(str), sort=False).mean()


COLUMNS = [
    "rate_per_s",
    "policy",
    "normalized_latency_s",
    "throughput_tok_s",
    "request_throughput",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "mean_batch_size",
    "requests_completed",
]


def sweep_table(points: list[tuple[float, pd.DataFrame, pd.DataFrame]]) -> pd.DataFrame:
    """One row per (rate, policy) from (rate, summary, requests) of each run."""
    frames = []
    for rate, summary, requests in points:
        norm = normalized_latency(requests)
        frame = summary.assign(rate_per_s=rate, policy=summary["policy"].astype(str))
        frame["normalized_latency_s"] = frame["policy"].map(norm).astype(float)
        frames.append(frame[[c for c in COLUMNS if c in frame]])
    return pd.concat(frames, ignore_index=True).sort_values(["rate_per_s"], kind="mergesort", ignore_index=True)


def unloaded_latency(table: pd.DataFrame) -> float:
    lowest = table[table["rate_per_s"] == table["rate_per_s"].min()]
    return float(lowest["normalized_latency_s"].min())


def sustained(table: pd.DataFrame, divergence: float = DIVERGENCE) -> dict[str, float]:
    """Per policy: the highest swept rate before its normalized latency first exceeds
    `divergence` x the unloaded level (NaN where even the lowest rate exceeds it)."""
    limit = divergence * unloaded_latency(table)
    out = {}
    for policy, rows in table.groupby("policy", sort=False):
        rows = rows.sort_values("rate_per_s")
        ok = (rows["normalized_latency_s"] <= limit).to_numpy()
        first_bad = int(np.argmin(ok)) if not ok.all() else len(ok)
        out[str(policy)] = float(rows["rate_per_s"].iloc[first_bad - 1]) if first_bad else math.nan
    return out


def summary_lines(table: pd.DataFrame, divergence: float = DIVERGENCE) -> list[str]:
    """A sentence per policy: the sustained rate and its throughput there."""
    limit = divergence * unloaded_latency(table)
    lines = []
    for policy, rate in sustained(table, divergence).items():
        if math.isnan(rate):
            lines.append(f"{policy}: latency diverges already at the lowest rate swept")
            continue
        row = table[(table["policy"] == policy) & (table["rate_per_s"] == rate)].iloc[0]
        top = rate == table["rate_per_s"].max()
        lines.append(
            f"{policy}: sustains {rate:g} req/s{' (the highest swept: sweep further)' if top else ''}, "
            f"{row['throughput_tok_s']:,.0f} tok/s at {row['normalized_latency_s']:.3g} s/token"
        )
    lines.append(
        f"(sustained: normalized latency within {divergence:g}x the unloaded "
        f"{limit / divergence:.3g} s/token, i.e. at most {limit:.3g} s/token)"
    )
    return lines
