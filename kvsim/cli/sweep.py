"""`kvsim sweep` (a grid of scenarios on a local process pool or a Ray cluster) and
`kvsim capacity` (the highest rate each policy sustains within latency targets, or the
fewest GPUs that serve a rate). The work is in kvsim.sweep; this reads flags, shows
progress and writes what it returns.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click

from kvsim.config.errors import InputError

RAY_HELP = "Run on Ray: a cluster's ADDRESS, or 'local' to start one for this run (pip install 'kvsim[ray]')."
WORKERS_HELP = "Processes (or, with --ray local, CPUs) [default: this machine's cores]."


def _backend(workers, ray_address):
    from kvsim.sweep.backends import LocalPool, RayCluster

    return RayCluster(ray_address, workers) if ray_address else LocalPool(workers)


class Bar:
    """A progress bar on stderr (tqdm: count, rate, ETA); nothing unless stderr is a terminal."""

    def __init__(self, total: int | None, what: str, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, unit="run", file=sys.stderr, dynamic_ncols=True)

    def advance(self) -> None:
        if self.bar:
            self.bar.update(1)

    def note(self, text: str) -> None:
        if self.bar:
            self.bar.write(text, file=sys.stderr)
        else:
            click.echo(text, err=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.bar = None


# --- kvsim sweep -----------------------------------------------------------------
@click.command()
@click.argument("sweep_file", metavar="SWEEP", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder [default: results/<sweep name>/, with --quick results/<name>-quick/].",
)
@click.option("--workers", type=click.IntRange(min=1), help=WORKERS_HELP)
@click.option("--ray", "ray_address", metavar="ADDRESS|local", help=RAY_HELP)
@click.option("--resume", is_flag=True, help="Keep the finished points in --out; run the missing and failed ones.")
@click.option("--quick", is_flag=True, help="Use the sweep file's quick: block (a smaller sweep).")
@click.option("--force", is_flag=True, help="Start over in an --out that holds earlier results.")
@click.option("--quiet", is_flag=True, help="No progress bar and no tables.")
def sweep(sweep_file, out, workers, ray_address, resume, quick, force, quiet):
    """Run every point of SWEEP (a base scenario, a grid over its fields, seeds) and write
    one row per (point, policy), a summary with confidence intervals, and plots."""
    from kvsim.sim.parallel import cores
    from kvsim.plots.sweep_figures import write_sweep_plots
    from kvsim.sweep.grid import load_sweep
    from kvsim.sweep.store import Store

    plan = load_sweep(sweep_file, quick=quick)
    out = out or Path("results") / (plan.name + ("-quick" if quick else ""))
    store = Store(out)
    _check_out(out, "sweep.json", resume, force, "pass --resume to keep its finished points or --force to start over")
    backend = _backend(workers, ray_address)
    if force and out.exists() and not resume:
        shutil.rmtree(out)
    todo = {p.id for p in plan.points} - (store.finished() if resume else set())
    labels = {
        p.id: ", ".join(f"{k}={json.dumps(v)}" for k, v in [*p.params.items(), ("seed", p.seed)]) for p in plan.points
    }
    click.echo(
        f"{plan.name}: {len(plan.points)} runs ({len(labels)} distinct), {len(todo)} to run on "
        f"{backend.label}" + (f", {len(labels) - len(todo)} kept" if resume else ""),
        err=True,
    )
    bar = Bar(len(todo), "points", not quiet)

    def progress(outcome) -> None:
        bar.advance()
        if outcome.error:
            bar.note(f"kvsim: point failed ({labels[outcome.id]}): {outcome.error}")

    try:
        with backend:
            store.fill(plan, backend, resume, progress)
    except KeyboardInterrupt:
        bar.close()
        click.echo(
            f"kvsim: sweep interrupted: {len(store.finished())} finished points are kept in "
            f"{out}/points; rerun with --resume to run the rest",
            err=True,
        )
        raise
    finally:
        bar.close()
    rows, summary, errors = store.write_tables(plan)
    from kvsim.analysis.unmodelled import sweep_notes

    notes = sweep_notes([p.scenario for p in plan.points], plan.base_dir)
    write_sweep_plots(summary, plan.params, out, workers or cores(), context=sweep_context(plan), notes=notes)
    if not quiet:
        from kvsim.cli.table import sweep_tables

        for line in sweep_tables(summary, plan.params):
            click.echo(line)
    click.echo(
        f"{len(rows)} rows from {rows['point'].nunique() if len(rows) else 0} finished runs; "
        f"{len(errors)} failed" + (" (errors.csv; --resume retries them)" if len(errors) else "") + f"; wrote {out}/"
    )
    return 1 if len(errors) else 0


def sweep_context(plan) -> str:
    """The base scenario's context line (of the first point), and what the sweep varies."""
    from kvsim.plots.style import context_line, param_label

    if not plan.points:
        return ""
    scenario = plan.points[0].scenario.model_dump(mode="json", exclude_none=True)
    rate = any(p.endswith("rate_per_s") for p in plan.params)
    varied = [param_label(p) for p in plan.params if len({str(q.params.get(p)) for q in plan.points}) > 1]
    seeds = sorted({q.seed for q in plan.points})
    return " · ".join(
        filter(
            None,
            [
                context_line(scenario, swept=rate),
                "swept: " + ", ".join(varied) if varied else "",
                f"seeds {', '.join(map(str, seeds))}",
            ],
        )
    )


