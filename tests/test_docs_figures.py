"""Every figure a hand-written page quotes comes from somewhere that a test reads: the
shipped scenario it describes, the shipped file it summarizes, the flagship run, the
code's own constants, or the reference data where it is beside the checkout. The tables
the pages include are rendered by scripts (tests/test_docs.py checks those); this checks
the figures in the prose around them, and that results/docs/mooncake_tiers.csv is what
scripts/docs_results.py measures."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCENARIOS = ROOT / "scenarios"
SHARED_DATA = ROOT.parent / "shared" / "data"
TRACE = SHARED_DATA / "traces" / "mooncake_synthetic_trace.jsonl"
needs_trace = pytest.mark.skipif(
    not TRACE.is_file(), reason="Mooncake's trace (../shared/data) is not beside the checkout"
)


def text(page: str) -> str:
    """A page with its line breaks as spaces (the prose wraps anywhere)."""
    return " ".join((ROOT / page).read_text().split())


def scenario(name: str) -> dict:
    return yaml.safe_load((SCENARIOS / name).read_text())


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _n(x: float) -> str:
    return f"{x:,.0f}"


# --- the shipped scenarios the pages describe -------------------------------------------
def test_the_flagship_is_described_as_its_file_sets_it():
    rag = scenario("rag_8k.yaml")
    w, slo = rag["workload"], rag["slo"]
    readme = text("README.md")
    assert (
        f"a shared {w['rag']['system_tokens']}-token system prompt, five retrieved "
        f"{_n(w['rag']['doc_tokens'])}-token documents" in readme
    )
    assert w["rag"]["docs_per_request"] == 5
    assert f"{w['arrival']['rate_per_s']:g} requests per second" in readme
    assert f"latency targets TTFT p99 {slo['ttft_p99_s']:g} s and TPOT p50 {slo['tpot_p50_s']:g} s" in readme
    assert (
        f"{['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight'][len(rag['policies']) - 1]} policies"
        in readme
    )
    results = text("docs/results.md")
    assert (
        f"a {w['rag']['system_tokens']}-token system prompt, five retrieved {_n(w['rag']['doc_tokens'])}-token "
        f"documents (from a corpus of {_n(w['rag']['corpus_docs'])} with Zipf popularity)" in results
    )
    assert w["rag"]["popularity"] == "zipf"
    assert f"TTFT p99 under {slo['ttft_p99_s']:g} s and TPOT p50 under {slo['tpot_p50_s']:g} s" in results
    over = scenario("rag_8k_overload.yaml")
    assert f"The same workload at {over['workload']['arrival']['rate_per_s']:g} requests per second" in results
    sweeps = text("docs/sweeps.md")
    assert f"On `rag_8k`, {_n(w['num_requests'])} requests per probe" in sweeps
    assert (
        f"({w['rag']['system_tokens']} system tokens, five of {_n(w['rag']['corpus_docs'])} Zipf-popular documents"
        in sweeps
    )
    grid = yaml.safe_load((SCENARIOS / "sweeps" / "rag_8k_grid.yaml").read_text())
    points = math.prod(len(v) for v in grid["grid"].values())
    assert f"three policies, {points} points x {len(grid['seeds'])} seeds of {_n(w['num_requests'])} requests" in sweeps
    assert len(grid["set"]["policies"]) == 3
    assert f"`--quick` runs {grid['quick']['set']['workload.num_requests']} requests and two seeds" in sweeps
    assert len(grid["quick"]["seeds"]) == 2


def test_the_other_scenarios_are_described_as_their_files_set_them():
    results = text("docs/results.md")
    opt = scenario("vllm_paper_opt13b.yaml")
    assert opt["kv_cache_memory_gib"] == 12 and opt["gpu"] == "a100-40gb"
    assert "(OPT-13B, A100-40GB, 12 GiB of KV, ShareGPT-shaped lengths capped at 2,048" in results
    assert opt["max_model_len"] == 2048
    shared = scenario("shared_system_prompt.yaml")
    assert shared["workload"]["prefix"]["groups"] == 1 and shared["gpu"] == "h100-80gb"
    assert f"(a {_n(shared['workload']['prefix']['tokens'])}-token shared prefix, H100, V1)" in results
    beam = scenario("sampling_beam.yaml")
    assert "`sampling_beam` (four beams, OPT-13B, A100-40GB, V0)" in results
    assert (beam["workload"]["beam_width"], beam["model"], beam["gpu"], beam["engine"]) == (
        4,
        "opt-13b",
        "a100-40gb",
        "vllm-v0",
    )
    fleet = scenario("fleet_fewshot.yaml")
    w = fleet["workload"]
    sweeps = text("docs/sweeps.md")
    assert (
        f"four Llama-3-8B engines on one H100 each, {w['prefix']['groups']} few-shot templates of "
        f"{_n(w['prefix']['tokens'])} tokens" in sweeps
    )
    assert fleet["replicas"] == 4
    per_template = w["num_requests"] / w["prefix"]["groups"]
    assert (
        f"({_n(w['num_requests'])} requests on {w['prefix']['groups']} templates: about "
        f"{per_template:.0f} requests per template, {per_template / fleet['replicas']:.0f} per replica)" in sweeps
    )


def test_the_tutorial_s_command_and_snippets_are_its_scenario():
    tutorial = (DOCS / "tutorial.md").read_text()
    scn = scenario("tutorial_vllm_serve.yaml")
    command = " ".join(tutorial.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ").split())
    flags = dict(re.findall(r"(--[\w-]+) (\S+)", command))
    assert float(flags["--gpu-memory-utilization"]) == scn["gpu_memory_utilization"]
    assert int(flags["--max-model-len"]) == scn["max_model_len"]
    assert int(flags["--max-num-seqs"]) == scn["scheduler"]["max_num_seqs"]
    assert int(flags["--max-num-batched-tokens"]) == scn["scheduler"]["max_num_batched_tokens"]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", tutorial, flags=re.S)]
    assert blocks[0] == {"workload": scn["workload"], "slo": scn["slo"]}
    assert blocks[1] == {"policies": scn["policies"]}
    prose = " ".join(tutorial.split())
    w, slo = scn["workload"], scn["slo"]
    assert f"documents of about {_n(w['rag']['doc_tokens'])} tokens" in prose
    assert f"about {w['arrival']['rate_per_s']:g} requests per second" in prose
    assert f"within {slo['ttft_p99_s']:g} s for 99 requests in 100" in prose
    assert f"at least {1 / slo['tpot_p50_s']:g} tokens per second" in prose


# --- the flagship's narrative against its run -------------------------------------------
def test_what_the_results_page_says_of_the_flagship_holds(flagship_run):
    """docs/results.md's paragraph under the rag_8k table, claim by claim, against the
    suite's run of it (the table itself: tests/test_docs.py)."""
    from kvsim.analysis.slo import misses

    code, _, err, out = flagship_run
    assert code == 0, err
    rows = pd.read_csv(out / "summary.csv").set_index("policy")
    targets = scenario("rag_8k.yaml")["slo"]
    met = {p for p, r in rows.iterrows() if not misses(r, targets)}
    # only the policy that cuts prefill work keeps TTFT p99 under its target
    assert met == {"paged-16-prefix"}, met
    # FP8 holds twice the requests and cuts the others' TTFT p99 by more than half, but misses
    fp8, paged = rows.loc["paged-16-fp8"], rows.loc["paged-16"]
    assert fp8.memory_capacity_requests / paged.memory_capacity_requests == pytest.approx(2, rel=0.02)
    others = rows.drop(index=["paged-16-fp8", "paged-16-prefix"]).ttft_p99_s
    assert (fp8.ttft_p99_s < 0.5 * others).all() and fp8.ttft_p99_s > targets["ttft_p99_s"]
    # paging fills the pool where max reservation cannot; the page quotes the latter's share
    page = text("docs/results.md")
    assert f"against max reservation's {rows.loc['contiguous'].kv_utilization:.0%})" in page
    assert paged.kv_utilization > 0.95 > rows.loc["contiguous"].kv_utilization
    # the larger batch shortens the tail a little, not under the target; the token budget
    # limits as much of the busy time as memory; V1's preemptions happen
    assert targets["ttft_p99_s"] < paged.ttft_p99_s < rows.loc["contiguous"].ttft_p99_s
    assert paged.limited_by_token_budget == pytest.approx(paged.limited_by_memory, abs=0.05)
    assert paged.preemptions > 0
    # Pow2 equals Max: the mean request rounds up to the whole context in the buddy allocator
    pow2, max_ = rows.loc["contiguous-pow2"], rows.loc["contiguous"]
    assert pow2.ttft_p99_s == max_.ttft_p99_s and pow2.external_fraction > max_.external_fraction
    w, rag = scenario("rag_8k.yaml")["workload"], scenario("rag_8k.yaml")["workload"]["rag"]
    mean = rag["system_tokens"] + rag["docs_per_request"] * rag["doc_tokens"] + w["prompt_tokens"]["mean"]
    mean += w["output_tokens"]["mean"]
    region = 1 << math.ceil(math.log2(mean))
    assert region == scenario("rag_8k.yaml")["max_model_len"]
    assert f"a region of about {round(mean, -3):,.0f} tokens rounds up to {region:,}" in page


