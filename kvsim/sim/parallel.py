"""Independent jobs (a scenario's policies, a run's figures) in forked worker processes.

`ordered_map(fn, n, workers)` returns [fn(0), ..., fn(n - 1)] whatever ran where: each
job is self-contained (a policy's simulation builds its own scheduler on its own
allocator, from the one request stream), so its result does not depend on the process
that ran it or on the jobs beside it, and the caller sees the results in job order.
Workers are forked, so they inherit `fn` and everything it reads without pickling; only
results (and errors) travel back. With one worker, one job, or no fork on this system,
the jobs run one after the other in this process: the same results.

Only the command line asks for workers (`kvsim run --jobs`); library callers and sweeps,
which run their own pools, get the serial path unless they ask.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

_JOB: Callable | None = None  # the job function, set for the forked workers to inherit


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    return (
        "fork" in multiprocessing.get_all_start_methods() and not multiprocessing.current_process().daemon
    )  # a daemon may not have children


def ordered_map(
    fn: Callable[[int], T],
    n: int,
    workers: int,
    *,
    first: Sequence[int] = (),
    on_result: Callable[[int, T], None] | None = None,
) -> list[T]:
    """[fn(i) for i in range(n)], run in up to `workers` forked processes. `first`: jobs to
    start before the others (the longest, so that they do not end the run alone).
    on_result(i, result) is called in this process as each job's result arrives."""
    if workers <= 1 or n <= 1 or not can_fork():
        results = []
        for i in range(n):
            results.append(fn(i))
            if on_result:
                on_result(i, results[-1])
        return results
    global _JOB
    order = [*first, *(i for i in range(n) if i not in first)]
    out: dict[int, T] = {}
    _JOB = fn
    # concurrent.futures, not multiprocessing.Pool: Pool.terminate, on an error, can hang
    # on a worker that waits for a task holding the task queue's lock
    pool = ProcessPoolExecutor(min(workers, n), mp_context=multiprocessing.get_context("fork"))
    done = False
    try:
        pending = [pool.submit(_run, i) for i in order]
        for future in as_completed(pending):
            i, ok, value = future.result()
            if not ok:
                raise value
            out[i] = value
            if on_result:
                on_result(i, value)
        done = True
    finally:
        _JOB = None
        pool.shutdown(wait=done, cancel_futures=True)  # on an error: the rest not started
    return [out[i] for i in range(n)]


def _run(i: int) -> tuple[int, bool, object]:
    """One job in a worker: (index, True, result), or (index, False, the error), the error
    replaced by a RuntimeError naming it where it cannot be pickled. Every error comes
    back, an interrupt too: a worker that died of one would leave its job unanswered."""
    try:
        return i, True, _JOB(i)
    except BaseException as e:
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        e.add_note(f"(raised in a worker process)\n{traceback.format_exc()}")
        return i, False, e
