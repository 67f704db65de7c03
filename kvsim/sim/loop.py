"""The discrete-event model: SimPy drives arrivals and the engine's step loop.

Two processes share one environment per policy:
- `arrivals` hands each request to the scheduler at its arrival time;
- `engine` repeatedly plans a step, records the memory it holds, waits the step's
  cost-model time, and applies the step. With nothing to do it sleeps until the next
  arrival.
Order of simultaneous events: requests arriving at the instant a step ends are queued
before the next step is planned (the engine yields one zero-delay timeout after each
step, which SimPy runs after every event already scheduled for that instant).
A fleet (`replicas: N`) runs N engine processes, each with its own scheduler and KV
pool, in the same environment; `arrivals` asks the router (kvsim.sim.router) which
one gets each request, at its arrival, as the replicas stand then. A request arriving
at the instant a step of some replica ends sees that step finished or not as SimPy
orders the two events.

Load stages that drain (kvsim.workload.stages) hold a stage's first arrival until every
request of the previous stage has ended, and move its arrivals by where its start falls.
A client timeout (`request_timeout_s`) aborts a request at the first step that starts
after its deadline, in whatever queue it is.

`simulate` runs one policy and returns plain records; kvsim.analysis.metrics turns them into
tables. Nothing here writes files or reads a clock.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import numpy as np
import simpy

from kvsim.sim import lazy
from kvsim.kvcache import InvariantError, KVAllocator, PrefixCachingPagedAllocator
from kvsim.kvcache.tiers import tally
from kvsim.cost.model import CostModel
from kvsim.engines import make_rules
from kvsim.sim.router import make_router
from kvsim.sim.records import BucketLog, MergedLog, SeqLog, SeqRecord, StepLog
from kvsim.sim.scheduler import LIMITS, MAX_WIDTH, Scheduler, sample_shape
from kvsim.workload.requests import RequestSpec, RequestTable

# One row per step: the memory breakdown (slots) while the step runs, and what kept the
# waiting queue's head out (an index into kvsim.sim.scheduler.LIMITS).
STEP_FIELDS = ("time_s", "step_s", "running", "waiting", "prefill_tokens", "decode_tokens",
               "token", "reservation", "internal", "external", "free", "allocated", "shared", "limit")
INT_FIELDS = STEP_FIELDS[2:]
# with KV tiers (kvsim.kvcache.tiered), the chunks each holds while the step runs
TIER_FIELDS = ("tier_cpu_chunks", "tier_disk_chunks")


def step_log(bucket_s: float | None = None, tiers: bool = False) -> StepLog:
    """Where a run's steps go: every step, or sums per `bucket_s` seconds (BucketLog)."""
    fields = STEP_FIELDS + TIER_FIELDS if tiers else STEP_FIELDS
    ints = INT_FIELDS + TIER_FIELDS if tiers else INT_FIELDS
    if bucket_s is None:
        return StepLog(fields, ints)
    return BucketLog(fields, ints, bucket_s, totals=("prefill_tokens", "decode_tokens"),
                     weighted=("running", "waiting", *STEP_FIELDS[6:13], *fields[len(STEP_FIELDS):]),
                     limits=len(LIMITS), memory=LIMITS.index("memory"))


