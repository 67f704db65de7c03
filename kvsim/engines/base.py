"""What an engine's rules work with, and what they provide.

An engine (vLLM V0, vLLM V1, SGLang, ...) is a small rules object (`EngineRules`):
asked to plan a step, it fills a `Step` by calling the scheduler's operations
(`SchedulerOps`): admit the head of the waiting queue, advance the running requests
(`RunningRequests`: "each running request's next tokens on a token budget", "decode
every running request", "run this chunk"), preempt, reject. It decides; the scheduler
keeps the state, talks to the allocator and applies the finished step
(kvsim.sim.scheduler). How the running requests are held (every one visited, or the
decoding ones advanced in sums: kvsim.sim.lazy) is private to the running set: every
operation gives the same result either way.

A request here (`Request`) is one request as the engine schedules it: where an engine
runs parallel samples as requests of their own (`split_samples`), each sample is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple, Protocol

from kvsim.kvcache import KVAllocator, NextSeq, SeqShape

if TYPE_CHECKING:
    from collections import deque

    from kvsim.cost.model import StepBatch
    from kvsim.sim.waiting import WaitingQueue
    from kvsim.workload.requests import RequestSpec

MAX_WIDTH = 64  # sequences per request; allocator ids are request id * 64 + k
LIMITS = ("memory", "watermark", "max_num_seqs", "token_budget", "preemption", "arrivals")


@dataclass(eq=False, slots=True)
class Request:
    """The mutable life of one request (or one sample of it) in one policy's run."""

    spec: RequestSpec
    shape: SeqShape
    target: int = 0  # tokens to prefill on (re)admission: prompt + generated
    prefilled: int = 0  # tokens of `target` already computed
    generated: int = 0
    held: int = 0  # tokens whose KV the allocator holds for it
    preemptions: int = 0
    swapped: bool = False  # KV sits in CPU memory, to be copied back on admission
    ids: tuple[int, ...] = ()  # allocator ids of its sequences (one unless samples or beams)
    admitted_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    outcome: str = ""  # "", "completed", "rejected" or "timed out"
    reason: str = ""
    # where a preemption stopped its tokens once they had begun: (last token before, first
    # token after) for each, what a streaming client sees as one long gap (kvsim.analysis.stages)
    stall_from: float = math.nan
    stalls: tuple[tuple[float, float], ...] = ()

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.target

    @property
    def index(self) -> int:
        """Its place in the run's arrival order (kvsim.sim.records numbers outcomes so)."""
        return self.ids[0] // MAX_WIDTH

    def next_tokens(self) -> int:
        """Tokens its next step computes where no budget cuts them: the rest of its
        prompt while it is prefilled, else one (a decode)."""
        return self.target - self.prefilled if self.prefilled < self.target else 1

    def held_after(self, n: int, ahead: int) -> int:
        """KV tokens it holds after computing `n` more. A decode adds one; a finished
        prefill also yields a token, whose slot comes now where `ahead` is 1 (the rules'
        `sampled_slot_ahead`), else with the next decode."""
        if self.prefilled >= self.target:
            return self.held + 1
        done = self.prefilled + n
        return done + ahead if done == self.target else done


class Work(NamedTuple):
    """One request's part of a step: the new tokens it computes (a prefill chunk, or 1)."""

    req: Request
    tokens: int


@dataclass(slots=True)
class Step:
    """What one step computes (each request's Work, in running order) and what it waits for."""

    work: list[Work] = field(default_factory=list)
    lazy: int = 0  # decoding requests advanced in sum (kvsim.sim.lazy)
    cost: StepBatch | None = None
    swap_bytes: float = 0.0  # KV copied over PCIe (swap in and out)
    load_s: float = 0.0  # seconds of KV-tier loads the step waits for
    rejected: list[Request] = field(default_factory=list)  # found unable to fit even alone
    preempted: int = 0
    limit: str = ""  # what kept the queue's head out (LIMITS)
    head_need: NextSeq | None = None  # what that head needed this step


def with_limit(step: Step, limit: str, head: Request | None = None, tokens: int = 0, keep_free: int = 0) -> Step:
    """Note what stopped the head (the first reason wins) and what it needed."""
    if not step.limit:
        step.limit = limit
        if head is not None:
            step.head_need = (head.shape, tokens, keep_free)
    return step


