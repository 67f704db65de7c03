"""benchmarks/RESULTS.md from bench_speed.py's medians: the runs, the ratios of each
pair, and where each speed target stands."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import others

ROOT = Path(__file__).resolve().parents[1]
GIB_MB = 1024

# kvsim's contenders beside plain `kvsim run` (bench_speed.py runs them; the targets name them)
NO_FIGURES = "kvsim, no figures"  # `kvsim run --no-plots`: beside simulators that draw none
COMPILED = "kvsim, compiled"  # the compiled build (setup.py, KVSIM_COMPILE=1)
COMPILED_NO_FIGURES = "kvsim, compiled, no figures"
EVERY_STEP = "kvsim, every step"  # the step series of a million requests row by row


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def _num(x, fmt="{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _runs_table(table: dict) -> list[str]:
    lines = [
        "| workload | simulator | requests | steps | simulated s | mean batch | runs | wall s (median) "
        "| CPU s (median) | peak RSS MB (max) | wall s of each run |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for (name, who), m in table.items():
        walls = ", ".join(f"{w:.2f}" for w in m["walls"])
        lines.append(
            f"| {name} | {who} | {m['requests']:,} | {_num(m['steps'])} | {m['makespan_s']:,.1f} "
            f"| {_num(m['mean_batch'], '{:.1f}')} | {m['runs']} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} "
            f"| {m['peak_rss_mb']:,.0f} | {walls} |"
        )
    return lines


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def _both(wall_ok: bool, cpu_ok: bool) -> str:
    """A target judged on wall and CPU time together: on a shared machine a busy minute
    stretches one process's wall time and not another's, so it is met only when both are."""
    if wall_ok == cpu_ok:
        return _verdict(wall_ok)
    return f"NOT met on {'CPU' if wall_ok else 'wall'} time (met on {'wall' if wall_ok else 'CPU'} time)"


def _targets(table: dict) -> list[str]:
    """One line per target: the figures it is judged on, and whether it is met."""
    get = table.get
    lines = []
    # kvsim as it runs by default draws five figures; Vidur 0.0.26 draws its own PNGs by
    # default (vidur/config/config.py: MetricsConfig.store_plots = True; the figures are
    # vidur/metrics/data_series.py's fig.write_image), BLIS none: each comparison is made
    # with and without kvsim's figures
    kinds = (
        ("kvsim", "kvsim (its figures drawn)"),
        (NO_FIGURES, "kvsim --no-plots (no figures)"),
        (COMPILED, "kvsim's compiled build (its figures drawn)"),
        (COMPILED_NO_FIGURES, "kvsim's compiled build --no-plots (no figures)"),
    )
    for who, label in kinds:
        k = get(("vidur_10k", who))
        if not k:
            continue
        ratio, cpu = others.VIDUR_10K_S / k["wall_s"], others.VIDUR_10K_S / k["cpu_s"]
        lines.append(
            f"- Vidur's 10k workload at least 10x faster than Vidur, {label}: Vidur {others.VIDUR_10K_S} s "
            f"(recorded in another hour) / kvsim {k['wall_s']:.2f} s = {ratio:.1f}x wall; against kvsim's CPU "
            f"time ({k['cpu_s']:.2f} s; Vidur simulates in one Python process, whose wall time on an idle "
            f"core is about its CPU time) {cpu:.1f}x: {_both(ratio >= 10, cpu >= 10)}."
        )
    for name in ("vidur_10k", "vidur_100k"):
        for who, label in kinds:
            k, b, off = get((name, who)), get((name, "BLIS")), get((name, "BLIS, snapshot off"))
            if not k:
                continue
            if not off:
                why = "BLIS not built: benchmarks/build_blis.sh"
                lines.append(f"- Faster than BLIS with its snapshot off on {name}, {label}: {_verdict(None)} ({why}).")
                continue
            wall, cpu = off["wall_s"] / k["wall_s"], off["cpu_s"] / k["cpu_s"]
            shipped = f"; BLIS as shipped {b['wall_s'] / k['wall_s']:.2f}x" if b else ""
            lines.append(
                f"- Faster than BLIS with its snapshot off on {name}, {label}: BLIS {off['wall_s']:.2f} s / "
                f"kvsim {k['wall_s']:.2f} s = {wall:.2f}x wall ({cpu:.2f}x CPU: {off['cpu_s']:.2f} / "
                f"{k['cpu_s']:.2f} s){shipped}: "
                f"{_both(wall > 1, cpu > 1)}. Peak RSS kvsim {k['peak_rss_mb']:,.0f} MB against BLIS's "
                f"{off['peak_rss_mb']:,.0f} MB: {_verdict(k['peak_rss_mb'] < off['peak_rss_mb'])}."
            )
    every_step = (EVERY_STEP, "kvsim recording every step (--timeseries-bucket 0; its figures drawn)")
    for who, label in (*kinds[::2], every_step):  # (figures drawn)
        m = get(("sharegpt_1m", who))
        if m:
            lines.append(
                f"- A million ShareGPT requests in under 60 s and 1 GiB, {label}: {m['wall_s']:.1f} s "
                f"({m['cpu_s']:.1f} s of CPU), {m['peak_rss_mb']:,.0f} MB: "
                f"{_verdict(m['wall_s'] < 60 and m['peak_rss_mb'] < GIB_MB)}."
            )
    if not get(("sharegpt_1m", "kvsim")):
        lines.append(f"- A million ShareGPT requests in under 60 s and 1 GiB: {_verdict(None)} (run with --million).")
    sizes = [s for s in (get((f"sharegpt_{n}", "kvsim")) for n in ("10k", "100k", "1m")) if s]
    if len(sizes) >= 2:
        n = [s["requests"] for s in sizes]
        per = ", ".join(f"{s['cpu_s'] / r * 1e6:,.0f} µs" for s, r in zip(sizes, n))
        text = (
            f"- Growth linear from 10k to 1M requests: CPU time per request {per} at {', '.join(f'{r:,}' for r in n)}"
        )
        if len(sizes) == 3:
            # the cost of each further request, so that the fixed start-up and figures do not
            # count; CPU time, as a busy minute of the shared machine stretches wall time alone
            def marginal(key, a, b):
                return (sizes[b][key] - sizes[a][key]) / (n[b] - n[a])

            low, high = marginal("cpu_s", 0, 1), marginal("cpu_s", 1, 2)
            text += (
                f"; each request beyond 10k costs {low * 1e6:,.0f} µs of CPU up to 100k and "
                f"{high * 1e6:,.0f} µs beyond (wall: {marginal('wall_s', 0, 1) * 1e6:,.0f} and "
                f"{marginal('wall_s', 1, 2) * 1e6:,.0f} µs; judged linear when the second is at most "
                f"1.25x the first): {_verdict(high <= 1.25 * low)}."
            )
        else:
            text += f": {_verdict(None)} (run with --million)."
        lines.append(text)
    for size in ("10k", "100k", "1m"):
        on, off = get((f"sharegpt_{size}_prefix", "kvsim")), get((f"sharegpt_{size}", "kvsim"))
        if on and off:
            ratio, cpu = on["wall_s"] / off["wall_s"], on["cpu_s"] / off["cpu_s"]
            lines.append(
                f"- Prefix caching on at most 1.5x the time without it, {size}: {on['wall_s']:.2f} / "
                f"{off['wall_s']:.2f} s = {ratio:.2f}x ({cpu:.2f}x in CPU time): "
                f"{_both(ratio <= 1.5, cpu <= 1.5)}."
            )
    return lines


def _recorded() -> list[str]:
    lines = ["| simulator | workload | wall s | peak RSS MB | note |", "| --- | --- | ---: | ---: | --- |"]
    for r in others.RECORDED:
        lines.append(
            f"| {r['tool']} | {r['workload']} | {r['wall_s']:.1f} | {r['peak_rss_mb']:,} | {r.get('note', '')} |"
        )
    return lines


def render(table: dict, command: str, started: str, loads: tuple, extra: list[str], workloads: dict) -> str:
    """workloads: each one's scenario file and kvsim's arguments (Workload.described)."""
    (before, after) = loads
    out = [
        "# Speed benchmarks",
        "",
        "Written by `benchmarks/bench_speed.py --write`; do not edit by hand. How each figure is taken is in",
        "that script's docstring and in `benchmarks/others.py` (how BLIS runs; why Vidur's figure is a recorded one).",
        "",
        f"- Command: `{command}`" + (f" (kvsim with {' '.join(extra)})" if extra else ""),
        f"- Started {started}, kvsim at commit {_commit()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores; load average {before[0]:.1f} / {before[1]:.1f} / {before[2]:.1f} before, "
        f"{after[0]:.1f} / {after[1]:.1f} / {after[2]:.1f} after (shared machine: compare only figures of one file).",
        "- Peak RSS is that of the run's largest process (kvsim draws its figures in forked worker processes).",
        "- kvsim runs from compiled bytecode, as an installed package does (compiled once before the runs).",
        "- Each workload's scenario (benchmarks/scenarios/; timeseries_bucket_s: the step series recorded in sums "
        "per that many simulated seconds) and kvsim's arguments: "
        + "; ".join(f"{name}: `{what}`" for name, what in workloads.items())
        + ".",
        *(
            [
                "- kvsim's compiled build: this commit's package built with KVSIM_COMPILE=1 (setup.py), its step "
                "loop compiled by Cython from the same source; its outputs are the same bytes (tests/test_compiled.py)."
            ]
            if any(who.startswith(COMPILED) for _, who in table)
            else []
        ),
        "",
        "## Runs (medians of alternated runs)",
        "",
        *_runs_table(table),
        "",
        "## Targets",
        "",
        *_targets(table),
        "",
        "## Recorded figures (not run here)",
        "",
        *_recorded(),
        "",
    ]
    return "\n".join(out)
