"""Execute the teaching notebooks with nbclient and refresh the committed outputs.

    python notebooks/run_all.py                            # reduced sizes, outputs written in place
    python notebooks/run_all.py 03 05                      # only notebooks whose name starts 03_ / 05_
    python notebooks/run_all.py --full --out executed/     # full sizes, executed copies in executed/

The committed notebooks hold the outputs of the reduced sizes (SPECREF_NB_SMALL=1, what the tests
run), with the sha256 of the code that produced them in their metadata (strip.source_hash);
tests/test_notebooks.py fails when a code cell was edited without a re-run. Plots are PNG at
FIGURE_DPI to keep the files small. The kernel is `python3`; jupyter_client starts it with the
interpreter running this script (sys.executable), so the notebooks see this environment's specref.
Each notebook runs in its own kernel, one at a time, with the notebooks folder as its working
directory. The whole reduced refresh of the 11 notebooks took 254 s wall (144 s CPU) on two
shared CPU cores.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # strip.py, beside this file
SMALL_ENV = "SPECREF_NB_SMALL"  # "1": every notebook runs its reduced sizes
FIGURE_DPI = 60  # the inline plots' resolution (matplotlib's default 100): small committed files


def run_notebook(path: Path, *, small: bool, timeout: int = 1800, out: Path = None):
    """Execute one notebook in a fresh python3 kernel; returns (executed notebook, wall seconds,
    CPU seconds of the kernel process, which a loaded machine does not inflate as much).

    Raises nbclient's CellExecutionError (with the failing cell's traceback) on any error."""
    from nbclient import NotebookClient

    from strip import META_KEY, source_hash

    nb = nbformat.read(path, as_version=4)
    env = {SMALL_ENV: "1" if small else "0", "MATPLOTLIBRC": tempfile.mkdtemp(prefix="specref_nb_mpl"),
           "PYTHONWARNINGS": "ignore:IProgress not found"}  # tqdm's warning names this machine's paths
    with open(Path(env["MATPLOTLIBRC"]) / "matplotlibrc", "w") as f:
        f.write(f"figure.dpi: {FIGURE_DPI}\n")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        NotebookClient(nb, kernel_name="python3", timeout=timeout,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    nb.metadata[META_KEY] = {"source_sha256": source_hash(nb), "small": small}
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the kernel has exited: its usage is counted
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / path.name)
    return nb, seconds, cpu


def main(argv=None) -> int:
    from strip import notebooks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for executed copies (default: in place)")
    ap.add_argument("--full", action="store_true", help=f"full sizes ({SMALL_ENV}=0); needs --out")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    ap.add_argument("only", nargs="*", help="name prefixes to run (default: all)")
    args = ap.parse_args(argv)
    paths = [p for p in notebooks() if not args.only or any(p.name.startswith(o) for o in args.only)]
    if not paths:
        print("no notebook matched", args.only, file=sys.stderr)
        return 2
    if args.full and args.out is None:
        print("--full needs --out: the committed notebooks hold the reduced run", file=sys.stderr)
        return 2
    total = total_cpu = 0.0
    for path in paths:
        _, seconds, cpu = run_notebook(path, small=not args.full, timeout=args.timeout, out=args.out or path.parent)
        total += seconds
        total_cpu += cpu
        print(f"{path.name}: {seconds:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    print(f"all {len(paths)}: {total:.1f} s wall, {total_cpu:.1f} s CPU ({'full' if args.full else 'reduced'} sizes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
