"""TensorRT-LLM, as it schedules with the PyTorch backend: the capacity scheduler, then
the micro-batch scheduler, over TensorRT-LLM's block manager (kvsim.kvcache.trtllm).

Sources (NVIDIA/TensorRT-LLM): TensorRT-LLM 1.2.0rc2's
cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp (commit b35ac1b64368, whose
tensorrt_llm/version.py reads 1.2.0rc2, not proven to be the tag v1.2.0rc2's, commit
31116825b39f: kvsim.kvcache.trtllm says why; `getRemainingBlocksToCompletion`,
`getNeededBlocksOneStep`); capacityScheduler.cpp (commit 02a10fed0dbf),
scheduledBlocksManager.cpp (ca64fd93be51) and microBatchScheduler.cpp (0a949d3128bf), at
commits no release tag can be tied to (docs/engines.md says why); the PyTorch executor
(tensorrt_llm/_torch/pyexecutor/py_executor.py `_pause_requests`: a paused request is
recomputed, its KV freed and stored for reuse).

Each step, over the active requests in order (running ones first, in admission order,
then the waiting queue's):
- Capacity (SchedulerConfig.capacity_scheduler_policy):
  GUARANTEED_NO_EVICT (the default) reserves, for every running request, the blocks it
  still needs to reach its full length (`getRemainingBlocksToCompletion`: blocks of
  prompt + max_new_tokens, less those it holds) out of the free blocks, cached ones
  included. A waiting request is admitted only if the blocks of its whole prompt and
  output fit in what is left (no credit for blocks it will reuse); the first that does
  not stops the queue. No request is ever paused.
  MAX_UTILIZATION gives each request the blocks of its next step only (a decode: a new
  block where its next token crosses one; a new prompt: all its blocks); a running
  request that cannot get them pauses the last started request, and so on until it fits
  or was itself paused (`MaxUtilizationScheduler`; kvsim's running set preempts from
  the back the same way). A paused request is recomputed: its prompt and output so far
  are prefilled again, reusing what the cache still holds.
  Either way a waiting request whose first block the cache lacks is skipped this step if
  a request admitted before it (or a prompt being prefilled in chunks) will store that
  very block (`beneficialToSkip`): it waits to reuse it.
- Micro-batch (max_batch_size requests, max_num_tokens tokens): each decode takes one
  token, a prompt its whole length (cached tokens included: the budget is set before
  the cache is looked up); the first request that does not fit stops the step. With
  chunked context (TorchLlmArgs.enable_chunked_prefill, off by default) prompts are cut
  first come first served to the tokens left, a cut chunk rounded down to whole blocks
  (`setCtxRequestsChunkSize`, kFIRST_COME_FIRST_SERVED); a prompt whose cached tokens
  start it later ends its chunk on a block boundary (LlmRequest.setPrepopulatedPromptLen).
- An admitted request's reused blocks are taken first (`addSequence`, block by block:
  kvsim.kvcache.trtllm `load_prefix`); the tokens they hold, which may be fewer than the
  lookup found, are what its prefill skips and what its chunk starts after.
- A prompt's full blocks are stored for reuse once its context has run (the step after);
  a sampled token takes its KV slot when it is fed back (`addToken`), as vLLM V1 counts.
- KV transfers between the GPU and the host pool delay the step (kvsim.kvcache.trtllm).

kvsim takes a request's max_new_tokens to be its true output length, as benchmark
clients send it. Parallel samples are separate requests. Not modelled: STATIC_BATCH,
PREFILL_FIRST, the EQUAL_PROGRESS chunking policy, the waiting queue's policies other
than FCFS, max_num_active_requests (the active list is bounded by max_batch_size only),
pipeline parallelism's in-flight micro-batches, speculative decoding and beam search.
"""

from __future__ import annotations

from kvsim.engines.base import EngineRules, Request, SchedulerOps, Step, with_limit
from kvsim.kvcache.paged import blocks_for
from kvsim.kvcache.trtllm import TrtllmBlockManager

GUARANTEED_NO_EVICT, MAX_UTILIZATION = "GUARANTEED_NO_EVICT", "MAX_UTILIZATION"
POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


