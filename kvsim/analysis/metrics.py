"""From one policy's records to tables: a summary row, a step series, a request table.

Definitions (also in the documentation, docs/outputs.md):
- Each step records what kept the head of the waiting queue out (kvsim.sim.scheduler.LIMITS):
  `limited_by_<limit>` is the share of the busy time (time-weighted by step duration)
  spent in steps of each kind; `limited_by_arrivals` is the share with nothing waiting.
- The KV pool at each step splits into token / reservation / internal / external / free
  (see kvsim.kvcache.base). The summary's fractions and `achievable_batch_size` are
  time-weighted over the memory-bound steps (limited_by == memory), where memory decided
  the batch; every policy is measured on the same kind of window. A policy that is never
  memory-bound has no such window: its fractions are empty (NaN) and `fraction_basis`
  says "none" instead of "memory".
- kv_utilization = token_fraction.
- allocation_waste = slots allocated but not holding tokens / slots allocated,
  time-weighted over the busy time.
- mean_batch_size: time-weighted mean of running requests over the busy time.
- throughput_tok_s: output tokens of completed requests (times the sequences each
  runs: parallel samples or beams) / makespan (first arrival to last completion);
  request_throughput likewise in requests.
- Latencies in simulated seconds: TTFT = first token - arrival; TPOT = (finish - first
  token) / (output tokens - 1) for requests of 2+ output tokens; e2e = finish - arrival;
  means and percentiles over completed requests. itl_mean_s is inference-perf's
  inter-token latency, the mean gap between the lines a streaming client reads
  (kvsim.analysis.stages): about half the TPOT above, as a token's event and the blank
  line after it are two lines. stages.csv has these per load stage.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvsim.kvcache.tiers import TIER_NAMES
from kvsim.sim.loop import STEP_FIELDS, PolicyRun
from kvsim.engines.base import LIMITS

PARTS = ("token", "reservation", "internal", "external", "free")
REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "admitted_s",
    "first_token_s",
    "finish_s",
    "prompt_tokens",
    "output_tokens",
    "sequences",
    "preemptions",
    "outcome",
    "reason",
)

# what each `fraction_basis` means, as the table notes and figures say it
BASIS = {
    "waiting": "time-weighted while requests wait",
    "busy": "time-weighted over busy time",
    "memory": "time-weighted over the steps memory kept a request waiting",
    "none": "never memory-bound: no fractions",
}


def ten_digits(x: float) -> float:
    """Ten significant digits: summaries stay byte-identical across platforms' last-bit noise."""
    return float(f"{x:.10g}") if math.isfinite(x) else x


def step_table(run: PolicyRun) -> pd.DataFrame:
    """One row per step (or bucket); a fleet's, each replica's rows in turn with its index."""
    if run.parts:
        return pd.concat([step_table(p).assign(replica=r) for r, p in enumerate(run.parts)], ignore_index=True)
    if run.steps.bucketed:
        return bucket_table(run)
    df = pd.DataFrame(run.steps.columns())
    cap = float(run.capacity_slots)
    for part in PARTS:
        df[part] = df[part] / cap
    df["limited_by"] = pd.Categorical.from_codes(df["limit"].astype(int), LIMITS)
    for name in TIER_NAMES if run.tiers is not None else ():
        held = df.pop(f"tier_{name}_chunks")
        df[f"tier_{name}_occupancy"] = held / max(run.tiers.get(f"seen_chunks_{name}", 0), 1)
    df.insert(0, "step", np.arange(len(df), dtype=np.int64))
    df.insert(0, "policy", run.name)
    return df.drop(columns=["allocated", "shared", "limit"])


