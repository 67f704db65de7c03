"""The step loop: arrivals and every replica's engine steps on one clock.

Each replica's engine repeatedly plans a step (its rules choose what the step holds:
kvsim.engines), records the memory the step holds, lets the step-cost model price it,
and applies the step when that time has passed; with nothing to do it waits for the
next arrival. Requests arrive at their arrival times. Simultaneous events go in a
documented order (StepLoop): at one instant, steps that end are completed first, then
arriving requests are received, then idle replicas plan, so a request arriving at the
instant a step ends joins the step planned then, and a router sees that step finished.
A fleet (`replicas: N`) runs N engines, each with its own scheduler and KV pool, on the
one clock; each request goes to the replica the router (kvsim.sim.router) picks at its
arrival, as the replicas stand then.

Load stages that drain (kvsim.workload.stages) hold a stage's first arrival until every
request of the previous stage has ended, and move its arrivals by where its start falls.
A client timeout (`request_timeout_s`) aborts a request at the first step that starts
after its deadline, in whatever queue it is.

The clock is an explicit event heap (as in Vidur's simulator) rather than SimPy's
processes: the only events are step ends and arrivals, a heap entry costs a fraction of
a SimPy event, so every step can have its own without a fast path that runs ahead of
the clock, and a step's end is the exact float sum of its start and its price.

`simulate` runs one policy and returns plain records; kvsim.analysis.metrics turns them
into tables. Nothing here writes files or reads a clock.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from kvsim.sim import lazy
from kvsim.kvcache import InvariantError, KVAllocator
from kvsim.kvcache.tiers import tally
from kvsim.cost.model import CostModel
from kvsim.engines import make_rules
from kvsim.sim.router import make_router
from kvsim.sim.records import BucketLog, MergedLog, PoolParts, SeqLog, SeqRecord, StepLog
from kvsim.engines.base import LIMITS, Step
from kvsim.sim.scheduler import Scheduler, sample_shape
from kvsim.workload.requests import RequestSpec, RequestTable

# One row per step: the memory breakdown (slots) while the step runs, and what kept the
# waiting queue's head out (an index into kvsim.engines.base.LIMITS).
STEP_FIELDS = ("time_s", "step_s", "running", "waiting", "prefill_tokens", "decode_tokens", *PoolParts._fields, "limit")
INT_FIELDS = STEP_FIELDS[2:]
# with KV tiers (kvsim.kvcache.tiered), the chunks each holds while the step runs
TIER_FIELDS = ("tier_cpu_chunks", "tier_disk_chunks")


def step_log(bucket_s: float | None = None, tiers: bool = False) -> StepLog:
    """Where a run's steps go: every step, or sums per `bucket_s` seconds (BucketLog)."""
    fields = STEP_FIELDS + TIER_FIELDS if tiers else STEP_FIELDS
    ints = INT_FIELDS + TIER_FIELDS if tiers else INT_FIELDS
    if bucket_s is None:
        return StepLog(fields, ints)
    return BucketLog(
        fields,
        ints,
        bucket_s,
        totals=("prefill_tokens", "decode_tokens"),
        weighted=("running", "waiting", *PoolParts._fields, *fields[len(STEP_FIELDS) :]),
        limits=len(LIMITS),
        memory=LIMITS.index("memory"),
    )