class TensorRTLLM(EngineRules):
    name = "trtllm"
    split_samples = True
    sampled_slot_ahead = False

    def __init__(self):
        self._contexts: list[Request] = []  # the requests the last step prefilled

    def cached_tokens(self, s: SchedulerOps, req: Request) -> int:
        """Tokens of `req`'s prompt the block manager's lookup finds: at most all but the
        last (an admission takes them block by block, which may reuse fewer: `_admit`)."""
        return s.allocator.match_prefix(req.shape, req.target)

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        return "recompute"

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        s.waiting.appendleft(req)  # a paused request keeps its place, before later arrivals

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        step = Step()
        alloc = _manager(s)
        bs = alloc.block_size
        for req in self._contexts:  # their context ran in the last step: store its blocks
            if not req.prefilling and alloc.tokens_of(req.ids[0]) is not None:
                alloc.store_context_blocks(req.ids[0])
        guaranteed = s.schedule_policy != MAX_UTILIZATION
        reserve = s.free_slots() // bs
        if guaranteed:
            reserve -= sum(blocks_for(q.shape.final_tokens, bs) - blocks_for(q.held, bs) for q in s.running)
        budget = self._decodes(s, step, now, s.budget)
        contributed: set[tuple] = set()
        if not step.preempted:
            budget = self._chunks(s, step, now, budget, contributed)
        if not step.preempted and not step.limit:
            self._admit(s, step, now, budget, reserve if guaranteed else None, contributed)
        if s.waiting and not step.limit and not step.preempted:
            with_limit(step, "max_num_seqs" if len(s.running) >= s.max_num_seqs else "token_budget")
        self._contexts = [req for req, _ in step.work if req.prefilling]
        step.load_s += alloc.take_transfer_s()
        return step

    def _decodes(self, s: SchedulerOps, step: Step, now: float, budget: int) -> int:
        """Every running request that decodes takes one token, in order, while the budget
        lasts; one that cannot grow pauses the latest started (MAX_UTILIZATION)."""
        decoding = s.running.decoding()
        if len(decoding) <= budget:
            s.running.decode_all(step, now)
            return budget - len(decoding)
        for req in decoding[:budget]:
            if not s.running.run(req, 1, step, now):
                break
        with_limit(step, "token_budget")
        return 0

    def _chunks(self, s: SchedulerOps, step: Step, now: float, budget: int, contributed: set) -> int:
        """Prompts being prefilled in chunks go on; each names the block it will store."""
        alloc = _manager(s)
        for req in s.running.prefilling():
            key = alloc.new_context_block(req.shape, req.target)
            if key is not None:
                contributed.add(key)
            n = fcfs_chunk(req.target - req.prefilled, budget, alloc.block_size)
            if n <= 0:
                with_limit(step, "token_budget")
                break
            if not s.running.run(req, n, step, now):
                break
            budget -= n
        return budget

    def _admit(
        self, s: SchedulerOps, step: Step, now: float, budget: int, reserve: int | None, contributed: set
    ) -> None:
        """Waiting requests in order: skipped where another admission stores their first
        missing block; admitted while blocks (reserve: GUARANTEED_NO_EVICT's, else the
        free blocks), max_batch_size and the token budget allow."""
        alloc = _manager(s)
        bs = alloc.block_size
        free = s.free_slots() // bs
        i = 0
        while i < len(s.waiting):
            if len(s.running) >= s.max_num_seqs:
                with_limit(step, "max_num_seqs")
                return
            head = s.waiting[i]
            key = alloc.new_context_block(head.shape, head.target)
            if key is not None and key in contributed:
                # it waits to reuse what an earlier admission is computing (kvsim counts
                # the wait as memory's: the deferral saves a shared block's KV and compute)
                with_limit(step, "memory", head, head.target)
                i += 1
                continue
            need = blocks_for(head.shape.final_tokens if reserve is not None else head.target, bs)
            if need > (reserve if reserve is not None else free):
                with_limit(step, "memory", head, head.target)
                return
            charged = head.target if not s.chunked else fcfs_chunk(head.target, budget, bs)
            if charged > budget or charged <= 0:
                with_limit(step, "token_budget", head, head.target)
                return
            # the blocks it reuses are taken first and say how many tokens it skips
            # (addSequence sets the prepopulated prompt length), then the step is planned
            cached = alloc.load_prefix(head.ids[0], head.shape, head.target)
            if cached is None:
                with_limit(step, "memory", head, head.target)
                return
            n = head.target - cached if not s.chunked else chunk_after_reuse(cached, charged, head.target, bs)
            if not s.admit(head, cached, n, cached + n, step, now):
                with_limit(step, "memory", head, head.target)
                return
            if key is not None:
                contributed.add(key)
            budget -= charged
            if reserve is not None:
                reserve -= need
            else:
                free -= need


def fcfs_chunk(remaining: int, budget: int, block_size: int) -> int:
    """A prompt's next chunk under FIRST_COME_FIRST_SERVED: all of it if the tokens left
    hold it, else what they hold rounded down to whole blocks (the chunk unit)."""
    if remaining <= budget:
        return remaining
    return budget // block_size * block_size


def chunk_after_reuse(cached: int, chunk: int, target: int, block_size: int) -> int:
    """Tokens a chunk computes once the cache's `cached` tokens start it: the rest of the
    prompt if the chunk reaches its end, else up to the block boundary the chunk's end
    rounds down to (setPrepopulatedPromptLen); at least one token."""
    if cached + chunk >= target:
        return target - cached
    end = (cached + chunk) // block_size * block_size
    return end - cached if end > cached else min(chunk, target - cached)


def _manager(s: SchedulerOps) -> TrtllmBlockManager:
    """The scheduler's allocator, which under these rules is TensorRT-LLM's block manager."""
    assert isinstance(s.allocator, TrtllmBlockManager), "engine: trtllm runs on its own block manager"
    return s.allocator
