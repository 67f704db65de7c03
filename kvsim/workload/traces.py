"""Request traces: the file formats kvsim replays, told apart by their content.

A trace gives each request's arrival and lengths; a Mooncake trace also gives its
prompt's identity, so prefix caches, routers and tiers see the trace's real sharing.

  kvsim CSV   arrived_at | arrival_s | arrival_time (seconds), num_prefill_tokens |
              prompt_tokens, num_decode_tokens | output_tokens (the columns of
              microsoft/vidur's processed traces; arrivals kept as in the file)
  Azure CSV   TIMESTAMP (a date and time), ContextTokens, GeneratedTokens: the Azure LLM
              inference traces 2023 and 2024 as published (Azure/AzurePublicDataset,
              AzureLLMInferenceDataset2023.md and 2024.md); arrivals in seconds after the
              first request
  BurstGPT    Timestamp (seconds), Request tokens, Response tokens (HPMLL/BurstGPT,
              README's schema). Its README marks failed requests by 0 response tokens;
              those rows are left out (nothing was generated for them to replay)
  Mooncake    JSON lines {"timestamp": ms, "input_length", "output_length", "hash_ids"}
              (kvcache-ai/Mooncake FAST25-release/; Qin et al., FAST 2025). `hash_ids`
              holds one id per 512-token block of the prompt, chained (equal ids mean
              equal prefixes); it may be shorter than the prompt (the rest is the
              request's own) or absent

A file whose first character is "{" is read as JSON lines, anything else as CSV, whose
header says which CSV format it is. Every kind of bad content becomes one InputError
naming the file, the field ("file", "columns", "rows" or "line N", the file's 1-based
line) and what is allowed.

Token identity (`trace_requests`): block i of a prompt, tokens [512 i, 512 (i + 1)) (the
last may be shorter), is content run (n + hash_ids[i], length) of the request's
`segments` (kvsim.kvcache.SeqShape), where n is the number of requests (ids below n
are the requests' own tails). A 16-token block of a paged cache is then identified by
its 512-token block's id and its place in it, as the trace means; the prefix caches key
the chain of runs themselves, so equal ids after different prefixes stay apart.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.config.errors import InputError
from kvsim.workload.table import RequestTable

HASH_BLOCK_TOKENS = 512  # tokens per Mooncake hash id
MAX_TOKENS = 2**31 - 1
MAX_HASH_ID = 2**62  # ids plus the request count stay inside int64
COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")

# format -> output column -> accepted header names, in order of preference
_CSV_FORMATS = {
    "kvsim": {
        "arrival_s": ("arrived_at", "arrival_s", "arrival_time"),
        "prompt_tokens": ("num_prefill_tokens", "prompt_tokens"),
        "output_tokens": ("num_decode_tokens", "output_tokens"),
    },
    "azure": {"arrival_s": ("TIMESTAMP",), "prompt_tokens": ("ContextTokens",), "output_tokens": ("GeneratedTokens",)},
    "burstgpt": {
        "arrival_s": ("Timestamp",),
        "prompt_tokens": ("Request tokens",),
        "output_tokens": ("Response tokens",),
    },
}
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
OTHER_FORMATS = (
    "or an Azure LLM trace (TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT "
    "(Timestamp, Request tokens, Response tokens) or Mooncake JSON lines"
)


def read_trace(path) -> pd.DataFrame:
    """The trace as columns arrival_s (float seconds), prompt_tokens and output_tokens
    (int64, >= 1), stably sorted by arrival, plus hash_ids (a tuple of ints per request)
    for a Mooncake trace. Other CSV columns are ignored."""
    src = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(src, "file", "no such file; expected a request trace") from None
    except OSError as exc:
        raise InputError(src, "file", f"cannot read ({exc.strerror or exc}); expected a request trace") from None
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(src, "file", "not a text CSV file (binary or not UTF-8)") from None
    frame = _read_jsonl(src, text) if text.lstrip().startswith("{") else _read_csv(src, text)
    return frame.sort_values("arrival_s", kind="stable").reset_index(drop=True)


def trace_requests(path, num_requests: int | None = None, time_scale: float = 1.0):
    """The trace's first `num_requests` requests (all when None) as a RequestTable, with
    arrivals multiplied by `time_scale` (> 1 stretches them, < 1 compresses) and, for a
    Mooncake trace, each prompt's hash blocks as its shared segments (module docstring)."""
    frame = read_trace(path)
    if num_requests is not None:
        frame = frame.iloc[:num_requests]
    arrival, prompt, output = (frame[c].to_numpy() for c in COLUMNS)
    segments = hash_segments(frame["hash_ids"], prompt) if "hash_ids" in frame else None
    return RequestTable(arrival * time_scale, prompt, output, segments)


def hash_segments(hash_ids, prompt_tokens) -> list[tuple[tuple[int, int], ...]]:
    """Each prompt's hash blocks as (content id, tokens) runs; content n + id."""
    n, size = len(prompt_tokens), HASH_BLOCK_TOKENS
    out = []
    for ids, tokens in zip(hash_ids, prompt_tokens.tolist()):
        runs = [(n + h, size) for h in ids]
        if runs and len(ids) * size > tokens:  # the last block is partly filled
            runs[-1] = (n + ids[-1], tokens - (len(ids) - 1) * size)
        out.append(tuple(runs))
    return out


# ------------------------------------------------------------------ CSV formats


