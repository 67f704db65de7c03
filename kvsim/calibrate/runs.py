"""A user's benchmark run of a real server, as kvsim reads it to fit and check itself.

A run folder holds what a load generator and a server leave behind:

- `exp-config.yaml`: the server's settings: `model` (its Hugging Face name),
  `tensor_parallelism`, `max_model_len`, `max_num_batched_tokens`, `max_num_seqs`
  (each optional but the model; unset ones take vLLM V1's defaults);
- `inference-perf-config.yaml`: the load generator's configuration (its data and load
  sections say what was sent);
- `stage_N_lifecycle_metrics.json`: inference-perf's report of stage N: how many
  requests were sent, succeeded and failed, and the latency distributions of the
  successes in seconds (`request_latency`, `time_to_first_token`,
  `inter_token_latency`, `time_per_output_token`, each with mean, median, p90, p99).

The model's shape comes from a Hugging Face `config.json`: in the run folder, or in
`models/<name>/config.json` beside it or one level up (the layout of the published
vLLM H100 runs), or from a kvsim preset of the same name. inference-perf's definitions
of the latencies are in inference_perf/reportgen/base.py (`summarize_requests`,
release 0.4.0): E2E is the request's whole time; TTFT the time to the first streamed
server-sent event; inter-token latency every gap between consecutive events of every
streamed request; time per output token each request's (last event - first event) /
(events - 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvsim.config.errors import InputError
from kvsim.model.specs import MODEL_PRESETS

LATENCIES = {
    "e2e": "request_latency",
    "ttft": "time_to_first_token",
    "itl": "inter_token_latency",
    "tpot": "time_per_output_token",
}
STATS = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99"}
SERVER_FIELDS = ("tensor_parallelism", "max_model_len", "max_num_batched_tokens", "max_num_seqs")


@dataclass(frozen=True)
class MeasuredStage:
    """One load stage as the load generator reported it (latencies in seconds; a
    latency no success reported is absent)."""

    index: int
    rate_per_s: float
    duration_s: float
    sent: int
    completed: int
    failed: int
    latency: tuple[tuple[str, tuple[tuple[str, float], ...]], ...]  # (e2e, ((mean, x), ...)), ...
    prompt_tokens: float | None = None  # the successes' mean prompt length, as the client counted it

    def get(self, what: str, stat: str = "mean") -> float | None:
        return dict(dict(self.latency).get(what, ())).get(stat)

    @property
    def answered(self) -> float:
        """The share of the stage's requests that completed."""
        return self.completed / self.sent if self.sent else 0.0


@dataclass(frozen=True)
class BenchmarkRun:
    path: Path
    name: str
    model: str  # the server's model name
    hf_config: Path | None  # its config.json, if found (else a kvsim preset of that name)
    server: tuple[tuple[str, int], ...]  # SERVER_FIELDS the folder sets
    inference_perf: Path
    stages: tuple[MeasuredStage, ...]

    def setting(self, key: str, default: int | None = None) -> int | None:
        return dict(self.server).get(key, default)

    @property
    def tp(self) -> int:
        return self.setting("tensor_parallelism", 1)


def run_dirs(root: Path) -> list[Path]:
    """The runs in folder `root`: its folders that hold an exp-config.yaml, by name."""
    return sorted(p for p in root.iterdir() if (p / "exp-config.yaml").is_file())


def read_run(path: str | Path) -> BenchmarkRun:
    """The run in folder `path`; InputError naming the file and field that is missing or wrong."""
    d = Path(path)
    if not d.is_dir():
        raise InputError(str(d), "RUN_DIR", "not a folder")
    exp = _yaml(d / "exp-config.yaml")
    model = exp.get("model")
    if not isinstance(model, str) or not model:
        raise InputError(str(d / "exp-config.yaml"), "model", "the server's model name is required")
    server = []
    for key in SERVER_FIELDS:
        value = exp.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(str(d / "exp-config.yaml"), key, f"must be a whole number >= 1, got {value!r}")
        server.append((key, value))
    ip = d / "inference-perf-config.yaml"
    config = _yaml(ip)
    stages_cfg = (config.get("load") or {}).get("stages") or []
    reports = sorted(d.glob("stage_*_lifecycle_metrics.json"), key=lambda p: int(p.stem.split("_")[1]))
    if not reports:
        raise InputError(str(d), "stage_N_lifecycle_metrics.json", "no stage reports in the folder")
    if len(reports) != len(stages_cfg):
        raise InputError(
            str(ip), "load.stages", f"{len(stages_cfg)} stages configured, {len(reports)} stage reports in the folder"
        )
    stages = tuple(_stage(i, p, stages_cfg[i]) for i, p in enumerate(reports))
    hf = find_hf_config(d, model)
    if hf is None and model.split("/")[-1].lower() not in MODEL_PRESETS:
        raise InputError(
            str(d / "exp-config.yaml"),
            "model",
            f"no config.json for {model!r} in the folder "
            f"or in models/{model.split('/')[-1]}/ beside it, and no kvsim preset of that name",
        )
    return BenchmarkRun(d, d.name, model, hf, tuple(server), ip, stages)


def find_hf_config(d: Path, model: str) -> Path | None:
    base = model.split("/")[-1]
    for p in (
        d / "config.json",
        d.parent / "models" / base / "config.json",
        d.parent.parent / "models" / base / "config.json",
    ):
        if p.is_file():
            return p
    return None


def _yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError:
        raise InputError(str(path), "file", "missing or unreadable") from None
    except yaml.YAMLError as e:
        raise InputError(str(path), "file", f"not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise InputError(str(path), "file", "must hold a mapping")
    return data


def _stage(i: int, path: Path, cfg: dict) -> MeasuredStage:
    try:
        doc = json.loads(path.read_text())
        load, ok, bad = doc["load_summary"], doc["successes"], doc["failures"]
        latency = []
        for ours, theirs in LATENCIES.items():
            dist = (ok.get("latency") or {}).get(theirs)
            if dist:
                latency.append((ours, tuple((s, float(dist[k])) for s, k in STATS.items())))
        prompt = (ok.get("prompt_len") or {}).get("mean")
        return MeasuredStage(
            i,
            float(cfg["rate"]),
            float(cfg["duration"]),
            int(load["count"]),
            int(ok["count"]),
            int(bad["count"]),
            tuple(latency),
            None if prompt is None else float(prompt),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(str(path), "file", f"not an inference-perf stage report: {e!r}") from None
