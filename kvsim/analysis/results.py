"""A scenario's tables: resolve it (kvsim.sim.plan), simulate every policy
(kvsim.sim.runner), and turn each run into its summary row, step series and request
table (kvsim.analysis.metrics) as it ends.

Building and running never write files; kvsim.cli writes what `run_scenario` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from kvsim.analysis.metrics import request_table, step_table, summarize, ten_digits, tier_columns
from kvsim.analysis.stages import stage_rows
from kvsim.config.scenario import Scenario
from kvsim.cost.model import describe
from kvsim.kvcache import KVAllocator, SeqShape, make_allocator
from kvsim.model.engine_log import engine_log
from kvsim.model.memory import PoolSizing
from kvsim.model.specs import GIB
from kvsim.sim.loop import PolicyRun
from kvsim.sim.plan import Plan, offload_columns, resolve
from kvsim.sim.runner import simulate_plan
from kvsim.workload.requests import RequestTable


@dataclass
class Results:
    summary: pd.DataFrame
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    pool: PoolSizing
    per_replica: pd.DataFrame | None = None  # a fleet's rows per (policy, replica)
    stages: pd.DataFrame | None = None  # rows per (policy, load stage): kvsim.analysis.stages
    engine_log: dict[str, list[str]] | None = None  # per policy, what the engine logs of its pool
    plan: Plan | None = None


def total_footprint(allocator: KVAllocator, requests: RequestTable) -> int:
    """The sum of every request's footprint (allocator.footprint), asked once per distinct
    (prompt, output) pair: a footprint depends on a shape's lengths alone. Each pair is
    one integer, prompt * base + output (so that finding the pairs is one sort)."""
    base = int(requests.output_tokens.max()) + 1 if len(requests) else 1
    pairs, counts = np.unique(requests.prompt_tokens * base + requests.output_tokens, return_counts=True)
    return sum(
        allocator.footprint(SeqShape(*divmod(pair, base))) * count
        for pair, count in zip(pairs.tolist(), counts.tolist())
    )


@dataclass
class PolicyTables:
    """One policy's part of the results."""

    row: dict
    replica_rows: list[dict]
    steps: pd.DataFrame
    requests: pd.DataFrame
    stage_rows: list[dict]


def tabulate(plan: Plan, i: int, run: PolicyRun) -> PolicyTables:
    """Policy i's summary row (and a fleet's rows per replica) and tables."""
    policy, requests = plan.policies[i], plan.requests
    table = request_table(run)
    api = policy.cost.api  # the HTTP server's delay on each response
    if api is not None:
        table = api.respond(table, plan.request_timeout_s)
    allocator = make_allocator(policy.kind, plan.pool.pool_bytes, policy.kv, plan.max_model_len, **policy.options)
    mean_footprint = total_footprint(allocator, requests) * plan.width / len(requests)
    fixed = {
        "policy": policy.name,
        "allocator": policy.allocator,
        "kv_cache_dtype": policy.kv.kv_cache_dtype,
        **policy.columns(),
    }
    tiered = any(p.tiers is not None for p in plan.policies)
    if tiered:
        fixed.update(offload_columns(policy.tiers))
    if plan.replicas > 1:
        fixed.update(replicas=plan.replicas, router=plan.router)
    kv = policy.kv

    def row(run: PolicyRun, table: pd.DataFrame, share: int) -> dict:
        """share: the replicas the row's pool and capacity columns add up."""
        return {
            **fixed,
            "kv_pool_gib": ten_digits(plan.pool.pool_bytes * share / GIB),
            "kv_capacity_tokens": policy.capacity * share,
            "memory_capacity_requests": ten_digits(policy.capacity * share / mean_footprint),
            **summarize(run, table, kv.scale_bytes_per_token / kv.bytes_per_token),
            **(tier_columns(run) if tiered else {}),
            "cost_model": describe(policy.cost.label, run.extrapolated, len(run.steps), run.extrapolation_reasons),
        }

    parts = []
    for r, part in enumerate(run.parts):
        mine = table[table.replica == r]
        parts.append({"replica": r, "requests_routed": len(mine), **row(part, mine, 1)})
    return PolicyTables(
        row(run, table, plan.replicas),
        parts,
        step_table(run),
        table,
        stage_rows(run, table, list(plan.stages), plan.streaming),
    )


def run_scenario(
    scn: Scenario,
    base_dir: Path,
    src: str = "scenario",
    *,
    on_progress: Callable[[str, int, int], None] | None = None,
    check_invariants: bool = False,
    exact_steps: bool = False,
    bucket_s: float | None = None,
    workers: int = 1,
) -> Results:
    """Resolve `scn`, run every policy (kvsim.sim.runner.simulate_plan: the options are
    its) and return the tables, each policy's made as its run ends."""
    plan = resolve(scn, base_dir, src)
    tables: dict[int, PolicyTables] = {}
    simulate_plan(
        plan,
        on_progress=on_progress,
        on_result=lambda i, run: tables.__setitem__(i, tabulate(plan, i, run)),
        check_invariants=check_invariants,
        exact_steps=exact_steps,
        bucket_s=bucket_s,
        workers=workers,
    )
    done = [tables[i] for i in range(len(plan.policies))]
    per_replica = [r for t in done for r in t.replica_rows]
    stages = pd.DataFrame([r for t in done for r in t.stage_rows]).map(
        lambda v: ten_digits(v) if isinstance(v, float) else v
    )
    log = {
        p.name: lines
        for p in plan.policies
        if (lines := engine_log(plan.pool, p.kv, p.kind, p.options, plan.max_model_len))
    }
    return Results(
        pd.DataFrame([t.row for t in done]),
        pd.concat([t.steps for t in done], ignore_index=True),
        pd.concat([t.requests for t in done], ignore_index=True),
        plan.pool,
        _replica_columns(pd.DataFrame(per_replica)) if per_replica else None,
        stages,
        log,
        plan,
    )


def _replica_columns(df: pd.DataFrame) -> pd.DataFrame:
    """policy, replica first: the rest as in the summary."""
    return df[["policy", "replica", *[c for c in df.columns if c not in ("policy", "replica")]]]
