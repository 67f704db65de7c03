"""The `kvsim` command line: `kvsim run` and `kvsim memory` (here), `kvsim cost` and
`kvsim calibrate` (kvsim.cli.cost), `kvsim compare` and `kvsim reproduce` (kvsim.cli.report),
`kvsim cache-curve` (kvsim.cli.cache_curve).

Bad input of any kind ends in one line on stderr naming the file (or the command
line), the field and what is allowed, with exit status 2 and nothing written.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import click

from kvsim import __version__
from kvsim.kvcache import InvariantError
from kvsim.cli.args import model_arg, override
from kvsim.cli.cache_curve import cache_curve
from kvsim.cli.cost import calibrate, cost
from kvsim.cli.fit import fit, validate
from kvsim.cli.flags import flags
from kvsim.cli.output import run_meta, simulate_with_progress, swap_in, write_run
from kvsim.cli.table import WIDE_HELP, print_run
from kvsim.cli.report import compare, reproduce
from kvsim.cli.sweep import capacity, sweep
from kvsim.config.errors import InputError
from kvsim.model.memory import kv_footprint
from kvsim.model.specs import DTYPE_BITS, GPU_PRESETS, MODEL_PRESETS, with_kv_heads


class WholeHelpGroup(click.Group):
    """Lists each command with the whole first paragraph of its help, not a cut-off line."""

    def format_commands(self, ctx, formatter):
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                first = (cmd.help or "").split("\n\n")[0]
                rows.append((name, " ".join(first.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=WholeHelpGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvsim")
def cli():
    """Simulate how KV-cache allocation policies use GPU memory in LLM serving."""


EMPTY_RUN = 3  # exit status of a run that completed nothing (as of an invariant violated)


# --- kvsim run -------------------------------------------------------------------
@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), help="Output folder [default: results/<scenario name>/]."
)
@click.option("--seed", type=click.IntRange(min=0), help="Override the scenario's seed.")
@click.option("--num-requests", type=click.IntRange(min=1), help="Override workload.num_requests.")
@click.option("--policy", "policies", multiple=True, metavar="NAME", help="Run only this policy (repeatable).")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary table.")
@click.option("--wide", is_flag=True, help=WIDE_HELP)
@click.option(
    "--check-invariants",
    is_flag=True,
    envvar="KVSIM_CHECK_INVARIANTS",
    help="Verify the allocator and scheduler after every step (slower).",
)
@click.option(
    "--exact-steps",
    is_flag=True,
    envvar="KVSIM_EXACT_STEPS",
    help="Visit every running request in every step (the plain path; the default fast "
    "path, which advances decoding requests in sums, gives the same results).",
)
@click.option(
    "--timeseries-bucket",
    "bucket_s",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Write the time series as sums per SECONDS of simulated time "
    "instead of one row per step (bounded memory for long runs; the summary is the same "
    "up to the last bits of its time-weighted means); over the scenario's timeseries_bucket_s, "
    "0 for every step.",
)
@click.option("--force", is_flag=True, help="Replace an --out folder that holds something else.")
@click.option(
    "--no-plots",
    is_flag=True,
    help="Write the tables and run.json but not the figures (drawing them takes most of a short run's time).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    envvar="KVSIM_JOBS",
    metavar="N",
    help="Run the policies in up to N processes (the same results) [default: one per CPU core].",
)
@click.option("--profile", metavar="NAME_OR_DIR", help="Step costs from this profile (overrides cost_model).")
@click.option(
    "--vllm-args",
    metavar="FLAGS",
    help="vLLM's serve flags, as on its command line, over the "
    "scenario's fields (e.g. \"--tensor-parallel-size 2 --max-num-seqs 128\").",
)
@click.option("--sglang-args", metavar="FLAGS", help="SGLang's launch flags, likewise (engine: sglang).")
@click.option(
    "--rates",
    metavar="R1,R2,..|START:STOP:STEP",
    help="Rerun at each arrival rate (req/s) into DIR/rate-R/, and draw latency and "
    "throughput against rate (rate_sweep.png, rates.csv).",
)
def run(
    scenario,
    out,
    seed,
    num_requests,
    policies,
    quiet,
    wide,
    check_invariants,
    exact_steps,
    bucket_s,
    force,
    no_plots,
    jobs,
    profile,
    vllm_args,
    sglang_args,
    rates,
):
    """Run every policy of SCENARIO on one request stream and write results and plots.

    With --rates, run it once per arrival rate and add the sweep's curves and the highest
    rate each policy sustains."""
    from kvsim.config.scenario import load_scenario

    started = time.monotonic()
    rate_list = None
    if rates is not None:
        from kvsim.analysis.rates import parse_rates

        rate_list = parse_rates(rates)
    given = {k: v for k, v in (("vllm_args", vllm_args), ("sglang_args", sglang_args)) if v is not None}
    scn, base_dir = load_scenario(scenario, given)
    scn = override(scn, str(scenario), seed, num_requests, policies)
    if profile is not None:
        from kvsim.cost.generalize import check_profile
        from kvsim.cost.profiles import shipped_names
        from kvsim.config.scenario import ProfileCost

        ref = profile if profile in shipped_names() else str(Path(profile).resolve())
        check_profile(ref, scn.model_spec(base_dir), Path("."), "command line", "--profile")
        keep = {k: getattr(scn.cost_model, k, None) for k in ("overhead", "step_overhead_ms")}
        scn = scn.model_copy(update={"cost_model": ProfileCost(profile=ref, **keep)})
    if getattr(scn.cost_model, "step_overhead_ms", None) is not None:
        click.echo(
            f"kvsim: note: {scenario}: cost_model.step_overhead_ms is deprecated; write "
            f"overhead: {{step_ms: {scn.cost_model.step_overhead_ms:g}}}",
            err=True,
        )
    out = out or Path("results") / scn.name
    if no_plots and rate_list is not None:
        raise InputError("command line", "--no-plots", "not with --rates (a rate sweep's folder is its figures)")
    if not force:
        _refuse_foreign(out, scn.name)
    from kvsim.sim.parallel import cores

    run_options = dict(exact_steps=exact_steps, bucket_s=bucket_s, workers=jobs or cores())
    if rate_list is not None:
        from kvsim.cli.report import run_rates

        run_rates(
            scn,
            base_dir,
            str(scenario),
            rate_list,
            out,
            quiet=quiet,
            wide=wide,
            check_invariants=check_invariants,
            started=started,
            **run_options,
        )
        return
    results = simulate_with_progress(scn, base_dir, str(scenario), quiet, check_invariants, **run_options)
    _refuse_empty(results, scn, str(scenario))
    meta = run_meta(scn, str(scenario), results, started)
    _write_results(results, scn, out, meta, run_options["workers"], plots=not no_plots)
    if not quiet:
        print_run(results.summary, scn, wide=wide)
        click.echo(f"wrote {out}/")


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
    except Exception:  # unreadable or absent: not a kvsim results folder
        held = None
    if held != name:
        what = f"results of scenario '{held}'" if held else "files that are not kvsim results"
        raise InputError("command line", "--out", f"{out} holds {what}; pass --force to replace it")


def _refuse_empty(results, scn, src: str) -> None:
    """A run in which no policy completed a request has nothing to report: say why, write
    nothing (such a run can leave millions of unfinished rows) and exit with status 3."""
    from kvsim.analysis.verdict import nothing_completed

    why = nothing_completed(results.summary, results.requests, scn.time_limit_s)
    if why is not None:
        click.echo(f"kvsim: warning: {src}: no request completed under any policy: {why}; nothing written", err=True)
        raise click.exceptions.Exit(EMPTY_RUN)


def _write_results(results, scn, out: Path, meta: dict, workers: int = 1, plots: bool = True) -> None:
    """The run's folder, written beside `out` and swapped in whole."""
    swap_in(out, lambda tmp: write_run(results, scn, tmp, meta, workers, plots=plots))


