"""Every notebook runs top to bottom on a real kernel, and is committed with its outputs cleared.

A plain (sync) test with nbclient: pytest-trio's trio_mode breaks nbmake. The kernel is the one
the README's test command installs into the virtual environment (`proto-server`), so the
notebooks import this checkout whatever other Python kernels the machine has.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
KERNEL = "proto-server"
INSTALL = f"python -m ipykernel install --sys-prefix --name {KERNEL}"


def test_there_are_notebooks() -> None:
    assert [path.name[:2] for path in NOTEBOOKS] == ["01", "02", "03"]


def test_the_kernel_is_this_environments_python() -> None:
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        pytest.fail(f"no Jupyter kernel {KERNEL!r}: install it with `{INSTALL}`.")
    assert Path(spec.argv[0]).resolve() == Path(sys.executable).resolve(), (
        f"the {KERNEL!r} kernel runs {spec.argv[0]}, not this environment's Python; "
        f"reinstall it with `{INSTALL}`."
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_the_notebook_is_committed_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_the_notebook_runs_top_to_bottom(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=120,  # per cell; a notebook takes seconds
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
