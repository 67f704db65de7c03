"""The shipped notebooks run top to bottom in a real Jupyter kernel (nbclient), with fast
settings put into their `# parameters` cell, and are committed without outputs."""

import json
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (kvsim[dev])")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (kvsim[dev])")

FOLDER = Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
FAST = {  # notebook -> {parameter line: fast replacement}
    "compare_policies.ipynb": {"NUM_REQUESTS = 300": "NUM_REQUESTS = 40"},
    "memory_math.ipynb": {},
    "reproduce_claims.ipynb": {"CLAIMS = ()": "CLAIMS = ('1', '9')"},
}


def test_every_notebook_is_listed_and_committed_without_outputs():
    assert sorted(p.name for p in NOTEBOOKS) == sorted(FAST)
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), path.name
        assert "".join(code[0]["source"]).startswith("# parameters"), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what a notebook writes to a temporary folder goes there
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    for old, new in FAST[path.name].items():
        assert old in first.source
        first.source = first.source.replace(old, new)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(FOLDER)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "no figure was shown"
