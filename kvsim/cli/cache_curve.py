"""`kvsim cache-curve TRACE`: the hit rate a prefix cache of each capacity reaches on a
trace's prompts (kvsim.analysis.cache_curve), written as cache_curve.csv and
cache_curve.png. The work is in kvsim.analysis; this reads flags and writes the result."""

from __future__ import annotations

import math
import time
from pathlib import Path

import click

from kvsim.cli.table import echo_wrapped
from kvsim.cli.args import model_arg
from kvsim.cli.output import swap_in
from kvsim.cli.report import _refuse_foreign
from kvsim.config.errors import InputError
from kvsim.model.specs import DTYPE_BITS

GIB = 2**30
POLICY_NAMES = "lru,lfu,belady"  # kvsim.analysis.cache_curve.POLICIES (not imported here: numpy, pandas)


@click.command("cache-curve")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--capacities",
    metavar="C1,C2,...",
    help="Cache sizes in tokens (GiB of KV with --model); "
    "'inf' is an unlimited cache [default: 1e4, 3e4, 1e5, ... up to every distinct block of "
    "the trace, and inf].",
)
@click.option(
    "--model",
    "model_name",
    metavar="NAME",
    help="Give --capacities in GiB of this model's KV (a preset or a Hugging Face config.json).",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(list(DTYPE_BITS)),
    default="fp16",
    show_default=True,
    help="The KV dtype behind --model's GiB.",
)
@click.option(
    "--policies",
    default=POLICY_NAMES,
    show_default=True,
    metavar="P1,P2,...",
    help="Eviction policies, any of the default ones (belady: the optimum knowing the future).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per cached block (vLLM's default: 16).",
)
@click.option("--num-requests", type=click.IntRange(min=1), help="Only the trace's first N requests.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder [default: results/cache-curve-<trace name>/].",
)
@click.option("--force", is_flag=True, help="Replace an --out folder that holds something else.")
@click.option("--quiet", is_flag=True, help="No table on stdout.")
def cache_curve(trace, capacities, model_name, kv_dtype, policies, block_size, num_requests, out, force, quiet):
    """Hit rate of a prefix cache against its capacity on a trace, from the prompts alone.

    For each capacity and eviction policy (lru, lfu, belady: the optimum that knows the
    future) the share of prompt tokens found cached, with no engine and no timing: how
    big a cache (GPU, host memory, disk) must be for the trace's reuse. Writes
    cache_curve.csv (policy, capacity_tokens, hit_rate, hit_tokens, prompt_tokens) and
    cache_curve.png."""
    from kvsim.analysis.block_refs import block_references
    from kvsim.analysis.cache_curve import cache_curve as curve, distinct_tokens
    from kvsim.workload.traces import trace_requests

    chosen = _policies(policies)
    per_token = None
    if model_name is not None:
        from kvsim.model.memory import kv_footprint

        per_token = kv_footprint(model_arg(model_name), 1, 1, kv_dtype).per_token_bytes
    given = _capacities(capacities, "GiB" if per_token else "tokens") if capacities else None
    out = out or Path("results") / f"cache-curve-{trace.stem}"
    _refuse_foreign(out, "cache_curve.csv", force)

    requests = trace_requests(trace, num_requests)
    started = time.perf_counter()
    refs = block_references(requests, block_size)
    if given is None:
        tokens = default_capacities(distinct_tokens(refs))
    else:
        tokens = [c if math.isinf(c) else c * GIB / per_token if per_token else c for c in given]
    table = curve(refs, tokens, chosen)
    seconds = time.perf_counter() - started
    if per_token:
        table.insert(2, "capacity_gib", table.capacity_tokens * per_token / GIB)

    def write(folder: Path) -> None:
        from kvsim.plots.cache_curve import cache_curve_figure
        from kvsim.plots.run_figures import save

        table.to_csv(folder / "cache_curve.csv", index=False)
        context = (
            f"{trace.name}: {refs.num_requests:,} requests, {refs.prompt_tokens:,} prompt tokens; "
            f"blocks of {block_size} tokens" + (f"; KV of {model_name} in {kv_dtype}" if per_token else "")
        )
        save(cache_curve_figure(table, context, GIB / per_token if per_token else None), folder / "cache_curve.png")

    swap_in(out, write)
    if not quiet:
        shown = table.pivot(index="capacity_tokens", columns="policy", values="hit_rate")[list(chosen)]
        shown = shown.map(lambda v: f"{v:.1%}")
        shown.index = [
            (
                "unlimited"
                if math.isinf(c)
                else f"{c:,.0f}" + (f" ({c * per_token / GIB:,.4g} GiB)" if per_token else "")
            )
            for c in shown.index
        ]
        shown.index.name, shown.columns.name = "capacity (tokens)", None
        click.echo(shown.to_string())
        rate = refs.blocks * len(chosen) / seconds if seconds > 0 else math.inf
        echo_wrapped(
            f"{refs.blocks:,} block references ({len(refs.item):,} items: blocks always used together) "
            f"x {len(chosen)} policies, {len(tokens)} capacities each, in {seconds:.2f} s: "
            f"{rate / 1e6:.1f}M block references per second"
        )
        if not table.hit_tokens.any():
            echo_wrapped(
                "note: no block of any prompt repeats: only a trace with hash ids (Mooncake's JSON "
                "lines) says which prompts share content"
            )
        click.echo(f"wrote {out}/cache_curve.csv, cache_curve.png")


def default_capacities(distinct: int) -> list[float]:
    """1e4, 3e4, 1e5, ... up to the first at or above `distinct` tokens, then unlimited."""
    grid, size = [], 1e4
    while True:
        for step in (1, 3):
            grid.append(size * step)
            if size * step >= distinct:
                return grid + [math.inf]
        size *= 10


def _capacities(text: str, unit: str) -> list[float]:
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not value > 0:  # NaN fails too
            raise InputError(
                "command line", "--capacities", f"{part.strip()!r}: a capacity in {unit} > 0, or inf; e.g. 1e5,1e6,inf"
            )
        values.append(value)
    return sorted(set(values))


def _policies(text: str) -> tuple[str, ...]:
    from kvsim.analysis.cache_curve import POLICIES

    names = tuple(dict.fromkeys(p.strip() for p in text.split(",")))
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise InputError(
            "command line",
            "--policies",
            f"unknown policy {unknown[0] if unknown else text!r}; choose from: {', '.join(POLICIES)}",
        )
    return names
