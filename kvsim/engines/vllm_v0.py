"""vLLM V0 (the system of the vLLM paper and of the claims `kvsim reproduce` checks), as in vLLM 0.6.3.post1.

Without chunked prefill (`Scheduler._schedule_default`, vllm/core/scheduler.py) a step
either prefills or decodes:
- While nothing is swapped out, waiting requests are prefilled first come first served
  (`_schedule_prefills`): the head is admitted whole if the block manager can allocate
  its prompt keeping the watermark free (`can_allocate`, vllm/core/block_manager.py:
  LATER stops the queue; NEVER, a prompt larger than the pool minus the watermark, is
  rejected), then if the token budget holds its prompt tokens and max_num_seqs its
  sequences (`SchedulingBudget.can_schedule`; running groups count all their sequences).
- A step that prefilled nothing decodes every running group (`_schedule_running`): one
  token each, no token budget; when a group cannot grow, the latest-admitted running
  group is preempted, until it fits or the group itself went. Then, if nothing was
  preempted, swapped-out groups come back first come first served while memory
  (watermark kept) and max_num_seqs allow (`_schedule_swapped`), and decode at once.
- Preemption (`_preempt`): with preemption_mode unset, a single sequence is recomputed
  and a group (samples, beams) swapped; "swap" or "recompute" force one. A recomputed
  request goes to the front of the waiting queue, a swapped one to the back of the
  swapped queue. Where vLLM aborts because CPU swap space is full, kvsim recomputes.
With chunked prefill (`_schedule_chunked_prefill`) one token budget is shared: running
requests first (decodes, then their next chunk), then swapped ones (unless a running one
was preempted), then waiting prompts in chunks, whether or not groups are still
swapped out (only the default scheduler waits for them). Chunked prefill is on by
default where max_model_len exceeds 32K (`EngineArgs.create_engine_config`,
vllm/engine/arg_utils.py), with a budget of 512 tokens (SchedulerConfig, vllm/config.py).
"""

from __future__ import annotations

from typing import overload

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit
from kvsim.kvcache import SeqShape


class VllmV0(EngineRules):
    name = "vllm-v0"
    split_samples = False

    def __init__(self) -> None:
        self._never_memo: tuple[Request | None, int, bool] = (None, 0, False)  # (head, its target, NEVER): see _never

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        if s.preemption_mode is None:
            return "recompute" if s.width == 1 else "swap"
        return s.preemption_mode

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        (s.swapped.append if req.swapped else s.waiting.appendleft)(req)

    def decodes_only(self, s: SchedulerOps) -> bool:
        """A step that prefills nothing decodes every running group (no token budget);
        with chunked prefill, while the budget holds every decode. Only with nothing
        waiting: V0 sees every waiting request."""
        return not s.waiting and (not s.chunked or s.running_seqs() <= s.budget)

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        step = Step()
        if s.chunked:  # waiting prompts are prefilled even while groups are swapped out
            budget: float = s.running.advance(step, now, s.budget)
            if not step.preempted:
                budget = self._swapped(s, step, now, budget)  # a number in, a number out
            self._prefills(s, step, now, budget)
            if s.swapped:  # groups still out, kept there by memory their preemption lacked
                with_limit(step, "preemption")
            return step
        if s.swapped:  # swapped-out groups come back before any prompt is prefilled
            with_limit(step, "preemption")
        else:
            self._prefills(s, step, now, s.budget)
        if step.work:
            return step
        s.running.decode_all(step, now)
        if not step.preempted:
            self._swapped(s, step, now, None)
        return step

    def _prefills(self, s: SchedulerOps, step: Step, now: float, budget: float) -> float:
        seqs = s.running_seqs()
        while s.waiting:
            head = s.waiting[0]
            cached, n, held = s.prefill_need(head, budget)
            reject, why = self._refusal(s, head, n, held, budget, seqs)
            if reject:
                s.reject(head, now, reject, step)
                continue
            if not why:
                if s.admit(head, cached, n, held, step, now, s.keep_free):
                    budget -= n
                    seqs += s.width
                    continue
                if not s.running and not s.swapped:  # nothing will ever free memory for it
                    s.reject(head, now, "does not fit an empty KV pool", step)
                    continue
                why = "memory"  # a copy for a sample or beam did not fit
            with_limit(step, why, head, held, s.keep_free)
            break
        return budget

    def _refusal(self, s: SchedulerOps, head: Request, n: int, held: int, budget: float, seqs: int) -> tuple[str, str]:
        """(why `head` is rejected, why it waits): both "" where it may be admitted, with
        `n` tokens to compute and `held` to hold, `seqs` sequences running. can_allocate
        first, then the budget, as _schedule_prefills asks them."""
        if self._never(s, head):
            return "prompt exceeds the KV pool minus the watermark", ""
        fits = s.fits(head, held, s.keep_free)
        if not fits and not s.running and not s.swapped:  # a reservation never fits
            return "does not fit an empty KV pool" + (" minus the watermark" if s.keep_free else ""), ""
        return "", (
            s.blocked_by(head, held, s.keep_free)
            if not fits
            else "token_budget"
            if n > budget or n == 0
            else "max_num_seqs"
            if seqs + s.width > s.max_num_seqs
            else ""
        )

    def _never(self, s: SchedulerOps, head: Request) -> bool:
        """can_allocate's NEVER: the prompt to prefill (`target` tokens) alone exceeds
        the pool minus the watermark. A head that memory keeps out is asked again every
        step, so the answer for the last head and target asked is kept (footprints
        depend on the shape alone)."""
        asked, target, never = self._never_memo
        if asked is not head or target != head.target:
            prompt = SeqShape(head.target, 0, head.shape.segments, head.shape.tail_id)
            never = s.allocator.footprint(prompt) + s.keep_free > s.allocator.capacity
            self._never_memo = (head, head.target, never)
        return never

    @overload
    def _swapped(self, s: SchedulerOps, step: Step, now: float, budget: float) -> float: ...
    @overload
    def _swapped(self, s: SchedulerOps, step: Step, now: float, budget: None) -> None: ...

    def _swapped(self, s: SchedulerOps, step: Step, now: float, budget: float | None) -> float | None:
        seqs = s.running_seqs()
        while s.swapped:
            req = s.swapped[0]
            if seqs + s.width > s.max_num_seqs or (budget is not None and budget < s.width):
                break
            if not s.swap_in(req, step, now, s.keep_free):
                break
            seqs += s.width
            budget = None if budget is None else budget - s.width
        return budget
