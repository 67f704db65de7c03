"""What a run records, kept compact: per-step rows and per-sequence outcomes, in columns.

A step's row is a tuple of numbers (kvsim.sim.loop.STEP_FIELDS). Rows are gathered in a
short list and packed every CHUNK rows into a float64 block, so a run of millions of
steps holds 8 bytes per field per step instead of a Python tuple per step. Integer
fields stay exact (float64 holds every integer below 2**53) and come back as int64.

A sequence's outcome (when it was admitted, produced its first token and finished, how
often it was preempted, how it ended and why) is written into arrays when it ends, or
when the run does, so a run keeps objects only for the requests in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Iterator, NamedTuple, Sequence

import numpy as np

CHUNK = 4096


class PoolParts(NamedTuple):
    """What a step records of the KV pool's breakdown (kvsim.kvcache.base.Breakdown), in slots."""

    token: int
    reservation: int
    internal: int
    external: int
    free: int
    allocated: int
    shared: int


class StepLog:
    """Rows of `fields`, the ones named in `ints` integers, in the order appended."""

    bucketed = False

    def __init__(self, fields: Sequence[str], ints: Sequence[str] = ()):
        self.fields = tuple(fields)
        self.ints = frozenset(ints)
        self._rows: list[tuple] = []
        self._blocks: list[np.ndarray] = []
        self._packed = 0

    def append(self, row: tuple) -> None:
        rows = self._rows
        rows.append(row)
        if len(rows) == CHUNK:
            self._pack()

    def _packed_rows(self) -> np.ndarray:
        """The gathered rows as a (rows, fields) float64 block (read as one stream of
        numbers: quicker than numpy's walk over a list of tuples); the list emptied."""
        rows, width = self._rows, len(self.fields)
        self._rows = []
        return np.fromiter(chain.from_iterable(rows), np.float64, len(rows) * width).reshape(-1, width)

    def _pack(self) -> None:
        if self._rows:
            self._packed += len(self._rows)
            self._blocks.append(self._packed_rows())

    def __len__(self) -> int:
        return self._packed + len(self._rows)

    def array(self) -> np.ndarray:
        """Every row as one (steps, fields) float64 array."""
        self._pack()
        if not self._blocks:
            return np.empty((0, len(self.fields)))
        if len(self._blocks) > 1:
            self._blocks = [np.concatenate(self._blocks)]
        return self._blocks[0]

    def columns(self) -> dict[str, np.ndarray]:
        """Each field as an array: int64 for the integer fields, float64 for the others."""
        a = self.array()
        return {
            name: a[:, i].astype(np.int64) if name in self.ints else a[:, i].copy()
            for i, name in enumerate(self.fields)
        }

    def _row(self, values: np.ndarray) -> tuple:
        return tuple(int(v) if name in self.ints else float(v) for name, v in zip(self.fields, values))

    def __getitem__(self, i: int) -> tuple:
        return self._row(self.array()[i])

    def __iter__(self) -> Iterator[tuple]:
        return (self._row(values) for values in self.array())


