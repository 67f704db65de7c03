"""What the figures promise: a policy's colour follows from its settings (the same in
every run, whatever its name or place), latency targets drawn on the latency figures,
percentiles told apart without colour, a note where a setting has no modelled effect
on step time, and sweep and capacity figures with context lines, words for axes, no
empty panels and intervals cut at physical bounds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from helpers import kvsim
from kvsim.plots.colours import FAMILIES, policy_colours, settings_frame, variant
from kvsim.config.scenario import load_scenario


def row(name, allocator="paged", **kw):
    return {
        "policy": name,
        "allocator": allocator,
        "kv_cache_dtype": kw.pop("dtype", "bf16"),
        "block_size": kw.pop("block", 16 if allocator == "paged" else 0),
        "prefix_cache": kw.pop("cache", "none"),
        **kw,
    }


def colours(*rows) -> dict[str, str]:
    return policy_colours(pd.DataFrame(list(rows)))


# --- the colour rule ----------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, family, shade",
    [
        (row("a", "contiguous", reserve="max", placement="first-fit"), "contiguous", 0),
        (row("a", "contiguous", reserve="pow2", placement="buddy"), "contiguous", 1),
        (row("a", "contiguous", reserve="oracle", placement="first-fit"), "contiguous", 2),
        (row("a", "contiguous", reserve="max", placement="first-fit", dtype="fp8"), "contiguous-quantized", 0),
        (row("a", block=16), "paged", 0),
        (row("a", block=32), "paged", 1),
        (row("a", block=8), "paged", 2),
        (row("a", dtype="fp8"), "paged-quantized", 0),
        (row("a", dtype="int4", block=32), "paged-quantized", 1),
        (row("a", cache="hash"), "prefix", 0),
        (row("a", cache="hash", dtype="fp8_e4m3"), "prefix-quantized", 0),
        (row("a", cache="radix", block=1), "radix", 0),
        (row("a", cache="radix", block=16), "radix", 1),
    ],
)
def test_the_family_sets_the_hue_and_the_variant_the_shade(settings, family, shade):
    assert variant(settings)[:2] == (family, shade)
    assert colours(settings)["a"] == FAMILIES[family][shade]


def test_a_colour_depends_on_settings_not_on_name_order_or_company():
    alone = colours(row("paged-16"))
    crowd = colours(
        row("contiguous", "contiguous"),
        row("paged-32", block=32),
        row("zzz-renamed"),
        row("p-fp8", dtype="fp8"),
        row("prefix", cache="hash"),
    )
    reordered = colours(
        row("prefix", cache="hash"),
        row("p-fp8", dtype="fp8"),
        row("zzz-renamed"),
        row("paged-32", block=32),
        row("contiguous", "contiguous"),
    )
    assert alone["paged-16"] == crowd["zzz-renamed"] == FAMILIES["paged"][0]
    assert crowd == {k: reordered[k] for k in crowd}
    assert len(set(crowd.values())) == len(crowd)


def test_equal_settings_share_a_colour_and_unlisted_variants_take_a_free_shade():
    got = colours(row("a"), row("b"), row("c", block=48), row("d", block=96))
    assert got["a"] == got["b"] == FAMILIES["paged"][0]
    assert len({got["a"], got["c"], got["d"]}) == 3
    assert {got["c"], got["d"]} <= set(FAMILIES["paged"])


def test_unknown_settings_fall_back_to_the_name():
    got = policy_colours(pd.DataFrame({"policy": ["x", "y"]}))
    assert len(set(got.values())) == 2 and not set(got.values()) & {c for f in FAMILIES.values() for c in f}


def test_a_run_keeps_its_colours_when_run_again_with_policies_in_another_order(tmp_path):
    """Through the command: rag_8k's policies, all of them and then three in reverse
    order, give each policy the same colour in the breakdown figure's tick labels."""
    from kvsim.plots.colours import with_settings

    scn, base = load_scenario("scenarios/rag_8k.yaml")
    full = policy_colours(with_settings(settings_frame(scn), scn.model_dump(mode="json")))
    some = scn.model_copy(update={"policies": list(reversed(scn.policies[2:5]))})
    part = policy_colours(settings_frame(some))
    assert all(part[name] == full[name] for name in part)
    assert len(set(full.values())) == len(full)  # seven settings, seven colours


