"""Every policy of a plan on one request stream: `simulate_plan` returns their runs.

Each policy runs on its own allocators (one per replica) and scheduler, from the plan
alone (kvsim.sim.plan); in worker processes where asked (kvsim.sim.parallel), with the
same results. Nothing here makes tables or writes files: kvsim.analysis.results turns
the runs into tables, and the command line writes them.
"""

from __future__ import annotations

from typing import Callable

from kvsim.kvcache import make_allocator
from kvsim.sim.loop import PolicyRun, simulate
from kvsim.sim.parallel import ordered_map
from kvsim.sim.plan import Plan


def simulate_plan(
    plan: Plan,
    *,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_result: Callable[[int, PolicyRun], None] | None = None,
    check_invariants: bool = False,
    exact_steps: bool = False,
    bucket_s: float | None = None,
    workers: int = 1,
) -> list[PolicyRun]:
    """Run every policy of `plan`; on_progress(policy, finished, total) reports progress,
    on_result(i, run) is called as policy i's run ends (with workers, while others run).
    workers: simulate the policies in up to that many processes (the same results;
    progress is then reported as each policy ends).
    exact_steps: the plain path, every running request visited in every step; the same
    results. bucket_s: the time series in buckets of that many simulated seconds, 0 for
    every step; None: the scenario's timeseries_bucket_s (None there too: every step)."""
    requests, n = plan.requests, len(plan.policies)
    bucket_s = plan.timeseries_bucket_s if bucket_s is None else bucket_s or None
    parallel = workers > 1 and n > 1

    def run_policy(i: int) -> PolicyRun:  # in a worker where parallel: plain records travel back
        policy = plan.policies[i]
        progress = (
            (lambda done, name=policy.name: on_progress(name, done, len(requests)))
            if on_progress and not parallel
            else None
        )
        if policy.tiers is None or policy.kind == "trtllm":  # TensorRT-LLM's host pool is its own
            fleet = [
                make_allocator(policy.kind, plan.pool.pool_bytes, policy.kv, plan.max_model_len, **policy.options)
                for _ in range(plan.replicas)
            ]
        else:  # fresh stores for this run, each behind its replica's allocator
            fleet = [
                make_allocator(
                    policy.kind, plan.pool.pool_bytes, policy.kv, plan.max_model_len, **policy.options, tiers=store
                )
                for store in policy.tiers.stores(plan.replicas, policy.kv.bytes_per_token)
            ]
        run = simulate(
            policy.name,
            requests,
            fleet,
            policy.cost,
            engine=policy.settings.engine,
            on_step=progress,
            check_invariants=check_invariants,
            time_limit_s=plan.time_limit_s,
            exact_steps=exact_steps,
            bucket_s=bucket_s,
            router=plan.router,
            request_timeout_s=plan.request_timeout_s,
            **policy.scheduler_options(plan),
        )
        if parallel:  # not sent back: the caller holds the same table
            for r in (run, *run.parts):
                r.requests = None
        return run

    def ended(i: int, run: PolicyRun) -> None:
        for r in (run, *run.parts):
            r.requests = requests
        if on_progress and parallel:  # in workers, a policy reports progress only as it ends
            on_progress(plan.policies[i].name, len(requests), len(requests))
        if on_result:
            on_result(i, run)

    # in workers, the prefix caches first, as the longest runs: the radix cache (it runs
    # step by step), then the hashed one (its lookups)
    first = [i for i, p in enumerate(plan.policies) if p.kind == "radix"] + [
        i for i, p in enumerate(plan.policies) if p.options.get("prefix_caching")
    ]
    return ordered_map(run_policy, n, workers if parallel else 1, first=first, on_result=ended)
