"""SGLang, as in SGLang 0.4.10 (python/sglang/srt/managers/scheduler.py, schedule_policy.py,
schedule_batch.py).

A step prefills or decodes (`Scheduler.get_next_batch_to_run`: a new prefill batch, when
one can be formed, runs before the running batch's decode; mixed chunks are off by
default).
- Prefill (`get_new_batch_prefill`, `PrefillAdder`): a request being prefilled in chunks
  continues first; then waiting requests in the schedule policy's order (`fcfs`, or
  `lpm`: longest cached prefix first, first come first served beyond 128 waiting) while
  fewer than max_running_requests (max_num_seqs) run. The adder's memory test is
  conservative: what is free or evictable, less each running request's remaining
  output (at most 4,096 tokens) times the new-token ratio, must exceed the request's
  uncached prompt plus its whole max_new_tokens (at most 4,096), and each admission
  reserves that much again (`add_one_req`, `rem_total_tokens`). A prompt longer than
  what is left of chunked_prefill_size (max_num_batched_tokens here) is cut to it and
  continues in later prefill steps; the batch also stops at max_prefill_tokens (16,384)
  of input.
- Decode (`update_running_batch`): every running request decodes one token. If the
  free and evictable slots cannot hold that (`check_decode_mem`), requests are
  retracted (`retract_decode`): fewest output tokens first, longest prompt first among
  equals, until 20 decode steps of the rest fit (at least one goes); retracted requests
  go to the back of the waiting queue and are recomputed; the ratio becomes (tokens
  decoded + 20 x requests left) / their max_new_tokens, at most 1. Otherwise the ratio
  decays by (0.7 - 0.098) / 600 per decode step, from 0.7 to 0.098 (sglang/global_config.py).
kvsim takes a request's max_new_tokens to be its true output length, as benchmark
clients send it. Parallel samples are separate requests.
"""
from __future__ import annotations

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit

CLIP_MAX_NEW_TOKENS = 4096
MAX_PREFILL_TOKENS = 16384
INIT_RATIO, MIN_RATIO_FACTOR, DECAY_STEPS = 0.7, 0.14, 600
RETRACT_DECODE_STEPS = 20
LPM_MAX_QUEUE = 128


class SGLang(EngineRules):
    name = "sglang"
    split_samples = True

    def __init__(self):
        self.ratio = INIT_RATIO
        self.min_ratio = INIT_RATIO * MIN_RATIO_FACTOR
        self.decay = (INIT_RATIO - self.min_ratio) / DECAY_STEPS

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        return "recompute"

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        s.waiting.append(req)

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        step = Step()
        self._prefill(s, step, now)
        if not step.work and not step.rejected:
            self._decode(s, step, now)
        return step

    def _available(self, s: SchedulerOps) -> int:
        return s.free_slots()            # free and evictable (cached, unreferenced) slots

    def _prefill(self, s: SchedulerOps, step: Step, now: float) -> None:
        chunk_left = s.budget if s.chunked else None
        input_left = MAX_PREFILL_TOKENS
        for req in s.running.prefilling():       # the request prefilled in chunks goes on
            n = req.next_tokens() if chunk_left is None else min(req.next_tokens(), chunk_left)
            if n > 0 and s.running.run(req, n, step, now):
                chunk_left = None if chunk_left is None else chunk_left - n
                input_left -= n
        if not s.waiting:
            return
        decoding = s.running.decoding()
        reserved = sum(min(q.shape.output_tokens - q.generated, CLIP_MAX_NEW_TOKENS) * self.ratio
                       for q in decoding)
        total_left = self._available(s) - reserved
        admitted = 0
        for head in self._order(s):
            if len(s.running) >= s.max_num_seqs:
                with_limit(step, "max_num_seqs", head)
                break
            cached, n, held = s.prefill_need(head, float("inf"))
            max_new = min(head.shape.output_tokens, CLIP_MAX_NEW_TOKENS)
            if n + max_new >= total_left:
                with_limit(step, "memory", head, held)
                break
            if n >= input_left and admitted:
                with_limit(step, "token_budget", head, held)
                break
            if chunk_left is not None and n > chunk_left:
                if chunk_left <= 0:
                    with_limit(step, "token_budget", head, held)
                    break
                cached, n, held = s.prefill_need(head, chunk_left)
                max_new = 0                  # a cut prompt reserves only its chunk
            if not s.admit(head, cached, n, held, step, now):
                if not s.running:
                    s.reject(head, now, "does not fit an empty KV pool", step)
                    continue
                with_limit(step, "memory", head, held)
                break
            admitted += 1
            total_left -= n + max_new
            input_left -= n
            chunk_left = None if chunk_left is None else chunk_left - n
            if total_left <= 0:                  # budget_state: NO_TOKEN, then OTHER
                with_limit(step, "memory")
                break
            if input_left <= 0 or (chunk_left is not None and chunk_left <= 0):
                with_limit(step, "token_budget")
                break

    def _order(self, s: SchedulerOps) -> list[Request]:
        if s.schedule_policy != "lpm" or len(s.waiting) > LPM_MAX_QUEUE:
            return list(s.waiting)
        hits = {id(q): s.allocator.match_prefix(q.shape, q.target + 1) for q in s.waiting}
        return sorted(s.waiting, key=lambda q: -hits[id(q)])

    def _decode(self, s: SchedulerOps, step: Step, now: float) -> None:
        if s.running.slots_to_decode() > self._available(s):
            decoding = s.running.decoding()
            victims = sorted(decoding, key=lambda q: (q.generated, -q.shape.prompt_tokens), reverse=True)
            first = True
            while len(victims) > 1 and (first or self._available(s) < RETRACT_DECODE_STEPS * len(victims)):
                s.preempt(victims.pop(), step)
                first = False
            max_new = sum(q.shape.output_tokens for q in victims)
            decoded = sum(q.generated for q in victims)
            self.ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(victims)) / max_new)
        else:                                    # memory to spare: the ratio decays
            self.ratio = max(self.ratio - self.decay, self.min_ratio)
        s.running.decode_all(step, now)
