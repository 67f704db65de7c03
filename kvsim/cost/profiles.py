"""Step-cost profiles: measured per-operator kernel times on disk, and lookup.

A profile is a folder (shipped ones live in kvsim/data/profiles/<name>/):

* ``meta.json`` — ``format`` ("kvsim-profile/1"), ``name``, ``device`` (what measured
  it), ``gpu`` (the kvsim GPU preset it stands for), ``model`` (the shape: layers,
  heads, KV heads, head_dim, hidden, FFN, vocab, gated MLP), ``dtype``, ``date``,
  ``tools`` (versions), ``source`` and ``license``, ``origin`` per part (measured,
  borrowed, predicted), ``attention`` (fitted forms, kvsim.cost.fit), ``allreduce``
  (bus GB/s and latency), ``step_overhead_s`` and free-text ``notes``; a profile made
  by `kvsim calibrate` adds ``validation``, whole forward steps measured against its
  prediction (kvsim.calibrate.validate).
* ``linear.csv`` — one row per (tp, num_tokens): per-layer milliseconds of every
  linear-layer op (kvsim.cost.fit.LINEAR_OPS); ``emb`` and ``lm_head`` are per step
  (``lm_head`` by the number of sequences that produce logits).
* ``attention.csv`` (optional) — measured attention points: phase, tp, batch_size,
  chunk_tokens, context, block_size, kv_dtype, kv_bits, time_ms, kv_write_ms. Only used to
  report held-out error; the cost model uses the fitted forms in meta.json.

Interpolation is piecewise linear in the token count between measured points. Beyond
the largest measured count, time grows in proportion to tokens from the last point
(large GEMMs are compute-bound); a tensor-parallel degree that was not measured scales
the nearest measured one (sharded ops by tp_measured / tp, replicated ops unchanged).
Both are counted as extrapolation by the cost model, never silent.
"""

from __future__ import annotations

import bisect
import csv
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvsim.config.errors import InputError
from kvsim.cost.fit import LINEAR_OPS

FORMAT = "kvsim-profile/1"
SHIPPED = Path(__file__).parent.parent / "data" / "profiles"
REPLICATED_OPS = ("emb", "input_layernorm", "post_attention_layernorm", "add")
ATTENTION_COLUMNS = (
    "phase",
    "tp",
    "batch_size",
    "chunk_tokens",
    "context",
    "block_size",
    "kv_dtype",
    "kv_bits",
    "time_ms",
    "kv_write_ms",
)


class Profile:
    """A profile: `meta`, `linear` (a DataFrame: tp, num_tokens, one column of ms per op)
    and `attention_rows` (a DataFrame or None). One read from disk holds its linear table
    as plain columns and makes the DataFrames only when they are asked for: a run prices
    its steps from the columns, so it need not import pandas before it simulates."""

    def __init__(self, meta: dict, linear, attention_rows=None):
        """linear: a DataFrame, or {column: list of numbers} as read from linear.csv;
        attention_rows: a DataFrame, None, or the path of attention.csv (read when asked)."""
        self.meta = meta
        self._linear = linear
        self._attention = attention_rows
        self._tables: dict = {}

    @property
    def linear(self):
        if isinstance(self._linear, dict):
            import pandas as pd

            self._linear = pd.DataFrame(self._linear)
        return self._linear

    @property
    def attention_rows(self):
        if isinstance(self._attention, Path):
            import pandas as pd

            self._attention = pd.read_csv(self._attention)
        return self._attention

    def _column(self, name: str) -> np.ndarray:
        lin = self._linear
        return np.asarray(lin[name] if isinstance(lin, dict) else lin[name].to_numpy())

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def tps(self) -> list[int]:
        if "tps" not in self._tables:
            # (not np.unique: its first call imports numpy.ma, in every worker process)
            self._tables["tps"] = sorted({int(t) for t in self._column("tp")})
        return self._tables["tps"]

    def table(self, tp: int, envelope: bool = False) -> tuple[list[int], dict[str, list[float]]]:
        """Token grid and seconds per op for one measured tp (cached, plain lists for speed),
        as measured or as their envelope (`_envelope`)."""
        if (tp, envelope) not in self._tables:
            if tp not in self._tables:
                rows = np.flatnonzero(self._column("tp") == tp)
                rows = rows[np.argsort(self._column("num_tokens")[rows], kind="stable")]
                self._tables[tp] = (
                    [int(n) for n in self._column("num_tokens")[rows]],
                    {op: [float(v) * 1e-3 for v in self._column(op)[rows]] for op in LINEAR_OPS},
                )
            grid, table = self._tables[tp]
            self._tables[tp, envelope] = (
                (grid, {op: _envelope(ys) for op, ys in table.items()}) if envelope else (grid, table)
            )
        return self._tables[tp, envelope]

    def op_time(self, op: str, tokens: float, tp: int, envelope: bool = False) -> tuple[float, str | None]:
        """Seconds of one op at `tokens` and `tp`, and why it was extrapolated (or None)."""
        t, why = self.ops_time((op,), tokens, tp, envelope)
        return t, (why[0] if why else None)

    def ops_time(self, ops, tokens: float, tp: int, envelope: bool = False) -> tuple[float, list[str]]:
        """Seconds of several ops at `tokens` and `tp`, each op_time's added in order, and
        each one's reason where it extrapolated: the grid is searched once for them all.
        envelope: read the measured times as their envelope (`_envelope`)."""
        why, tps = None, self.tps
        measured = tp if tp in tps else min(tps, key=lambda t: (abs(np.log2(t / tp)), t))
        if measured != tp:
            why = f"tp {tp} not measured (scaled from tp {measured})"
        grid, table = self.table(measured, envelope)
        if tokens > grid[-1]:
            why = why or f"linear ops beyond {grid[-1]} measured tokens (scaled in proportion)"
        at = bisect.bisect_right(grid, tokens)
        total = 0.0
        for op in ops:
            t = _interp(grid, table[op], tokens, at)
            if measured != tp and op not in REPLICATED_OPS:
                t *= measured / tp
            total += t
        return total, [why] * len(ops) if why else []