# --- figures taken from shipped files and code -------------------------------------------
def test_the_limits_quote_the_shipped_overheads():
    """docs/sources.md's step-cost limits: the A100 overhead's held-out misses over 25%, its
    usable points and where its large-step bandwidth starts; the vLLM H100 overhead's
    worst answered share (from its accuracy page, which renders the shipped file)."""
    a100 = json.loads((ROOT / "kvsim" / "data" / "overheads" / "splitwise-a100-v2.json").read_text())
    usable = [p for p in a100["points"] if not p.get("excluded")]
    off = [p for p in usable if abs(p["held_out_ms"] - p["measured_ms"]) > 0.25 * p["measured_ms"]]
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    page = text("docs/sources.md")
    assert f"within 25% at all but {words.get(len(off), len(off))} of {len(usable)} measured A100 steps" in page
    assert f"below {a100['comm']['large_step_tokens']:,}-token steps" in page
    accuracy = (DOCS / "accuracy-vllm-h100.md").read_text()
    shares = [tuple(map(float, m)) for m in re.findall(r"\| ([\d.]+)% / ([\d.]+)% \|$", accuracy, flags=re.M)]
    measured, predicted = max(shares, key=lambda s: abs(s[1] - s[0]))
    assert predicted == 100.0
    assert f"predicted to answer all its requests where {measured:.0f}% were answered" in page


