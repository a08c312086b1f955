"""Every notebook under notebooks/ runs top to bottom without error with its small settings, and draws a plot."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
#: Notebooks executed at once: each runs in a kernel process of its own, which mostly imports and waits on one core,
#: so two share this suite's 2-core machine well (a test of its own would leave the second core idle).
PARALLEL = 2
#: Seconds one notebook may take, kernel start included.
TIMEOUT_S = 600

_EXECUTE = """
import sys
import nbformat
from nbclient import NotebookClient

source, target = sys.argv[1], sys.argv[2]
notebook = nbformat.read(source, as_version=4)
client = NotebookClient(notebook, timeout={timeout}, kernel_name="python3",
                        resources={{"metadata": {{"path": sys.argv[3]}}}})
client.execute()
nbformat.write(notebook, target)
"""


def _execute(path: Path, out: Path) -> tuple[Path, str]:
    """Run notebook ``path`` top to bottom in a fresh kernel (a subprocess, as a user's Jupyter would), its
    executed copy written to ``out``; the runner's stderr tail when it failed (a cell's error: nbclient's
    ``CellExecutionError`` with the cell's traceback), else empty."""
    env = dict(os.environ, KVBOOST_NOTEBOOK_TURNS="2", KVBOOST_NOTEBOOK_SMALL="1")  # every parameter cell reads it
    # conftest interprets Triton for the kernel tests; a notebook runs as for a user (05 sets it itself), or the
    # "kvboost" attention of notebook 03 would run interpreted on CPU instead of falling back to sdpa
    env.pop("TRITON_INTERPRET", None)
    script = _EXECUTE.format(timeout=TIMEOUT_S)
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), str(out), str(path.parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 60,
        check=False,
    )
    return out, done.stderr[-4000:] if done.returncode else ""


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each notebook's name -> (its executed copy, the runner's stderr tail when the runner itself failed), all
    run :data:`PARALLEL` at a time."""
    folder = tmp_path_factory.mktemp("notebooks")
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = {p.name: pool.submit(_execute, p, folder / p.name) for p in NOTEBOOKS}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, executed):
    out, runner_error = executed[path.name]
    assert not runner_error, runner_error
    notebook = nbformat.read(out, as_version=4)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code" and cell.source)
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
