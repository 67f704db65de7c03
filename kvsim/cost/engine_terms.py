"""The parts of an engine overhead that belong to a modern serving stack (vLLM V1).

An engine that captures CUDA graphs launches a step's kernels in one call where the step
replays a graph, between the graphs' pieces where it holds prompt tokens, and one by one
where it is larger than any captured size (kvsim.cost.graphs). `GraphTerms` prices the
middle case per layer; the eager one is the overhead's `launch_per_layer_s`, hidden
behind device work as before (kvsim.cost.overhead).

`kernels` scales parts of a profile's kernel time where this engine's kernels are
measured to run faster or slower than the profile's (a profile times each operator
alone, eagerly, with the attention kernels of another backend or GPU; a compiled graph
fuses small operators, and a newer attention kernel reads KV closer to the HBM peak).

`ApiServer` is what the OpenAI-compatible HTTP server adds to each request outside the
engine's steps: receiving and tokenizing the prompt, handing it to the engine process,
and sending the first token back (detokenized, as a server-sent event). It is a delay
on the request, not a cost of a step: a fixed part and a part per prompt token, added to
the time to first token and so to the end-to-end latency. What the server spends per
further streamed token delays each token alike, so it moves no inter-token gap; it is
absorbed into the fixed part. The engine is simulated on the client's clock and the
delay added to what the client sees (`respond`): a request then reaches the engine at
the moment it was sent, milliseconds early, which moves which step it joins by at
most one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.cost.graphs import CudaGraphs

GRAPH_RULES = ("vllm-0.33.0",)  # how capture sizes are chosen (kvsim.cost.graphs)
SCALED_PARTS = ("linear", "attention_decode", "attention_prefill", "lm_head")


@dataclass(frozen=True)
class GraphTerms:
    rule: str = GRAPH_RULES[0]
    piecewise_per_layer_s: float = 0.0

    @classmethod
    def from_doc(cls, doc: dict) -> "GraphTerms":
        rule = doc.get("rule", GRAPH_RULES[0])
        if rule not in GRAPH_RULES:
            raise ValueError(f"graphs.rule must be one of {', '.join(GRAPH_RULES)}, got {rule!r}")
        return cls(rule, _non_negative(doc, "piecewise_per_layer_ms") * 1e-3)

    def to_doc(self) -> dict:
        return {"rule": self.rule, "piecewise_per_layer_ms": round(self.piecewise_per_layer_s * 1e3, 6)}

    def capture(self, max_num_seqs: int, max_num_batched_tokens: int) -> CudaGraphs:
        return CudaGraphs.vllm(max_num_seqs, max_num_batched_tokens)


@dataclass(frozen=True)
class ApiServer:
    request_s: float = 0.0
    per_prompt_token_s: float = 0.0

    @classmethod
    def from_doc(cls, doc: dict) -> "ApiServer":
        return cls(_non_negative(doc, "request_ms") * 1e-3, _non_negative(doc, "per_prompt_token_us") * 1e-6)

    def to_doc(self) -> dict:
        return {
            "request_ms": round(self.request_s * 1e3, 6),
            "per_prompt_token_us": round(self.per_prompt_token_s * 1e6, 6),
        }

    def delay(self, prompt_tokens):
        """Seconds added to a request's time to first token (scalar or array of prompts)."""
        return self.request_s + self.per_prompt_token_s * prompt_tokens

    def respond(self, table, timeout_s: float | None = None):
        """A request table (kvsim.analysis.metrics.request_table) as the client sees it:
        every first and last token later by the delay; a completed request whose last
        token then comes after its client's timeout has timed out, ended at the deadline."""
        delay = self.delay(table.prompt_tokens.to_numpy(dtype=float))
        if not (delay > 0).any():
            return table
        table = table.copy()
        table["first_token_s"] += delay
        done = (table.outcome == "completed").to_numpy()
        table.loc[done, "finish_s"] += delay[done]
        if timeout_s is not None:
            deadline = table.arrival_s + timeout_s
            late = done & (table.finish_s > deadline).to_numpy()
            table.loc[late, "outcome"] = "timed out"
            table.loc[late, "finish_s"] = deadline[late]
        return table


def kernel_scales(doc: dict) -> tuple[tuple[str, float], ...]:
    """(part, factor) pairs from a file's `kernels` block, in SCALED_PARTS order."""
    unknown = sorted(set(doc) - set(SCALED_PARTS))
    if unknown:
        raise ValueError(f"kernels: unknown part {unknown[0]!r}; known: {', '.join(SCALED_PARTS)}")
    return tuple((k, _positive(doc, k)) for k in SCALED_PARTS if k in doc)


def _non_negative(doc: dict, key: str) -> float:
    value = doc.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return float(value)


def _positive(doc: dict, key: str) -> float:
    value = _non_negative(doc, key)
    if value == 0:
        raise ValueError(f"kernels.{key} must be > 0")
    return value
