"""Every notebook in notebooks/ executes without error (8 simulated CPU devices, set by its first cell).

Notebooks are stored without outputs; this runs each one in a fresh kernel with nbclient and fails
on the first cell that raises. It also checks that the stored notebooks carry no outputs and that
the first cell sets the device count.
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # generous: CI machines are shared; a notebook normally takes seconds


def test_there_are_notebooks():
    names = [nb.name for nb in NOTEBOOKS]
    assert "01_sbp_and_placement.ipynb" in names and "02_boxing.ipynb" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    book = nbformat.read(path, as_version=4)
    first = next(c for c in book.cells if c.cell_type == "code")
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in first.source, f"{path.name}: first cell"
    assert "jsbp" not in first.source.split("jax_num_cpu_devices")[0], "set the devices before jsbp"
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: outputs stored in git"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    book = nbformat.read(path, as_version=4)
    env_before = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the kernel inherits it
    try:
        client = nbclient.NotebookClient(
            book,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
            allow_errors=False,
        )
        client.execute()  # raises CellExecutionError naming the cell on the first error
    finally:
        if env_before is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = env_before
    errors = [
        o
        for c in book.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors
    html = [
        o["data"]["text/html"]
        for c in book.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type in ("execute_result", "display_data") and "text/html" in o.get("data", {})
    ]
    assert html, f"{path.name} displays no picture"
    assert all("<script" not in h.lower() for h in html)
