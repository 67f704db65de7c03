"""docs/step-costs.md, rendered from docs/templates/step-costs.md: every figure on the
page is computed here, from what kvsim ships (its profiles, engine overheads and GPU
presets, what `kvsim cost` prints, the H200 profiles under tests/data/h200-calibrate)
or from results/docs/step_costs_sources.json (the few figures of the source data that
kvsim does not ship, measured by `python scripts/docs_results.py --data DIR`).

    python scripts/step_costs_page.py        # or: python scripts/docs_tables.py --only step_costs

In the template `{{name}}` or `{{name:format}}` stands for a value of `values()`; edit
the template, not the page, and rerun. The suite checks that the page is current.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "docs" / "templates" / "step-costs.md"
PAGE = ROOT / "docs" / "step-costs.md"
SOURCES = ROOT / "results" / "docs" / "step_costs_sources.json"
POOL = ROOT / "results" / "docs" / "vllm_kv_pool.csv"  # scripts/docs_results.py --only pool
DATA = ROOT / "kvsim" / "data"
H200 = ROOT / "tests" / "data" / "h200-calibrate"
H200_MODELS = ("llama-3-8b", "llama-2-7b", "llama-3-70b")
FIELD = re.compile(r"\{\{(\w+)(?::([^}]*))?\}\}")


def render(template: str, values: dict) -> str:
    def one(m: re.Match) -> str:
        value = values[m[1]]
        return format(value, m[2]) if m[2] else str(value)

    return FIELD.sub(one, template)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _cost(*args: str) -> tuple[dict, str]:
    """`kvsim cost ARGS`: its JSON and the last line it prints."""
    from click.testing import CliRunner

    from kvsim.cli.cost import cost

    runner = CliRunner()
    doc = json.loads(runner.invoke(cost, [*args, "--json"], catch_exceptions=False).output)
    text = runner.invoke(cost, list(args), catch_exceptions=False).output
    return doc, text.strip().splitlines()[-1]


def _ms(parts: dict, *names: str) -> float:
    return 1e3 * sum(parts[n] for n in names)


def _words(n: int) -> str:
    return ("No", "One", "Two", "Three", "Four", "Five")[n] if n < 6 else f"{n:,}"


def _3(x: float) -> str:
    """Three significant digits, trailing zeros kept (3.60, 24.3, 109)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _range(xs, fmt: str, sep: str = "-") -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}{sep}{format(hi, fmt)}"


def _points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def _pct_range(xs, digits: int = 1) -> str:
    return _range([100 * x for x in xs], f".{digits}f") + "%"


# --- the shipped A100 overhead -------------------------------------------------------


@lru_cache(maxsize=1)
def overhead_points() -> pd.DataFrame:
    """The shipped overhead's points, with each one's communication and host ms."""
    from kvsim.cost.overhead import from_file
    from kvsim.model.specs import MODEL_PRESETS

    doc = _json(DATA / "overheads" / "splitwise-a100-v2.json")
    comm = from_file(doc).comm
    pts = pd.DataFrame(doc["points"])
    pts["excluded"] = pts.get("excluded").notna() if "excluded" in pts else False
    models = {m: MODEL_PRESETS[m] for m in pts.model.unique()}
    pts["layers"] = [models[m].num_layers for m in pts.model]
    pts["new_tokens"] = np.where(pts.phase == "prefill", pts.batch * pts.prompt, pts.batch)
    pts["comm_ms"] = [
        comm.seconds(int(r.tp), int(r.layers), models[r.model].hidden_size, int(r.new_tokens)) * 1e3
        for r in pts.itertuples()
    ]
    # the host part as the overhead prices it (host + any wait for launches), not as the
    # difference of rounded times
    host = doc["host"]
    prompt_tokens = np.where(pts.phase == "prefill", pts.new_tokens, 0)
    launches = pts.layers * host["launch_per_layer_ms"]
    pts["host_ms"] = (
        host["step_ms"]
        + host["per_seq_ms"] * pts.batch
        + host["per_prefill_token_ms"] * prompt_tokens
        + np.maximum(0.0, launches - pts.kernel_ms - pts.comm_ms)
    )
    return pts