def bucket_table(run: PolicyRun) -> pd.DataFrame:
    """One row per time bucket of a run recorded in buckets (kvsim.sim.records.BucketLog):
    its start (time_s), its steps and busy seconds (step_s), the time-weighted means of
    running and waiting requests and of the breakdown (as shares of the pool), the
    tokens prefilled and decoded in it, the largest batch, and the limit that held for
    most of its busy time (limited_by)."""
    b = run.steps.buckets()
    busy = b["busy"]
    cap = float(run.capacity_slots)
    df = pd.DataFrame(
        {
            "policy": run.name,
            "bucket": b["bucket"],
            "time_s": b["bucket"] * run.steps.bucket_s,
            "step_s": busy,
            "steps": b["steps"].astype(np.int64),
            "running": b["dt_running"] / busy,
            "max_running": b["peak_running"].astype(np.int64),
            "waiting": b["dt_waiting"] / busy,
            "prefill_tokens": b["prefill_tokens"].astype(np.int64),
            "decode_tokens": b["decode_tokens"].astype(np.int64),
            **{part: b[f"dt_{part}"] / busy / cap for part in PARTS},
        }
    )
    for name in TIER_NAMES if run.tiers is not None else ():
        df[f"tier_{name}_occupancy"] = (
            b[f"dt_tier_{name}_chunks"] / busy / max(run.tiers.get(f"seen_chunks_{name}", 0), 1)
        )
    limits = np.stack([b[f"dt_limit_{i}"] for i in range(len(LIMITS))], axis=1)
    df["limited_by"] = pd.Categorical.from_codes(limits.argmax(axis=1) if len(df) else [], LIMITS)
    return df


def _bucket_figures(run: PolicyRun) -> dict:
    """The step-derived summary columns from bucket sums: the same sums and time-weighted
    means as from the steps, summed in another order (the last bits may differ)."""
    b = {k: v.sum() for k, v in run.steps.buckets().items() if k != "bucket" and not k.startswith("peak_")}
    peak = run.steps.buckets()["peak_running"]
    busy = b["busy"]
    memory = LIMITS.index("memory")
    w = b[f"dt_limit_{memory}"]

    def weighted(total, weights=w):
        return float(total / weights) if weights > 0 else math.nan

    fractions = {f"{p}_fraction": weighted(b[f"w_{p}"] / run.capacity_slots) for p in PARTS}
    logical = b["dt_allocated"] + b["dt_shared"]
    return {
        "limits": {
            f"limited_by_{name}": float(b[f"dt_limit_{i}"] / busy) if busy > 0 else math.nan
            for i, name in enumerate(LIMITS)
        },
        "fractions": fractions,
        "basis": "memory" if w > 0 else "none",
        "waste": float((b["dt_allocated"] - b["dt_token"]) / b["dt_allocated"]) if b["dt_allocated"] else 0.0,
        "mean_batch_size": weighted(b["dt_running"], busy),
        "max_batch_size": int(peak.max()) if len(peak) else 0,
        "achievable_batch_size": weighted(b["w_running"]),
        "sharing_savings": float(b["dt_shared"] / logical) if logical else 0.0,
        "steps": int(b["steps"]),
    }


