"""Where a sweep's simulations run: a local process pool, or Ray tasks on a cluster.

Both run the same function (`run_point`) on the same validated scenarios and hand each
outcome to the caller as it finishes; the caller writes it. A point is one seeded,
self-contained simulation, so its result does not depend on where, when or beside what
it ran: the two backends give the same rows.

A point that raises is an outcome with its error; the others go on. A worker process
that dies (killed, out of memory) takes its point with it: the point runs again, up to
MAX_ATTEMPTS times in all. The local pool cannot tell which of the points in flight
killed it, so every point in flight then counts an attempt; at most `workers` are in
flight at once.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import traceback
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from kvsim.config.errors import InputError
from kvsim.config.scenario import Scenario

MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Task:
    id: str
    scenario: Scenario
    base_dir: Path
    src: str  # the file named in the scenario's errors


@dataclass(frozen=True)
class Outcome:
    id: str
    summary: pd.DataFrame | None  # one row per policy; None when the point failed
    error: str | None = None  # one line
    detail: str = ""  # the traceback, for a failure that is not bad input
    input_error: tuple[str, str, str] | None = None  # bad input: InputError's (source, field, message)


def run_point(task: Task) -> Outcome:
    """Run one point; any exception becomes a failed outcome."""
    from kvsim.analysis.results import run_scenario

    try:
        return Outcome(task.id, run_scenario(task.scenario, task.base_dir, task.src).summary)
    except InputError as e:
        return Outcome(task.id, None, str(e), input_error=(e.source, e.field, e.message))
    except Exception as e:  # recorded with the point; the sweep goes on
        return Outcome(task.id, None, f"{type(e).__name__}: {e}".splitlines()[0], detail=traceback.format_exc())


def died(task: Task, attempts: int, why: str) -> Outcome:
    return Outcome(task.id, None, f"the worker running it died {attempts} times ({why})")


def _call(fn: Callable[[Task], Outcome], task: Task) -> Outcome:
    """What a Ray task runs: Ray wraps functions only, and `fn` may be any callable."""
    return fn(task)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


OnOutcome = Callable[[Outcome], None]


class LocalPool:
    """A pool of worker processes on this machine. `fn` must pickle: a module-level
    function, or an instance of a module-level class."""

    def __init__(self, workers: int | None = None, fn: Callable[[Task], Outcome] = run_point):
        self.workers = workers or default_workers()
        self.slots = self.workers  # points that run at once
        self.fn = fn
        self.label = f"local pool of {self.workers} workers"
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "LocalPool":
        self._pool = self._new_pool()
        return self

    def __exit__(self, *exc) -> None:
        # On an error or Ctrl-C, drop what has not started; finished points are on disk.
        self._pool.shutdown(wait=exc[0] is None, cancel_futures=True)

    def _new_pool(self) -> ProcessPoolExecutor:
        # forkserver: workers start from a clean process that has imported kvsim once
        # (fork would copy the caller's threads, spawn re-imports kvsim per worker).
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["kvsim.sweep.backends", "kvsim.analysis.results"])
        return ProcessPoolExecutor(self.workers, mp_context=ctx)

    def run(self, tasks: Iterable[Task], on_outcome: OnOutcome) -> None:
        queue, flight, attempts = deque(tasks), {}, Counter()
        while queue or flight:
            while queue and len(flight) < self.workers:
                task = queue.popleft()
                flight[self._pool.submit(self.fn, task)] = task
            done, _ = wait(flight, return_when=FIRST_COMPLETED)
            if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                wait(flight)  # a broken pool fails every future at once
                done = set(flight)
            broken = False
            for future in done:
                task = flight.pop(future)
                error = future.exception()
                if isinstance(error, BrokenProcessPool):
                    broken = True
                    attempts[task.id] += 1
                    if attempts[task.id] >= MAX_ATTEMPTS:
                        on_outcome(died(task, attempts[task.id], "a local worker process exited"))
                    else:
                        queue.appendleft(task)
                elif error is not None:  # the outcome could not come back (pickling, say)
                    on_outcome(Outcome(task.id, None, f"{type(error).__name__}: {error}"))
                else:
                    on_outcome(future.result())
            if broken:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()


class RayCluster:
    """Ray tasks on an existing cluster (`address`) or on a local one started for the run
    (`address='local'`, `workers` CPUs). A Ray session already open in this process
    (`ray.init(...)` by the caller) is used as it is. Workers need kvsim installed and
    any file the scenario names (a trace, a profile folder) at the same path."""

    def __init__(self, address: str, workers: int | None = None, fn: Callable[[Task], Outcome] = run_point):
        if importlib.util.find_spec("ray") is None:
            raise InputError("command line", "--ray", "Ray is not installed: pip install 'kvsim[ray]'")
        self.address, self.workers, self.fn = address, workers, fn
        self.label = f"Ray ({address})"
        self._started = False

    def __enter__(self) -> "RayCluster":
        import ray

        if not ray.is_initialized():
            local = self.address == "local"
            try:
                ray.init(
                    address=self.address,
                    num_cpus=self.workers if local else None,
                    include_dashboard=False,
                    logging_level="warning",
                    log_to_driver=False,
                )
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise InputError(
                    "command line", "--ray", f"cannot reach a Ray cluster at '{self.address}': {str(e).splitlines()[0]}"
                ) from None
            self._started = True
        self._ray = ray
        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(num_cpus=1, max_retries=MAX_ATTEMPTS - 1)(_call)
        return self

    def __exit__(self, *exc) -> None:
        if self._started:
            self._ray.shutdown()

    def run(self, tasks: Iterable[Task], on_outcome: OnOutcome) -> None:
        ray = self._ray
        refs = {self._remote.remote(self.fn, task): task for task in tasks}
        try:
            while refs:
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    task = refs.pop(ref)
                    try:
                        outcome = ray.get(ref)
                    except ray.exceptions.WorkerCrashedError:
                        outcome = died(task, MAX_ATTEMPTS, "a Ray worker crashed")
                    except ray.exceptions.RayError as e:
                        outcome = Outcome(task.id, None, f"{type(e).__name__}: {str(e).splitlines()[0]}")
                    on_outcome(outcome)
        finally:
            for ref in refs:  # interrupted: stop what has not finished
                ray.cancel(ref, force=True)
