"""vLLM V1, as in vLLM 0.10.1.1 (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`).

One token budget (max_num_batched_tokens) per step, no prefill or decode phases:
- Running requests first, in order: each gets its remaining tokens (a decode: one; a
  prefill: the rest of its prompt) cut to the budget left, and stops the pass when the
  budget is spent. When the KV cache manager cannot allocate its slots
  (`allocate_slots` returns None), the last running request is preempted, recomputed
  later from scratch (`num_computed_tokens = 0`, put at the front of the waiting queue),
  until it fits or the request itself went.
- Then, only if this step preempted nobody, waiting requests first come first served
  while the budget lasts and fewer than max_num_seqs run: the prefix cache's hits
  (`get_computed_blocks`, at most all tokens but the last) are reused, the rest is
  chunked to the budget left; a request that cannot be allocated stops the queue. With
  chunked prefill disabled, a prompt larger than the budget left is skipped for this
  step (the queue goes on behind it).
There is no watermark and no swap. Parallel samples are separate requests (the engine
fans a request with n > 1 out into n), whose prompts meet in the prefix cache.
"""
from __future__ import annotations

from kvsim.sim.scheduler import Scheduler, Seq, Step, with_limit


class VllmV1:
    name = "vllm-v1"
    split_samples = True

    def preemption_mode(self, s: Scheduler, seq: Seq) -> str:
        return "recompute"

    def requeue(self, s: Scheduler, seq: Seq) -> None:
        s.waiting.appendleft(seq)

    def lazy_ok(self, s: Scheduler) -> bool:
        """Decoding requests matter to a step only through the running pass."""
        return True

    def decode_only(self, s: Scheduler) -> None:
        """A step that only decodes every running request changes nothing else here."""

    def head_waits(self, s: Scheduler) -> None:
        """Quiet ticks with requests waiting (kvsim.sim.lazy): none here. A step runs the running
        requests first, on the token budget the waiting ones share."""
        return None

    def schedule(self, s: Scheduler, now: float) -> Step:
        step = Step()
        budget = s.run_running(step, now, s.budget, lambda b: self._running(s, step, now, b))
        if step.preempted:
            return step
        skipped = []
        while s.waiting and budget > 0:
            if len(s.running) >= s.max_num_seqs:
                with_limit(step, "max_num_seqs")
                break
            head = s.waiting[0]
            cached, n, held = s.prefill_need(head, budget)
            if not s.chunked and n > budget:
                skipped.append(s.waiting.popleft())
                with_limit(step, "token_budget", head, held)
                continue
            if not s.admit(head, cached, n, held, step, now):
                if not s.running:      # nothing will ever free memory for it
                    s.reject(head, now, "does not fit an empty KV pool", step)
                    continue
                with_limit(step, "memory", head, held)
                break
            budget -= n
        s.waiting.extendleft(reversed(skipped))
        if s.waiting and budget <= 0:
            with_limit(step, "token_budget")
        return step

    def _running(self, s: Scheduler, step: Step, now: float, budget: int) -> int:
        i = 0
        while i < len(s.running) and budget > 0:
            seq = s.running[i]
            n = min(seq.target - seq.prefilled, budget) if seq.prefilling else 1
            if not s.run(seq, n, step, now):
                break
            budget -= n
            i += 1
        return budget
