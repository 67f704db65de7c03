"""Capacity: the highest arrival rate each policy sustains within latency targets, and the
fewest GPUs that serve a given rate.

A rate *meets* the targets when the policy's summary row at that rate misses none of
them (kvsim.analysis.slo.misses) and no request is left unfinished by `time_limit_s`
(its latency is unknown, and only a server that cannot keep up leaves requests behind).
Each policy runs alone on the scenario's requests with the arrival rate replaced; the
same seed gives the same requests and the same arrival draws at every rate, scaled in
time, so the search compares like with like.

Search, per policy (all policies at once, and several rates of one policy at once when
there are more workers than policies): start at the scenario's rate; while every rate
tried meets, try 2x, 4x, ... the highest; while every rate misses, 1/2x, 1/4x, ... the
lowest; once a met rate lies below a missed one, split the bracket geometrically
(bisection with one worker per policy, k-section with k). Stop when
lowest missed / highest met <= 1 + tolerance, and report the highest met rate. The
bracket is widened at most 2^EXPAND times either way; beyond that the answer is
reported as unbracketed. The rates tried depend on how many run at once (the backend's
slots), so answers found with different worker counts agree within the tolerance, not
to the digit; the same count gives the same answer on any backend.

Saturation: above the rate the engine can serve (mu), the queue grows with every
arrival, and request i waits about i x (1/mu - 1/rate). With N requests a percentile q
of TTFT (or e2e) stays below T up to rate mu / (1 - mu T / (q N)), so a finite run
overstates capacity by about mu T / (q N): raise num_requests until that is small
(mu = 4/s, T = 2 s, N = 2,000, p99: 0.4%). TPOT targets do not diverge this way: a
saturated engine decodes a full batch at a bounded step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from kvsim.config.errors import InputError
from kvsim.analysis.metrics import ten_digits
from kvsim.analysis.slo import misses
from kvsim.config.scenario import Constant, Gamma, Poisson, Scenario
from kvsim.sweep.backends import Outcome, Task
from kvsim.sweep.grid import scenario_id

EXPAND = 20  # doublings (or halvings) from the starting rate
TP_SIZES = (1, 2, 4, 8)  # tensor-parallel degrees tried for --rate ...
REPLICAS = (1, 2, 3, 4, 6, 8)  # ... and replicas of each (GPUs = tp x replicas)


@dataclass(frozen=True)
class Probe:
    policy: str
    rate_per_s: float
    tensor_parallel_size: int
    replicas: int
    met: bool
    why: str  # the targets missed, or the error; empty when met
    values: dict  # the targets' columns at this rate


@dataclass
class Search:
    """One policy's bracket: the probes so far decide the next rates."""

    policy: str
    start: float
    probes: list[Probe] = field(default_factory=list)

    @property
    def lowest_missed(self) -> float | None:
        return min((p.rate_per_s for p in self.probes if not p.met), default=None)

    @property
    def highest_met(self) -> float | None:
        """The highest met rate below every missed one (what the bracket's floor is)."""
        cap = self.lowest_missed
        return max((p.rate_per_s for p in self.probes if p.met and (cap is None or p.rate_per_s < cap)), default=None)

    def done(self, tolerance: float) -> bool:
        lo, hi = self.highest_met, self.lowest_missed
        if lo is not None and hi is not None:
            return hi / lo <= 1 + tolerance
        if not self.probes:
            return False
        return (hi is None and lo >= self.start * 2**EXPAND) or (lo is None and hi <= self.start / 2**EXPAND)

    def next_rates(self, k: int) -> list[float]:
        lo, hi = self.highest_met, self.lowest_missed
        if not self.probes:
            return [self.start * 2.0**j for j in [0, 1, -1, 2, -2, 3, -3][:k]]
        if lo is not None and hi is not None:
            return [lo * (hi / lo) ** (i / (k + 1)) for i in range(1, k + 1)]
        if hi is None:
            return [lo * 2.0**j for j in range(1, k + 1)]
        return [hi / 2.0**j for j in range(1, k + 1)]

    def row(self) -> dict:
        lo, hi = self.highest_met, self.lowest_missed
        note = ""
        if lo is None:
            note = f"missed the targets at every rate tried, down to {hi:.4g}/s"
        elif hi is None:
            note = f"met the targets at every rate tried, up to {lo:.4g}/s"
        elif any(p.met and p.rate_per_s > hi for p in self.probes):
            note = "not monotone: a higher rate met the targets than one that missed"
        return {
            "policy": self.policy,
            "max_rate_per_s": ten_digits(lo) if lo is not None else 0.0,
            "lowest_missed_rate_per_s": ten_digits(hi) if hi is not None else math.nan,
            "probes": len(self.probes),
            "note": note,
        }


def arrival_rate(scn: Scenario, src: str) -> float:
    arrival = scn.workload.arrival
    if not isinstance(arrival, (Poisson, Gamma, Constant)):
        raise InputError(
            src,
            "workload.arrival",
            "capacity varies the arrival rate: use process "
            "poisson, gamma or constant (a burst, stages or a trace have no one rate)",
        )
    return arrival.rate_per_s


def probe_scenario(scn: Scenario, policy, rate: float, tp: int, replicas: int | None) -> Scenario:
    wl = scn.workload
    arrival = wl.arrival.model_copy(update={"rate_per_s": rate})
    return scn.model_copy(
        update={
            "policies": [policy],
            "tensor_parallel_size": tp,
            "replicas": replicas,
            "workload": wl.model_copy(update={"arrival": arrival}),
        }
    )