def _4(x: float) -> str:
    """A time the file keeps to 4 significant digits, shown with no more."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.1f}"


def point(model: str, tp: int, phase: str, prompt: int, batch: int, tokens: int = 128):
    pts = overhead_points()
    hit = pts[
        (pts.model == model)
        & (pts.tp == tp)
        & (pts.phase == phase)
        & (pts.prompt == prompt)
        & (pts.batch == batch)
        & (pts.tokens == tokens)
    ]
    return hit.iloc[0]


def every_configuration_table() -> str:
    pts = overhead_points()
    head = (
        "| model | tp | prompt x batch, tokens | prefill ms: measured / fitted (kernels + comm + host) / held out "
        "| decode ms: measured / fitted (kernels + comm + host) / held out |\n| --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for (m, tp, p, b, t), g in pts.groupby(["model", "tp", "prompt", "batch", "tokens"], sort=True):
        cells = [
            f"{_4(r.measured_ms)} / {_4(r.fitted_ms)} ({_4(r.kernel_ms)} + {_4(r.comm_ms)} + {_4(r.host_ms)}) "
            f"/ {_4(r.held_out_ms)}" + (" (excluded)" if r.excluded else "")
            for r in g.sort_values("phase", ascending=False).itertuples()
        ]
        rows.append(f"| {m} | {tp} | {p} x {b}, {t} | {cells[0]} | {cells[1]} |")
    return head + "\n".join(rows)


EXAMPLES = (  # (label, model, tp, phase, prompt, batch, tokens)
    ("decode batch 1, tp 2 (context ~{context})", 2, "decode", 1, 128),
    ("decode batch 32, tp 2{note}", 2, "decode", 32, 128),
    ("decode batch 1, tp 8", 8, "decode", 1, 128),
    ("decode batch 32, tp 8", 8, "decode", 32, 128),
    ("prefill 8,192 tokens, tp 4", 4, "prefill", 1, 128),
    ("prefill 8,192 tokens, tp 8", 8, "prefill", 1, 128),
)


def example_rows() -> str:
    lines = ["| step | measured | kernels | fitted | held out |", "| --- | --- | --- | --- | --- |"]
    for label, tp, phase, batch, tokens in EXAMPLES:
        r = point("llama-2-70b", tp, phase, 8192 if phase == "prefill" else 512, batch, tokens)
        label = label.format(context=_mid_context(512, 128), note=" (excluded by the e2e rule)" if r.excluded else "")
        fmt = "{:,.0f}" if phase == "prefill" else "{:,.1f}"
        cells = [fmt.format(r[k]) for k in ("measured_ms", "kernel_ms", "fitted_ms", "held_out_ms")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mid_context(prompt: int, tokens: int) -> int:
    return int(round(prompt + (tokens + 1) / 2))


def _extra_per_prompt(model: str) -> list[float]:
    """Per extra prompt in a batched prefill, ms beyond one prompt of the same tokens,
    after the kernels' difference (attention: the tokens are the same)."""
    pts = overhead_points()
    out = []
    for tp in sorted(pts[pts.model == model].tp.unique()):
        for b in (2, 4, 8, 16):
            try:
                many, one = point(model, tp, "prefill", 512, b), point(model, tp, "prefill", 512 * b, 1)
            except IndexError:
                continue
            gap = (many.measured_ms - one.measured_ms) - (many.kernel_ms - one.kernel_ms)
            out.append(gap / (b - 1))
    return out


