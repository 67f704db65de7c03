"""The HTML reports in a real browser: headless Chromium driven by Playwright.

Nothing overflows the page (at 1,280 px the tables fit by wrapping, the every-column
table scrolls in its own box; on narrower screens no table pushes the page sideways),
every image loads, the verdict comes first, and the text keeps its contrast in the
light and the dark colour scheme. Needs the `browser` extra (pip install
'kvsim[browser]') and a Chromium: Debian's at /usr/bin/chromium, or the one
KVSIM_CHROMIUM names. Skipped where either is missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import kvsim

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser extra (Playwright) is not installed")
CHROMIUM = os.environ.get("KVSIM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (set KVSIM_CHROMIUM)", allow_module_level=True)

# Flags for a sandboxed, offline machine: no network chatter, no first-run pages.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

LONG = "paged-16-prefix-caching-with-a-long-name"
SCENARIO = {
    "name": "browser",
    "seed": 2,
    "model": "llama-3-8b",
    "gpu": "h100-80gb",
    "max_model_len": 4096,
    "kv_cache_memory_gib": 1,
    "cost_model": "calibrated",
    "workload": {
        "num_requests": 60,
        "arrival": {"process": "poisson", "rate_per_s": 20.0},
        "prefix": {"groups": 4, "tokens": 400},
        "prompt_tokens": {"dist": "lognormal", "mean": 600, "cv": 0.5, "min": 16, "max": 3000},
        "output_tokens": {"dist": "lognormal", "mean": 100, "cv": 0.5, "min": 4, "max": 500},
    },
    "slo": {"ttft_p99_s": 2.0, "tpot_p50_s": 0.1},
    "policies": [
        {"name": "contiguous", "allocator": "contiguous", "reserve": "max"},
        {"name": "contiguous-oracle", "allocator": "contiguous", "reserve": "oracle"},
        {"name": "paged-16", "allocator": "paged", "block_size": 16},
        {"name": "paged-32", "allocator": "paged", "block_size": 32},
        {"name": "paged-16-fp8", "allocator": "paged", "block_size": 16, "kv_cache_dtype": "fp8"},
        {"name": LONG, "allocator": "paged", "block_size": 16, "enable_prefix_caching": True},
    ],
}

FACTS = """() => {
  const page = document.documentElement;
  const fits = el => el.scrollWidth <= el.clientWidth + 1;
  const boxes = Array.from(document.querySelectorAll('div.fit, div.scroll'));
  const luminance = css => {
    const [r, g, b] = css.match(/[\\d.]+/g).slice(0, 3).map(v => {
      v = v / 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const style = getComputedStyle(document.body);
  const [a, b] = [luminance(style.color), luminance(style.backgroundColor)];
  return {
    page: [page.scrollWidth, page.clientWidth],
    boxes: boxes.map(el => ({cls: el.className, fits: fits(el),
                             right: el.getBoundingClientRect().right})),
    body_right: document.body.getBoundingClientRect().right,
    images: Array.from(document.images).map(img => [img.alt, img.complete && img.naturalWidth > 0,
                                                   img.getBoundingClientRect().right]),
    order: Array.from(document.body.children).slice(0, 3).map(el => [el.tagName, el.className, el.textContent.slice(0, 40)]),
    contrast: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05),
  };
}"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    work = tmp_path_factory.mktemp("browser")
    (work / "s.yaml").write_text(yaml.safe_dump(SCENARIO))
    assert kvsim("run", work / "s.yaml", "--out", work / "run", "--quiet")[0] == 0
    assert kvsim("compare", work / "run", "--out", work / "cmp")[0] == 0
    assert kvsim("reproduce", "--quick", "--claim", "2", "--out", work / "claims")[0] == 0
    return {"compare": work / "cmp" / "report.html", "reproduce": work / "claims" / "report.html"}


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        try:
            chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        except Exception as e:  # a Chromium that does not start here: not the report's fault
            pytest.skip(f"Chromium did not start: {e}")
        yield chromium
        chromium.close()


def facts(browser, page_file: Path, width: int, scheme: str = "light") -> dict:
    page = browser.new_page(viewport={"width": width, "height": 900}, color_scheme=scheme)
    try:
        page.goto(page_file.as_uri())
        page.wait_for_load_state("load")
        return page.evaluate(FACTS)
    finally:
        page.close()


@pytest.mark.parametrize("which", ["compare", "reproduce"])
@pytest.mark.parametrize("width", [1280, 1024, 800])
def test_nothing_overflows_the_page_and_every_image_loads(reports, browser, which, width):
    got = facts(browser, reports[which], width)
    assert got["page"][0] <= got["page"][1], got["page"]  # no sideways scrolling
    assert got["images"], "the report shows figures"
    for alt, loaded, right in got["images"]:
        assert loaded, f"{alt} did not load"
        assert right <= got["body_right"] + 1, f"{alt} reaches past the page"
    for box in got["boxes"]:
        assert box["right"] <= got["body_right"] + 1, box
        if width >= 1280 and box["cls"] == "fit":
            assert box["fits"], "a table meant to wrap needs its scroll bar at 1,280 px"


def test_the_verdict_comes_first_and_the_wide_table_scrolls_in_its_box(reports, browser):
    got = facts(browser, reports["compare"], 1280)
    assert [tag for tag, _, _ in got["order"]] == ["H1", "H2", "UL"]
    assert got["order"][1][2] == "Verdict" and got["order"][2][1] == "verdict"
    assert got["order"][2][2].startswith("Pick ") or got["order"][2][2].startswith("No policy meets")
    wide = [b for b in got["boxes"] if b["cls"] == "scroll"]
    assert len(wide) == 1 and not wide[0]["fits"]  # 54 columns: its box scrolls, the page does not


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_keeps_its_contrast_in_either_colour_scheme(reports, browser, scheme):
    got = facts(browser, reports["compare"], 1280, scheme)
    assert got["contrast"] >= 7, got["contrast"]  # WCAG AAA for body text