def request_table(run: PolicyRun) -> pd.DataFrame:
    """One row per request. Where an engine ran a request's samples as requests of their
    own (vLLM V1, SGLang), they are one row again: admitted and first token at the
    first sample's, finished at the last one's, completed when all are."""
    req, rec, per = run.requests, run.records, run.per
    arrival = np.repeat(req.arrival_s, per) if run.arrived_s is None else run.arrived_s
    columns = (
        np.repeat(req.id_column(), per),
        arrival,
        rec.admitted_s,
        rec.first_token_s,
        rec.finish_s,
        np.repeat(req.prompt_tokens, per),
        np.repeat(req.output_tokens, per),
        np.full(len(rec), run.width, dtype=np.int64),
        rec.preemptions,
        rec.names(),
        rec.reason_column(),
    )
    df = pd.DataFrame(dict(zip(REQUEST_COLUMNS, columns)))
    df["stage"] = 0 if req.stage is None else np.repeat(req.stage, per)
    if run.replica is not None:
        df["replica"] = np.repeat(run.replica, per)
    if df.request_id.duplicated().any():
        rank = df.outcome.map({"rejected": 3, "timed out": 2, "unfinished": 1, "completed": 0})
        df = (
            df.assign(rank=rank)
            .groupby("request_id", sort=True)
            .agg(
                arrival_s=("arrival_s", "first"),
                admitted_s=("admitted_s", "min"),
                first_token_s=("first_token_s", "min"),
                finish_s=("finish_s", "max"),
                prompt_tokens=("prompt_tokens", "first"),
                output_tokens=("output_tokens", "first"),
                sequences=("sequences", "size"),
                preemptions=("preemptions", "sum"),
                rank=("rank", "max"),
                reason=("reason", "max"),
                stage=("stage", "first"),
                **({"replica": ("replica", "first")} if run.replica is not None else {}),
            )
            .reset_index()
        )
        df.insert(
            len(REQUEST_COLUMNS) - 2,
            "outcome",
            df.pop("rank").map({3: "rejected", 2: "timed out", 1: "unfinished", 0: "completed"}),
        )
    df.insert(0, "policy", run.name)
    return df


def _step_figures(run: PolicyRun) -> dict:
    """The step-derived summary columns, from every step."""
    steps = run.steps.array()
    col = {name: steps[:, i] for i, name in enumerate(STEP_FIELDS)}
    dt = col["step_s"]
    busy = dt.sum()
    limits = {
        f"limited_by_{name}": float(dt[col["limit"] == i].sum() / busy) if busy > 0 else math.nan
        for i, name in enumerate(LIMITS)
    }
    memory_bound = col["limit"] == LIMITS.index("memory")
    w = dt * memory_bound

    def weighted(x, weights=w):
        total = weights.sum()
        return float((x * weights).sum() / total) if total > 0 else math.nan

    allocated = (col["allocated"] * dt).sum()
    return {
        "limits": limits,
        "fractions": {f"{p}_fraction": weighted(col[p] / run.capacity_slots) for p in PARTS},
        "basis": "memory" if dt[memory_bound].sum() > 0 else "none",
        "waste": float(((col["allocated"] - col["token"]) * dt).sum() / allocated) if allocated else 0.0,
        "mean_batch_size": weighted(col["running"], dt),
        "max_batch_size": int(col["running"].max()) if len(dt) else 0,
        "achievable_batch_size": weighted(col["running"]),
        "sharing_savings": _savings(col, dt),
        "steps": len(dt),
    }


def _savings(col: dict, dt: np.ndarray) -> float:
    """1 - physical / logical slots in use, time-weighted over the busy time."""
    logical = ((col["allocated"] + col["shared"]) * dt).sum()
    return float((col["shared"] * dt).sum() / logical) if logical else 0.0