def test_the_performance_page_quotes_the_code_s_constants():
    from kvsim.plots.run_figures import MAX_CDF_POINTS
    from kvsim.sim.waiting import KEEP

    page = text("docs/performance.md")
    assert f"past its first {KEEP:,} requests" in page
    assert f"at most {MAX_CDF_POINTS:,} evenly spaced ranks" in page and f"1/{MAX_CDF_POINTS:,} of the axis" in page


# --- what the reference data give, where it is beside the checkout ------------------------
@needs_trace
def test_the_cache_curve_page_quotes_the_trace_as_it_is():
    from kvsim.analysis.block_refs import block_references
    from kvsim.workload.traces import trace_requests

    refs = block_references(trace_requests(TRACE), 16)
    page = text("docs/cache-curves.md")
    assert f"{refs.blocks / 1e6:.1f}M block references, {len(refs.item):,} item references" in page
    assert f"(Qin et al., FAST 2025: {refs.num_requests:,} requests)" in page


@needs_trace
def test_the_cache_curve_table_is_what_the_trace_gives():
    """If this fails: `python scripts/docs_tables.py --only cache_curve --trace PATH`."""
    tables = script("docs_tables")
    assert tables.cache_curve_table(TRACE) == (DOCS / "generated" / "cache_curve_mooncake.md").read_text()


TIERS = ROOT / "results" / "docs" / "mooncake_tiers.csv"


def test_the_kv_tiers_file_holds_the_runs_the_script_makes(tmp_path):
    """Its rows name the fleets and policies scripts/docs_results.py runs, in its order
    (a policy added to a scenario, or a fleet to the script, shows here without the data)."""
    results = script("docs_results")
    stand_in = tmp_path / "trace.jsonl"
    stand_in.write_text("")
    planned = []
    for name, fleet in results.FLEETS:
        scn, _ = results.fleet_scenario(name, stand_in, **fleet)
        planned += [results.fleet_key(name, scn, p) for p in scn.policies]
    saved = pd.read_csv(TIERS)
    fleets = saved[saved.tier != "unlimited"].drop(columns=["prefix_hit_rate", "prefix_hit_rate_gpu"])
    assert fleets.fillna("").to_dict(orient="records") == planned
    assert list(saved.tier).count("unlimited") == 1 and saved.tier.iloc[-1] == "unlimited"


