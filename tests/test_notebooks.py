"""Every notebook under notebooks/ runs top to bottom without error with its small settings, and draws a plot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("KVBOOST_NOTEBOOK_TURNS", "2")
    monkeypatch.setenv("KVBOOST_NOTEBOOK_SMALL", "1")  # every notebook's parameter cell reads it
    # conftest interprets Triton for the kernel tests; a notebook runs as for a user (05 sets it itself), or the
    # "kvboost" attention of notebook 03 would run interpreted on CPU instead of falling back to sdpa
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