def overhead_values() -> dict:
    doc = _json(DATA / "overheads" / "splitwise-a100-v2.json")
    acc = _json(DATA / "overheads" / "accuracy.json")
    from kvsim.cost.overhead_fit import KNEES
    from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS

    host, comm, fit, rng = doc["host"], doc["comm"], doc["fit"], doc["range"]
    llama, bloom = MODEL_PRESETS["llama-2-70b"], MODEL_PRESETS["bloom-176b"]
    a100 = GPU_PRESETS["a100-80gb"]
    per_hop = comm["latency_per_hop_us"]
    v = {
        "ov_points": len(doc["points"]),
        "ov_used": fit["points_used"],
        "ov_excluded": fit["points_excluded"],
        "step_ms": host["step_ms"],
        "per_seq_ms": host["per_seq_ms"],
        "per_seq_32": 32 * host["per_seq_ms"],
        "per_prompt_token": (
            "0 (held at its bound)" if not host["per_prefill_token_ms"] else f"{host['per_prefill_token_ms']:.3g} ms"
        ),
        "launch_ms": host["launch_per_layer_ms"],
        "launch_llama": llama.num_layers * host["launch_per_layer_ms"],
        "launch_bloom": bloom.num_layers * host["launch_per_layer_ms"],
        "llama_layers": llama.num_layers,
        "per_hop_us": per_hop,
        "allreduce_us": ", ".join(f"{per_hop * (tp - 1):.0f}" for tp in (2, 4)) + f" and {per_hop * 7:.0f}",
        "allreduce_step_ms": ", ".join(f"{2 * llama.num_layers * per_hop * (tp - 1) / 1e3:.1f}" for tp in (2, 4))
        + f" and {2 * llama.num_layers * per_hop * 7 / 1e3:.1f}",
        "bus": comm["bus_gb_s"],
        "knee": comm["large_step_tokens"],
        "large_bus": comm["large_step_bus_gb_s"],
        "knee_grid": f"{min(KNEES):,}-{max(KNEES):,}",
        "fixed_per_tp": ", ".join(f"{doc['per_tp'][f'tp{tp}']['fixed_ms_per_step_llama_2_70b']:.1f}" for tp in (2, 4))
        + f" and {doc['per_tp']['tp8']['fixed_ms_per_step_llama_2_70b']:.1f}",
        "free_bus": fit["free_bus_fit"]["comm"]["bus_gb_s"],
        "free_mape": fit["free_bus_fit"]["in_sample_mape"],
        "held_mape": fit["in_sample_mape"],
        "tp_range": f"{rng['tp'][0]}-{rng['tp'][1]}",
        "seq_range": f"{rng['seqs'][0]}-{rng['seqs'][1]}",
        "max_seqs": rng["seqs"][1],
        "token_range": f"{rng['new_tokens'][0]:,}-{rng['new_tokens'][1]:,}",
        "max_tokens": f"{rng['new_tokens'][1]:,}",
        "per_seq_256": 256 * host["per_seq_ms"],
        "rules_medians": doc["rules"]["medians"],
        "e2e_low_runs": doc["rules"]["e2e_single_runs_below_half_their_median"],
        "e2e_short": doc["rules"]["e2e_short_runs_kept"],
        "bloom_decode_held": acc["held_out"]["bloom-176b tp8 decode"],
        "bloom_prefill_held": acc["held_out"]["bloom-176b tp8 prefill"],
        "bloom_decode_additive": acc["held_out_additive"]["bloom-176b tp8 decode"],
        "over_25": _words(len(acc["points_over_25pct"])),
    }
    # decode at batch 1: the same step time at tp 4 and 8 while the kernels halve
    d4, d8 = point("llama-2-70b", 4, "decode", 512, 1), point("llama-2-70b", 8, "decode", 512, 1)
    v |= {"d48_measured": (d4.measured_ms + d8.measured_ms) / 2, "d4_kernel": d4.kernel_ms, "d8_kernel": d8.kernel_ms}
    w_bloom, w_llama = bloom.weight_bytes() / 8 / 1e9, llama.weight_bytes() / 8 / 1e9
    b1, l1 = point("bloom-176b", 8, "decode", 128, 1), point("llama-2-70b", 8, "decode", 128, 1)
    v |= {
        "w_bloom": w_bloom,
        "w_llama": w_llama,
        "w_extra_ms": (w_bloom - w_llama) / (a100.hbm_tb_s * 1e3) * 1e3,
        "a100_tb_s": a100.hbm_tb_s,
        "bloom_b1": b1.measured_ms,
        "llama_b1": l1.measured_ms,
        "bloom_gap": b1.measured_ms - l1.measured_ms,
    }
    pts = overhead_points()
    launch_bound = pts[(pts.model == "llama-2-70b") & pts.tp.isin([4, 8]) & (pts.phase == "decode") & (pts.batch == 1)]
    device = launch_bound.kernel_ms + launch_bound.comm_ms
    v["llama_device"] = _range(device, ".0f")
    v["bloom_device"] = b1.kernel_ms + b1.comm_ms
    # prefill beyond the knee, Llama at tp 4
    p8k, p32k = point("llama-2-70b", 4, "prefill", 8192, 1), point("llama-2-70b", 4, "prefill", 512, 64)
    v |= {
        "tp4_kernel_per_token": p8k.kernel_ms / 8192,
        "tp4_8k_per_token": p8k.measured_ms / 8192,
        "tp4_32k_per_token": p32k.measured_ms / 32768,
    }
    # excluded points
    b64, b32 = point("llama-2-70b", 2, "prefill", 512, 64), point("llama-2-70b", 2, "prefill", 512, 32)
    ratios = [float(re.search(r"e2e ([\d.]+)x", e)[1]) for e in acc["excluded"] if "decode batch" in e]
    v |= {
        "b64_ms": b64.measured_ms,
        "b32_ms": b32.measured_ms,
        "e2e_ratios": f"{ratios[0]:.2f}x; batch 64: {ratios[1]:.0f}x",
    }
    # the worst held-out points
    worst = _described(acc["worst"]["point"])
    v |= {
        "worst_pred": worst.held_out_ms,
        "worst_measured": worst.measured_ms,
        "worst_error": acc["worst"]["error"],
    }
    others = [_described(p) for p in acc["points_over_25pct"] if p != acc["worst"]["point"]]
    v["other_worst"] = "; ".join(
        f"Llama tp {r.tp}, {r.batch} prompts of {r.prompt}: {r.held_out_ms:,.0f} against {r.measured_ms:,.0f} ms, "
        f"{r.held_out_ms / r.measured_ms - 1:+.1%}"
        for r in others
    )
    # one long prompt against 16 prompts of 512
    gaps = {
        tp: (point("llama-2-70b", tp, "prefill", 8192, 1), point("llama-2-70b", tp, "prefill", 512, 16))
        for tp in (2, 4, 8)
    }
    less = {tp: 1 - a.measured_ms / b.measured_ms for tp, (a, b) in gaps.items()}
    v |= {
        "long_less": _pct_range([less[4], less[8]], 0),
        "long_tp8": f"{gaps[8][0].measured_ms:,.0f} against {gaps[8][1].measured_ms:,.0f}",
        "long_tp4": f"{gaps[4][0].measured_ms:,.0f} against {gaps[4][1].measured_ms:,.0f}",
        "long_tp2": f"{less[2]:.0%}",
        "long_kernels": _pct_range([a.kernel_ms / b.kernel_ms - 1 for a, b in (gaps[4], gaps[8])], 0),
        "extra_llama": _range(_extra_per_prompt("llama-2-70b"), ".0f"),
        "extra_bloom": _range(_extra_per_prompt("bloom-176b"), "+.1f", " to "),
    }
    # the 8,192-token prompt at tp 8: its attention
    doc8, _ = _cost(
        "--model", "llama-2-70b", "--gpu", "a100-80gb", "--tp", "8", "--prefill-tokens", "8192", "--overhead", "none"
    )
    attention = _ms(doc8["parts_s"], "attention_prefill")
    long8 = gaps[8][0]
    v |= {
        "long8_attention": attention,
        "long8_kernels": long8.kernel_ms,
        "long8_without": (long8.held_out_ms - attention) / long8.measured_ms - 1,
    }
    # the large-step term across tp: measured time beyond the kernels at >= 8,192 tokens
    big = pts[(pts.model == "llama-2-70b") & (pts.phase == "prefill") & (pts.new_tokens >= 8192) & ~pts.excluded]
    extra = (big.measured_ms - big.kernel_ms).groupby([big.prompt, big.batch, big.tp]).first().unstack()
    v |= {
        "large_8_over_4": _range((extra[8] / extra[4]).dropna(), ".1f"),
        "large_2_over_4": _range((extra[2] / extra[4]).dropna().clip(lower=0), ".2f"),
    }
    t2a, t2b = point("llama-2-70b", 2, "decode", 512, 1, 128), point("llama-2-70b", 2, "decode", 512, 1, 256)
    v |= {"tp2_series_a": t2a.measured_ms, "tp2_series_b": t2b.measured_ms}
    return v


