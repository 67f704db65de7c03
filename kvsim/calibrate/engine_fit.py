"""Fit a vLLM V1 engine overhead to benchmark runs by simulating them.

The runs give per-request latencies per load stage, not step times, so the overhead is
fitted the only way they allow: kvsim simulates every run with candidate coefficients
and compares each stage's prediction with its report.

The form (kvsim.cost.overhead, format kvsim-overhead/3), every term non-negative and
shared by all runs (nothing per run):
- `step_us`: host time every step waits for (scheduling, input preparation, sampling);
- `per_seq_us`: the same, per sequence in the step;
- `piecewise_per_layer_us`: launching a mixed step's attention between the CUDA-graph
  pieces, per layer; a full-graph step (a uniform decode batch up to vLLM's capture
  sizes) launches nothing per layer;
- `launch_per_layer_us`: an eager step's launches per layer (beyond the capture sizes),
  hidden behind device work where that is longer; held at its start unless asked for
  (`FREE`): in runs like the vLLM H100 ones the eager steps (whole new prompts and
  recomputed ones) are device-bound, so no run tells it;
- `allreduce_us`: the latency of each all-reduce (two per layer at tp > 1), with the
  profile's bus bandwidth;
- `attention_decode`: the engine's decode attention relative to the profile's (whose
  attention on the H100 is transferred from A100 measurements), between the profile's
  own fraction of the HBM peak (the kernel then reads KV at the datasheet bandwidth)
  and 1.5;
- `api_ms`: what the API server adds to each request's time to first token.
The profile's linear ops are read at their envelope (`linear: envelope`,
kvsim.cost.profiles): the runs' 2026 engine does not share the H100 profile's 2024
kernel picks (a QKV projection 60% slower at 72-96 tokens than at 104).

Objective: the sum over runs of each run's mean over its stages of
    H(log(predicted / measured E2E mean) / 0.08) + H(log(predicted / measured TTFT p50) / 0.15)
    + H((predicted - measured share answered within the client's timeout) / 0.15),
each error in units of its accuracy target, so every run weighs the same whatever its
number of stages. A stage whose report shows more than 15% of its requests failed (past
its capacity) counts by its share answered alone, the target for such a stage: its
latencies are its survivors', the requests that came through a queue short enough,
another population than kvsim's answered requests wherever the shares differ, and their
mean moves steeply with any term that changes the capacity. H is Huber's loss, z^2
within one target and 2|z| - 1 beyond, so that a stage the form cannot come near pulls
on the terms every run shares in proportion to its error, not to its square.
Optimizer: projected Levenberg-Marquardt on the parameters scaled to their ranges, the
Jacobian by forward differences (steps of 2% of a range: coarse enough that the
simulations' discrete events do not make it noise) carried between steps by Broyden's
update and taken again when a step fails, started from `START`, at most
`MAX_ITERATIONS` iterations; a trial step is kept only if it lowers the objective.
Simulations are deterministic (fixed seeds), so the fit is too. `api_ms` changes no
step, so its derivative costs no simulation; the runs' simulations are kept per run,
so a fit over some of the same runs reuses them. A leave-one-out fit starts where the
all-runs fit does, never from anything fitted with the run it leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvsim.calibrate.replay import PredictedStage, Replay
from kvsim.calibrate.runs import MeasuredStage
from kvsim.cost.engine_terms import ApiServer, GraphTerms
from kvsim.cost.overhead import Comm, Overhead

TARGETS = {"e2e": 0.08, "ttft": 0.15, "answered": 0.15}
MAX_ITERATIONS = 12
FD_STEP = 0.02
KEEP = 2  # simulations kept: the current point's and the last trial's


@dataclass(frozen=True)
class Param:
    name: str
    low: float
    high: float
    start: float
    post_hoc: bool = False  # changes no step: the simulations are reused


PARAMS = (
    Param("step_us", 0.0, 3000.0, 200.0),
    Param("per_seq_us", 0.0, 100.0, 5.0),
    Param("piecewise_per_layer_us", 0.0, 200.0, 10.0),
    Param("launch_per_layer_us", 0.0, 500.0, 50.0),
    Param("allreduce_us", 0.0, 60.0, 8.0),
    Param("attention_decode", 0.82, 1.5, 1.0),
    Param("api_ms", 0.0, 50.0, 5.0, post_hoc=True),
)
START = {p.name: p.start for p in PARAMS}
FREE = tuple(p.name for p in PARAMS if p.name != "launch_per_layer_us")
BUS_GB_S = 360.0  # the shipped H100 profiles' assumed all-reduce bandwidth (80% of 450 GB/s)


def overhead(theta: dict, label: str = "overhead:fitted", gpu: str = "h100-80gb") -> Overhead:
    """The Overhead a parameter set describes."""
    t = {**START, **theta}
    return Overhead(
        label,
        step_s=t["step_us"] * 1e-6,
        per_seq_s=t["per_seq_us"] * 1e-6,
        comm=Comm(latency_s=t["allreduce_us"] * 1e-6, bus_gb_s=BUS_GB_S),
        gpu=gpu,
        launch_per_layer_s=t["launch_per_layer_us"] * 1e-6,
        graphs=GraphTerms(piecewise_per_layer_s=t["piecewise_per_layer_us"] * 1e-6),
        kernels=(("attention_decode", t["attention_decode"]),),
        api=ApiServer(request_s=t["api_ms"] * 1e-3),
        linear="envelope",
    )


def document(theta: dict, name: str, gpu: str = "h100-80gb") -> dict:
    """The kvsim-overhead/3 fields of a parameter set (the fitted coefficients only)."""
    t = {**START, **theta}
    r = lambda x: round(float(x), 6)  # noqa: E731
    return {
        "format": "kvsim-overhead/3",
        "name": name,
        "gpu": gpu,
        "host": {
            "step_ms": r(t["step_us"] / 1e3),
            "per_seq_ms": r(t["per_seq_us"] / 1e3),
            "per_prefill_token_ms": 0.0,
            "launch_per_layer_ms": r(t["launch_per_layer_us"] / 1e3),
        },
        "comm": {"latency_us": r(t["allreduce_us"]), "latency_per_hop_us": 0.0, "bus_gb_s": BUS_GB_S},
        "graphs": {"rule": "vllm-0.33.0", "piecewise_per_layer_ms": r(t["piecewise_per_layer_us"] / 1e3)},
        "kernels": {"attention_decode": r(t["attention_decode"])},
        "api": {"request_ms": r(t["api_ms"]), "per_prompt_token_us": 0.0},
        "linear": "envelope",
    }


def residuals(measured: Sequence[MeasuredStage], predicted: Sequence[PredictedStage]) -> np.ndarray:
    """One run's errors in units of their targets, each beyond one target made to count in
    proportion (`huber`), scaled so the run weighs 1 (see the module docstring)."""
    out = []
    for m, p in zip(measured, predicted):
        for what, stat in (("e2e", "mean"), ("ttft", "p50")):
            mv, pv = m.get(what, stat), p.get(what, stat)
            if mv and mv > 0:
                z = math.log(max(pv or 0.0, 1e-6) / mv) / TARGETS[what]
                out.append(z if m.answered >= 1 - TARGETS["answered"] else 0.0)
        out.append((p.answered - m.answered) / TARGETS["answered"])
    return huber(np.array(out)) / math.sqrt(len(measured))


def huber(z: np.ndarray) -> np.ndarray:
    """Residuals whose squares are Huber's loss at 1: z^2 within 1, 2|z| - 1 beyond."""
    a = np.abs(z)
    return np.where(a <= 1, z, np.sign(z) * np.sqrt(np.maximum(2 * a - 1, 0.0)))


