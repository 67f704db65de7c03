"""The fast path: running requests that only decode advance without being visited.

In most steps most running requests only decode: each gains one token of KV, and the
allocator does nothing but count it (the token fills a slot reserved in the request's
last block or region) or, at a block boundary, hand it the next free block.
`LazyScheduler` keeps such a request *lazy*: it stays in the running list, but nothing
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
time in proportion to the requests it changes, not to the batch; a step that can only
be every request decoding lazily (a quiet tick) is planned without the rules' pass
(with requests waiting, where the rules find that the queue's head waits and a step
that admits nothing decodes every running request: vLLM V0's `head_waits`).

Exactness. The engines' rules are the same code in both paths; only the running pass
(`run_running`) differs, and it goes lazy only where the engine's own pass would give
every running request its whole demand with no preemption: the budget covers every
decode and every prefill chunk, and the free slots cover every explicit request's
growth and the tick's crossings. Then the explicit requests are run in running order,
the order in which the engine's pass would have grown them. The lazy requests' grows
would only have counted, or taken blocks of which it does not matter which: the plain
paged allocator has no cache and no window here, and nothing kvsim reports depends on
block ids. A prefix cache's blocks go the same way where no request's tail content is
another's (its `block_room` says why that is exact); elsewhere its room stops short of a
block boundary, so its blocks are taken and keyed one by one as in the plain path.
Everything else (admission, preemption, completion) runs as in the plain scheduler, on
explicit requests; where an engine's rule reads the state of every decoding request
(SGLang's admission test) or a pass could preempt, every lazy request is made explicit
first and the engine's plain pass runs. Sums of integers are exact, so every step's
batch, breakdown and time are the plain path's to the last bit (tests/test_fast_path.py).

Not lazy (their runs go step by step, as in the plain path): the radix cache (every
token takes a free slot), sliding windows (blocks leave the window), and sequence
groups (samples or beams in vLLM V0 share partly filled blocks).
"""
from __future__ import annotations

from kvsim.kvcache import Breakdown, InvariantError, NextSeq
from kvsim.kvcache.base import split_used
from kvsim.cost.model import Decodes, StepBatch
from kvsim.sim.pool_sums import PoolSums
from kvsim.sim.scheduler import Scheduler, Seq, Step, arrival_index

COUNTED = ("room", "slots_of", "pool_free")


def applies(allocator, rules, options: dict, cost_block_size: int | None = None) -> bool:
    """Whether a run of these settings can use the lazy scheduler (see the module docstring)."""
    single = rules.split_samples or options.get("width", 1) == 1
    blocks = getattr(allocator, "block_size", None)
    return (single and not options.get("beam") and options.get("sliding_window") is None
            and all(hasattr(allocator, m) for m in COUNTED)
            and cost_block_size in (None, blocks))


