"""The `kvsim` command line: `kvsim run` and `kvsim memory` (here), `kvsim cost` and
`kvsim calibrate` (kvsim.cli.cost).

Bad input of any kind ends in one line on stderr naming the file (or the command
line), the field and what is allowed, with exit status 2 and nothing written.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import click

from kvsim import __version__
from kvsim.allocators import InvariantError
from kvsim.cli.args import model_arg
from kvsim.cli.cost import calibrate, cost
from kvsim.errors import InputError
from kvsim.memory import kv_footprint
from kvsim.specs import DTYPE_BITS, MODEL_PRESETS, with_kv_heads


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvsim")
def cli():
    """Simulate how KV-cache allocation policies use GPU memory in LLM serving."""


# --- kvsim run -------------------------------------------------------------------
@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Output folder [default: results/<scenario name>/].")
@click.option("--seed", type=click.IntRange(min=0), help="Override the scenario's seed.")
@click.option("--num-requests", type=click.IntRange(min=1), help="Override workload.num_requests.")
@click.option("--policy", "policies", multiple=True, metavar="NAME",
              help="Run only this policy (repeatable).")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary table.")
@click.option("--check-invariants", is_flag=True, envvar="KVSIM_CHECK_INVARIANTS",
              help="Verify the allocator and scheduler after every step (slower).")
@click.option("--exact-steps", is_flag=True, envvar="KVSIM_EXACT_STEPS",
              help="Visit every running request in every step, each step its own SimPy event "
                   "(the plain path; the default fast path gives the same results).")
@click.option("--timeseries-bucket", "bucket_s", type=click.FloatRange(min=0, min_open=True),
              metavar="SECONDS", help="Write the time series as sums per SECONDS of simulated time "
              "instead of one row per step (bounded memory for long runs; the summary is the same "
              "up to the last bits of its time-weighted means).")
@click.option("--force", is_flag=True, help="Replace an --out folder that holds something else.")
@click.option("--profile", metavar="NAME_OR_DIR", help="Step costs from this profile (overrides cost_model).")
def run(scenario, out, seed, num_requests, policies, quiet, check_invariants, exact_steps, bucket_s,
        force, profile):
    """Run every policy of SCENARIO on one request stream and write results and plots."""
    from kvsim.runner import run_scenario
    from kvsim.scenario import load_scenario

    started = time.monotonic()
    scn, base_dir = load_scenario(scenario)
    scn = _override(scn, str(scenario), seed, num_requests, policies)
    if profile is not None:
        from kvsim.cost.generalize import check_profile
        from kvsim.cost.profiles import shipped_names
        from kvsim.scenario import ProfileCost
        ref = profile if profile in shipped_names() else str(Path(profile).resolve())
        check_profile(ref, scn.model_spec(base_dir), Path("."), "command line", "--profile")
        scn = scn.model_copy(update={"cost_model": ProfileCost(profile=ref)})
    out = out or Path("results") / scn.name
    if not force:
        _refuse_foreign(out, scn.name)
    bar = Progress(len(scn.policies), enabled=not quiet and sys.stderr.isatty())
    try:
        results = run_scenario(scn, base_dir, str(scenario), on_progress=bar.update,
                               check_invariants=check_invariants, exact_steps=exact_steps,
                               bucket_s=bucket_s)
    finally:
        bar.close()
    meta = {
        "kvsim_version": __version__, "python": platform.python_version(),
        "scenario": str(scenario), "seed": scn.seed, "policies": [p.name for p in scn.policies],
        "wall_time_s": round(time.monotonic() - started, 3),
        "kv_pool": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results.pool.__dict__.items()},
    }
    _write_results(results, scn, out, meta)
    if not quiet:
        _print_table(results.summary)
        click.echo(f"wrote {out}/")


def _override(scn, src, seed, num_requests, policies):
    update = {}
    if seed is not None:
        update["seed"] = seed
    if num_requests is not None:
        update["workload"] = scn.workload.model_copy(update={"num_requests": num_requests})
    if policies:
        known = {p.name: p for p in scn.policies}
        for name in policies:
            if name not in known:
                raise InputError(src, "--policy", f"no policy '{name}'; the scenario has: {', '.join(known)}")
        update["policies"] = [known[n] for n in dict.fromkeys(policies)]
    return scn.model_copy(update=update)


def _refuse_foreign(out: Path, name: str) -> None:
    """An existing, non-empty --out is replaced only if it holds this scenario's results."""
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError("command line", "--out", f"{out} is a file, not a folder")
    if not any(out.iterdir()):
        return
    try:
        import yaml
        held = yaml.safe_load((out / "scenario.yaml").read_text()).get("name")
    except Exception:   # unreadable or absent: not a kvsim results folder
        held = None
    if held != name:
        what = f"results of scenario '{held}'" if held else "files that are not kvsim results"
        raise InputError("command line", "--out", f"{out} holds {what}; pass --force to replace it")


