"""Continuous batching: which sequences run in the next step, and their memory.

Plain synchronous code; the engine owns the clock and passes `now` in.

Each step, in this order:
1. Running sequences, oldest admission first, get their next tokens: one decode token,
   or (with chunked prefill) the next chunk of their prompt. If the allocator cannot
   grow a sequence, the latest-admitted running sequence is preempted, all or nothing,
   and put back at the front of the waiting queue (vLLM's recompute preemption: its KV
   is dropped and later rebuilt by one prefill over prompt + generated tokens). This
   repeats until the growth fits or the sequence itself was preempted.
   With preemption_mode swap, the victim's KV is copied to CPU memory instead (while
   swap space lasts; then it falls back to recompute) and copied back on re-admission;
   both copies add their PCIe time to the step.
2. Waiting sequences are admitted first-come first-served while memory, max_num_seqs
   and max_num_batched_tokens allow, keeping `watermark` of the pool free (vLLM V0's
   guard against preempting right after admitting). The queue head blocks the rest (no
   skipping). A prefix cache may already hold KV for the start of the prompt: those
   tokens are not prefilled again (and count as prefix hits).

A request may run as a group of `width` sequences: parallel samples (n) or beams
(beam_width). They are forked from the prompt at admission, sharing its KV as far as
the allocator can, decode one token each per step, and are preempted together; a
preempted group restarts from its prompt (recompute; swap is for single sequences).
Beam search branches after every decode step: each beam but the first is, with
probability BEAM_REPLACE, pruned and replaced by a fork of a beam kept this step (a
uniform choice), so beams share their common history by reference. The draws depend
only on the seed, the request and its progress, so every policy sees the same tree.
Groups need whole-prompt prefill (no chunking), so the fork shares all of it.

A sequence holds KV for every token that exists: its prompt (or the part prefilled so
far) and each token generated so far. A request whose prompt + output exceeds
max_model_len, or which could not fit even in an empty pool, is rejected on arrival
with that reason: it would otherwise wait or thrash forever.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvsim.allocators import InvariantError, KVAllocator, SeqShape
from kvsim.cost.model import StepBatch
from kvsim.workload.requests import RequestSpec


MAX_WIDTH = 64        # sequences per request; allocator ids are request id * 64 + k
BEAM_REPLACE = 0.5    # chance that a beam is replaced by a fork of another each step


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
    swapped: bool = False    # KV sits in CPU memory, to be copied back on admission
    ids: tuple[int, ...] = ()   # allocator ids of its sequences (one unless samples or beams)
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
    """What one step computes: (sequence, new tokens) pairs, and the PCIe copies it waits for."""
    work: list[tuple[Seq, int]] = field(default_factory=list)
    cost: StepBatch | None = None
    swap_bytes: float = 0.0
    rejected: list[Seq] = field(default_factory=list)   # found unable to fit even alone


@dataclass(frozen=True)
class SwapSpace:
    """CPU memory for swapped-out KV and the link it is copied over (the scheduler
    owns what is in use: `Scheduler.swap_used`)."""
    capacity_bytes: float
    bytes_per_token: float
    bandwidth_bytes_s: float


class Scheduler:
    def __init__(self, allocator: KVAllocator, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, chunked_prefill: bool, watermark: float = 0.0,
                 swap: SwapSpace | None = None, sliding_window: int | None = None,
                 width: int = 1, beam: bool = False, seed: int = 0):
        if width > 1 and chunked_prefill:
            raise ValueError("parallel sampling and beam search need whole-prompt prefill")
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.keep_free = int(watermark * allocator.capacity)
        self.swap = swap
        self.swap_used = 0.0               # bytes of swapped-out KV in CPU memory
        self.window = sliding_window
        self.width, self.beam, self.seed = width, beam, seed
        self.running: list[Seq] = []       # admission order: the last is preempted first
        self.waiting: deque[Seq] = deque()
        self.preemptions = 0
        self.swaps = 0
        self.prompt_tokens = 0             # tokens to prefill at admissions ...
        self.cached_tokens = 0             # ... and those a prefix cache already held

    # --- arrivals and the waiting queue --------------------------------------------
    def arrive(self, seq: Seq, now: float) -> None:
        seq.target = seq.shape.prompt_tokens
        seq.ids = tuple(seq.spec.id * MAX_WIDTH + k for k in range(self.width))
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
        return head.shape, (head.held if head.swapped else head.target) + 1

    # --- one step ------------------------------------------------------------------
    def schedule(self, now: float) -> Step:
        step, budget = Step(), self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.target - seq.prefilled, budget) if seq.prefilling else 1
            if not seq.prefilling and budget < self.width:
                break
            if self._grow_or_preempt(seq, self._held_after(seq, n), step, now):
                step.work.append((seq, n))
                budget -= n if seq.prefilling else self.width
                i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            n = self._admit(self.waiting[0], budget, step)
            if not n and not self.running:   # an empty pool cannot take it: it never will
                seq = self.waiting.popleft()
                seq.outcome, seq.finish_s = "rejected", now
                seq.reason = "does not fit an empty KV pool" + (
                    f" with its {self.width} sequences" if self.width > 1 else "")
                step.rejected.append(seq)
                continue
            if not n:
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            if math.isnan(seq.admitted_s):
                seq.admitted_s = now
            step.work.append((seq, n))
            budget -= n
        window = self.window or math.inf
        step.cost = StepBatch.build(
            [(n, min(s.prefilled, window)) for s, n in step.work if s.prefilling],
            [min(s.held + 1, window) for s, n in step.work if not s.prefilling for _ in range(self.width)])
        for seq, n in step.work:
            seq.held = self._held_after(seq, n)
        return step

    def _admit(self, seq: Seq, budget: int, step: Step) -> int:
        """Give the queue head memory; returns its new tokens this step, 0 if it must wait."""
        # The watermark guards running requests; with none running it would only block.
        keep_free = self.keep_free if self.running else 0
        if seq.swapped:    # copy its KV back and let it decode at once
            if not self.allocator.allocate(seq.ids[0], seq.shape, seq.held + 1, keep_free):
                return 0
            nbytes = seq.held * self.swap.bytes_per_token
            self.swap_used -= nbytes
            step.swap_bytes += nbytes
            seq.swapped = False
            return 1
        cached = self.allocator.match_prefix(seq.shape, seq.target + 1)
        n = max(seq.target - cached, 1)    # a fully cached prompt still computes its last token
        if self.chunked:
            n = min(n, budget)
        if n > budget:
            return 0
        done = min(cached, seq.target - 1)
        held = done + n + (1 if done + n == seq.target else 0)
        first, *others = seq.ids
        if not self.allocator.allocate(first, seq.shape, held, keep_free):
            return 0
        for k, other in enumerate(others):
            if not self.allocator.fork(first, other):    # a copy that does not fit: wait
                for sid in [first, *others[:k]]:
                    self.allocator.free(sid)
                return 0
        seq.prefilled = done
        self.prompt_tokens += seq.target
        self.cached_tokens += done
        return n

    def _held_after(self, seq: Seq, n: int) -> int:
        """KV tokens after computing n more: a finished prefill also yields a token."""
        if not seq.prefilling:
            return seq.held + 1
        done = seq.prefilled + n
        return done + 1 if done == seq.target else done

    def _grow_or_preempt(self, seq: Seq, tokens: int, step: Step, now: float) -> bool:
        for sid in seq.ids:
            while not self.allocator.grow(sid, tokens):
                victim = self.running.pop()
                if victim is seq and not self.running:   # alone and still stuck: it never fits
                    for k in seq.ids:
                        self.allocator.free(k)
                    seq.outcome, seq.finish_s = "rejected", now
                    seq.reason = "cannot grow to its final length even alone in the KV pool" + (
                        f" with its {self.width} sequences" if self.width > 1 else "")
                    step.rejected.append(seq)
                    return False
                self._preempt(victim, step)
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Seq, step: Step) -> None:
        for sid in seq.ids:
            self.allocator.free(sid)
        nbytes = seq.held * self.swap.bytes_per_token if self.swap else math.inf
        if self.width > 1:   # a group restarts: its samples or beams are not kept
            seq.generated = 0
            nbytes = math.inf
        if self.swap and not seq.prefilling and nbytes <= self.swap.capacity_bytes - self.swap_used:
            self.swap_used += nbytes
            step.swap_bytes += nbytes
            seq.swapped = True
            self.swaps += 1
        else:      # recompute: drop the KV, later prefill prompt + generated tokens again
            seq.target, seq.prefilled, seq.held = seq.shape.prompt_tokens + seq.generated, 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

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
        for seq in self.waiting:
            if id(seq) in running:
                raise InvariantError(f"request {seq.spec.id} is both running and waiting")
            swapped += seq.held * self.swap.bytes_per_token if seq.swapped else 0
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
        b = self.allocator.breakdown(self.next_waiting())
        parts = (b.token, b.reservation, b.internal, b.padding, b.unusable, b.free)
        if min(parts) < 0 or b.capacity != self.allocator.capacity:
            raise InvariantError(f"breakdown {parts} does not split the pool of {self.allocator.capacity}")
        held = sum(s.held for s in self.running) * self.width   # sharing and windows make b.token less
        if b.token > held:
            raise InvariantError(f"the pool counts {b.token} token slots; running requests hold "
                                 f"only {held}")

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
                for sid in seq.ids:
                    self.allocator.free(sid)
                finished.append(seq)
            elif self.beam:
                self._branch(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
        return finished