def _described(text: str):
    """The point accuracy.json names, e.g. 'llama-2-70b tp8 prefill 1 x 8192'."""
    m = re.fullmatch(r"(\S+) tp(\d+) prefill (\d+) x (\d+)", text)
    return point(m[1], int(m[2]), "prefill", int(m[4]), int(m[3]))


# --- the shipped profiles --------------------------------------------------------------


def profile_values(sources: dict) -> dict:
    from kvsim.cost.accuracy import report as held_out
    from kvsim.cost.fit import ELEMENTWISE_OPS, LINEAR_OPS, gemm_kn, predict_attention
    from kvsim.cost.profiles import load_profile
    from kvsim.model.specs import GPU_PRESETS

    folder = DATA / "profiles"
    acc = _json(folder / "accuracy.json")
    gpus = _json(folder / "gpus.json")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())  # the files' bytes
    kept = {
        fam: pd.read_csv(folder / name / "linear.csv").groupby("tp").num_tokens.nunique().max()
        for fam, name in (("llama2", "a100-llama-2-7b"), ("llama3", "a100-llama-3-8b"))
    }
    measured = sources["profiles"]["measured_token_counts"]
    interp = acc["interpolation"]
    worst = max(
        ((e, op, name) for name, ops in interp.items() for op, e in ops.items() if op != "all_ops"), key=lambda t: t[0]
    )
    report = held_out(load_profile("a100-llama-3-8b"))["mape"]
    shapes = acc["leave_one_shape_out"]

    def held(gpu: str, key: str) -> str:
        return ", ".join(f"{e[key]:.1%} ({', '.join(e['held_out_models'])})" for e in shapes[gpu].values())

    elementwise = [e["per_op"][op] for g in shapes.values() for e in g.values() for op in ELEMENTWISE_OPS]
    att = acc["attention"]
    v = {
        "profiles_kb": size / 1e3,
        "kept_llama2": kept["llama2"],
        "kept_llama3": kept["llama3"],
        "measured_llama2": measured["llama-2"],
        "measured_llama3": measured["llama-3"],
        "heldout_llama2": measured["llama-2"] - kept["llama2"],
        "heldout_llama3": measured["llama-3"] - kept["llama3"],
        "interp_range": _pct_range([ops["all_ops"] for ops in interp.values()]),
        "interp_worst": f"{worst[0]:.1%} ({worst[2]} {worst[1]})",
        "report_range": _pct_range([e for op, e in report.items() if op in LINEAR_OPS]),
        "shape_a100": held("a100-80gb", "gemm_mape"),
        "shape_h100": held("h100-80gb", "gemm_mape"),
        "layer_a100": held("a100-80gb", "layer_total_mape"),
        "layer_h100": held("h100-80gb", "layer_total_mape"),
        "elementwise_range": _pct_range(elementwise, 0),
        "att_whole": att["prefill_whole_prompt"]["mape"],
        "att_chunks": att["prefill_chunk_on_cache"]["mape"],
        "att_decode": att["decode"]["mape"],
        "att_all": att["all"]["mape"],
        "att_rows": att["all"]["rows"],
        "att_kv_write": att["kv_write"]["mape"],
    }
    for gpu, key in (("a100-80gb", "a100"), ("h100-80gb", "h100")):
        g = gpus[gpu]["gemm"]
        v |= {f"{key}_bw": g["bw_eff"], f"{key}_flops": g["flops_eff"], f"{key}_p": g["p"], f"{key}_a": g["a_s"] * 1e6}
    # the decode sample's staircase, against the smooth fitted form
    prof = load_profile("a100-llama-3-8b")
    rows = prof.attention_rows
    meta = prof.meta
    pred = predict_attention(
        meta["attention"], {c: rows[c].values for c in rows}, meta["model"], meta["peak_flops"], meta["bandwidth"]
    )
    dec = (rows.phase == "decode").values
    err = pd.Series(pred[dec] / (rows.time_ms.values[dec] * 1e-3) - 1, index=rows.index[dec])
    jumps = re.search(r"e\.g\. ([^)]*) in the A100 sample", " ".join(meta["notes"]))[1]
    edges = [int(j.split("->")[1]) for j in jumps.split(", ")]
    band = np.searchsorted(edges, rows.batch_size.values[dec], side="right")
    largest = err.abs().sort_values().index[-10:]
    v |= {
        "jumps": jumps,
        "band_bias": max(abs(e) for e in err.groupby(band).mean()),
        "largest_errors": _pct_range(err.abs()[largest], 0),
        "largest_us": _range(rows.time_ms[largest] * 1e3, ".0f"),
        "largest_context": int(rows.context[largest].max()),
    }
    pre = rows[(rows.phase == "prefill") & (rows.context == 0)]
    per_token = pre.kv_write_ms / pre.chunk_tokens * 1e3
    v["kv_write_us"] = _range(per_token.quantile([0.1, 0.9]), ".2g")
    share = []
    for model, gpu, tp in (("llama-2-70b", "a100-80gb", "2"), ("llama-3-8b", "h100-80gb", "1")):
        doc, _ = _cost("--model", model, "--gpu", gpu, "--tp", tp, "--prefill-tokens", "2048", "--overhead", "none")
        share.append(doc["parts_s"]["kv_write"] / doc["step_time_s"])
    v |= {"kv_share_70b": share[0], "kv_share_8b": share[1]}
    # every small projection takes longer than reading its weights
    slower = []
    for name in (
        "a100-llama-2-7b",
        "a100-llama-2-70b",
        "a100-llama-3-8b",
        "a100-llama-3-70b",
        "h100-llama-2-7b",
        "h100-llama-2-70b",
    ):
        p = load_profile(name)
        bw = GPU_PRESETS[p.meta["gpu"]].hbm_tb_s * 1e12
        one = p.linear[p.linear.num_tokens == 1]
        for r in one.itertuples():
            for op in ("attn_pre_proj", "attn_post_proj", "mlp_down_proj"):
                k, n = gemm_kn(p.meta["model"], op, int(r.tp))
                slower.append(getattr(r, op) * 1e-3 > 2 * k * n / bw)
    assert all(slower), "a 1-token projection reads its weights faster than HBM bandwidth: rewrite that sentence"
    p7 = load_profile("a100-llama-2-7b")
    k, n = gemm_kn(p7.meta["model"], "attn_post_proj", 1)
    row = p7.linear[(p7.linear.tp == 1) & (p7.linear.num_tokens == 1)].iloc[0]
    v |= {
        "out_proj_us": row.attn_post_proj * 1e3,
        "out_proj_read_us": 2 * k * n / (GPU_PRESETS["a100-80gb"].hbm_tb_s * 1e6),
    }
    return v


