"""Fuzzed input: every scenario or trace either runs or fails cleanly.

The property, for `kvsim run` on any input: exit status 0 with results written, or exit
status 2 with exactly one stderr line "kvsim: error: <file>: <field or line>: <what is
allowed>", no traceback, and no output folder (not even a temporary one) left behind.

Inputs: hypothesis-built scenario dicts with mutations (unknown keys, wrong types,
negative, zero and enormous numbers, NaN, infinities, unicode, nesting), raw YAML text
edits, binary garbage, a shipped scenario truncated at every byte, and trace CSVs
(wrong columns, ragged rows, NaN, negative and huge numbers, truncation, binary). Then
scenarios whose numbers make no physical sense, in a subprocess with a time and
memory limit, since a bug there can hang or exhaust the machine.

Most runs go through `kvsim.cli.app.main` in-process (it returns the exit status) with the
plots stubbed out: drawing PNGs costs half a second a run and sees only simulated
tables, never raw input; the subprocess runs draw them for real. FUZZED counts the
inputs tried per test; test_fuzz_counts (last) prints them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import os
import resource
import subprocess
import tempfile
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import kvsim, kvsim_command, wall_limit, with_changes
from kvsim.workload.traces import read_trace
from kvsim.config.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
FUZZED: collections.Counter = collections.Counter()  # inputs tried, per kind
RAN: collections.Counter = collections.Counter()  # ... of which ran (exit 0)


def fuzz(examples: int) -> settings:
    """KVSIM_FUZZ_SCALE=10 tries ten times as many inputs, for a deeper run by hand."""
    scale = float(os.environ.get("KVSIM_FUZZ_SCALE", "1"))
    return settings(
        max_examples=max(1, int(examples * scale)),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# A scenario that runs in a few hundredths of a second: 2,048 token slots of Llama-3-8B.
BASE = {
    "name": "fuzz",
    "seed": 3,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "kv_cache_memory_gib": 0.25,
    "max_model_len": 512,
    "cost_model": "roofline",
    "workload": {
        "num_requests": 5,
        "arrival": {"process": "poisson", "rate_per_s": 10.0},
        "prompt_tokens": {"dist": "uniform", "min": 8, "max": 300},
        "output_tokens": {"dist": "lognormal", "mean": 20, "cv": 0.5, "min": 1, "max": 100},
    },
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
    "policies": [
        {"name": "contiguous", "allocator": "contiguous", "reserve": "pow2", "placement": "buddy"},
        {"name": "paged", "allocator": "paged", "block_size": 16},
        {
            "name": "offload",
            "allocator": "paged",
            "block_size": 16,
            "enable_prefix_caching": True,
            "kv_offload": {"cpu_gib": 0.05, "disk_gib": 0.1, "policy": "arc", "chunk_tokens": 32},
        },
        {
            "name": "hicache",
            "allocator": "paged",
            "prefix_cache": "radix",
            "kv_offload": {"hicache_ratio": 0.5, "write_policy": "write_back"},
        },
    ],
}


# --- running and judging one input ---------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def no_plots():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvsim.plots.run_figures.plot_jobs", lambda *args, **kwargs: [])
        yield


@contextlib.contextmanager
def inside(folder: Path):
    old = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def kvsim_in(folder: Path, *args) -> tuple[int, str, str]:
    """In-process `kvsim ARGS` run from `folder`: (exit status, stdout, stderr)."""
    with inside(folder), wall_limit(60):
        return kvsim(*args)


def assert_clean(code: int, out: str, err: str, folder: Path, sources: tuple[str, ...]) -> str:
    """Ran (exit 0, results written), completed nothing (exit 3, one warning line saying
    why, nothing written) or failed as one named line (exit 2, nothing written).
    Returns "ran", "empty" or "refused"."""
    assert "Traceback" not in out + err, err
    results = folder / "out"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "a temporary folder was left"
    if code == 0:
        assert err == "", err
        assert (results / "summary.csv").is_file()
        return "ran"
    if code == 3:
        assert err.startswith("kvsim: warning: ") and "no request completed under any policy: " in err, err
        assert err.count("\n") == 1 and not results.exists(), err
        return "empty"
    assert code == 2, (code, err)
    lines = err.replace("\r\n", "\n").rstrip("\n").split("\n")  # terminal lines, not str.splitlines
    assert len(lines) == 1, err
    assert lines[0].startswith(tuple(f"kvsim: error: {s}: " for s in (*sources, "command line"))), lines[0]
    assert len(lines[0].split(": ")) >= 4, f"no field or no explanation: {lines[0]}"  # file: field: what
    assert not results.exists(), "a failed run wrote results"
    return "refused"


def run_scenario_bytes(
    kind: str, content: bytes, extra: dict[str, bytes] | None = None, num_requests: int | None = 5
) -> tuple[str, str]:
    """Write scenario.yaml (and extra files) to a fresh folder, run it, judge it; count it
    under `kind`."""
    outcome, err = _run_scenario_bytes(content, extra, num_requests)
    FUZZED[kind] += 1
    RAN[kind] += outcome == "ran"
    return outcome, err


def _run_scenario_bytes(content, extra, num_requests):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "scenario.yaml").write_bytes(content)
        for name, data in (extra or {}).items():
            (folder / name).write_bytes(data)
        args = ["run", "scenario.yaml", "--out", "out", "--quiet"]
        if num_requests:
            args += ["--num-requests", str(num_requests)]
        code, out, err = kvsim_in(folder, *args)
        return assert_clean(code, out, err, folder, ("scenario.yaml", *(extra or {}))), err


def dump(doc) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode("utf-8")


# --- mutated scenario dicts ------------------------------------------------------------
# Any text but surrogates and line breaks (control characters, line and paragraph
# separators): a line break inside a key or value breaks the one-line error, a known bug
# pinned by test_line_break_in_a_key_or_value.
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=12)


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 2, -(2**31), 2**31, 2**63, 10**30, -(10**30)]),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=False),
    st.sampled_from([0.0, -0.0, -1.5, 1e-300, 1e300, float("nan")]),
    TEXT,
    st.sampled_from(["", "1", "0x10", "1e3", "llama-3-8b", "paged", "∞", "ＮａＮ", "名前"]),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(TEXT, st.integers(-5, 5), max_size=2),
    st.integers(1, 150).map(nested),
)


def _slots(doc):
    """(container, key) for every value in the document, containers included."""
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            yield node, key
            if isinstance(value, (dict, list)):
                stack.append(value)


WORDS = [
    "max",
    "pow2",
    "oracle",
    "first-fit",
    "buddy",
    "paged",
    "contiguous",
    "poisson",
    "gamma",
    "burst",
    "fixed",
    "uniform",
    "lognormal",
    "fp8",
    "int4",
    "auto",
    "llama-2-7b",
    "a100-40gb",
    "sharegpt",
]


def plausible(value):
    """A value of the right type at or near the edges of what is allowed: these runs
    get past validation and exercise the simulation."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(1, 4) | st.sampled_from([0, value * 2, max(value // 2, 1), 4096, 65_536])
    if isinstance(value, float):
        return st.floats(1e-3, 64) | st.sampled_from([value * 2, value / 2, 1.0])
    if isinstance(value, str):
        return st.sampled_from([value, *WORDS])
    return st.just(value)


