"""Latency targets: does a policy's summary row meet the scenario's `slo:` block?

A target names a summary column (ttft_p99_s, tpot_p50_s, ...) and an upper bound in
simulated seconds. A row misses a target when the value is above it, or is missing
(NaN: no request completed), since nothing was shown to meet it.
"""

from __future__ import annotations

import math
from typing import Mapping


def misses(row: Mapping, targets: Mapping[str, float]) -> list[str]:
    """The targets `row` misses, each as "column value > target" (empty: all met)."""
    out = []
    for column, bound in targets.items():
        value = float(row[column])
        if math.isnan(value) or value > bound:
            out.append(f"{column} {value:.4g} > {bound:g}")
    return out


def parse_targets(text: str, src: str = "command line", field: str = "--slo") -> dict[str, float]:
    """'ttft_p99_s=2,tpot_p50_s=0.1' -> {column: seconds}, validated against the SLO block."""
    from kvsim.config.errors import InputError, positive_number
    from kvsim.config.scenario import SLO

    targets = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in SLO.model_fields:
            raise InputError(src, field, f"'{item}' is not NAME=SECONDS with NAME one of {', '.join(SLO.model_fields)}")
        targets[name.strip()] = positive_number(
            value, src, field, f"'{item}': the target must be a positive number of seconds"
        )
    if not targets:
        raise InputError(src, field, "give at least one target, e.g. ttft_p99_s=2,tpot_p50_s=0.1")
    return targets
