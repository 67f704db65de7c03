"""Which policy, and why: one sentence per policy from its summary row.

A verdict says whether the policy meets the latency targets (kvsim.analysis.slo), what
throughput it reached, and what limited its batch. The limit comes from the summary's
`limited_by_*` columns (time shares of the busy time: what stopped the head of the
queue each step) where the run has them. Older runs lack them; then it is inferred,
and labelled so: nothing ever waited ('busy' basis) means arrivals set the batch;
requests waited while the pool was at least 90% taken means memory; otherwise a
scheduler limit (sequence cap or token budget) that the run did not record.
"""

from __future__ import annotations

import math
from typing import Mapping

import pandas as pd

from kvsim.analysis.slo import misses

LIMITS = {  # summary column -> words
    "limited_by_memory": "memory",
    "limited_by_watermark": "the admission watermark",
    "limited_by_max_num_seqs": "the sequence cap (max_num_seqs)",
    "limited_by_token_budget": "the token budget (max_num_batched_tokens)",
    "limited_by_preemption": "preemption",
    "limited_by_arrivals": "arrivals (nothing waiting)",
}
TIE = 0.99  # throughputs this close are the same: latency decides
FULL = 0.9  # share of the pool taken (not free) above which waiting means memory


def _num(row: Mapping, column: str) -> float:
    try:
        value = float(row.get(column, math.nan))
    except (TypeError, ValueError):
        return math.nan
    return value


def limiting_factor(row: Mapping) -> tuple[str, float | None, bool]:
    """(what limited the batch, its time share or None, whether it was inferred)."""
    shares = {c: _num(row, c) for c in LIMITS if c in row}
    shares = {c: v for c, v in shares.items() if not math.isnan(v)}
    if shares:
        column = max(shares, key=lambda c: (shares[c], -list(LIMITS).index(c)))
        return LIMITS[column], shares[column], False
    basis = str(row.get("fraction_basis", ""))
    if basis in ("busy", "none"):
        return LIMITS["limited_by_arrivals"], None, True
    free = _num(row, "free_fraction")
    if not math.isnan(free) and 1 - free >= FULL:
        return "memory", None, True
    return "a scheduler limit (sequence cap or token budget)", None, True


def arrival_limited(row: Mapping) -> bool:
    """Throughput set by the arrival rate: arrivals were the batch's main limit."""
    return limiting_factor(row)[0] == LIMITS["limited_by_arrivals"]


def sentence(row: Mapping, targets: Mapping[str, float] | None = None, rate: float | None = None) -> str:
    """One quotable sentence about one policy's summary row."""
    name = row.get("policy", "?")
    at = f" at {rate:g} req/s" if rate else ""
    if targets:
        missed = misses(row, targets)
        slo = (
            "meets every latency target (" + _targets_text(targets) + ")"
            if not missed
            else "misses " + "; ".join(missed)
        )
        slo += ", with"
    else:
        slo = "reaches"  # pick() says once that no targets are set
    tput = _num(row, "throughput_tok_s")
    p99, tpot = _num(row, "ttft_p99_s"), _num(row, "tpot_p50_s")
    what, share, inferred = limiting_factor(row)
    limit = f"{what} for {share:.0%} of the busy time" if share is not None else what
    if inferred:
        limit += " (inferred: this run records no limited_by_* columns)"
    batch = _num(row, "mean_batch_size")
    return (
        f"{name}{at} {slo} {tput:,.0f} output tok/s, TTFT p99 {_s(p99)} and TPOT p50 "
        f"{_s(tpot)}; its batch (mean {batch:.1f}) was limited by {limit}."
    )


def pick(
    summary: pd.DataFrame,
    targets: Mapping[str, float] | None = None,
    per_policy: Mapping[str, Mapping[str, float]] | None = None,
) -> str:
    """The recommendation: among policies meeting every target (all, when none are set),
    the highest throughput; within 1% of it (arrivals set throughput) the lowest TTFT p99.
    per_policy: each policy's own targets by name, where the policies come from runs
    whose scenarios set different ones (a policy it does not name has `targets`); each
    policy is then judged against its own run's targets."""
    rows = summary.to_dict(orient="records")
    own = {id(r): dict((per_policy or {}).get(str(r.get("policy")), targets or {})) for r in rows}
    ok = [r for r in rows if not misses(r, own[id(r)])]
    if not ok:
        return "No policy meets every latency target: relax the targets, lower the load, or add memory."
    tput = {id(r): _num(r, "throughput_tok_s") for r in ok}
    top = max((v for v in tput.values() if not math.isnan(v)), default=math.nan)
    close = [r for r in ok if tput[id(r)] >= TIE * top] or ok
    best = min(close, key=lambda r: _num(r, "ttft_p99_s") if not math.isnan(_num(r, "ttft_p99_s")) else math.inf)
    judged = [r for r in rows if own[id(r)]]
    mixed = len({tuple(sorted(t.items())) for t in own.values()}) > 1
    if not own[id(best)]:
        why = "it has no latency targets and" if judged else "it"
    else:
        why = "it meets its own run's targets and" if mixed else "it meets every target and"
    unset = ""
    if judged and len(ok) < len(rows):
        unset = f" {len(ok)} of {len(rows)} policies meet " + ("their own run's targets." if mixed else "every target.")
    if not judged:
        unset = " No latency targets are set: add an slo: block to weigh latency."
    elif len(judged) < len(rows):
        free = ", ".join(str(r.get("policy")) for r in rows if not own[id(r)])
        unset += f" No latency targets for {free} (no slo: block in its run)."
    if len(close) > 1:
        return (
            f"Pick {best['policy']}: {why} matches the best throughput ({top:,.0f} tok/s, within 1%) "
            f"with the lowest TTFT p99 ({_s(_num(best, 'ttft_p99_s'))}).{unset}"
        )
    return f"Pick {best['policy']}: {why} has the highest throughput ({top:,.0f} tok/s).{unset}"


def _targets_text(targets: Mapping[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} ≤ {v:g} s" for k, v in targets.items())


def _s(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g} s"


def nothing_completed(summary: pd.DataFrame, requests: pd.DataFrame, time_limit_s: float | None) -> str | None:
    """Why no request completed under any policy (None when some did): the time limit
    ended the run first, or the requests were rejected (their commonest reason)."""
    if len(summary) == 0 or int(summary["requests_completed"].sum()) > 0:
        return None
    outcomes = requests["outcome"].astype(str).value_counts()
    rejected, unfinished = int(outcomes.get("rejected", 0)), int(outcomes.get("unfinished", 0))
    why = []
    if rejected:
        reasons = requests.loc[requests["outcome"] == "rejected", "reason"].astype(str)
        top = reasons.value_counts()
        why.append(
            f"{rejected:,} request(s) were rejected (most: {top.index[0]})"
            if len(top) and top.index[0]
            else f"{rejected:,} request(s) were rejected"
        )
    if unfinished:
        if time_limit_s is not None:
            why.append(
                f"time_limit_s ({time_limit_s:g} s of simulated time) ended the run before "
                f"any of {unfinished:,} request(s) finished: raise it or drop it"
            )
        else:
            why.append(f"{unfinished:,} request(s) were still running when the run ended")
    return "; ".join(why) or "the workload produced no requests"