# --- the example step, other GPUs ------------------------------------------------------


def cost_values() -> dict:
    from kvsim.model.specs import GPU_PRESETS

    doc, line = _cost(
        "--model", "llama-2-70b", "--gpu", "a100-80gb", "--tp", "8", "--decode-batch", "32", "--context", "576"
    )
    parts = doc["parts_s"]
    v = {
        "cost_split": line.removeprefix("of which "),
        "cost_device": _ms(parts, *(k for k in parts if not k.startswith("overhead"))),
        "cost_host": _ms(parts, "overhead_step", "overhead_seqs", "overhead_prompt_tokens"),
        "cost_launch_wait": _ms(parts, "overhead_launch"),
    }
    g = GPU_PRESETS
    v |= {
        "a100_40_tflops": g["a100-40gb"].bf16_tflops,
        "h200_tflops": g["h200"].bf16_tflops,
        "a100_40_tb_s": g["a100-40gb"].hbm_tb_s,
        "h200_tb_s": g["h200"].hbm_tb_s,
        "nvlink_a100": g["a100-80gb"].nvlink_gb_s,
        "nvlink_h100": g["h100-80gb"].nvlink_gb_s,
        "links_h100": g["h100-80gb"].nvlink_gb_s / g["a100-80gb"].nvlink_gb_s,
        "links_a100_40": g["a100-40gb"].nvlink_gb_s / g["a100-80gb"].nvlink_gb_s,
    }
    assert (
        g["a100-40gb"].nvlink_gb_s == g["a100-80gb"].nvlink_gb_s and g["h200"].nvlink_gb_s == g["h100-80gb"].nvlink_gb_s
    )
    h100 = {}
    for tp in ("2", "8"):
        for b in ("1", "32"):
            d, _ = _cost(*H100, "--tp", tp, "--decode-batch", b, "--context", "576")
            h100[tp, b] = d
    launch_bound = all(d["parts_s"]["overhead_launch"] > 0 for d in h100.values())
    v["h100_decode"] = (
        f"{h100['2', '1']['step_time_s'] * 1e3:.1f} and {h100['2', '32']['step_time_s'] * 1e3:.1f} ms at tp 2, "
        f"{h100['8', '1']['step_time_s'] * 1e3:.1f} and {h100['8', '32']['step_time_s'] * 1e3:.1f} ms at tp 8"
        + (" (every one launch-bound: the host part and the launches)" if launch_bound else "")
    )
    for tp in ("4", "8"):
        d, _ = _cost(*H100, "--tp", tp, "--prefill-tokens", "8192")
        v[f"h100_prefill_tp{tp}"] = d["step_time_s"] * 1e3
    return v


