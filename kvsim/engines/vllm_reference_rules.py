"""`engine: vllm-reference`: vLLM 0.33.0's own V1 scheduler deciding kvsim's steps.

vLLM's `Scheduler` and `KVCacheManager` (kvsim.engines.vllm_reference) decide what each
step runs, which requests are admitted with how many tokens found in vLLM's prefix
cache, whom to preempt, which blocks are cached and evicted; kvsim supplies the
requests (their token ids from kvsim's token identity, so shared prefixes meet in vLLM's
cache as they do in kvsim's), the clock, each step's time from its cost model, and one
sampled token per request that samples (`ModelRunnerOutput`).

kvsim's scheduler then carries out vLLM's decisions in vLLM's order, so that kvsim's own
paged allocator (which the step records' memory breakdown reads) holds what vLLM's block
pool holds: the running requests in running order, each grown by the tokens vLLM gave
it (a request vLLM preempted to make room is preempted the same way, from the back of
the running list, as vLLM's `Scheduler.schedule` does), then the waiting ones vLLM
admitted, in waiting order, with vLLM's count of cached tokens. Where kvsim's allocator
could not follow (it would preempt a request vLLM kept, or find another number of
cached tokens), the run stops with an error naming the step: that is a disagreement
between kvsim's and vLLM's KV caches, which the differential test
(kvsim.sim.differential) exists to find.

vLLM sees a request when it reaches kvsim's waiting queue near the head: it is kept
topped up to max_num_seqs + 1 waiting requests in kvsim's order, more than one step can
admit, so vLLM's first-come-first-served queue is kvsim's. A request whose client gave
up (request_timeout_s) is aborted in vLLM too (`finish_requests`, FINISHED_ABORTED).
Scheduling is synchronous (vLLM's `async_scheduling` off), as the differential test
steps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit

if TYPE_CHECKING:
    from kvsim.engines.vllm_reference import VllmReference


class VllmReferenceRules(EngineRules):
    name = "vllm-reference"
    split_samples = True
    sampled_slot_ahead = False  # vLLM allocates a sampled token's slot when it is fed back

    def __init__(self) -> None:
        self.ref: VllmReference | None = None  # made at the first step, from the scheduler's settings
        self._requests: dict[int, Request] = {}  # requests vLLM holds, by key (first id)

    def _start(self, s: SchedulerOps) -> VllmReference:
        from kvsim.engines.vllm_reference import VllmReference
        from kvsim.kvcache import (
            HybridPagedAllocator,
            HybridPrefixCache,
            PagedAllocator,
            PrefixCachingPagedAllocator,
            SlidingWindowPagedAllocator,
            SlidingWindowPrefixCache,
        )

        alloc, window = s.allocator, getattr(s, "window", None)
        if isinstance(alloc, HybridPagedAllocator):  # a hybrid model's KV cache groups
            self.ref = VllmReference(
                num_blocks=alloc.num_blocks + 1,
                block_size=alloc.block_size,
                max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.budget,
                enable_chunked_prefill=s.chunked,
                max_model_len=s.max_model_len,
                enable_prefix_caching=isinstance(alloc, HybridPrefixCache),
                groups=alloc.windows,
            )
            return self.ref
        if not isinstance(alloc, PagedAllocator) or (
            window is not None and not isinstance(alloc, (SlidingWindowPagedAllocator, SlidingWindowPrefixCache))
        ):
            raise ValueError(
                "vllm-reference runs vLLM's block pool with one KV group: a paged allocator, "
                "with vLLM V1's sliding-window rules where the model has a window"
            )
        self.ref = VllmReference(
            num_blocks=alloc.num_blocks + 1,
            block_size=alloc.block_size,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.budget,
            enable_chunked_prefill=s.chunked,
            max_model_len=s.max_model_len,
            enable_prefix_caching=isinstance(alloc, PrefixCachingPagedAllocator),
            sliding_window=window,
        )
        return self.ref

    def cached_tokens(self, s: SchedulerOps, req: Request) -> int:
        """As vllm-v1 counts them (whole blocks of at most target - 1 tokens)."""
        return s.allocator.match_prefix(req.shape, req.target)

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        return "recompute"

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        s.waiting.appendleft(req)  # vLLM prepends a preempted request to its waiting queue

    def _sync_queue(self, s: SchedulerOps, ref: VllmReference) -> None:
        """Abort in vLLM what kvsim aborted; give vLLM kvsim's next waiting requests."""
        live = {r.ids[0] for r in s.running}
        gone = [k for k, r in self._requests.items() if k not in live and r.outcome]
        if gone:
            from vllm.v1.request import RequestStatus

            ref.scheduler.finish_requests(
                [str(k) for k in gone if str(k) in ref.scheduler.requests], RequestStatus.FINISHED_ABORTED
            )
            for k in gone:
                del self._requests[k]
        want = min(len(s.waiting), s.max_num_seqs + 1)
        i = len(ref.scheduler.waiting)
        while i < want:
            req = s.waiting[i]
            ref.add(req.ids[0], req.shape)
            self._requests[req.ids[0]] = req
            i += 1

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        ref = self.ref or self._start(s)
        self._sync_queue(s, ref)
        trace = ref.step()
        step = Step()
        preempted = set(trace.preempted)
        for req in list(s.running):
            n = trace.scheduled.get(req.ids[0])
            if n is None or req not in s.running:
                continue
            if not s.running.run(req, n, step, now):
                self._disagree(now, f"kvsim preempted request {req.spec.id} itself, vLLM ran it")
        for k in preempted:  # a request vLLM preempted while growing itself (the last)
            if self._requests[k] in s.running:
                s.preempt(self._requests[k], step)
        if step.preempted != len(preempted):
            self._disagree(now, f"vLLM preempted {sorted(preempted)}, kvsim {step.preempted} requests")
        admitted = dict(trace.admitted)
        for req in [r for r in s.waiting if r.ids[0] in admitted] if admitted else ():
            cached, n, held = s.need_after(req, admitted[req.ids[0]], trace.scheduled[req.ids[0]])
            ours = s.allocator.match_prefix(req.shape, req.target)
            if ours != cached or not s.admit(req, cached, n, held, step, now):
                self._disagree(
                    now, f"request {req.spec.id}: vLLM admits it with {cached} tokens cached, kvsim finds {ours}"
                )
        for k in trace.finished:
            self._requests.pop(k, None)
        if s.waiting and not step.preempted:
            self._limit(s, step, s.budget - sum(trace.scheduled.values()))
        return step

    def _limit(self, s: SchedulerOps, step: Step, left: int) -> None:
        """What kept the waiting head out, named as vllm-v1's rules name it (the first of:
        the budget spent, max_num_seqs, an unchunked prompt over the budget left, memory)."""
        if left <= 0:
            with_limit(step, "token_budget")
        elif len(s.running) >= s.max_num_seqs:
            with_limit(step, "max_num_seqs")
        else:
            head = s.waiting[0]
            _, n, held = s.prefill_need(head, left)
            if not s.chunked and n > left:
                with_limit(step, "token_budget", head, held)
            else:
                with_limit(step, "memory", head, head.target)

    def _disagree(self, now: float, what: str) -> None:
        raise RuntimeError(
            f"vllm-reference at t={now:.6f}s: {what}; kvsim's KV cache disagrees "
            "with vLLM's (a kvsim bug: kvsim.sim.differential finds such cases)"
        )
