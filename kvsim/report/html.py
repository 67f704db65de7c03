"""A self-contained HTML page: text, tables and PNGs embedded as data URIs.

The page opens from disk in any browser, with no server and no files beside it, and
holds no script. Everything shown is escaped; tables come from DataFrames.
"""
from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import pandas as pd

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: .85em; margin: .6em 0; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
.context { color: #555; font-size: .9em; } .verdict { background: #f6f8fa; padding: .6em 1em; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: .85em; }
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


def table(frame: pd.DataFrame, digits: int = 4) -> str:
    """A DataFrame as an HTML table; floats to `digits` significant digits."""
    def cell(v):
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.{digits}g}"
        return v
    shown = frame.apply(lambda col: col.map(cell)) if len(frame) else frame
    return shown.to_html(index=False, escape=True, border=0, na_rep="")


def image(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")