@dataclass
class PolicyRun:
    name: str
    capacity_slots: int
    requests: RequestTable
    per: int = 1               # sequences per request (an engine that runs samples as requests)
    records: SeqLog | None = None   # each sequence's outcome, request-major
    steps: StepLog | MergedLog = field(default_factory=step_log)
    preemptions: int = 0
    swaps: int = 0
    prompt_tokens: int = 0     # tokens to prefill at admissions, and those found cached
    cached_tokens: int = 0
    width: int = 1             # sequences per request
    extrapolated: int = 0      # steps the cost model priced beyond its measured ranges ...
    extrapolation_reasons: set[str] = field(default_factory=set)   # ... and why
    arrived_s: np.ndarray | None = None   # each sequence's arrival, where stages moved them
    parts: list["PolicyRun"] = field(default_factory=list)   # a fleet's replicas' runs ...
    replica: np.ndarray | None = None     # ... and the replica each request was sent to
    tiers: dict[str, float] | None = None   # what KV tiers did (kvsim.kvcache.tiers.tally)

    @property
    def seqs(self) -> list[SeqRecord]:
        """Every sequence's outcome as an object (for small runs and tests)."""
        specs = [self.requests[i // self.per] for i in range(len(self.records))]
        return [self.records.record(i, r, sample_shape(r, i % self.per) if self.per > 1 else r.shape)
                for i, r in enumerate(specs)]


def simulate(name: str, requests: RequestTable | list[RequestSpec],
             allocator: KVAllocator | Sequence[KVAllocator], cost: CostModel, *,
             engine: str = "vllm-v1", on_step: Callable[[int], None] | None = None,
             check_invariants: bool = False, time_limit_s: float | None = None,
             exact_steps: bool = False, bucket_s: float | None = None,
             router: str = "round-robin", request_timeout_s: float | None = None,
             **scheduler_options) -> PolicyRun:
    """Replay `requests` against one allocator under `engine`'s rules (kvsim.engines);
    `on_step(finished_so_far)` reports progress.

    scheduler_options go to kvsim.sim.scheduler.Scheduler (max_model_len, max_num_seqs,
    max_num_batched_tokens, chunked_prefill, watermark, preemption_mode, swap,
    sliding_window, width, beam, seed, schedule_policy).
    check_invariants: verify allocator and scheduler after every planned and every
    completed step; a violation raises InvariantError naming the step and the time.
    time_limit_s: stop the simulated clock there; requests not finished stay "unfinished".
    exact_steps: the plain path: every running request visited and every step its own
    SimPy timeout. By default decoding requests advance lazily (kvsim.sim.lazy) and steps
    follow each other without SimPy until an arrival or the time limit is due; the
    records are the same to the last bit (tests/test_fast_path.py).
    bucket_s: record steps as sums per bucket of that many simulated seconds (a long
    run's memory then holds its buckets, not its steps); None: every step.
    allocator: a list of several allocators runs a fleet, one engine per allocator in
    one environment, each request sent to one of them by `router`
    (kvsim.sim.router) when it arrives; the run returned is the fleet's, with each
    replica's run in `parts` and each request's replica in `replica`.
    request_timeout_s: each client gives up that long after it sent its request: at the
    next step's start the engine aborts it wherever it is (waiting, running, swapped
    out), freeing its KV, as vLLM aborts a request whose connection closed; its outcome
    is "timed out", ended at its deadline. A request whose last token comes after its
    deadline has timed out too (its KV is already freed).
    """
    env = simpy.Environment()
    requests = RequestTable.of(requests)
    fleet = list(allocator) if isinstance(allocator, (list, tuple)) else [allocator]
    cost_blocks = getattr(cost, "block_size", None)
    width = scheduler_options.get("width", 1)
    reps = []
    for i, alloc in enumerate(fleet):
        rules = make_rules(engine)
        if isinstance(alloc, PrefixCachingPagedAllocator):    # what its fast path may do
            alloc.private_tails = requests.private_tails()
        if not exact_steps and lazy.applies(alloc, rules, scheduler_options, cost_blocks):
            sched = lazy.LazyScheduler(alloc, rules, cost_block_size=cost_blocks, **scheduler_options)
        else:
            sched = Scheduler(alloc, rules, **scheduler_options)
        reps.append(_Replica(sched, env, index=i if len(fleet) > 1 else None))
    per = width if reps[0].sched.rules.split_samples else 1
    records = SeqLog(len(requests) * per)
    for rep in reps:
        rep.run = PolicyRun(name, rep.sched.allocator.capacity, requests, per, records,
                            step_log(bucket_s, tiers=hasattr(rep.sched.allocator, "store")))
        # a request deep in a long waiting queue is kept as its index and rebuilt near the head
        rep.sched.waiting.rebuild = partial(_rebuild, rep.sched, requests, per)
    stores = {id(a.store): a.store for a in fleet if hasattr(a, "store")}
    shared = None
    if len(fleet) > 1 and len(stores) == 1 and all(hasattr(a, "store") for a in fleet):
        store = next(iter(stores.values()))      # one KV store behind every replica
        shared = lambda spec: len(store.find(spec.shape, 0)) * store.chunk_tokens  # noqa: E731
    pick = make_router(router, len(reps), shared).pick if len(reps) > 1 else None
    served = np.full(len(requests), -1, dtype=np.int64)   # each request's replica
    left = [per] * len(requests) if pick else None         # its sequences not ended yet
    limit = math.inf if time_limit_s is None else time_limit_s
    # `next`: when SimPy will hand over the next arrival (the time its timeout fires); NaN
    # while a stage drains (not known yet: the engine neither waits for it nor ends)
    state = {"ended": 0, "next": 0.0}
    stages = _Stages(requests, per, env)
    # each sequence's client deadline: it gives up request_timeout_s after it sent it
    deadline = None if request_timeout_s is None else np.full(len(records), math.inf)

    def expire(rep: _Replica, now: float) -> None:
        """Abort, at a step's start, every request whose client has given up by now."""
        while rep.deadlines and rep.deadlines[0][0] <= now:
            end_s, index = heapq.heappop(rep.deadlines)
            if records.outcome[index] == 0:             # not settled yet
                seq = rep.sched.abort(index, end_s)
                if seq is not None:
                    settle(rep, index, seq)

    def settle(rep: _Replica, index: int, seq) -> None:
        records.settle(index, seq)
        state["ended"] += 1
        stages.ended(index, seq.finish_s)
        if left is not None:
            left[index // per] -= 1
            if not left[index // per]:
                rep.load -= 1

    def arrivals():
        # A request's sequences are made when it arrives, numbered in arrival order; it
        # is routed when its first sequence arrives. Where stages drain, a stage's
        # arrivals wait for the previous stage's requests to end and move with its zero.
        index = 0
        for i in range(len(requests)):
            while (drained := stages.before(i)) is not None:
                state["next"] = math.nan
                yield drained
            shift = stages.shift
            for k, seq in enumerate(reps[0].sched.expand([requests[i]], width)):
                delay = seq.spec.arrival_s + shift - env.now
                if delay > 0:
                    state["next"] = env.now + delay      # as SimPy computes the timeout's time
                    yield env.timeout(delay)
                stages.arrived(index, env.now)
                if k == 0:
                    served[i] = pick(seq.spec, [r.load for r in reps]) if pick else 0
                    rep = reps[served[i]]
                    rep.load += 1
                rep.sched.arrive(seq, env.now, index)
                if seq.outcome:          # rejected on arrival
                    settle(rep, index, seq)
                elif deadline is not None:
                    deadline[index] = env.now + request_timeout_s
                    heapq.heappush(rep.deadlines, (deadline[index], index))
                if not rep.wake.triggered:
                    rep.wake.succeed()
                index += 1
        state["next"] = math.inf
        for rep in reps:                 # idle replicas see that nothing more comes
            if not rep.wake.triggered:
                rep.wake.succeed()

    def engine(rep: _Replica):
        # `now` runs ahead of SimPy's clock between arrivals (never with exact_steps):
        # nothing but an arrival or the time limit can happen before the next step.
        sched, run = rep.sched, rep.run
        now = env.now
        while True:
            if rep.deadlines and rep.deadlines[0][0] <= now:
                expire(rep, now)
            if not sched.running and not sched.waiting and not sched.swapped:
                if state["next"] == math.inf:
                    return
                for delay in (_delays(env.now, now) if now != env.now else ()):
                    yield env.timeout(delay)
                rep.wake = env.event()
                yield rep.wake
                now = env.now
                continue
            step = sched.quiet_tick(now) or sched.schedule(now)
            for seq in step.rejected:
                settle(rep, seq.ids[0] // MAX_WIDTH, seq)
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
            dt += step.load_s        # and for the KV its admissions load from tiers
            _record(run, sched, step, now, dt)
            if check_invariants:
                _check(sched, f"{rep.label(name)}step {len(run.steps) - 1} planned at t={now:.6f}s")
            end = now + dt           # SimPy's time for a timeout of dt from now
            synced = exact_steps or state["next"] <= end or end >= limit
            if synced:
                for delay in ((dt,) if now == env.now else _delays(env.now, end)):
                    yield env.timeout(delay)
            now = end
            for seq in sched.complete(step, now):
                index = seq.ids[0] // MAX_WIDTH
                if deadline is not None and now > deadline[index]:   # its client left first
                    seq.outcome, seq.finish_s = "timed out", float(deadline[index])
                settle(rep, index, seq)
            if check_invariants:
                _check(sched, f"{rep.label(name)}step {len(run.steps) - 1} completed at t={now:.6f}s")
            if on_step:
                on_step(state["ended"])
            # let arrivals at this instant join first (with the next one already later,
            # there is none left, except where the time limit's event may be pending)
            if synced and (exact_steps or state["next"] <= now or now >= limit):
                yield env.timeout(0)

    env.process(arrivals())
    done = env.all_of([env.process(engine(rep)) for rep in reps])
    env.run(until=done if time_limit_s is None else env.any_of([done, env.timeout(time_limit_s)]))
    for rep in reps:
        sched = rep.sched
        for seq in [*sched.running, *sched.waiting, *sched.swapped]:    # unfinished
            records.settle(seq.ids[0] // MAX_WIDTH, seq)
        rep.run.preemptions, rep.run.swaps = sched.preemptions, sched.swaps
        rep.run.prompt_tokens, rep.run.cached_tokens = sched.prompt_tokens, sched.cached_tokens
        rep.run.width = sched.width
        rep.run.arrived_s = stages.arrived_s
        if hasattr(sched.allocator, "store"):
            rep.run.tiers = tally([sched.allocator])
    if len(reps) == 1:
        return reps[0].run
    run = fleet_run(name, [rep.run for rep in reps], served)
    if reps[0].run.tiers is not None:
        run.tiers = tally([rep.sched.allocator for rep in reps])
    return run


class _Stages:
    """Where load stages drain (kvsim.workload.stages): which arrival waits for the
    previous stage to end, the event that says it has, and how far the next stage's
    nominal times move. Records the arrival times used where they moved (per sequence)."""

    def __init__(self, requests: RequestTable, per: int, env: simpy.Environment):
        plan = requests.plan
        self.plan = plan if plan is not None and plan.drain and len(plan.counts) > 1 else None
        self.shift = 0.0
        self.arrived_s = None
        if self.plan is None:
            return
        self.env, self.per = env, per
        self.firsts = self.plan.firsts
        self.zero = 0.0                       # where the current stage started
        self.stage = 0
        self.left = [c * per for c in self.plan.counts]   # its sequences not ended yet
        self.last_end = [-math.inf] * len(self.left)
        self.stage_of = requests.stage
        self.drained = env.event()
        self.arrived_s = np.full(len(requests) * per, np.nan)

    def before(self, i: int) -> simpy.Event | None:
        """Before request i arrives: the event to wait for where it opens a stage whose
        predecessor has not drained yet; None once it may come (at its time + shift).
        A stage of no requests passes at once: it ends at its zero."""
        if self.plan is None:
            return None
        while self.stage + 1 < len(self.firsts) and i == self.firsts[self.stage + 1]:
            if self.left[self.stage]:
                return self.drained
            self._next_stage()
        return None

    def _next_stage(self) -> None:
        self.zero = self.plan.next_zero(self.zero, self.last_end[self.stage])
        self.stage += 1
        self.shift = self.zero - self.plan.zeros[self.stage]
        self.drained = self.env.event()

    def ended(self, index: int, finish_s: float) -> None:
        if self.plan is None:
            return
        k = int(self.stage_of[index // self.per])
        self.left[k] -= 1
        self.last_end[k] = max(self.last_end[k], finish_s)
        if k == self.stage and not self.left[k] and not self.drained.triggered:
            self.drained.succeed()

    def arrived(self, index: int, now: float) -> None:
        if self.arrived_s is not None:
            self.arrived_s[index] = now


@dataclass
class _Replica:
    """One engine of a fleet: its scheduler, what it records, its unfinished requests
    (the router's load) and the event that wakes it when idle."""
    sched: Scheduler
    env: simpy.Environment
    load: int = 0
    index: int | None = None      # in a fleet of several
    deadlines: list = field(default_factory=list)   # heap of (client deadline, arrival index)
    run: PolicyRun | None = None
    wake: simpy.Event = None

    def __post_init__(self):
        self.wake = self.env.event()

    def label(self, name: str) -> str:
        return f"{name}: " if self.index is None else f"{name}: replica {self.index}: "


def fleet_run(name: str, parts: list[PolicyRun], served: np.ndarray) -> PolicyRun:
    """The fleet as one run: every request, the replicas' steps read as one log (so
    time-weighted figures are over replica-time) and their counts summed."""
    first = parts[0]
    run = PolicyRun(name, first.capacity_slots, first.requests, first.per, first.records,
                    MergedLog([p.steps for p in parts]), width=first.width, parts=parts, replica=served,
                    arrived_s=first.arrived_s)
    for p in parts:
        run.preemptions += p.preemptions
        run.swaps += p.swaps
        run.prompt_tokens += p.prompt_tokens
        run.cached_tokens += p.cached_tokens
        run.extrapolated += p.extrapolated
        run.extrapolation_reasons |= p.extrapolation_reasons
    return run


def _rebuild(sched: Scheduler, requests: RequestTable, per: int, index: int):
    """The sequence that arrived as the index-th, as it arrived (kvsim.sim.waiting)."""
    return sched.arrived(sched.expand([requests[index // per]], per)[index % per], index)


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
    row = (now, dt, len(sched.running), len(sched.waiting) + len(sched.swapped), prefill,
           step.cost.decodes, *sched.recorded_parts(step.head_need), LIMITS.index(step.limit))
    if len(run.steps.fields) > len(STEP_FIELDS):
        row += sched.allocator.tier_occupancy()
    run.steps.append(row)
