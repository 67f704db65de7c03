"""The README and the documentation site: the README stays short and its quick start
runs, the scenario reference names every key and preset, the quoted tables are what
kvsim computes today, nothing speaks of how the project was developed, and the site
builds with `mkdocs build --strict` (where the docs extra is installed)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pandas as pd
import pytest
import yaml
from pydantic import BaseModel

from helpers import kvsim
from kvsim.config import scenario as schema
from kvsim.model.specs import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# words for a project's own history, which users cannot place
HISTORY = re.compile(
    r"\bissues? \d+|\bsession \d|\bthe seeds'|\bseed [12]\b|shared/seeds|shared/guide|FACTS\.md|"
    r"\.\./shared|"
    r"\bnow fixed\b|\bas before\b|\bno longer\b",
    re.IGNORECASE,
)


def pages() -> list[Path]:
    """README and the hand-written pages (docs/generated/ holds what kvsim prints)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "generated" not in p.parts)]


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize(
    "page", pages() + sorted((DOCS / "generated").glob("*.md")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_page_speaks_of_the_project_s_history(page):
    found = [m.group() for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.name}: {found}"


# files outside the repository that a user does not have
ELSEWHERE = re.compile(r"\bthe seeds'|\bseed [12]\b|shared/seeds|shared/guide|FACTS\.md", re.IGNORECASE)
# the project's own tracker and work (another project's "issue #N" is a public source)
OWN_HISTORY = re.compile(r"\bissues? \d+|\bsession \d", re.IGNORECASE)


def sources() -> list[Path]:
    return [
        f
        for d in ("kvsim", "scenarios", "notebooks", "scripts", "benchmarks", "tests")
        for f in sorted((ROOT / d).rglob("*"))
        if f.suffix in {".py", ".yaml", ".ipynb", ".md", ".sh"} and f.name != "test_docs.py"
    ]


def test_no_source_cites_a_file_users_do_not_have():
    """Help texts, claim sources and scenario comments name public sources, not the files
    they were read from."""
    found = [
        f"{f.relative_to(ROOT)}: {m.group()}"
        for f in sources()
        for m in ELSEWHERE.finditer(f.read_text(errors="replace"))
    ]
    assert not found, found


def test_no_source_speaks_of_the_project_s_history():
    found = [
        f"{f.relative_to(ROOT)}: {m.group()}"
        for f in sources()
        for m in OWN_HISTORY.finditer(f.read_text(errors="replace"))
    ]
    assert not found, found


def quick_start() -> list[str]:
    text = README.read_text()
    block = text.split("<!-- quick start", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_quick_start_runs_on_a_small_scenario(tmp_path, monkeypatch):
    commands = quick_start()
    assert commands[0].startswith("pip install") and len(commands) >= 2
    doc = yaml.safe_load((ROOT / "scenarios" / "rag_8k.yaml").read_text())
    doc["workload"]["num_requests"] = 60
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "rag_8k.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    for command in commands[1:]:
        words = shlex.split(command)
        assert words[0] == "kvsim", command
        code, out, err = kvsim(*words[1:])
        assert code == 0, (command, err)
    assert (tmp_path / "results" / "rag_8k" / "summary.csv").is_file()
    assert (tmp_path / "results" / "compare" / "report.html").is_file()


def schema_fields() -> set[str]:
    """Every key a scenario may hold, from the models reachable from Scenario."""
    seen, fields, todo = set(), set(), [schema.Scenario]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            fields.add(field.alias or name)
            todo += [t for t in _types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return fields


def _types(annotation) -> list:
    """The annotation and every type inside it (unions, Annotated, lists)."""
    return [annotation, *(t for arg in typing.get_args(annotation) for t in _types(arg))]


def test_the_scenario_reference_names_every_key_and_preset():
    text = (DOCS / "scenarios.md").read_text()
    fences = re.findall(r"```.*?```", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", " ", text, flags=re.S))
    named = {word for span in fences + spans for word in re.findall(r"\w+", span)}
    missing = sorted(f for f in schema_fields() if f not in named)
    assert not missing, f"docs/scenarios.md does not describe: {missing}"
    presets = sorted(p for p in MODEL_PRESETS if f"`{p}`" not in text)
    assert not presets, f"docs/scenarios.md does not list the presets {presets}"


def test_every_quoted_table_names_the_script_that_writes_it():
    snippets = {m for page in pages() for m in re.findall(r'--8<-- "(docs/generated/[^"]+)"', page.read_text())}
    assert snippets
    for name in snippets:
        script = re.match(r"<!-- generated by `python (scripts/\w+\.py)", (ROOT / name).read_text())
        assert script and (ROOT / script[1]).is_file(), name


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables():
    return script("docs_tables")


def test_the_flagship_s_table_is_what_kvsim_computes_today(tables, flagship_run):
    """If this fails, a change moved results: run `python scripts/docs_tables.py`. The
    table is rendered from the summary.csv of the suite's one `kvsim run` of rag_8k
    (the script's own run gives the same numbers: runs are deterministic, and the CSV
    keeps every digit)."""
    code, _, err, out = flagship_run
    assert code == 0, err
    summary = pd.read_csv(out / "summary.csv")
    assert tables.summary_table("rag_8k", summary) == (DOCS / "generated" / "scenario_rag_8k.md").read_text()


def test_the_overhead_s_error_table_is_the_shipped_file_s(tables):
    """If this fails, the shipped overhead was refitted: run
    `python scripts/docs_tables.py --only overhead_accuracy`."""
    assert tables.overhead_accuracy_table() == (DOCS / "generated" / "overhead_accuracy.md").read_text()


def test_every_serving_step_quoted_is_the_shipped_overhead_s_point():
    """docs/step-costs.md's table of every A100 configuration (printed by
    scripts/derive_overheads.py, which needs the source data) quotes the points the
    shipped overhead keeps: measured, kernel, fitted and held-out ms agree within the
    rounding of each (0.1 ms on the page, 4 significant digits in the file)."""
    import json

    page = (DOCS / "step-costs.md").read_text()
    table = page.split("<details><summary>Every A100 configuration", 1)[1].split("</details>", 1)[0]
    cell = re.compile(r"([\d,.]+) / ([\d,.]+) \(([\d,.]+) \+ [\d,.]+ \+ [\d,.]+\) / ([\d,.]+)( \(excluded\))?$")
    quoted = {}
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        m = re.fullmatch(r"(\d+) x (\d+), (\d+)", parts[2]) if len(parts) == 5 else None
        if m:
            for phase, text in (("prefill", parts[3]), ("decode", parts[4])):
                got = cell.fullmatch(text)
                assert got, text
                quoted[(parts[0], int(parts[1]), *map(int, m.groups()), phase)] = got.groups()
    points = json.loads((ROOT / "kvsim" / "data" / "overheads" / "splitwise-a100-v2.json").read_text())["points"]
    assert len(quoted) == len(points)
    for p in points:
        q = quoted[(p["model"], p["tp"], p["prompt"], p["batch"], p["tokens"], p["phase"])]
        for text, key in zip(q[:4], ("measured_ms", "fitted_ms", "kernel_ms", "held_out_ms")):
            assert abs(float(text.replace(",", "")) - p[key]) <= 0.05 + 5e-4 * abs(p[key]), (p, key, text)
        assert bool(q[4]) == bool(p.get("excluded")), p


def test_the_kv_tiers_table_is_the_results_file_s(tables):
    """docs/kv-tiers.md quotes the Mooncake runs rendered from results/docs/mooncake_tiers.csv
    (measured by `python scripts/docs_results.py --data DIR --only tiers`, which needs the
    trace); if this fails, run `python scripts/docs_tables.py --only kv_tiers`."""
    assert tables.kv_tiers_table() == (DOCS / "generated" / "kv_tiers_mooncake.md").read_text()
    assert '--8<-- "docs/generated/kv_tiers_mooncake.md"' in (DOCS / "kv-tiers.md").read_text()


def test_the_kv_pool_table_is_the_results_file_s(tables):
    """docs/accuracy-vllm-h100.md quotes the runs past their capacity under other KV pools,
    rendered from results/docs/vllm_kv_pool.csv (measured by `python scripts/docs_results.py
    --data DIR --only pool`, which needs the runs); if this fails, run `python
    scripts/docs_tables.py --only kv_pool`."""
    assert tables.kv_pool_table() == (DOCS / "generated" / "vllm_kv_pool.md").read_text()
    assert '--8<-- "docs/generated/vllm_kv_pool.md"' in (DOCS / "accuracy-vllm-h100.md").read_text()


def test_the_per_seq_table_is_the_results_file_s(tables):
    """docs/accuracy-vllm-h100.md quotes every run with and without the overhead's
    per-sequence term, rendered from results/docs/vllm_per_seq.csv (measured by `python
    scripts/docs_results.py --data DIR --only per_seq`, which needs the runs); if this
    fails, run `python scripts/docs_tables.py --only per_seq`."""
    assert tables.per_seq_table() == (DOCS / "generated" / "vllm_per_seq.md").read_text()
    assert '--8<-- "docs/generated/vllm_per_seq.md"' in (DOCS / "accuracy-vllm-h100.md").read_text()


def test_the_step_costs_page_is_rendered_from_what_kvsim_ships():
    """Every figure on docs/step-costs.md comes from the shipped profiles and overheads,
    `kvsim cost`, the H200 profiles in tests/data or results/docs/step_costs_sources.json;
    if this fails, something they hold changed: run `python scripts/step_costs_page.py`
    (and edit docs/templates/step-costs.md, not the page)."""
    assert script("step_costs_page").page() == (DOCS / "step-costs.md").read_text()


SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.mark.skipif(
    not all((SHARED_DATA / d).is_dir() for d in ("profiling", "serving", "vllm-h100")),
    reason="the reference data (../shared/data) is not beside the checkout",
)
def test_the_step_costs_sources_are_what_the_data_give():
    """results/docs/step_costs_sources.json is what `python scripts/docs_results.py --only
    sources` measures from the data today."""
    import json

    measured = json.loads(json.dumps(script("docs_results").sources(SHARED_DATA)))
    saved = json.loads((ROOT / "results" / "docs" / "step_costs_sources.json").read_text())
    assert {k: saved.get(k) for k in measured} == measured


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_flag_tables_are_the_parser_s_own(tables, engine):
    """The reference's flag tables are rendered from the table vllm_args and sglang_args are
    parsed with, name every flag of the release once, and are current (else: run
    `python scripts/docs_tables.py --only flags_vllm flags_sglang`)."""
    from kvsim.config import engine_flags

    page = (DOCS / "generated" / f"engine_flags_{engine}.md").read_text()
    assert tables.engine_flags_table(engine) == page
    assert f'--8<-- "docs/generated/engine_flags_{engine}.md"' in (DOCS / "scenarios.md").read_text()
    named = re.findall(r"`(--[\w-]+)`", page)
    expected = set(engine_flags.known(engine)) | set(engine_flags.TABLES[engine])
    assert set(named) >= expected
    assert all(named.count(name) == 1 for name in expected)


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings) is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "tutorial" / "index.html").is_file()


def test_the_vllm_accuracy_page_and_its_quotes_are_the_shipped_overhead_s():
    """docs/accuracy-vllm-h100.md is what scripts/derive_vllm_overhead.py writes from the
    shipped vllm-v1-h100-v1.json (refitting needs the runs), and the README, Step costs
    and Sources quote its held-out figures. If this fails, the overhead was refitted:
    rerun the script, then put its figures into those pages."""
    import json

    shipped = json.loads((ROOT / "kvsim" / "data" / "overheads" / "vllm-v1-h100-v1.json").read_text())
    spec = importlib.util.spec_from_file_location("derive_vllm", ROOT / "scripts" / "derive_vllm_overhead.py")
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    assert derive.markdown(shipped) == (DOCS / "accuracy-vllm-h100.md").read_text()
    held = shipped["error"]["leave_one_out"]
    mae, ttft = f"{held['e2e_mean_mae']:.1%}", f"{held['ttft_p50_median_error']:.1%}"
    quotes = {
        README: f"E2E mean within {mae} on average, TTFT p50 within {ttft} at the median",
        DOCS / "step-costs.md": f"E2E mean within {mae} on average",
        DOCS / "sources.md": f"E2E means are within {mae} on average, {held['e2e_mean_worst']:.0%} at worst",
    }
    for page, quote in quotes.items():
        assert quote in " ".join(page.read_text().split()), page.name
