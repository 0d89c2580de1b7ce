"""The teaching notebooks (notebooks/0N_*.ipynb): stored without outputs, and executed end to end.

Each notebook runs in a fresh `python3` kernel (jupyter_client starts it with this interpreter,
sys.executable) at its reduced sizes (SPECREF_NB_SMALL=1), one at a time; a failing cell raises
nbclient's CellExecutionError with the cell's traceback. The notebooks assert their own results
(chi-square verdicts, greedy parity, the KV-cache invariant), so a run that breaks the library's
behaviour fails here, not just a run that crashes. Every notebook must render at least one plot.
"""
import importlib.util
from pathlib import Path

import nbformat
import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_specref_notebooks_{name}", NB_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


strip = _load("strip")
run_all = _load("run_all")
NOTEBOOKS = strip.notebooks(NB_DIR)


def test_one_notebook_per_line_of_the_issue():
    # the 8 first subjects (01_ .. 08_), then 09_medusa and on: numbered consecutively from 01_
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}_" for i in range(1, max(len(NOTEBOOKS), 9) + 1)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs_and_equation_first(path):
    nb = nbformat.read(path, as_version=4)
    assert not strip.has_outputs(nb), f"{path.name} holds outputs: run `python notebooks/strip.py`"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "$" in first.source, f"{path.name} must open with its equation"
    assert "SPECREF_NB_SMALL" in first.source, f"{path.name} must state its full and reduced sizes"


def test_strip_removes_outputs():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1", execution_count=3, outputs=[
        nbformat.v4.new_output("execute_result", data={"text/plain": "1"}, execution_count=3)])])
    assert strip.has_outputs(nb)  # an executed cell counts as output
    assert not strip.has_outputs(strip.strip(nb))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_reduced(path):
    nb, _, _ = run_all.run_notebook(path, small=True, timeout=600)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} rendered no plot"