class BucketLog(StepLog):
    """Steps summed per fixed time bucket (by the time each step starts) instead of kept:
    what a long run records, in memory bounded by its length in buckets. Each bucket
    holds the sums a summary needs (steps, busy time, time-weighted fields, time per
    limit, fields weighted over memory-bound steps) and the largest batch, so sums and
    time-weighted means over the run are those of the steps, up to the order of
    floating-point additions. `limit_field` names the field holding a limit code, of
    `limits` codes; `memory` is the code whose steps are memory-bound."""

    bucketed = True

    def __init__(
        self,
        fields: Sequence[str],
        ints: Sequence[str],
        bucket_s: float,
        *,
        totals: Sequence[str],
        weighted: Sequence[str],
        limits: int,
        memory: int,
        limit_field: str = "limit",
        peaks: Sequence[str] = ("running",),
    ):
        super().__init__(fields, ints)
        self.bucket_s = bucket_s
        self.col = {name: i for i, name in enumerate(fields)}
        self.totals, self.weighted = tuple(totals), tuple(weighted)
        self.limits, self.memory, self.limit_field = limits, memory, limit_field
        self.sums = (
            "steps",
            "busy",
            *self.totals,
            *(f"dt_{f}" for f in self.weighted),
            *(f"dt_limit_{i}" for i in range(limits)),
            *(f"w_{f}" for f in self.weighted),
        )
        self.acc = np.zeros((0, len(self.sums)))
        self.peak: dict[str, np.ndarray] = {f: np.zeros(0) for f in peaks}
        self._steps = 0

    def _pack(self) -> None:
        if not self._rows:
            return
        self._steps += len(self._rows)
        a = self._packed_rows()
        bucket = np.floor(a[:, self.col["time_s"]] / self.bucket_s).astype(np.int64)
        if bucket[-1] >= len(self.acc):
            self.acc = np.vstack([self.acc, np.zeros((bucket[-1] + 1 - len(self.acc), len(self.sums)))])
        lo, hi = bucket[0], bucket[-1] + 1
        dt = a[:, self.col["step_s"]]
        limit = a[:, self.col[self.limit_field]]
        w = dt * (limit == self.memory)
        parts = [
            np.ones(len(a)),
            dt,
            *(a[:, self.col[f]] for f in self.totals),
            *(dt * a[:, self.col[f]] for f in self.weighted),
            *(dt * (limit == i) for i in range(self.limits)),
            *(w * a[:, self.col[f]] for f in self.weighted),
        ]
        for j, weights in enumerate(parts):
            self.acc[lo:hi, j] += np.bincount(bucket - lo, weights=weights, minlength=hi - lo)
        for f, peak in self.peak.items():
            if hi > len(peak):
                peak = self.peak[f] = np.concatenate([peak, np.full(hi - len(peak), -np.inf)])
            np.maximum.at(peak, bucket, a[:, self.col[f]])

    def __len__(self) -> int:
        return self._steps + len(self._rows)

    def buckets(self) -> dict[str, np.ndarray]:
        """Per bucket that holds a step: its index and every sum (see `sums`), and each
        integer field's largest value as peak_<field>."""
        self._pack()
        used = np.flatnonzero(self.acc[:, 0]) if len(self.acc) else np.zeros(0, dtype=np.int64)
        out = {"bucket": used, **{name: self.acc[used, j] for j, name in enumerate(self.sums)}}
        out.update({f"peak_{f}": peak[used] for f, peak in self.peak.items()})
        return out

    def array(self) -> np.ndarray:
        raise TypeError("a BucketLog keeps sums per time bucket, not the steps")


class MergedLog:
    """Several replicas' logs read as one (a fleet's): their rows, or their buckets, one
    replica after another. Sums and time-weighted means over it are over replica-time."""

    def __init__(self, logs: Sequence[StepLog]):
        self.logs = list(logs)
        self.bucketed = self.logs[0].bucketed
        self.bucket_s = getattr(self.logs[0], "bucket_s", None)

    def __len__(self) -> int:
        return sum(len(log) for log in self.logs)

    def array(self) -> np.ndarray:
        return np.concatenate([log.array() for log in self.logs])

    def buckets(self) -> dict[str, np.ndarray]:
        parts = [log.buckets() for log in self.logs]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


OUTCOMES = ("unfinished", "completed", "rejected", "timed out")


@dataclass(frozen=True)
class SeqRecord:
    """One sequence's outcome, as a view (outcome "" while unfinished, as on a live Seq)."""

    spec: object  # its RequestSpec
    shape: object  # its SeqShape
    admitted_s: float
    first_token_s: float
    finish_s: float
    preemptions: int
    outcome: str
    reason: str


class SeqLog:
    """Outcomes of `n` sequences by index (kvsim.sim.loop numbers them in arrival order)."""

    def __init__(self, n: int):
        self.admitted_s = np.full(n, np.nan)
        self.first_token_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.outcome = np.zeros(n, dtype=np.int8)  # an index into OUTCOMES
        self.reasons: dict[int, str] = {}  # only rejected ones have one
        self.stalls: dict[int, tuple] = {}  # only preempted ones (Seq.stalls)

    def __len__(self) -> int:
        return len(self.outcome)

    def record_outcome(self, index: int, seq) -> None:
        """Record where a sequence stands (kvsim.sim.scheduler.Seq); it may be dropped after."""
        self.admitted_s[index] = seq.admitted_s
        self.first_token_s[index] = seq.first_token_s
        self.finish_s[index] = seq.finish_s
        self.preemptions[index] = seq.preemptions
        self.outcome[index] = OUTCOMES.index(seq.outcome or "unfinished")
        if seq.reason:
            self.reasons[index] = seq.reason
        if seq.stalls:
            self.stalls[index] = seq.stalls

    def names(self) -> np.ndarray:
        """Each outcome's name."""
        return np.array(OUTCOMES, dtype=object)[self.outcome]

    def reason_column(self) -> np.ndarray:
        out = np.full(len(self), "", dtype=object)
        for index, reason in self.reasons.items():
            out[index] = reason
        return out

    def record(self, index: int, spec, shape) -> SeqRecord:
        outcome = int(self.outcome[index])
        return SeqRecord(
            spec,
            shape,
            float(self.admitted_s[index]),
            float(self.first_token_s[index]),
            float(self.finish_s[index]),
            int(self.preemptions[index]),
            OUTCOMES[outcome] if outcome else "",
            self.reasons.get(index, ""),
        )