H100 = ("--model", "llama-2-70b", "--gpu", "h100-80gb", "--overhead", "splitwise-a100-v2")  # the A100 fit carried over


# --- vLLM V1 on H100 ---------------------------------------------------------------------


def vllm_values(sources: dict) -> dict:
    from kvsim.calibrate.engine_fit import TARGETS

    doc = _json(DATA / "overheads" / "vllm-v1-h100-v1.json")
    pts = pd.DataFrame(doc["points"])
    loo = doc["error"]["leave_one_out"]
    held = pts[~pts.in_sample]
    splitwise = sources["vllm_splitwise"]
    ex = pts[pts.in_sample & (pts.run == splitwise["run"]) & (pts.stage == splitwise["stage"])].iloc[0]

    def row(name: str, key: str, scale: float, unit: str) -> str:
        m, p = ex[f"{key}_measured_s"] * scale, ex[f"{key}_predicted_s"] * scale
        other = splitwise[f"{key}_predicted_s"] * scale
        return f"| {name} | {_3(m)} {unit} | {_3(p)} {unit} ({p / m - 1:+.1%}) | {_3(other)} {unit} |"

    dense_fast = held[(held.rate_per_s == held.rate_per_s.max()) & ~held.run.str.startswith("mixtral")]
    # runs past capacity: fewer than 99% answered, measured or predicted
    past = held[(held.answered_measured < 0.99) | (held.answered_predicted < 0.99)]
    past_dense = past[~past.run.str.startswith("mixtral")]
    mixtral = past[past.run.str.startswith("mixtral")].iloc[0]
    reasoning = held[held.run == "codellama-34b-tp2-reasoning"].iloc[0]
    pool = pd.read_csv(POOL, dtype={"kv_cache_gib": str})
    pool = pool[pool.run == mixtral.run]
    sized, smaller = pool[pool.kv_cache_gib == "vllm"].iloc[0], pool[pool.kv_cache_gib != "vllm"]
    nearest = smaller.loc[(smaller.answered_predicted - smaller.answered_measured).abs().idxmin()]
    return {
        "vllm_runs": len(pts.run.unique()),
        "vllm_step_ms": doc["host"]["step_ms"],
        "vllm_per_seq_us": doc["host"]["per_seq_ms"] * 1e3,
        "vllm_rate": f"{ex.rate_per_s:g}",
        "vllm_table": "\n".join(
            [
                "| | measured | kvsim, `calibrated` (vllm-v1-h100-v1) | kvsim with `splitwise-a100-v2` |",
                "| --- | --- | --- | --- |",
                row("E2E mean", "e2e_mean", 1, "s"),
                row("TTFT p50", "ttft_p50", 1e3, "ms"),
                row("ITL mean", "itl_mean", 1e3, "ms"),
            ]
        ),
        "vllm_stages": loo["stages"],
        "vllm_e2e": loo["e2e_mean_mae"],
        "vllm_e2e_target": TARGETS["e2e"],
        "vllm_e2e_worst": loo["e2e_mean_worst"],
        "vllm_ttft": loo["ttft_p50_median_error"],
        "vllm_ttft_target": TARGETS["ttft"],
        "vllm_fast_rate": f"{dense_fast.rate_per_s.max():g}",
        "vllm_fast_errors": " and ".join(f"{e:+.0%}" for e in sorted(dense_fast.e2e_mean_error)),
        "mixtral_answered": mixtral.answered_measured,
        "mixtral_e2e": mixtral.e2e_mean_error,
        "mixtral_pool_gib": f"{float(nearest.kv_cache_gib):g}",
        "mixtral_pool_share": nearest.kv_cache_tokens / sized.kv_cache_tokens,
        "mixtral_pool_answered": nearest.answered_predicted,
        "reasoning_e2e": reasoning.e2e_mean_error,
        "reasoning_ttft": reasoning.ttft_p50_error,
        "dense_past_points": _points(math.ceil(max(abs(past_dense.answered_error_points)))),
        "dense_past_ttft": ", ".join(f"{e:+.0%}" for e in past_dense.ttft_p50_error),
        "dense_past_runs": ", ".join(past_dense.run),
    }


