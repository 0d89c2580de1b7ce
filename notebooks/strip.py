"""The notebooks' bookkeeping: their list, the hash of their code, and stripping outputs.

The notebooks are committed WITH the outputs of their reduced-size run (`python notebooks/run_all.py`
writes them, with `source_hash` of the code it ran in the notebook's metadata; tests/test_notebooks.py
checks that the stored code still has that hash). Stripping is for a reader who wants a clean copy:

    python notebooks/strip.py            # strip every notebooks/*.ipynb in place (then re-run run_all.py)
    python notebooks/strip.py --check    # exit 1 and list the notebooks that hold outputs
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent


def notebooks(folder: Path = HERE) -> list:
    """The teaching notebooks, in order (01_, 02_, ... numbered consecutively)."""
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb"))


META_KEY = "specref"  # nb.metadata[META_KEY] = {"source_sha256": ..., "small": bool}, set by run_all.py


def source_hash(nb) -> str:
    """sha256 of the code cells' sources, in order (markdown edits need no re-run)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode("utf-8"))
            h.update(b"\x00")  # a cell boundary: moving a line across cells changes the hash
    return h.hexdigest()


def has_outputs(nb) -> bool:
    """True if any code cell holds outputs or an execution count (or the notebook run metadata)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            return True
        if "execution" in cell.get("metadata", {}):
            return True
    return False


def strip(nb):
    """Remove outputs, execution counts and per-cell execution metadata, in place; returns nb."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report notebooks with outputs")
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/[0-9][0-9]_*.ipynb)")
    args = ap.parse_args(argv)
    paths = args.paths or notebooks()
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if has_outputs(nb):
            dirty.append(path)
            if not args.check:
                nbformat.write(strip(nb), path)
    verb = "hold outputs" if args.check else "stripped"
    for path in dirty:
        print(f"{verb}: {path}")
    return 1 if (args.check and dirty) else 0


if __name__ == "__main__":
    sys.exit(main())
