"""What a run records per step, kept compact: one row per step in packed columns.

A step's row is a tuple of numbers (kvsim.engine.STEP_FIELDS). Rows are gathered in a
short list and packed every CHUNK rows into a float64 block, so a run of millions of
steps holds 8 bytes per field per step instead of a Python tuple per step. Integer
fields stay exact (float64 holds every integer below 2**53) and come back as int64.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

CHUNK = 4096


class StepLog:
    """Rows of `fields`, the ones named in `ints` integers, in the order appended."""

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

    def _pack(self) -> None:
        if self._rows:
            self._blocks.append(np.array(self._rows, dtype=np.float64).reshape(-1, len(self.fields)))
            self._packed += len(self._rows)
            self._rows = []

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
        return {name: a[:, i].astype(np.int64) if name in self.ints else a[:, i].copy()
                for i, name in enumerate(self.fields)}

    def _row(self, values: np.ndarray) -> tuple:
        return tuple(int(v) if name in self.ints else float(v) for name, v in zip(self.fields, values))

    def __getitem__(self, i: int) -> tuple:
        return self._row(self.array()[i])

    def __iter__(self) -> Iterator[tuple]:
        return (self._row(values) for values in self.array())
