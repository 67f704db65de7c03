"""`kvsim flags`: every engine flag kvsim understands, what it sets, and what it ignores."""

from __future__ import annotations

import json

import click

from kvsim.cli.table import echo_wrapped


@click.command()
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="vLLM 0.33.0's serve flags (vllm_args) or SGLang 0.5.23's launch flags (sglang_args).",
)
@click.option("--all", "show_all", is_flag=True, help="List the ignored flags too.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def flags(engine, show_all, as_json):
    """The engine flags a scenario's vllm_args or sglang_args (or kvsim run --vllm-args)
    understand: what each sets, which kvsim does not model, and which it ignores."""
    from kvsim.config.engine_flags import table

    rows = [r for r in table(engine) if show_all or as_json or r["kind"] != "ignored"]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    width = max(len(r["flag"]) for r in rows)
    for kind in ("sets", "not modelled", "ignored"):
        chosen = [r for r in rows if r["kind"] == kind]
        if not chosen:
            continue
        click.echo(
            {
                "sets": "Sets:",
                "not modelled": "Not modelled (an input error unless at the default):",
                "ignored": "Accepted and ignored:",
            }[kind]
        )
        for r in chosen:
            what = f"{r['field']}: {r['note']}" if r["field"] else r["note"]
            echo_wrapped(f"  {r['flag']:<{width}}  {what}", indent=" " * (width + 4))
    if not show_all:
        click.echo("Every other flag of the release is accepted and ignored (--all lists them).")
