"""Continuous batching: the queues every engine schedules over, and the moves they share.

Plain synchronous code; the engine process (kvsim.sim.loop) owns the clock and passes
`now` in. Which requests run in the next step, in what order, and whom to preempt is
the imitated engine's decision (kvsim.engines: vLLM V0, vLLM V1, SGLang): each is a
small rules object (kvsim.engines.base.EngineRules) whose `schedule(scheduler, now)`
fills a `Step` with the moves below and those of the running set (kvsim.sim.running).
This module keeps the queues, admits, preempts and rejects, and has the running set
apply a finished step.

A sequence holds KV for every token that exists: its prompt (or the part prefilled so
far) and each token generated so far. Where a sampled token's slot is taken is the
rules' `sampled_slot_ahead`: vLLM V0 as kvsim counts it, in the step that samples the
token (a request's peak is prompt + output); vLLM V1 and SGLang as they allocate, in
the step that feeds the token back in (vLLM's KVCacheManager.allocate_slots covers the
tokens computed, SGLang's prepare_for_decode one slot per request, so the peak is
prompt + output - 1: the last token sampled is never fed). A
request whose prompt +
output exceeds max_model_len, or which could not fit even in an empty pool, is rejected
with that reason: it would otherwise wait or thrash forever.

A request may run as a group of `width` sequences: parallel samples (n) or beams
(beam_width). vLLM V0 forks them from the prompt at admission, sharing its KV as far as
the allocator can, decodes one token each per step and preempts them together. vLLM V1
and SGLang run parallel samples as separate requests whose prompts are the same tokens
(content), so only a prefix cache shares them (`expand`). Beam search branches after every
decode step: each beam but the first is, with probability BEAM_REPLACE, pruned and
replaced by a fork of a beam kept this step (a uniform choice), so beams share their
common history by reference. The draws depend only on the seed, the request and its
progress, so every policy sees the same tree (kvsim.sim.running).

Every step records what kept the head of the waiting queue out (`Step.limit`, one of
LIMITS): memory, the watermark, max_num_seqs, the token budget, a preemption in this
step; with nothing waiting the step is arrival-bound. `Step.head_need` is what that
head needed this step (its chunk with chunked prefill) for the memory breakdown.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvsim.cost.model import StepBatch
from kvsim.engines.base import MAX_WIDTH, EngineRules, Request, Step
from kvsim.kvcache import InvariantError, KVAllocator, NextSeq, SeqShape
from kvsim.sim.records import PoolParts
from kvsim.sim.running import RunningSet
from kvsim.sim.waiting import WaitingQueue
from kvsim.workload.requests import RequestSpec, RequestTable


@dataclass(frozen=True)
class SwapSpace:
    """CPU memory for swapped-out KV and the link it is copied over (the scheduler
    owns what is in use: `Scheduler.swap_used`)."""

    capacity_bytes: float
    bytes_per_token: float
    bandwidth_bytes_s: float


class Scheduler:
    """One replica's queues and the moves every engine shares (kvsim.engines.base.SchedulerOps).
    running_set: the class that holds the running requests (RunningSet, or the lazy one
    of kvsim.sim.lazy), built with running_options. arrivals: the run's requests, from
    which a request deep in a long waiting queue, kept as its index, is rebuilt near the
    head (kvsim.sim.waiting); without them every waiting request is an object."""

    def __init__(
        self,
        allocator: KVAllocator,
        rules: EngineRules,
        *,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        watermark: float = 0.0,
        preemption_mode: str | None = "recompute",
        swap: SwapSpace | None = None,
        sliding_window: int | None = None,
        width: int = 1,
        beam: bool = False,
        seed: int = 0,
        schedule_policy: str = "fcfs",
        async_scheduling: bool = False,
        ignore_eos: bool = False,
        running_set: type[RunningSet] = RunningSet,
        running_options: dict | None = None,
        arrivals: RequestTable | None = None,
    ):
        if width > 1 and chunked_prefill and not rules.split_samples:
            raise ValueError("sequence groups need whole-prompt prefill")
        self.allocator, self.rules = allocator, rules
        self.ahead = int(rules.sampled_slot_ahead)  # see the module docstring
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.keep_free = int(watermark * allocator.capacity)
        self.preemption_mode = preemption_mode
        self.schedule_policy = schedule_policy
        self.ignore_eos = ignore_eos
        self.swap = swap
        self.swap_used = 0.0  # bytes of swapped-out KV in CPU memory
        self.window = sliding_window
        self.width = 1 if rules.split_samples else width
        self.beam, self.seed = beam, seed
        self._arrivals, self._per = arrivals, width if rules.split_samples else 1  # requests per arrival
        self.waiting = WaitingQueue(self._rebuild if arrivals is not None else None)
        self.swapped: deque[Request] = deque()  # vLLM V0 keeps swapped-out groups apart
        self.preemptions = 0
        self.swaps = 0
        self.prompt_tokens = 0  # tokens to prefill at admissions ...
        self.cached_tokens = 0  # ... and those a prefix cache already held
        self.now_planned = 0.0  # when the step being planned starts
        self.async_scheduling = async_scheduling
        # arrivals by index (the run numbers them in arrival order, kvsim.sim.loop): the
        # latest, the latest when the step in flight was planned, the latest the step
        # being planned sees (an index, not a time: stages that drain move arrivals)
        self.latest = self.planned_latest = self.cutoff = -1
        self.running = running_set(self, **(running_options or {}))

    # --- arrivals ----------------------------------------------------------------------
    def expand(self, requests: list[RequestSpec], width: int) -> list[Request]:
        """One Request per request, or, where the engine runs samples as requests, one per
        sample: the same prompt tokens (the prompt's own part becomes a shared segment)
        and outputs of their own."""
        if not self.rules.split_samples or width == 1:
            return [Request(r, r.shape) for r in requests]
        return [Request(r, sample_shape(r, k)) for r in requests for k in range(width)]

    def arrive(self, req: Request, now: float, index: int) -> None:
        """Queue `req` (the index-th of the run) or reject it at once with the reason."""
        self.arrived(req, index)
        self.latest = index
        reason = (
            "prompt + output exceeds max_model_len"
            if req.shape.final_tokens > self.max_model_len
            else self.allocator.unfit_reason(req.shape)
        )
        if reason:
            req.outcome, req.reason, req.finish_s = "rejected", reason, now
        else:
            self.waiting.arrived(req, index)

    def _rebuild(self, index: int) -> Request:
        """The sequence that arrived as the index-th, as it arrived (kvsim.sim.waiting)."""
        per = self._per
        return self.arrived(self.expand([self._arrivals[index // per]], per)[index % per], index)

    def arrived(self, req: Request, index: int) -> Request:
        """`req` as it arrives, the index-th of the run: its prompt to prefill, its ids.
        (kvsim.sim.waiting rebuilds a request kept as its index with this.)"""
        req.target = req.shape.prompt_tokens
        first = index * MAX_WIDTH
        req.ids = (first,) if self.width == 1 else tuple(range(first, first + self.width))
        return req

    # --- what the rules use --------------------------------------------------------------
    def running_seqs(self) -> int:
        """Sequences running (max_num_seqs counts these, as vLLM does)."""
        return len(self.running) * self.width

    def prefill_need(self, req: Request, budget: float) -> tuple[int, int, int]:
        """(tokens a prefix cache holds, tokens to compute this step, KV tokens held after)
        to admit `req`, its prompt chunked to `budget` where prefill is chunked. The last
        prompt token is always computed, to produce output."""
        return self.need_after(req, self.rules.cached_tokens(self, req), budget)

    def need_after(self, req: Request, cached: int, budget: float) -> tuple[int, int, int]:
        """prefill_need's answer for `cached` tokens found in a cache."""
        n = req.target - cached
        if self.chunked:
            n = min(n, budget)
        n = int(n)
        return cached, n, cached + n + (self.ahead if cached + n == req.target else 0)

    def fits(self, req: Request, tokens: int, keep_free: int) -> bool:
        """Whether `req` could be admitted with `tokens` of KV now (nothing changes)."""
        return self.running.fits((req.shape, tokens, keep_free))

    def blocked_by(self, req: Request, tokens: int, keep_free: int) -> str:
        """Why `req` cannot be admitted: the watermark, if it would fit without it; else memory."""
        return "watermark" if keep_free and self.fits(req, tokens, 0) else "memory"

    def free_slots(self) -> int:
        """Free slots in the pool (with a radix cache, evictable ones too)."""
        return self.running.free_slots()

    def admit(self, req: Request, cached: int, n: int, held: int, step: Step, now: float, keep_free: int = 0) -> bool:
        """Give the waiting head `held` tokens of KV (its cache hits reused) and run its
        next `n` tokens in this step; False, changing nothing, if memory refuses."""
        first, *others = req.ids
        if not self.allocator.allocate(first, req.shape, held, keep_free):
            return False
        for k, other in enumerate(others):
            if not self.allocator.fork(first, other):  # a copy that does not fit: wait
                for sid in [first, *others[:k]]:
                    self.allocator.free(sid)
                return False
        self.waiting.remove(req)
        step.load_s += self.allocator.take_load_s()  # KV tiers: the step waits for its prefix
        req.prefilled = cached
        self.prompt_tokens += req.target
        self.cached_tokens += cached
        self.running.add(req, n, step, now)
        return True

    def swap_in(self, req: Request, step: Step, now: float, keep_free: int = 0) -> bool:
        """Copy a swapped-out request's KV back and let it decode in this step. A group
        comes back as its prompt shared by every sequence, each with its own generated
        tokens (parallel samples exactly; beams' shared history beyond the prompt comes
        back unshared)."""
        first, *others = req.ids
        prompt = req.shape.prompt_tokens
        if not self.allocator.allocate(first, req.shape, prompt if others else req.held + 1, keep_free):
            return False
        done = [first]
        for other in others:
            ok = self.allocator.fork(first, other)
            done += [other] if ok else []
            if not ok:
                break
        if len(done) < len(req.ids) or not all(self.allocator.grow(k, req.held + 1) for k in done):
            for k in done:
                self.allocator.free(k)
            return False
        (self.swapped if req in self.swapped else self.waiting).remove(req)
        nbytes = self._swap_bytes(req)
        self.swap_used -= nbytes
        step.swap_bytes += nbytes
        req.swapped = False
        self.running.add(req, 1, step, now, swapped_in=True)
        return True

    def reject(self, req: Request, now: float, reason: str, step: Step) -> None:
        """`req` can never run: its KV freed, out of the waiting queue, recorded with `reason`."""
        for sid in req.ids:
            if self.allocator.tokens_of(sid) is not None:
                self.allocator.free(sid)
        if req in self.waiting:
            self.waiting.remove(req)
        req.outcome, req.finish_s = "rejected", now
        req.reason = reason + (f" with its {self.width} sequences" if self.width > 1 else "")
        step.rejected.append(req)

    def abort(self, index: int, end_s: float) -> Request | None:
        """The client of the index-th arrival gave up at end_s: take it out of the queue
        that holds it, free its KV (or its swap space) and mark it timed out. None where
        it is not here (it ended, or another replica serves it)."""
        req = self.running.find(index)
        if req is not None:
            self.running.remove(req)
            for sid in req.ids:
                self.allocator.free(sid)
        else:
            req = next((s for s in self.swapped if s.index == index), None)
            if req is not None:
                self.swapped.remove(req)
            else:
                req = self.waiting.take(index, lambda s: s.index)
                if req is None:
                    return None
            if req.swapped:
                self.swap_used -= self._swap_bytes(req)
        req.outcome, req.finish_s = "timed out", end_s
        return req

    def preempt(self, req: Request, step: Step, mode: str | None = None) -> None:
        """Take `req` out of the running requests: swap its KV to CPU memory (while swap
        space lasts) or drop it to be recomputed later, by prompt + generated tokens in
        one prefill (a group by its prompt: its samples or beams are not kept)."""
        self.running.remove(req)
        mode = mode or self.rules.preemption_mode(self, req)
        # SGLang's retraction frees what the request computed without caching it
        release = self.allocator.drop if mode == "retract" else self.allocator.free
        for sid in req.ids:
            release(sid)
        nbytes = self._swap_bytes(req) if self.swap else math.inf
        if mode == "swap" and not req.prefilling and nbytes <= self.swap.capacity_bytes - self.swap_used:
            self.swap_used += nbytes
            step.swap_bytes += nbytes
            req.swapped = True
            self.swaps += 1
            self.rules.requeue(self, req)
        else:
            if self.width > 1:
                req.generated = 0
            req.target, req.prefilled, req.held = req.shape.prompt_tokens + req.generated, 0, 0
            self.rules.requeue(self, req)
        if not math.isnan(req.first_token_s) and math.isnan(req.stall_from):
            req.stall_from = self.now_planned  # it decoded in the step that just ended
        req.preemptions += 1
        self.preemptions += 1
        step.preempted += 1

    def _swap_bytes(self, req: Request) -> float:
        """KV copied over PCIe: a group's shared prompt once, each sequence's own tokens."""
        own = req.held - req.shape.prompt_tokens
        return (
            (req.shape.prompt_tokens + own * self.width) * self.swap.bytes_per_token
            if self.width > 1
            else req.held * self.swap.bytes_per_token
        )

    # --- one step ------------------------------------------------------------------------
    def visible(self, req: Request) -> bool:
        """Whether a waiting request has reached the scheduler planning this step. With
        asynchronous scheduling (vLLM 0.33.0's default, vllm/config/vllm.py; a queue of two
        batches, vllm/v1/engine/core.py `EngineCore.step_with_batch_queue`), the engine
        plans step k+1 as soon as step k is launched, so a request that arrives while step
        k runs can join step k+2 at the earliest: the plan made when step k ends sees the
        arrivals up to the moment step k started. An idle engine (nothing running) plans
        as soon as a request comes."""
        return req.index <= self.cutoff

    def visible_next(self, req: Request) -> bool:
        """Whether the step planned next will see `req` (`visible` once it is planned)."""
        return req.index <= self._next_cutoff()

    def _next_cutoff(self) -> int:
        return self.planned_latest if self.async_scheduling and self.running else self.latest

    def planning(self, now: float) -> None:
        """Note that a step is planned now (see `visible`)."""
        self.cutoff = self.planned_latest if self.async_scheduling and self.running else self.latest
        self.planned_latest = self.latest

    def schedule(self, now: float) -> Step:
        """The next step as the engine's rules plan it, with what kept the queue's head
        out and the batch the cost model prices."""
        self.now_planned = now
        self.planning(now)
        self.running.start_step()
        step = self.rules.schedule(self, now)
        if not self.waiting and not self.swapped:
            step.limit, step.head_need = "arrivals", None
        elif step.preempted:
            step.limit = "preemption"
        elif not step.limit:
            raise RuntimeError(
                f"{self.rules.name} left requests waiting without saying why at t={now:.6f}s; this is a kvsim bug"
            )
        if step.head_need is None:
            step.head_need = self.head_need()
        self.running.close_step(step)
        return step

    def head_need(self) -> NextSeq | None:
        """What the waiting queue's head would hold if admitted now, as a step records it
        where the rules did not say (its prompt chunked to the whole budget), or None
        with nothing waiting."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        _, _, held = self.prefill_need(head, self.budget)
        return (head.shape, held, self.keep_free)

    def quiet_next(self) -> bool:
        """Whether the next step is quiet: nothing is swapped out, every running request
        decodes lazily (kvsim.sim.lazy) and the engine's rules would plan nothing but their
        tokens (EngineRules.decodes_only: nothing waits, or nothing the step can see)."""
        return not self.swapped and self.rules.decodes_only(self) and self.running.quiet()

    def quiet_step(self, now: float) -> StepBatch:
        """Plan a quiet step (`quiet_next`) as `schedule` would, without asking the rules
        (its limit is "arrivals": nothing waits that the step could admit; its head's
        need is `head_need`); returns its batch."""
        self.now_planned = now
        self.planning(now)
        return self.running.quiet_tick()

    def recorded_parts(self, next_seq: NextSeq | None) -> PoolParts:
        """What a step records of the pool's breakdown."""
        return self.running.recorded_parts(next_seq)

    def complete(self, step: Step, now: float) -> list[Request]:
        """Apply a finished step at time `now`; returns the requests that finished."""
        return self.running.complete(step, now)

    def check(self) -> None:
        """Raise InvariantError where the scheduler, the running set and the allocator
        disagree (the running set brings its requests up to date first)."""
        self.running.check()

    def check_state(self) -> None:
        """The checks on the queues, the running requests and the allocator."""
        self.allocator.check_invariants()
        running = {id(s) for s in self.running}
        swapped = 0.0
        for req in [*self.waiting, *self.swapped]:
            if id(req) in running:
                raise InvariantError(f"request {req.spec.id} is both running and waiting")
            swapped += self._swap_bytes(req) if req.swapped else 0
            if any(self.allocator.tokens_of(sid) is not None for sid in req.ids):
                raise InvariantError(f"waiting request {req.spec.id} still holds KV")
        for req in self.running:
            for sid in req.ids:
                held = self.allocator.tokens_of(sid)
                if held != req.held:
                    raise InvariantError(
                        f"request {req.spec.id} (sequence {sid}) should hold "
                        f"{req.held} tokens of KV; the allocator has {held}"
                    )
            if req.held > req.shape.final_tokens:
                raise InvariantError(
                    f"request {req.spec.id} holds {req.held} tokens, more than "
                    f"its final length {req.shape.final_tokens}"
                )
        if self.swap and not math.isclose(swapped, self.swap_used, abs_tol=1e-6):
            raise InvariantError(f"swap space counts {self.swap_used} bytes; swapped-out requests hold {swapped}")
        head = self.waiting[0] if self.waiting else None
        b = self.allocator.breakdown(None if head is None else (head.shape, head.target + 1, self.keep_free))
        parts = (b.token, b.reservation, b.internal, b.padding, b.unusable, b.free)
        if min(parts) < 0 or b.capacity != self.allocator.capacity:
            raise InvariantError(f"breakdown {parts} does not split the pool of {self.allocator.capacity}")
        # sharing and windows make b.token less; a hybrid model's KV cache groups hold a
        # token once in each of their tables (kvsim.kvcache.hybrid)
        held = sum(s.held for s in self.running) * self.width * getattr(self.allocator, "tables_per_sequence", 1)
        if b.token > held:
            raise InvariantError(f"the pool counts {b.token} token slots; running requests hold only {held}")


def sample_shape(r: RequestSpec, k: int = 0) -> SeqShape:
    """Sample k of a request run as a request of its own: the prompt's own part is a
    shared segment, its output content of its own. That content is a negative id no
    workload hands out (-1 is "never shared"): another sample never matches it, but the
    sample itself does when it is recomputed after a preemption, as vLLM's prefix cache
    hashes a request's own output blocks and finds them again."""
    return SeqShape(r.prompt_tokens, r.output_tokens, r.prompt_runs, -2 - (r.id * MAX_WIDTH + k))
