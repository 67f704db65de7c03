"""`kvsim fit` and `kvsim validate`: kvsim's step costs against a user's own benchmark runs.

`kvsim fit RUN_DIR... --out FILE` fits the vLLM V1 engine overhead to the runs by
simulating them (kvsim.calibrate.engine_fit) and writes a kvsim-overhead/3 file that a
scenario names as `cost_model: {overhead: FILE}`. `kvsim validate RUN_DIR...` simulates
each run whole, as it ran, and prints and writes predicted against measured per stage
(kvsim.calibrate.run_check): validation.csv, validation.json and validation.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvsim.config.errors import InputError

GPUS = ("h100-80gb", "h200")


def _replays(run_dirs, gpu: str, window_s: float | None):
    from kvsim.calibrate.replay import Replay
    from kvsim.calibrate.runs import read_run

    if not run_dirs:
        raise InputError("command line", "RUN_DIR", "give at least one run folder")
    if gpu not in GPUS:
        raise InputError("command line", "--gpu", f"{gpu!r}: the runs kvsim reads are vLLM V1 on {' or '.join(GPUS)}")
    runs = [read_run(d) for d in run_dirs]
    return [Replay(r, gpu, window_s=window_s) for r in runs]


@click.command()
@click.argument("run_dirs", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The overhead file to write (JSON, format kvsim-overhead/3).",
)
@click.option("--gpu", default="h100-80gb", show_default=True, help=f"The runs' GPU: {', '.join(GPUS)}.")
@click.option("--name", help="The overhead's name [default: the file's stem].")
@click.option(
    "--window",
    "window_s",
    type=click.FloatRange(min=1),
    default=None,
    help="Simulate only this many seconds of arrivals of each stage while fitting, to make it "
    "cheaper (stages with failures run whole) [default: whole stages]. Short windows "
    "bias the fit: a stage's cold start then weighs more.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Simulate the runs in N processes.",
)
@click.option(
    "--max-iterations",
    type=click.IntRange(min=1),
    default=12,
    show_default=True,
    help="Levenberg-Marquardt iterations at most.",
)
@click.option("--quiet", is_flag=True, help="No progress and no table.")
def fit(run_dirs, out, gpu, name, window_s, jobs, max_iterations, quiet):
    """Fit the engine overhead to benchmark runs (folders as inference-perf leaves them)."""
    from kvsim.calibrate import engine_fit, run_check

    replays = _replays(run_dirs, gpu, window_s)
    objective = engine_fit.Objective(replays, workers=jobs)

    def progress(it, theta, cost):
        if not quiet:
            click.echo(
                f"iteration {it}: objective {cost:.4g} ({objective.evaluations} simulations of every run)", err=True
            )

    result = engine_fit.fit(objective, on_iteration=progress, max_iterations=max_iterations)
    name = name or out.stem
    doc = engine_fit.document(result["theta"], name, gpu)
    table = [
        row
        for r, p in zip(replays, objective.predictions(result["theta"]))
        for row in run_check.rows(r.run, p, f"overhead:{name}")
    ]
    doc.update(
        version=1,
        engine="vLLM V1 (as the runs' server ran it)",
        source=f"kvsim fit on {len(replays)} benchmark runs: {', '.join(r.run.name for r in replays)}",
        fit={
            "method": engine_fit.__doc__.split("Objective:")[1].strip().split("\n\n")[0],
            "window_s": window_s,
            **{k: result[k] for k in ("objective", "iterations", "evaluations")},
        },
        error=run_check.summary(table),
        points=table,
    )
    out.write_text(json.dumps(clean(doc), indent=1, sort_keys=True) + "\n")
    if not quiet:
        click.echo(run_check.text_table(table))
        click.echo(f"wrote {out}")


@click.command()
@click.argument("run_dirs", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--cost-model",
    "overhead_ref",
    metavar="NAME|FILE",
    help="The engine overhead: a shipped one or a file [default: calibrated's for vLLM V1 on the GPU].",
)
@click.option("--gpu", default="h100-80gb", show_default=True, help=f"The runs' GPU: {', '.join(GPUS)}.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write validation.csv, validation.json and validation.png here.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Simulate the runs in N processes.",
)
def validate(run_dirs, overhead_ref, gpu, out, jobs):
    """Simulate benchmark runs and compare each stage with what the load generator measured."""
    from kvsim.calibrate import run_check
    from kvsim.cost.overhead import load_overhead
    from kvsim.cost.model import default_overhead
    from kvsim.sim.parallel import ordered_map

    replays = _replays(run_dirs, gpu, None)
    overhead = (
        load_overhead(overhead_ref, Path("."), "command line", "--cost-model")
        if overhead_ref
        else default_overhead("vllm-v1", gpu)
    )
    predicted = ordered_map(lambda i: replays[i].predict(overhead), len(replays), jobs)
    label = replays[0].cost(overhead).label
    table = [row for r, p in zip(replays, predicted) for row in run_check.rows(r.run, p, label)]
    click.echo(f"cost model: {label}")
    click.echo(run_check.text_table(table))
    s = run_check.summary(table)
    click.echo(
        f"E2E mean: mean absolute error {s['e2e_mean_mae']:.1%}, worst stage {s['e2e_mean_worst']:.1%}; "
        f"TTFT p50: median error {s['ttft_p50_median_error']:.1%}"
        + (
            f"; answered share: worst {s['answered_worst_points']:.1f} points"
            if s["answered_worst_points"] == s["answered_worst_points"]
            else ""
        )
    )
    if out:
        import pandas as pd

        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(table).to_csv(out / "validation.csv", index=False)
        (out / "validation.json").write_text(
            json.dumps(clean({"cost_model": label, "summary": s, "stages": table}), indent=1) + "\n"
        )
        run_check.figure(table, out / "validation.png")
        click.echo(f"wrote {out}/validation.csv, validation.json, validation.png", err=True)


def clean(x):
    """NaN as null, floats rounded to 6 places (a valid, stable JSON file)."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return None if x != x else round(x, 6)
    return x
