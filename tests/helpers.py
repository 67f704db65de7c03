"""Small helpers shared by several test modules (tests/ is on sys.path under pytest)."""

import contextlib
import copy
import io
import shutil
import signal
import sys

from kvsim.cli.app import main
from kvsim.cost.model import StepBatch
from kvsim.kvcache import PagedAllocator
from kvsim.sim.loop import simulate


@contextlib.contextmanager
def wall_limit(seconds: int):
    """Fail, rather than hang the suite, if the block runs longer (SIGALRM: main thread only)."""

    def expire(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s of wall time")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class OneSecondSteps:
    """A cost model whose every step takes one second, so every instant is predictable;
    it keeps the batches it priced."""

    label = "fixed"
    block_size = None
    api = None

    def __init__(self):
        self.batches: list[StepBatch] = []

    def price(self, batch: StepBatch) -> tuple[float, tuple[str, ...]]:
        self.batches.append(batch)
        return 1.0, ()

    def step_time(self, batch: StepBatch) -> float:
        return self.price(batch)[0]

    def parts(self, batch: StepBatch) -> tuple[dict[str, float], tuple[str, ...]]:
        return {"fixed": self.price(batch)[0]}, ()


def one_second_run(requests, allocator=None, **options):
    """`requests` through vLLM V1's rules with one-second steps: 100 blocks of 4 tokens
    unless an allocator is given, max_model_len 64, 8 sequences and 64 tokens a step,
    chunked prefill; `options` override any of these or add simulate's others."""
    settings = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=True) | options
    return simulate("p", requests, allocator or PagedAllocator(100, 4), OneSecondSteps(), **settings)


def kvsim(*args) -> tuple[int, str, str]:
    """In-process `kvsim ARGS`: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def kvsim_command() -> list[str]:
    """The installed `kvsim` executable, or this interpreter running the CLI module."""
    exe = shutil.which("kvsim")
    return [exe] if exe else [sys.executable, "-m", "kvsim.cli.app"]


def one_error_line(code: int, out: str, err: str) -> str:
    """Bad input fails as the project promises: exit 2, nothing on stdout, one
    `kvsim: error: ...` line on stderr and no traceback. Returns that line."""
    assert code == 2, (code, err)
    assert out == "", out
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvsim: error: "), err
    return lines[0]


def with_changes(base: dict, **changes) -> dict:
    """A deep copy of `base` with changes: a key a__b sets [a][b], a value None drops it."""
    doc = copy.deepcopy(base)
    for key, value in changes.items():
        *path, last = key.split("__")
        node = doc
        for part in path:
            node = node[part]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return doc


# SGLang's reference code runs in a child process: importing SGLang stands an empty module in
# for torchvision (kvsim.engines.sglang_reference)
SGLANG_PRELUDE = """
from kvsim.engines.sglang_reference import SGLangMissing, load_sglang
try:
    load_sglang()
except SGLangMissing as e:
    print("MISSING", e)
    raise SystemExit(0)
"""


def sglang_child(check: str, timeout: int) -> list[str]:
    """The output lines of `check` run after SGLANG_PRELUDE in a child process; a skip
    where SGLang 0.5.23 does not import."""
    import subprocess

    import pytest

    out = subprocess.run(
        [sys.executable, "-c", SGLANG_PRELUDE + check], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    if lines and lines[-1].startswith("MISSING"):
        pytest.skip(lines[-1])
    return lines
