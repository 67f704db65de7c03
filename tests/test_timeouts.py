"""Client timeouts: a request past request_timeout_s is aborted wherever it is, its KV
freed, and it counts once, as failed (kvsim.sim.loop, Scheduler.abort)."""

from __future__ import annotations

import pytest

from kvsim.kvcache import PagedAllocator, PrefixCachingPagedAllocator
from kvsim.sim.loop import simulate
from kvsim.analysis.metrics import request_table, summarize
from kvsim.analysis.stages import stage_rows
from kvsim.workload.requests import RequestTable

from helpers import OneSecondSteps


def run(table, allocator, timeout, exact=True, **options):
    opts = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=True)
    opts.update(options)
    return simulate(
        "p",
        table,
        allocator,
        OneSecondSteps(),
        check_invariants=True,
        exact_steps=exact,
        request_timeout_s=timeout,
        **opts,
    )


def rows(result):
    t = request_table(result)
    return list(zip(t.admitted_s.round(6), t.first_token_s.round(6), t.finish_s.round(6), t.outcome))


@pytest.mark.parametrize("exact", [True, False])
def test_a_waiting_request_past_its_timeout_leaves_the_queue(exact):
    # 4 blocks of 4: r0 (12 + 4) holds 3 after its prefill and the 4th from t=1, when
    # its first token is fed back; r1 arrives at 0.5 and waits for memory. Both clients
    # wait 2.5 s: r0's leaves at 2.5, r1's at 3, and the step starting at 3 aborts both,
    # r1 before it was ever admitted
    alloc = PagedAllocator(4, 4)
    result = run(RequestTable([0.0, 0.5], [12, 4], [4, 4]), alloc, 2.5, exact)
    got = rows(result)
    assert got[0] == (0.0, 1.0, 2.5, "timed out")
    assert got[1][2:] == (3.0, "timed out") and got[1][0] != got[1][0]  # never admitted (NaN)
    assert alloc.breakdown(None).free == alloc.capacity
    s = summarize(result, request_table(result))
    assert (s["requests_completed"], s["requests_timed_out"], s["requests_unfinished"]) == (0, 2, 0)


@pytest.mark.parametrize("exact", [True, False])
def test_a_running_request_past_its_timeout_frees_its_kv(exact):
    # r0 (4 + 10) runs from 0; its client gives up at 3.5, so the step at 4 aborts it and
    # frees its blocks: r1 (arrived at 3, held back by max_num_seqs 1) is admitted at once
    alloc = PagedAllocator(5, 4)
    result = run(RequestTable([0.0, 3.0], [4, 12], [10, 2]), alloc, 3.5, exact, max_num_seqs=1)
    got = rows(result)
    assert got[0][2:] == (3.5, "timed out")
    assert got[1] == (4.0, 5.0, 6.0, "completed")
    assert alloc.tokens_of(0) is None and alloc.tokens_of(64) is None
    assert alloc.breakdown(None).free == alloc.capacity  # nothing left held
    table = request_table(result)
    row = stage_rows(result, table, [(1.0, 2.0)])[0]
    # counted once: a failure, in neither the latencies nor the throughput
    assert (row["requests"], row["completed"], row["failed"]) == (2, 1, 1)
    assert row["e2e_mean_s"] == 3.0
    assert row["requests_per_s"] == 1 / 6.0  # over the stage's span, 0 to 6


def test_a_request_finishing_after_its_deadline_timed_out():
    # r0's last token comes at 3 (steps end at 1, 2, 3); its client left at 2.5
    result = run(RequestTable([0.0], [4], [3]), PagedAllocator(8, 4), 2.5)
    assert rows(result) == [(0.0, 1.0, 2.5, "timed out")]


def test_prefix_cached_kv_of_an_aborted_request_stays_reusable():
    # r0 is aborted after its prompt is computed; its full blocks stay in the prefix cache,
    # so r1, the same prompt, finds them
    alloc = PrefixCachingPagedAllocator(16, 4)
    segs = [((100, 9),), ((100, 9),)]
    table = RequestTable([0.0, 5.0], [9, 9], [20, 2], segments=segs)
    result = run(table, alloc, 3.0)
    got = rows(result)
    assert got[0][3] == "timed out" and got[1][3] == "completed"
    assert result.cached_tokens == 8  # r1 reuses r0's two full blocks


def test_no_timeout_changes_nothing():
    table = RequestTable([0.0, 0.5, 0.7], [8, 4, 6], [8, 4, 3])
    plain = rows(run(table, PagedAllocator(4, 4), None))
    assert plain == rows(run(table, PagedAllocator(4, 4), 1e9))
