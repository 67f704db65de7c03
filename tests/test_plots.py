"""Plots: the four PNGs are written, valid and closed; downsampling keeps time means."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib import pyplot

from kvsim.plots.run_figures import FILES, downsample, latency_samples, policy_colours, save, write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_summary(policies, basis="waiting"):
    rows = []
    for i, name in enumerate(policies):
        token = 0.3 + 0.2 * i
        rows.append(
            dict(
                policy=name,
                kv_utilization=token,
                token_fraction=token,
                reservation_fraction=0.1,
                internal_fraction=0.15,
                external_fraction=0.05,
                free_fraction=1 - token - 0.3,
                fraction_basis=basis,
                allocation_waste=0.3,
                mean_batch_size=8.0 + i,
                achievable_batch_size=12.0 + 2 * i,
                max_batch_size=256,
                throughput_tok_s=900.0 * (i + 1),
                request_throughput=3.0,
                ttft_p50_s=0.2,
                ttft_p99_s=1.5,
                tpot_p50_s=0.03,
                e2e_p50_s=4.0,
                preemptions=i,
                requests_completed=40,
                requests_rejected=0,
                cost_model="roofline",
            )
        )
    return pd.DataFrame(rows)


def make_timeseries(policies, steps=300):
    frames = []
    for i, name in enumerate(policies):
        step = np.arange(steps)
        step_s = np.full(steps, 0.02 + 0.01 * i)
        token = 0.3 + 0.2 * np.sin(step / 20) ** 2
        frames.append(
            pd.DataFrame(
                dict(
                    policy=name,
                    step=step,
                    time_s=np.r_[0, np.cumsum(step_s)[:-1]],
                    step_s=step_s,
                    running=(step % 17) + 1,
                    waiting=step % 5,
                    token=token,
                    reservation=0.1,
                    internal=0.1,
                    external=0.05,
                    free=0.75 - token,
                )
            )
        )
    return pd.concat(frames, ignore_index=True)


def make_requests(policies, n=40, rejected=()):
    rng = np.random.default_rng(0)
    frames = []
    for name in policies:
        arrival = np.sort(rng.uniform(0, 5, n))
        first = arrival + rng.exponential(0.3, n)
        out = rng.integers(1, 200, n)
        finish = first + 0.03 * out
        frame = pd.DataFrame(
            dict(
                policy=name,
                request_id=np.arange(n),
                arrival_s=arrival,
                admitted_s=arrival,
                first_token_s=first,
                finish_s=finish,
                prompt_tokens=rng.integers(10, 500, n),
                output_tokens=out,
                preemptions=0,
                outcome="completed",
                reason="",
            )
        )
        if name in rejected:
            frame = frame.assign(
                admitted_s=np.nan,
                first_token_s=np.nan,
                finish_s=np.nan,
                outcome="rejected",
                reason="prompt exceeds KV pool",
            )
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def assert_pngs(paths, out_dir):
    assert paths == [out_dir / name for name in FILES]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 5_000
    assert pyplot.get_fignums() == []


def test_writes_four_pngs_with_a_policy_that_completed_nothing(tmp_path):
    policies = ["contiguous-max", "paged-16", "paged-fp8"]
    paths = write_plots(
        make_summary(policies),
        make_timeseries(policies),
        make_requests(policies, rejected={"contiguous-max"}),
        tmp_path,
    )
    assert_pngs(paths, tmp_path)


@pytest.mark.parametrize("case", ["single policy", "no steps for one", "no steps at all", "no requests", "mixed basis"])
def test_edge_cases_still_draw(tmp_path, case):
    policies = ["paged-16"] if case == "single policy" else ["contiguous-max", "paged-16"]
    summary, timeseries, requests = (make_summary(policies), make_timeseries(policies), make_requests(policies))
    if case == "no steps for one":
        timeseries = timeseries[timeseries["policy"] == "paged-16"]
    if case == "no steps at all":
        timeseries = timeseries.iloc[:0]
    if case == "no requests":
        requests = requests.iloc[:0]
    if case == "mixed basis":
        summary.loc[1, "fraction_basis"] = "busy"
    assert_pngs(write_plots(summary, timeseries, requests, tmp_path), tmp_path)


def test_downsample_buckets_by_time_and_weights_by_duration():
    series = pd.DataFrame(dict(time_s=[4.0, 0.0, 3.0, 1.0], step_s=[1.0, 1.0, 1.0, 2.0], token=[20.0, 10.0, 0.0, 40.0]))
    # span 0..5 s, two 2.5 s buckets: steps at 0 and 1 s, then at 3 and 4 s
    out = downsample(series, ["token"], max_points=2)
    assert out["time_s"].tolist() == [0.0, 3.0]
    assert out["step_s"].tolist() == [3.0, 2.0]
    assert out["token"].tolist() == [30.0, 10.0]


def test_downsample_keeps_the_time_weighted_mean_of_a_long_series():
    rng = np.random.default_rng(1)
    step_s = rng.uniform(0.001, 0.1, 100_000)
    series = pd.DataFrame(
        dict(time_s=np.r_[0, np.cumsum(step_s)[:-1]], step_s=step_s, token=rng.uniform(0, 1, step_s.size))
    )
    out = downsample(series, ["token"])
    assert len(out) <= 2000
    assert out["step_s"].sum() == pytest.approx(step_s.sum())
    expected = np.average(series["token"], weights=series["step_s"])
    assert np.average(out["token"], weights=out["step_s"]) == pytest.approx(expected, rel=1e-12)
    assert out.equals(downsample(series.iloc[::-1], ["token"]))


def test_latency_samples_define_tpot_only_beyond_the_first_token():
    requests = pd.DataFrame(
        dict(
            policy=["a", "a", "a"],
            arrival_s=[0.0, 1.0, 2.0],
            first_token_s=[0.5, 1.25, np.nan],
            finish_s=[2.5, 1.25, np.nan],
            output_tokens=[5, 1, 0],
            outcome=["completed", "completed", "rejected"],
        )
    )
    got = latency_samples(requests)
    assert got["ttft_s"].tolist() == [0.5, 0.25]
    assert got["tpot_s"].iloc[0] == 0.5 and np.isnan(got["tpot_s"].iloc[1])
    assert got["e2e_s"].tolist() == [2.5, 0.25]


def small_figure(facecolor="white"):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5), facecolor=facecolor, layout="constrained")
    ax = fig.subplots()
    ax.plot([0, 1, 2], [0, 1, 0.5], color="#1f77b4")
    ax.set_title("a title", fontsize=10)
    return fig


def test_a_figure_is_saved_with_print_pngs_pixels(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    fig = small_figure()
    fig.set_dpi(110)
    FigureCanvasAgg(fig).print_png(tmp_path / "matplotlib.png")
    save(small_figure(), tmp_path / "kvsim.png")
    theirs, ours = Image.open(tmp_path / "matplotlib.png"), Image.open(tmp_path / "kvsim.png")
    assert np.array_equal(np.asarray(theirs), np.asarray(ours))
    assert ours.info["Software"].startswith("Matplotlib version")
    assert ours.info["dpi"] == pytest.approx((110, 110), abs=0.01)


def test_a_figure_with_transparent_pixels_keeps_its_alpha_channel(tmp_path):
    from PIL import Image

    save(small_figure(facecolor="none"), tmp_path / "clear.png")
    image = Image.open(tmp_path / "clear.png")
    assert image.mode == "RGBA"
    assert image.getchannel("A").getextrema()[0] == 0


def test_policy_colours_follow_summary_order_then_first_appearance():
    colours = policy_colours(pd.DataFrame({"policy": ["b", "a"]}), pd.DataFrame({"policy": ["a", "c"]}))
    assert list(colours) == ["b", "a", "c"]
    assert len(set(colours.values())) == 3
    repeated = policy_colours(
        pd.DataFrame({"policy": ["b", "b", "a", "b"]}),
        pd.DataFrame({"policy": pd.Categorical(["c", "a", "c"], categories=["z", "c", "a"])}),
    )
    assert list(repeated) == ["b", "a", "c"]  # first appearance, not category order; unused ones left out


LONG_NAMES = [
    "contiguous-max-first-fit-reservation",
    "contiguous-pow2-buddy-allocator",
    "contiguous-oracle-first-fit",
    "paged-16-block-table-plain",
    "paged-32-block-table-plain",
    "paged-16-fp8-e4m3-per-tensor-scales",
    "paged-16-automatic-prefix-caching",
    "radix-tree-prefix-cache-sglang-style",
]


def test_tick_labels_never_overlap_with_eight_long_policy_names():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from kvsim.plots.run_figures import figures

    figs = figures(
        make_summary(LONG_NAMES),
        make_timeseries(LONG_NAMES, steps=50),
        make_requests(LONG_NAMES, n=20),
        context="a scenario · a model on a GPU, tp 1",
    )
    checked = 0
    for name, fig in figs.items():
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                boxes = [
                    t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()
                ]
                for i, a in enumerate(boxes):
                    for b in boxes[i + 1 :]:
                        assert not a.overlaps(b), f"{name}: tick labels overlap"
                checked += len(boxes)
    assert checked > 8 * 4  # the policy axes were among those checked


def test_a_policy_keeps_its_colour_whatever_else_is_in_the_figure():
    alone = policy_colours(pd.DataFrame({"policy": ["paged-16"]}))
    crowd = policy_colours(pd.DataFrame({"policy": ["contiguous", "paged-32", "paged-16"]}))
    assert alone["paged-16"] == crowd["paged-16"]
    many = policy_colours(pd.DataFrame({"policy": LONG_NAMES}))
    assert len(set(many.values())) == len(LONG_NAMES)


def test_identical_lines_are_labelled_as_coinciding():
    from kvsim.plots.run_figures import figures

    ts = make_timeseries(["a"])
    ts = pd.concat([ts, ts.assign(policy="b")], ignore_index=True)
    fig = figures(make_summary(["a", "b"]), ts, make_requests(["a", "b"]))["utilization_batch.png"]
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert labels == ["a", "b (same as a)"]
    styles = {line.get_linestyle() for line in fig.axes[0].get_lines()}
    assert len(styles) == 2


def test_every_figure_carries_its_context():
    from kvsim.plots.run_figures import figures

    figs = figures(make_summary(["a"]), make_timeseries(["a"]), make_requests(["a"]), context="rag_8k · ctx")
    assert all(fig._suptitle is not None and "rag_8k · ctx" in fig._suptitle.get_text() for fig in figs.values())


def test_the_context_clears_the_legends_beside_the_axes():
    """A long context line, centred, ran into the policy legend at the upper right of the
    utilization figure (rag_8k's own context did)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvsim.plots.run_figures import figures

    names = ["contiguous", "contiguous-pow2", "paged-16"]
    ts = make_timeseries(["contiguous", "paged-16"])
    ts = pd.concat([ts, ts[ts["policy"] == "contiguous"].assign(policy="contiguous-pow2")], ignore_index=True)
    context = (
        "rag_8k · llama-3-8b on h100-80gb, tp 1 · poisson 4 req/s · engine vllm-v1 · "
        "step costs differ per policy (see the summary)"
    )
    figs = figures(make_summary(names), ts, make_requests(names), context=context)
    with_legends = [fig for fig in figs.values() if fig.legends]
    assert len(with_legends) >= 2
    for fig in with_legends:
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        title = fig._suptitle.get_window_extent(renderer)
        assert not any(title.overlaps(legend.get_window_extent(renderer)) for legend in fig.legends)


def test_the_engines_columns_draw_where_present_and_never_memory_bound_runs_show_n_a(tmp_path):
    """The engines work adds engine, limited_by_* and memory_capacity_requests to the summary,
    the 'none' basis (fractions and achievable batch NaN) and a per-step limited_by column."""
    from kvsim.plots.run_figures import capacity_requests, figures

    policies = ["paged-16", "paged-16-fp8"]
    summary = make_summary(policies).assign(
        engine="vllm-v1",
        fraction_basis="none",
        limited_by_memory=0.0,
        limited_by_arrivals=1.0,
        memory_capacity_requests=[40.0, 80.0],
        kv_capacity_tokens=[16000, 32000],
    )
    for col in (
        "token_fraction",
        "reservation_fraction",
        "internal_fraction",
        "external_fraction",
        "free_fraction",
        "achievable_batch_size",
    ):
        summary[col] = np.nan
    timeseries = make_timeseries(policies).assign(limited_by="arrivals")
    assert capacity_requests(summary, make_requests(policies))[0].tolist() == [40.0, 80.0]
    figs = figures(summary, timeseries, make_requests(policies), context="ctx")
    texts = [t.get_text() for ax in figs["memory_breakdown.png"].axes for t in ax.texts]
    assert texts.count("n/a") == 2
    tput = figs["throughput_batch.png"].axes[1]
    assert tput.get_title() == "Output throughput: set by the arrival rate for every policy"
    # without the column: capacity in tokens over the mean request (prompt + output)
    requests = make_requests(policies)
    mean = (requests.prompt_tokens + requests.output_tokens).mean()
    got = capacity_requests(summary.drop(columns="memory_capacity_requests"), requests)[0]
    assert got.tolist() == pytest.approx([16000 / mean, 32000 / mean])


def test_a_long_latency_cdf_is_drawn_through_evenly_spaced_ranks():
    from kvsim.plots.run_figures import cdf_points

    v = np.sort(np.random.default_rng(1).exponential(size=10_001))
    x, y = cdf_points(v[:5])  # short: every sample
    assert list(x) == [v[0], *v[:5]] and list(y) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    x, y = cdf_points(v, max_points=101)  # ranks 0, 100, ..., 10,000
    assert len(x) == 102 and (x[0], y[0]) == (v[0], 0.0)
    assert list(x[1:]) == list(v[::100]) and list(y[1:]) == [(r + 1) / 10_001 for r in range(0, 10_001, 100)]
    assert np.diff(y[1:]).max() <= 1 / 100 + 1e-12  # each step under 1/max_points of the axis


def test_no_text_leaves_its_figure_with_many_runs_policies_and_mixed_bases():
    """Ten policies of two runs (names prefixed run/), one of them never memory-bound:
    the breakdown's title, which names the bases, wraps inside the figure (it ran off both
    edges), and no policy label breaks inside a word (`chat/contiguou` + `s`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvsim.plots.run_figures import figures

    names = [f"{run}/{p}" for run in ("rag", "chat") for p in ("contiguous", "paged-16", "paged-32", "pow2", "prefix")]
    summary = make_summary(names, basis="memory")
    summary.loc[4, "fraction_basis"] = "none"
    figs = figures(summary, make_timeseries(names, steps=40), make_requests(names, n=10), context="ctx")
    for name, fig in figs.items():
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        page = fig.bbox
        for ax in fig.axes:
            box = ax.title.get_window_extent(renderer)
            assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1, f"{name}: {ax.get_title()!r} leaves the figure"
    title = figs["memory_breakdown.png"].axes[0].get_title()
    assert "rag/prefix: never memory-bound" in title and "bases differ" not in title


@pytest.mark.parametrize(
    "name, lines",
    [
        ("chat/contiguous", ["chat/", "contiguous"]),
        ("paged-16-prefix-caching", ["paged-16-", "prefix-caching"]),
        ("contiguous-oracle", ["contiguous-", "oracle"]),
        ("an-extraordinarily-long-word-here", ["an-", "extraordinarily-", "long-word-here"]),
        ("paged-16", ["paged-16"]),
    ],
)
def test_policy_labels_wrap_after_hyphens_and_slashes_never_inside_a_word(name, lines):
    from kvsim.plots.style import wrap_label

    assert wrap_label(name).split("\n") == lines
