"""Sweep files: a base scenario, fixed overrides, a grid (or a list) of points, and seeds.

A sweep names scenario fields by dotted paths into the scenario's YAML: `seed`,
`workload.arrival.rate_per_s`, `scheduler.max_num_seqs`, `policies[*].block_size` (every
policy), `policies[0].block_size` (the first), `policies[allocator=paged].block_size`
(those whose `allocator` is `paged`). A value replaces whatever the path holds (a
mapping for an inline `model:`, a list for `policies:`). Nothing here knows the
scenario's fields: any field, including ones added later, can be swept.

The points are the product of `points` (default: one empty point) and `grid` (every
combination, in the file's order), each run once per seed. Overrides are applied to the
raw YAML (`set` first, then the point, then the seed) and each point is validated like
a scenario file before anything runs. A point's id is a hash of the scenario it runs:
the same scenario is simulated once, and a resumed sweep finds its finished points
even after the grid has grown.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvsim.config.errors import InputError
from kvsim.config.scenario import Scenario, read_yaml, validate_scenario


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Quick(_Strict):
    """What --quick changes: `seeds` and `points` replace, `set` and `grid` update key by key."""

    seeds: list[int] | None = Field(None, min_length=1)
    overrides: dict[str, Any] = Field({}, alias="set")
    grid: dict[str, list[Any]] = {}
    points: list[dict[str, Any]] | None = None


class SweepFile(_Strict):
    scenario: str  # relative to the sweep file
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seeds: list[int] | None = Field(None, min_length=1)
    overrides: dict[str, Any] = Field({}, alias="set")
    grid: dict[str, list[Any]] = {}
    points: list[dict[str, Any]] = []
    quick: Quick | None = None

    def quickened(self) -> "SweepFile":
        q = self.quick
        return self.model_copy(
            update={
                "seeds": q.seeds or self.seeds,
                "overrides": {**self.overrides, **q.overrides},
                "grid": {**self.grid, **q.grid},
                "points": self.points if q.points is None else q.points,
                "quick": None,
            }
        )


@dataclass(frozen=True)
class Point:
    id: str  # hash of the scenario it runs
    params: dict[str, Any]  # swept path -> value, in the sweep's order (seed apart)
    seed: int
    scenario: Scenario


@dataclass(frozen=True)
class Sweep:
    name: str
    src: str  # the sweep file
    scenario_src: str  # the base scenario file
    base_dir: Path  # where the scenario's relative paths start
    params: list[str]  # swept paths: the results' parameter columns
    points: list[Point]  # in plan order: points x grid x seeds


def load_sweep(path: str | Path, quick: bool = False) -> Sweep:
    """Read, expand and validate a sweep; every problem is one InputError naming the sweep file."""
    path = Path(path)
    src = str(path)
    try:
        spec = SweepFile.model_validate(read_yaml(path, "sweep keys (scenario, grid, seeds, ...)"))
    except ValidationError as e:
        raise _input_error(e, src) from None
    if quick:
        if spec.quick is None:
            raise InputError(src, "quick", "--quick needs a quick: block (seeds, set, grid or points to use instead)")
        spec = spec.quickened()
    scenario_path = path.parent / spec.scenario
    if not scenario_path.is_file():
        raise InputError(src, "scenario", f"file {scenario_path} not found")
    base = read_yaml(scenario_path, "scenario keys (name, model, ...)")
    base_scn = validate_scenario(copy.deepcopy(base), str(scenario_path))
    _check_keys(spec, src)

    names = list(dict.fromkeys([k for p in spec.points for k in p] + list(spec.grid)))
    combos = [dict(zip(spec.grid, values)) for values in itertools.product(*spec.grid.values())]
    points = []
    for i, fixed in enumerate(spec.points or [{}]):
        for combo in combos:
            params = {**fixed, **combo}
            for seed in spec.seeds or [base_scn.seed]:
                raw = copy.deepcopy(base)
                for key, value in spec.overrides.items():
                    set_path(raw, key, value, src, f"set.{key}")
                for key, value in params.items():
                    where = f"grid.{key}" if key in spec.grid else f"points[{i}].{key}"
                    set_path(raw, key, value, src, where)
                raw["seed"] = seed
                scn = _validate_point(raw, scenario_path, src, params, seed)
                points.append(Point(scenario_id(scn), params, seed, scn))
    return Sweep(spec.name or path.stem, src, str(scenario_path), scenario_path.parent, names, points)


def scenario_id(scn: Scenario) -> str:
    """A stable name for what a run computes: the validated scenario, hashed."""
    text = json.dumps(scn.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_keys(spec: SweepFile, src: str) -> None:
    for key, values in spec.grid.items():
        if not values:
            raise InputError(src, f"grid.{key}", "give at least one value")
        shown = [json.dumps(v, sort_keys=True) for v in values]
        dup = sorted({v for v in shown if shown.count(v) > 1})
        if dup:
            raise InputError(src, f"grid.{key}", f"repeats the value {dup[0]}")
    for i, point in enumerate(spec.points):
        both = sorted(set(point) & set(spec.grid))
        if both:
            raise InputError(src, f"points[{i}].{both[0]}", "is also in grid: set it in one place")
    if spec.seeds is not None:
        if len(set(spec.seeds)) < len(spec.seeds) or min(spec.seeds) < 0:
            raise InputError(src, "seeds", "give distinct seeds, each 0 or more")
        for section, keys in (
            ("set", spec.overrides),
            ("grid", spec.grid),
            *((f"points[{i}]", p) for i, p in enumerate(spec.points)),
        ):
            if "seed" in keys:
                raise InputError(src, f"{section}.seed", "the sweep has seeds: sweep seeds there, not here")


def _validate_point(raw: dict, scenario_path: Path, src: str, params: dict, seed: int) -> Scenario:
    try:
        return validate_scenario(raw, str(scenario_path))
    except InputError as e:
        where = ", ".join(f"{k}={json.dumps(v)}" for k, v in [*params.items(), ("seed", seed)])
        raise InputError(src, e.field, f"{e.message} (at {where})") from None


# --- dotted paths ----------------------------------------------------------------
_TOKEN = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]")


def parse_path(path: str, src: str, where: str) -> list[tuple[str, str]]:
    """'policies[*].block_size' -> [('key', 'policies'), ('select', '*'), ('key', 'block_size')]."""
    tokens, pos = [], 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if not m or (pos == 0 and path.startswith(".")):
            raise InputError(
                src,
                where,
                "not a field path: use keys joined by '.', with [*], [INDEX] "
                "or [KEY=VALUE] after a list (policies[*].block_size)",
            )
        tokens.append(("key", m.group(1)) if m.group(1) else ("select", m.group(2).strip()))
        pos = m.end()
    if not tokens or tokens[0][0] != "key":
        raise InputError(src, where, "a field path starts with a key")
    return tokens


def set_path(raw: dict, path: str, value: Any, src: str, where: str) -> None:
    """Set `path` in the raw scenario to (a copy of) `value`."""
    _assign(raw, parse_path(path, src, where), value, "", src, where)


def _assign(node, tokens, value, at: str, src: str, where: str) -> None:
    (kind, name), rest = tokens[0], tokens[1:]
    if kind == "key":
        if not isinstance(node, dict):
            raise InputError(src, where, f"{at or 'the scenario'} is {_show(node)}, not a mapping")
        here = f"{at}.{name}" if at else name
        if not rest:
            node[name] = copy.deepcopy(value)
            return
        if node.get(name) is None:
            if rest[0][0] == "select":
                raise InputError(src, where, f"the scenario has no list at {here}")
            node[name] = {}
        _assign(node[name], rest, value, here, src, where)
        return
    if not isinstance(node, list):
        raise InputError(src, where, f"{at} is {_show(node)}, not a list")
    chosen = _select(node, name, src, where, at)
    for i in chosen:
        if rest:
            _assign(node[i], rest, value, f"{at}[{i}]", src, where)
        else:
            node[i] = copy.deepcopy(value)


def _select(items: list, selector: str, src: str, where: str, at: str) -> list[int]:
    if selector == "*":
        chosen = list(range(len(items)))
    elif re.fullmatch(r"-?\d+", selector):
        i = int(selector)
        if not -len(items) <= i < len(items):
            raise InputError(src, where, f"{at} has {len(items)} entries; [{selector}] is out of range")
        chosen = [i % len(items)]
    elif "=" in selector:
        key, _, wanted = (s.strip() for s in selector.partition("="))
        chosen = [i for i, x in enumerate(items) if isinstance(x, dict) and str(x.get(key)) == wanted]
    else:
        raise InputError(src, where, f"[{selector}]: select list entries with [*], [INDEX] or [KEY=VALUE]")
    if not chosen:
        raise InputError(src, where, f"no entry of {at} matches [{selector}]")
    return chosen


def _show(node) -> str:
    text = json.dumps(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _input_error(exc: ValidationError, src: str) -> InputError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc) or "top level"
    if err["type"] == "extra_forbidden":
        model = Quick if loc[0] == "quick" else SweepFile
        valid = [f.alias or name for name, f in model.model_fields.items()]
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return InputError(src, field, f"unknown key{hint}; choose from: {', '.join(valid)}")
    return InputError(src, field, err["msg"].removeprefix("Value error, "))
