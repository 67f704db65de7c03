"""`kvsim compare` (run folders -> report.html), `kvsim reproduce` (the claims table),
and the rate sweep behind `kvsim run --rates`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import click

from kvsim.cli.output import run_meta, simulate_with_progress, swap_in, write_run
from kvsim.cli.table import claim_lines, echo_wrapped, print_run
from kvsim.config.errors import InputError


@click.command()
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/compare"),
    show_default=True,
    help="Folder for report.html and its PNGs.",
)
@click.option("--force", is_flag=True, help="Replace an --out folder that holds something else.")
def compare(dirs, out, force):
    """Compare run folders (or a rate sweep's folder) in one self-contained report.html.

    The report opens from disk: a verdict per policy (latency targets, throughput, what
    limited its batch), the memory breakdown and capacity, memory and batch over time,
    latency percentiles and CDFs, throughput against rate for a sweep, and the tables
    (summary, scenario as run, step-cost models, versions)."""
    from kvsim.plots.compare import build_report, find_runs, load_run

    runs = [load_run(p) for p in find_runs(list(dirs))]
    _refuse_foreign(out, "report.html", force)
    verdict: list[str] = []
    swap_in(out, lambda tmp: verdict.extend(build_report(runs, tmp)))
    echo_wrapped("verdict: " + verdict[0])
    for line in verdict[1:]:
        echo_wrapped("- " + line)
    click.echo(f"compared {len(runs)} run(s): wrote {out}/report.html")


@click.command()
@click.option("--quick", is_flag=True, help="Fewer requests and rates: about a minute on 2 cores.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/claims"),
    show_default=True,
    help="Folder for claims.csv, claims.md, report.html and figures.",
)
@click.option("--claim", "only", multiple=True, metavar="ID", help="Only this claim (repeatable), e.g. 1 or 4.")
@click.option(
    "--scenarios",
    type=click.Path(file_okay=False, path_type=Path),
    help="The claim scenarios [default: scenarios/claims/ of this checkout].",
)
@click.option(
    "--traces",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder with the public traces the Mooncake claims read (Mooncake's synthetic_trace.jsonl) "
    "[default: ../shared/data/traces beside the checkout, if there].",
)
@click.option("--force", is_flag=True, help="Replace an --out folder that holds something else.")
def reproduce(quick, out, only, scenarios, traces, force):
    """Measure published claims (KV-cache explainers, the vLLM paper, Mooncake) and print a verdict for each.

    Runs the scenarios in scenarios/claims/ and writes claims.csv, claims.md and
    report.html: per claim what kvsim measured, what was claimed, and whether it holds."""
    from kvsim.reproduce.claims import (
        Context,
        default_scenarios,
        default_traces,
        reproduce as run_claims,
        select,
        write,
    )

    select(only)  # unknown ids fail before anything runs
    _refuse_foreign(out, "claims.csv", force)
    command = "kvsim reproduce" + (" --quick" if quick else "") + "".join(f" --claim {c}" for c in only)
    started = time.monotonic()

    def work(tmp: Path) -> None:
        ctx = Context(scenarios or default_scenarios(), quick, tmp, traces=traces or default_traces())
        show = sys.stderr.isatty()
        table = run_claims(ctx, only, on_claim=(lambda c: click.echo(f"claim {c} ...", err=True)) if show else None)
        write(table, ctx, command)
        work.table = table

    swap_in(out, work)
    for line in claim_lines(work.table):
        click.echo(line)
    click.echo(f"({time.monotonic() - started:.0f} s) wrote {out}/claims.csv, claims.md, report.html")


class RateRun(NamedTuple):
    """One rate of `kvsim run --rates`: the scenario at that rate, its results and run.json."""

    rate: float
    scenario: Any
    results: Any
    meta: dict


def run_rates(
    scn,
    base_dir,
    src: str,
    rates: list[float],
    out: Path,
    *,
    quiet: bool,
    check_invariants: bool,
    started: float,
    wide: bool = False,
    **run_options,
) -> None:
    """`kvsim run --rates`: one run folder per rate under `out`, then the sweep's curves."""
    from kvsim.plots.colours import settings_frame
    from kvsim.plots.curves import rate_sweep
    from kvsim.plots.run_figures import save
    from kvsim.analysis.rates import summary_lines, sweep_table, with_rate
    from kvsim.plots.style import context_line

    runs = []
    for i, rate in enumerate(rates):
        at = with_rate(scn, rate, src)
        results = simulate_with_progress(
            at, base_dir, src, quiet, check_invariants, label=f"{rate:g} req/s ({i + 1}/{len(rates)}) ", **run_options
        )
        runs.append(RateRun(rate, at, results, run_meta(at, src, results, started)))
    table = sweep_table([(run.rate, run.results.summary, run.results.requests) for run in runs])

    def write(tmp: Path) -> None:
        from kvsim.cli.output import _scenario_yaml

        for run in runs:
            folder = tmp / f"rate-{run.rate:g}"
            folder.mkdir()
            write_run(run.results, run.scenario, folder, run.meta, run_options.get("workers", 1))
        (tmp / "scenario.yaml").write_text(_scenario_yaml(scn))
        table.to_csv(tmp / "rates.csv", index=False)
        context = context_line(scn.model_dump(mode="json", exclude_none=True), runs[-1].results.summary, swept=True)
        save(rate_sweep(table, context, settings=settings_frame(scn)), tmp / "rate_sweep.png")

    swap_in(out, write)
    if not quiet:
        for run in runs:
            click.echo(f"--- {run.rate:g} req/s")
            print_run(run.results.summary, run.scenario, wide=wide)
        click.echo("--- the sweep")
        for line in summary_lines(table):
            echo_wrapped(line)
        click.echo(f"wrote {out}/ (rate-*/ per rate, rates.csv, rate_sweep.png)")


def _refuse_foreign(out: Path, marker: str, force: bool) -> None:
    """An existing, non-empty --out is replaced only if it holds what this command writes."""
    if force or not out.exists():
        return
    if not out.is_dir():
        raise InputError("command line", "--out", f"{out} is a file, not a folder")
    if any(out.iterdir()) and not (out / marker).is_file():
        raise InputError("command line", "--out", f"{out} holds other files; pass --force to replace it")
