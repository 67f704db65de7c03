"""SGLang, as in SGLang 0.5.23 (python/sglang/srt/managers/scheduler.py, schedule_policy.py,
schedule_batch.py, scheduler_components/new_token_ratio_tracker.py, mem_cache/prefill_budget.py,
mem_cache/common.py, environ.py).

A step prefills or decodes (`Scheduler.get_next_batch_to_run`: a new prefill batch, when
one can be formed, runs before the running batch's decode; mixed chunks are off by
default).
- Prefill (`_get_new_batch_prefill_raw`, `PrefillAdder`): the request being prefilled in
  chunks continues first (`add_chunked_req`: its next chunk is what is left of
  chunked_prefill_size, cut further to the memory left if that is positive); then
  waiting requests in the schedule policy's order (`fcfs`, or `lpm`: longest cached
  prefix first, first come first served beyond 128 waiting) while fewer than
  max_running_requests (max_num_seqs) run. The memory test is conservative
  (`add_one_req`, `PrefillBudget.check_prefill`): the request's uncached tokens, its
  remaining output (at most 4,096) and one page must be less than what is free or
  evictable (its own cached prefix locked first, so not evictable), less each running
  request's remaining output (at most 4,096) times the new-token ratio, less what this
  step admitted before it. An admission reserves (`PrefillBudget.reserve`) its uncached
  tokens in whole pages, a page, and its whole max_new_tokens (at most 4,096; none for a
  prompt cut to a chunk). A prompt longer than the chunk left is cut to it, in whole
  pages; without chunked prefill a request whose input reaches what is left of
  max_prefill_tokens (16,384) waits unless it is the step's first.
- The batch-is-full latch (`running_batch.batch_is_full`): set when the memory test
  fails with a request running or admitted, when the memory left after an admission is
  gone, or when max_running_requests are running; while it is set no prefill is tried
  (the chunked request still continues), until a running request finishes or is
  retracted, or none runs.
- Decode (`update_running_batch`): every running request decodes one token. If the
  free and evictable slots cannot hold that (`check_decode_mem`, which first evicts the
  shortfall from the tree), requests are retracted (`retract_decode`): fewest output
  tokens first, longest prompt first among equals, at least one, until the next decode
  of those left fits or one is left; after each, the tree evicts what 20 decode steps of
  those left would need beyond the free slots (`release_req`). A retracted request keeps
  in the tree only what it had put there after its prefill (its prompt): its generated
  tokens are freed, not cached (`release_kv_cache(..., checkpoint=False)`), so it
  recomputes at least them on readmission; it goes to the back of the waiting queue. The
  ratio becomes (tokens decoded + 20 x requests left) / (their max_new_tokens + 1), at
  most 1 (`estimate_new_token_ratio_after_retract`). Otherwise it decays by
  (0.7 - 0.098) / 600 per decode step, from 0.7 to 0.098 (environ.py), and it returns to
  0.7 whenever the server goes idle (`on_idle`: nothing running or waiting). With
  pages of more than one token the decode's allocation then evicts until a page per
  request is free (`alloc_paged_token_slots_decode`, mem_cache/allocation.py), though
  only the pages it opens are taken.
kvsim takes a request's max_new_tokens to be its true output length. Where the clients
send ignore_eos (the workload's ignore_eos), a running request's remaining output is
reserved whole instead of the ratio's share, and without the radix cache a waiting one
takes SGLang's fixed-length test instead (kvsim.engines.sglang_eos). Parallel samples are
separate requests.
"""

from __future__ import annotations

import math

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit
from kvsim.engines.sglang_eos import insert_state, outlast, state_of
from kvsim.kvcache.radix import RadixCacheAllocator

CLIP_MAX_NEW_TOKENS = 4096
MAX_PREFILL_TOKENS = 16384
INIT_RATIO, MIN_RATIO_FACTOR, DECAY_STEPS = 0.7, 0.14, 600
RETRACT_DECODE_STEPS = 20
LPM_MAX_QUEUE = 128