@st.composite
def plausible_scenarios(draw):
    """Only same-typed edge values (max_num_seqs 1, block_size 4096, a 2-token
    max_model_len, ...): most of these run, so they fuzz the simulation itself."""
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        container, key = draw(st.sampled_from([(c, k) for c, k in _slots(doc) if not isinstance(c[k], (dict, list))]))
        container[key] = draw(plausible(container[key]))
    return doc


@st.composite
def mutated_scenarios(draw):
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        container, key = draw(st.sampled_from(list(_slots(doc)) or [(doc, "name")]))
        how = draw(st.sampled_from(["replace", "replace", "replace", "delete", "unknown key", "typo", "wrap"]))
        if how == "replace" or not isinstance(container, dict) and how != "wrap":
            container[key] = draw(NASTY | plausible(container[key]))
        elif how == "delete":
            del container[key]
        elif how == "unknown key":
            container[draw(TEXT | st.integers())] = draw(NASTY)
        elif how == "typo":
            name = str(key)
            i = draw(st.integers(0, max(len(name) - 1, 0)))
            container[name[:i] + name[i + 1 :] + draw(TEXT.filter(bool) | st.just("_"))] = container.pop(key)
        else:  # wrap: the right value, one level too deep
            container[key] = draw(st.sampled_from([[container[key]], {"value": container[key]}]))
    return doc


