"""Continuous batching: which sequences run in the next step, and their memory.

Plain synchronous code; the engine owns the clock and passes `now` in.

Each step, in this order:
1. Running sequences, oldest admission first, get their next tokens: one decode token,
   or (with chunked prefill) the next chunk of their prompt. If the allocator cannot
   grow a sequence, the latest-admitted running sequence is preempted, all or nothing,
   and put back at the front of the waiting queue (vLLM's recompute preemption: its KV
   is dropped and later rebuilt by one prefill over prompt + generated tokens). This
   repeats until the growth fits or the sequence itself was preempted.
2. Waiting sequences are admitted first-come first-served while memory, max_num_seqs
   and max_num_batched_tokens allow. The queue head blocks the rest (no skipping).

A sequence holds KV for every token that exists: its prompt (or the part prefilled so
far) and each token generated so far. A request whose prompt + output exceeds
max_model_len, or which could not fit even in an empty pool, is rejected on arrival
with that reason: it would otherwise wait or thrash forever.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .allocators import InvariantError, KVAllocator, SeqShape
from .costmodel import StepBatch
from .workload import RequestSpec


@dataclass(eq=False)
class Seq:
    """The mutable life of one request in one policy's run."""
    spec: RequestSpec
    shape: SeqShape
    target: int = 0          # tokens to prefill on (re)admission: prompt + generated
    prefilled: int = 0       # tokens of `target` already computed
    generated: int = 0
    held: int = 0            # tokens whose KV the allocator holds for it
    preemptions: int = 0
    admitted_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    outcome: str = ""        # "", "completed" or "rejected"
    reason: str = ""

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.target


@dataclass
class Step:
    """What one step computes: (sequence, new tokens) pairs, prefill chunks first."""
    work: list[tuple[Seq, int]] = field(default_factory=list)
    cost: StepBatch | None = None


class Scheduler:
    def __init__(self, allocator: KVAllocator, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, chunked_prefill: bool):
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.running: list[Seq] = []       # admission order: the last is preempted first
        self.waiting: deque[Seq] = deque()
        self.preemptions = 0

    # --- arrivals and the waiting queue --------------------------------------------
    def arrive(self, seq: Seq, now: float) -> None:
        seq.target = seq.shape.prompt_tokens
        reason = ("prompt + output exceeds max_model_len"
                  if seq.shape.final_tokens > self.max_model_len
                  else self.allocator.unfit_reason(seq.shape))
        if reason:
            seq.outcome, seq.reason, seq.finish_s = "rejected", reason, now
        else:
            self.waiting.append(seq)

    def next_waiting(self) -> tuple[SeqShape, int] | None:
        """The queue head and the tokens it needs to be admitted whole."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        return head.shape, head.target + 1

    # --- one step ------------------------------------------------------------------
    def schedule(self, now: float) -> Step:
        step, budget = Step(), self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.target - seq.prefilled, budget) if seq.prefilling else 1
            if self._grow_or_preempt(seq, self._held_after(seq, n)):
                step.work.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(seq.target, budget) if self.chunked else seq.target
            if n > budget or not self.allocator.allocate(seq.spec.id, seq.shape, self._held_after(seq, n)):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if math.isnan(seq.admitted_s):
                seq.admitted_s = now
            step.work.append((seq, n))
            budget -= n
        step.cost = StepBatch.build(
            [(n, s.prefilled) for s, n in step.work if s.prefilling],
            [s.held + 1 for s, n in step.work if not s.prefilling])
        for seq, n in step.work:
            seq.held = self._held_after(seq, n)
        return step

    def _held_after(self, seq: Seq, n: int) -> int:
        """KV tokens after computing n more: a finished prefill also yields a token."""
        if not seq.prefilling:
            return seq.held + 1
        done = seq.prefilled + n
        return done + 1 if done == seq.target else done

    def _grow_or_preempt(self, seq: Seq, tokens: int) -> bool:
        while not self.allocator.grow(seq.spec.id, tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq) -> None:
        self.allocator.free(seq.spec.id)
        seq.target, seq.prefilled, seq.held = seq.shape.prompt_tokens + seq.generated, 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def check(self) -> None:
        """Raise InvariantError where the scheduler and the allocator disagree."""
        self.allocator.check_invariants()
        running = {id(s) for s in self.running}
        for seq in self.waiting:
            if id(seq) in running:
                raise InvariantError(f"request {seq.spec.id} is both running and waiting")
            if self.allocator.tokens_of(seq.spec.id) is not None:
                raise InvariantError(f"waiting request {seq.spec.id} still holds KV")
        for seq in self.running:
            held = self.allocator.tokens_of(seq.spec.id)
            if held != seq.held:
                raise InvariantError(f"request {seq.spec.id} should hold {seq.held} tokens of KV; "
                                     f"the allocator has {held}")
            if seq.held > seq.shape.final_tokens:
                raise InvariantError(f"request {seq.spec.id} holds {seq.held} tokens, more than "
                                     f"its final length {seq.shape.final_tokens}")
        b = self.allocator.breakdown(self.next_waiting())
        parts = (b.token, b.reservation, b.internal, b.padding, b.unusable, b.free)
        if min(parts) < 0 or b.capacity != self.allocator.capacity:
            raise InvariantError(f"breakdown {parts} does not split the pool of {self.allocator.capacity}")
        if b.token != sum(s.held for s in self.running):
            raise InvariantError(f"the pool counts {b.token} token slots; running requests hold "
                                 f"{sum(s.held for s in self.running)}")

    def complete(self, step: Step, now: float) -> list[Seq]:
        """Apply a finished step at time `now`; returns the sequences that finished."""
        finished = []
        for seq, n in step.work:
            if seq.prefilling:
                seq.prefilled += n
                if seq.prefilling:
                    continue
            seq.generated += 1
            if math.isnan(seq.first_token_s):
                seq.first_token_s = now
            if seq.generated == seq.shape.output_tokens:
                seq.outcome, seq.finish_s = "completed", now
                self.allocator.free(seq.spec.id)
                finished.append(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
        return finished