def judge(outcome: Outcome, policy: str, rate: float, tp: int, replicas: int, targets: dict) -> Probe:
    if outcome.summary is None:
        return Probe(policy, rate, tp, replicas, False, outcome.error, {})
    row = outcome.summary.iloc[0].to_dict()
    missed = misses(row, targets)
    if row["requests_unfinished"]:
        missed.append(f"{row['requests_unfinished']} requests unfinished at time_limit_s")
    return Probe(policy, rate, tp, replicas, not missed, "; ".join(missed), {k: row[k] for k in targets})


def _run(backend, jobs: dict[str, tuple], scn, base_dir, src, targets, on_probe, fatal_input: bool) -> list[Probe]:
    """jobs: task id -> (policy, rate, tp, replicas); runs them all and judges each. With
    fatal_input, bad input stops the search (the scenario is wrong); without, it is a
    missed probe (a tensor-parallel degree whose weights do not fit, say)."""
    tasks, probes = [], []
    for tid, job in jobs.items():
        tasks.append(Task(tid, probe_scenario(scn, *job), base_dir, src))

    def collect(outcome: Outcome) -> None:
        policy, rate, tp, replicas = jobs[outcome.id]
        if outcome.input_error and fatal_input:
            raise InputError(*outcome.input_error)
        probes.append(judge(outcome, policy.name, rate, tp, replicas or 1, targets))
        on_probe(probes[-1])

    backend.run(tasks, collect)
    return probes


def max_rates(
    scn: Scenario, base_dir, src: str, targets: dict, backend, tolerance: float, on_probe=lambda p: None
) -> tuple[pd.DataFrame, list[Probe]]:
    """The highest rate each policy sustains within `targets` (see the module docstring);
    `backend` is open, and its `slots` (points at once) decide how many rates a round tries."""
    start = arrival_rate(scn, src)
    searches = {p.name: Search(p.name, start) for p in scn.policies}
    policies = {p.name: p for p in scn.policies}
    while True:
        active = [s for s in searches.values() if not s.done(tolerance)]
        if not active:
            break
        k = max(1, backend.slots // len(active))
        jobs = {}
        for s in active:
            for rate in s.next_rates(k):
                job = (policies[s.policy], rate, scn.tensor_parallel_size, scn.replicas)
                jobs[scenario_id(probe_scenario(scn, *job))] = job
        for probe in _run(backend, jobs, scn, base_dir, src, targets, on_probe, fatal_input=True):
            searches[probe.policy].probes.append(probe)
    table = pd.DataFrame([s.row() for s in searches.values()])
    return table, [p for s in searches.values() for p in s.probes]


def fewest_gpus(
    scn: Scenario, base_dir, src: str, targets: dict, backend, rate: float, on_probe=lambda p: None
) -> tuple[pd.DataFrame, list[Probe]]:
    """The fewest GPUs (tensor_parallel_size x replicas, of TP_SIZES x REPLICAS) with which
    each policy serves `rate`: GPU counts are tried in rising order, every layout of a
    count at once, until one meets the targets. Of several layouts of that count that
    meet, the one with the smallest tp is reported and the others named in the note.
    The fleet routes with the scenario's router (default round-robin)."""
    arrival_rate(scn, src)
    layouts = sorted((tp * r, tp, r) for tp in TP_SIZES for r in REPLICAS)  # (gpus, tp, replicas)
    open_policies, probes, rows = list(scn.policies), [], {}
    for gpus in dict.fromkeys(g for g, _, _ in layouts):
        jobs = {}
        for policy in open_policies:
            for tp, r in ((tp, r) for g, tp, r in layouts if g == gpus):
                job = (policy, rate, tp, r)
                jobs[scenario_id(probe_scenario(scn, *job))] = job
        found = _run(backend, jobs, scn, base_dir, src, targets, on_probe, fatal_input=False)
        probes += found
        for policy in list(open_policies):
            met = sorted((p for p in found if p.policy == policy.name and p.met), key=lambda p: p.tensor_parallel_size)
            if met:
                also = ", ".join(f"tp {p.tensor_parallel_size} x {p.replicas}" for p in met[1:])
                rows[policy.name] = (
                    gpus,
                    met[0].tensor_parallel_size,
                    met[0].replicas,
                    f"also met: {also}" if also else "",
                )
                open_policies.remove(policy)
        if not open_policies:
            break
    most = f"not met with up to {max(TP_SIZES) * max(REPLICAS)} GPUs (tp {TP_SIZES[-1]} x {REPLICAS[-1]} replicas)"
    table = pd.DataFrame(
        [
            {
                "policy": p.name,
                "rate_per_s": rate,
                **dict(
                    zip(
                        ("gpus", "tensor_parallel_size", "replicas", "note"), rows.get(p.name, (None, None, None, most))
                    )
                ),
            }
            for p in scn.policies
        ]
    )
    table = table.astype({"gpus": "Int64", "tensor_parallel_size": "Int64", "replicas": "Int64"})
    return table, probes


def probe_table(probes: list[Probe], targets: dict) -> pd.DataFrame:
    rows = [
        {
            "policy": p.policy,
            "rate_per_s": ten_digits(p.rate_per_s),
            "gpus": p.tensor_parallel_size * p.replicas,
            "tensor_parallel_size": p.tensor_parallel_size,
            "replicas": p.replicas,
            "met": p.met,
            **{k: p.values.get(k, math.nan) for k in targets},
            "why": p.why,
        }
        for p in probes
    ]
    return (
        pd.DataFrame(rows)
        .sort_values(["policy", "gpus", "tensor_parallel_size", "rate_per_s"], kind="stable")
        .reset_index(drop=True)
    )
