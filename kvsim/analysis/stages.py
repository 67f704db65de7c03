"""Results per load stage, as inference-perf's report defines them: stages.csv.

One row per policy and stage (a run without stages is one stage, 0). A stage's
requests are those it sent; `completed` are inference-perf's successes, `failed` its
failures (requests the client gave up on at request_timeout_s, and those the server
refused: kvsim's rejections), `unfinished` the rest (the run's time limit came first).
Latencies are over completed requests, from the moment the request was sent, as
`summarize_requests` in inference_perf/reportgen/base.py (kubernetes-sigs/inference-perf
at commit b81afa4; kvsim.config.inference_perf) computes them:

- e2e: end - start.
- ttft: the first streamed line's time - start.
- tpot ("time_per_output_token"): (last line's time - first line's time) / (lines - 1),
  per request.
- itl ("inter_token_latency"): every gap between consecutive lines, of every request,
  pooled: its mean is the lines' time summed over requests / the gaps counted.

The lines are the client's: it timestamps every line of the server-sent event stream
(apis/completion.py process_response), and an event is a `data: {...}` line and a
blank line. vLLM streams each token as its own event, then `data: [DONE]`, so a
request of N tokens gives 2N + 2 lines: the blank line comes microseconds after its
event, and so does [DONE] after the last token. kvsim takes those gaps as 0: a
request's lines span its first token to its last, its gaps are its N - 1 gaps between
tokens plus N + 2 zeros, and so tpot = (finish - first token) / (2N + 1), about half
the time between tokens, and the median itl is 0 (the runs': tens of microseconds).
The gaps between tokens are the step-to-step times of the steps that ended while the
request decoded, exact where every running request decodes in every step (vLLM V1,
SGLang) and it is not preempted; where the time series is bucketed, each request's
N - 1 gaps are taken as its mean gap. Throughput: input and output tokens and requests
of completed requests / (the last end - the first start of any of the stage's requests,
failed ones included). kvsim counts tokens as it simulates them, where the client
re-tokenizes the text (kvsim.workload.inference_perf).

Without streaming (api.streaming false) the client sees no tokens: ttft, itl and tpot
are empty, as inference-perf reports them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

PERCENTILES = {"mean": None, "p50": 50, "p90": 90, "p99": 99}
QUANTILES = {key: q for key, q in PERCENTILES.items() if q is not None}  # the percentiles alone
METRICS = ("ttft", "e2e", "itl", "tpot")
COLUMNS = (
    "policy",
    "stage",
    "rate_per_s",
    "duration_s",
    "requests",
    "completed",
    "failed",
    "unfinished",
    *(f"{m}_{k}_s" for m in METRICS for k in PERCENTILES),
    "input_tokens_per_s",
    "output_tokens_per_s",
    "requests_per_s",
)


def stage_rows(run, table: pd.DataFrame, stages: list[tuple[float, float]], streaming: bool = True) -> list[dict]:
    """The rows of one policy's run (its request table as kvsim.analysis.metrics makes it);
    stages: each stage's (rate_per_s, duration_s)."""
    rows = []
    for k, (rate, duration) in enumerate(stages):
        mine = table[table.stage == k]
        done = mine[mine.outcome == "completed"]
        failed = int((mine.outcome == "rejected").sum() + (mine.outcome == "timed out").sum())
        row = {
            "policy": run.name,
            "stage": k,
            "rate_per_s": rate,
            "duration_s": duration,
            "requests": len(mine),
            "completed": len(done),
            "failed": failed,
            "unfinished": int((mine.outcome == "unfinished").sum()),
        }
        e2e = (done.finish_s - done.arrival_s).to_numpy()
        row.update(_spread("e2e", e2e))
        if streaming:
            n = done.output_tokens.to_numpy()
            span = (done.finish_s - done.first_token_s).to_numpy()
            row.update(_spread("ttft", (done.first_token_s - done.arrival_s).to_numpy()))
            row.update(_spread("tpot", span / (2 * n + 1)))
            row.update(_itl(run, done, n, span))
        else:
            row.update({f"{m}_{k}_s": math.nan for m in ("ttft", "itl", "tpot") for k in PERCENTILES})
        ended = mine[mine.outcome != "unfinished"]
        total = float(ended.finish_s.max() - mine.arrival_s.min()) if len(ended) else math.nan
        per_s = (lambda x: float(x) / total) if total > 0 else (lambda x: math.nan)
        row.update(
            input_tokens_per_s=per_s(done.prompt_tokens.sum()),
            output_tokens_per_s=per_s((done.output_tokens * done.sequences).sum()),
            requests_per_s=per_s(len(done)),
        )
        rows.append({c: row[c] for c in COLUMNS})
    return rows