@needs_trace
def test_the_kv_tiers_unlimited_row_is_what_the_trace_gives():
    results = script("docs_results")
    row = pd.DataFrame([results.unlimited_row(TRACE)])
    assert results.csv_text(row).splitlines()[1] == TIERS.read_text().splitlines()[-1]


@needs_trace
def test_one_kv_tiers_fleet_is_what_the_trace_gives():
    """The prefix-aware fleet's GPU-only policy rerun alone on the whole trace (a policy's
    run is its own, so alone it gives its row in the file): the cheap check of the file
    that a change to the simulation or the step costs moves. The whole file:
    test_the_whole_kv_tiers_file_is_what_the_data_give."""
    results = script("docs_results")
    name, fleet = results.FLEETS[2]
    scn, _ = results.fleet_scenario(name, TRACE, **fleet)
    policy = next(p for p in scn.policies if p.tiers is None)
    row = results._fleet_run(name, TRACE, **fleet, policies=[policy.model_dump(mode="json", exclude_none=True)])
    key = results.fleet_key(name, scn, policy)
    saved = TIERS.read_text().splitlines()
    mine = next(line for line in saved if line.startswith(",".join(_csv(v) for v in key.values()) + ","))
    assert results.csv_text(row).splitlines()[1] == mine, (
        "results/docs/mooncake_tiers.csv is not what the data give today: rerun "
        "`python scripts/docs_results.py --data DIR --only tiers` and `python scripts/docs_tables.py --only kv_tiers`"
    )


def _csv(value) -> str:
    """A key value as the tiers file writes it (float_format %.6g)."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


@pytest.mark.slow
@needs_trace
@pytest.mark.skipif(
    os.environ.get("KVSIM_DOCS_RESULTS") != "1",
    reason="the whole tiers rerun takes 5-10 minutes on two cores: set KVSIM_DOCS_RESULTS=1",
)
def test_the_whole_kv_tiers_file_is_what_the_data_give():
    results = script("docs_results")
    assert results.csv_text(results.tiers(SHARED_DATA)) == TIERS.read_text()


POOL = ROOT / "results" / "docs" / "vllm_kv_pool.csv"
VLLM_RUNS = SHARED_DATA / "vllm-h100"


def test_the_kv_pool_file_holds_the_runs_the_script_makes():
    """Its rows are the runs and pools scripts/docs_results.py replays, in its order."""
    results = script("docs_results")
    saved = pd.read_csv(POOL, dtype={"kv_cache_gib": str})
    replayed = list(dict.fromkeys(zip(saved.run, saved.kv_cache_gib)))
    planned = [
        (run, "vllm" if gib is None else f"{gib:g}") for run, pools in results.POOL_RUNS.items() for gib in pools
    ]
    assert [(run, gib if gib == "vllm" else f"{float(gib):g}") for run, gib in replayed] == planned


@pytest.mark.skipif(not VLLM_RUNS.is_dir(), reason="the vLLM H100 runs (../shared/data) are not beside the checkout")
def test_the_mixtral_run_under_a_smaller_kv_pool_is_what_the_data_give(monkeypatch):
    """The run the accuracy page explains replayed under its smallest and its own pool (a
    few seconds each): the cheap check of the pool file that a change to the simulation or
    the step costs moves; the whole file: `python scripts/docs_results.py --only pool`."""
    results = script("docs_results")
    name = "mixtral-8x7b-v0-1-tp2-reasoning"
    pools = results.POOL_RUNS[name]
    monkeypatch.setattr(results, "POOL_RUNS", {name: (pools[0], pools[-1])})
    assert_rows_saved(results.csv_text(results.pool(SHARED_DATA)), POOL, "pool", "kv_pool")


def assert_rows_saved(text: str, path: Path, part: str, table: str) -> None:
    """Every row of a replay's CSV `text` is in the results file `path` (same header)."""
    rows, saved = text.splitlines(), path.read_text().splitlines()
    assert rows[0] == saved[0]
    for row in rows[1:]:
        assert row in saved, (
            f"{path.relative_to(ROOT)} is not what the data give today: rerun "
            f"`python scripts/docs_results.py --data DIR --only {part}` and `python scripts/docs_tables.py --only {table}`"
        )


PER_SEQ = ROOT / "results" / "docs" / "vllm_per_seq.csv"


