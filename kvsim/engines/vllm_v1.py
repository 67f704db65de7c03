"""vLLM V1, as in vLLM 0.33.0 (vllm/v1/core/sched/scheduler.py `Scheduler.schedule`,
vllm/v1/core/kv_cache_manager.py `get_computed_blocks` and `allocate_slots`).

One token budget (max_num_batched_tokens) per step, no prefill or decode phases:
- Running requests first, in order: each gets its remaining tokens (a decode: one; a
  prefill: the rest of its prompt) cut to the budget left, and stops the pass when the
  budget is spent. When the KV cache manager cannot allocate its slots
  (`allocate_slots` returns None), the last running request is preempted, recomputed
  later from scratch (`_preempt_request`: `num_computed_tokens = 0`, put at the front
  of the waiting queue), until it fits or the request itself went.
- Then, only if this step preempted nobody, waiting requests first come first served
  while the budget lasts and fewer than max_num_seqs run. A request's cache hits
  (`get_computed_blocks`) are whole blocks of at most all its tokens but the last
  (max_cache_hit_length = num_tokens - 1): a prompt whose every block is cached still
  recomputes its last block, into a block of its own. The rest is chunked to the budget
  left. It is admitted only if its whole prompt (prompt and output so far, for one
  resumed after preemption) fits in the free blocks now, its hits counted
  (`scheduler_reserve_full_isl`, on by default: `allocate_slots(...,
  full_sequence_must_fit=True)`), though only this step's chunk is allocated; a request
  that does not fit stops the queue. With chunked prefill disabled, a prompt larger
  than the budget left also stops the queue (`break`; vLLM 0.10 skipped it and went on).
- Slots: `allocate_slots` covers the tokens computed in the step, so a sampled token
  takes its slot in the step that feeds it back (`sampled_slot_ahead` False), and a
  block is cached as soon as the tokens that fill it are scheduled.
There is no swap, and the watermark (SchedulerConfig.watermark) is 0 by default.
Parallel samples are separate requests (the engine fans a request with n > 1 out into
n), whose prompts meet in the prefix cache.
With asynchronous scheduling (vLLM 0.33.0's default; `--no-async-scheduling` turns it
off) a waiting request is admitted only once the scheduler has seen it: one step
after the one it arrived during (kvsim.sim.scheduler.Scheduler.visible).
"""

from __future__ import annotations

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit


class VllmV1(EngineRules):
    name = "vllm-v1"
    split_samples = True
    sampled_slot_ahead = False

    def cached_tokens(self, s: SchedulerOps, req: Request) -> int:
        """Tokens of `req` a prefix cache serves: whole blocks of at most target - 1 tokens."""
        return s.allocator.match_prefix(req.shape, req.target)

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        return "recompute"

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        s.waiting.appendleft(req)

    def decodes_only(self, s: SchedulerOps) -> bool:
        """The running pass gives every decode its token while the budget holds them all;
        then a waiting head that the step cannot see yet (asynchronous scheduling) stops
        the queue with the limit "arrivals", where budget is left and fewer than
        max_num_seqs run (else those limits come first)."""
        running = len(s.running)
        if not s.waiting:
            return running <= s.budget
        return running < s.budget and running < s.max_num_seqs and not s.visible_next(s.waiting[0])

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        step = Step()
        budget = s.running.advance(step, now, s.budget)
        if step.preempted:
            return step
        while s.waiting and budget > 0:
            if len(s.running) >= s.max_num_seqs:
                with_limit(step, "max_num_seqs")
                break
            head = s.waiting[0]
            if not s.visible(head):  # arrived after this step was planned (async scheduling)
                with_limit(step, "arrivals")
                break
            cached, n, held = s.prefill_need(head, budget)
            if not s.chunked and n > budget:
                with_limit(step, "token_budget", head, held)
                break
            if not s.fits(head, head.target, 0) or not s.admit(head, cached, n, held, step, now):
                if not s.running:  # nothing will ever free memory for it
                    s.reject(head, now, "does not fit an empty KV pool", step)
                    continue
                with_limit(step, "memory", head, head.target)
                break
            budget -= n
        if s.waiting and budget <= 0:
            with_limit(step, "token_budget")
        return step