class SGLang(EngineRules):
    name = "sglang"
    split_samples = True
    # A token's KV slot comes with the step that feeds it in (prepare_for_extend allocates
    # the prompt, prepare_for_decode one slot per request): the last one sampled has none.
    sampled_slot_ahead = False

    def __init__(self) -> None:
        self.ratio = INIT_RATIO
        self.min_ratio = INIT_RATIO * MIN_RATIO_FACTOR
        self.decay = (INIT_RATIO - self.min_ratio) / DECAY_STEPS
        self.full = ""  # the batch-is-full latch: "" or what set it (a limit's name)
        self._running = 0  # requests running when the last step was planned

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        return "retract"  # recompute, the generated tokens not cached

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        s.waiting.append(req)

    def on_idle(self) -> None:
        """Nothing runs or waits: the new-token ratio starts over."""
        self.ratio = INIT_RATIO

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        if len(s.running) < self._running or not s.running:  # one finished, or none runs
            self.full = ""
        step = Step()
        self._prefill(s, step, now)
        if not step.work and not step.rejected:
            self._decode(s, step, now)
        self._running = len(s.running)
        return step

    def _page(self, s: SchedulerOps) -> int:
        return s.allocator.page_size

    def _pages(self, s: SchedulerOps, tokens: int) -> int:
        page = self._page(s)
        return -(-tokens // page) * page

    def _prefill(self, s: SchedulerOps, step: Step, now: float) -> None:
        page = self._page(s)
        ratio = 1.0 if s.ignore_eos else self.ratio  # a fixed-length output is reserved whole
        budget = _Budget(
            s.free_slots(),
            sum(min(q.shape.output_tokens - q.generated, CLIP_MAX_NEW_TOKENS) * ratio for q in s.running.decoding()),
            s.budget if s.chunked else None,
        )
        for req in s.running.prefilling():  # the request prefilled in chunks goes on
            left = req.target - req.prefilled
            n = left if budget.chunk is None else min(left, budget.chunk_for_continuation(budget.chunk))
            if s.running.run(req, n, step, now):
                budget.reserve(
                    self._pages(s, n), page, 0 if n < left else min(req.shape.output_tokens, CLIP_MAX_NEW_TOKENS), req
                )
        if not s.waiting:
            return
        if self.full and not s.running.prefilling():
            with_limit(step, self.full, s.waiting[0])
            return
        if len(s.running) >= s.max_num_seqs:
            self.full = "max_num_seqs"
        for head in self._order(s):
            if budget.state() == "other":
                with_limit(step, "token_budget", head)
                break
            if len(s.running) >= s.max_num_seqs:
                self.full = "max_num_seqs"
            if self.full:
                with_limit(step, self.full, head)
                break
            if s.ignore_eos and not isinstance(s.allocator, RadixCacheAllocator):
                if self._add_fixed_length(s, step, head, budget, now) in ("continue", "rejected"):
                    continue
                break
            cached, n, held = s.prefill_need(head, math.inf)
            locked = s.allocator.lockable(head.shape, held)
            total = n + min(head.shape.output_tokens - head.generated, CLIP_MAX_NEW_TOKENS) + page
            if total >= budget.total_left() - locked:
                if not s.running and not budget.admitted:  # SGLang would wait forever
                    s.reject(head, now, "its prompt, output and a page exceed the KV pool", step)
                    continue
                self._memory_full(s, step, head, held, budget.admitted)
                break
            if budget.chunk is None and budget.admitted and self._pages(s, n) >= budget.input_left:
                with_limit(step, "token_budget", head, held)
                break
            max_new = min(head.shape.output_tokens, CLIP_MAX_NEW_TOKENS)
            if budget.chunk is not None and self._pages(s, n) > budget.chunk:
                n = (cached + budget.chunk) // page * page - cached  # the chunk, in whole pages
                if n <= 0:
                    with_limit(step, "token_budget", head, held)
                    break
                cached, n, held = s.need_after(head, cached, n)
                max_new = 0  # a cut prompt reserves only its chunk
            if not s.admit(head, cached, n, held, step, now):
                if not s.running:
                    s.reject(head, now, "does not fit an empty KV pool", step)
                    continue
                self._memory_full(s, step, head, held, budget.admitted)
                break
            budget.available -= locked
            budget.reserve(self._pages(s, n), page, max_new, head)
            if budget.state() == "no_token":  # the verdict for the next candidate
                self.full = "memory"
                with_limit(step, "memory")
                break

    def _add_fixed_length(self, s: SchedulerOps, step: Step, head: Request, budget: _Budget, now: float) -> str:
        """add_one_req_ignore_eos (kvsim.engines.sglang_eos): "continue", "rejected" (it
        can never fit) or what ended the pass."""
        page = self._page(s)
        n = head.target  # nothing cached: the tree is off
        paged = self._pages(s, n) + page
        new = state_of(head)
        if paged <= min(budget.available - budget.current_offset, budget.total_left()):
            if budget.states is None:
                others = [state_of(q) for q in (*s.running.decoding(), *budget.taken)]
                budget.states = sorted((x for x in (new, *others) if x), key=lambda x: x[0])
            elif new:
                insert_state(budget.states, new)
            fits = outlast(budget.states, budget.available - budget.current_offset - paged)
        else:
            fits = False
        if not fits:
            if not s.running and not budget.admitted:  # SGLang would wait forever
                s.reject(head, now, "its prompt and output exceed the KV pool", step)
                return "rejected"
            self._memory_full(s, step, head, 0, budget.admitted)
            return "memory"
        max_new = min(head.shape.output_tokens, CLIP_MAX_NEW_TOKENS)
        if budget.chunk is not None and n > budget.chunk:
            if budget.chunk <= 0:
                with_limit(step, "token_budget", head)
                return "token_budget"
            n, max_new = budget.chunk, 0  # cut to the chunk left, in tokens
        cached, n, held = s.need_after(head, 0, n)
        if not s.admit(head, cached, n, held, step, now):
            if not s.running:
                s.reject(head, now, "does not fit an empty KV pool", step)
                return "rejected"
            self._memory_full(s, step, head, held, budget.admitted)
            return "memory"
        budget.reserve(self._pages(s, n), page, max_new, head)
        if budget.state() == "no_token":  # the verdict for the next candidate, as below
            self.full = "memory"
            with_limit(step, "memory")
            return "memory"
        return "continue"

    def _memory_full(self, s: SchedulerOps, step: Step, head: Request, held: int, admitted: int) -> None:
        """NO_TOKEN: the latch is set where something runs or was admitted."""
        if admitted or s.running:
            self.full = "memory"
        with_limit(step, "memory", head, held)

    def _order(self, s: SchedulerOps) -> list[Request]:
        if s.schedule_policy != "lpm" or len(s.waiting) > LPM_MAX_QUEUE:
            return list(s.waiting)
        hits = {id(q): s.allocator.match_prefix(q.shape, q.target + 1) for q in s.waiting}
        return sorted(s.waiting, key=lambda q: -hits[id(q)])

    def _evict(self, s: SchedulerOps, slots: int) -> None:
        """The tree evicts until `slots` are free, if it can (evict_to_free_tokens)."""
        s.allocator.evict_to_free(slots)

    def _decode(self, s: SchedulerOps, step: Step, now: float) -> None:
        need = s.running.slots_to_decode()
        self._evict(s, need)  # check_decode_mem evicts the shortfall
        if need > s.free_slots():
            keep = sorted(s.running.decoding(), key=lambda q: (q.generated, -q.shape.prompt_tokens), reverse=True)
            first = True
            while first or s.running.slots_to_decode() > s.free_slots():
                if len(keep) <= 1:
                    break
                first = False
                s.preempt(keep.pop(), step)
                self._evict(s, RETRACT_DECODE_STEPS * len(keep))
                self._evict(s, s.running.slots_to_decode())
            max_new = sum(q.shape.output_tokens for q in keep)
            decoded = sum(q.generated for q in keep)
            self.ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(keep)) / (max_new + 1))
            self.full = ""
        else:  # memory to spare: the ratio decays
            self.ratio = max(self.ratio - self.decay, self.min_ratio)
        if self._page(s) > 1:  # alloc_paged_token_slots_decode evicts for a page per request
            self._evict(s, self._page(s) * len(s.running.decoding()))
        s.running.decode_all(step, now)


