"""What a serving engine's step costs beyond its GPU kernels.

Kernel profiles (kvsim.cost.profiles) time each operator alone. A real engine's step
also spends time on the host, scheduling, preparing inputs and block tables, sampling
and launching kernels, and on tensor-parallel communication. kvsim models both as
parts of the step, added to the kernels:

    step   = host + max(device, launch)
    host   = step_s + per_seq_s x sequences + per_prefill_token_s x prompt tokens
    device = kernels + comm
    comm   = layers x 2 all-reduces x (latency_s + latency_per_hop_s x (tp - 1)
             + 2 (tp-1)/tp x N x hidden x 2 B / bus bandwidth
             + the same bytes for the tokens beyond large_step_tokens / large_step_bus)
    launch = layers x launch_per_layer_s

N is the step's new tokens. `host` is CPU work the GPU waits for (scheduling, preparing
inputs and block tables, sampling). `launch` is the CPU time to issue the layers' kernels:
the CPU issues them asynchronously while the GPU runs the ones already issued, so it is
hidden behind device work and shows only when the GPU would otherwise wait, as
`launch_wait` = max(0, launch - device): an engine without CUDA graphs is launch-bound
in small decode steps. The host and launch parts are CPU time; the communication part is
the device's: it moves over the GPU's links. An `Overhead` is fitted on one GPU
(kvsim.cost.overhead_fit, scripts/derive_overheads.py) and carried to another by
`for_gpu`: the host and launch parts unchanged (the CPU is the host's, not the GPU's; kvsim knows
nothing about other hosts' CPUs), both bandwidths scaled by the ratio of the GPUs'
datasheet NVLink bandwidths, the latencies unchanged (small all-reduces are bound by
launch and synchronisation, which datasheets do not give).

Shipped overheads live in kvsim/data/overheads/<name>.json. A file (format
"kvsim-overhead/2") holds ``name``, ``version``, ``gpu`` (where measured), ``source`` and
``license``; ``host`` {step_ms, per_seq_ms, per_prefill_token_ms, launch_per_layer_ms};
``comm`` {latency_us,
latency_per_hop_us, bus_gb_s, large_step_tokens, large_step_bus_gb_s} (optional: without
it the profile's all-reduce is used); ``range`` {tp, seqs, new_tokens: [low, high]}, the
measured steps, beyond which a step is named as extrapolated. The rest (the fit's
points, rules and error) documents the fit and is not read. Format "kvsim-overhead/1" is
the same without ``launch_per_layer_ms`` (read as 0: a purely additive overhead).

Format "kvsim-overhead/3" describes an engine that runs CUDA graphs (vLLM V1) and adds,
each optional (kvsim.cost.engine_terms): ``graphs`` {rule, piecewise_per_layer_ms}, the
capture rule whose steps replay graphs (kvsim.cost.graphs) and the launch cost per layer
of a piecewise step (attention between the pieces); a full-graph step launches nothing
per layer, an eager one (beyond the largest captured size) pays ``launch_per_layer_ms``
as above; ``kernels`` {part: factor}, this engine's kernel time relative to the
profile's for a part of the step; ``api`` {request_ms, per_prompt_token_us}, what the
HTTP server adds to each request's time to first token (and so to its end-to-end time);
``linear`` "measured" (the default) or "envelope": whether this engine's kernel library
runs the profile's linear ops as they were measured or at their envelope, every size no
slower than a larger one (kvsim.cost.profiles.Profile.ops_time), for an engine whose
library picks its GEMM kernels unlike the one the profile was measured with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from kvsim.config.errors import InputError
from kvsim.cost.engine_terms import ApiServer, GraphTerms, kernel_scales
from kvsim.model.specs import GPU_PRESETS, GPUSpec

FORMAT = "kvsim-overhead/2"
GRAPH_FORMAT = "kvsim-overhead/3"
FORMATS = ("kvsim-overhead/1", FORMAT, GRAPH_FORMAT)  # /1: no launch_per_layer_ms (0)
SHIPPED = Path(__file__).parent.parent / "data" / "overheads"
DEFAULT = "splitwise-a100-v2"  # what `calibrated` adds to the kernels (kvsim.cost.model.default_overhead) ...
VLLM_V1_H100 = "vllm-v1-h100-v1"  # ... and for vLLM V1 on an H100 or H200
ACT_BYTES = 2  # fp16/bf16 activations


@dataclass(frozen=True)
class Comm:
    """Two all-reduces per layer, ring-shaped (see the module docstring)."""

    latency_s: float = 0.0
    latency_per_hop_s: float = 0.0
    bus_gb_s: float = float("inf")
    large_step_tokens: int | None = None
    large_step_bus_gb_s: float | None = None

    def seconds(self, tp: int, layers: int, hidden: int, tokens: int) -> float:
        """All-reduce time of one step over every layer."""
        if tp <= 1:
            return 0.0
        ring = 2 * (tp - 1) / tp * hidden * ACT_BYTES  # bytes per token per GPU
        one = self.latency_s + self.latency_per_hop_s * (tp - 1) + ring * tokens / (self.bus_gb_s * 1e9)
        if self.large_step_tokens is not None and tokens > self.large_step_tokens:
            assert self.large_step_bus_gb_s is not None, "large_step_tokens comes with large_step_bus_gb_s"
            one += ring * (tokens - self.large_step_tokens) / (self.large_step_bus_gb_s * 1e9)
        return 2 * layers * one

    def scaled(self, factor: float) -> "Comm":
        """Bandwidths times `factor` (faster links); latencies unchanged."""
        large = self.large_step_bus_gb_s and self.large_step_bus_gb_s * factor
        return replace(self, bus_gb_s=self.bus_gb_s * factor, large_step_bus_gb_s=large)


@dataclass(frozen=True)
class Overhead:
    """Host time per step, the CPU time to launch each layer (hidden behind device work
    when the device is slower) and, when fitted, tensor-parallel communication (None: keep
    the profile's all-reduce). `label` names it in a run's cost_model column."""

    label: str
    step_s: float = 0.0
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0
    comm: Comm | None = None
    gpu: str | None = None  # the GPU it was measured on
    ranges: tuple = ()  # (what, low, high): the measured steps' tp, seqs, new_tokens
    launch_per_layer_s: float = 0.0
    graphs: GraphTerms | None = None  # None: every step launches its kernels (no CUDA graphs)
    kernels: tuple[tuple[str, float], ...] = ()  # (part, factor) on the profile's kernel times
    api: ApiServer | None = None  # what the HTTP server adds to each request
    linear: str = "measured"  # the profile's linear ops as measured, or their envelope

    def outside(self, tp: int, seqs: int, tokens: int) -> list[str]:
        """Why a step lies outside the measured steps (linear extrapolation), if it does."""
        here = {"tp": tp, "seqs": seqs, "new_tokens": tokens}
        units = {"seqs": "sequences", "new_tokens": "tokens"}  # one reason per side, not per value

        def why(k, lo, hi):
            if k == "tp":
                return f"engine overhead at tp {tp} (measured {lo}-{hi})"
            return f"engine overhead at {'more' if here[k] > hi else 'fewer'} {units[k]} than measured ({lo}-{hi})"

        return [why(k, lo, hi) for k, lo, hi in self.ranges if not lo <= here[k] <= hi]

    def host(self, seqs: int, prefill_tokens: int) -> dict[str, float]:
        return {
            "overhead_step": self.step_s,
            "overhead_seqs": self.per_seq_s * seqs,
            "overhead_prompt_tokens": self.per_prefill_token_s * prefill_tokens,
        }

    def launch_wait(self, layers: int, device_s: float) -> float:
        """Seconds the GPU waits for the CPU to launch a step's kernels: the launches beyond
        what the step's device time (kernels and communication) hides."""
        return max(0.0, layers * self.launch_per_layer_s - device_s)

    def for_gpu(self, gpu: GPUSpec) -> "Overhead":
        """The same overhead on `gpu`: host and launch parts as fitted, link bandwidths scaled
        by NVLink."""
        home = GPU_PRESETS.get(self.gpu or "")
        if self.comm is None or home is None or gpu.name == home.name:
            return self
        if not (gpu.nvlink_gb_s and home.nvlink_gb_s):
            return replace(self, label=f"{self.label} (no NVLink figure for {gpu.name}: {home.name}'s links)")
        factor = gpu.nvlink_gb_s / home.nvlink_gb_s
        how = "same NVLink" if factor == 1 else f"links x{factor:g}"
        return replace(self, comm=self.comm.scaled(factor), label=f"{self.label} (on {gpu.name}: {how})")


NONE = Overhead("overhead:none")


def from_file(data: dict) -> Overhead:
    """An Overhead from a kvsim-overhead/1 or /2 document (raises KeyError on a missing field)."""
    host, comm = data["host"], data.get("comm")
    ranges = tuple((k, *data["range"][k]) for k in ("tp", "seqs", "new_tokens") if k in data.get("range", {}))
    graphs, api = data.get("graphs"), data.get("api")
    return Overhead(
        label=f"overhead:{data['name']}",
        gpu=data["gpu"],
        step_s=host["step_ms"] * 1e-3,
        per_seq_s=host["per_seq_ms"] * 1e-3,
        per_prefill_token_s=host["per_prefill_token_ms"] * 1e-3,
        comm=None
        if comm is None
        else Comm(
            latency_s=comm["latency_us"] * 1e-6,
            latency_per_hop_s=comm["latency_per_hop_us"] * 1e-6,
            bus_gb_s=comm["bus_gb_s"],
            large_step_tokens=comm.get("large_step_tokens"),
            large_step_bus_gb_s=comm.get("large_step_bus_gb_s"),
        ),
        ranges=ranges,
        launch_per_layer_s=host.get("launch_per_layer_ms", 0.0) * 1e-3,
        graphs=None if graphs is None else GraphTerms.from_doc(graphs),
        kernels=kernel_scales(data.get("kernels", {})),
        api=None if api is None else ApiServer.from_doc(api),
        linear=_linear(data),
    )


LINEAR_READINGS = ("measured", "envelope")


def _linear(data: dict) -> str:
    value = data.get("linear", "measured")
    if value not in LINEAR_READINGS:
        raise ValueError(f"linear must be one of {', '.join(LINEAR_READINGS)}, got {value!r}")
    return value


def inline(
    step_ms: float = 0.0, per_seq_ms: float = 0.0, per_prefill_token_ms: float = 0.0, launch_per_layer_ms: float = 0.0
) -> Overhead:
    """A host overhead given in a scenario; communication stays the profile's."""
    terms = [
        f"{k} {v:g} ms"
        for k, v in (
            ("step", step_ms),
            ("per seq", per_seq_ms),
            ("per prompt token", per_prefill_token_ms),
            ("launch per layer", launch_per_layer_ms),
        )
        if v
    ]
    return Overhead(
        f"overhead:{', '.join(terms) or 'zero'}",
        step_ms * 1e-3,
        per_seq_ms * 1e-3,
        per_prefill_token_ms * 1e-3,
        launch_per_layer_s=launch_per_layer_ms * 1e-3,
    )


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json") if p.stem != "accuracy")


@lru_cache(maxsize=None)
def shipped_document(name: str) -> dict:
    return json.loads((SHIPPED / f"{name}.json").read_text())


def load_overhead(
    ref: str, base_dir: Path = Path("."), src: str = "command line", field_name: str = "--overhead"
) -> Overhead:
    """A shipped overhead by name, "none", or a kvsim-overhead JSON file (relative to base_dir)."""
    if ref == "none":
        return NONE
    if ref in shipped_names():
        return from_file(shipped_document(ref))
    path = Path(base_dir) / ref
    if not path.is_file():
        raise InputError(
            src,
            field_name,
            f"no overhead '{ref}': not none, a shipped overhead ({', '.join(shipped_names())}) or a file",
        )
    try:
        data = json.loads(path.read_text())
        if data.get("format") not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}")
        return from_file(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(src, field_name, f"overhead file {path} cannot be used: {e!r}") from None
