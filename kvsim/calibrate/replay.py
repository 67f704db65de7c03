"""Simulate a benchmark run (kvsim.calibrate.runs) and report it as its load generator did.

`Replay` builds what does not depend on the engine overhead once per run: the model
(from its config.json), the KV pool, the request stream. `predict(overhead)` simulates
the run under vLLM V1's rules on an H100 with that overhead and returns one
`PredictedStage` per load stage, each with the statistics inference-perf reports.

The request stream follows inference-perf 0.4.0 (inference_perf/datagen/
shared_prefix_datagen.py, loadgen/load_timer.py, loadgen/load_generator.py):
- `shared_prefix` data: num_groups system prompts of system_prompt_len tokens, each
  with num_prompts_per_group questions of question_len tokens; the prompts are
  shuffled once and every stage sends them in that order, cycling, from the first
  (each stage draws its data anew); every request asks for exactly output_len tokens
  (ignore_eos). Prompt tokens are what the server saw: the stage reports' mean
  `prompt_len` where given (tokenization and the template add a few), else the
  configured lengths plus one (the BOS token).
- `constant` load: int(rate x duration) requests whose gaps are exponential draws
  scaled to sum to the duration; stages follow one another after the previous one's
  requests have all ended.
- The client gives up after `client_timeout_s` (aiohttp's default, 300 s, when
  `load.request_timeout` is unset); such a request counts as failed. (The engine keeps
  serving it here: kvsim cannot yet abort a request.)

`window_s` simulates each stage alone and shortened to that many seconds of arrivals,
after a warm-up that fills the prefix cache with every prompt once (what the stage
finds when it follows another); a stage past its capacity (one whose report shows
failures) keeps its whole length. The fit uses windows to make each simulation cheap;
`kvsim validate` simulates whole runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsim.kvcache import make_allocator
from kvsim.calibrate.runs import BenchmarkRun, MeasuredStage
from kvsim.cost.model import Profiled
from kvsim.cost.engine_terms import ApiServer
from kvsim.cost.overhead import Overhead
from kvsim.sim.loop import simulate
from kvsim.config.errors import InputError
from kvsim.model.memory import activation_estimate, size_pool
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, KVSpec, model_from_hf_config
from kvsim.workload.requests import RequestTable

CLIENT_TIMEOUT_S = 300.0       # aiohttp.ClientTimeout's default total, inference-perf's when unset
WARMUP_S = 10.0                # the warm-up's arrivals, and the pause after it
V1_DEFAULTS = {"max_model_len": 4096, "max_num_batched_tokens": 8192, "max_num_seqs": 1024}


@dataclass(frozen=True)
class PredictedStage:
    index: int
    sent: int
    completed: int
    failed: int
    latency: dict              # what -> {stat: seconds}, as MeasuredStage.latency
    events_per_token: float

    def get(self, what: str, stat: str = "mean") -> float | None:
        return self.latency.get(what, {}).get(stat)

    @property
    def answered(self) -> float:
        return self.completed / self.sent if self.sent else 0.0


@dataclass(frozen=True)
class Simulated:
    """One simulation's requests (engine times, stage -1 for the warm-up) and steps."""
    stages: tuple[int, ...]
    stage: np.ndarray
    arrival: np.ndarray
    prompt_tokens: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    steps: dict


