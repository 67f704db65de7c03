"""Fitting engine overheads (kvsim.cost.overhead) to measured whole-step times.

Input: points, one per measured step, with the kernel time kvsim's profile predicts for
it (no communication, no overhead) and the features the overhead needs: layers, hidden,
tp, sequences, prompt tokens and new tokens. A measured step is

    measured = host + max(device, L x launch_per_layer)
    host     = step_ms + per_seq_ms x S + per_prefill_token_ms x P
    device   = kernel + 2 L x latency_per_hop x (tp - 1)                       (all-reduce latency)
             + 2 L x 2 (tp-1)/tp x hidden x 2 B x N / bus                      (all-reduce bytes)
             + 2 L x 2 (tp-1)/tp x hidden x 2 B x max(N - knee, 0) / large_step_bus

For a given knee and launch time per layer, each point is either device-bound (every term
above enters) or launch-bound (only the host terms do: the device's are hidden), and
then every term is linear in its coefficient. The fit alternates: assign each point its
regime from the current coefficients, refit, until the regimes stop changing. The knee
and the launch time are chosen from grids by the fit's own error. Coefficients are fitted
by non-negative least squares on relative error (each point weighted by 1 / measured), so
no part of a step can be negative time. With launch_per_layer 0 every point is
device-bound and the model is the purely additive one. The plain bus bandwidth is either
fitted or held at a given figure (`bus_gb_s`): when the points cannot resolve it (its
bytes are small next to the other terms below the knee), holding it at a
datasheet-based assumption keeps it physical and says so.

A per-step fixed cost and an all-reduce latency that does not grow with tp cannot be told
apart with one layer count per tp: they enter as step_ms + 2 L x latency. The hop form,
latency_per_hop x (tp - 1), is what separates them (it is zero at tp 1); it is an
assumption, shaped like a ring all-reduce's 2 (tp - 1) steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvsim.cost.overhead import ACT_BYTES, Comm, Overhead

KNEES = tuple(range(1024, 4097, 512))
LAUNCHES_MS = tuple(round(0.02 * i, 2) for i in range(41))  # per layer: 0-0.8 ms, refined to 0.002
HOST = ("step_ms", "per_seq_ms", "per_prefill_token_ms")
POINT_COLUMNS = ("layers", "hidden", "tp", "seqs", "prefill_tokens", "new_tokens", "kernel_ms", "measured_ms")


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |a x - y| with x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    active, x = np.zeros(n, bool), np.zeros(n)
    for _ in range(3 * n):
        grad = a.T @ (y - a @ x)
        if active.all() or grad[~active].max() <= 1e-12 * max(1.0, np.abs(grad).max()):
            break
        active[np.argmax(np.where(active, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[active] = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
            if (z[active] > 0).all():
                x = z
                break
            neg = active & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            active &= x > 1e-15
    return x


def _columns(p: pd.DataFrame, knee: int, free_bus: bool) -> dict[str, np.ndarray]:
    """Each coefficient's column; the host terms first, then the device terms."""
    tp = p.tp.to_numpy(float)
    gb_per_token = 2 * p.layers.to_numpy(float) * 2 * (tp - 1) / tp * p.hidden.to_numpy(float) * ACT_BYTES / 1e9
    cols = {
        "step_ms": np.ones(len(p)),
        "per_seq_ms": p.seqs.to_numpy(float),
        "per_prefill_token_ms": p.prefill_tokens.to_numpy(float),
        "latency_per_hop_ms": 2 * p.layers.to_numpy(float) * (tp - 1),
        "ms_per_gb_large": gb_per_token * np.maximum(p.new_tokens.to_numpy(float) - knee, 0),
    }
    if free_bus:
        cols["ms_per_gb"] = gb_per_token * p.new_tokens.to_numpy(float)
    return cols


def to_overhead(fit: dict, label: str = "overhead:fitted", gpu: str | None = None) -> Overhead:
    c, h = fit["comm"], fit["host"]
    return Overhead(
        label,
        h["step_ms"] * 1e-3,
        h["per_seq_ms"] * 1e-3,
        h["per_prefill_token_ms"] * 1e-3,
        Comm(0.0, c["latency_per_hop_us"] * 1e-6, c["bus_gb_s"], c["large_step_tokens"], c["large_step_bus_gb_s"]),
        gpu,
        launch_per_layer_s=h.get("launch_per_layer_ms", 0.0) * 1e-3,
    )


def predict(fit: dict, p: pd.DataFrame) -> np.ndarray:
    """Predicted step ms: the points' kernel times plus the fitted overhead, computed by the
    same kvsim.cost.overhead code a run uses."""
    o = to_overhead(fit)
    out = []
    for r in p.itertuples():
        device = r.kernel_ms * 1e-3 + o.comm.seconds(int(r.tp), int(r.layers), int(r.hidden), int(r.new_tokens))
        host = sum(o.host(r.seqs, r.prefill_tokens).values())
        out.append((device + host + o.launch_wait(int(r.layers), device)) * 1e3)
    return np.array(out)


