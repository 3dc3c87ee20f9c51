"""The notebooks run top to bottom on CPU with the default model, as a user's "Run all" would.

Each notebook is executed by nbclient in a fresh kernel of this interpreter. The cell tagged
``parameters`` is followed by an injected cell of overrides (papermill's convention), so the
install cell is skipped and the timing sweep stays short. Any cell error fails the test.
"""

import json
import os
import sys

import pytest

from tests.conftest import REPO

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = REPO / "notebooks"
KERNEL_NAME = "jaxinfer-test-python"
CELL_TIMEOUT_S = 900

RUNS = {  # test id: (notebook, parameter overrides)
    "quickstart": ("quickstart.ipynb", {"INSTALL": False}),
    # The server in the notebook's own process (BackgroundServer), as on a TPU VM.
    "quickstart-in-process-server": ("quickstart.ipynb", {"INSTALL": False, "SERVER_IN_PROCESS": True}),
    "research": ("research.ipynb", {"BATCH_SIZES": [1, 4], "TIMED_STEPS": 3}),
}


@pytest.fixture(scope="module")
def kernel_of_this_python(tmp_path_factory, monkeypatch_module):
    """A kernelspec that runs this interpreter, found before any "python3" installed elsewhere."""
    jupyter_path = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "jaxinfer tests", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch_module.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter_path), os.environ.get("JUPYTER_PATH")])))
    monkeypatch_module.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch_module.setenv("MPLBACKEND", "agg")
    return KERNEL_NAME


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def with_parameters(nb, overrides: dict):
    """Insert an ``injected-parameters`` cell after the ``parameters`` cell."""
    index = next(i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in overrides.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(index + 1, cell)
    return nb


def test_notebooks_are_committed_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(RUNS))
def test_notebook_runs_top_to_bottom(run, kernel_of_this_python):
    name, overrides = RUNS[run]
    nb = with_parameters(nbformat.read(NOTEBOOKS / name, as_version=4), overrides)
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_of_this_python, timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
