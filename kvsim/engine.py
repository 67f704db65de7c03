"""The discrete-event model: SimPy drives arrivals and the engine's step loop.

Two processes share one environment per policy:
- `arrivals` hands each request to the scheduler at its arrival time;
- `engine` repeatedly plans a step, records the memory it holds, waits the step's
  cost-model time, and applies the step. With nothing to do it sleeps until the next
  arrival.
Order of simultaneous events: requests arriving at the instant a step ends are queued
before the next step is planned (the engine yields one zero-delay timeout after each
step, which SimPy runs after every event already scheduled for that instant).

`simulate` runs one policy and returns plain records; kvsim.report.metrics turns them into
tables. Nothing here writes files or reads a clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import simpy

from kvsim import lazy
from kvsim.allocators import InvariantError, KVAllocator
from kvsim.cost.model import CostModel
from kvsim.engines import make_rules
from kvsim.records import BucketLog, SeqLog, SeqRecord, StepLog
from kvsim.scheduler import LIMITS, MAX_WIDTH, Scheduler, sample_shape
from kvsim.workload.requests import RequestSpec, RequestTable

# One row per step: the memory breakdown (slots) while the step runs, and what kept the
# waiting queue's head out (an index into kvsim.scheduler.LIMITS).
STEP_FIELDS = ("time_s", "step_s", "running", "waiting", "prefill_tokens", "decode_tokens",
               "token", "reservation", "internal", "external", "free", "allocated", "shared", "limit")
INT_FIELDS = STEP_FIELDS[2:]


def step_log(bucket_s: float | None = None) -> StepLog:
    """Where a run's steps go: every step, or sums per `bucket_s` seconds (BucketLog)."""
    if bucket_s is None:
        return StepLog(STEP_FIELDS, INT_FIELDS)
    return BucketLog(STEP_FIELDS, INT_FIELDS, bucket_s, totals=("prefill_tokens", "decode_tokens"),
                     weighted=("running", "waiting", *STEP_FIELDS[6:13]), limits=len(LIMITS),
                     memory=LIMITS.index("memory"))


