"""`kvsim cost` and `kvsim calibrate`: step costs on the command line.

`kvsim cost` prices one step (a prefill chunk, or a batch of decodes) with the same
cost model a run uses and prints its parts (GPU kernels, tensor-parallel communication,
the engine's host overhead), so a profile can be checked against one's own measurements.
`--engine` chooses whose step it is: the engine's default overhead (what `calibrated`
gives a run of that engine on that GPU) and, for a CUDA-graph engine, its capture sizes,
which follow max_num_seqs and max_num_batched_tokens (the engine's defaults unless given).
`kvsim calibrate` measures a profile with PyTorch, or with `--report PROFILE` prints a
profile's held-out error.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvsim.cli.args import gpu_arg, model_arg
from kvsim.config.errors import InputError
from kvsim.model.specs import DTYPE_BITS, GPU_PRESETS, MODEL_PRESETS, KVSpec, resolve_kv_dtype


@click.command()
@click.option(
    "--model",
    "model_name",
    required=True,
    help=f"A preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json path.",
)
@click.option("--gpu", "gpu_name", required=True, help=f"A preset: {', '.join(GPU_PRESETS)}.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel GPUs.")
@click.option("--prefill-tokens", type=click.IntRange(min=1), help="One prefill chunk of T tokens.")
@click.option("--decode-batch", type=click.IntRange(min=1), help="B sequences decoding one token each.")
@click.option(
    "--context",
    type=click.IntRange(min=0),
    help="Decode: tokens each sequence attends to (required). Prefill: tokens already cached (default 0).",
)
@click.option("--kv-dtype", type=click.Choice(list(DTYPE_BITS)), help="KV-cache dtype [default: the model's].")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="KV block size.")
@click.option("--profile", metavar="NAME_OR_DIR", help="Use this profile instead of the automatic choice.")
@click.option("--roofline", is_flag=True, help="Use the roofline model instead of a profile.")
@click.option(
    "--overhead",
    metavar="NAME|none|FILE",
    help="Engine overhead: a shipped one, none (kernels only) or a file [default: the shipped one].",
)
@click.option(
    "--engine",
    type=click.Choice(["vllm-v0", "vllm-v1", "sglang"]),
    default="vllm-v1",
    show_default=True,
    help="The engine whose step this is (its default overhead and graph sizes).",
)
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="The engine's max_num_seqs [default: its own].")
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    help="The engine's max_num_batched_tokens [default: its own].",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def cost(
    model_name,
    gpu_name,
    tp,
    prefill_tokens,
    decode_batch,
    context,
    kv_dtype,
    block_size,
    profile,
    roofline,
    overhead,
    engine,
    max_num_seqs,
    max_num_batched_tokens,
    as_json,
):
    """Predicted time of one engine step and its parts."""
    from kvsim.cost.model import Roofline, StepBatch, describe, make_cost_model
    from kvsim.config.scenario import ProfileCost, SchedulerSettings
    from kvsim.config.engine_defaults import resolve

    if (prefill_tokens is None) == (decode_batch is None):
        raise InputError(
            "command line", "--prefill-tokens", "give either --prefill-tokens T or --decode-batch B with --context C"
        )
    if decode_batch is not None and not context:
        raise InputError(
            "command line", "--context", "--decode-batch needs --context C >= 1 (the tokens each sequence attends to)"
        )
    if profile and roofline:
        raise InputError("command line", "--profile", "give --profile or --roofline, not both")
    if overhead and roofline:
        raise InputError("command line", "--overhead", "the roofline is a bound and takes no overhead")
    model, gpu = model_arg(model_name), gpu_arg(gpu_name)
    if profile:
        from kvsim.cost.generalize import check_profile

        check_profile(profile, model, Path("."), "command line", "--profile")
    kv = KVSpec(model, resolve_kv_dtype(kv_dtype or "auto", model))
    if overhead:
        from kvsim.cost.overhead import load_overhead

        load_overhead(overhead)  # a bad name or file fails here, naming --overhead
    choice = "roofline" if roofline else ProfileCost(profile=profile, overhead=overhead)
    settings = resolve(
        engine,
        SchedulerSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        max_model_len=model.max_position_embeddings or 4096,
        gpu_name=gpu.name,
        gpu_memory_gib=gpu.memory_gib,
    )
    model_cost = make_cost_model(
        choice,
        model,
        gpu,
        kv,
        tp,
        block_size=block_size,
        base_dir=Path("."),
        src="command line",
        engine=engine,
        limits=(settings.max_num_seqs, settings.max_num_batched_tokens),
    )
    batch = (
        StepBatch.build([(prefill_tokens, context or 0)], [])
        if prefill_tokens
        else StepBatch.build([], [context] * decode_batch)
    )
    parts, why = model_cost.parts(batch)
    label = describe(model_cost.label, 1 if why else 0, 1, why)
    total = sum(parts.values())
    bound = Roofline(model, gpu, kv, tp).step_time(batch)
    step = (
        f"prefill {prefill_tokens:,} tokens on {context or 0:,} cached"
        if prefill_tokens
        else f"decode batch {decode_batch:,} x {context:,} context"
    )
    groups = None if "roofline" in parts else grouped(parts)
    out = {
        "model": model.name,
        "gpu": gpu.name,
        "tp": tp,
        "engine": engine,
        "step": step,
        "kv_dtype": kv.kv_cache_dtype,
        "block_size": block_size,
        "cost_model": label,
        "step_time_s": total,
        "parts_s": parts,
        "groups_s": groups,
        "roofline_s": bound,
        "extrapolated": sorted(set(why)),
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"{model.name} on {gpu.name} x{tp} under {engine}: {step}, KV {kv.kv_cache_dtype}, block {block_size}")
    click.echo(f"cost model: {label}")
    click.echo(f"step time:  {total * 1e3:.3f} ms   (roofline bound {bound * 1e3:.3f} ms)")
    for name, seconds in parts.items():
        click.echo(f"  {name:<22} {seconds * 1e3:10.3f} ms  {seconds / total:6.1%}")
    if groups:
        click.echo(
            "of which "
            + ", ".join(
                f"{name.replace('_', ' ')} {seconds * 1e3:.3f} ms ({seconds / total:.1%})"
                for name, seconds in groups.items()
            )
        )


def grouped(parts: dict[str, float]) -> dict[str, float]:
    """A profiled step's parts as GPU kernels, tensor-parallel communication and engine overhead."""
    groups = {"kernels": 0.0, "tp_communication": parts["allreduce"], "engine_overhead": 0.0}
    for name, seconds in parts.items():
        if name != "allreduce":
            groups["engine_overhead" if name.startswith("overhead") else "kernels"] += seconds
    return groups


