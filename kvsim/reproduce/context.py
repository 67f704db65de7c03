"""What a claim check is given (Context: the claims' scenarios, quick or not, where its
figures go, a way to run a scenario) and what it returns (Claim rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

COLUMNS = ("id", "claim", "source", "scenario", "measured", "expected", "verdict", "why")


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    source: str
    scenario: str
    measured: str
    expected: str
    verdict: str
    why: str = ""


@dataclass
class Context:
    """What a check gets: the claims folder, speed, where figures go, and a runner."""

    scenarios: Path
    quick: bool
    out: Path
    figures: list[tuple[str, Path]] = field(default_factory=list)  # (claim id, png)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    traces: Path | None = None  # public traces some claims read (kvsim.reproduce.mooncake)

    def load(self, name: str):
        from kvsim.config.scenario import load_scenario

        return load_scenario(self.scenarios / name)

    def run(self, scn, base_dir: Path, src: str, num_requests: int | None = None):
        """Run a scenario (quietly) with num_requests overriding the workload's."""
        from kvsim.analysis.results import run_scenario

        if num_requests is not None:
            scn = scn.model_copy(update={"workload": scn.workload.model_copy(update={"num_requests": num_requests})})
        return run_scenario(scn, base_dir, src)

    def save(self, claim_id: str, fig, name: str) -> None:
        from kvsim.plots.run_figures import save

        self.figures.append((claim_id, save(fig, self.out / name)))