def _check_out(out: Path, marker: str, resume: bool, force: bool, advice: str) -> None:
    """Refuse an --out that holds something else, or (without resume or force) earlier results."""
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError("command line", "--out", f"{out} is a file, not a folder")
    if not any(out.iterdir()) or force:
        return
    if not (out / marker).exists():
        raise InputError(
            "command line",
            "--out",
            f"{out} holds files that are not kvsim {marker} results; pass --force to replace them",
        )
    if not resume:
        raise InputError("command line", "--out", f"{out} holds earlier results; {advice}")


# --- kvsim capacity --------------------------------------------------------------
@click.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--slo",
    "slo_text",
    metavar="NAME=SECONDS,...",
    help="Latency targets, e.g. ttft_p99_s=2,tpot_p50_s=0.1 [default: the scenario's slo: block].",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Instead: the fewest GPUs (tensor-parallel degree 1, 2, 4, 8 times replicas 1, 2, 3, "
    "4, 6, 8) that serve RATE requests/s.",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(min=0.001, max=1),
    default=0.05,
    show_default=True,
    help="Stop when the lowest missed rate is within this share above the highest met one.",
)
@click.option("--num-requests", type=click.IntRange(min=1), help="Override workload.num_requests.")
@click.option("--policy", "policies", multiple=True, metavar="NAME", help="Only this policy (repeatable).")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder [default: results/<scenario name>-capacity/].",
)
@click.option("--workers", type=click.IntRange(min=1), help=WORKERS_HELP)
@click.option("--ray", "ray_address", metavar="ADDRESS|local", help=RAY_HELP)
@click.option("--force", is_flag=True, help="Replace an --out that holds something else.")
@click.option("--quiet", is_flag=True, help="No progress and no table.")
def capacity(scenario, slo_text, rate, tolerance, num_requests, policies, out, workers, ray_address, force, quiet):
    """The highest arrival rate each policy of SCENARIO sustains within latency targets
    (bisection over the rate), or with --rate the fewest GPUs that serve that rate."""
    from kvsim.cli.args import override
    from kvsim.analysis.slo import parse_targets
    from kvsim.config.scenario import load_scenario
    from kvsim.sweep import capacity as cap

    scn, base_dir = load_scenario(scenario)
    src = str(scenario)
    scn = override(scn, src, None, num_requests, policies)
    if slo_text is not None:
        targets = parse_targets(slo_text)
    elif scn.slo is not None and scn.slo.targets():
        targets = scn.slo.targets()
    else:
        raise InputError(
            "command line",
            "--slo",
            "the scenario has no slo: block; give targets, e.g. --slo ttft_p99_s=2,tpot_p50_s=0.1",
        )
    cap.arrival_rate(scn, src)
    out = out or Path("results") / f"{scn.name}-capacity"
    _check_out(out, "capacity.json", True, force, "")
    backend = _backend(workers, ray_address)
    bar = Bar(None, "probes", not quiet)

    def seen(probe) -> None:
        bar.advance()

    try:
        with backend:
            if rate is None:
                table, probes = cap.max_rates(scn, base_dir, src, targets, backend, tolerance, seen)
            else:
                table, probes = cap.fewest_gpus(scn, base_dir, src, targets, backend, rate, seen)
    finally:
        bar.close()
    shown = ", ".join(f"{k} <= {v:g} s" for k, v in targets.items())
    meta = {
        "scenario": src,
        "targets": targets,
        "num_requests": scn.workload.num_requests,
        "seed": scn.seed,
        "policies": [p.name for p in scn.policies],
        "backend": backend.label,
    }
    if rate is None:
        meta.update(question="max_rate_per_s", start_rate_per_s=cap.arrival_rate(scn, src), tolerance=tolerance)
        head = (
            f"highest arrival rate within {shown} ({scn.workload.num_requests} requests per probe, "
            f"seed {scn.seed}; rates within {tolerance:.0%})"
        )
    else:
        replicas, router = scn.fleet
        meta.update(
            question="gpus",
            rate_per_s=rate,
            tensor_parallel_sizes=list(cap.TP_SIZES),
            replicas=list(cap.REPLICAS),
            router=router,
        )
        head = (
            f"fewest GPUs serving {rate:g} requests/s within {shown} (GPUs = tensor_parallel_size "
            f"{', '.join(map(str, cap.TP_SIZES))} x replicas {', '.join(map(str, cap.REPLICAS))}; "
            f"{router} router)"
        )
    from kvsim.plots.style import context_line

    context = context_line(scn.model_dump(mode="json", exclude_none=True), swept=rate is None)
    from kvsim.plots.colours import settings_frame
    from kvsim.analysis.unmodelled import notes

    figure = (context, settings_frame(scn), notes(scn, base_dir))
    _write(out, table, cap.probe_table(probes, targets), targets, meta, rate is None, *figure)
    if not quiet:
        from kvsim.cli.table import capacity_lines

        for line in capacity_lines(head, table):
            click.echo(line)
        click.echo(f"wrote {out}/")


def _write(out: Path, table, probes, targets, meta, forward: bool, context: str = "", settings=None, notes=()) -> None:
    """Write into a fresh folder beside `out`, then swap it in (as kvsim run does)."""
    from kvsim.cli.output import swap_in
    from kvsim.plots.sweep_figures import write_capacity_plot

    def write(tmp: Path) -> None:
        table.to_csv(tmp / "capacity.csv", index=False)
        probes.to_csv(tmp / "probes.csv", index=False)
        write_capacity_plot(
            table,
            probes,
            targets,
            "max_rate_per_s" if forward else "gpus",
            "rate_per_s" if forward else "gpus",
            tmp,
            context,
            settings,
            notes,
        )
        (tmp / "capacity.json").write_text(json.dumps(meta, indent=2) + "\n")

    swap_in(out, write)