# --- measured on an H200 -----------------------------------------------------------------


def h200_values() -> dict:
    from kvsim.cost.accuracy import against_prediction, report
    from kvsim.cost.fit import GEMM_OPS, LINEAR_OPS, PER_STEP_OPS
    from kvsim.cost.generalize import fits_for, predict_linear
    from kvsim.cost.profiles import load_profile
    from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS

    log = (H200 / "run.log").read_text() + (H200 / "run-70b.log").read_text()
    driver = log.splitlines()[1].split(", ")
    seconds = [int(s) for s in re.findall(r"^[\w.-]+: (\d+) s$", log, flags=re.M)]
    meta = _json(H200 / "llama-3-8b" / "meta.json")
    v = {
        "h200_driver": driver[2],
        "h200_torch": meta["tools"]["torch"].split("+")[0],
        "h200_cuda": meta["tools"]["cuda"],
        "h200_seconds": _range(seconds, "d"),
    }
    cells = {k: [] for k in ("linear", "attention", "steps", "launched", "ops", "bands", "elementwise")}
    bands_all, norms = [], ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act")
    tokens_in_band = ((1, 128), (129, 1024), (1025, 16384))
    for name in H200_MODELS:
        prof = load_profile(str(H200 / name))
        rep = report(prof)
        mape = rep["mape"]
        cells["linear"].append(_pct_range([mape[op] for op in LINEAR_OPS if op in mape]) + " per op")
        cells["attention"].append(
            " / ".join(
                f"{100 * mape[k]:.1f}"
                for k in ("attn_prefill_whole_prompt", "attn_prefill_chunk_on_cache", "attn_decode")
            )
            + "%"
        )
        if "end_to_end" in rep:
            steps = rep["end_to_end"]["steps"]
            errs = [s["error"] for s in steps]
            cells["steps"].append(f"MAPE {rep['end_to_end']['mape']:.1%}, {min(errs):+.1%} to {max(errs):+.1%}")
            ratio = [s["launched_ms"] / s["measured_ms"] for s in steps if "launched_ms" in s]
            cells["launched"].append(_range(ratio, ".1f") + "x the kernels' time")
            if name == "llama-3-8b":
                kinds = [("+" in s["step"], s["step"].split()[0]) for s in steps]
                steps_label = (
                    f"{kinds.count((False, 'prefill'))} prompts, {kinds.count((False, 'decode'))} decode batches, "
                    f"{sum(mixed for mixed, _ in kinds)} mixed"
                )
                step = next(s for s in steps if s["step"].startswith("decode 1 x"))
                v |= {"h200_tps": _range(prof.linear.tp, "d"), "h200_tokens": prof.linear.num_tokens.nunique()}
                layers = prof.meta["model"]["num_layers"]
                v |= {
                    "eager_kernels": step["measured_ms"],
                    "eager_launched": step["launched_ms"],
                    "eager_layers": layers,
                }
        else:
            weights = MODEL_PRESETS[name].weight_bytes() / 2**30
            cells["steps"].append(f"not timed: {weights:.0f} GiB of weights")
            cells["launched"].append("")
        vs = against_prediction(prof)["ops"]
        cells["ops"].append(" / ".join(f"{100 * vs[op]['median']:+.1f}" for op in GEMM_OPS) + "%")
        cells["elementwise"].append(
            f"{100 * max(vs[op]['median'] for op in norms):.0f} to {100 * min(vs[op]['median'] for op in norms):.0f}%"
        )
        shape, measured = prof.meta["model"], prof.linear
        fits = fits_for(GPU_PRESETS["h200"])
        predicted = predict_linear(fits, shape, sorted(set(measured.tp)), sorted(set(measured.num_tokens)))
        both = measured.merge(predicted, on=["tp", "num_tokens"], suffixes=("", "_p"))

        def gemms(suffix: str):
            return sum(both[op + suffix] * (1 if op in PER_STEP_OPS else shape["num_layers"]) for op in GEMM_OPS)

        err = gemms("_p") / gemms("") - 1
        bands = [float(np.median(err[(both.num_tokens >= lo) & (both.num_tokens <= hi)])) for lo, hi in tokens_in_band]
        bands_all.append(bands)
        cells["bands"].append(" / ".join(f"{100 * b:+.1f}" for b in bands) + "%")
    table = [
        "| | " + " | ".join(_title(m) for m in H200_MODELS) + " |",
        "| --- |" + " --- |" * len(H200_MODELS),
        "| linear ops, even grid points predict odd ones | " + " | ".join(cells["linear"]) + " |",
        "| attention, 5-fold CV: whole prompts / chunks on a cache / decode | " + " | ".join(cells["attention"]) + " |",
        f"| whole forward steps (tp 1; {steps_label}): sum of parts against the step | "
        + " | ".join(cells["steps"])
        + " |",
        "| the same steps launched eagerly, not from a graph | " + " | ".join(cells["launched"]) + " |",
    ]
    rule = [
        "| op | " + " | ".join(_title(m) for m in H200_MODELS) + " |",
        "| --- |" + " --- |" * len(H200_MODELS),
        "| QKV / output / MLP up / MLP down projections, LM head (cuBLAS GEMMs) | " + " | ".join(cells["ops"]) + " |",
        "| the five GEMMs, summed as a step: 1-128 tokens / 129-1,024 / 1,025-16,384 | "
        + " | ".join(cells["bands"])
        + " |",
        "| norms, RoPE, activation (eager PyTorch) | " + " | ".join(cells["elementwise"]) + " |",
    ]
    small, middle, large = zip(*bands_all)
    host_ms = v["eager_launched"] - v["eager_kernels"]
    v |= {
        "h200_table": "\n".join(table),
        "h200_rule_table": "\n".join(rule),
        "h200_outside": max(abs(b) for b in (*small, *large)),
        "h200_middle": _pct_range([abs(b) for b in middle], 0),
        "h200_small": _pct_range([-b for b in small], 0),
        "h200_large": _pct_range(large, 0),
        "eager_host": host_ms,
        "eager_host_per_layer": host_ms / v["eager_layers"],
        "h200_gpu_tflops": GPU_PRESETS["h200"].bf16_tflops,
    }
    return v