def test_base_scenario_runs():
    assert _run_scenario_bytes(dump(BASE), None, 5)[0] == "ran"


@pytest.mark.slow
@fuzz(300)
@given(doc=mutated_scenarios())
def test_mutated_scenarios(doc):
    run_scenario_bytes("mutated scenario dicts", dump(doc))


@pytest.mark.slow
@fuzz(150)
@given(doc=plausible_scenarios())
def test_plausible_scenarios(doc):
    run_scenario_bytes("edge-valued scenario dicts", dump(doc))


# --- raw text and bytes ----------------------------------------------------------------
@st.composite
def edited_text(draw):
    text = dump(BASE)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 20)))
        how = draw(st.sampled_from(["insert", "delete", "replace"]))
        junk = draw(
            st.binary(max_size=8)
            | TEXT.map(lambda t: t.encode("utf-8"))
            | st.sampled_from(
                [
                    b":",
                    b"- ",
                    b"{",
                    b"]",
                    b"\t",
                    b"\n  ",
                    b"&a",
                    b"*a",
                    b"!!python/object:os.system",
                    b"\x00",
                    b"\xff",
                    b"---\n",
                ]
            )
        )
        text = text[:i] + (junk if how != "delete" else b"") + text[(i if how == "insert" else j) :]
    return text


@pytest.mark.slow
@fuzz(200)
@given(content=edited_text())
def test_edited_yaml_text(content):
    run_scenario_bytes("edited YAML texts", content)


@pytest.mark.slow
@fuzz(100)
@given(content=st.binary(max_size=256))
def test_binary_garbage(content):
    assert run_scenario_bytes("binary scenario files", content)[0] == "refused"


@pytest.mark.slow
def test_truncated_shipped_scenario_at_every_byte(monkeypatch):
    """rag_8k.yaml cut after every byte. The runs that load are simulated without the
    per-step checks (six policies on an H100-sized pool), to keep this to seconds."""
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    full = (ROOT / "scenarios" / "rag_8k.yaml").read_bytes()
    outcomes = collections.Counter()
    for cut in range(len(full) + 1):
        outcome, _ = run_scenario_bytes("truncations of rag_8k.yaml", full[:cut], num_requests=1)
        outcomes[outcome] += 1
    assert outcomes["ran"] >= 1 and outcomes["refused"] >= len(full) // 2, outcomes


# --- traces ----------------------------------------------------------------------------
TRACE_SCENARIO = {**{k: v for k, v in BASE.items() if k != "workload"}, "workload": {"trace": "trace.csv"}}
COLUMN_NAMES = [
    "arrived_at",
    "arrival_s",
    "arrival_time",
    "num_prefill_tokens",
    "prompt_tokens",
    "num_decode_tokens",
    "output_tokens",
    "extra",
    "",
    "Arrived_At",
    " prompt_tokens",
    "名前",
]
GOOD_HEADER = ["arrived_at", "num_prefill_tokens", "num_decode_tokens"]
CELL = st.one_of(
    st.integers(1, 400).map(str),
    st.floats(0, 100, allow_nan=False).map(repr),
    st.sampled_from(
        [
            "",
            " ",
            "nan",
            "NaN",
            "inf",
            "-inf",
            "-1",
            "0",
            "1.5",
            "1e3",
            "1e400",
            "2147483647",
            "2147483648",
            "99999999999999999999999",
            "0x10",
            "abc",
            "\"1\"",
            "\"a,b\"",
            "\"unclosed",
            "名前",
            "1_000",
            "+5",
            "٣",
        ]
    ),
)


@st.composite
def trace_csvs(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    good = draw(st.booleans())
    header = GOOD_HEADER if good else draw(st.lists(st.sampled_from(COLUMN_NAMES), min_size=0, max_size=5))
    width = len(header)
    rows = []
    for _ in range(draw(st.integers(0, 8))):
        if good and draw(st.integers(0, 3)):
            rows.append(
                [
                    str(draw(st.floats(0, 50, allow_nan=False))),
                    str(draw(st.integers(1, 300))),
                    str(draw(st.integers(1, 100))),
                ]
            )
        else:
            rows.append(draw(st.lists(CELL, min_size=max(0, width - 1), max_size=width + 1)))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    text = newline.join(",".join(r) for r in [header, *rows]) + draw(st.sampled_from(["", newline]))
    data = text.encode("utf-8")
    if draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data)))]  # truncated
    return data