@dataclass
class PolicyRun:
    name: str
    capacity_slots: int
    requests: RequestTable
    per: int = 1  # sequences per request (an engine that runs samples as requests)
    records: SeqLog | None = None  # each sequence's outcome, request-major
    steps: StepLog | MergedLog = field(default_factory=step_log)
    preemptions: int = 0
    swaps: int = 0
    prompt_tokens: int = 0  # tokens to prefill at admissions, and those found cached
    cached_tokens: int = 0
    width: int = 1  # sequences per request
    extrapolated: int = 0  # steps the cost model priced beyond its measured ranges ...
    extrapolation_reasons: set[str] = field(default_factory=set)  # ... and why
    arrived_s: np.ndarray | None = None  # each sequence's arrival, where stages moved them
    parts: list["PolicyRun"] = field(default_factory=list)  # a fleet's replicas' runs ...
    replica: np.ndarray | None = None  # ... and the replica each request was sent to
    tiers: dict[str, float] | None = None  # what KV tiers did (kvsim.kvcache.tiers.tally)

    @property
    def seqs(self) -> list[SeqRecord]:
        """Every sequence's outcome as an object (for small runs and tests)."""
        specs = [self.requests[i // self.per] for i in range(len(self.records))]
        return [
            self.records.record(i, r, sample_shape(r, i % self.per) if self.per > 1 else r.shape)
            for i, r in enumerate(specs)
        ]


def simulate(
    name: str,
    requests: RequestTable | list[RequestSpec],
    allocator: KVAllocator | Sequence[KVAllocator],
    cost: CostModel,
    *,
    engine: str = "vllm-v1",
    on_step: Callable[[int], None] | None = None,
    check_invariants: bool = False,
    time_limit_s: float | None = None,
    exact_steps: bool = False,
    bucket_s: float | None = None,
    router: str = "round-robin",
    request_timeout_s: float | None = None,
    **scheduler_options,
) -> PolicyRun:
    """Replay `requests` against one allocator under `engine`'s rules (kvsim.engines);
    `on_step(finished_so_far)` reports progress.

    scheduler_options go to kvsim.sim.scheduler.Scheduler (max_model_len, max_num_seqs,
    max_num_batched_tokens, chunked_prefill, watermark, preemption_mode, swap,
    sliding_window, width, beam, seed, schedule_policy).
    check_invariants: verify allocator and scheduler after every planned and every
    completed step; a violation raises InvariantError naming the step and the time.
    time_limit_s: stop the clock there; requests not finished stay "unfinished".
    exact_steps: the plain path: every running request visited in every step, and
    every step's end an event of the queue. By default decoding requests advance lazily
    (kvsim.sim.lazy) and a step that ends first is completed without the queue
    (StepLoop); the records are the same to the last bit (tests/test_fast_path.py).
    bucket_s: record steps as sums per bucket of that many simulated seconds (a long
    run's memory then holds its buckets, not its steps); None: every step.
    allocator: a list of several allocators runs a fleet, one engine per allocator on
    one clock, each request sent to one of them by `router` (kvsim.sim.router) when it
    arrives; the run returned is the fleet's, with each replica's run in `parts` and
    each request's replica in `replica`.
    request_timeout_s: each client gives up that long after it sent its request: at the
    next step's start the engine aborts it wherever it is (waiting, running, swapped
    out), freeing its KV, as vLLM aborts a request whose connection closed; its outcome
    is "timed out", ended at its deadline. A request whose last token comes after its
    deadline has timed out too (its KV is already freed).
    """
    requests = RequestTable.of(requests)
    fleet = list(allocator) if isinstance(allocator, (list, tuple)) else [allocator]
    cost_blocks = cost.block_size
    reps = []
    for i, alloc in enumerate(fleet):
        rules = make_rules(engine)
        if not exact_steps and lazy.applies(alloc, rules, scheduler_options, cost_blocks):
            tails_private = alloc.takes_blocks_in_bulk and requests.private_tails()
            sched = Scheduler(
                alloc,
                rules,
                running_set=lazy.LazyRunningSet,
                **scheduler_options,
                arrivals=requests,
                running_options={"cost_block_size": cost_blocks, "tails_private": tails_private},
            )
        else:
            sched = Scheduler(alloc, rules, **scheduler_options, arrivals=requests)
        reps.append(_Replica(sched, index=i if len(fleet) > 1 else None))
    per = scheduler_options.get("width", 1) if reps[0].sched.rules.split_samples else 1
    records = SeqLog(len(requests) * per)
    for rep in reps:
        rep.run = PolicyRun(
            name,
            rep.sched.allocator.capacity,
            requests,
            per,
            records,
            step_log(bucket_s, tiers=rep.sched.allocator.store is not None),
        )
    stores = {id(a.store): a.store for a in fleet if a.store is not None}
    shared = None
    if len(fleet) > 1 and len(stores) == 1 and all(a.store is not None for a in fleet):
        store = next(iter(stores.values()))  # one KV store behind every replica
        shared = lambda spec: len(store.find(spec.shape, 0)) * store.chunk_tokens  # noqa: E731
    pick = make_router(router, len(reps), shared).pick if len(reps) > 1 else None
    loop = StepLoop(
        name,
        reps,
        requests,
        records,
        cost,
        per=per,
        width=scheduler_options.get("width", 1),
        pick=pick,
        on_step=on_step,
        check_invariants=check_invariants,
        time_limit_s=math.inf if time_limit_s is None else time_limit_s,
        request_timeout_s=request_timeout_s,
        run_ahead=not exact_steps,
    )
    loop.run()
    for rep in reps:
        sched = rep.sched
        for seq in [*sched.running, *sched.waiting, *sched.swapped]:  # unfinished
            records.record_outcome(seq.index, seq)
        rep.run.preemptions, rep.run.swaps = sched.preemptions, sched.swaps
        rep.run.prompt_tokens, rep.run.cached_tokens = sched.prompt_tokens, sched.cached_tokens
        rep.run.width = sched.width
        rep.run.arrived_s = loop.stages.arrived_s
        if sched.allocator.store is not None:
            rep.run.tiers = tally([sched.allocator])
    if len(reps) == 1:
        return reps[0].run
    run = fleet_run(name, [rep.run for rep in reps], loop.served)
    if reps[0].run.tiers is not None:
        run.tiers = tally([rep.sched.allocator for rep in reps])
    return run


# What happens at one instant, in this order: steps that end then are completed (in the
# order they were planned), then requests that arrive then are received (in arrival
# order, routed as the replicas stand after those completions); then every replica
# without a step in flight that has requests to serve plans its next step.
COMPLETE, ARRIVE = 0, 1
ARRIVALS = LIMITS.index("arrivals")  # the limit of a step with nothing waiting


class Event(NamedTuple):
    """A step's end (COMPLETE, on its replica) or the next arrival (ARRIVE), in heap
    order: by time, then phase, then the order events were made in."""

    time: float
    phase: int
    order: int
    replica: "_Replica | None"


class Deadline(NamedTuple):
    """When a sequence's client gives up (a replica's heap of them, earliest first)."""

    time: float
    index: int  # the sequence's arrival index


class _Stages:
    """Where load stages drain (kvsim.workload.stages): which arrival waits for the
    previous stage to end, when it has, and how far the next stage's nominal times move.
    Records the arrival times used where they moved (per sequence)."""

    def __init__(self, requests: RequestTable, per: int):
        plan = requests.plan
        self.plan = plan if plan is not None and plan.drain and len(plan.counts) > 1 else None
        self.shift = 0.0
        self.arrived_s = None
        if self.plan is None:
            return
        self.per = per
        self.firsts = self.plan.firsts
        self.zero = 0.0  # where the current stage started
        self.stage = 0
        self.left = [c * per for c in self.plan.counts]  # its sequences not ended yet
        self.last_end = [-math.inf] * len(self.left)
        self.stage_of = requests.stage
        self.arrived_s = np.full(len(requests) * per, np.nan)

    def before(self, i: int) -> bool:
        """Before request i arrives: whether it opens a stage whose predecessor has not
        drained yet (else it may come, at its time + shift). A stage of no requests
        passes at once: it ends at its zero."""
        if self.plan is None:
            return False
        while self.stage + 1 < len(self.firsts) and i == self.firsts[self.stage + 1]:
            if self.left[self.stage]:
                return True
            self._next_stage()
        return False

    def _next_stage(self) -> None:
        self.zero = self.plan.next_zero(self.zero, self.last_end[self.stage])
        self.stage += 1
        self.shift = self.zero - self.plan.zeros[self.stage]

    def ended(self, index: int, finish_s: float) -> bool:
        """A sequence ended; whether that drained the current stage."""
        if self.plan is None:
            return False
        k = int(self.stage_of[index // self.per])
        self.left[k] -= 1
        self.last_end[k] = max(self.last_end[k], finish_s)
        return k == self.stage and not self.left[k]

    def arrived(self, index: int, now: float) -> None:
        if self.arrived_s is not None:
            self.arrived_s[index] = now


@dataclass
class _Replica:
    """One engine of a fleet: its scheduler, what it records, its unfinished requests
    (the router's load) and the step it has in flight."""

    sched: Scheduler
    load: int = 0
    index: int | None = None  # in a fleet of several
    run: PolicyRun | None = None
    in_flight: object = None  # the Step planned and not yet completed
    deadlines: list[Deadline] = field(default_factory=list)  # a heap, earliest first

    def label(self, name: str) -> str:
        return f"{name}: " if self.index is None else f"{name}: replica {self.index}: "

    def has_work(self) -> bool:
        sched = self.sched
        return bool(sched.running or sched.waiting or sched.swapped)


class StepLoop:
    """One clock and one queue of events for every replica of a run.

    Events are (time, phase, order) in a heap: a step's end (COMPLETE) or the next
    arrival (ARRIVE); `order` counts events as they are made, so ties keep the order
    they were made in. Times are exact: a step planned at t for dt ends at t + dt, and
    an arrival is received at t + (arrival_s - t) from the time t of the one before (at
    that time itself where it is not later), so each clock reading is one float
    addition away from the last. No event is made for a request that arrives with the
    one before, or for idle replicas: they plan when the instant's events are done. A
    stage that waits for the previous one to drain makes its first arrival's event when
    the last of those requests ends, and goes on from that instant.

    On the fast path (`run_ahead`), a step that ends before any other event (and before
    the time limit and every client deadline, with no other replica still to plan at its
    start) is completed at its end without the event queue, and the next step planned
    there (`_complete_first`): the steps follow one another, each clock reading one float
    addition from the last. With one replica, the arrivals during a step are received at
    their times first, as the event queue would receive them before the step's end.
    Quiet steps (every running request decoding lazily, nothing waiting that the step
    could admit: most steps of a light load) are planned without the engine's rules
    (`_quiet_steps`), each priced and recorded as `_plan` does."""

    def __init__(
        self,
        name: str,
        reps: list[_Replica],
        requests: RequestTable,
        records: SeqLog,
        cost: CostModel,
        *,
        per: int,
        width: int,
        pick: Callable | None,
        on_step,
        check_invariants: bool,
        time_limit_s: float,
        request_timeout_s: float | None = None,
        run_ahead: bool = True,
    ):
        self.name, self.reps, self.requests, self.records, self.cost = name, reps, requests, records, cost
        self.per, self.width = per, width
        self.pick = pick  # the router's choice of replica (None: one replica)
        self.served = np.full(len(requests), -1, dtype=np.int64)  # each request's replica
        self.left = [per] * len(requests) if self.pick else None  # its sequences not ended yet
        self.on_step, self.checking, self.limit = on_step, check_invariants, time_limit_s
        self.run_ahead = run_ahead  # complete the engine's steps that end first here (`_complete_first`)
        self.ended = 0  # sequences ended so far (progress)
        self.events: list[Event] = []
        self.made = 0
        self.next_request = 0  # the next request to arrive ...
        self.arriving: list = []  # ... or, while one arrives, its sequences still to come
        self.index = 0  # arrival index of the next sequence
        self.first = False  # the next of `arriving` is its request's first
        self.rep: _Replica | None = None  # where the arriving request was routed
        self.shift = 0.0  # how far its stage moved the arriving request
        self.stages = _Stages(requests, per)
        self.blocked = False  # the next request waits for its stage's predecessor to drain
        # each sequence's client deadline: it gives up request_timeout_s after it sent it
        self.timeout = request_timeout_s
        self.deadline = None if request_timeout_s is None else np.full(len(records), math.inf)

    def run(self) -> None:
        if len(self.requests):
            self._arrivals(0.0)
        events, limit, reps = self.events, self.limit, self.reps
        now = 0.0
        while True:
            while events and events[0].time == now:
                event = heapq.heappop(events)
                if event.phase == COMPLETE:
                    self._complete(event.replica, now)
                else:
                    self._arrivals(now)
            if now < limit:
                for rep in reps:
                    if rep.in_flight is None:
                        if rep.deadlines and rep.deadlines[0].time <= now:
                            self._expire(rep, now)
                        if rep.has_work():
                            self._plan(rep, now)
                        else:  # nothing runs or waits once this instant's events are done
                            rep.sched.rules.on_idle()
            if not events or events[0].time > limit:
                return
            now = events[0].time

    def _push(self, time: float, phase: int, rep: _Replica | None = None) -> None:
        self.made += 1
        heapq.heappush(self.events, Event(time, phase, self.made, rep))

    def _arrivals(self, now: float) -> None:
        """Receive the sequences due now; schedule the next arrival."""
        reps, requests = self.reps, self.requests
        while True:
            if not self.arriving:
                if self.next_request == len(requests):
                    return
                i = self.next_request
                if self.stages.before(i):  # its stage waits for the last to drain
                    self.blocked = True
                    return
                self.next_request += 1
                # A request's sequences are made when it arrives, numbered in arrival order;
                # it is routed when its first sequence arrives; its stage may move it.
                self.arriving = reps[0].sched.expand([requests[i]], self.width)
                self.arriving.reverse()
                self.first = True
                self.shift = self.stages.shift
            seq = self.arriving[-1]
            delay = seq.spec.arrival_s + self.shift - now
            if delay > 0:
                self._push(now + delay, ARRIVE)
                return
            self.arriving.pop()
            i = self.next_request - 1
            if self.first:
                self.served[i] = self.pick(seq.spec, [r.load for r in reps]) if self.pick else 0
                self.rep = reps[self.served[i]]
                self.rep.load += 1
                self.first = False
            rep = self.rep
            self.stages.arrived(self.index, now)
            rep.sched.arrive(seq, now, self.index)
            if seq.outcome:  # rejected on arrival
                self._record_outcome(rep, self.index, seq, now)
            elif self.deadline is not None:
                self.deadline[self.index] = now + self.timeout
                heapq.heappush(rep.deadlines, Deadline(self.deadline[self.index], self.index))
            self.index += 1

    def _record_outcome(self, rep: _Replica, index: int, seq, now: float) -> None:
        self.records.record_outcome(index, seq)
        self.ended += 1
        if self.stages.ended(index, seq.finish_s) and self.blocked:  # its stage drained
            self.blocked = False
            self._push(now, ARRIVE)
        left = self.left
        if left is not None:
            left[index // self.per] -= 1
            if not left[index // self.per]:
                rep.load -= 1

    def _plan(self, rep: _Replica, now: float) -> None:
        """Plan `rep`'s steps from `now` on: quiet runs (`_quiet_steps`) and the engine's
        steps, each completed here on the fast path where it ends first
        (`_complete_first`) and the next planned at its end, as the event queue would;
        the first that does not goes in flight."""
        sched, run = rep.sched, rep.run
        while True:
            if sched.quiet_next():
                now = self._quiet_steps(rep, now)
                if now is None:  # one is in flight, or the event queue goes on
                    return
            step = sched.schedule(now)
            for seq in step.rejected:
                self._record_outcome(rep, seq.index, seq, now)
            if not step.work and not step.lazy:
                if rep.has_work():
                    raise RuntimeError(
                        f"{self.name}: no progress possible at t={now:.6f}s with "
                        f"{len(sched.waiting)} waiting; this is a kvsim bug"
                    )
                return
            dt = self._price(run, step.cost)
            if step.swap_bytes:  # the step waits for its PCIe copies ...
                dt += step.swap_bytes / sched.swap.bandwidth_bytes_s
            dt += step.load_s  # ... and for the KV its admissions load from tiers
            prefill = sum(n for n, _ in step.cost.prefills)
            _record(run, sched, now, dt, prefill, step.cost.decodes, step.head_need, LIMITS.index(step.limit))
            if self.checking:
                _check(sched, f"{rep.label(self.name)}step {len(run.steps) - 1} planned at t={now:.6f}s")
            rep.in_flight = step
            now = self._complete_first(rep, now + dt)
            if now is None:
                return

    def _quiet_steps(self, rep: _Replica, now: float) -> float | None:
        """Quiet steps (Scheduler.quiet_next: every running request only decodes), from
        `now` while the next is quiet, each planned without the engine's rules. A step
        that ends first (`_ends_first`, the arrivals before its end received) is completed
        here, and the next planned at its end; else it goes in flight like any step and
        None is returned (None too where the event queue goes on from its end:
        `_completed_at`). Returns the time the next step, not quiet, is to be planned at.
        Each step's price and row are those `_plan` gives it; one that completes no
        request only ends the tick."""
        sched, run = rep.sched, rep.run
        running, checking = sched.running, self.checking
        tiers = sched.allocator.store is not None
        rules, price, append = sched.rules, self.cost.price, run.steps.append
        # nothing is admitted or ends between quiet steps: the counts change with arrivals alone
        counts = (len(running), len(sched.waiting) + len(sched.swapped))
        while True:
            batch = sched.quiet_step(now)
            dt, why = price(batch)
            if why:  # (as _price counts them)
                run.extrapolated += 1
                run.extrapolation_reasons.update(why)
            head = sched.head_need() if counts[1] else None
            row = (now, dt, *counts, 0, batch.extra.sequences, *running.recorded_parts(head), ARRIVALS)
            append(row + sched.allocator.tier_occupancy() if tiers else row)
            if checking:
                _check(sched, f"{rep.label(self.name)}step {len(run.steps) - 1} planned at t={now:.6f}s")
            end = now + dt
            arrived = self._receive_before(end)
            if not self._ends_first(rep, end):
                rep.in_flight = Step(lazy=batch.decodes, cost=batch, limit="arrivals")
                self._push(end, COMPLETE, rep)
                return None
            if not running.completes_none():  # completed here, as the event queue would at its end
                rep.in_flight = Step(lazy=batch.decodes, cost=batch, limit="arrivals")
                now = self._completed_at(rep, end)
                if now is None or not sched.quiet_next():
                    return now
                counts = (len(running), len(sched.waiting) + len(sched.swapped))
                continue
            running.complete_quiet()
            if checking:
                _check(sched, f"{rep.label(self.name)}step {len(run.steps) - 1} completed at t={end:.6f}s")
            if self.on_step:
                self.on_step(self.ended)
            now = end
            if arrived:
                counts = (counts[0], len(sched.waiting) + len(sched.swapped))
            # quiet_next, of which only the running set and the rules' view of a waiting
            # head can have changed since the last step: nothing ran or was swapped
            if not running.quiet() or (counts[1] and not rules.decodes_only(sched)):
                return now

    def _receive_before(self, end: float) -> bool:
        """Receive the arrivals due before `end`, where one replica serves them all (a
        fleet routes each arrival) and `end` is within the time limit: what the event
        queue does before a step in flight that ends then completes. Whether any may have
        come."""
        events = self.events
        if self.pick is not None or end >= self.limit or not events or events[0].time >= end:
            return False
        while events and events[0].time < end and events[0].phase == ARRIVE:
            self._arrivals(heapq.heappop(events).time)
        return True

    def _ends_first(self, rep: _Replica, end: float) -> bool:
        """Whether `rep`'s step in flight, ending at `end`, ends before every event left
        (after `_receive_before(end)`) and every client deadline, within the time limit,
        and no other replica of a fleet is still to plan at this instant (it plans before
        this one's next step, as in the event queue: a shared KV store sees them in that
        order): then it may be completed here, without the event queue."""
        events, deadlines = self.events, rep.deadlines
        if (events and events[0].time <= end) or end >= self.limit or (deadlines and deadlines[0].time <= end):
            return False
        return self.pick is None or all(r is rep or r.in_flight is not None or not r.has_work() for r in self.reps)

    def _complete_first(self, rep: _Replica, end: float) -> float | None:
        """`rep`'s step in flight, ending at `end`: completed here where the loop runs
        ahead and it ends first (arrivals before it received), and the time the next step
        is to be planned at returned; else put in the event queue (None). The plain path
        (`--exact-steps`) takes every step through the queue: the oracle of the fast one."""
        if self.run_ahead:
            self._receive_before(end)
            if self._ends_first(rep, end):
                return self._completed_at(rep, end)
        self._push(end, COMPLETE, rep)
        return None

    def _completed_at(self, rep: _Replica, end: float) -> float | None:
        """Complete `rep`'s step in flight at its `end`, as the event queue would; `end`,
        where the next step is to be planned then, else None: the event queue goes on from
        there (an event that the completion made at that instant: a stage opened), or
        nothing is left to do."""
        self._complete(rep, end)
        if self.events and self.events[0].time == end:
            return None
        if not rep.has_work():
            rep.sched.rules.on_idle()
            return None
        return end

    def _price(self, run: PolicyRun, batch) -> float:
        """The cost model's seconds for a step's batch; a run counts the steps it priced
        beyond its measured ranges."""
        dt, why = self.cost.price(batch)
        if why:
            run.extrapolated += 1
            run.extrapolation_reasons.update(why)
        return dt

    def _expire(self, rep: _Replica, now: float) -> None:
        """Abort, at a step's start, every request whose client has given up by now."""
        while rep.deadlines and rep.deadlines[0].time <= now:
            end_s, index = heapq.heappop(rep.deadlines)
            if self.records.outcome[index] == 0:  # not settled yet
                seq = rep.sched.abort(index, end_s)
                if seq is not None:
                    self._record_outcome(rep, index, seq, now)

    def _complete(self, rep: _Replica, now: float) -> None:
        sched, step = rep.sched, rep.in_flight
        rep.in_flight = None
        for seq in sched.complete(step, now):
            index = seq.index
            if self.deadline is not None and now > self.deadline[index]:  # its client left first
                seq.outcome, seq.finish_s = "timed out", float(self.deadline[index])
            self._record_outcome(rep, index, seq, now)
        if self.checking:
            _check(sched, f"{rep.label(self.name)}step {len(rep.run.steps) - 1} completed at t={now:.6f}s")
        if self.on_step:
            self.on_step(self.ended)


def fleet_run(name: str, parts: list[PolicyRun], served: np.ndarray) -> PolicyRun:
    """The fleet as one run: every request, the replicas' steps read as one log (so
    time-weighted figures are over replica-time) and their counts summed."""
    first = parts[0]
    run = PolicyRun(
        name,
        first.capacity_slots,
        first.requests,
        first.per,
        first.records,
        MergedLog([p.steps for p in parts]),
        width=first.width,
        parts=parts,
        replica=served,
        arrived_s=first.arrived_s,
    )
    for p in parts:
        run.preemptions += p.preemptions
        run.swaps += p.swaps
        run.prompt_tokens += p.prompt_tokens
        run.cached_tokens += p.cached_tokens
        run.extrapolated += p.extrapolated
        run.extrapolation_reasons |= p.extrapolation_reasons
    return run


def _check(sched: Scheduler, where: str) -> None:
    try:
        sched.check()
    except InvariantError as e:
        raise InvariantError(f"{where}: {e}") from None


def _record(
    run: PolicyRun, sched: Scheduler, now: float, dt: float, prefill: int, decodes: int, head_need, limit: int
) -> None:
    row = (
        now,
        dt,
        len(sched.running),
        len(sched.waiting) + len(sched.swapped),
        prefill,  # STEP_FIELDS
        decodes,
        *sched.recorded_parts(head_need),
        limit,
    )
    if sched.allocator.store is not None:  # TIER_FIELDS too
        row += sched.allocator.tier_occupancy()
    run.steps.append(row)
