"""vLLM V1's asynchronous scheduling: a request that arrives while a step runs joins the
step after next (the engine planned the next one when this one started), and an idle
engine plans at once. Exact timelines with one-second steps, on both simulation paths.
"""

import pytest

from kvsim.workload.requests import RequestSpec

from helpers import one_second_run


def timeline(async_scheduling, rows, exact_steps=False):
    requests = [RequestSpec(i, a, p, o) for i, (a, p, o) in enumerate(rows)]
    run = one_second_run(
        requests, max_num_seqs=256, check_invariants=True, exact_steps=exact_steps, async_scheduling=async_scheduling
    )
    return [(s.spec.id, s.admitted_s, s.first_token_s, s.finish_s) for s in run.seqs]


@pytest.mark.parametrize("exact_steps", [False, True])
def test_an_arrival_during_a_step_waits_one_more_step(exact_steps):
    # r0 arrives at an idle engine and is planned at once: steps [0,1], [1,2], ...
    # r1 arrives at 0.5, while step [0,1] runs. Synchronously it joins the step planned at
    # 1; asynchronously that step was planned at 0 (when [0,1] started), so r1 joins the
    # one planned at 1 for [2,3].
    rows = [(0.0, 4, 6), (0.5, 4, 2)]
    assert timeline(False, rows, exact_steps) == [(0, 0.0, 1.0, 6.0), (1, 1.0, 2.0, 3.0)]
    assert timeline(True, rows, exact_steps) == [(0, 0.0, 1.0, 6.0), (1, 2.0, 3.0, 4.0)]


@pytest.mark.parametrize("exact_steps", [False, True])
def test_an_arrival_at_a_step_start_is_seen_by_the_next_plan(exact_steps):
    # r1 arrives at 1.0, the instant step [1,2] starts: the plan for [2,3] (made at 1.0,
    # after the requests arrived at that instant) includes it.
    rows = [(0.0, 4, 6), (1.0, 4, 2)]
    assert timeline(True, rows, exact_steps)[1] == (1, 2.0, 3.0, 4.0)
    assert timeline(False, rows, exact_steps)[1] == (1, 1.0, 2.0, 3.0)


def test_an_idle_engine_plans_at_once():
    # r0 is done at 2.0; r1 arrives at 3.5 to an idle engine and is prefilled at once.
    rows = [(0.0, 4, 2), (3.5, 4, 2)]
    assert timeline(True, rows) == [(0, 0.0, 1.0, 2.0), (1, 3.5, 4.5, 5.5)]


def test_async_scheduling_is_vllm_v1s_default_and_setting():
    from kvsim.config.engine_defaults import resolve
    from kvsim.config.scenario import SchedulerSettings

    big = dict(max_model_len=4096, gpu_name="h100-80gb", gpu_memory_gib=80)
    assert resolve("vllm-v1", SchedulerSettings(), **big).async_scheduling is True
    assert resolve("vllm-v1", SchedulerSettings(async_scheduling=False), **big).async_scheduling is False
    assert resolve("vllm-v0", SchedulerSettings(), **big).async_scheduling is False


@pytest.mark.parametrize("exact_steps", [False, True])
def test_arrivals_a_drained_stage_moved_wait_as_any_other(exact_steps):
    # stage 0's r0 ends at 2.5, the poll at 3 sees it, stage 1's zero is 3 + 2 = 5 (its
    # nominal zero is 3): r1 and r2, nominally at 3.0 and 3.5, come at 5.0 and 5.5. r1
    # finds the engine idle; r2 arrives during step [5,6] and joins the one planned at 6
    # for [7,8], as it would without the move.
    from kvsim.workload.stages import StagePlan
    from kvsim.workload.requests import RequestTable

    plan = StagePlan((1.0, 1.0), (1.0, 2.0), (1, 2), drain=True, pause_s=2.0, poll_s=1.0)
    table = RequestTable([0.5, 3.0, 3.5], [4, 4, 4], [2, 6, 2], stage=[0, 1, 1], plan=plan)

    def ends(async_scheduling):
        run = one_second_run(table, check_invariants=True, exact_steps=exact_steps, async_scheduling=async_scheduling)
        return [(s.admitted_s, s.first_token_s, s.finish_s) for s in run.seqs]

    assert ends(False) == [(0.5, 1.5, 2.5), (5.0, 6.0, 11.0), (6.0, 7.0, 8.0)]
    assert ends(True) == [(0.5, 1.5, 2.5), (5.0, 6.0, 11.0), (7.0, 8.0, 9.0)]
