"""Continuous batching: the queues every engine schedules over, and the moves they share.

Plain synchronous code; the engine process (kvsim.sim.loop) owns the clock and passes
`now` in. Which requests run in the next step, in what order, and whom to preempt is
the imitated engine's decision (kvsim.engines: vLLM V0, vLLM V1, SGLang): each is a
small rules object whose `schedule(scheduler, now)` fills a `Step` with the moves
below. This module keeps the state, talks to the allocator, and applies a finished step.

A sequence holds KV for every token that exists: its prompt (or the part prefilled so
far) and each token generated so far. Where a sampled token's slot is taken is the
rules' `sampled_slot_ahead`: vLLM V0 and SGLang as kvsim counts them, in the step that
samples the token (a request's peak is prompt + output); vLLM V1 as it allocates, in
the step that feeds the token back in (KVCacheManager.allocate_slots covers the tokens
computed, so its peak is prompt + output - 1: the last token sampled is never fed). A
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
progress, so every policy sees the same tree.

Every step records what kept the head of the waiting queue out (`Step.limit`, one of
LIMITS): memory, the watermark, max_num_seqs, the token budget, a preemption in this
step; with nothing waiting the step is arrival-bound. `Step.head_need` is what that
head needed this step (its chunk with chunked prefill) for the memory breakdown.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvsim.kvcache import Breakdown, InvariantError, KVAllocator, NextSeq, SeqShape
from kvsim.cost.model import StepBatch
from kvsim.sim.waiting import WaitingQueue
from kvsim.workload.requests import RequestSpec

MAX_WIDTH = 64        # sequences per request; allocator ids are request id * 64 + k
BEAM_REPLACE = 0.5    # chance that a beam is replaced by a fork of another each step
LIMITS = ("memory", "watermark", "max_num_seqs", "token_budget", "preemption", "arrivals")


@dataclass(eq=False, slots=True)
class Seq:
    """The mutable life of one request (or one sample of it) in one policy's run."""
    spec: RequestSpec
    shape: SeqShape
    target: int = 0          # tokens to prefill on (re)admission: prompt + generated
    prefilled: int = 0       # tokens of `target` already computed
    generated: int = 0
    held: int = 0            # tokens whose KV the allocator holds for it
    preemptions: int = 0
    swapped: bool = False    # KV sits in CPU memory, to be copied back on admission
    ids: tuple[int, ...] = ()   # allocator ids of its sequences (one unless samples or beams)
    admitted_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    outcome: str = ""        # "", "completed", "rejected" or "timed out"
    reason: str = ""
    # where a preemption stopped its tokens once they had begun: (last token before, first
    # token after) for each, what a streaming client sees as one long gap (kvsim.analysis.stages)
    stall_from: float = math.nan
    stalls: tuple[tuple[float, float], ...] = ()

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.target


@dataclass
class Step:
    """What one step computes: (sequence, new tokens) pairs, and the PCIe copies it waits for."""
    work: list[tuple[Seq, int]] = field(default_factory=list)
    lazy: int = 0                        # decoding requests advanced in sum (kvsim.sim.lazy)
    cost: StepBatch | None = None
    swap_bytes: float = 0.0
    load_s: float = 0.0                  # seconds of KV-tier loads the step waits for
    rejected: list[Seq] = field(default_factory=list)   # found unable to fit even alone
    preempted: int = 0
    limit: str = ""                      # what kept the queue's head out (LIMITS)
    head_need: NextSeq | None = None     # what that head needed this step


@dataclass(frozen=True)
class SwapSpace:
    """CPU memory for swapped-out KV and the link it is copied over (the scheduler
    owns what is in use: `Scheduler.swap_used`)."""
    capacity_bytes: float
    bytes_per_token: float
    bandwidth_bytes_s: float