def _title(name: str) -> str:
    return {"llama-3-8b": "Llama-3-8B", "llama-2-7b": "Llama-2-7B", "llama-3-70b": "Llama-3-70B"}[name]


def cpu_calibrate(runs: dict | None) -> str:
    """What `kvsim calibrate --device cpu --quick` gave on the machine that made the results file."""
    if not runs:
        return ""
    e2e = [r["mape"] for r in runs["runs"]]
    steps = [e for r in runs["runs"] for e in r["errors"]]
    return (
        f" On a {runs['cores']}-core CPU, {len(e2e)} `--quick` profiles of {runs['model']} (`kvsim calibrate --model "
        f"{runs['model']} --device cpu --quick --out DIR`, then `--report DIR`; `python scripts/docs_results.py "
        f"--only cpu_calibrate`) predicted their whole steps with a median MAPE of {np.median(e2e):.1%} "
        f"({_pct_range(e2e)}; single steps from {min(steps):+.0%} to {max(steps):+.0%})."
    )


def values() -> dict:
    sources = _json(SOURCES)
    return {
        **cost_values(),
        **profile_values(sources),
        **overhead_values(),
        **vllm_values(sources),
        "cpu_calibrate": cpu_calibrate(sources.get("cpu_calibrate")),
        **h200_values(),
        **{k: v for k, v in sources["overhead"].items()},
        "every_a100_configuration": every_configuration_table(),
        "example_rows": example_rows(),
    }


def page() -> str:
    return render(TEMPLATE.read_text(), values())


def main() -> None:
    PAGE.write_text(page())
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
