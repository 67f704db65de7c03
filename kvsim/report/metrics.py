"""From one policy's records to tables: a summary row, a step series, a request table.

Definitions (also in the README):
- The KV pool at each step splits into token / reservation / internal / external / free
  (see kvsim.allocators.base). The summary's fractions are time-weighted (by step
  duration) over the steps during which at least one request waits, when memory is
  the bottleneck; if nothing ever waits, over all busy steps. `fraction_basis` says
  which ("waiting" or "busy"); `achievable_batch_size` uses the same basis.
- kv_utilization = token_fraction.
- allocation_waste = slots allocated but not holding tokens / slots allocated,
  time-weighted over the busy time.
- mean_batch_size: time-weighted mean of running requests over the busy time.
- throughput_tok_s: output tokens of completed requests (times the sequences each
  runs: parallel samples or beams) / makespan (first arrival to last completion);
  request_throughput likewise in requests.
- Latencies in simulated seconds: TTFT = first token - arrival; TPOT = (finish - first
  token) / (output tokens - 1) for requests of 2+ output tokens; e2e = finish - arrival.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvsim.engine import STEP_FIELDS, PolicyRun

PARTS = ("token", "reservation", "internal", "external", "free")
REQUEST_COLUMNS = ("request_id", "arrival_s", "admitted_s", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "preemptions", "outcome", "reason")


def tidy(x: float) -> float:
    """Ten significant digits: summaries stay byte-identical across platforms' last-bit noise."""
    return float(f"{x:.10g}") if math.isfinite(x) else x


def step_table(run: PolicyRun) -> pd.DataFrame:
    df = pd.DataFrame.from_records(run.steps, columns=list(STEP_FIELDS))
    cap = float(run.capacity_slots)
    for part in PARTS:
        df[part] = df[part] / cap
    df.insert(0, "step", np.arange(len(df), dtype=np.int64))
    df.insert(0, "policy", run.name)
    return df.drop(columns=["allocated", "shared"])


def request_table(run: PolicyRun) -> pd.DataFrame:
    rows = [(s.spec.id, s.spec.arrival_s, s.admitted_s, s.first_token_s, s.finish_s,
             s.spec.prompt_tokens, s.spec.output_tokens, s.preemptions, s.outcome or "unfinished",
             s.reason) for s in run.seqs]
    df = pd.DataFrame.from_records(rows, columns=list(REQUEST_COLUMNS))
    df.insert(0, "policy", run.name)
    return df


def _savings(col: dict, dt: np.ndarray) -> float:
    """1 - physical / logical slots in use, time-weighted over the busy time."""
    logical = ((col["allocated"] + col["shared"]) * dt).sum()
    return float((col["shared"] * dt).sum() / logical) if logical else 0.0


def summarize(run: PolicyRun, requests: pd.DataFrame, scale_share: float = 0.0) -> dict:
    """One policy's summary row; scale_share = scale bytes / bytes per token slot."""
    steps = np.asarray(run.steps, dtype=float).reshape(-1, len(STEP_FIELDS))
    col = {name: steps[:, i] for i, name in enumerate(STEP_FIELDS)}
    dt = col["step_s"]
    waiting = col["waiting"] > 0
    basis = "waiting" if dt[waiting].sum() > 0 else "busy"
    mask = waiting if basis == "waiting" else np.ones_like(waiting)
    w = dt * mask

    def weighted(x, weights=w):
        total = weights.sum()
        return float((x * weights).sum() / total) if total > 0 else math.nan

    fractions = {f"{p}_fraction": weighted(col[p] / run.capacity_slots) for p in PARTS}
    allocated = (col["allocated"] * dt).sum()
    waste = float(((col["allocated"] - col["token"]) * dt).sum() / allocated) if allocated else 0.0

    done = requests[requests.outcome == "completed"]
    ttft = (done.first_token_s - done.arrival_s).to_numpy()
    e2e = (done.finish_s - done.arrival_s).to_numpy()
    multi = done[done.output_tokens > 1]
    tpot = ((multi.finish_s - multi.first_token_s) / (multi.output_tokens - 1)).to_numpy()
    makespan = float(done.finish_s.max() - requests.arrival_s.min()) if len(done) else math.nan

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else math.nan

    row = {
        "requests_total": len(requests),
        "requests_completed": int(len(done)),
        "requests_rejected": int((requests.outcome == "rejected").sum()),
        "requests_unfinished": int((requests.outcome == "unfinished").sum()),
        **fractions,
        "fraction_basis": basis,
        "kv_utilization": fractions["token_fraction"],
        "allocation_waste": waste,
        "mean_batch_size": weighted(col["running"], dt),
        "max_batch_size": int(col["running"].max()) if len(dt) else 0,
        "achievable_batch_size": weighted(col["running"]),
        "throughput_tok_s": float(done.output_tokens.sum() * run.width / makespan) if makespan > 0 else 0.0,
        "request_throughput": float(len(done) / makespan) if makespan > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90), "tpot_p99_s": pct(tpot, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "scale_fraction": fractions["token_fraction"] * scale_share,
        "preemptions": run.preemptions,
        "swaps": run.swaps,
        "prefix_hit_rate": run.cached_tokens / run.prompt_tokens if run.prompt_tokens else 0.0,
        "sharing_savings": _savings(col, dt),
        "makespan_s": makespan,
        "steps": len(dt),
    }
    return {k: tidy(v) if isinstance(v, float) else v for k, v in row.items()}