class Objective:
    """The runs' residuals at a parameter set, simulating only what the set changes. Each
    replay keeps the simulations of its last KEEP engine settings, so objectives over
    some of the same replays (a leave-one-out fit's) share them."""

    def __init__(self, replays: Sequence[Replay], workers: int = 1):
        self.replays = list(replays)
        self.workers = workers
        self.evaluations = 0  # simulations of every run

    @staticmethod
    def engine_key(theta: dict) -> tuple:
        return tuple(round(theta[p.name], 9) for p in PARAMS if not p.post_hoc)

    def simulations(self, theta: dict) -> list:
        key = self.engine_key(theta)
        caches = [r.__dict__.setdefault("_fit_runs", {}) for r in self.replays]
        missing = [i for i, c in enumerate(caches) if key not in c]
        if missing:
            from kvsim.sim.parallel import ordered_map

            o = overhead(theta)
            # the longest first, so that it does not end the batch alone
            order = sorted(range(len(missing)), key=lambda k: -len(self.replays[missing[k]].requests))
            runs = ordered_map(lambda k: self.replays[missing[k]].simulate(o), len(missing), self.workers, first=order)
            for i, run in zip(missing, runs):
                caches[i][key] = run
            self.evaluations += 1
        out = []
        for c in caches:
            c[key] = c.pop(key)  # the most recently used last
            while len(c) > KEEP:  # a fit revisits only its current point
                c.pop(next(iter(c)))
            out.append(c[key])
        return out

    def predictions(self, theta: dict) -> list[list[PredictedStage]]:
        o = overhead(theta)
        return [r.report(run, o) for r, run in zip(self.replays, self.simulations(theta))]

    def per_run(self, theta: dict) -> list[np.ndarray]:
        """Each run's residuals (their concatenation is the objective's)."""
        return [residuals(r.run.stages, p) for r, p in zip(self.replays, self.predictions(theta))]

    def __call__(self, theta: dict) -> np.ndarray:
        return np.concatenate(self.per_run(theta))