class Scheduler:
    def __init__(self, allocator: KVAllocator, rules, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, chunked_prefill: bool, watermark: float = 0.0,
                 preemption_mode: str | None = "recompute", swap: SwapSpace | None = None,
                 sliding_window: int | None = None, width: int = 1, beam: bool = False, seed: int = 0,
                 schedule_policy: str = "fcfs", async_scheduling: bool = False):
        if width > 1 and chunked_prefill and not rules.split_samples:
            raise ValueError("sequence groups need whole-prompt prefill")
        self.allocator, self.rules = allocator, rules
        self.ahead = int(getattr(rules, "sampled_slot_ahead", True))   # see the module docstring
        self._cached = getattr(rules, "cached_tokens", None)   # the rules' own prefix-hit limit
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.keep_free = int(watermark * allocator.capacity)
        self.preemption_mode = preemption_mode
        self.schedule_policy = schedule_policy
        self.swap = swap
        self.swap_used = 0.0               # bytes of swapped-out KV in CPU memory
        self.window = sliding_window
        self.width = 1 if rules.split_samples else width
        self.beam, self.seed = beam, seed
        self.running: list[Seq] = []       # admission order: the last is preempted first
        self.waiting = WaitingQueue()      # deep requests as indices where rebuild is set
        self.swapped: deque[Seq] = deque()  # vLLM V0 keeps swapped-out groups apart
        self.preemptions = 0
        self.swaps = 0
        self.prompt_tokens = 0             # tokens to prefill at admissions ...
        self.cached_tokens = 0             # ... and those a prefix cache already held
        self.now_planned = 0.0             # when the step being planned starts
        self.async_scheduling = async_scheduling
        # arrivals by index (the run numbers them in arrival order, kvsim.sim.loop): the
        # latest, the latest when the step in flight was planned, the latest the step
        # being planned sees (an index, not a time: stages that drain move arrivals)
        self.latest = self.planned_latest = self.cutoff = -1

    # --- arrivals ----------------------------------------------------------------------
    def expand(self, requests: list[RequestSpec], width: int) -> list[Seq]:
        """One Seq per request, or, where the engine runs samples as requests, one per sample:
        the same prompt tokens (the prompt's own part becomes a shared segment) and
        outputs of their own."""
        if not self.rules.split_samples or width == 1:
            return [Seq(r, r.shape) for r in requests]
        return [Seq(r, sample_shape(r, k)) for r in requests for k in range(width)]

    def arrive(self, seq: Seq, now: float, index: int) -> None:
        """Queue `seq` (the index-th of the run) or reject it at once with the reason."""
        self.arrived(seq, index)
        self.latest = index
        reason = ("prompt + output exceeds max_model_len"
                  if seq.shape.final_tokens > self.max_model_len
                  else self.allocator.unfit_reason(seq.shape))
        if reason:
            seq.outcome, seq.reason, seq.finish_s = "rejected", reason, now
        else:
            self.waiting.arrived(seq, index)

    def arrived(self, seq: Seq, index: int) -> Seq:
        """`seq` as it arrives, the index-th of the run: its prompt to prefill, its ids.
        (kvsim.sim.waiting rebuilds a request kept as its index with this.)"""
        seq.target = seq.shape.prompt_tokens
        first = index * MAX_WIDTH
        seq.ids = (first,) if self.width == 1 else tuple(range(first, first + self.width))
        return seq

    # --- what the rules use --------------------------------------------------------------
    def running_seqs(self) -> int:
        """Sequences running (max_num_seqs counts these, as vLLM does)."""
        return len(self.running) * self.width

    def prefill_need(self, seq: Seq, budget: float) -> tuple[int, int, int]:
        """(tokens a prefix cache holds, tokens to compute this step, KV tokens held after)
        to admit `seq`, its prompt chunked to `budget` where prefill is chunked. The last
        prompt token is always computed, to produce output."""
        if self._cached is not None:
            cached = self._cached(self, seq)
        else:
            cached = min(self.allocator.match_prefix(seq.shape, seq.target + 1), seq.target - 1)
        return self.need_after(seq, cached, budget)

    def need_after(self, seq: Seq, cached: int, budget: float) -> tuple[int, int, int]:
        """prefill_need's answer for `cached` tokens found in a cache."""
        n = seq.target - cached
        if self.chunked:
            n = min(n, budget)
        n = int(n)
        return cached, n, cached + n + (self.ahead if cached + n == seq.target else 0)

    def fits(self, seq: Seq, tokens: int, keep_free: int) -> bool:
        """Whether `seq` could be admitted with `tokens` of KV now (nothing changes)."""
        return not self._pool_free((seq.shape, tokens, keep_free))[2]

    def _pool_free(self, next_seq) -> tuple[int, int, bool]:
        """(unusable, free, starved) of the breakdown, without its walk over the sequences
        where the allocator offers that (pool_free; the radix cache does not)."""
        if hasattr(self.allocator, "pool_free"):
            return self.allocator.pool_free(next_seq)
        b = self.allocator.breakdown(next_seq)
        return b.unusable, b.free, b.starved

    def blocked_by(self, seq: Seq, tokens: int, keep_free: int) -> str:
        """Why `seq` cannot be admitted: the watermark, if it would fit without it; else memory."""
        return "watermark" if keep_free and self.fits(seq, tokens, 0) else "memory"

    def admit(self, seq: Seq, cached: int, n: int, held: int, step: Step, now: float,
              keep_free: int = 0) -> bool:
        """Give the waiting head `held` tokens of KV (its cache hits reused) and run its
        next `n` tokens in this step; False, changing nothing, if memory refuses."""
        first, *others = seq.ids
        if not self.allocator.allocate(first, seq.shape, held, keep_free):
            return False
        for k, other in enumerate(others):
            if not self.allocator.fork(first, other):    # a copy that does not fit: wait
                for sid in [first, *others[:k]]:
                    self.allocator.free(sid)
                return False
        self.waiting.remove(seq)
        if hasattr(self.allocator, "take_load_s"):    # KV tiers: the request waits for its prefix
            step.load_s += self.allocator.take_load_s()
        seq.prefilled = cached
        self.prompt_tokens += seq.target
        self.cached_tokens += cached
        self._start(seq, n, step, now)
        return True

    def swap_in(self, seq: Seq, step: Step, now: float, keep_free: int = 0) -> bool:
        """Copy a swapped-out request's KV back and let it decode in this step. A group
        comes back as its prompt shared by every sequence, each with its own generated
        tokens (parallel samples exactly; beams' shared history beyond the prompt comes
        back unshared)."""
        first, *others = seq.ids
        prompt = seq.shape.prompt_tokens
        if not self.allocator.allocate(first, seq.shape, prompt if others else seq.held + 1, keep_free):
            return False
        done = [first]
        for other in others:
            ok = self.allocator.fork(first, other)
            done += [other] if ok else []
            if not ok:
                break
        if len(done) < len(seq.ids) or not all(self.allocator.grow(k, seq.held + 1) for k in done):
            for k in done:
                self.allocator.free(k)
            return False
        (self.swapped if seq in self.swapped else self.waiting).remove(seq)
        nbytes = self._swap_bytes(seq)
        self.swap_used -= nbytes
        step.swap_bytes += nbytes
        seq.swapped = False
        self._start(seq, 1, step, now)
        return True

    def _start(self, seq: Seq, n: int, step: Step, now: float) -> None:
        self.running.append(seq)
        if math.isnan(seq.admitted_s):
            seq.admitted_s = now
        step.work.append((seq, n))

    def run(self, seq: Seq, n: int, step: Step, now: float) -> bool:
        """Schedule a running sequence's next `n` tokens, preempting from the back of the
        running list (the rules' choice) until they fit; False if `seq` itself went."""
        tokens = self._held_after(seq, n)
        for sid in seq.ids:
            while not self.allocator.grow(sid, tokens):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:   # alone and still stuck: it never fits
                    self.running.pop()
                    self.reject(seq, now, "cannot grow to its final length even alone in the KV pool", step)
                    return False
                self.preempt(victim, step)
                if victim is seq:
                    return False
        step.work.append((seq, n))
        return True

    def reject(self, seq: Seq, now: float, reason: str, step: Step) -> None:
        for sid in seq.ids:
            if self.allocator.tokens_of(sid) is not None:
                self.allocator.free(sid)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.outcome, seq.finish_s = "rejected", now
        seq.reason = reason + (f" with its {self.width} sequences" if self.width > 1 else "")
        step.rejected.append(seq)

    def abort(self, index: int, end_s: float) -> Seq | None:
        """The client of the index-th arrival gave up at end_s: take it out of the queue
        that holds it, free its KV (or its swap space) and mark it timed out. None where
        it is not here (it ended, or another replica serves it)."""
        seq = next((s for s in self.running if arrival_index(s) == index), None)
        if seq is not None:
            self.running.remove(seq)
            for sid in seq.ids:
                self.allocator.free(sid)
        else:
            seq = next((s for s in self.swapped if arrival_index(s) == index), None)
            if seq is not None:
                self.swapped.remove(seq)
            else:
                seq = self.waiting.take(index, arrival_index)
                if seq is None:
                    return None
            if seq.swapped:
                self.swap_used -= self._swap_bytes(seq)
        seq.outcome, seq.finish_s = "timed out", end_s
        return seq

    def preempt(self, seq: Seq, step: Step, mode: str | None = None) -> None:
        """Take `seq` out of the running list: swap its KV to CPU memory (while swap space
        lasts) or drop it to be recomputed later, by prompt + generated tokens in one
        prefill (a group by its prompt: its samples or beams are not kept)."""
        self.running.remove(seq)
        for sid in seq.ids:
            self.allocator.free(sid)
        mode = mode or self.rules.preemption_mode(self, seq)
        nbytes = self._swap_bytes(seq) if self.swap else math.inf
        if mode == "swap" and not seq.prefilling and nbytes <= self.swap.capacity_bytes - self.swap_used:
            self.swap_used += nbytes
            step.swap_bytes += nbytes
            seq.swapped = True
            self.swaps += 1
            self.rules.requeue(self, seq)
        else:
            if self.width > 1:
                seq.generated = 0
            seq.target, seq.prefilled, seq.held = seq.shape.prompt_tokens + seq.generated, 0, 0
            self.rules.requeue(self, seq)
        if not math.isnan(seq.first_token_s) and math.isnan(seq.stall_from):
            seq.stall_from = self.now_planned      # it decoded in the step that just ended
        seq.preemptions += 1
        self.preemptions += 1
        step.preempted += 1

    def _swap_bytes(self, seq: Seq) -> float:
        """KV copied over PCIe: a group's shared prompt once, each sequence's own tokens."""
        own = seq.held - seq.shape.prompt_tokens
        return (seq.shape.prompt_tokens + own * self.width) * self.swap.bytes_per_token if self.width > 1 \
            else seq.held * self.swap.bytes_per_token

    def _held_after(self, seq: Seq, n: int) -> int:
        """KV tokens after computing n more: a finished prefill also yields a token (whose
        slot comes now where the rules say so, else with the next decode)."""
        if not seq.prefilling:
            return seq.held + 1
        done = seq.prefilled + n
        return done + self.ahead if done == seq.target else done

    # --- what the fast path (kvsim.sim.lazy) does without visiting every request; here plainly
    def run_running(self, step: Step, now: float, budget, loop):
        """The running requests' part of a step: `loop(budget)` is the engine's pass over
        them, which returns the budget left (None: no budget)."""
        return loop(budget)

    def prefilling_running(self) -> list[Seq]:
        """Running requests still being prefilled, in running order."""
        return [q for q in self.running if q.prefilling]

    def decode_slots_needed(self) -> int:
        """Free slots one more token for every decoding request would take."""
        return sum(self.allocator.slots_to_grow(k, q.held + 1)
                   for q in self.running if not q.prefilling for k in q.ids)

    def free_slots(self) -> int:
        """Free slots in the pool (with a radix cache, evictable ones too)."""
        unusable, free, _ = self._pool_free(None)
        return free + unusable

    # --- one step ------------------------------------------------------------------------
    def quiet_tick(self, now: float) -> Step | None:
        """A step planned without the rules where nothing can happen but decoding (kvsim.sim.lazy)."""
        return None

    def visible(self, seq: Seq) -> bool:
        """Whether a waiting request has reached the scheduler planning this step. With
        asynchronous scheduling (vLLM 0.33.0's default, vllm/config/vllm.py; a queue of two
        batches, vllm/v1/engine/core.py `EngineCore.step_with_batch_queue`), the engine
        plans step k+1 as soon as step k is launched, so a request that arrives while step
        k runs can join step k+2 at the earliest: the plan made when step k ends sees the
        arrivals up to the moment step k started. An idle engine (nothing running) plans
        as soon as a request comes."""
        return seq.ids[0] // MAX_WIDTH <= self.cutoff

    def planning(self, now: float) -> None:
        """Note that a step is planned now (see `visible`)."""
        lag = self.async_scheduling and self.running
        self.cutoff = self.planned_latest if lag else self.latest
        self.planned_latest = self.latest

    def schedule(self, now: float) -> Step:
        self.now_planned = now
        self.planning(now)
        step = self.rules.schedule(self, now)
        if not self.waiting and not self.swapped:
            step.limit, step.head_need = "arrivals", None
        elif step.preempted:
            step.limit = "preemption"
        elif not step.limit:
            raise RuntimeError(f"{self.rules.name} left requests waiting without saying why "
                               f"at t={now:.6f}s; this is a kvsim bug")
        if step.head_need is None and self.waiting:
            head = self.waiting[0]
            step.head_need = (head.shape, self.prefill_need(head, self.budget)[2], self.keep_free)
        window = self.window or math.inf
        width = self.width
        step.cost = StepBatch.build(
            [(n, min(s.prefilled, window)) for s, n in step.work if s.prefilling],
            [min(s.held + 1, window) for s, n in step.work if not s.prefilling for _ in range(width)])
        for seq, n in step.work:
            seq.held = self._held_after(seq, n)
        return step

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        """The pool now, as the allocator splits it."""
        return self.allocator.breakdown(next_seq)

    def recorded_parts(self, next_seq: NextSeq | None) -> tuple[int, ...]:
        """What a step records of the breakdown: token, reservation, internal, external,
        free, allocated and shared slots."""
        b = self.breakdown(next_seq)
        return b.token, b.reservation, b.internal, b.external, b.free, b.allocated, b.shared

    def complete(self, step: Step, now: float) -> list[Seq]:
        """Apply a finished step at time `now`; returns the sequences that finished."""
        finished = []
        for seq, n in step.work:
            if seq.prefilling:
                seq.prefilled += n
                for sid in seq.ids:      # a cache that shares computed prompts may take them now
                    self.allocator.cache_prefilled(sid, seq.prefilled)
                if seq.prefilling:
                    continue
            seq.generated += 1
            if math.isnan(seq.first_token_s):
                seq.first_token_s = now
            elif not math.isnan(seq.stall_from):      # its first token after a preemption
                seq.stalls += ((seq.stall_from, now),)
                seq.stall_from = math.nan
            if seq.generated == seq.shape.output_tokens:
                seq.outcome, seq.finish_s = "completed", now
                for sid in seq.ids:
                    self.allocator.free(sid)
                finished.append(seq)
            elif self.beam:
                self._branch(seq)
        for seq in finished:
            self.running.remove(seq)
        return finished

    def _branch(self, seq: Seq) -> None:
        """Prune beams and fork kept ones in their place (see the module docstring)."""
        rng = np.random.default_rng((self.seed, seq.spec.id, seq.generated))
        ids = seq.ids
        replaced = [k for k in range(1, self.width) if rng.random() < BEAM_REPLACE]
        kept = [k for k in range(self.width) if k not in replaced]
        for k in replaced:
            self.allocator.free(ids[k])
            if not self.allocator.fork(ids[int(rng.choice(kept))], ids[k]):
                raise InvariantError(f"request {seq.spec.id}: a beam's copy did not fit where "
                                     "the pruned beam was")

    def check(self) -> None:
        """Raise InvariantError where the scheduler and the allocator disagree."""
        self.allocator.check_invariants()
        running = {id(s) for s in self.running}
        swapped = 0.0
        for seq in [*self.waiting, *self.swapped]:
            if id(seq) in running:
                raise InvariantError(f"request {seq.spec.id} is both running and waiting")
            swapped += self._swap_bytes(seq) if seq.swapped else 0
            if any(self.allocator.tokens_of(sid) is not None for sid in seq.ids):
                raise InvariantError(f"waiting request {seq.spec.id} still holds KV")
        for seq in self.running:
            for sid in seq.ids:
                held = self.allocator.tokens_of(sid)
                if held != seq.held:
                    raise InvariantError(f"request {seq.spec.id} (sequence {sid}) should hold "
                                         f"{seq.held} tokens of KV; the allocator has {held}")
            if seq.held > seq.shape.final_tokens:
                raise InvariantError(f"request {seq.spec.id} holds {seq.held} tokens, more than "
                                     f"its final length {seq.shape.final_tokens}")
        if self.swap and not math.isclose(swapped, self.swap_used, abs_tol=1e-6):
            raise InvariantError(f"swap space counts {self.swap_used} bytes; swapped-out "
                                 f"requests hold {swapped}")
        head = self.waiting[0] if self.waiting else None
        b = self.allocator.breakdown(None if head is None else (head.shape, head.target + 1, self.keep_free))
        parts = (b.token, b.reservation, b.internal, b.padding, b.unusable, b.free)
        if min(parts) < 0 or b.capacity != self.allocator.capacity:
            raise InvariantError(f"breakdown {parts} does not split the pool of {self.allocator.capacity}")
        held = sum(s.held for s in self.running) * self.width   # sharing and windows make b.token less
        if b.token > held:
            raise InvariantError(f"the pool counts {b.token} token slots; running requests hold "
                                 f"only {held}")


def arrival_index(seq: Seq) -> int:
    """The place of a sequence among the run's arrivals (its first allocator id / MAX_WIDTH)."""
    return seq.ids[0] // MAX_WIDTH


def sample_shape(r: RequestSpec, k: int = 0) -> SeqShape:
    """Sample k of a request run as a request of its own: the prompt's own part is a
    shared segment, its output content of its own. That content is a negative id no
    workload hands out (-1 is "never shared"): another sample never matches it, but the
    sample itself does when it is recomputed after a preemption, as vLLM's prefix cache
    hashes a request's own output blocks and finds them again."""
    return SeqShape(r.prompt_tokens, r.output_tokens, r.prompt_runs, -2 - (r.id * MAX_WIDTH + k))


def with_limit(step: Step, limit: str, head: Seq | None = None, tokens: int = 0, keep_free: int = 0) -> Step:
    """Note what stopped the head (the first reason wins) and what it needed."""
    if not step.limit:
        step.limit = limit
        if head is not None:
            step.head_need = (head.shape, tokens, keep_free)
    return step


