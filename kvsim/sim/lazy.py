"""The fast path: running requests that only decode advance without being visited.

In most steps most running requests only decode: each gains one token of KV, and the
allocator does nothing but count it (the token fills a slot reserved in the request's
last block or region) or, at a block boundary, hand it the next free block.
`LazyRunningSet` keeps such a request *lazy*: it stays in the running list, but nothing
touches it until a step where its next token needs more. Decode steps in which every
lazy request decodes are numbered (`tick`); a lazy request's held and generated tokens
are the values it had when it went lazy plus the ticks since. When it goes lazy, the
tick that ends its laziness is known: the one whose token its allocator room no longer
covers (a copy, a window, a cache entry: `CountedAllocator.room`, `block_room`), or the
one that completes it. Before the first it is made explicit, then scheduled and grown
by the engine's own code like any request; in the second it completes through the
plain completion, in its running-order place among the step's work.

What a step needs from the lazy requests is kept in sums: how many decode and the
tokens and blocks their contexts hold (for the cost model, kvsim.cost.model.Decodes),
and the memory breakdown's per-request shares (reservation, internal, padding, slots)
summed over all running requests; the allocator gives the free part (`pool_free`).
Block boundaries are counted by (held - tick) mod block_size: tick k's crossings are
one residue, their blocks taken off the free queue in one call and handed
to each request when it is caught up (`take_free`, `extend`). A step therefore costs
time in proportion to the requests it changes, not to the batch.

Exactness. The engines' rules are the same code in both paths; only the running set's
passes (`advance`, `decode_all`) differ, and they go lazy only where the plain pass
would give every running request its whole demand with no preemption: the budget
covers every decode and every prefill chunk, and the free slots cover every explicit
request's growth and the tick's crossings. Then the explicit requests are run in running order,
the order in which the engine's pass would have grown them. The lazy requests' grows
would only have counted, or taken blocks of which it does not matter which: the plain
paged allocator has no cache and no window here, and nothing kvsim reports depends on
block ids. A prefix cache's blocks go the same way where no request's tail content is
another's (its `block_room` says why that is exact); elsewhere its room stops short of a
block boundary, so its blocks are taken and keyed one by one as in the plain path.
Everything else (admission, preemption, completion) runs as in the plain set, on
explicit requests; where an engine reads every running request (SGLang's admission
test: `decoding`, or iteration) each lazy one is brought up to date in place, and where
a pass could preempt, every lazy request is made explicit first and the plain pass runs. Sums of integers are exact, so every step's
batch, breakdown and time are the plain path's to the last bit (tests/test_fast_path.py).

A step in which every running request is lazy and nothing waits that the step could
admit (nothing at all, or, with vLLM V1's asynchronous scheduling, only requests that
arrived after the step in flight was planned) is *quiet*: the engine's rules would only
give each its token (EngineRules.decodes_only), so the loop plans it as the tick alone
(`quiet_tick`: what `_lazy_pass` does with no explicit request) and, while it completes
nothing, completes it by ending the tick (kvsim.sim.loop).

Not lazy (their runs go step by step, as in the plain path): the radix cache (every
token takes a free slot), sliding windows (blocks leave the window), and sequence
groups (samples or beams in vLLM V0 share partly filled blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

from kvsim.cost.model import Decodes, StepBatch
from kvsim.engines.base import Request, Step, Work
from kvsim.kvcache import Breakdown, BulkBlockAllocator, InvariantError, NextSeq
from kvsim.kvcache.base import split_used
from kvsim.sim.pool_sums import PoolSums, Share
from kvsim.sim.records import PoolParts
from kvsim.sim.running import RunningSet


def applies(allocator, rules, options: dict, cost_block_size: int | None = None) -> bool:
    """Whether a run of these settings can use the lazy running set (see the module docstring)."""
    single = rules.split_samples or options.get("width", 1) == 1
    return (
        single
        and not options.get("beam")
        and options.get("sliding_window") is None
        and allocator.counted
        and cost_block_size in (None, allocator.block_size)
    )


@dataclass(eq=False, slots=True)
class LazyEntry:
    """A request as it went lazy, and when its laziness ends."""

    tick: int  # the tick it went lazy at
    held: int  # its held and generated tokens then
    generated: int
    due: int  # the first tick it is not lazy in ...
    finishes: bool  # ... completing in the tick before, if it completes lazily
    last_crossing: int = 0  # the tick its last crossing takes a block ending past its final
    # length (those slots are internal), 0 if none is lazy


class Wanting(NamedTuple):
    """A request that may take a slot in this step, at its place in the running order."""

    order: int
    req: Request
    was_lazy: bool


class LazyRunningSet(RunningSet):
    """A running set whose decoding requests advance in sums between the steps that
    change them. cost_block_size: the block size the cost model counts contexts in;
    tails_private: no request's tail content is another's (RequestTable.private_tails),
    so a prefix cache's blocks may go in bulk."""

    def __init__(self, sched, *, cost_block_size: int | None = None, tails_private: bool = False):
        super().__init__(sched)
        allocator: BulkBlockAllocator = sched.allocator  # or a CountedAllocator: see `bulk`
        self.allocator = allocator
        self.cost_block_size = cost_block_size
        self.tails_private = tails_private
        # Block boundaries (an allocator of blocks): a lazy request whose held tokens reach
        # a multiple of `bs` takes a block at the next tick (where its block room allows
        # it; elsewhere its laziness ends first). by_residue[r]: lazy requests with
        # (held - tick) % bs == r when they went lazy, so tick k's crossings are
        # by_residue[(1 - k) % bs]; their blocks are taken in bulk and attached when caught up.
        self.bs = allocator.block_size
        self.bulk = allocator.takes_blocks_in_bulk
        self.by_residue: list[dict[Request, None]] = [{} for _ in range(self.bs or 1)]
        self.taken_ahead: list[int] = []  # blocks taken for lazy requests' crossings, not yet attached
        # A crossing adds a block's slots to the reservation, except into a last block that
        # ends past the final length: those slots are internal. tick -> such slots.
        self.internal_at: dict[int, int] = {}
        self.tick = 0  # decode ticks planned so far
        self.pending = False  # the last tick planned has not completed yet
        self.tick_at_start = 0  # the tick when the step being planned began
        self.refreshed_at: tuple[int, bool] | None = None  # (tick, pending) of the last refresh_all
        self.lazy: dict[Request, LazyEntry] = {}
        self.due: dict[int, list[tuple[Request, LazyEntry]]] = {}  # made explicit at that tick
        self.finishing: dict[int, list[tuple[Request, LazyEntry]]] = {}  # completed with that tick
        self.explicit: dict[Request, None] = {}  # running requests not lazy
        self.order: dict[Request, int] = {}  # running order: admissions counted
        self._admissions = 0
        self.lazy_held = 0  # sum over lazy requests of held - tick when they went lazy
        self.lazy_blocks = 0  # sum of their contexts' cost blocks at the last tick
        # The breakdown in sums over running requests at their true counts; a lazy
        # request's own share stays as it went lazy (the sums move for it: its
        # reservation falls by one per tick and rises by a block per crossing, as its
        # slots do) until it is caught up.
        self.sums = PoolSums(allocator)
        self.swapped_in = False  # a swap-in ran: recount the sums

    # --- lazy requests ---------------------------------------------------------------
    def _enter(self, req: Request) -> None:
        """After a step: let a decoding request go lazy for as many ticks as it can, to
        the tick that completes it if its room reaches that far."""
        sid = req.ids[0]
        room = self.allocator.block_room(sid, self.tails_private) if self.bulk else self.allocator.room(sid)
        left = req.shape.output_tokens - req.generated
        finishes = room >= left
        span = left if finishes else min(room, left - 1)
        if span <= 0:
            return
        self._go_lazy(req, LazyEntry(self.tick, req.held, req.generated, self.tick + span + 1, finishes))

    def _go_lazy(self, req: Request, entry: LazyEntry, registered: bool = False) -> None:
        """`req` goes lazy as `entry` says (registered: its entry is already where its
        laziness ends, in `due` or `finishing`)."""
        tick, held = entry.tick, entry.held
        bs = self.bs
        if bs:
            self.by_residue[(held - tick) % bs][req] = None
            if self.cost_block_size:
                self.lazy_blocks += -(-held // bs)
            final = req.shape.final_tokens
            internal = -final % bs  # slots of its last block past its final length
            start = (final - 1) // bs * bs  # where its last block starts
            if internal and held <= start and tick + start - held + 1 < entry.due:
                last = entry.last_crossing = tick + start - held + 1
                self.internal_at[last] = self.internal_at.get(last, 0) + internal
        self.lazy[req] = entry
        self.explicit.pop(req, None)
        if not registered:  # a request that finishes lazily does so in the completion of tick due - 1
            (self.finishing if entry.finishes else self.due).setdefault(entry.due - entry.finishes, []).append(
                (req, entry)
            )
        self.lazy_held += held - tick

    def _bring_up_to_date(self, req: Request) -> LazyEntry:
        """Bring a lazy request's fields, its allocator count and blocks, and its share
        up to date; it leaves the lazy set (returns its entry)."""
        entry = self.lazy.pop(req)
        k = self.tick - entry.tick
        req.held = held = entry.held + k
        req.generated = entry.generated + k - self.pending
        final = req.shape.final_tokens
        share = self.sums.share
        _, _, pad, slots = share[req]
        new_slots = slots
        bs = self.bs
        if bs:
            del self.by_residue[(entry.held - entry.tick) % bs][req]
            blocks = -(-held // bs)
            if self.cost_block_size:
                self.lazy_blocks -= blocks
            if blocks * bs > slots:
                new_slots = blocks * bs
            last = entry.last_crossing
            if last > self.tick:  # its last crossing will not be lazy
                internal_at = self.internal_at
                internal_at[last] -= -final % bs
                if not internal_at[last]:
                    del internal_at[last]
        if new_slots > slots:  # the blocks taken for its crossings, last first
            ahead, n = self.taken_ahead, (new_slots - slots) // bs
            taken = ahead[-n:]
            del ahead[-n:]
            taken.reverse()
            self.allocator.extend(req.ids[0], held, taken)
        else:
            self.allocator.grow(req.ids[0], held)  # a count only: within its room
        # the sums have followed it tick by tick; its own share is now where they put it
        _, reservation, internal = split_used(held, new_slots, final)
        share[req] = Share(reservation, internal, pad, new_slots)
        self.lazy_held -= entry.held - entry.tick
        return entry

    def _make_explicit(self, req: Request) -> None:
        self._bring_up_to_date(req)
        self.explicit[req] = None

    def make_all_explicit(self) -> None:
        """Make every lazy request explicit (before a plain pass over the running requests)."""
        for req in list(self.lazy):
            self._make_explicit(req)
        self.due.clear()
        self.finishing.clear()
        if self.taken_ahead:
            raise InvariantError(f"{len(self.taken_ahead)} blocks taken for lazy requests were never attached")

    def _refresh(self, req: Request) -> None:
        """Bring a lazy request up to date in place: it stays lazy, due at the same tick (a
        tick planned but not completed stays its own: the request decodes in it)."""
        entry = self._bring_up_to_date(req)
        entry.tick, entry.held, entry.generated = self.tick, req.held, req.generated + self.pending
        entry.last_crossing = 0
        self._go_lazy(req, entry, registered=True)

    def refresh_all(self) -> None:
        """Every lazy request's fields up to date; they stay lazy."""
        if self.refreshed_at != (self.tick, self.pending):  # else none has moved since
            for req in list(self.lazy):
                self._refresh(req)
            self.refreshed_at = (self.tick, self.pending)
        if self.taken_ahead:
            raise InvariantError(f"{len(self.taken_ahead)} blocks taken for lazy requests were never attached")

    def _recount(self) -> None:
        """After a swap-in (the plain move the sums do not follow): every share recounted."""
        self.refresh_all()
        self.explicit = dict.fromkeys(req for req in self.requests if req not in self.lazy)
        self.order = {req: self.order[req] for req in self.requests}
        self.sums.recount(self.requests)
        self.swapped_in = False

    def _explicit_in_order(self) -> list[Request]:
        return sorted(self.explicit, key=self.order.__getitem__)

    # --- reading ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Request]:
        if self.lazy:
            self.refresh_all()
        return iter(self.requests)

    def prefilling(self) -> list[Request]:
        return [q for q in self._explicit_in_order() if q.prefilling]  # lazy ones decode

    def decoding(self) -> list[Request]:
        if self.lazy:
            self.refresh_all()
        return super().decoding()

    def slots_to_decode(self) -> int:
        needed = sum(
            self.allocator.slots_to_grow(k, q.held + 1) for q in self.explicit if not q.prefilling for k in q.ids
        )
        needed += self._crossing(self.tick + 1) * (self.bs or 0)
        if needed > self.free_slots():  # the engine will look at every decoding request
            self.make_all_explicit()
        return needed

    # --- the pool ------------------------------------------------------------------
    def pool_free(self, next_seq: NextSeq | None) -> tuple[int, int, bool]:
        return self.sums.pool_free(next_seq)

    def free_slots(self) -> int:
        return self.sums.free_slots()

    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        return self.sums.breakdown(next_seq)

    def recorded_parts(self, next_seq: NextSeq | None) -> PoolParts:
        return self.sums.recorded_parts(next_seq)

    # --- the passes ------------------------------------------------------------------
    def advance(self, step: Step, now: float, budget: int) -> int:
        """The budget pass, lazily where the plain pass would run every request whole."""
        if not self.lazy:
            return super().advance(step, now, budget)
        work, needs, demand = [], [], len(self.lazy)
        for req in self._explicit_in_order() if self.explicit else ():
            n = req.next_tokens()
            demand += n
            needs.append(sum(self.allocator.slots_to_grow(sid, req.held_after(n, self.ahead)) for sid in req.ids))
            work.append(Work(req, n))
        if demand > budget:
            self.make_all_explicit()
            return super().advance(step, now, budget)
        return self._lazy_pass(step, now, work, needs, budget - demand)

    def decode_all(self, step: Step, now: float) -> None:
        """The decode pass, lazily where every request may take its token."""
        if not self.lazy:
            return super().decode_all(step, now)
        work, needs = [], []
        for req in self._explicit_in_order() if self.explicit else ():
            if req.prefilling:  # a pass that skips it: the plain one
                self.make_all_explicit()
                return super().decode_all(step, now)
            needs.append(sum(self.allocator.slots_to_grow(sid, req.held + 1) for sid in req.ids))
            work.append(Work(req, 1))
        self._lazy_pass(step, now, work, needs, 0)

    def _lazy_pass(self, step: Step, now: float, work: list[Work], needs: list[int], left: int) -> int:
        """Every lazy request decodes and the explicit ones (`work`, in running order,
        needing `needs` free slots) run whole, where the free slots cover them all and the
        tick's crossings; else the short pass. Returns `left`, the budget it leaves."""
        crossing = self._crossing(self.tick + 1)
        if sum(needs) + crossing * (self.bs or 0) > self.free_slots():
            return self._short_pass(
                step, now, [req for req, _ in work], left + sum(n for _, n in work) + len(self.lazy)
            )
        # The lazy requests' grows first: in the plain pass they only count, and their
        # blocks may come off the queue in any order (no output depends on which id).
        self._lazy_tick(crossing)
        for req, n in work:
            if not self.run(req, n, step, now) or step.preempted:
                raise InvariantError(
                    f"request {req.spec.id} could not grow in a step that had room "
                    "for every running request (a kvsim bug)"
                )
        return left

    def _short_pass(self, step: Step, now: float, explicit: list[Request], budget: int) -> int:
        """The running pass where the free slots do not cover every request's growth
        (`explicit`: the explicit requests in running order). The requests that need
        slots (the explicit ones and the lazy ones at a block boundary) go in running
        order, as in the plain pass. A lazy one the free slots left cover takes its
        block without preempting, so it stays lazy: its block is taken in bulk
        (`_take_crossings`, before the next request that runs, so that request sees the
        free queue the plain pass would). Every other one runs through the plain
        `run` (a lazy one made explicit first), which preempts from the back of the
        running order as the plain pass does (a lazy victim is caught up first;
        victims come after the request that needs the room, so never one served before
        it), and the free slots are counted again. A request preempted before its turn
        is skipped; one that cannot run ends the pass, as in the plain passes: every
        request after it has been preempted. The lazy requests that need no slot only
        count, as in the plain pass, so they decode lazily."""
        wanting = [Wanting(self.order[req], req, False) for req in explicit]
        if self.bs:
            crossers = self.by_residue[(1 - (self.tick + 1)) % self.bs]
            wanting += [Wanting(self.order[req], req, True) for req in crossers]
            wanting.sort(key=lambda want: want.order)
        free, bulk, ran = self.free_slots(), 0, 0
        for _, req, was_lazy in wanting:
            if was_lazy:
                if req not in self.lazy:  # preempted by a request before it
                    continue
                if free >= self.bs:  # its block is there: it stays lazy
                    free -= self.bs
                    bulk += 1
                    continue
            elif req not in self.explicit:  # preempted by a request before it
                continue
            self._take_crossings(bulk)
            bulk = 0
            if was_lazy:
                self._make_explicit(req)
            n = req.next_tokens()
            if not self.run(req, n, step, now):
                break
            ran += n
            free = self.free_slots()
        self._take_crossings(bulk)
        self._lazy_tick(0)
        return budget - ran - len(self.lazy)

    def _take_crossings(self, crossing: int) -> None:
        """`crossing` lazy requests take a block at the next tick: their new blocks, in
        bulk (which id goes where does not matter), attached when they are caught up."""
        if crossing:
            sums, slots = self.sums, crossing * self.bs
            self.taken_ahead += self.allocator.take_free(crossing)
            sums.took(slots)
            sums.reservation += slots
            sums.slots += slots
            if self.cost_block_size:
                self.lazy_blocks += crossing

    def _lazy_tick(self, crossing: int) -> None:
        """Every lazy request decodes one token; `crossing` of them take a block (if they
        have not yet: _take_crossings)."""
        if crossing:
            self._take_crossings(crossing)
        sums = self.sums
        self.tick += 1
        self.pending = True
        sums.reservation -= len(self.lazy)
        if self.tick in self.internal_at:  # crossings into a last, partly used block
            internal = self.internal_at.pop(self.tick)
            sums.reservation -= internal
            sums.internal += internal

    def _crossing(self, tick: int) -> int:
        """Lazy requests that take a block at `tick` (their held tokens fill their last block)."""
        return len(self.by_residue[(1 - tick) % self.bs]) if self.bs else 0

    # --- quiet steps ----------------------------------------------------------------
    def quiet(self) -> bool:
        """Whether every running request is lazy and the next tick is one that the
        engine's running pass would make without a change: none is due, and the free slots
        cover its crossings (`_lazy_pass` with no explicit request)."""
        tick = self.tick + 1
        if not self.lazy or self.explicit or self.swapped_in or tick in self.due:
            return False
        bs = self.bs  # (the crossings: `_crossing(tick)`)
        crossing = len(self.by_residue[(1 - tick) % bs]) if bs else 0
        return not crossing or crossing * bs <= self.sums.free_slots()

    def quiet_tick(self) -> StepBatch:
        """Plan a quiet step: the tick of `_lazy_pass` without explicit requests (its
        crossings, `_crossing(tick + 1)`, taken in bulk), and the batch `close_step` gives it."""
        self.tick_at_start = tick = self.tick
        bs = self.bs
        if bs:
            crossing = len(self.by_residue[-tick % bs])
            if crossing:
                self._take_crossings(crossing)
        self._lazy_tick(0)
        n = len(self.lazy)
        return StepBatch((), (), Decodes(n, self.lazy_held + n * (tick + 1), self.lazy_blocks, self.cost_block_size))

    def completes_none(self) -> bool:
        """Whether the tick in flight completes no request (its completion then only ends it)."""
        return self.tick not in self.finishing

    def complete_quiet(self) -> None:
        """Complete a quiet step that completes no request: what `complete` does with it."""
        self.pending = False

    # --- moves -----------------------------------------------------------------------
    def run(self, req: Request, n: int, step: Step, now: float) -> bool:
        if req in self.lazy:
            self._make_explicit(req)
        ran = super().run(req, n, step, now)
        self.sums.version += 1
        return ran

    def add(self, req: Request, n: int, step: Step, now: float, swapped_in: bool = False) -> None:
        super().add(req, n, step, now)
        self.swapped_in |= swapped_in
        self.sums.version += 1
        self._admissions += 1
        self.order[req] = self._admissions
        self.explicit[req] = None

    def remove(self, req: Request) -> None:
        if req in self.lazy:
            self._make_explicit(req)
        super().remove(req)
        self.sums.drop(req)
        del self.explicit[req], self.order[req]
        self.sums.version += 1

    # --- one step ------------------------------------------------------------------
    def start_step(self) -> None:
        """The due lazy requests made explicit (and every share recounted after a swap-in)."""
        for req, entry in self.due.pop(self.tick + 1, ()):
            if self.lazy.get(req) is entry:
                self._make_explicit(req)
        if self.swapped_in:
            self._recount()
        self.tick_at_start = self.tick

    def close_step(self, step: Step) -> None:
        """The plain batch, with the lazy requests that decoded in it added in sum."""
        super().close_step(step)
        if self.tick != self.tick_at_start and self.lazy:
            n = step.lazy = len(self.lazy)
            step.cost = StepBatch(
                step.cost.prefills,
                step.cost.decode_contexts,
                Decodes(n, self.lazy_held + n * self.tick, self.lazy_blocks, self.cost_block_size),
            )
        if self.swapped_in:
            self._recount()
        elif step.work:
            for req, n in step.work:
                if req in self.explicit:
                    self.sums.update(req)
            self.sums.version += 1

    def complete(self, step: Step, now: float) -> list[Request]:
        """The plain completion, with the lazy requests this tick completes made explicit
        and put among the step's work in running order (where the plain pass has them)."""
        if self.pending:
            done = [req for req, entry in self.finishing.pop(self.tick, ()) if self.lazy.get(req) is entry]
            if done:
                for req in done:
                    self._make_explicit(req)
                order = self.order
                step.work = sorted([*step.work, *(Work(req, 1) for req in done)], key=lambda w: order[w.req])
        self.pending = False
        finished = super().complete(step, now)
        for req in finished:
            self.sums.drop(req)
            del self.explicit[req], self.order[req]
        if finished:
            self.sums.version += 1
        for req, n in step.work:
            if not req.outcome and not req.prefilling and req in self.explicit:
                self._enter(req)
        return finished

    def check(self) -> None:
        """The plain checks on every request's true counts (lazy ones brought up to date
        in place, staying lazy), then this set's sums against the allocator."""
        self.refresh_all()
        super().check()
        sched = self.sched
        head = sched.waiting[0] if sched.waiting else None
        nxt = None if head is None else (head.shape, head.target + 1, sched.keep_free)
        mine, theirs = self.breakdown(nxt), self.allocator.breakdown(nxt)
        if mine != theirs:
            raise InvariantError(f"the lazy running set's breakdown {mine} is not the allocator's {theirs}")
        if set(self.requests) != set(self.lazy) | set(self.explicit) or set(self.lazy) & set(self.explicit):
            raise InvariantError("a running request is neither lazy nor explicit, or both")
        held = sum(e.held - e.tick for e in self.lazy.values())
        blocks = sum(-(-e.held // self.bs) for e in self.lazy.values()) if self.cost_block_size else 0
        if held != self.lazy_held or blocks != self.lazy_blocks:
            raise InvariantError("the lazy requests' sums are stale")
        for req in self.requests:
            slots, pad = self.allocator.slots_of(req.ids[0])
            if self.sums.share[req] != (*split_used(req.held, slots, req.shape.final_tokens)[1:], pad, slots):
                raise InvariantError(f"request {req.spec.id}'s share of the breakdown is stale")