def _read_csv(src: str, text: str) -> pd.DataFrame:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [" ".join(h.split()) for h in next(reader, [])]  # one-line names
        rows, lines = [], []
        for row in reader:
            if row and any(cell.strip() for cell in row):
                rows.append(row)
                lines.append(reader.line_num)
    except csv.Error as exc:
        raise InputError(src, f"line {reader.line_num}", f"malformed CSV ({exc})") from None

    # the format whose columns the header names most of (kvsim's own on a tie)
    kind = max(_CSV_FORMATS, key=lambda k: sum(any(c in header for c in names) for names in _CSV_FORMATS[k].values()))
    index = {}
    for out, names in _CSV_FORMATS[kind].items():
        present = [c for c in names if c in header]
        if len(present) != 1:
            found = ", ".join(header) if any(header) else "none"
            problem = "several columns for" if present else "missing column for"
            raise InputError(
                src,
                "columns",
                f"{problem} {out}: accepted names are {' / '.join(names)} (found: {found}); {OTHER_FORMATS}",
            )
        index[out] = header.index(present[0])
    if not rows:
        raise InputError(src, "rows", "no data rows; expected at least one request")
    for row, line in zip(rows, lines):
        if len(row) != len(header):
            raise InputError(src, f"line {line}", f"{len(row)} fields, the header has {len(header)}")

    columns = {}
    for out, i in index.items():
        cells = [r[i] for r in rows]
        if out == "arrival_s" and kind == "azure":
            columns[out] = _parse_dates(src, cells, lines, header[i])
        else:  # BurstGPT's failed requests have 0 response tokens
            least = 0 if kind == "burstgpt" and out == "output_tokens" else 1
            columns[out] = _parse_column(src, cells, lines, out, header[i], least)
    if kind == "burstgpt":  # failed requests are not replayed: nothing was generated
        done = columns["output_tokens"] > 0
        if not done.any():
            raise InputError(src, "rows", "every request failed (0 response tokens); nothing to replay")
        columns = {out: values[done] for out, values in columns.items()}
    return pd.DataFrame(columns)


def _parse_column(src: str, cells: list[str], lines: list[int], out: str, header: str, least: int = 1):
    values = pd.to_numeric(pd.Series([c.strip() for c in cells], dtype=object), errors="coerce").to_numpy(
        dtype=np.float64
    )
    if out == "arrival_s":
        bad, allowed = ~(np.isfinite(values) & (values >= 0)), "a finite number of seconds >= 0"
    else:
        bad = ~(np.isfinite(values) & (values >= least) & (values <= MAX_TOKENS) & (np.floor(values) == values))
        allowed = f"a whole number of tokens from {least} to {MAX_TOKENS}"
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(src, f"line {lines[i]}", f"{header}={cells[i].strip()!r}: {allowed}")
    return values if out == "arrival_s" else values.astype(np.int64)


def _parse_dates(src: str, cells: list[str], lines: list[int], header: str) -> np.ndarray:
    """Dates and times (ISO 8601, as the Azure traces write them) as seconds after the
    earliest; times without a zone are taken as UTC."""
    stamps = pd.to_datetime(pd.Series([c.strip() for c in cells]), format="ISO8601", utc=True, errors="coerce")
    bad = stamps.isna().to_numpy()
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(
            src, f"line {lines[i]}", f"{header}={cells[i].strip()!r}: a date and time such as 2023-11-16 18:17:03.97996"
        )
    return (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)


# ------------------------------------------------------------------ Mooncake JSON lines


def _read_jsonl(src: str, text: str) -> pd.DataFrame:
    arrival, prompt, output, hashes = [], [], [], []
    for line, body in enumerate(text.splitlines(), start=1):
        if not body.strip():
            continue
        where = f"line {line}"
        try:
            row = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            row = None
        if not isinstance(row, dict):
            raise InputError(src, where, "not a JSON object; a Mooncake trace has one object per line")
        unknown = [k for k in row if k not in _MOONCAKE_KEYS]
        missing = [k for k in _MOONCAKE_KEYS[:3] if k not in row]
        if unknown or missing:
            what = f"unknown field {unknown[0]!r}" if unknown else f"missing field {missing[0]!r}"
            raise InputError(
                src, where, f"{what}; a Mooncake trace line has {', '.join(_MOONCAKE_KEYS)} (hash_ids optional)"
            )
        stamp = row["timestamp"]
        if not (_is_number(stamp) and math.isfinite(stamp) and stamp >= 0):
            raise InputError(src, where, f"timestamp={stamp!r}: a finite number of milliseconds >= 0")
        tokens = [_tokens(src, where, row, key) for key in ("input_length", "output_length")]
        ids = _hash_ids(src, where, row.get("hash_ids", []), tokens[0])
        arrival.append(stamp / 1000.0)
        prompt.append(tokens[0])
        output.append(tokens[1])
        hashes.append(ids)
    if not arrival:
        raise InputError(src, "rows", "no requests; expected one JSON object per line")
    return pd.DataFrame(
        {
            "arrival_s": np.asarray(arrival, dtype=np.float64),
            "prompt_tokens": np.asarray(prompt, dtype=np.int64),
            "output_tokens": np.asarray(output, dtype=np.int64),
            "hash_ids": hashes,
        }
    )


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _tokens(src: str, where: str, row: dict, key: str) -> int:
    value = row[key]
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_TOKENS):
        raise InputError(src, where, f"{key}={value!r}: a whole number of tokens from 1 to {MAX_TOKENS}")
    return value


def _hash_ids(src: str, where: str, ids, prompt: int) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < MAX_HASH_ID for h in ids
    ):
        raise InputError(src, where, f"hash_ids: a list of whole numbers from 0 to {MAX_HASH_ID - 1}")
    blocks = -(-prompt // HASH_BLOCK_TOKENS)
    if len(ids) > blocks:
        raise InputError(
            src,
            where,
            f"hash_ids has {len(ids)} ids, more than the {blocks} blocks of "
            f"{HASH_BLOCK_TOKENS} tokens in input_length={prompt}",
        )
    return tuple(ids)