class Replay:
    """One run, ready to simulate under any overhead (see the module docstring)."""

    def __init__(self, run: BenchmarkRun, gpu: str = "h100-80gb", *, window_s: float | None = None,
                 seed: int = 0, events_per_token: int | None = None):
        self.run, self.window_s = run, window_s
        self.model = (model_from_hf_config(run.hf_config) if run.hf_config
                      else MODEL_PRESETS[run.model.split("/")[-1].lower()])
        self.gpu = GPU_PRESETS[gpu]
        self.kv = KVSpec(self.model, self.model.dtype)
        self.limits = {k: run.setting(k, v) for k, v in V1_DEFAULTS.items()}
        tp = run.tp
        act = activation_estimate(self.model, self.limits["max_num_batched_tokens"],
                                  self.limits["max_num_seqs"], tp)
        self.pool_bytes = size_pool(self.model, self.gpu, tp=tp, gpu_memory_utilization=0.9,
                                    kv_cache_memory_gib=None, activation_bytes=act).pool_bytes
        self.shape = _shared_prefix(run)
        self.events = events_per_token or streamed_events(run, self.shape["output"])
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(self.shape["prompts"])
        self.streams = [self._stage_stream(st) for st in run.stages]

    def _stage_stream(self, st: MeasuredStage) -> tuple[np.ndarray, np.ndarray, bool]:
        """(arrival offsets, prompt indices, whole) of one stage, from its zero."""
        whole = self.window_s is None or st.failed > 0 or st.duration_s <= self.window_s
        duration = st.duration_s if whole else self.window_s
        n = int(st.rate_per_s * duration)
        gaps = self.rng.exponential(1 / st.rate_per_s, n)
        times = np.cumsum(gaps * (duration / gaps.sum())) if n else np.zeros(0)
        return times, self.order[np.arange(n) % len(self.order)], whole

    def cost(self, overhead: Overhead) -> Profiled:
        return Profiled(self.model, self.gpu, self.kv, self.run.tp, None, 16, overhead,
                        limits=(self.limits["max_num_seqs"], self.limits["max_num_batched_tokens"]))

    def predict(self, overhead: Overhead) -> list[PredictedStage]:
        return self.report(self.simulate(overhead), overhead.api)

    def simulate(self, overhead: Overhead) -> list["Simulated"]:
        """The engine's side of the run (what the API server's delay does not change)."""
        cost = self.cost(overhead)
        if self.window_s is None:           # the stages one after another, as they ran
            return [self._simulate(cost, list(range(len(self.streams))), warm=False)]
        return [self._simulate(cost, [i], warm=not self.streams[i][2] or i > 0)
                for i in range(len(self.streams))]

    def report(self, sims: list["Simulated"], api: ApiServer | None) -> list[PredictedStage]:
        """Each stage as the client saw it: the engine's times and the API server's delay."""
        out = []
        for sim in sims:
            delay = api.delay(sim.prompt_tokens) if api else 0.0
            first, finish = sim.first + delay, sim.finish + delay
            for i in sim.stages:
                mine = sim.stage == i
                arrival = sim.arrival[mine]
                out.append(self._stage(i, arrival, first[mine], finish[mine], sim.steps,
                                       arrival.min(), finish[mine].max()))
        return sorted(out, key=lambda p: p.index)

    def _simulate(self, cost: Profiled, stages: list[int], warm: bool) -> "Simulated":
        """Stages `stages` in one simulation; each starts once the one before has ended (the
        load generator waits for all its requests) and the next second has begun."""
        arrivals, prompts, label = [], [], []
        t = 0.0
        if warm:                             # every prompt once, one token out, then a pause
            k = len(self.order)
            arrivals.append(np.linspace(0, WARMUP_S, k, endpoint=False))
            prompts.append(self.order)
            label.append(np.full(k, -1))
            t = 2 * WARMUP_S
        # A stage's end is not known before it is simulated; the next one waits for it, so
        # each stage starts after a bound on the previous one's end (its last arrival plus
        # the client's timeout). The engine idles in between, which changes nothing it
        # holds: the prefix cache stays as the stage left it.
        for i in stages:
            times, idx, _ = self.streams[i]
            arrivals.append(t + times)
            prompts.append(idx)
            label.append(np.full(len(times), i))
            t = math.ceil(t + (times[-1] if len(times) else 0.0) + CLIENT_TIMEOUT_S) + 1.0
        arrival = np.concatenate(arrivals)
        prompt = np.concatenate(prompts)
        stage = np.concatenate(label)
        table = self._table(arrival, prompt, stage)
        alloc = make_allocator("paged", self.pool_bytes, self.kv, self.limits["max_model_len"],
                               block_size=16, prefix_caching=True)
        run = simulate(self.run.name, table, alloc, cost, engine="vllm-v1",
                       max_model_len=self.limits["max_model_len"], max_num_seqs=self.limits["max_num_seqs"],
                       max_num_batched_tokens=self.limits["max_num_batched_tokens"], chunked_prefill=True,
                       async_scheduling=True)
        steps = {k: v for k, v in run.steps.columns().items() if k in ("time_s", "step_s", "decode_tokens")}
        return Simulated(tuple(stages), stage, arrival, table.prompt_tokens,
                         run.records.first_token_s, run.records.finish_s, steps)

    def _table(self, arrival, prompt, stage) -> RequestTable:
        sh = self.shape
        n = len(arrival)
        own = sh["prompt_tokens"] - sh["system"]
        segments = [((n + int(p) // sh["per_group"], sh["system"]), (n + sh["groups"] + int(p), own))
                    for p in prompt]
        outputs = np.where(stage < 0, 1, sh["output"])
        return RequestTable(arrival, np.full(n, sh["prompt_tokens"]), outputs, segments)

    def _stage(self, i, arrival, first, finish, steps, t0, t1) -> PredictedStage:
        e2e = finish - arrival
        ok = np.isfinite(e2e) & (e2e <= CLIENT_TIMEOUT_S)
        ttft, e2e = (first - arrival)[ok], e2e[ok]
        out = self.shape["output"]
        events = self.events * (out + 1)      # every token's events and the stream's end ([DONE])
        lat = {"e2e": _stats(e2e), "ttft": _stats(ttft)}
        if len(e2e):
            per_request = (e2e - ttft) / (events - 1)
            lat["tpot"] = _stats(per_request)
            lat["itl"] = {"mean": float(per_request.mean()), **self._itl(steps, t0, t1)}
            lat["decode"] = _stats((e2e - ttft) / max(out - 1, 1))
        return PredictedStage(i, len(arrival), int(ok.sum()), int((~ok).sum()), lat, self.events)

    def _itl(self, steps, t0, t1) -> dict:
        """Inter-token gaps' percentiles: each step's duration once per sequence it
        decoded, and (events per token - 1) near-zero gaps beside each (the other events
        of a token arrive together)."""
        mine = (steps["time_s"] >= t0) & (steps["time_s"] < t1) & (steps["decode_tokens"] > 0)
        dt, w = steps["step_s"][mine], steps["decode_tokens"][mine].astype(float)
        if not len(dt):
            return {}
        order = np.argsort(dt)
        dt, w = dt[order], w[order]
        zeros = w.sum() * (self.events - 1)
        total = zeros + w.sum()
        cum = (zeros + np.cumsum(w)) / total
        out = {}
        for q in (50, 90, 99):
            if q / 100 <= zeros / total:
                out[f"p{q}"] = 0.0
            else:
                out[f"p{q}"] = float(dt[min(int(np.searchsorted(cum, q / 100)), len(dt) - 1)])
        return out


def streamed_events(run: BenchmarkRun, output_tokens: int) -> int:
    """Server-sent events per generated token in the runs' streams, as their reports show
    it: a request streams (E2E - TTFT) / TPOT + 1 events (inference-perf's TPOT is the
    mean gap between them). The vLLM H100 runs show 2.0 for every stage (the server's
    completions stream as those runs' client parsed it: half the gaps are a few
    microseconds); 1 where the reports do not tell."""
    seen = []
    for st in run.stages:
        e2e, ttft, tpot = st.get("e2e"), st.get("ttft"), st.get("tpot")
        if e2e and ttft is not None and tpot:
            seen.append(((e2e - ttft) / tpot + 1) / output_tokens)
    return max(1, round(float(np.median(seen)))) if seen else 1


def _stats(x: np.ndarray) -> dict:
    if not len(x):
        return {}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _shared_prefix(run: BenchmarkRun) -> dict:
    import yaml
    cfg = yaml.safe_load(run.inference_perf.read_text())
    data = cfg.get("data") or {}
    if data.get("type") != "shared_prefix":
        raise InputError(str(run.inference_perf), "data.type", f"{data.get('type')!r}: kvsim replays "
                         "shared_prefix data (other data types come with workload: {inference_perf: PATH})")
    sp = data.get("shared_prefix") or {}
    try:
        groups, per, system = int(sp["num_groups"]), int(sp["num_prompts_per_group"]), int(sp["system_prompt_len"])
        question, output = int(sp["question_len"]), int(sp["output_len"])
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(str(run.inference_perf), "data.shared_prefix", f"needs whole numbers: {e!r}") from None
    seen = [st.prompt_tokens for st in run.stages if st.prompt_tokens]
    prompt = round(float(np.mean(seen))) if seen else system + question + 1
    return {"groups": groups, "per_group": per, "prompts": groups * per, "system": system,
            "output": output, "prompt_tokens": max(prompt, system + 1)}