@click.command()
@click.option("--model", "model_name", help="A preset or a Hugging Face config.json path.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--quick", is_flag=True, help="Tiny grids (a smoke test; on CPU, widths / 8).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Folder for the profile.")
@click.option("--gpu", "gpu_name", help="The kvsim GPU preset this device is [default: detected].")
@click.option("--report", metavar="PROFILE", help="Print PROFILE's held-out error instead of measuring.")
@click.option("--json", "as_json", is_flag=True, help="With --report: print JSON.")
def calibrate(model_name, device, quick, out, gpu_name, report, as_json):
    """Measure kernel times with PyTorch and write a profile (or report a profile's error)."""
    from kvsim.cost.profiles import load_profile, save_profile

    if report:
        from kvsim.cost.accuracy import report as held_out

        result = held_out(load_profile(report))
        if as_json:
            click.echo(json.dumps(result, indent=2))
            return
        click.echo(f"{result['profile']}: held-out MAPE ({result['method']}); linear: {result['linear_origin']}")
        for op, err in result["mape"].items():
            click.echo(f"  {op:<28} {err:7.1%}")
        overall = result["overall_mape"]
        click.echo(
            f"  {'overall':<28} {overall:7.1%}"
            if overall is not None
            else "  no measured points in this profile to hold out"
        )
        if "end_to_end" in result:
            e2e = result["end_to_end"]
            click.echo(f"whole forward steps, predicted vs measured: MAPE {e2e['mape']:.1%}")
            for r in e2e["steps"]:
                click.echo(
                    f"  {r['step']:<28} {r['measured_ms']:10.3f} ms measured "
                    f"{r['predicted_ms']:10.3f} ms predicted {r['error']:+7.1%}"
                    + (f" {r['launched_ms']:10.3f} ms as launched" if "launched_ms" in r else "")
                )
        if "against_prediction" in result:
            vs = result["against_prediction"]
            click.echo(
                f"kvsim's prediction without this profile ({vs['prediction']}), predicted / measured - 1: median, MAPE"
            )
            for name, e in [*vs["ops"].items(), *((f"a step's linear ops, {k}", e) for k, e in vs["step"].items())]:
                click.echo(f"  {name:<38} {e['median']:+7.1%} {e['mape']:7.1%}")
        return
    if not model_name or not out:
        raise InputError(
            "command line",
            "--model" if not model_name else "--out",
            "calibrate needs --model and --out (or --report PROFILE)",
        )
    if gpu_name is not None:
        gpu_arg(gpu_name)
    from kvsim.calibrate.measure import calibrate as measure

    profile = measure(model_arg(model_name), device, quick, gpu_name, log=lambda m: click.echo(m, err=True))
    save_profile(profile, out)
    click.echo(
        f"wrote {out}/ (profile '{profile.name}', {len(profile.linear)} linear rows, "
        f"{len(profile.attention_rows)} attention points)"
    )