def summarize(run: PolicyRun, requests: pd.DataFrame, scale_share: float = 0.0) -> dict:
    """One policy's summary row; scale_share = scale bytes / bytes per token slot."""
    figures = _bucket_figures(run) if run.steps.bucketed else _step_figures(run)
    limits, fractions = figures["limits"], figures["fractions"]

    done = requests[requests.outcome == "completed"]

    ttft = (done.first_token_s - done.arrival_s).to_numpy()
    e2e = (done.finish_s - done.arrival_s).to_numpy()
    multi = done[done.output_tokens > 1]
    tpot = ((multi.finish_s - multi.first_token_s) / (multi.output_tokens - 1)).to_numpy()
    makespan = float(done.finish_s.max() - requests.arrival_s.min()) if len(done) else math.nan

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else math.nan

    def mean(x):
        return float(np.mean(x)) if len(x) else math.nan

    # inference-perf's inter-token latency (kvsim.analysis.stages): lines' span / gaps counted
    lines = (2 * done.output_tokens + 1).sum()
    itl_mean = float((done.finish_s - done.first_token_s).sum() / lines) if lines else math.nan

    row = {
        "requests_total": len(requests),
        "requests_completed": int(len(done)),
        "requests_rejected": int((requests.outcome == "rejected").sum()),
        "requests_unfinished": int((requests.outcome == "unfinished").sum()),
        "requests_timed_out": int((requests.outcome == "timed out").sum()),
        **limits,
        **fractions,
        "fraction_basis": figures["basis"],
        "kv_utilization": fractions["token_fraction"],
        "allocation_waste": figures["waste"],
        "mean_batch_size": figures["mean_batch_size"],
        "max_batch_size": figures["max_batch_size"],
        "achievable_batch_size": figures["achievable_batch_size"],
        "throughput_tok_s": float((done.output_tokens * done.sequences).sum() / makespan) if makespan > 0 else 0.0,
        "request_throughput": float(len(done) / makespan) if makespan > 0 else 0.0,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p90_s": pct(tpot, 90),
        "tpot_p99_s": pct(tpot, 99),
        "itl_mean_s": itl_mean,
        "e2e_mean_s": mean(e2e),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p90_s": pct(e2e, 90),
        "e2e_p99_s": pct(e2e, 99),
        "scale_fraction": fractions["token_fraction"] * scale_share,
        "preemptions": run.preemptions,
        "swaps": run.swaps,
        "prefix_hit_rate": run.cached_tokens / run.prompt_tokens if run.prompt_tokens else 0.0,
        "sharing_savings": figures["sharing_savings"],
        "makespan_s": makespan,
        "steps": figures["steps"],
    }
    return {k: ten_digits(v) if isinstance(v, float) else v for k, v in row.items()}


def tier_columns(run: PolicyRun) -> dict:
    """The KV tiers' summary columns (zeros, and every hit the GPU's, for a run without):
    the share of prompt tokens each tier held (prefix_hit_rate_gpu, _cpu, _disk: they sum
    to prefix_hit_rate), GiB written to and read from each tier, each tier's occupancy
    (time-weighted over the busy time, as a share of its capacity), the seconds steps
    waited for loads and their share of the busy time."""
    prompt = run.prompt_tokens or 1
    t = run.tiers or {}
    tiers = {name: t.get(f"hit_tokens_{name}", 0.0) for name in TIER_NAMES}
    row = {
        "prefix_hit_rate_gpu": (run.cached_tokens - sum(tiers.values())) / prompt if run.prompt_tokens else 0.0,
        **{f"prefix_hit_rate_{name}": tokens / prompt for name, tokens in tiers.items()},
    }
    for name in TIER_NAMES:
        row[f"tier_{name}_written_gib"] = t.get(f"written_bytes_{name}", 0.0) / 2**30
        row[f"tier_{name}_read_gib"] = t.get(f"read_bytes_{name}", 0.0) / 2**30
    steps = run.steps
    if run.tiers is None:
        busy, held = 0.0, {name: 0.0 for name in TIER_NAMES}
    elif steps.bucketed:
        b = steps.buckets()
        busy = float(b["busy"].sum())
        held = {name: float(b[f"dt_tier_{name}_chunks"].sum()) for name in TIER_NAMES}
    else:
        a = steps.array()
        dt = a[:, STEP_FIELDS.index("step_s")]
        busy = float(dt.sum())
        held = {name: float((a[:, len(STEP_FIELDS) + i] * dt).sum()) for i, name in enumerate(TIER_NAMES)}
    for name in TIER_NAMES:
        cap = t.get(f"seen_chunks_{name}", 0.0)  # a fleet's: over replica-time, of each one's
        row[f"tier_{name}_occupancy"] = held[name] / busy / cap if busy > 0 and cap else 0.0
    row["tier_load_s"] = t.get("load_s", 0.0)
    row["tier_load_share"] = row["tier_load_s"] / busy if busy > 0 else 0.0
    return {k: ten_digits(v) for k, v in row.items()}
