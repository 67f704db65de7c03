"""benchmarks/TIERS_RESULTS.md (written by `python benchmarks/bench_tiers.py --write`)
and the table docs/kv-tiers.md quotes from it agree; if this fails, rerun the benchmark
or `python scripts/tiers_speed_page.py`."""

import importlib.util
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load(ROOT / "benchmarks" / "bench_tiers.py")
page_script = load(ROOT / "scripts" / "tiers_speed_page.py")


def test_the_results_file_is_what_its_runs_give():
    """Each median is its runs' median, each ratio that of the medians; the visible
    table is the one the runs render to."""
    data = bench.read_results()
    assert len(data["rows"]) == len(bench.CASES)
    for row in data["rows"]:
        assert len(row["plain_runs"]) == len(row["tiered_runs"]) == data["repeats"]
        assert row["plain_s"] == statistics.median(row["plain_runs"])
        assert row["tiered_s"] == statistics.median(row["tiered_runs"])
        assert row["ratio"] == row["tiered_s"] / row["plain_s"]
    assert bench.RESULTS.read_text() == bench.results_text(data)


def test_the_kv_tiers_page_quotes_the_results_file():
    page = (ROOT / "docs" / "kv-tiers.md").read_text()
    assert '--8<-- "docs/generated/kv_tiers_speed.md"' in page
    assert page_script.page() == page_script.FRAGMENT.read_text()
    # no ratio kept by hand beside it (the target, 1.5x, is the only figure with an x)
    assert re.findall(r"\b\d+\.\d+x\b", page) == ["1.5x"]


def test_the_fragment_says_what_the_runs_say():
    data = {
        "command": "c",
        "started": "2026-01-01 00:00",
        "load_before": 1.0,
        "load_after": 2.0,
        "cpus": 2,
        "repeats": 1,
        "num_requests": 10,
        "rows": [
            {"case": "a", "plain_s": 2.0, "tiered_s": 2.5, "ratio": 1.25, "plain_runs": [2.0], "tiered_runs": [2.5]},
            {"case": "b", "plain_s": 1.0, "tiered_s": 1.6, "ratio": 1.6, "plain_runs": [1.0], "tiered_runs": [1.6]},
        ],
    }
    text = page_script.fragment(data, 1.5)
    assert "| a | 2.00 | 2.50 | 1.25x |" in text and "| b | 1.00 | 1.60 | 1.60x |" in text
    assert text.rstrip().endswith("Largest ratio 1.60x: over the target of 1.5x.")
    assert "Largest ratio 1.60x: over the target of 1.5x." in bench.results_text(data)