class _Budget:
    """One prefill pass's reservations (PrefillBudget and PrefillAdder's counters): what is
    free or evictable when the pass starts, the offsets the admissions add to it, and
    the pass's input and chunk tokens left."""

    def __init__(self, available: int, running_offset: float, chunk: int | None):
        self.available = available  # free + evictable, less the prefixes locked
        self.total_offset = running_offset  # reserved for outputs, running and admitted
        self.current_offset = 0.0  # reserved for this step's inputs
        self.input_left = MAX_PREFILL_TOKENS
        self.chunk = chunk  # chunked_prefill_size left; None: unchunked
        self.admitted = 0
        self.taken: list[Request] = []  # this pass's admissions (can_run_list)
        self.states: list[tuple[int, int]] | None = None  # ignore_eos's (req_states)

    def total_left(self) -> float:
        return self.available - self.total_offset

    def chunk_for_continuation(self, chunk: int) -> int:
        """The chunked request's next chunk: the chunk left, cut to the memory left
        where that is positive (available_chunk_tokens)."""
        left = min(chunk, int(self.total_left()))
        return left if left > 0 else chunk

    def reserve(self, tokens: int, page: int, max_new: int, req: Request) -> None:
        self.taken.append(req)
        self.total_offset += tokens + page + max_new
        self.current_offset += tokens + page
        self.input_left -= tokens
        if self.chunk is not None:
            self.chunk -= tokens
        self.admitted += 1

    def state(self) -> str:
        """budget_state: "no_token", "other" (the step's input is spent) or "continue"."""
        if self.total_left() <= 0 or self.available - self.current_offset <= 0:
            return "no_token"
        if self.input_left <= 0 or (self.chunk is not None and self.chunk <= 0):
            return "other"
        return "continue"
