"""The waiting queue keeps the requests deep in a long queue as their arrival index and
rebuilds each near the head (kvsim.sim.waiting): by hand on a toy queue, then whole runs
that keep every waiting request as an index against runs that keep none, under each
engine, on both paths: the same tables to the last bit."""

import copy
from pathlib import Path

import pytest

import kvsim.sim.waiting
from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import validate_scenario
from kvsim.sim.scheduler import Scheduler
from kvsim.sim.waiting import WaitingQueue

from test_fast_path import BASE, assert_same, scenario


class Req:
    """A stand-in for a Seq: compared by identity, as Seqs are."""

    def __init__(self, index):
        self.index = index

    def __repr__(self):
        return f"Req({self.index})"


def test_deep_arrivals_are_indices_until_they_near_the_head():
    made = []

    def rebuild(index):
        made.append(index)
        return Req(index)

    q = WaitingQueue(rebuild, keep=2)
    first = [Req(i) for i in range(5)]
    for i, req in enumerate(first):
        q.arrived(req, i)
    assert len(q) == 5 and q and made == []  # two objects, then 2, 3, 4 as indices
    assert q.popleft() is first[0] and q[0] is first[1]
    q.remove(first[1])
    assert made == [] and len(q) == 3
    head = q[0]  # request 2 is rebuilt in its place
    assert (head.index, made) == (2, [2]) and q[0] is head and q.popleft() is head
    back = Req("requeued")
    q.append(back)  # behind the indices 3 and 4
    assert back in q and first[0] not in q and made == [2]
    q.appendleft(first[0])
    q.extendleft([first[1]])
    assert [r.index for r in q] == [1, 0, 3, 4, "requeued"] and made == [2, 3, 4]
    assert list(q)[2] is q[2]  # iterating made them objects, once
    q.remove(back)
    assert back not in q and len(q) == 4
    with pytest.raises(ValueError):
        q.remove(back)


def test_without_rebuild_every_arrival_stays_an_object():
    q = WaitingQueue(keep=0)
    reqs = [Req(i) for i in range(3)]
    for i, req in enumerate(reqs):
        q.arrived(req, i)
    assert list(q) == reqs


CASES = {
    "vllm-v1": {"engine": "vllm-v1"},
    "vllm-v0": {"engine": "vllm-v0"},
    "sglang": {"engine": "sglang"},
    "v1 samples": {"workload__n": 3},
    "v0 beams": {"engine": "vllm-v0", "workload__beam_width": 2, "scheduler": {"preemption_mode": "recompute"}},
    "v1 rag": {"workload__rag": {"system_tokens": 50, "corpus_docs": 20, "doc_tokens": 40, "docs_per_request": 3}},
    "time limit": {"time_limit_s": 1.5},
    "fleet": {"replicas": 3, "router": "least-loaded"},
    "fleet rag": {
        "replicas": 2,
        "router": "prefix-aware",
        "workload__rag": {"system_tokens": 50, "corpus_docs": 20, "doc_tokens": 40, "docs_per_request": 3},
    },
}


def counted_run(doc, keep, monkeypatch, exact):
    """A run whose queue keeps `keep` requests as objects; also how many it rebuilt."""
    monkeypatch.setattr(kvsim.sim.waiting, "KEEP", keep)
    calls = []
    arrived = Scheduler.arrived
    monkeypatch.setattr(Scheduler, "arrived", lambda self, seq, index: calls.append(index) or arrived(self, seq, index))
    result = run_scenario(validate_scenario(copy.deepcopy(doc), "fast"), Path("."), "fast", exact_steps=exact)
    return result, len(calls)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "plain"])
@pytest.mark.parametrize("case", CASES)
def test_a_queue_of_indices_gives_the_same_tables(case, exact, monkeypatch):
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)
    doc = scenario(**CASES[case])
    objects, arrivals = counted_run(doc, 10**9, monkeypatch, exact)
    indices, calls = counted_run(doc, 0, monkeypatch, exact)
    assert (objects.summary.requests_total.iloc[0], len(objects.summary)) == (
        BASE["workload"]["num_requests"],
        len(BASE["policies"]),
    )
    assert calls > arrivals  # requests were kept as indices and rebuilt
    assert_same(objects, indices)
