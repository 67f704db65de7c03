"""Trace formats (kvsim.workload.traces): Mooncake JSON lines with hash ids, the Azure and
BurstGPT CSVs, format detection, num_requests and time_scale, and the sharing a Mooncake
trace gives the prefix caches. Checks on the given Mooncake trace skip when the
reference data is absent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvsim.kvcache import PrefixCachingPagedAllocator
from kvsim.config.errors import InputError
from kvsim.workload.traces import hash_segments, read_trace, trace_requests

TINY = Path(__file__).parent / "data" / "tiny_trace.csv"
MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="no Mooncake synthetic trace")


def write(tmp_path: Path, text: str | bytes, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def jsonl(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def line(t, n_in, n_out, ids=None) -> dict:
    row = {"timestamp": t, "input_length": n_in, "output_length": n_out}
    return row if ids is None else {**row, "hash_ids": ids}


# ------------------------------------------------------------------ Mooncake


def test_mooncake_lines_become_seconds_lengths_and_hash_ids(tmp_path):
    path = write(tmp_path, jsonl(line(1500, 700, 3, [1, 2]), line(0, 1100, 5, [1, 2, 3]), line(1500, 10, 1)))
    got = read_trace(path)
    assert list(got.columns) == ["arrival_s", "prompt_tokens", "output_tokens", "hash_ids"]
    assert got.arrival_s.tolist() == [0.0, 1.5, 1.5]  # sorted, ties in file order
    assert got.prompt_tokens.tolist() == [1100, 700, 10]
    assert got.hash_ids.tolist() == [(1, 2, 3), (1, 2), ()]


def test_hash_ids_become_content_runs_with_a_partial_last_block():
    ids, prompt = [(1, 2), (1, 2, 3), (), (4,)], np.array([700, 1100, 10, 2000])
    n = len(prompt)
    assert hash_segments(ids, prompt) == [
        ((n + 1, 512), (n + 2, 188)),
        ((n + 1, 512), (n + 2, 512), (n + 3, 76)),
        (),
        ((n + 4, 512),),
    ]  # the rest is the request's own


def test_requests_first_n_and_time_scale(tmp_path):
    path = write(tmp_path, jsonl(*(line(1000 * i, 600, 2, [i % 2, 9 + i]) for i in range(5))))
    table = trace_requests(path, num_requests=3, time_scale=2.5)
    assert table.arrival_s.tolist() == [0.0, 2.5, 5.0]
    assert [spec.segments for spec in table] == [((3, 512), (12, 88)), ((4, 512), (13, 88)), ((3, 512), (14, 88))]
    assert [spec.prompt_runs[-1] for spec in table] == [(12, 88), (13, 88), (14, 88)]  # no own tail left
    assert table.private_tails()


def test_a_prefix_cache_sees_the_shared_hash_blocks(tmp_path):
    """Request B starts with A's two hash blocks; A's second is partial (188 tokens), so B
    finds A's 43 full 16-token blocks: 688 tokens."""
    path = write(tmp_path, jsonl(line(0, 700, 1, [1, 2]), line(1, 1100, 1, [1, 2, 3]), line(2, 1100, 1, [5, 2, 3])))
    a, b, c = trace_requests(path)
    cache = PrefixCachingPagedAllocator(num_blocks=400, block_size=16)
    assert cache.allocate(a.id, a.shape, a.prompt_tokens)
    cache.free(a.id)
    assert cache.match_prefix(b.shape, b.prompt_tokens) == 688
    assert cache.match_prefix(c.shape, c.prompt_tokens) == 0  # same ids after another prefix


