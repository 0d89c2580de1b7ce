"""The teaching notebooks (notebooks/NN_*.ipynb): committed with current outputs, and executed end to end.

Committed outputs are current when every code cell has outputs, none is an error, and the code
cells' sha256 equals the one run_all.py recorded when it executed them (a cell edited without a
re-run fails here: `python notebooks/run_all.py NN` refreshes it).

Each notebook runs in a fresh `python3` kernel (jupyter_client starts it with this interpreter,
sys.executable) at its reduced sizes (SPECREF_NB_SMALL=1), one at a time; a failing cell raises
nbclient's CellExecutionError with the cell's traceback. The notebooks assert their own results
(chi-square verdicts, greedy parity, the KV-cache invariant), so a run that breaks the library's
behaviour fails here, not just a run that crashes. Every notebook must render at least one plot.
"""
import importlib.util
import json
import sys
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


def test_notebooks_numbered_consecutively():
    # one notebook per subject, numbered consecutively from 01_ (11_: the EAGLE family and MTP)
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}_" for i in range(1, max(len(NOTEBOOKS), 11) + 1)]


def _stale(nb) -> list:
    """Why a notebook's committed outputs are not those of its committed code ([] if current)."""
    meta = nb.metadata.get(strip.META_KEY, {})
    why = [] if meta.get("small") is True else ["not executed by run_all.py at the reduced sizes"]
    if meta.get("source_sha256") != strip.source_hash(nb):
        why.append("code edited after its outputs were made")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if not cell.get("outputs"):
            why.append(f"code cell {i} has no outputs")
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            why.append(f"code cell {i} holds an error")
        text = json.dumps(cell.get("outputs", []))
        if any(len(local) > 1 and local in text for local in (str(Path.home()), sys.prefix, sys.base_prefix,
                                                              str(NB_DIR.parent))):
            why.append(f"code cell {i} prints a path of this machine (home, Python or checkout)")
    return why


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_current_and_equation_first(path):
    nb = nbformat.read(path, as_version=4)
    stale = _stale(nb)
    assert not stale, f"{path.name}: {stale}: run `python notebooks/run_all.py {path.name[:2]}`"
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", [])), f"{path.name} shows no plot"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "$" in first.source, f"{path.name} must open with its equation"
    assert "SPECREF_NB_SMALL" in first.source, f"{path.name} must state its full and reduced sizes"


def test_stale_outputs_detected():
    out = nbformat.v4.new_output("stream", name="stdout", text="2\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("$x$"),
                                         nbformat.v4.new_code_cell("print(1 + 1)", execution_count=1, outputs=[out])])
    nb.metadata[strip.META_KEY] = {"source_sha256": strip.source_hash(nb), "small": True}
    assert _stale(nb) == []
    nb.cells[0].source = "$y$"  # prose needs no re-run
    assert _stale(nb) == []
    nb.cells[1].source = "print(1 + 2)"  # code edited without a re-run
    assert _stale(nb) == ["code edited after its outputs were made"]
    nb.metadata[strip.META_KEY]["source_sha256"] = strip.source_hash(nb)
    nb.cells[1].outputs = [nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])]
    assert _stale(nb) == ["code cell 1 holds an error"]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text=f"{sys.prefix}/lib/x.py:1: Warning")]
    assert _stale(nb) == ["code cell 1 prints a path of this machine (home, Python or checkout)"]
    nb.cells[1].outputs = []
    assert _stale(nb) == ["code cell 1 has no outputs"]


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