# --- latency figures ------------------------------------------------------------------
def run_figures(tmp_path, **changes):
    from kvsim.plots.run_figures import figures

    scn_doc = {
        "name": "figs",
        "seed": 1,
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 4096,
        "kv_cache_memory_gib": 1,
        "cost_model": "calibrated",
        "workload": {
            "num_requests": 40,
            "arrival": {"process": "poisson", "rate_per_s": 20.0},
            "prompt_tokens": {"dist": "lognormal", "mean": 600, "cv": 0.5, "min": 16, "max": 3000},
            "output_tokens": {"dist": "lognormal", "mean": 60, "cv": 0.5, "min": 4, "max": 300},
        },
        "slo": {"ttft_p99_s": 1.5, "tpot_p50_s": 0.05},
        "policies": [
            {"name": "paged-16", "allocator": "paged", "block_size": 16},
            {"name": "paged-32", "allocator": "paged", "block_size": 32},
        ],
        **changes,
    }
    (tmp_path / "figs.yaml").write_text(yaml.safe_dump(scn_doc))
    code, _, err = kvsim("run", tmp_path / "figs.yaml", "--out", tmp_path / "out", "--quiet")
    assert code == 0, err
    out = tmp_path / "out"
    summary, series, requests = (
        pd.read_csv(out / "summary.csv"),
        pd.read_parquet(out / "timeseries.parquet"),
        pd.read_parquet(out / "requests.parquet"),
    )
    meta = yaml.safe_load((out / "run.json").read_text())
    return figures(summary, series, requests, context="ctx", targets=scn_doc["slo"], notes=meta["timing_notes"]), meta


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def test_latency_figures_draw_the_targets_and_mark_percentiles_without_colour(tmp_path):
    figs, _ = run_figures(tmp_path)
    cdf = figs["latency.png"]
    words = texts(cdf)
    assert "target p99 ≤ 1.5 s " in words and "target p50 ≤ 0.05 s " in words
    assert {" p50", " p90", " p99"} <= set(words)
    bars = figs["latency_percentiles.png"]
    hatches = {p.get_hatch() for ax in bars.axes for p in ax.patches}
    assert {None, "//", "xx"} <= hatches or {"", "//", "xx"} <= hatches
    legend = [t.get_text() for ax in bars.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert {"p50", "p90", "p99", "target p99 ≤ 1.5 s", "target p50 ≤ 0.05 s"} <= set(legend)


def test_a_setting_without_modelled_effect_on_time_is_noted_on_the_figures_of_time(tmp_path):
    figs, meta = run_figures(tmp_path)
    note = "block size (16, 32): no modelled effect on step time; these policies differ through memory alone"
    assert meta["timing_notes"] == [note]
    suptitle = {name: fig._suptitle.get_text().replace("\n", " ") for name, fig in figs.items()}
    for name in ("latency.png", "throughput_batch.png", "latency_percentiles.png"):
        assert "Note: block size (16, 32): no modelled effect" in suptitle[name], name
    assert "Note:" not in suptitle["memory_breakdown.png"]


def test_a_setting_the_model_prices_gets_no_note():
    """The roofline reads fewer bytes of an FP8 cache: its KV dtype is priced; a block
    size is not, by any shipped model."""
    from kvsim.analysis.unmodelled import unmodelled_settings

    scn, base = load_scenario("scenarios/rag_8k.yaml")
    roofline = scn.model_copy(update={"cost_model": "roofline"})
    assert "kv_cache_dtype" not in unmodelled_settings(roofline, base)
    assert unmodelled_settings(roofline, base)["block_size"] == [16, 32]


def test_a_quantized_cache_says_its_dequantization_is_not_modelled(monkeypatch):
    """The shipped profiles timed attention on 16-bit KV only: an FP8 policy reads fewer
    bytes and the note says its dequantization is not priced; a model that timed FP8
    gets no such note."""
    import kvsim.analysis.unmodelled as unmodelled

    scn, base = load_scenario("scenarios/rag_8k.yaml")
    note = (
        "KV dtype fp8: attention reads its fewer bytes; dequantizing it is not modelled "
        "(no step time measured with that dtype)"
    )
    assert unmodelled.notes(scn, base)[-1] == note
    assert note in unmodelled.notes(scn.model_copy(update={"cost_model": "roofline"}), base)
    bf16 = scn.model_copy(update={"policies": [p for p in scn.policies if p.kv_cache_dtype == "auto"]})
    assert unmodelled.unpriced_dequantization(bf16, base) == []

    class TimedFP8:
        measured_kv_dtypes = ("fp8",)

    monkeypatch.setattr(unmodelled, "make_cost_model", lambda *a, **k: TimedFP8())
    assert unmodelled.unpriced_dequantization(scn, base) == []


# --- sweep and capacity figures -------------------------------------------------------
def test_intervals_stop_at_physical_bounds():
    from kvsim.plots.sweep_figures import clipped_errors

    below, above = clipped_errors(np.array([0.5, 3.0, 0.98]), np.array([2.0, 1.0, 0.1]), None)
    assert below.tolist() == [0.5, 1.0, 0.1] and above.tolist() == [2.0, 1.0, 0.1]
    below, above = clipped_errors(np.array([0.98]), np.array([0.1]), 1.0)
    assert above.tolist() == pytest.approx([0.02]) and below.tolist() == [0.1]


def test_sweep_figures_have_words_context_and_no_empty_metric_rows():
    from kvsim.plots.sweep_figures import _against, METRICS

    summary = pd.DataFrame(
        {
            "workload.arrival.rate_per_s": [1, 2, 1, 2],
            "policy": ["a", "a", "b", "b"],
            "allocator": "paged",
            "block_size": 16,
            "kv_cache_dtype": "bf16",
            "throughput_tok_s": [10.0, 20.0, 11.0, 19.0],
            "throughput_tok_s_ci95": [15.0] * 4,
            "kv_utilization": [np.nan] * 4,
            "ttft_p99_s": [0.1, 0.2, 0.1, 0.3],
        }
    )
    metrics = [m for m in METRICS if m[0] in summary and summary[m[0]].notna().any()]
    fig = _against(summary, "workload.arrival.rate_per_s", [], metrics, policy_colours(summary))
    assert len(fig.axes) == 2  # throughput and TTFT: KV utilization has no value
    assert fig.axes[-1].get_xlabel() == "arrival rate (req/s)"
    assert fig.axes[0].get_ylim()[0] == 0
    for line in fig.axes[0].collections:  # error bars: none below zero
        for segment in line.get_segments():
            assert min(y for _, y in segment) >= 0


def _sweep_titles(monkeypatch) -> dict[str, str]:
    """The title of each figure kvsim.plots.sweep_figures saves, by file name (none is written)."""
    seen = {}

    def keep(fig, path):
        seen[path.name] = fig._suptitle.get_text().replace("\n", " ") if fig._suptitle else ""
        return path

    monkeypatch.setattr("kvsim.plots.sweep_figures.save", keep)
    return seen


def _small_scenario(num_requests: int) -> dict:
    """A scenario of one paged policy, fixed lengths and a TTFT target."""
    return {
        "name": "c",
        "model": "llama-3-8b",
        "gpu": "h100-80gb",
        "max_model_len": 2048,
        "kv_cache_memory_gib": 1,
        "slo": {"ttft_p99_s": 1.0},
        "workload": {
            "num_requests": num_requests,
            "arrival": {"process": "poisson", "rate_per_s": 5.0},
            "prompt_tokens": {"dist": "fixed", "value": 200},
            "output_tokens": {"dist": "fixed", "value": 20},
        },
        "policies": [{"name": "paged", "allocator": "paged"}],
    }


def test_kvsim_sweep_and_capacity_figures_carry_their_context(tmp_path, monkeypatch):
    seen = _sweep_titles(monkeypatch)
    doc = _small_scenario(20)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "g.yaml").write_text(
        yaml.safe_dump({"scenario": "c.yaml", "grid": {"workload.arrival.rate_per_s": [5, 10]}})
    )
    assert kvsim("sweep", tmp_path / "g.yaml", "--out", tmp_path / "sw", "--workers", 1)[0] == 0
    assert kvsim("capacity", tmp_path / "c.yaml", "--out", tmp_path / "cap", "--workers", 1)[0] == 0
    assert seen["sweep_workload_arrival_rate_per_s.png"].startswith("c · llama-3-8b on h100-80gb, tp 1")
    assert "swept: arrival rate (req/s)" in seen["sweep_workload_arrival_rate_per_s.png"]
    assert "Metrics against arrival rate (req/s)" in seen["sweep_workload_arrival_rate_per_s.png"]  # its title stays
    assert seen["capacity.png"].startswith("c · llama-3-8b on h100-80gb, tp 1 · poisson arrivals, rate swept")


