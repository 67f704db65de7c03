"""`kvsim reproduce`: published claims about KV memory, paging, FP8 and prefix caching, measured by kvsim.

Each claim is a function in kvsim.reproduce.checks, listed in CHECKS; it runs the
scenarios it needs from scenarios/claims/ (fewer requests with `quick`) and returns
rows: the claim in words, its source, the scenario, what kvsim measured, what was
claimed, a verdict ("holds", "holds only when …", "does not hold …") and why. A check
never adjusts a model to make a claim hold: where kvsim disagrees, the verdict says so
and `why` gives the cause. Tolerances are part of the `expected` text.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

import pandas as pd

from kvsim.config.errors import InputError
from kvsim.reproduce.context import COLUMNS, Claim, Context


def default_scenarios() -> Path:
    """scenarios/claims/ of the checkout kvsim runs from, else of the working folder."""
    beside = Path(__file__).resolve().parents[2] / "scenarios" / "claims"
    return beside if beside.is_dir() else Path("scenarios") / "claims"


def default_traces() -> Path | None:
    """The reference traces beside the checkout (../shared/data/traces, where the replay
    scenarios find them), or None."""
    beside = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
    return beside if beside.is_dir() else None


def select(only: tuple[str, ...]) -> dict[str, Callable]:
    from kvsim.reproduce.checks import CHECKS

    if not only:
        return CHECKS
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        raise InputError(
            "command line", "--claim", f"unknown claim {', '.join(unknown)}; choose from: {', '.join(CHECKS)}"
        )
    return {c: CHECKS[c] for c in only}


def reproduce(ctx: Context, only: tuple[str, ...] = (), on_claim: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Run the selected checks; one row per claim, in CHECKS order."""
    checks = select(only)
    if not ctx.scenarios.is_dir():
        raise InputError(str(ctx.scenarios), "folder", "not found: the claim scenarios (scenarios/claims/)")
    rows: list[Claim] = []
    for claim_id, check in checks.items():
        if on_claim:
            on_claim(claim_id)
        rows += check(ctx)
    return pd.DataFrame([asdict(r) for r in rows], columns=list(COLUMNS))


def markdown(table: pd.DataFrame) -> str:
    """The claims as a Markdown table (claims.md's and the documentation's)."""
    cols = [c for c in COLUMNS if c != "why"]
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for row in table.to_dict(orient="records"):
        lines.append("| " + " | ".join(str(row[c]).replace("|", "\\|").replace("\n", " ") for c in cols) + " |")
    notes = [f"- **{r['id']}**: {r['why']}" for r in table.to_dict(orient="records") if r["why"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(table: pd.DataFrame, ctx: Context, command: str) -> None:
    """claims.csv, claims.md and report.html into ctx.out (figures are already there)."""
    from kvsim.plots import html

    table.to_csv(ctx.out / "claims.csv", index=False)
    (ctx.out / "claims.md").write_text(f"Measured with `{command}`.\n\n" + markdown(table))
    body = [
        html.heading("kvsim reproduce: the claims, measured", 1),
        html.paragraph(
            f"Measured with `{command}`" + (" (quick settings: fewer requests and rates)" if ctx.quick else "") + "."
        ),
        html.table(table[[c for c in COLUMNS if c != "why"]]),
    ]
    for row in table.to_dict(orient="records"):
        body += [
            html.heading(f"{row['id']}: {row['claim']}", 3),
            html.paragraph(f"Source: {row['source']}. Scenario: {row['scenario']}."),
            html.paragraph(f"Measured: {row['measured']}. Expected: {row['expected']}. Verdict: {row['verdict']}."),
            html.paragraph(row["why"]),
        ]
    shown: set[Path] = set()
    body.append(html.heading("Figures and tables"))
    for claim_id, png in ctx.figures:
        if png not in shown:
            shown.add(png)
            body += [html.heading(f"{claim_id}: {png.name}", 3), html.image(png, png.name)]
    for title, frame in ctx.tables:
        body += [html.heading(title, 3), html.table(frame)]
    (ctx.out / "report.html").write_text(html.page("kvsim reproduce", body), encoding="utf-8")
