"""The running requests: their order, the KV they grow into, and the pool they share.

`RunningSet` holds the running requests in admission order (the last admitted is the
first preempted, as in vLLM and SGLang) and is the only code that grows their KV: an
engine asks it for semantic moves (kvsim.engines.base.RunningRequests: "advance every
request on this token budget", "decode every request", "run this chunk") and it makes
them, request by request, through the allocator. Preempting and rejecting stay the
scheduler's (where a preempted request goes is the engine's rule); this set only asks
for them, from the back of the running order, when a request cannot grow.

The pool's state is read here too, through two questions (`pool_free`, `breakdown`)
that every other pool query is written on, so that a running set which keeps the
breakdown in sums (kvsim.sim.lazy) answers them all from its sums.

This plain set visits every running request in every step: it is the reference the
lazy one is tested against (`--exact-steps`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvsim.cost.model import StepBatch
from kvsim.engines.base import Request, Step, Work
from kvsim.kvcache import Breakdown, InvariantError, NextSeq
from kvsim.sim.records import PoolParts

if TYPE_CHECKING:
    from kvsim.sim.scheduler import Scheduler

BEAM_REPLACE = 0.5  # chance that a beam is replaced by a fork of another each step


class RunningSet:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.allocator = sched.allocator
        self.ahead = sched.ahead  # a finished prefill's sampled token takes its slot now
        self.requests: list[Request] = []  # admission order

    # --- reading --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __contains__(self, req: object) -> bool:
        return req in self.requests

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def find(self, index: int) -> Request | None:
        """The running request that arrived as the index-th, if it runs here."""
        return next((q for q in self.requests if q.index == index), None)

    def prefilling(self) -> list[Request]:
        return [q for q in self.requests if q.prefilling]

    def decoding(self) -> list[Request]:
        return [q for q in self.requests if not q.prefilling]

    def slots_to_decode(self) -> int:
        return sum(
            self.allocator.slots_to_grow(k, q.held + 1) for q in self.requests if not q.prefilling for k in q.ids
        )

    # --- the pool -------------------------------------------------------------------
    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        """(unusable, free, starved) of the breakdown, without its walk over the sequences."""
        return self.allocator.pool_free(next_seq)

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """The pool now, as the allocator splits it."""
        return self.allocator.breakdown(next_seq)

    def free_slots(self) -> int:
        """Free slots in the pool (with a radix cache, evictable ones too)."""
        unusable, free, _ = self.pool_free(None)
        return free + unusable

    def fits(self, next_seq: NextSeq) -> bool:
        """Whether that sequence could be admitted now (nothing changes)."""
        _, _, starved = self.pool_free(next_seq)
        return not starved

    def recorded_parts(self, next_seq: NextSeq | None) -> PoolParts:
        b = self.breakdown(next_seq)
        return PoolParts(b.token, b.reservation, b.internal, b.external, b.free, b.allocated, b.shared)

    # --- moves ----------------------------------------------------------------------
    def add(self, req: Request, n: int, step: Step, now: float, swapped_in: bool = False) -> None:
        """An admitted (or swapped-in) request joins the back, running `n` tokens in this step."""
        self.requests.append(req)
        if math.isnan(req.admitted_s):
            req.admitted_s = now
        step.work.append(Work(req, n))

    def remove(self, req: Request) -> None:
        """`req` leaves the running requests (preempted or rejected; its KV is the caller's)."""
        self.requests.remove(req)

    def run(self, req: Request, n: int, step: Step, now: float) -> bool:
        tokens = req.held_after(n, self.ahead)
        requests, grow = self.requests, self.allocator.grow
        for sid in req.ids:
            while not grow(sid, tokens):
                victim = requests[-1]
                if victim is req and len(requests) == 1:  # alone and still stuck: it never fits
                    self.remove(req)
                    self.sched.reject(req, now, "cannot grow to its final length even alone in the KV pool", step)
                    return False
                self.sched.preempt(victim, step)
                if victim is req:
                    return False
        step.work.append(Work(req, n))
        return True

    def advance(self, step: Step, now: float, budget: int) -> int:
        width, requests = self.sched.width, self.requests
        i = 0
        while i < len(requests):
            req = requests[i]
            if req.prefilling:
                n = cost = min(req.next_tokens(), budget)
                if n <= 0:
                    break
            else:
                if budget < width:
                    break
                n, cost = 1, width
            if not self.run(req, n, step, now):
                break
            budget -= cost
            i += 1
        return budget

    def decode_all(self, step: Step, now: float) -> None:
        # Growing preempts from the back only, so once a request cannot run every later
        # one has gone: the pass may stop there.
        requests = self.requests
        i = 0
        while i < len(requests):
            req = requests[i]
            if not req.prefilling and not self.run(req, 1, step, now):
                break
            i += 1

    def quiet(self) -> bool:
        """Whether a step could be planned without the engine's rules (kvsim.sim.lazy's
        quiet steps): never here, where every step visits every request."""
        return False

    # --- one step -------------------------------------------------------------------
    def start_step(self) -> None:
        """Before the engine plans a step (a lazy set brings due requests up to date)."""

    def close_step(self, step: Step) -> None:
        """After the engine planned `step`: its batch for the cost model, and each
        request's KV as the step leaves it."""
        window, width = self.sched.window or math.inf, self.sched.width
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for s, n in step.work:
            if s.prefilled < s.target:  # prefilling
                prefills.append((n, min(s.prefilled, window)))
            else:  # one context per sequence of the request
                decodes += [min(s.held + 1, window)] * width
        step.cost = StepBatch(tuple(prefills), tuple(decodes))
        ahead = self.ahead
        for req, n in step.work:
            req.held = req.held_after(n, ahead)

    def complete(self, step: Step, now: float) -> list[Request]:
        """Apply a finished step at time `now`; returns the requests that finished."""
        finished = []
        allocator = self.allocator
        for req, n in step.work:
            if req.prefilling:
                req.prefilled += n
                for sid in req.ids:  # a cache that shares computed prompts may take them now
                    allocator.cache_prefilled(sid, req.prefilled)
                if req.prefilling:
                    continue
            req.generated += 1
            if math.isnan(req.first_token_s):
                req.first_token_s = now
            elif not math.isnan(req.stall_from):  # its first token after a preemption
                req.stalls += ((req.stall_from, now),)
                req.stall_from = math.nan
            if req.generated == req.shape.output_tokens:
                req.outcome, req.finish_s = "completed", now
                for sid in req.ids:
                    allocator.free(sid)
                finished.append(req)
            elif self.sched.beam:
                self._branch(req)
        for req in finished:
            self.requests.remove(req)
        return finished

    def _branch(self, req: Request) -> None:
        """Beam search: each beam but the first is, with chance BEAM_REPLACE, pruned and
        replaced by a fork of a beam kept this step (a uniform choice). The draws depend
        only on the seed, the request and its progress, so every policy sees the same tree."""
        sched = self.sched
        rng = np.random.default_rng((sched.seed, req.spec.id, req.generated))
        ids = req.ids
        replaced = [k for k in range(1, sched.width) if rng.random() < BEAM_REPLACE]
        kept = [k for k in range(sched.width) if k not in replaced]
        for k in replaced:
            self.allocator.free(ids[k])
            if not self.allocator.fork(ids[int(rng.choice(kept))], ids[k]):
                raise InvariantError(f"request {req.spec.id}: a beam's copy did not fit where the pruned beam was")

    def check(self) -> None:
        """Raise InvariantError where the scheduler's state is wrong (Scheduler.check_state)."""
        self.sched.check_state()
