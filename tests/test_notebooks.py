"""Every notebook under notebooks/ runs top to bottom without error with its small settings, and draws a plot.

The notebooks share one kernel, each started from a clean namespace, environment and working folder (a prelude cell
that is not part of the notebook): a kernel's start and its imports of torch and transformers cost ~12 s of CPU,
more than most small notebooks. A notebook that sets what must precede an import gets a kernel of its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

FOLDER = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
#: sets TRITON_INTERPRET before its first import of the kernel module: a kernel that imported it already (another
#: notebook's "kvboost" attention) would not interpret it
OWN_KERNEL = {"05_attention_kernel.ipynb"}


def notebook_environment() -> dict[str, str]:
    """The kernel's environment: every notebook's small settings (its parameter cell reads them). conftest interprets
    Triton for the kernel tests; a notebook runs as for a user (05 sets it itself), or the "kvboost" attention of
    notebook 03 would run interpreted on CPU instead of falling back to sdpa."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {"KVBOOST_NOTEBOOK_TURNS": "2", "KVBOOST_NOTEBOOK_SMALL": "1"}


#: a module in the shared kernel holding its environment as it started (ipykernel adds to it: MPLBACKEND, ...)
STARTED = "_notebook_test_kernel_started"
#: the first cell run in the shared kernel: keeps its environment at start where ``%reset`` does not reach
SNAPSHOT = f"import os, sys, types; sys.modules[{STARTED!r}] = types.SimpleNamespace(environ=dict(os.environ))"
#: the cell before each notebook in the shared kernel: what a fresh kernel would give it (its environment at start,
#: the notebooks' folder as working folder, an empty namespace: ``%reset -f`` last, so the cell's own names go too)
PRELUDE = "\n".join(
    [
        "import os, sys",
        f"os.environ.clear(); os.environ.update(sys.modules[{STARTED!r}].environ)",
        f"os.chdir({str(FOLDER)!r})",
        "%reset -f",
    ]
)


def start_kernel(env: dict[str, str]) -> AsyncKernelManager:
    manager = AsyncKernelManager(kernel_name="python3")
    run_sync(manager.start_kernel)(cwd=str(FOLDER), env=env)
    return manager


@pytest.fixture(scope="module")
def shared_kernel() -> Iterator[AsyncKernelManager]:
    """One kernel for the notebooks not in :data:`OWN_KERNEL`, shut down after the module."""
    manager = start_kernel(notebook_environment())
    execute(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SNAPSHOT)]), manager)
    yield manager
    run_sync(manager.shutdown_kernel)(now=True)


def execute(notebook: nbformat.NotebookNode, manager: AsyncKernelManager) -> None:
    """Run every cell of ``notebook`` in ``manager``'s kernel."""
    client = NotebookClient(notebook, km=manager, timeout=600, kernel_name="python3")
    try:
        client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, request: pytest.FixtureRequest) -> None:
    notebook = nbformat.read(path, as_version=4)
    if path.name in OWN_KERNEL:
        manager = start_kernel(notebook_environment())
        try:
            execute(notebook, manager)
        finally:
            run_sync(manager.shutdown_kernel)(now=True)
    else:
        notebook.cells.insert(0, nbformat.v4.new_code_cell(PRELUDE))
        execute(notebook, request.getfixturevalue("shared_kernel"))
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"


def test_the_shared_kernel_starts_each_notebook_as_a_fresh_kernel_would(shared_kernel, tmp_path):
    """What one notebook leaves behind (a name, an environment variable, a working folder) is gone for the next."""
    leave = f"import os\nleft = 1\nos.environ['KVBOOST_LEFT'] = '1'\nos.chdir({str(tmp_path)!r})"
    look = "import os\nprint(sorted({'left'} & set(globals())), os.environ.get('KVBOOST_LEFT'), os.getcwd())"
    for source in (leave, look):
        notebook = nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(PRELUDE), nbformat.v4.new_code_cell(source)]
        )
        execute(notebook, shared_kernel)
    assert notebook.cells[1].outputs[0]["text"].split() == ["[]", "None", str(FOLDER)]