def _fit_at(p: pd.DataFrame, knee: int, launch_ms: float, bus_gb_s: float | None) -> tuple[float, dict]:
    """(relative error, coefficients) at one knee and launch time per layer; see the module
    docstring for the alternation between regimes and coefficients."""
    free = bus_gb_s is None
    cols = _columns(p, knee, free)
    a = np.column_stack(list(cols.values()))
    device_terms = np.array([k not in HOST for k in cols])
    held = 0.0 if free else _columns(p, knee, True)["ms_per_gb"] / bus_gb_s * 1e3
    measured, kernel = p.measured_ms.to_numpy(float), p.kernel_ms.to_numpy(float)
    launch = launch_ms * p.layers.to_numpy(float)
    w = 1 / measured
    bound = np.zeros(len(p), bool)  # launch-bound points
    best, seen = None, set()
    while bound.tobytes() not in seen:  # stops when the regimes repeat
        seen.add(bound.tobytes())
        a_here = np.where(bound[:, None] & device_terms[None, :], 0.0, a)
        y = measured - np.where(bound, launch, kernel + held)
        c = nnls(a_here * w[:, None], y * w)
        device = kernel + held + a[:, device_terms] @ c[device_terms]
        pred = a[:, ~device_terms] @ c[~device_terms] + np.maximum(device, launch)
        err = float(np.mean(np.abs(pred / measured - 1)))
        if best is None or err < best[0]:
            best = (err, dict(zip(cols, c)))
        bound = launch > device
    return best


def fit_overhead(p: pd.DataFrame, bus_gb_s: float | None = None, knees=KNEES, launches_ms=LAUNCHES_MS) -> dict:
    """Fit the overhead to points (POINT_COLUMNS); bus_gb_s None fits the plain bandwidth too.
    The launch time per layer is searched on `launches_ms`, then on a grid 10 times finer
    around the best (launches_ms (0,) fits the purely additive model)."""
    best = None
    for knee in knees:
        for launch in launches_ms:
            err, c = _fit_at(p, knee, launch, bus_gb_s)
            if best is None or err < best[0]:
                best = (err, knee, launch, c)
    err, knee, launch, c = best
    fine = (launches_ms[1] - launches_ms[0]) / 10 if len(launches_ms) > 1 else 0.0
    for i in range(-9, 10) if fine else ():
        here = round(launch + fine * i, 6)
        if here >= 0 and i:
            e, cl = _fit_at(p, knee, here, bus_gb_s)
            if e < err:
                err, launch, c = e, here, cl
    fit = {
        "host": {**{k: float(c[k]) for k in HOST}, "launch_per_layer_ms": float(launch)},
        "comm": {
            "latency_per_hop_us": float(c["latency_per_hop_ms"] * 1e3),
            "bus_gb_s": (_bandwidth(c["ms_per_gb"]) if bus_gb_s is None else float(bus_gb_s)),
            "large_step_tokens": int(knee),
            "large_step_bus_gb_s": _bandwidth(c["ms_per_gb_large"]),
        },
    }
    fit["mape"] = float(np.mean(np.abs(predict(fit, p) / p.measured_ms.to_numpy(float) - 1)))
    fit["points"] = len(p)
    return fit


def _bandwidth(ms_per_gb: float) -> float:
    """GB/s from a fitted ms-per-GB coefficient; a zero coefficient is an unresolved (infinite) one."""
    return float(1e3 / ms_per_gb) if ms_per_gb > 0 else float("inf")


# --- the measured data's rules ------------------------------------------------------
CONFIG = ["model", "tensor_parallel", "prompt_size", "batch_size", "token_size"]


def configurations(raw: pd.DataFrame, e2e_tolerance: float = 0.10) -> pd.DataFrame:
    """One row per measured configuration: medians of its repeats, and which phases the
    stated rules exclude (see `why`).

    * Medians of the repeated runs, so single-run outliers (the e2e_time values far below
      their siblings) do not move anything; e2e_time is not fitted at all.
    * A configuration whose prefill is faster than the same one at half the batch did not
      prefill the batch it names: its prefill is excluded.
    * A configuration whose median e2e_time exceeds prefill + token_size x token_time by more
      than `e2e_tolerance` spent time in iterations that are neither (requests queued or
      preempted and recomputed): its decode mean is not the batch's, and is excluded.
      Runs whose e2e_time falls short stopped generating early (the model's maximum length);
      their token_time is still a mean per decode step, over fewer steps, and is kept.
    """
    g = raw.groupby(CONFIG, as_index=False).agg(
        repeats=("prompt_time", "size"),
        prompt_ms=("prompt_time", "median"),
        token_ms=("token_time", "median"),
        e2e_ms=("e2e_time", "median"),
        e2e_low_runs=("e2e_time", lambda s: int((s < 0.5 * s.median()).sum())),
    )
    half = g.assign(batch_size=g.batch_size * 2).set_index(CONFIG).prompt_ms
    smaller = g.set_index(CONFIG).index.map(lambda k: half.get(k, np.nan)).to_numpy()
    g["prefill_excluded"] = g.prompt_ms.to_numpy() < smaller
    expected = g.prompt_ms + g.token_size * g.token_ms
    g["e2e_ratio"] = g.e2e_ms / expected
    g["decode_excluded"] = g.e2e_ratio > 1 + e2e_tolerance
    g["why"] = [
        (
            "; ".join(
                w
                for w, on in (
                    ("prefill faster than at half the batch: the batch was not prefilled as one", pe),
                    (f"e2e {r:.2f}x prefill + decode steps: time in other iterations (queueing, preemption)", de),
                )
                if on
            )
        )
        for pe, de, r in zip(g.prefill_excluded, g.decode_excluded, g.e2e_ratio)
    ]
    return g