def fit(
    objective: Objective,
    start: dict | None = None,
    free: Sequence[str] | None = None,
    max_iterations: int = MAX_ITERATIONS,
    on_iteration: Callable | None = None,
    tolerance: float = 1e-3,
) -> dict:
    """Projected Levenberg-Marquardt over the `free` parameters (default FREE), the rest
    held at `start`; returns {"theta", "objective", "iterations", "evaluations",
    "converged", "residuals", "jacobian"} (the Jacobian at the end, as last updated).

    The Jacobian is taken by forward differences once, then carried from step to step by
    Broyden's rank-one update (each kept step tells how the residuals moved along it), and
    taken again by differences only when a step from the carried one fails: so an
    iteration costs one simulation of every run where a Jacobian by differences would cost
    one per parameter. The fit has converged when a kept step moves no parameter by more
    than 0.1% of its range or lowers the objective by less than `tolerance` (a fraction),
    or when no step lowers it from a Jacobian just taken by differences."""
    theta = {**START, **(start or {})}
    free = FREE if free is None else free
    params = [p for p in PARAMS if p.name in free]
    span = np.array([p.high - p.low for p in params])
    low = np.array([p.low for p in params])
    high = np.array([p.high for p in params])

    def at(x: np.ndarray) -> dict:
        return {**theta, **{p.name: float(v) for p, v in zip(params, x)}}

    def differences(x: np.ndarray, r: np.ndarray) -> np.ndarray:
        jac = np.empty((len(r), len(params)))
        # the parameters that change no step first, while the point's simulations are kept
        for j in sorted(range(len(params)), key=lambda j: not params[j].post_hoc):
            h = FD_STEP * span[j] * (1 if x[j] + FD_STEP * span[j] <= high[j] else -1)
            xj = x.copy()
            xj[j] += h
            jac[:, j] = (objective(at(xj)) - r) / (h / span[j])
        return jac

    x = np.clip(np.array([theta[p.name] for p in params]), low, high)
    r, jac = objective(at(x)), None
    cost, lam, it, converged = float(r @ r), 1e-2, 0, False
    fresh, last = False, jac
    while it < max_iterations:
        it += 1
        if jac is None:
            jac, fresh = differences(x, r), True
        jac = np.array(jac, dtype=float)
        improved = small = False
        for _ in range(6 if fresh else 2):  # a carried Jacobian that misses is taken again
            a = jac.T @ jac
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -jac.T @ r)
            trial = np.clip(x + step * span, low, high)
            rt = objective(at(trial))
            if float(rt @ rt) < cost:
                improved = True
                break
            lam *= 4
        if improved:
            moved = (trial - x) / span
            gain = 1 - float(rt @ rt) / cost
            if moved @ moved > 0:  # Broyden: the residuals' change along the step
                jac = jac + np.outer(rt - r - jac @ moved, moved) / float(moved @ moved)
            x, r, cost = trial, rt, float(rt @ rt)
            lam = max(lam / 3, 1e-6)
            small = np.max(np.abs(moved)) < 1e-3 or gain < tolerance
        if on_iteration:
            on_iteration(it, at(x), cost)
        if small or (not improved and fresh):
            converged = True
            break
        if not improved:
            last, jac = jac, None  # the carried Jacobian may be what failed: take it again
        fresh = False
    return {
        "theta": at(x),
        "objective": cost,
        "iterations": it,
        "evaluations": objective.evaluations,
        "converged": converged,
        "residuals": r,
        "jacobian": last if jac is None else jac,
    }