def test_the_per_seq_file_holds_each_run_with_the_shipped_term_and_without_it():
    """Every run twice, stage by stage: under the shipped overhead's per-sequence term,
    then at zero (scripts/docs_results.py's order)."""
    from kvsim.calibrate.runs import run_dirs
    from kvsim.cost.overhead import VLLM_V1_H100, load_overhead

    saved = pd.read_csv(PER_SEQ)
    us = round(load_overhead(VLLM_V1_H100).per_seq_s * 1e6, 3)
    for run, rows in saved.groupby("run", sort=False):
        stages = len(rows) // 2
        assert rows.per_seq_us.tolist() == [us] * stages + [0.0] * stages, run
        assert rows.stage.tolist() == list(range(stages)) * 2, run
    if VLLM_RUNS.is_dir():
        assert sorted(saved.run.unique()) == [p.name for p in run_dirs(VLLM_RUNS)]


@pytest.mark.skipif(not VLLM_RUNS.is_dir(), reason="the vLLM H100 runs (../shared/data) are not beside the checkout")
def test_a_run_with_and_without_the_per_seq_term_is_what_the_data_give():
    """One short run replayed both ways (a few seconds): the cheap check of the file that a
    change to the simulation or the step costs moves; the whole file: `python
    scripts/docs_results.py --only per_seq`."""
    results = script("docs_results")
    text = results.csv_text(results.per_seq(SHARED_DATA, ["llama-2-7b-tp1-codegen"]))
    assert_rows_saved(text, PER_SEQ, "per_seq", "per_seq")


RENDERED_ELSEWHERE = {
    "kv_tiers",
    "kv_pool",
    "per_seq",
    "overhead_accuracy",
    "flags_vllm",
    "flags_sglang",
    "rag_8k",
}  # tests/test_docs.py


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KVSIM_DOCS_RESULTS") != "1",
    reason="rerunning every scenario, sweep, capacity search and claim the pages show takes tens of minutes on "
    "two cores: set KVSIM_DOCS_RESULTS=1",
)
@pytest.mark.parametrize("part", sorted(set(script("docs_tables").PARTS) - RENDERED_ELSEWHERE))
def test_every_generated_table_is_what_kvsim_computes_today(part):
    """What `python scripts/docs_tables.py --only PART` would write is what docs/generated/
    holds (the tutorial's run, the flagship's table and the ones rendered from shipped
    files are checked on every run elsewhere)."""
    tables = script("docs_tables")
    if part == "cache_curve":
        if not TRACE.is_file():
            pytest.skip("Mooncake's trace is not beside the checkout")
        tables.TRACE = TRACE
    file, build = tables.PARTS[part]
    assert build() == (DOCS / "generated" / file).read_text(), f"run `python scripts/docs_tables.py --only {part}`"


def test_the_scenario_reference_gives_each_key_the_schema_s_default():
    """docs/scenarios.md's tables: a default written as a literal (a number, true/false,
    none, required, a `word`) is the schema's default for that key (a key whose schema
    default is None is filled when the scenario is read: engine, replicas, router, ...;
    its row names what fills it)."""
    import typing

    from pydantic import BaseModel

    from kvsim.config import scenario as schema

    def types(annotation) -> list:
        return [annotation, *(t for arg in typing.get_args(annotation) for t in types(arg))]

    defaults: dict[str, list] = {}
    seen, todo = set(), [schema.Scenario]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            value = "required" if field.is_required() else field.get_default(call_default_factory=True)
            defaults.setdefault(field.alias or name, []).append(value)
            todo += [t for t in types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]

    def literal(cell: str):
        if cell in ("required", "none", "true", "false"):
            return {"required": "required", "none": None, "true": True, "false": False}[cell]
        if re.fullmatch(r"[\d,]+(\.\d+)?", cell):
            return float(cell.replace(",", ""))
        word = re.fullmatch(r"`([\w.-]+)`", cell)
        return word[1] if word else ...

    checked, wrong = 0, []
    for key, cell in re.findall(r"^\| `(\w+)` \| ([^|]*?) \|", (DOCS / "scenarios.md").read_text(), flags=re.M):
        value = literal(cell.strip())
        if value is ... or key not in defaults or None in defaults[key] and value is not None:
            continue
        checked += 1
        if not any(d == value and type(d) is not bool or d is value for d in defaults[key]):
            wrong.append((key, cell, defaults[key]))
    assert checked > 50 and not wrong, wrong