def test_sweep_and_capacity_figures_note_a_setting_without_modelled_effect(tmp_path, monkeypatch):
    """A grid that varies the block size from point to point (one block size per point):
    the note is judged across the points, as a run's is across its policies; a capacity
    search's figure notes what its policies' settings do not change."""
    from kvsim.analysis.unmodelled import sweep_notes
    from kvsim.sweep.grid import load_sweep

    seen = _sweep_titles(monkeypatch)
    doc = _small_scenario(10)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    grid = {"policies[*].block_size": [16, 32], "workload.arrival.rate_per_s": [5, 10]}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump({"scenario": "c.yaml", "grid": grid}))
    note = "Note: block size (16, 32): no modelled effect on step time; these policies differ through memory alone"
    assert kvsim("sweep", tmp_path / "g.yaml", "--out", tmp_path / "sw", "--workers", 1, "--quiet")[0] == 0
    for name in ("sweep_policies_block_size.png", "sweep_workload_arrival_rate_per_s.png"):
        assert " ".join(seen[name].split()).endswith(note), seen[name]
    # the roofline prices an FP8 cache's fewer bytes: a grid over the KV dtype gets no note
    doc["cost_model"] = "roofline"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    grid = {"policies[*].kv_cache_dtype": ["auto", "fp8"]}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({"scenario": "r.yaml", "grid": grid}))
    plan = load_sweep(tmp_path / "d.yaml")
    assert [n for n in sweep_notes([p.scenario for p in plan.points], plan.base_dir) if "KV dtype (" in n] == []
    doc.pop("cost_model")
    doc["policies"] = [
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
        {"name": "paged-32", "allocator": "paged", "block_size": 32},
    ]
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(doc))
    code, _, err = kvsim("capacity", tmp_path / "two.yaml", "--out", tmp_path / "cap", "--workers", 1, "--quiet")
    assert code == 0, err
    assert " ".join(seen["capacity.png"].split()).endswith(note), seen["capacity.png"]