def _spread(name: str, x: np.ndarray) -> dict:
    at = np.percentile(x, list(QUANTILES.values())) if len(x) else [math.nan] * len(QUANTILES)
    return {
        f"{name}_mean_s": float(np.mean(x)) if len(x) else math.nan,
        **{f"{name}_{key}_s": float(v) for key, v in zip(QUANTILES, at)},
    }


def _itl(run, done: pd.DataFrame, n: np.ndarray, span: np.ndarray) -> dict:
    """The pooled line gaps: each request's N + 2 zeros and its N - 1 gaps between tokens."""
    count = int((2 * n + 1).sum())
    if not count:
        return {f"itl_{k}_s": math.nan for k in PERCENTILES}
    values, weights = [np.zeros(1)], [np.array([(n + 2).sum()])]
    for gaps, w in _token_gaps(run, done, n, span):
        values.append(gaps)
        weights.append(w)
    values, weights = np.concatenate(values), np.concatenate(weights)
    at = weighted_percentiles(values, weights, list(QUANTILES.values()))
    return {"itl_mean_s": float(span.sum() / count), **{f"itl_{key}_s": x for key, x in zip(QUANTILES, at)}}


def _token_gaps(run, done: pd.DataFrame, n: np.ndarray, span: np.ndarray):
    """(gaps, how many times each occurs) between consecutive tokens of `done`."""
    parts = run.parts or [run]
    for r, part in enumerate(parts):
        mine = done.replica.to_numpy() == r if run.parts else np.ones(len(done), dtype=bool)
        if part.steps.bucketed:
            many = mine & (n > 1)
            yield span[many] / (n[many] - 1), n[many] - 1
            continue
        steps = part.steps.array()
        ends = steps[:, 0] + steps[:, 1]  # time_s + step_s
        gaps = np.diff(ends, prepend=np.nan)
        # each request decodes from its first token to its finish, except in its stalls
        # (a preemption: one gap, from the last token before it to the first after)
        starts, stops = [done.first_token_s.to_numpy()[mine]], [done.finish_s.to_numpy()[mine]]
        stalls = [w for i in done.index[mine] for w in run.records.stalls.get(i, ())] if run.per == 1 else []
        if stalls:
            s, e = np.array(stalls).T
            starts.append(e)
            stops.append(s)
            yield e - s, np.ones(len(s), dtype=np.int64)
        starts, stops = np.sort(np.concatenate(starts)), np.sort(np.concatenate(stops))
        # requests decoding at each step's end: an interval's start before it, its end at or after it
        w = np.searchsorted(starts, ends, side="left") - np.searchsorted(stops, ends, side="left")
        keep = (w > 0) & ~np.isnan(gaps)
        yield gaps[keep], w[keep]


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: list[float]) -> list[float]:
    """np.percentile (linear interpolation) at each of `qs` of the multiset holding each
    value `weight` times (sorted once for them all)."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order].astype(np.int64)
    v, w = v[w > 0], w[w > 0]
    total = int(w.sum())
    ends = np.cumsum(w)  # the expanded list's k-th element is v[searchsorted(ends, k+1)]
    at = lambda k: float(v[np.searchsorted(ends, k + 1)])  # noqa: E731
    out = []
    for q in qs:
        h = (total - 1) * q / 100.0
        lo = int(math.floor(h))
        hi = min(lo + 1, total - 1)
        out.append(at(lo) + (h - lo) * (at(hi) - at(lo)))
    return out