@needs_mooncake
def test_the_given_mooncake_trace():
    got = read_trace(MOONCAKE)
    assert len(got) == 3993
    assert round(got.prompt_tokens.mean()) == 15325 and round(got.output_tokens.mean()) == 149
    assert got.arrival_s.is_monotonic_increasing
    blocks = -(-got.prompt_tokens // 512)
    assert (got.hash_ids.map(len) == blocks).all()
    table = trace_requests(MOONCAKE, num_requests=100)
    assert len(table) == 100 and all(sum(n for _, n in s.segments) == s.prompt_tokens for s in table)


# ------------------------------------------------------------------ the CSV formats


def test_read_trace_good_file_sorts_stably_and_keeps_times(tmp_path):
    path = write(
        tmp_path, "arrival_time,prompt_tokens,output_tokens,extra\n5.0,10,1,a\n3.5,20,2,b\n5.0,30,3,c\n\n4,40.0,4,d\n"
    )
    got = read_trace(path)
    assert list(got.columns) == ["arrival_s", "prompt_tokens", "output_tokens"]
    assert got.dtypes.tolist() == [np.float64, np.int64, np.int64]
    assert got.arrival_s.tolist() == [3.5, 4.0, 5.0, 5.0]  # not shifted to 0
    assert got.prompt_tokens.tolist() == [20, 40, 10, 30]  # ties keep file order


def test_tiny_trace_example():
    got = read_trace(TINY)
    assert len(got) == 10 and got.arrival_s.iloc[0] == 0.0
    assert got.arrival_s.is_monotonic_increasing
    assert got.prompt_tokens.sum() == 9585 and got.output_tokens.sum() == 1520


HEAD = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
CSV_BAD = {  # case -> (file content, field, words the message must contain)
    "binary": (bytes(range(256)) * 8, "file", "not a text CSV"),
    "latin-1": ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,caf\xe9\n".encode("latin-1"), "file", "UTF-8"),
    "empty": ("", "columns", "arrived_at / arrival_s / arrival_time"),
    "no columns": ("a,b\n1,2\n", "columns", "found: a, b"),
    "two arrivals": ("arrived_at,arrival_s,prompt_tokens,output_tokens\n0,0,1,1\n", "columns", "several columns"),
    "no decode": ("arrived_at,num_prefill_tokens\n0,1\n", "columns", "num_decode_tokens / output_tokens"),
    "header only": (HEAD, "rows", "no data rows"),
    "text length": (HEAD + "0,5,5\n1,abc,5\n", "line 3", "num_prefill_tokens='abc'"),
    "NaN length": (HEAD + "0,5,NaN\n", "line 2", "num_decode_tokens='NaN'"),
    "empty cell": (HEAD + "0,5,5\n0.5,,5\n", "line 3", "whole number"),
    "negative": (HEAD + "0,5,5\n1,5,5\n2,-3,5\n", "line 4", "'-3'"),
    "fraction": (HEAD + "0,5,2.5\n", "line 2", "whole number"),
    "zero": (HEAD + "0,0,5\n", "line 2", "from 1"),
    "huge": (HEAD + "0,1e30,5\n", "line 2", "from 1"),
    "inf arrival": (HEAD + "inf,5,5\n", "line 2", "finite"),
    "negative arrival": (HEAD + "-1,5,5\n", "line 2", ">= 0"),
    "ragged": (HEAD + "0,5,5\n1,5\n", "line 3", "2 fields"),
    "after blank": (HEAD + "0,5,5\n\n\n1,x,5\n", "line 5", "'x'"),
}


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_read_trace_unreadable_path(tmp_path, what):
    path = tmp_path / "nope.csv" if what == "missing" else tmp_path
    with pytest.raises(InputError) as info:
        read_trace(path)
    assert (info.value.source, info.value.field) == (str(path), "file")


CELLS = st.sampled_from(
    ["0", "1", "7", "2.5", "-1", "nan", "", "x", "1e3", "inf", '"', " 4 ", "\x00", "é", "1,2", '"3\n4"']
)


def test_azure_dates_become_seconds_after_the_first_request(tmp_path):
    path = write(
        tmp_path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:18:03.9799600,110,27\n",
    )
    got = read_trace(path)
    assert list(got.columns) == ["arrival_s", "prompt_tokens", "output_tokens"]
    assert np.allclose(got.arrival_s, [0.0, 0.052, 60.0])
    assert got.prompt_tokens.tolist() == [4808, 3180, 110]


def test_azure_2024_times_with_a_zone(tmp_path):
    path = write(
        tmp_path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,2162,5\n2024-05-10 00:00:01.5+00:00,17,3\n",
    )
    assert np.allclose(read_trace(path).arrival_s, [0.0, 1.49007])


def test_burstgpt_leaves_out_failed_requests(tmp_path):
    path = write(
        tmp_path,
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n",
    )
    got = read_trace(path)
    assert got.arrival_s.tolist() == [5.0, 118.0] and got.output_tokens.tolist() == [18, 276]


JSONL_BAD = {  # case -> (content, field, words the message must contain)
    "not json": ('{"timestamp": 0,\n', "line 1", "not a JSON object"),
    "array line": (jsonl(line(0, 5, 5)) + "[1, 2]\n", "line 2", "not a JSON object"),
    "unknown field": (jsonl({**line(0, 5, 5), "hash_id": [1]}), "line 1", "unknown field 'hash_id'"),
    "missing field": (jsonl({"timestamp": 0, "input_length": 5}), "line 1", "missing field 'output_length'"),
    "negative time": (jsonl(line(-1, 5, 5)), "line 1", "milliseconds >= 0"),
    "text time": (jsonl(line("0", 5, 5)), "line 1", "timestamp='0'"),
    "zero input": (jsonl(line(0, 0, 5)), "line 1", "input_length=0"),
    "float output": (jsonl(line(0, 5, 2.5)), "line 1", "output_length=2.5"),
    "bool length": (jsonl(line(0, True, 5)), "line 1", "input_length=True"),
    "negative id": (jsonl(line(0, 5, 5, [-1])), "line 1", "hash_ids"),
    "id list": (jsonl(line(0, 5, 5, 3)), "line 1", "hash_ids"),
    "too many ids": (jsonl(line(0, 513, 5, [1, 2, 3])), "line 1", "more than the 2 blocks"),
    "blank only": ("{}\n"[:0] + "\n \n", "columns", "missing column"),
    "unknown CSV": ("when,in,out\n0,1,1\n", "columns", "Mooncake JSON lines"),
    "azure date": (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,5,5\nyesterday,5,5\n",
        "line 3",
        "TIMESTAMP='yesterday'",
    ),
    "azure lacks a column": ("TIMESTAMP,ContextTokens\n2023-11-16 18:17:04,5\n", "columns", "GeneratedTokens"),
    "burstgpt all failed": ("Timestamp,Request tokens,Response tokens\n1,5,0\n", "rows", "every request failed"),
    "burstgpt negative": ("Timestamp,Request tokens,Response tokens\n1,5,-2\n", "line 2", "from 0"),
}


BAD = {**CSV_BAD, **JSONL_BAD}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_traces_are_one_line_errors(tmp_path, case):
    content, field, words = BAD[case]
    path = write(tmp_path, content)
    with pytest.raises(InputError) as info:
        read_trace(path)
    err = info.value
    assert (err.source, err.field) == (str(path), field)
    assert words in err.message and "\n" not in str(err)
    assert str(err).startswith(f"{path}: {field}: ")


VALUES = st.one_of(
    st.integers(-3, 1100),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 5), max_size=4),
)
KEYS = st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"])
JSON_LINES = st.tuples(st.lists(st.dictionaries(KEYS, VALUES, max_size=5), max_size=4), st.integers(0, 400)).map(
    lambda rows_cut: "".join(json.dumps(r) + "\n" for r in rows_cut[0])[: rows_cut[1]] or "{"
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(
        st.binary(max_size=200),
        st.lists(st.lists(CELLS, min_size=1, max_size=4), max_size=6).map(
            lambda rows: HEAD + "\n".join(",".join(r) for r in rows)
        ),
        JSON_LINES,
    )
)
def test_read_trace_never_leaks_other_errors(tmp_path_factory, body):
    path = write(tmp_path_factory.mktemp("fuzz"), body)
    try:
        got = read_trace(path)
    except InputError as err:
        assert err.source == str(path) and "\n" not in str(err)
    else:
        assert len(got) >= 1 and (got.prompt_tokens >= 1).all() and (got.output_tokens >= 1).all()
        assert got.arrival_s.is_monotonic_increasing
        if "hash_ids" in got:
            assert all(len(ids) * 512 < p + 512 for ids, p in zip(got.hash_ids, got.prompt_tokens))
