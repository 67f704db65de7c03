"""Simulate a benchmark run (kvsim.calibrate.runs) and report it as its load generator did.

A run is simulated as the scenario a user would write for it: the server's settings
(model, tensor_parallel_size, max_model_len, max_num_batched_tokens, max_num_seqs,
vLLM V1's defaults for the rest: gpu_memory_utilization 0.9, paged blocks of 16 with
prefix caching, asynchronous scheduling) and `workload: {inference_perf: PATH}` on the
run's load-generator config, so the requests, their arrivals, the stages one after
another (each waiting for the last one's requests) and the client's timeout, whose
requests the engine aborts and which count as failed, are kvsim's own reading of
inference-perf (kvsim.config.inference_perf, kvsim.workload.stages). Each stage is
reported by kvsim.analysis.stages, inference-perf's definitions.

Two things the run's reports tell that its config does not:
- Prompt lengths. inference-perf's prompts are text, which the server tokenizes again:
  the reports' mean `prompt_len` (the client's count with the model's tokenizer, which is
  the server's) is some 5% longer than system_prompt_len + question_len. A replay gives
  the prompts that length, the extra shared between the system prompt and the question
  in proportion to their lengths.
- Where the engine overhead's API server delay belongs: added to what the client sees
  (kvsim.cost.engine_terms.ApiServer.respond) after the engine's simulation, so a fit
  varies it without simulating again.

`kv_cache_gib` pins the KV pool per GPU instead of sizing it as vLLM would from the
server's settings (kvsim.model.memory): what a run does with the pool a server logged,
or with one it may have had.

`window_s` shortens each stage that the report shows whole (no failures) to that many
seconds of arrivals, to make the simulations of a fit cheap; a stage past its capacity
keeps its whole length, since its share answered depends on how long its queue grows.
A shortened stage starts as the real one did (the one before it drained, its prefix
cache warm), so what a window leaves out is the stage's later, steady part, and its
start (the first stage's cold prefix cache) weighs more: short windows bias a fit.
`kvsim validate` simulates whole runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.calibrate.runs import BenchmarkRun
from kvsim.config.inference_perf import expand
from kvsim.config.scenario import read_yaml, validate_scenario
from kvsim.cost.model import Profiled
from kvsim.cost.overhead import Overhead
from kvsim.kvcache import make_allocator
from kvsim.sim.loop import PolicyRun, simulate
from kvsim.sim.plan import resolve

V1_DEFAULTS = {"max_model_len": 4096, "max_num_batched_tokens": 8192, "max_num_seqs": 1024}
POLICY = {"name": "vllm", "allocator": "paged", "block_size": 16, "enable_prefix_caching": True}


@dataclass(frozen=True)
class PredictedStage:
    """One stage as kvsim predicts the load generator reports it (a stages.csv row)."""

    index: int
    sent: int
    completed: int
    failed: int
    latency: dict  # what -> {stat: seconds}: e2e, ttft, itl, tpot x mean, p50, p90, p99

    def get(self, what: str, stat: str = "mean") -> float | None:
        return self.latency.get(what, {}).get(stat)

    @property
    def answered(self) -> float:
        return self.completed / self.sent if self.sent else 0.0

    @classmethod
    def from_row(cls, row: dict) -> "PredictedStage":
        latency = {}
        for what in ("e2e", "ttft", "itl", "tpot"):
            stats = {
                s: row[f"{what}_{s}_s"]
                for s in ("mean", "p50", "p90", "p99")
                if row[f"{what}_{s}_s"] == row[f"{what}_{s}_s"]
            }  # not NaN
            if stats:
                latency[what] = stats
        return cls(
            int(row["stage"]),
            int(row["requests"]),
            int(row["completed"]),
            int(row["failed"]) + int(row["unfinished"]),
            latency,
        )


def scenario_of(
    run: BenchmarkRun,
    gpu: str = "h100-80gb",
    window_s: float | None = None,
    seed: int = 0,
    kv_cache_gib: float | None = None,
) -> dict:
    """The scenario (as YAML would give it) that simulates `run`; see the module docstring."""
    src = str(run.inference_perf)
    workload = expand(read_yaml(run.inference_perf, "inference-perf config sections"), src)
    sp = workload["inference_perf"].get("shared_prefix")
    seen = [st.prompt_tokens for st in run.stages if st.prompt_tokens]
    if sp and seen:
        given = sp["system_prompt_len"] + sp["question_len"]
        extra = round(sum(seen) / len(seen)) - given
        if extra > 0:
            system_extra = round(extra * sp["system_prompt_len"] / given)
            sp["system_prompt_len"] += system_extra
            sp["question_len"] += extra - system_extra
    if window_s is not None:
        for stage, measured in zip(workload["arrival"]["stages"], run.stages):
            if measured.failed == 0 and stage["duration_s"] > window_s:
                stage["duration_s"] = float(window_s)
    if run.hf_config is not None:
        model = {"hf_config": str(run.hf_config.resolve())}
    else:
        model = run.model.split("/")[-1].lower()
    limits = {k: run.setting(k, v) for k, v in V1_DEFAULTS.items()}
    pool = {} if kv_cache_gib is None else {"kv_cache_memory_gib": kv_cache_gib}
    return {
        "name": "".join(c if c.isalnum() or c in "_.-" else "-" for c in run.name) or "run",
        "seed": seed,
        "model": model,
        "gpu": gpu,
        "engine": "vllm-v1",
        "tensor_parallel_size": run.tp,
        "gpu_memory_utilization": 0.9,
        **pool,
        "max_model_len": limits["max_model_len"],
        "scheduler": {
            "max_num_seqs": limits["max_num_seqs"],
            "max_num_batched_tokens": limits["max_num_batched_tokens"],
        },
        "cost_model": "calibrated",
        "workload": workload,
        "policies": [dict(POLICY)],
    }


class Replay:
    """One run, ready to simulate under any overhead (see the module docstring): the
    scenario, its KV pool and its request stream are built once."""

    def __init__(
        self,
        run: BenchmarkRun,
        gpu: str = "h100-80gb",
        *,
        window_s: float | None = None,
        seed: int = 0,
        kv_cache_gib: float | None = None,
    ):
        self.run, self.window_s = run, window_s
        src = str(run.inference_perf)
        self.scenario = scn = validate_scenario(scenario_of(run, gpu, window_s, seed, kv_cache_gib), src)
        self.plan = plan = resolve(scn, run.path, src)
        self.policy = plan.policies[0]
        self.settings = self.policy.settings  # every default filled
        self.requests = plan.requests
        self.timeout_s = plan.request_timeout_s

    def cost(self, overhead: Overhead) -> Profiled:
        plan, policy = self.plan, self.policy
        s = policy.settings
        return Profiled(
            plan.model,
            plan.gpu,
            policy.kv,
            plan.tensor_parallel_size,
            None,
            policy.options.get("block_size"),
            overhead,
            limits=(s.max_num_seqs, s.max_num_batched_tokens),
        )

    def simulate(self, overhead: Overhead) -> PolicyRun:
        """The engine's side of the run (what the API server's delay does not change)."""
        plan, policy = self.plan, self.policy
        allocator = make_allocator(policy.kind, plan.pool.pool_bytes, policy.kv, plan.max_model_len, **policy.options)
        run = simulate(
            POLICY["name"],
            self.requests,
            allocator,
            self.cost(overhead),
            engine=policy.settings.engine,
            request_timeout_s=plan.request_timeout_s,
            **policy.scheduler_options(plan),
        )
        run.requests = None  # the replay holds the stream (a worker sends less back)
        return run

    def report(self, run: PolicyRun, overhead: Overhead) -> list[PredictedStage]:
        """Each stage as the client saw it: the engine's times and the API server's delay."""
        from kvsim.analysis.metrics import request_table
        from kvsim.analysis.stages import stage_rows

        run.requests = self.requests
        table = request_table(run)
        if overhead.api is not None:
            table = overhead.api.respond(table, self.timeout_s)
        rows = stage_rows(run, table, list(self.plan.stages), self.plan.streaming)
        run.requests = None
        return [PredictedStage.from_row(r) for r in rows]

    def predict(self, overhead: Overhead) -> list[PredictedStage]:
        return self.report(self.simulate(overhead), overhead)