def _envelope(ys: list[float]) -> list[float]:
    """Each time at most every time measured at more tokens (the running minimum from the
    largest size down): the times of a kernel library that picks, at every size, a kernel
    no slower than one it runs at a larger size (which, padded, computes the smaller one).
    Profiles record the picks of the library they were measured with: the H100 Llama-2-7B
    profile's QKV projection (vidur's, a 2024 stack) takes 60% longer at 72-96 tokens than
    at 104, where kvsim's own H200 calibration of that model (PyTorch 2.11, CUDA 13.0,
    tests/data/h200-calibrate) rises smoothly through those sizes."""
    out, low = list(ys), float("inf")
    for i in range(len(out) - 1, -1, -1):
        low = out[i] = min(out[i], low)
    return out


def _interp(xs: list[int], ys: list[float], x: float, i: int) -> float:
    """Piecewise linear; proportional to x beyond the last point. i: bisect_right(xs, x),
    searched once by the caller for every op on the same grid."""
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    if i == 0:
        return ys[0]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# --- disk ---------------------------------------------------------------------------
@lru_cache(maxsize=None)
def shipped_names() -> tuple[str, ...]:
    """The shipped profiles' names (the folder is read once: each policy's cost model
    asks for them)."""
    return tuple(sorted(p.parent.name for p in SHIPPED.glob("*/meta.json")))


def load_profile(
    ref: str | Path, base_dir: Path = Path("."), src: str = "command line", field_name: str = "--profile"
) -> Profile:
    """A shipped profile by name, or a folder (relative to base_dir)."""
    ref = str(ref)
    if ref in shipped_names():
        return _shipped(ref)
    folder = Path(base_dir) / ref
    if not (folder / "meta.json").is_file():
        raise InputError(
            src,
            field_name,
            f"no profile '{ref}': not a shipped profile ({', '.join(shipped_names())}) and no {folder / 'meta.json'}",
        )
    return _read(folder.resolve(), src, field_name)


@lru_cache(maxsize=None)
def shipped_meta(name: str) -> dict:
    """A shipped profile's meta.json alone (choosing among them need not read their tables)."""
    return json.loads((SHIPPED / name / "meta.json").read_text())


@lru_cache(maxsize=None)
def _shipped(name: str) -> Profile:
    return _read(SHIPPED / name, "kvsim", f"shipped profile {name}")


def _read(folder: Path, src: str, field_name: str) -> Profile:
    try:
        meta = json.loads((folder / "meta.json").read_text())
        linear = _read_columns(folder / "linear.csv")
    except (OSError, ValueError) as e:
        raise InputError(src, field_name, f"profile {folder} cannot be read: {e}") from None
    if meta.get("format") != FORMAT:
        raise InputError(src, field_name, f"{folder}/meta.json: format must be '{FORMAT}'")
    missing = [c for c in ("tp", "num_tokens", *LINEAR_OPS) if c not in linear]
    missing += [k for k in ("name", "gpu", "model", "attention", "allreduce") if k not in meta]
    if missing:
        raise InputError(src, field_name, f"profile {folder} lacks {', '.join(missing)}")
    att = folder / "attention.csv"
    return Profile(meta, linear, att if att.is_file() else None)


def _read_columns(path: Path) -> dict[str, list]:
    """A CSV of numbers as {column: values}: int where every cell of it is one, else float
    (pandas' types for such a file), without pandas."""
    with open(path, newline="") as f:
        head, *rows = list(csv.reader(f))
    if any(len(r) != len(head) for r in rows):
        raise ValueError(f"{path.name}: every row must have {len(head)} cells")
    columns: dict[str, list] = {}
    for i, name in enumerate(head):
        cells = [r[i] for r in rows]
        try:
            columns[name] = [int(c) for c in cells]
        except ValueError:
            columns[name] = [float(c) for c in cells]
    return columns


def save_profile(profile: Profile, folder: str | Path) -> Path:
    """Write meta.json, linear.csv and attention.csv (if any) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps(profile.meta, indent=1, sort_keys=True) + "\n")
    lin = profile.linear.sort_values(["tp", "num_tokens"])[["tp", "num_tokens", *LINEAR_OPS]]
    lin.to_csv(folder / "linear.csv", index=False, float_format="%.5g")
    if profile.attention_rows is not None:
        profile.attention_rows[list(ATTENTION_COLUMNS)].to_csv(
            folder / "attention.csv", index=False, float_format="%.5g"
        )
    return folder
