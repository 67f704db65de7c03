"""A policy's colour, keyed to what the policy is, so that it is the same in every
figure of every run.

The rule has two parts, both read from the policy's settings (the summary's
`allocator`, `kv_cache_dtype`, `block_size`, `enable_prefix_caching`, `prefix_cache`
columns, and `reserve` and `placement` for contiguous allocation):

1. The *family* sets the hue: contiguous reservation is orange, contiguous with a
   quantized KV cache red; paged blocks blue, paged with quantized KV teal; paged with
   hash prefix caching green, the same quantized olive; a radix cache purple, quantized
   magenta. (Quantized: fp8, fp8_e4m3, fp8_e5m2, int8, int4.)
2. Within a family the *variant* sets the shade, darkest first: for contiguous
   allocation by reservation and placement (max first-fit, pow2 buddy, oracle first-fit,
   max buddy, pow2 first-fit, oracle buddy); for paged and prefix-caching policies by
   block size (16, 32, 8, 64, 128, 256); for a radix cache by page size (1, 16, 32, 8,
   64, 128).

So paged-16 is the darkest blue and paged-16-fp8 the darkest teal in any run, whatever
they are named and wherever they stand in the table. Policies with the same settings
share a colour (their lines still differ in style). Only where one figure holds two
policies of one family whose variants ask for the same shade (a block size outside the
list, say) does the later one, in the order of their settings, take the family's next
free shade; past six variants of one family, and for a policy whose settings are not
known, the colour comes from the policy's name (CRC-32 into a 20-colour palette).
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import pandas as pd

FAMILIES = {  # six shades each, dark to light in the order variants take them
    "contiguous": ("#a63603", "#fd8d3c", "#e6550d", "#7f2704", "#fdae6b", "#d94801"),
    "contiguous-quantized": ("#a50f15", "#fb6a4a", "#de2d26", "#67000d", "#fc9272", "#cb181d"),
    "paged": ("#08519c", "#6baed6", "#3182bd", "#08306b", "#9ecae1", "#2171b5"),
    "paged-quantized": ("#00695c", "#4db6ac", "#00897b", "#004d40", "#80cbc4", "#26a69a"),
    "prefix": ("#006d2c", "#74c476", "#31a354", "#00441b", "#a1d99b", "#238b45"),
    "prefix-quantized": ("#6b6b00", "#b8b83a", "#8f8f1a", "#4d4d00", "#cccc66", "#a3a329"),
    "radix": ("#54278f", "#9e9ac8", "#756bb1", "#3f007d", "#bcbddc", "#6a51a3"),
    "radix-quantized": ("#980043", "#df65b0", "#ce1256", "#67001f", "#d4b9da", "#e7298a"),
}
RESERVATIONS = (
    ("max", "first-fit"),
    ("pow2", "buddy"),
    ("oracle", "first-fit"),
    ("max", "buddy"),
    ("pow2", "first-fit"),
    ("oracle", "buddy"),
)
BLOCK_SIZES = {
    "paged": (16, 32, 8, 64, 128, 256),
    "prefix": (16, 32, 8, 64, 128, 256),
    "radix": (1, 16, 32, 8, 64, 128),
}
QUANTIZED = {"fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
# matplotlib's tab20, dark shades first: for policies whose settings are not known
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
)


class Variant(NamedTuple):
    """Where a policy's settings put it: its family (the hue), the shade it asks for, and
    the settings that make two policies the same variant."""

    family: str
    shade: int
    key: tuple


def variant(row: dict) -> Variant | None:
    """The family, preferred shade and settings key of a policy's settings, or None where
    they are not known (no allocator column)."""
    allocator = row.get("allocator")
    if not isinstance(allocator, str) or allocator not in ("contiguous", "paged"):
        return None
    quantized = str(row.get("kv_cache_dtype", "")) in QUANTIZED
    suffix = "-quantized" if quantized else ""
    dtype = str(row.get("kv_cache_dtype", ""))
    if allocator == "contiguous":
        shape = (_text(row, "reserve", "max"), _text(row, "placement", "first-fit"))
        shade = RESERVATIONS.index(shape) if shape in RESERVATIONS else len(RESERVATIONS)
        return Variant("contiguous" + suffix, shade, ("contiguous", *shape, dtype))
    cache = _text(row, "prefix_cache", "")
    kind = "radix" if cache == "radix" else "prefix" if cache == "hash" or _on(row) else "paged"
    block = _int(row.get("block_size"))
    order = BLOCK_SIZES[kind]
    shade = order.index(block) if block in order else len(order)
    return Variant(kind + suffix, shade, (kind, block, dtype))


def policy_colours(*frames: pd.DataFrame) -> dict[str, str]:
    """One colour per policy named in `frames` (first-seen order), by the rule above;
    settings come from the first frame that has them for a policy."""
    names = _names(*frames)
    settings = _settings(frames)
    colour: dict[str, str] = {}
    taken: dict[str, dict[int, tuple]] = {}  # family -> shade -> settings key
    known = {n: variant(settings[n]) for n in names if n in settings}
    known = {n: v for n, v in known.items() if v is not None}
    for name in sorted(known, key=lambda n: (known[n].shade, repr(known[n].key), n)):
        family, shade, key = known[name]
        shades = taken.setdefault(family, {})
        for step in range(len(FAMILIES[family])):
            slot = (shade + step) % len(FAMILIES[family])
            if shades.get(slot, key) == key:
                shades[slot] = key
                colour[name] = FAMILIES[family][slot]
                break
    rest = [n for n in names if n not in colour]
    size = 10 if len(rest) <= 10 else len(PALETTE)
    used: dict[int, str] = {}
    for name in sorted(rest):
        slot = zlib.crc32(name.encode()) % size
        while slot in used and len(used) < size:
            slot = (slot + 1) % size
        used.setdefault(slot, name)
        colour[name] = PALETTE[slot]
    return {name: colour[name] for name in names}


def with_settings(summary: pd.DataFrame, scenario: dict | None) -> pd.DataFrame:
    """The summary with each contiguous policy's `reserve` and `placement` (which the
    summary does not hold) from the scenario as run, for the colour rule."""
    policies = {str(p.get("name")): p for p in (scenario or {}).get("policies") or [] if isinstance(p, dict)}
    if not policies or "policy" not in summary:
        return summary
    extra = {}
    for key, default in (("reserve", "max"), ("placement", "first-fit")):
        if key not in summary:
            extra[key] = [policies.get(str(n), {}).get(key, default) for n in summary["policy"]]
    return summary.assign(**extra) if extra else summary


def settings_frame(scn) -> pd.DataFrame:
    """A scenario's policies with the settings the colour rule reads, as they take effect
    under its engine (for tables that name policies only: capacity's)."""
    from kvsim.sim.plan import policy_columns

    rows = []
    for policy in scn.policies:
        kind, options = policy.allocator_kind(scn.engine_name)
        effective = policy_columns(scn.engine_settings(), kind, options)
        if kind == "radix":
            effective["block_size"] = options.get("page_size", 1)
        rows.append(
            {
                "policy": policy.name,
                "allocator": "contiguous" if kind == "contiguous" else "paged",
                "kv_cache_dtype": policy.kv_cache_dtype,
                "block_size": effective["block_size"],
                "prefix_cache": effective["prefix_cache"],
                "reserve": getattr(policy, "reserve", None),
                "placement": getattr(policy, "placement", None),
            }
        )
    return pd.DataFrame(rows)


def _names(*frames: pd.DataFrame) -> list[str]:
    names: dict[str, None] = {}
    for frame in frames:
        if "policy" in frame:  # unique() keeps first-seen order, without a string per row
            names.update(dict.fromkeys(str(name) for name in frame["policy"].unique()))
    return list(names)


def _settings(frames) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for frame in frames:
        if "policy" in frame and "allocator" in frame:
            for row in frame.drop_duplicates("policy").to_dict(orient="records"):
                out.setdefault(str(row["policy"]), row)
    return out


def _text(row: dict, key: str, default: str) -> str:
    value = row.get(key)
    return default if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _on(row: dict) -> bool:
    value = row.get("enable_prefix_caching")
    return value is True or str(value).lower() == "true"


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