class RunningRequests(Protocol):
    """The running requests in admission order (the last admitted is preempted first).
    Growing a request preempts from the back until it fits (the engines' common rule);
    iterating or indexing sees every request up to date."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __contains__(self, req: object) -> bool: ...

    def advance(self, step: Step, now: float, budget: int) -> int:
        """Each request in running order runs its next tokens: a decode one token per
        sequence, a prefill the rest of its prompt cut to the budget left; the pass stops
        at the first the budget left cannot hold or that cannot grow. Returns the budget left."""

    def decode_all(self, step: Step, now: float) -> None:
        """Every decoding request in running order decodes one token (prefilling ones wait)."""

    def run(self, req: Request, n: int, step: Step, now: float) -> bool:
        """Run `req`'s next `n` tokens in this step; False if it was preempted or rejected."""

    def prefilling(self) -> list[Request]:
        """The requests whose prompt is still being prefilled, in running order."""

    def decoding(self) -> list[Request]:
        """The requests that decode, in running order."""

    def slots_to_decode(self) -> int:
        """Free slots one more token for every decoding request would take."""


class SchedulerOps(Protocol):
    """What engine rules may read and do: the queues, the settings, the moves."""

    allocator: KVAllocator
    running: RunningRequests
    waiting: WaitingQueue
    swapped: "deque[Request]"
    budget: int  # max_num_batched_tokens
    chunked: bool  # enable_chunked_prefill
    max_num_seqs: int
    keep_free: int  # the watermark, in slots
    max_model_len: int
    width: int  # sequences per request (1 where samples run as requests)
    preemption_mode: str | None
    schedule_policy: str
    ignore_eos: bool  # the clients send ignore_eos: every request runs to its max_new_tokens

    def running_seqs(self) -> int: ...
    def visible(self, req: Request) -> bool: ...
    def visible_next(self, req: Request) -> bool: ...
    def prefill_need(self, req: Request, budget: float) -> tuple[int, int, int]: ...
    def need_after(self, req: Request, cached: int, budget: float) -> tuple[int, int, int]: ...
    def fits(self, req: Request, tokens: int, keep_free: int) -> bool: ...
    def blocked_by(self, req: Request, tokens: int, keep_free: int) -> str: ...
    def free_slots(self) -> int: ...
    def admit(
        self, req: Request, cached: int, n: int, held: int, step: Step, now: float, keep_free: int = 0
    ) -> bool: ...
    def swap_in(self, req: Request, step: Step, now: float, keep_free: int = 0) -> bool: ...
    def reject(self, req: Request, now: float, reason: str, step: Step) -> None: ...
    def preempt(self, req: Request, step: Step, mode: str | None = None) -> None: ...


class EngineRules(Protocol):
    """An engine: what a step holds, and what a preemption does. The settings with a
    default (`sampled_slot_ahead`, `cached_tokens`, `on_idle`) are inherited by rules that
    subclass this protocol; an engine that counts otherwise overrides them."""

    name: str
    split_samples: bool  # parallel samples run as requests of their own
    # Where a sampled token's KV slot is taken: True in the step that samples it (a
    # request's peak is prompt + output), False in the step that feeds it back in (vLLM
    # V1's allocate_slots covers the tokens computed: prompt + output - 1).
    sampled_slot_ahead: bool = True

    def cached_tokens(self, s: SchedulerOps, req: Request) -> int:
        """Tokens of `req`'s next prefill a prefix cache serves: every hit but the last
        token, which is always computed to produce output."""
        return min(s.allocator.match_prefix(req.shape, req.target + 1), req.target - 1)

    def on_idle(self) -> None:
        """The replica has nothing running or waiting (an engine that resets some state
        when idle, as SGLang its new-token ratio, does it here)."""
        return None

    def schedule(self, s: SchedulerOps, now: float) -> Step:
        """Plan the next step: admissions and the running requests' tokens, with
        `limit` saying what kept the waiting queue's head out (LIMITS)."""
        ...

    def decodes_only(self, s: SchedulerOps) -> bool:
        """Whether, with nothing swapped out and every running request decoding, the step
        these rules plan is one token for each of them and nothing else, its limit
        "arrivals" (nothing waits, or nothing the step may admit yet: vLLM V1's
        asynchronous scheduling), changing no state of the rules: such a step may then be
        planned without them (kvsim.sim.loop's quiet steps). Rules that keep state across
        steps (SGLang's new-token ratio) say False, as this default does."""
        return False

    def preemption_mode(self, s: SchedulerOps, req: Request) -> str:
        """ "swap" (KV to CPU memory while swap space lasts), "recompute", or "retract"
        (recompute, releasing its KV without caching what it generated: SGLang)."""
        ...

    def requeue(self, s: SchedulerOps, req: Request) -> None:
        """Put a preempted request back where it waits (the waiting or swapped queue)."""
        ...
