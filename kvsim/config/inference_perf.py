"""inference-perf's benchmark config as a kvsim workload: `workload: {inference_perf: PATH}`.

kvsim follows kubernetes-sigs/inference-perf at commit b81afa4 (2025-10-15), the code
between releases v0.2.0 and v0.3.0 whose config fields (load.request_timeout and
circuit_breakers, but no load.trace or data.enable_multi_turn_chat yet) the resolved
configs of the vLLM H100 runs carry; v0.3.0 generates the same data and arrivals.
Files read there: inference_perf/config.py, main.py, datagen/shared_prefix_datagen.py,
datagen/random_datagen.py, utils/distribution.py, loadgen/load_timer.py,
loadgen/load_generator.py, client/modelserver/openai_client.py, apis/completion.py,
reportgen/base.py.

What each part of the file becomes:
- `data` (type `shared_prefix` or `random`) and `api.streaming` stay as the
  `workload.inference_perf` block (InferencePerf below; kvsim.workload.inference_perf
  makes its requests).
- `load.stages` (rate, duration) become `workload.arrival.stages`, each with process
  `inference-perf-constant` or `inference-perf-poisson` (load.type), drained as the
  multi-process load generator does: `drain: true, poll_s: 1, pause_s: interval + 1`
  (kvsim.workload.stages).
- `load.request_timeout` becomes `workload.request_timeout_s`. Null (or 0) leaves the
  client's aiohttp session at aiohttp's default total timeout, 300 s (aiohttp/client.py
  DEFAULT_TIMEOUT), which is where the runs' failures at 300-301 s come from. aiohttp
  rounds a deadline of 5 s or more up to the next whole second of its event loop's
  clock (helpers.TimeoutHandle), so real failures end 0-1 s after the timeout; kvsim's
  client gives up at exactly request_timeout_s.
- `server.ignore_eos` must be true (inference-perf's default): kvsim generates every
  request's whole max_tokens and cannot know where a model would stop on its own.
- Ignored, as they change nothing kvsim simulates: api.headers, data.path, server.type,
  model_name, base_url and api_key, tokenizer, metrics, report, storage,
  load.worker_max_tcp_connections. load.num_workers x load.worker_max_concurrency caps
  the requests in flight; kvsim does not model that cap (the runs' 224 x 100 never binds).
- Refused, with a one-line error naming the field: other data types, api.type chat
  (shared_prefix and random send completions only), load types other than constant and
  poisson, load.sweep (its stages come from probing a real server), circuit breakers,
  load.num_workers 0 (the single-process generator, which follows other rules),
  ignore_eos false, and shared_prefix with input or output distributions (this commit
  ignores them; later releases sample lengths from them).

A scenario's own workload.request_timeout_s replaces the file's timeout.
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvsim.config.errors import InputError

AIOHTTP_DEFAULT_TIMEOUT_S = 300.0  # aiohttp.client.DEFAULT_TIMEOUT = ClientTimeout(total=5 * 60)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class SharedPrefix(_Strict):
    """num_groups system prompts of system_prompt_len tokens, each followed by
    num_prompts_per_group questions of question_len tokens; output_len tokens asked
    of each (inference-perf's defaults)."""

    num_groups: int = Field(10, ge=1)
    num_prompts_per_group: int = Field(10, ge=1)
    system_prompt_len: int = Field(100, ge=0)
    question_len: int = Field(50, ge=0)
    output_len: int = Field(50, ge=0)

    @model_validator(mode="after")
    def _some_prompt(self):
        if self.system_prompt_len + self.question_len < 1:
            raise ValueError("system_prompt_len + question_len must be at least 1 (an empty prompt fails)")
        return self


class Distribution(_Strict):
    """Lengths drawn from a normal distribution, clipped to [min, max] and rounded
    (utils/distribution.py generate_distribution); total_count lengths are drawn."""

    min: int = Field(10, ge=0)
    max: int = Field(1024, ge=0)
    mean: float = 512
    std_dev: float = Field(200, ge=0)
    total_count: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _consistent(self):
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        if not self.min <= self.mean <= self.max:
            raise ValueError("mean must lie within [min, max]")
        return self


class InferencePerf(_Strict):
    """The data an inference-perf config asks for (its `data` section and api.streaming)."""

    type: Literal["shared_prefix", "random"]
    shared_prefix: SharedPrefix | None = None
    input_distribution: Distribution | None = None
    output_distribution: Distribution | None = None
    streaming: bool = True  # api.streaming: without it the client sees no first token

    @model_validator(mode="after")
    def _parts(self):
        distributions = self.input_distribution is not None or self.output_distribution is not None
        if self.type == "shared_prefix":
            if self.shared_prefix is None:
                raise ValueError("type shared_prefix needs a shared_prefix block")
            if distributions:
                raise ValueError(
                    "shared_prefix with input/output_distribution: inference-perf at b81afa4 "
                    "ignores the distributions (later releases sample from them); remove them"
                )
        else:
            if self.shared_prefix is not None:
                raise ValueError("type random takes no shared_prefix (inference-perf refuses it)")
            if self.input_distribution is None or self.output_distribution is None:
                raise ValueError("type random needs input_distribution and output_distribution")
            if self.input_distribution.min < 1:
                raise ValueError("input_distribution.min must be at least 1 (an empty prompt fails)")
        return self


# --- reading a config file -----------------------------------------------------------
# Every key inference-perf's config (at b81afa4) has, by section, with what kvsim does.
IGNORED = "ignored"
KNOWN = {
    "api": {"type", "streaming", "headers"},
    "data": {"type", "path", "input_distribution", "output_distribution", "shared_prefix"},
    "load": {
        "type",
        "interval",
        "stages",
        "sweep",
        "num_workers",
        "worker_max_concurrency",
        "worker_max_tcp_connections",
        "circuit_breakers",
        "request_timeout",
    },
    "server": {"type", "model_name", "base_url", "ignore_eos", "api_key"},
    "metrics": None,
    "report": None,
    "storage": None,
    "tokenizer": None,
    "circuit_breakers": None,
}
DATA_TYPES = ("shared_prefix", "random")
LOAD_TYPES = {"constant": "inference-perf-constant", "poisson": "inference-perf-poisson"}


def expand(cfg, src: str) -> dict:
    """The workload keys an inference-perf config (its YAML as read) gives: inference_perf
    (the data), arrival (the stages) and request_timeout_s. Bad or unsupported content
    is an InputError naming the file and the field."""
    if not isinstance(cfg, dict):
        raise InputError(src, "top level", "must be a mapping (api, data, load, server, ...)")
    _known_keys(cfg, KNOWN, src, "")
    api, data, load, server = (_section(cfg, k, src) for k in ("api", "data", "load", "server"))
    for name, section in (("api", api), ("data", data), ("load", load), ("server", server)):
        _known_keys(section, dict.fromkeys(KNOWN[name]), src, name + ".")
    if api.get("type", "completion") != "completion":
        raise InputError(
            src,
            "api.type",
            f"'{api['type']}' is not supported: shared_prefix and random "
            "data send completions only (api.type completion)",
        )
    if cfg.get("circuit_breakers") or load.get("circuit_breakers"):
        where = "circuit_breakers" if cfg.get("circuit_breakers") else "load.circuit_breakers"
        raise InputError(
            src, where, "circuit breakers are not supported (they end a stage on live metrics); remove them"
        )
    if server.get("ignore_eos", True) is not True:
        raise InputError(
            src,
            "server.ignore_eos",
            "must be true: kvsim generates every request's "
            "whole output length and cannot know where the model would stop",
        )
    data_type = data.get("type", "mock")
    if data_type not in DATA_TYPES:
        raise InputError(src, "data.type", f"'{data_type}' is not supported; kvsim reads {' and '.join(DATA_TYPES)}")
    block = {
        k: data[k]
        for k in ("type", "shared_prefix", "input_distribution", "output_distribution")
        if data.get(k) is not None
    }
    block["streaming"] = api.get("streaming", False)  # inference-perf's default is False
    try:
        parsed = InferencePerf.model_validate(block)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        where = ("api." if field == "streaming" else "data.") + field if field else "data"
        raise InputError(src, where, err["msg"].removeprefix("Value error, ")) from None
    return {
        "inference_perf": parsed.model_dump(exclude_none=True),
        "arrival": _arrival(load, src),
        "request_timeout_s": _timeout(load, src),
    }


def _section(cfg: dict, key: str, src: str) -> dict:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(src, key, "must be a mapping")
    return value


def _known_keys(section: dict, known: dict, src: str, prefix: str) -> None:
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise InputError(
                src, prefix + str(key), f"not a key of inference-perf's config{hint}; known: {', '.join(sorted(known))}"
            )


def _arrival(load: dict, src: str) -> dict:
    kind = load.get("type", "constant")
    if kind not in LOAD_TYPES:
        raise InputError(src, "load.type", f"'{kind}' is not supported; kvsim reads {', '.join(LOAD_TYPES)}")
    if load.get("sweep") is not None:
        raise InputError(
            src, "load.sweep", "not supported: a sweep's stages come from probing a real server; give load.stages"
        )
    workers = load.get("num_workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(
            src,
            "load.num_workers",
            "must be a whole number of at least 1 (kvsim follows "
            "the multi-process load generator; num_workers 0 runs another one)",
        )
    interval = _number(load.get("interval", 1.0), src, "load.interval", minimum=0)
    stages = load.get("stages")
    if not isinstance(stages, list) or not stages:
        raise InputError(src, "load.stages", "give a list of stages, each {rate, duration}")
    out = []
    for i, stage in enumerate(stages):
        where = f"load.stages[{i}]"
        if not isinstance(stage, dict) or set(stage) - {"rate", "duration"} or not {"rate", "duration"} <= set(stage):
            raise InputError(src, where, "must be {rate: requests per second, duration: seconds}")
        rate = _number(stage["rate"], src, where + ".rate", minimum=0, open_min=True)
        duration = _number(stage["duration"], src, where + ".duration", minimum=1)
        if duration != int(duration):  # inference-perf's LoadStage.duration is an int
            raise InputError(src, where + ".duration", "must be a whole number of seconds")
        out.append({"rate_per_s": rate, "duration_s": duration, "process": LOAD_TYPES[kind]})
    return {"stages": out, "drain": True, "poll_s": 1.0, "pause_s": interval + 1.0}


def _timeout(load: dict, src: str) -> float:
    value = load.get("request_timeout")
    if not value:  # None or 0: inference-perf passes aiohttp's sentinel, its default
        return AIOHTTP_DEFAULT_TIMEOUT_S
    return _number(value, src, "load.request_timeout", minimum=0, open_min=True)


def _number(value, src: str, field: str, *, minimum: float, open_min: bool = False) -> float:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value == value
        and value != float("inf")
        and (value > minimum if open_min else value >= minimum)
    )
    if not ok:
        raise InputError(src, field, f"must be a number {'>' if open_min else '>='} {minimum:g}")
    return float(value)
