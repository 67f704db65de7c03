"""A self-contained HTML page: text, tables and PNGs embedded as data URIs.

The page opens from disk in any browser, with no server and no files beside it, and
holds no script. Everything shown is escaped; tables come from DataFrames. Nothing is
wider than the page: cells wrap (headings break after underscores, long words
anywhere), a table too wide to wrap sits in its own scroll box, and figures shrink to
the page's width (on a screen narrower than the page's 1,200 px, a table that cannot
wrap further scrolls in its box rather than the page sideways). Colours follow the reader's light or dark setting; the figures keep
the white ground they are drawn on.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import pandas as pd

CSS = """
:root { color-scheme: light dark; --fg: #1f2328; --muted: #59636e; --bg: #ffffff; --panel: #f6f8fa;
        --border: #d1d9e0; --accent: #0969da; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e6edf3; --muted: #9198a1; --bg: #0d1117; --panel: #161b22; --border: #3d444d;
          --accent: #4493f8; } }
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: var(--fg); background: var(--bg); line-height: 1.45; }
h1 { font-size: 1.6em; }
h2 { border-bottom: 1px solid var(--border); padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: .8em; margin: .6em 0; max-width: 100%; }
th, td { border: 1px solid var(--border); padding: .2em .35em; text-align: right; vertical-align: top; }
td { white-space: nowrap; }
th { background: var(--panel); font-weight: 600; }
td:first-child, th:first-child { text-align: left; }
td:first-child { white-space: normal; overflow-wrap: break-word; min-width: 7em; }
td.text { white-space: normal; overflow-wrap: anywhere; text-align: left; min-width: 12em; }
.fit, .scroll { overflow-x: auto; max-width: 100%; }
.scroll table { max-width: none; }
.scroll td, .scroll th { white-space: nowrap; }
img { display: block; max-width: 100%; height: auto; margin: .5em 0; background: #ffffff;
      border: 1px solid var(--border); border-radius: 4px; }
.context { color: var(--muted); font-size: .9em; }
.verdict { background: var(--panel); border-left: 4px solid var(--accent); padding: .6em 1em .6em 2em; }
.verdict li:first-child { font-weight: 600; }
pre { background: var(--panel); padding: .6em; font-size: .85em; white-space: pre-wrap;
      overflow-wrap: anywhere; }
"""


def esc(text) -> str:
    return html.escape(str(text))


def heading(text: str, level: int = 2) -> str:
    return f"<h{level}>{esc(text)}</h{level}>"


def paragraph(text: str, cls: str | None = None) -> str:
    klass = f' class="{cls}"' if cls else ""
    return f"<p{klass}>{esc(text)}</p>"


def items(lines: list[str], cls: str | None = None) -> str:
    klass = f' class="{cls}"' if cls else ""
    return f"<ul{klass}>" + "".join(f"<li>{esc(x)}</li>" for x in lines) + "</ul>"


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def table(frame: pd.DataFrame, digits: int = 4, scroll: bool = False) -> str:
    """A DataFrame as an HTML table; floats to `digits` significant digits. Headings
    may break after an underscore; columns of text are left-aligned. With `scroll`,
    cells keep one line and the table scrolls inside its own box instead."""

    def cell(v) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.{digits}g}"
        return "" if v is None or v is pd.NA else str(v)

    text = [
        c
        for c in frame.columns
        if not pd.api.types.is_numeric_dtype(frame[c]) and frame[c].astype(str).str.len().max() > 24
    ]
    head = "".join(f"<th>{esc(c).replace('_', '_<wbr>')}</th>" for c in frame.columns)
    rows = []
    for values in frame.itertuples(index=False, name=None):
        cells = "".join(
            f'<td class="text">{esc(cell(v))}</td>' if c in text else f"<td>{esc(cell(v))}</td>"
            for c, v in zip(frame.columns, values)
        )
        rows.append(f"<tr>{cells}</tr>")
    out = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    # a wrapping table fits a page of 1,200 px; on a narrower screen it scrolls in its box
    return f'<div class="{"scroll" if scroll else "fit"}">{out}</div>'


def image(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def page(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