def _write_results(results, scn, out: Path, meta: dict) -> None:
    """Write into a fresh folder beside `out`, then swap it in: never half a result."""
    from kvsim.report.plots import write_plots

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        results.summary.to_csv(tmp / "summary.csv", index=False)
        rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                for r in results.summary.to_dict(orient="records")]
        (tmp / "summary.json").write_text(json.dumps(rows, indent=2, allow_nan=False) + "\n")
        results.timeseries.to_parquet(tmp / "timeseries.parquet", index=False)
        results.requests.to_parquet(tmp / "requests.parquet", index=False)
        (tmp / "scenario.yaml").write_text(_scenario_yaml(scn))
        write_plots(results.summary, results.timeseries, results.requests, tmp)
        (tmp / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _scenario_yaml(scn) -> str:
    import yaml
    return yaml.safe_dump(scn.model_dump(mode="json", exclude_none=True), sort_keys=False)


SHOWN = [("policy", "{}"), ("kv_utilization", "{:.1%}"), ("internal_fraction", "{:.1%}"),
         ("external_fraction", "{:.1%}"), ("achievable_batch_size", "{:.1f}"),
         ("throughput_tok_s", "{:.0f}"), ("ttft_p50_s", "{:.2f}"), ("preemptions", "{}"),
         ("requests_rejected", "{}"), ("limited_by_memory", "{:.0%}")]


def _print_table(summary) -> None:
    heads = ["policy", "kv util", "internal", "external", "achv batch", "tok/s",
             "ttft p50 s", "preempt", "rejected", "mem-bound"]
    rows = [[fmt.format(r[c]) for c, fmt in SHOWN] for r in summary.to_dict(orient="records")]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    for line in [heads] + rows:
        click.echo("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(line, widths))))
    click.echo("kv util, internal, external, achv batch: time-weighted over the steps in which "
               "memory kept a request waiting (nan: never); mem-bound: their share of the busy "
               f"time; engine: {summary.engine.iloc[0]}; step costs: {summary.cost_model.iloc[0]}")


class Progress:
    """A one-line progress bar on stderr, shown only after the run passes two seconds."""

    def __init__(self, num_policies: int, enabled: bool):
        self.enabled, self.num_policies = enabled, num_policies
        self.start = self.last = time.monotonic()
        self.policies: list[str] = []

    def update(self, policy: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if policy not in self.policies:
            self.policies.append(policy)
        now = time.monotonic()
        if now - self.start < 2 or now - self.last < 0.2:
            return
        self.last = now
        frac = done / total if total else 1
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{len(self.policies)}/{self.num_policies}] {policy:<20.20} "
                         f"|{bar:<30}| {done}/{total} requests")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and time.monotonic() - self.start >= 2:
            sys.stderr.write("\n")


# --- kvsim memory ----------------------------------------------------------------
@cli.command()
@click.option("--model", "model_name", required=True,
              help=f"A preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json path.")
@click.option("--context", type=click.IntRange(min=1), required=True, help="Tokens per request.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Requests.")
@click.option("--kv-dtype", type=click.Choice(list(DTYPE_BITS)), default="fp16", show_default=True)
@click.option("--num-kv-heads", type=click.IntRange(min=1), help="Override the KV heads (e.g. MHA).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def memory(model_name, context, batch, kv_dtype, num_kv_heads, as_json):
    """KV-cache bytes per token, per request and in total (the seeds' formula)."""
    model = with_kv_heads(model_arg(model_name), num_kv_heads)
    fp = kv_footprint(model, context, batch, kv_dtype)
    if as_json:
        click.echo(json.dumps(fp.as_dict(), indent=2))
        return
    shape = (f"{model.num_layers} layers, latent {model.kv_lora_rank}+{model.qk_rope_head_dim}"
             if model.is_mla else f"{model.num_layers} layers, {model.num_kv_heads} KV heads x {model.head_dim}")
    click.echo(f"{model.name} ({fp.attention}: {shape}), KV in {kv_dtype}")
    click.echo(f"per token:    {_bytes(fp.per_token_bytes)}")
    click.echo(f"per request:  {_bytes(fp.per_request_bytes)}  at {context:,} tokens")
    click.echo(f"total:        {_bytes(fp.total_bytes)}  for batch {batch:,}")


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.2f} GB, {n / 2**30:.2f} GiB)" if n >= 1e8 else f"{n:,} B ({n / 1024:.1f} KiB)"


cli.add_command(cost)
cli.add_command(calibrate)


# --- entry point -----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input becomes one line on stderr and exit status 2."""
    try:
        code = cli.main(args=argv, prog_name="kvsim", standalone_mode=False)
    except InputError as e:
        click.echo(f"kvsim: error: {e}", err=True)
        return 2
    except click.UsageError as e:
        click.echo(f"kvsim: error: command line: {e.format_message()}".replace("\n", " "), err=True)
        return 2
    except InvariantError as e:
        click.echo(f"kvsim: invariant violated: {e}", err=True)
        return 3
    except click.exceptions.Abort:
        click.echo("kvsim: interrupted; earlier results left as they were", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"kvsim: error: {e.format_message()}", err=True)
        return e.exit_code
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