@dataclass
class PolicyRun:
    name: str
    capacity_slots: int
    requests: RequestTable
    per: int = 1               # sequences per request (an engine that runs samples as requests)
    records: SeqLog | None = None   # each sequence's outcome, request-major
    steps: StepLog = field(default_factory=step_log)
    preemptions: int = 0
    swaps: int = 0
    prompt_tokens: int = 0     # tokens to prefill at admissions, and those found cached
    cached_tokens: int = 0
    width: int = 1             # sequences per request
    extrapolated: int = 0      # steps the cost model priced beyond its measured ranges ...
    extrapolation_reasons: set[str] = field(default_factory=set)   # ... and why

    @property
    def seqs(self) -> list[SeqRecord]:
        """Every sequence's outcome as an object (for small runs and tests)."""
        specs = [self.requests[i // self.per] for i in range(len(self.records))]
        return [self.records.record(i, r, sample_shape(r) if self.per > 1 else r.shape)
                for i, r in enumerate(specs)]


def simulate(name: str, requests: RequestTable | list[RequestSpec], allocator: KVAllocator, cost: CostModel, *,
             engine: str = "vllm-v1", on_step: Callable[[int], None] | None = None,
             check_invariants: bool = False, time_limit_s: float | None = None,
             exact_steps: bool = False, bucket_s: float | None = None, **scheduler_options) -> PolicyRun:
    """Replay `requests` against one allocator under `engine`'s rules (kvsim.engines);
    `on_step(finished_so_far)` reports progress.

    scheduler_options go to kvsim.scheduler.Scheduler (max_model_len, max_num_seqs,
    max_num_batched_tokens, chunked_prefill, watermark, preemption_mode, swap,
    sliding_window, width, beam, seed, schedule_policy).
    check_invariants: verify allocator and scheduler after every planned and every
    completed step; a violation raises InvariantError naming the step and the time.
    time_limit_s: stop the simulated clock there; requests not finished stay "unfinished".
    exact_steps: the plain path: every running request visited and every step its own
    SimPy timeout. By default decoding requests advance lazily (kvsim.lazy) and steps
    follow each other without SimPy until an arrival or the time limit is due; the
    records are the same to the last bit (tests/test_fast_path.py).
    bucket_s: record steps as sums per bucket of that many simulated seconds (a long
    run's memory then holds its buckets, not its steps); None: every step.
    """
    env = simpy.Environment()
    rules = make_rules(engine)
    cost_blocks = getattr(cost, "block_size", None)
    if not exact_steps and lazy.applies(allocator, rules, scheduler_options, cost_blocks):
        sched = lazy.LazyScheduler(allocator, rules, cost_block_size=cost_blocks, **scheduler_options)
    else:
        sched = Scheduler(allocator, rules, **scheduler_options)
    requests = RequestTable.of(requests)
    width = scheduler_options.get("width", 1)
    per = width if rules.split_samples else 1
    # a request deep in a long waiting queue is kept as its index and rebuilt near the head
    sched.waiting.rebuild = lambda index: sched.arrived(sched.expand([requests[index // per]], per)[0], index)
    run = PolicyRun(name, allocator.capacity, requests, per, SeqLog(len(requests) * per), step_log(bucket_s))
    total = len(run.records)
    settle = run.records.settle
    limit = math.inf if time_limit_s is None else time_limit_s
    # `next`: when SimPy will hand over the next arrival (the time its timeout fires)
    state = {"ended": 0, "wake": env.event(), "next": 0.0}

    def arrivals():
        # A request's sequences are made when it arrives, numbered in arrival order.
        index = 0
        for i in range(len(requests)):
            for seq in sched.expand([requests[i]], width):
                delay = seq.spec.arrival_s - env.now
                if delay > 0:
                    state["next"] = env.now + delay      # as SimPy computes the timeout's time
                    yield env.timeout(delay)
                sched.arrive(seq, env.now, index)
                if seq.outcome:          # rejected on arrival
                    state["ended"] += 1
                    settle(index, seq)
                if not state["wake"].triggered:
                    state["wake"].succeed()
                index += 1
        state["next"] = math.inf

    def engine():
        # `now` runs ahead of SimPy's clock between arrivals (never with exact_steps):
        # nothing but an arrival or the time limit can happen before the next step.
        now = env.now
        while state["ended"] < total:
            if not sched.running and not sched.waiting and not sched.swapped:
                for delay in (_delays(env.now, now) if now != env.now else ()):
                    yield env.timeout(delay)
                state["wake"] = env.event()
                yield state["wake"]
                now = env.now
                continue
            step = sched.quiet_tick(now) or sched.schedule(now)
            state["ended"] += len(step.rejected)
            for seq in step.rejected:
                settle(seq.ids[0] // MAX_WIDTH, seq)
            if not step.work and not step.lazy and not sched.running and not sched.waiting \
                    and not sched.swapped:
                continue
            if not step.work and not step.lazy:
                raise RuntimeError(f"{name}: no progress possible at t={now:.6f}s with "
                                   f"{len(sched.waiting)} waiting; this is a kvsim bug")
            dt, why = cost.price(step.cost)
            if why:
                run.extrapolated += 1
                run.extrapolation_reasons.update(why)
            if step.swap_bytes:      # the step waits for its PCIe copies
                dt += step.swap_bytes / sched.swap.bandwidth_bytes_s
            _record(run, sched, step, now, dt)
            if check_invariants:
                _check(sched, f"{name}: step {len(run.steps) - 1} planned at t={now:.6f}s")
            end = now + dt           # SimPy's time for a timeout of dt from now
            synced = exact_steps or state["next"] <= end or end >= limit
            if synced:
                for delay in ((dt,) if now == env.now else _delays(env.now, end)):
                    yield env.timeout(delay)
            now = end
            finished = sched.complete(step, now)
            state["ended"] += len(finished)
            for seq in finished:
                settle(seq.ids[0] // MAX_WIDTH, seq)
            if check_invariants:
                _check(sched, f"{name}: step {len(run.steps) - 1} completed at t={now:.6f}s")
            if on_step:
                on_step(state["ended"])
            # let arrivals at this instant join first (with the next one already later,
            # there is none left, except where the time limit's event may be pending)
            if synced and (exact_steps or state["next"] <= now or now >= limit):
                yield env.timeout(0)

    env.process(arrivals())
    done = env.process(engine())
    env.run(until=done if time_limit_s is None else env.any_of([done, env.timeout(time_limit_s)]))
    for seq in [*sched.running, *sched.waiting, *sched.swapped]:    # unfinished
        settle(seq.ids[0] // MAX_WIDTH, seq)
    run.preemptions, run.swaps = sched.preemptions, sched.swaps
    run.prompt_tokens, run.cached_tokens = sched.prompt_tokens, sched.cached_tokens
    run.width = sched.width
    return run


def _delays(now: float, target: float) -> tuple[float, ...]:
    """Timeouts that take SimPy's clock from `now` to exactly `target`, where the engine's
    own clock ran ahead (step by step, as SimPy would have added the steps). One where
    now + (target - now) rounds to target; otherwise two, the second from a time t in
    [target / 2, target], from which target - t is exact (Sterbenz)."""
    d = target - now
    if now + d == target:
        return (d,)
    first = (target - now) * 0.75
    t = now + first
    if not target / 2 <= t <= target or t + (target - t) != target:
        raise RuntimeError(f"no delays take {now!r} to {target!r} (a kvsim bug)")
    return first, target - t


def _check(sched: Scheduler, where: str) -> None:
    try:
        sched.check()
    except InvariantError as e:
        raise InvariantError(f"{where}: {e}") from None


def _record(run: PolicyRun, sched: Scheduler, step, now: float, dt: float) -> None:
    prefill = sum(n for n, _ in step.cost.prefills)
    run.steps.append((now, dt, len(sched.running), len(sched.waiting) + len(sched.swapped), prefill,
                      step.cost.decodes, *sched.recorded_parts(step.head_need), LIMITS.index(step.limit)))