class LazyScheduler(Scheduler):
    """A Scheduler whose decoding requests advance in sums between the steps that
    change them. cost_block_size: the block size the cost model counts contexts in."""

    def __init__(self, allocator, rules, *, cost_block_size: int | None = None, **options):
        super().__init__(allocator, rules, **options)
        self.cost_block_size = cost_block_size
        # Block boundaries (an allocator of blocks): a lazy request whose held tokens reach
        # a multiple of `bs` takes a block at the next tick (where its block room allows
        # it; elsewhere its laziness ends first). by_residue[r]: lazy requests with
        # (held - tick) % bs == r when they went lazy, so tick k's crossings are
        # by_residue[(1 - k) % bs]; their blocks are taken in bulk and attached when caught up.
        self.bs = getattr(allocator, "block_size", None)
        self.bulk = hasattr(allocator, "block_room")
        self.by_residue: list[dict[Seq, None]] = [{} for _ in range(self.bs or 1)]
        self.owed: list[int] = []  # blocks taken for lazy requests' crossings, not yet attached
        # A crossing adds a block's slots to the reservation, except into a last block that
        # ends past the final length: those slots are internal. tick -> such slots.
        self.excess: dict[int, int] = {}
        self.tick = 0              # decode ticks planned so far
        self.pending = False       # the last tick planned has not completed yet
        # seq -> (tick, held, generated, due tick, finishes, tick of its last crossing) when
        # it went lazy: due is the first tick it is not lazy in; finishes, whether it
        # completes in the tick before; the last field is 0 unless that crossing is into a
        # block ending past its final length.
        self.lazy: dict[Seq, tuple[int, int, int, int, bool, int]] = {}
        self.due: dict[int, list[tuple[Seq, tuple]]] = {}         # made explicit at that tick
        self.finishing: dict[int, list[tuple[Seq, tuple]]] = {}   # completed with that tick
        self.explicit: dict[Seq, None] = {}    # running requests not lazy
        self.order: dict[Seq, int] = {}        # running order: admissions counted
        self._admissions = 0
        self.lazy_held = 0         # sum over lazy requests of held - tick when they went lazy
        self.lazy_blocks = 0       # sum of their contexts' cost blocks at the last tick
        # The breakdown in sums over running requests at their true counts; a lazy
        # request's own share stays as it went lazy (the sums move for it: its
        # reservation falls by one per tick and rises by a block per crossing, as its
        # slots do) until it is caught up.
        self.sums = PoolSums(allocator)
        self.dirty = False         # a swap-in ran: recount the sums

    # --- lazy requests ---------------------------------------------------------------
    def _enter(self, seq: Seq) -> None:
        """After a step: let a decoding request go lazy for as many ticks as it can, to
        the tick that completes it if its room reaches that far."""
        sid = seq.ids[0]
        room = self.allocator.block_room(sid) if self.bulk else self.allocator.room(sid)
        left = seq.shape.output_tokens - seq.generated
        finishes = room >= left
        span = left if finishes else min(room, left - 1)
        if span <= 0:
            return
        self._go_lazy(seq, (self.tick, seq.held, seq.generated, self.tick + span + 1, finishes))

    def _go_lazy(self, seq: Seq, entry: tuple) -> None:
        tick, held, generated, due, finishes = entry[:5]
        last = 0
        bs = self.bs
        if bs:
            self.by_residue[(held - tick) % bs][seq] = None
            if self.cost_block_size:
                self.lazy_blocks += -(-held // bs)
            final = seq.shape.final_tokens
            excess = -final % bs                       # slots of its last block past its final length
            start = (final - 1) // bs * bs             # where its last block starts
            if excess and held <= start and tick + start - held + 1 < due:
                last = tick + start - held + 1
                self.excess[last] = self.excess.get(last, 0) + excess
        entry = (tick, held, generated, due, finishes, last)
        self.lazy[seq] = entry
        self.explicit.pop(seq, None)
        # a request that finishes lazily does so in the completion of tick due - 1
        (self.finishing if finishes else self.due).setdefault(due - finishes, []).append((seq, entry))
        self.lazy_held += held - tick

    def _catch_up(self, seq: Seq) -> tuple:
        """Bring a lazy request's fields, its allocator count and blocks, and its share
        up to date; it leaves the lazy set (returns its entry)."""
        entry = self.lazy.pop(seq)
        tick0, held0, gen0, _, _, last = entry
        k = self.tick - tick0
        seq.held = held = held0 + k
        seq.generated = gen0 + k - self.pending
        final = seq.shape.final_tokens
        share = self.sums.share
        _, _, pad, slots = share[seq]
        new_slots = slots
        bs = self.bs
        if bs:
            del self.by_residue[(held0 - tick0) % bs][seq]
            blocks = -(-held // bs)
            if self.cost_block_size:
                self.lazy_blocks -= blocks
            if blocks * bs > slots:
                new_slots = blocks * bs
            if last > self.tick:                       # its last crossing will not be lazy
                excess = self.excess
                excess[last] -= -final % bs
                if not excess[last]:
                    del excess[last]
        if new_slots > slots:                          # the blocks taken for its crossings, last first
            owed, n = self.owed, (new_slots - slots) // bs
            taken = owed[-n:]
            del owed[-n:]
            taken.reverse()
            self.allocator.extend(seq.ids[0], held, taken)
        else:
            self.allocator.grow(seq.ids[0], held)      # a count only: within its room
        # the sums have followed it tick by tick; its own share is now where they put it
        _, reservation, internal = split_used(held, new_slots, final)
        share[seq] = (reservation, internal, pad, new_slots)
        self.lazy_held -= held0 - tick0
        return entry

    def _materialize(self, seq: Seq) -> None:
        self._catch_up(seq)
        self.explicit[seq] = None

    def materialize_all(self) -> None:
        """Make every lazy request explicit (before a plain pass over the running list)."""
        for seq in list(self.lazy):
            self._materialize(seq)
        self.due.clear()
        self.finishing.clear()
        if self.owed:
            raise InvariantError(f"{len(self.owed)} blocks taken for lazy requests were never attached")

    def _rebase(self, seq: Seq) -> None:
        """Catch a lazy request up in place: it stays lazy, due at the same tick (a tick
        planned but not completed stays its own: the request decodes in it)."""
        entry = self._catch_up(seq)
        self._go_lazy(seq, (self.tick, seq.held, seq.generated + self.pending, entry[3], entry[4]))

    def _resync(self) -> None:
        """After a swap-in (the plain move the sums do not follow): every share recounted."""
        for seq in list(self.lazy):
            self._rebase(seq)
        if self.owed:
            raise InvariantError(f"{len(self.owed)} blocks taken for lazy requests were never attached")
        self.explicit = dict.fromkeys(seq for seq in self.running if seq not in self.lazy)
        self.order = {seq: self.order[seq] for seq in self.running}
        self.sums.recount(self.running)
        self.dirty = False

    def _explicit_in_order(self) -> list[Seq]:
        return sorted(self.explicit, key=self.order.__getitem__)

    # --- the pool ------------------------------------------------------------------
    def breakdown(self, next_seq: NextSeq | None) -> Breakdown:
        return self.sums.breakdown(next_seq)

    def recorded_parts(self, next_seq: NextSeq | None) -> tuple[int, ...]:
        return self.sums.recorded_parts(next_seq)

    def fits(self, seq: Seq, tokens: int, keep_free: int) -> bool:
        return not self.sums.pool_free((seq.shape, tokens, keep_free))[2]

    def free_slots(self) -> int:
        unusable, free, _ = self.sums.pool_free(None)
        return unusable + free

    # --- the engines' hooks --------------------------------------------------------
    def run_running(self, step: Step, now: float, budget, loop):
        """The running pass, lazily where the engine's pass would run every request whole."""
        if not self.lazy:
            return loop(budget)
        work, needs, demand = [], [], len(self.lazy)
        for seq in (self._explicit_in_order() if self.explicit else ()):
            if seq.prefilling and budget is None:      # a pass that only decodes: the engine's
                work = None
                break
            n = seq.target - seq.prefilled if seq.prefilling else 1
            demand += n
            needs.append(sum(self.allocator.slots_to_grow(sid, self._held_after(seq, n)) for sid in seq.ids))
            work.append((seq, n))
        crossing = self._crossing(self.tick + 1)
        if work is None or (budget is not None and demand > budget):
            self.materialize_all()
            return loop(budget)
        if sum(needs) + crossing * (self.bs or 0) > self.free_slots():
            return self._short_pass(step, now, budget, [seq for seq, _ in work])
        # The lazy requests' grows first: in the plain pass they only count, and their
        # blocks may come off the queue in any order (no output depends on which id).
        self._lazy_tick(crossing)
        for seq, n in work:
            if not self.run(seq, n, step, now) or step.preempted:
                raise InvariantError(f"request {seq.spec.id} could not grow in a step that had room "
                                     "for every running request (a kvsim bug)")
        return None if budget is None else budget - demand

    def _short_pass(self, step: Step, now: float, budget, explicit: list[Seq]):
        """The running pass where the free slots do not cover every request's growth
        (`explicit`: the explicit requests in running order). The requests that need
        slots (the explicit ones and the lazy ones at a block boundary) go in running
        order, as in the engine's pass. A lazy one the free slots left cover takes its
        block without preempting, so it stays lazy: its block is taken in bulk
        (`_take_crossings`, before the next request that runs, so that request sees the
        free queue the engine's pass would). Every other one runs through the plain
        `run` (a lazy one made explicit first), which preempts from the back of the
        running list as the engine's pass does (a lazy victim is caught up first;
        victims come after the request that needs the room, so never one served before
        it), and the free slots are counted again. A request preempted before its turn
        is skipped; one that cannot run ends the pass, as in the engines' loops: every
        request after it has been preempted. The lazy requests that need no slot only
        count, as in the plain pass, so they decode lazily."""
        wanting = [(self.order[seq], seq, False) for seq in explicit]
        if self.bs:
            crossers = self.by_residue[(1 - (self.tick + 1)) % self.bs]
            wanting += [(self.order[seq], seq, True) for seq in crossers]
            wanting.sort(key=lambda want: want[0])
        free, bulk, ran = self.free_slots(), 0, 0
        for _, seq, was_lazy in wanting:
            if was_lazy:
                if seq not in self.lazy:          # preempted by a request before it
                    continue
                if free >= self.bs:               # its block is there: it stays lazy
                    free -= self.bs
                    bulk += 1
                    continue
            elif seq not in self.explicit:        # preempted by a request before it
                continue
            self._take_crossings(bulk)
            bulk = 0
            if was_lazy:
                self._materialize(seq)
            n = seq.target - seq.prefilled if seq.prefilling else 1
            if not self.run(seq, n, step, now):
                break
            ran += n
            free = self.free_slots()
        self._take_crossings(bulk)
        self._lazy_tick(0)
        return None if budget is None else budget - ran - len(self.lazy)

    def quiet_tick(self, now: float) -> Step | None:
        """The next step where it can only be every running request decoding lazily (no
        request explicit or due to be, nothing swapped out, the free slots cover the tick's
        crossings, and nothing waiting or, the rules say, its head kept out:
        `rules.head_waits`): what the engine's rules would plan, without their pass
        over the running requests. None otherwise."""
        tick = self.tick + 1
        if (self.swapped or self.explicit or self.dirty or not self.lazy or tick in self.due
                or self._crossing(tick) * (self.bs or 0) > self.free_slots()):
            return None
        if self.waiting:
            waits = self.rules.head_waits(self)
            if waits is None:
                return None
            step = Step(limit=waits[0], head_need=waits[1])
        else:
            self.rules.decode_only(self)
            step = Step(limit="arrivals")
        self.planning(now)
        self._lazy_tick(self._crossing(tick))
        n = step.lazy = len(self.lazy)
        step.cost = StepBatch((), (), Decodes(n, self.lazy_held + n * self.tick, self.lazy_blocks,
                                              self.cost_block_size))
        return step

    def _take_crossings(self, crossing: int) -> None:
        """`crossing` lazy requests take a block at the next tick: their new blocks, in
        bulk (which id goes where does not matter), attached when they are caught up."""
        if crossing:
            sums = self.sums
            self.owed += self.allocator.take_free(crossing)
            sums.version += 1
            sums.reservation += crossing * self.bs
            sums.slots += crossing * self.bs
            if self.cost_block_size:
                self.lazy_blocks += crossing

    def _lazy_tick(self, crossing: int) -> None:
        """Every lazy request decodes one token; `crossing` of them take a block (if they
        have not yet: _take_crossings)."""
        self._take_crossings(crossing)
        sums = self.sums
        self.tick += 1
        self.pending = True
        sums.reservation -= len(self.lazy)
        excess = self.excess.pop(self.tick, 0)        # crossings into a last, partly used block
        sums.reservation -= excess
        sums.internal += excess

    def _crossing(self, tick: int) -> int:
        """Lazy requests that take a block at `tick` (their held tokens fill their last block)."""
        return len(self.by_residue[(1 - tick) % self.bs]) if self.bs else 0

    def prefilling_running(self) -> list[Seq]:
        return [q for q in self._explicit_in_order() if q.prefilling]

    def decode_slots_needed(self) -> int:
        needed = sum(self.allocator.slots_to_grow(k, q.held + 1)
                     for q in self.explicit if not q.prefilling for k in q.ids)
        needed += self._crossing(self.tick + 1) * (self.bs or 0)
        if needed > self.free_slots():     # the engine will look at every decoding request
            self.materialize_all()
        return needed

    def run(self, seq: Seq, n: int, step: Step, now: float) -> bool:
        ran = super().run(seq, n, step, now)
        self.sums.version += 1
        return ran

    def _start(self, seq: Seq, n: int, step: Step, now: float) -> None:
        super()._start(seq, n, step, now)
        self.sums.version += 1
        self._admissions += 1
        self.order[seq] = self._admissions
        self.explicit[seq] = None

    def preempt(self, seq: Seq, step: Step, mode: str | None = None) -> None:
        if seq in self.lazy:
            self._materialize(seq)
        super().preempt(seq, step, mode)
        self._leave(seq)

    def abort(self, index: int, end_s: float) -> Seq | None:
        seq = next((s for s in self.running if arrival_index(s) == index), None)
        if seq in self.lazy:
            self._materialize(seq)
        out = super().abort(index, end_s)
        if seq is not None:
            self._leave(seq)
        return out

    def reject(self, seq: Seq, now: float, reason: str, step: Step) -> None:
        super().reject(seq, now, reason, step)
        if seq in self.explicit:                  # a running request found unable to grow
            self._leave(seq)
        self.sums.version += 1

    def _leave(self, seq: Seq) -> None:
        """A running request left the running list (its KV freed): out of the sums."""
        self.sums.drop(seq)
        del self.explicit[seq], self.order[seq]
        self.sums.version += 1

    def swap_in(self, seq: Seq, step: Step, now: float, keep_free: int = 0) -> bool:
        self.dirty = True
        return super().swap_in(seq, step, now, keep_free)

    # --- one step ------------------------------------------------------------------
    def schedule(self, now: float) -> Step:
        """The plain scheduler's step, with the due lazy requests made explicit first and
        the lazy ones that decoded in it added to its batch in sum."""
        for seq, entry in self.due.pop(self.tick + 1, ()):
            if self.lazy.get(seq) is entry:
                self._materialize(seq)
        if self.dirty:
            self._resync()
        if self.lazy and not self.rules.lazy_ok(self):
            self.materialize_all()
        tick = self.tick
        step = super().schedule(now)
        if self.tick != tick and self.lazy:
            n = step.lazy = len(self.lazy)
            step.cost = StepBatch(step.cost.prefills, step.cost.decode_contexts,
                                  Decodes(n, self.lazy_held + n * self.tick, self.lazy_blocks,
                                          self.cost_block_size))
        if self.dirty:
            self._resync()
        elif step.work:
            for seq, n in step.work:
                if seq in self.explicit:
                    self.sums.update(seq)
            self.sums.version += 1
        return step

    def complete(self, step: Step, now: float) -> list[Seq]:
        """The plain completion, with the lazy requests this tick completes made explicit
        and put among the step's work in running order (where the plain pass has them)."""
        if self.pending:
            done = [seq for seq, entry in self.finishing.pop(self.tick, ()) if self.lazy.get(seq) is entry]
            if done:
                for seq in done:
                    self._materialize(seq)
                step.work = sorted([*step.work, *((seq, 1) for seq in done)],
                                   key=lambda work: self.order[work[0]])
        self.pending = False
        finished = super().complete(step, now)
        for seq in finished:
            self.sums.drop(seq)
            del self.explicit[seq], self.order[seq]
        if finished:
            self.sums.version += 1
        for seq, n in step.work:
            if not seq.outcome and not seq.prefilling and seq in self.explicit:
                self._enter(seq)
        return finished

    def check(self) -> None:
        """The plain checks on every request's true counts (lazy ones are caught up in
        place and stay lazy), then this scheduler's sums against the allocator."""
        for seq in list(self.lazy):
            self._rebase(seq)
        super().check()
        head = self.waiting[0] if self.waiting else None
        nxt = None if head is None else (head.shape, head.target + 1, self.keep_free)
        mine, theirs = self.breakdown(nxt), self.allocator.breakdown(nxt)
        if mine != theirs:
            raise InvariantError(f"the lazy scheduler's breakdown {mine} is not the allocator's {theirs}")
        if set(self.running) != set(self.lazy) | set(self.explicit) or set(self.lazy) & set(self.explicit):
            raise InvariantError("a running request is neither lazy nor explicit, or both")
        held = sum(e[1] - e[0] for e in self.lazy.values())
        blocks = sum(-(-e[1] // self.bs) for e in self.lazy.values()) if self.cost_block_size else 0
        if held != self.lazy_held or blocks != self.lazy_blocks:
            raise InvariantError("the lazy requests' sums are stale")
        for seq in self.running:
            slots, pad = self.allocator.slots_of(seq.ids[0])
            if self.sums.share[seq] != (*split_used(seq.held, slots, seq.shape.final_tokens)[1:], pad, slots):
                raise InvariantError(f"request {seq.spec.id}'s share of the breakdown is stale")