# --- kvsim memory ----------------------------------------------------------------
@cli.command()
@click.option(
    "--model",
    "model_name",
    required=True,
    help=f"A preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json path.",
)
@click.option(
    "--context", type=click.IntRange(min=1), help="Tokens per request (the footprint; required without --gpu)."
)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Requests.")
@click.option(
    "--kv-dtype",
    type=click.Choice(["auto", *DTYPE_BITS]),
    default=None,
    help="KV cache dtype [default: fp16 for the footprint, the model's own (auto) for --gpu].",
)
@click.option("--num-kv-heads", type=click.IntRange(min=1), help="Override the KV heads (e.g. MHA).")
@click.option(
    "--gpu", "gpu_name", help=f"Also size the KV pool on this GPU ({', '.join(GPU_PRESETS)}) as each --engine would."
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    type=click.Choice(["vllm-v1", "vllm-v0", "sglang", "trtllm"]),
    help="Engine whose pool to size (repeatable) [default with --gpu: vllm-v1 and sglang].",
)
@click.option("--tensor-parallel-size", "--tp", "tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), help="[default: the model's context length]")
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.9,
    show_default=True,
    help="vLLM's share of the GPU.",
)
@click.option(
    "--mem-fraction-static",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="SGLang's share for weights and KV [default: SGLang's, by GPU and tp].",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    help="Tokens per step (SGLang: chunked_prefill_size) [default: the engine's].",
)
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="[default: the engine's]")
@click.option("--block-size", type=click.IntRange(min=1), help="[default: vLLM 16, SGLang's page 1]")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def memory(
    model_name,
    context,
    batch,
    kv_dtype,
    num_kv_heads,
    gpu_name,
    engines,
    tp,
    max_model_len,
    gpu_memory_utilization,
    mem_fraction_static,
    max_num_batched_tokens,
    max_num_seqs,
    block_size,
    as_json,
):
    """KV-cache bytes per token, per request and in total (2 x layers x KV heads x head_dim x
    bytes); with --gpu, the KV pool each engine would leave on that GPU, stated as the engine
    logs it."""
    model = with_kv_heads(model_arg(model_name), num_kv_heads)
    if context is None and gpu_name is None:
        raise InputError("command line", "--context", "required (tokens per request), unless --gpu asks for the pool")
    out = {}
    if context is not None:
        out = kv_footprint(model, context, batch, kv_dtype if kv_dtype not in (None, "auto") else "fp16").as_dict()
    if gpu_name is not None:
        from kvsim.cli.args import gpu_arg
        from kvsim.cli.pools import describe, pool_reports

        out["pools"] = pool_reports(
            model,
            gpu_arg(gpu_name),
            engines or ("vllm-v1", "sglang"),
            tp=tp,
            max_model_len=max_model_len,
            kv_dtype=kv_dtype or "auto",
            gpu_memory_utilization=gpu_memory_utilization,
            mem_fraction_static=mem_fraction_static,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
        )
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    shape = (
        f"{model.num_layers} layers, latent {model.kv_lora_rank}+{model.qk_rope_head_dim}"
        if model.is_mla
        else f"{model.num_layers} layers, {model.num_kv_heads} KV heads x {model.head_dim}"
    )
    if context is not None:
        click.echo(f"{model.name} ({out['attention']}: {shape}), KV in {out['kv_dtype']}")
        click.echo(f"per token:    {_bytes(out['per_token_bytes'])}")
        click.echo(f"per request:  {_bytes(out['per_request_bytes'])}  at {context:,} tokens")
        click.echo(f"total:        {_bytes(out['total_bytes'])}  for batch {batch:,}")
    for report in out.get("pools", []):
        for line in describe(report):
            click.echo(line)


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.2f} GB, {n / 2**30:.2f} GiB)" if n >= 1e8 else f"{n:,} B ({n / 1024:.1f} KiB)"


cli.add_command(cost)
cli.add_command(flags)
cli.add_command(calibrate)
cli.add_command(fit)
cli.add_command(validate)
cli.add_command(sweep)
cli.add_command(capacity)
cli.add_command(compare)
cli.add_command(reproduce)
cli.add_command(cache_curve)


# --- entry point -----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input becomes one line on stderr and exit status 2. Warnings
    that libraries raise are for kvsim's developers, not its users: they are not shown
    (unless Python runs with -W or PYTHONWARNINGS)."""
    with warnings.catch_warnings():
        if not sys.warnoptions:
            warnings.simplefilter("ignore")
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        code = cli.main(args=argv, prog_name="kvsim", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # bare `kvsim`: the help, as click prints it
        e.show()
        return e.exit_code
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


def entry() -> None:
    """The `kvsim` command (and `python -m kvsim.cli`)."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
