"""How every kvsim figure looks: a policy's colour and line style, tick labels that
never collide, and the line of context each figure carries.

A policy's colour follows from its settings (kvsim.plots.colours: the allocator family
sets the hue, block size or reservation the shade), so it is the same in every figure
and run. Line styles and markers cycle by position so that identical lines in one
figure stay distinguishable. Only matplotlib-free helpers live here; kvsim.plots.run_figures
and kvsim.plots.curves draw.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pandas as pd

from kvsim.cost.model import undescribe
from kvsim.plots.colours import policy_colours

LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LABEL_WIDTH = 14  # characters per line of a wrapped policy name
INCH_PER_LABEL = 1.25  # horizontal room per bar group, so wrapped labels never meet


@dataclass(frozen=True)
class Style:
    colour: str
    linestyle: str
    marker: str


def policy_styles(*frames: pd.DataFrame) -> dict[str, Style]:
    """Colour from the settings; line style and marker by position, so no two lines match."""
    colours = policy_colours(*frames)
    return {
        name: Style(colours[name], LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)])
        for i, name in enumerate(colours)
    }


def wrap_label(name: str, width: int = LABEL_WIDTH) -> str:
    """A policy name on lines of at most `width` characters, broken after a hyphen or the
    slash of a run's prefix (`rag/paged-16`), never inside a word: a word longer than
    `width` keeps a line of its own."""
    lines: list[str] = []
    for piece in re.findall(r"[^-/]+[-/]?|[-/]", name):
        if lines and len(lines[-1]) + len(piece) <= width:
            lines[-1] += piece
        else:
            lines.append(piece)
    return "\n".join(lines) or name


def bar_figure_width(count: int, minimum: float = 6.5, extra: float = 3.0) -> float:
    """Inches for `count` bar groups with horizontal wrapped labels, plus legend room."""
    return max(minimum, INCH_PER_LABEL * count + extra)


def set_policy_ticks(ax, x, policies: list[str], colours: dict[str, str]) -> None:
    """Horizontal, wrapped policy names in the policy's colour (see bar_figure_width)."""
    ax.set_xticks(x, [wrap_label(p) for p in policies], fontsize=8)
    for tick, name in zip(ax.get_xticklabels(), policies):
        tick.set_color(colours.get(name, "black"))


def same_as(series: dict[str, tuple]) -> dict[str, str]:
    """For lines whose data equal an earlier line's: {name: the earlier name}."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, data in series.items():
        if data in seen:
            out[name] = seen[data]
        else:
            seen[data] = name
    return out


# --- numbers in few characters (tables in the terminal and the report) ------------
def seconds(x: float) -> str:
    """A latency in few characters: 144ms, 7.3ms, 70.8s, 1,234s."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x < 1:
        return f"{x * 1000:.3g}ms"
    return f"{x:,.0f}s" if x >= 1000 else f"{x:.3g}s"


def percent(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


# --- context ---------------------------------------------------------------------
def arrival_rate(scenario: dict) -> float | None:
    """Requests per second of a scenario (as a dict, e.g. its scenario.yaml), or None."""
    arrival = (scenario.get("workload") or {}).get("arrival") or {}
    rate = arrival.get("rate_per_s")
    return float(rate) if rate is not None else None


def _arrival_text(scenario: dict) -> str:
    workload = scenario.get("workload") or {}
    if workload.get("trace"):
        return "trace arrivals"
    arrival = workload.get("arrival") or {}
    if arrival.get("process") == "burst":
        return "all requests at t=0"
    if arrival.get("stages"):
        return (
            "stages "
            + ", ".join(
                f"{s.get('rate_per_s', 0):g} req/s x {s.get('duration_s', 0):g} s" for s in arrival["stages"][:4]
            )
            + (", ..." if len(arrival["stages"]) > 4 else "")
        )
    rate = arrival_rate(scenario)
    return f"{arrival.get('process', '?')} {rate:g} req/s" if rate is not None else "arrivals ?"


def _name(value, default: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return str(value.get("name") or value.get("hf_config") or default)
    return default


def context_line(scenario: dict | None, summary: pd.DataFrame | None = None, swept: bool = False) -> str:
    """'rag_8k · llama-3-8b on h100-80gb, tp 1 · poisson 4 req/s · engine … · step costs …'
    (with `swept`, the arrival rate reads 'rate swept')."""
    if not scenario:
        return ""
    arrival = (scenario.get("workload") or {}).get("arrival") or {}
    parts = [
        str(scenario.get("name", "?")),
        f"{_name(scenario.get('model'), 'model')} on {_name(scenario.get('gpu'), 'gpu')}, "
        f"tp {scenario.get('tensor_parallel_size', 1)}" + _fleet_text(scenario),
        f"{arrival.get('process', '?')} arrivals, rate swept" if swept else _arrival_text(scenario),
    ]
    engines = _distinct(summary, "engine") or ([scenario["engine"]] if scenario.get("engine") else [])
    if engines:
        parts.append("engine " + "/".join(engines))
    costs = list(dict.fromkeys(undescribe(c).label for c in _distinct(summary, "cost_model")))
    if len(costs) == 1:
        parts.append(f"step costs {costs[0]}")
    elif costs:
        parts.append("step costs differ per policy (see the summary)")
    return " · ".join(parts)


def _fleet_text(scenario: dict) -> str:
    n = scenario.get("replicas") or 1
    return f", {n} replicas ({scenario.get('router') or 'round-robin'} router; time series: replica 0)" if n > 1 else ""


def _distinct(summary: pd.DataFrame | None, column: str) -> list[str]:
    if summary is None or column not in summary:
        return []
    values = [str(v) for v in summary[column] if not (isinstance(v, float) and math.isnan(v))]
    return list(dict.fromkeys(values))


# --- swept fields ----------------------------------------------------------------
KNOWN_FIELDS = {
    "rate_per_s": "arrival rate (req/s)",
    "num_requests": "requests",
    "tensor_parallel_size": "tensor_parallel_size",
    "seed": "seed",
}


def param_label(path: str) -> str:
    """A sweep's dotted path in words: `workload.arrival.rate_per_s` -> 'arrival rate
    (req/s)', `policies[allocator=paged].block_size` -> 'block_size (paged policies)',
    `policies[*].kv_cache_dtype` -> 'kv_cache_dtype (every policy)'. Engine settings keep
    vLLM's names, which their users know."""
    leaf = path.rsplit(".", 1)[-1]
    words = KNOWN_FIELDS.get(leaf, leaf)
    selectors = [s for s in _selectors(path) if s]
    return f"{words} ({', '.join(selectors)})" if selectors else words


def _selectors(path: str) -> list[str]:
    out = []
    for part in path.split(".")[:-1]:
        name, _, sel = part.partition("[")
        sel = sel.rstrip("]")
        if not sel:
            continue
        single = "policy" if name == "policies" else name.removesuffix("s")
        if sel == "*":
            out.append(f"every {single}")
        elif "=" in sel:
            key, value = sel.split("=", 1)
            out.append(f"{name} with {key} {value}" if key != "allocator" else f"{value} {name}")
        else:
            out.append(f"{single} {sel}")
    return out