@pytest.mark.slow
@fuzz(500)
@given(data=trace_csvs())
def test_read_trace_returns_clean_columns_or_one_input_error(data):
    FUZZED["trace CSVs (reader)"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_bytes(data)
        try:
            df = read_trace(path)
        except InputError as e:
            assert e.source == str(path)
            assert e.field in ("file", "columns", "rows") or e.field.startswith("line "), e.field
            assert "\n" not in str(e)
            return
    RAN["trace CSVs (reader)"] += 1
    assert list(df.columns) == ["arrival_s", "prompt_tokens", "output_tokens"] and len(df) >= 1
    assert df.arrival_s.map(math.isfinite).all() and (df.arrival_s >= 0).all()
    assert df.arrival_s.is_monotonic_increasing
    for col in ("prompt_tokens", "output_tokens"):
        assert str(df[col].dtype) == "int64" and df[col].between(1, 2**31 - 1).all()


@pytest.mark.slow
@fuzz(120)
@given(data=trace_csvs())
def test_trace_scenarios(data):
    run_scenario_bytes("trace CSVs (kvsim run)", dump(TRACE_SCENARIO), extra={"trace.csv": data})


# --- a few through the real executable, plots drawn ---------------------------------------
def kvsim_subprocess(folder: Path, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    """`kvsim ARGS` in a child limited to 1.5 GiB of address space (a normal run needs
    under 1 GiB; a runaway allocation fails there instead of exhausting the machine) and
    `timeout` seconds."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*kvsim_command(), *map(str, args)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_memory,
        env=env,
    )


SUBPROCESS_CASES = {
    "unknown key": {**BASE, "shceduler": {}},
    "negative seed": {**BASE, "seed": -1},
    "NaN rate": {
        **BASE,
        "workload": {**BASE["workload"], "arrival": {"process": "poisson", "rate_per_s": float("nan")}},
    },
    "unicode name": {**BASE, "name": "ｆｕｚｚ"},
    "enormous max_model_len": {
        **BASE,
        "max_model_len": 10**18,
        "scheduler": {**BASE["scheduler"], "enable_chunked_prefill": True},
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SUBPROCESS_CASES))
def test_through_the_executable(tmp_path, case):
    (tmp_path / "scenario.yaml").write_bytes(dump(SUBPROCESS_CASES[case]))
    proc = kvsim_subprocess(tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet", "--num-requests", "5")
    outcome = assert_clean(proc.returncode, proc.stdout, proc.stderr, tmp_path, ("scenario.yaml",))
    assert outcome == ("ran" if case == "enormous max_model_len" else "refused")
    FUZZED["through the executable"] += 1


# --- numbers that make no physical sense ---------------------------------------------------
def _with(**changes):
    return with_changes(BASE, **changes)


INLINE_MODEL = {
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
    "hidden_size": 128,
    "intermediate_size": 256,
    "params": 1.0e6,
}
NONSENSE = {
    # weights larger than the GPU: refused before the run, naming the memory
    "weights larger than the GPU": (
        _with(model="llama-3-70b", gpu="a100-40gb", kv_cache_memory_gib=None),
        "refused",
        "no memory left for the KV cache",
    ),
    "pool smaller than one block": (_with(kv_cache_memory_gib=1.0e-6), "refused", "holds not even one block"),
    "activations fill the GPU": (
        _with(kv_cache_memory_gib=None, activation_memory_gib=79.0),
        "refused",
        "no memory left for the KV cache",
    ),
    # max_model_len beyond the pool under max reservation: runs, every request rejected, so
    # nothing completes: the warning names the rejections' reason and nothing is written
    "max_model_len beyond the pool": (
        _with(
            max_model_len=100_000,
            policies=[BASE["policies"][0] | {"reserve": "max"}],
            scheduler={"max_num_batched_tokens": 100_000},
        ),
        "empty",
        "reservation exceeds KV pool",
    ),
    "prompts longer than the pool": (
        _with(
            max_model_len=100_000,
            scheduler={"max_num_batched_tokens": 100_000},
            workload__prompt_tokens={"dist": "fixed", "value": 5000},
        ),
        "empty",
        "exceeds KV pool",
    ),
}
ONCE_CRASHED = {
    # each once crashed or exhausted memory instead of exiting with 2
    "KV pool larger than the GPU": _with(kv_cache_memory_gib=1.0e6),
    "infinite KV pool": _with(kv_cache_memory_gib=float("inf")),
    "absurd tensor parallelism": _with(tensor_parallel_size=10**14),
    "infinite GPU memory": _with(
        kv_cache_memory_gib=None, gpu={"memory_gib": float("inf"), "hbm_tb_s": 3.35, "bf16_tflops": 989.0}
    ),
    "infinite parameters": _with(model=INLINE_MODEL | {"params": float("inf")}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(NONSENSE))
def test_physical_nonsense(tmp_path, case):
    doc, expected, reason = NONSENSE[case]
    (tmp_path / "scenario.yaml").write_bytes(dump(doc))
    proc = kvsim_subprocess(tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet", "--num-requests", "5")
    outcome = assert_clean(proc.returncode, proc.stdout, proc.stderr, tmp_path, ("scenario.yaml",))
    assert outcome == expected
    if outcome in ("refused", "empty"):
        assert reason in proc.stderr
    else:
        requests = pd.read_parquet(tmp_path / "out" / "requests.parquet")
        rejected = requests[requests.outcome == "rejected"]
        assert len(rejected) >= 1 and rejected.reason.str.contains(reason).all(), requests.reason.unique()
    FUZZED["physically impossible scenarios"] += 1


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ONCE_CRASHED))
def test_physical_nonsense_once_crashed(tmp_path, case):
    (tmp_path / "scenario.yaml").write_bytes(dump(ONCE_CRASHED[case]))
    try:
        proc = kvsim_subprocess(
            tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet", "--num-requests", "5", timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("did not finish in 30 s")
    assert_clean(proc.returncode, proc.stdout, proc.stderr, tmp_path, ("scenario.yaml",))
    assert proc.returncode == 2


@pytest.mark.parametrize("doc", [{**BASE, "bad\nkey": 1}, {**BASE, "model": "llama\n3"}], ids=["key", "preset name"])
def test_line_break_in_a_key_or_value(tmp_path, doc):
    (tmp_path / "scenario.yaml").write_bytes(dump(doc))
    code, out, err = kvsim_in(tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet")
    assert assert_clean(code, out, err, tmp_path, ("scenario.yaml",)) == "refused"


@pytest.mark.parametrize("depth", [1000])
def test_deeply_nested_yaml(tmp_path, depth):
    (tmp_path / "scenario.yaml").write_text("name: x\nmodel: " + "[" * depth + "]" * depth + "\n")
    code, out, err = kvsim_in(tmp_path, "run", "scenario.yaml", "--out", "out")
    assert assert_clean(code, out, err, tmp_path, ("scenario.yaml",)) == "refused"


@pytest.mark.parametrize("key", ["prompt_tokens", "output_tokens"])
def test_uniform_max_beyond_int64(tmp_path, key):
    doc = _with(**{f"workload__{key}": {"dist": "uniform", "min": 1, "max": 2**63}})
    (tmp_path / "scenario.yaml").write_bytes(dump(doc))
    code, out, err = kvsim_in(tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet", "--num-requests", "5")
    assert assert_clean(code, out, err, tmp_path, ("scenario.yaml",)) == "refused"


@pytest.mark.slow
def test_enormous_num_requests(tmp_path):
    (tmp_path / "scenario.yaml").write_bytes(dump(_with(workload__num_requests=10**12)))
    proc = kvsim_subprocess(tmp_path, "run", "scenario.yaml", "--out", "out", "--quiet", timeout=60)
    assert assert_clean(proc.returncode, proc.stdout, proc.stderr, tmp_path, ("scenario.yaml",)) == "refused"


@pytest.mark.slow
def test_fuzz_counts():
    """How many inputs each fuzz test tried in this session (pytest -rP shows it)."""
    print(
        "inputs fuzzed (of which ran): "
        + ", ".join(f"{k} {v:,} ({RAN[k]:,})" for k, v in FUZZED.items())
        + f"; total {sum(FUZZED.values()):,}"
    )
