"""Load stages: a run's arrivals as one stage after another, each at its own rate.

A stage sends `int(rate_per_s * duration_s)` requests (as inference-perf's load generator
counts them, float rounding included) at times counted from the stage's start (its
*zero*), drawn by its process:

- `constant`: a fixed interval, at 1/rate, 2/rate, ... after the zero.
- `poisson`: exponential gaps of mean 1/rate.
- `inference-perf-constant`: what inference-perf calls a constant load. It is not a
  fixed interval: N exponential gaps of mean 1/rate are drawn and scaled so that they
  sum to the duration, so the last request comes exactly at the stage's end and the
  others lie where N - 1 uniform draws over the duration would
  (`ConstantLoadTimer.start_timer` in inference_perf/loadgen/load_timer.py).
- `inference-perf-poisson`: inference-perf's Poisson load: each second draws a Poisson
  number c of requests with mean `rate`, spread over that second as its constant load
  spreads c requests over one second (the last at the second's end; a second with none
  passes empty), and the stage takes the first N of them (`PoissonLoadTimer`, same file).

(Both at kubernetes-sigs/inference-perf commit b81afa4 of 2025-10-15, the code between
releases v0.2.0 and v0.3.0 whose config fields the runs in kvsim's validation data
carry; v0.3.0 has the same timers.)

Where the next stage starts:
- open loop (`drain: false`, the default): `pause_s` after the previous stage's
  configured end, whatever is still running;
- `drain: true`: only once every request of the previous stage has ended (completed,
  failed or rejected), then `pause_s` later. With `poll_s`, the load generator sees
  that only at its next poll, every poll_s seconds from the stage's zero.
  inference-perf's multi-process load generator (loadgen/load_generator.py,
  `run_stage` and `mp_run`) drains: it polls its finished counter once a second from
  one second before the stage's zero (so on whole seconds from the zero), sleeps
  `load.interval` seconds after the stage, and puts the next stage's zero one second
  after it starts: drain with poll_s 1 and pause_s = interval + 1.

Arrival times in a RequestTable are nominal: stage k's zero is taken as the sum of the
earlier stages' durations and pauses. Where stages drain, the engine moves each stage's
arrivals by where its zero really falls (`StagePlan.next_zero`) and records the times
it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StagePlan:
    """The stages of a run: their rates, durations and request counts, where each starts
    nominally, and how the next one follows (see the module docstring)."""

    rates: tuple[float, ...]
    durations: tuple[float, ...]
    counts: tuple[int, ...]
    drain: bool = False
    pause_s: float = 0.0
    poll_s: float | None = None

    @property
    def zeros(self) -> tuple[float, ...]:
        """Each stage's nominal zero: the earlier stages' durations and pauses summed."""
        out, t = [], 0.0
        for d in self.durations:
            out.append(t)
            t += d + self.pause_s
        return tuple(out)

    @property
    def firsts(self) -> tuple[int, ...]:
        """The index of each stage's first request in the run's stream."""
        return tuple(int(x) for x in np.cumsum((0,) + self.counts[:-1]))

    def next_zero(self, zero: float, last_end: float) -> float:
        """Where the stage after one that started at `zero` starts, its last request
        having ended at `last_end` (a stage with no requests ends at its zero)."""
        end = max(zero, last_end)
        if self.poll_s:
            end = zero + self.poll_s * math.ceil((end - zero) / self.poll_s)
        return end + self.pause_s

    def truncated(self, n: int) -> "StagePlan":
        """The plan of the stream's first n requests (stages past them are dropped)."""
        counts, left = [], n
        for c in self.counts:
            if left <= 0:
                break
            counts.append(min(c, left))
            left -= c
        k = len(counts)
        return StagePlan(self.rates[:k], self.durations[:k], tuple(counts), self.drain, self.pause_s, self.poll_s)


def stage_count(rate: float, duration: float) -> int:
    """Requests a stage sends: int(rate * duration), as inference-perf's run_stage does."""
    return int(rate * duration)


def draw_stage(
    process: str, rate: float, duration: float, rng: np.random.Generator, cv: float | None = None
) -> np.ndarray:
    """A stage's arrival times from its zero (see the module docstring)."""
    n = stage_count(rate, duration)
    if n == 0:
        return np.zeros(0)
    if process == "constant":
        return np.arange(1, n + 1) / rate
    if process == "poisson":
        return np.cumsum(rng.exponential(1.0 / rate, n))
    if process == "gamma":
        shape = 1.0 / cv**2
        return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))
    if process == "inference-perf-constant":
        return _spread(rate, duration, n, rng, 0.0)
    if process == "inference-perf-poisson":
        return _poisson_seconds(rate, n, rng)
    raise ValueError(f"unknown stage process {process!r}")


def _spread(rate: float, duration: float, n: int, rng: np.random.Generator, start: float) -> np.ndarray:
    """ConstantLoadTimer: n exponential gaps scaled to sum to `duration`, from `start`."""
    gaps = rng.exponential(1.0 / rate, n)
    gaps = gaps * (duration / np.sum(gaps))
    # added one by one from the start, as the timer does (cumsum adds in order)
    return np.cumsum(np.concatenate(([start], gaps)))[1:]


def _poisson_seconds(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """PoissonLoadTimer: per second a Poisson count, spread over that second; the first n."""
    out, t = [], 0.0
    while len(out) < n:
        c = int(rng.poisson(rate))
        if c < 1:
            t += 1.0
            continue
        times = _spread(c, 1.0, c, rng, t)
        out.extend(times.tolist())
        t = float(times[-1])
    return np.array(out[:n])


def staged_arrivals(stages, plan: StagePlan, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Every stage's nominal arrival times, in stage order, and each request's stage."""
    times, which = [], []
    for k, (stage, zero) in enumerate(zip(stages, plan.zeros)):
        t = draw_stage(stage.process, stage.rate_per_s, stage.duration_s, rng, getattr(stage, "cv", None))
        times.append(zero + t)
        which.append(np.full(len(t), k, dtype=np.int64))
    return np.concatenate(times), np.concatenate(which)


def plan_of(arrival) -> StagePlan:
    """The StagePlan of a staged arrival block (kvsim.config.scenario.Staged)."""
    rates = tuple(s.rate_per_s for s in arrival.stages)
    durations = tuple(s.duration_s for s in arrival.stages)
    counts = tuple(stage_count(r, d) for r, d in zip(rates, durations))
    return StagePlan(rates, durations, counts, arrival.drain, arrival.pause_s, arrival.poll_s)
