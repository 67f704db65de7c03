"""The request stream as the simulation reads it: one request (RequestSpec), or every
request of a run in columns (RequestTable), whichever way it was made (drawn from
distributions: kvsim.workload.requests; read from a trace: kvsim.workload.traces).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.kvcache import SeqShape
from kvsim.workload.stages import StagePlan

NO_TAIL = np.iinfo(np.int64).min  # a RequestTable's tail id for "the request's own id"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    segments: tuple[tuple[int, int], ...] = ()  # shared content the prompt starts with
    tail_id: int | None = None  # content id of the rest; default: id

    @property
    def shape(self) -> SeqShape:
        tail = self.id if self.tail_id is None else self.tail_id
        return SeqShape(self.prompt_tokens, self.output_tokens, self.segments, tail)

    @property
    def prompt_runs(self) -> tuple[tuple[int, int], ...]:
        """The prompt as (content id, length) runs: its shared segments, then its own
        tokens (its tail content from offset 0)."""
        shape = self.shape
        own = self.prompt_tokens - sum(length for _, length in shape.segments)
        return shape.segments + (((shape.tail_id, own),) if own > 0 else ())


class RequestTable:
    """The request stream as columns, one row per request: what a run of a million
    requests holds instead of a million objects. A row becomes a RequestSpec only when
    asked for (`table[i]`, iteration), as the engine does at its arrival.

    segments: each request's shared runs (None: none has any); tail_ids: each request's
    tail content (None: its id); ids: request ids (None: 0, 1, 2, ...); stage: each
    request's load stage (None: all 0) and plan the stages (kvsim.workload.stages)."""

    def __init__(
        self,
        arrival_s,
        prompt_tokens,
        output_tokens,
        segments=None,
        tail_ids=None,
        ids=None,
        stage=None,
        plan: StagePlan | None = None,
    ):
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(output_tokens, dtype=np.int64)
        self.segments = segments
        self.tail_ids = None if tail_ids is None else np.asarray(tail_ids, dtype=np.int64)
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64)
        self.stage = None if stage is None else np.asarray(stage, dtype=np.int64)
        self.plan = plan
        self._private = None  # private_tails, once asked

    @classmethod
    def of(cls, specs) -> "RequestTable":
        """A table of RequestSpecs (a table is returned as it is)."""
        if isinstance(specs, RequestTable):
            return specs
        specs = list(specs)
        tails = [s.tail_id for s in specs]
        return cls(
            [s.arrival_s for s in specs],
            [s.prompt_tokens for s in specs],
            [s.output_tokens for s in specs],
            [s.segments for s in specs],
            None if all(t is None for t in tails) else [NO_TAIL if t is None else t for t in tails],
            [s.id for s in specs],
        )

    def id_column(self) -> np.ndarray:
        return np.arange(len(self), dtype=np.int64) if self.ids is None else self.ids

    def __len__(self) -> int:
        return len(self.arrival_s)

    def private_tails(self) -> bool:
        """Whether each request's tail content (the rest of its prompt and its output) is
        its own: no other request has the same tail or holds it among its shared runs (an
        earlier turn of a conversation is a later turn's run). Then no key of a block that
        holds output can be looked up by another request (kvsim.kvcache.prefix)."""
        if self._private is None:
            ids = self.id_column()
            tails = ids if self.tail_ids is None else np.where(self.tail_ids == NO_TAIL, ids, self.tail_ids)
            tails = np.sort(tails[tails != -1])  # (not np.unique: its first call imports numpy.ma)
            runs = {content for segments in set(self.segments or ()) for content, _ in segments}
            self._private = bool(not (tails[1:] == tails[:-1]).any() and runs.isdisjoint(tails.tolist()))
        return self._private

    def __getitem__(self, i: int) -> RequestSpec:
        n = len(self.arrival_s)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        # `item` gives the Python int or float without a NumPy scalar in between (the
        # engine asks for every request once or twice)
        rid = i if self.ids is None else self.ids.item(i)
        tail = None if self.tail_ids is None else self.tail_ids.item(i)
        return RequestSpec(
            rid,
            self.arrival_s.item(i),
            self.prompt_tokens.item(i),
            self.output_tokens.item(i),
            self.segments[i] if self.segments else (),
            None if tail == NO_TAIL else tail,
        )

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None
