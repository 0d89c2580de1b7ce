"""Execute the teaching notebooks with nbclient; optionally save executed copies.

    python notebooks/run_all.py --out executed/            # full sizes, executed copies in executed/
    python notebooks/run_all.py --small                    # reduced sizes (SPECREF_NB_SMALL=1), as the tests
    python notebooks/run_all.py --out executed/ 03 05      # only notebooks whose name starts 03_ / 05_

The kernel is `python3`; jupyter_client starts it with the interpreter running this script
(sys.executable), so the notebooks see this environment's specref. Each notebook runs in its own
kernel, one at a time, with the notebooks folder as its working directory. Stored notebooks carry no
outputs (see strip.py); the executed copies are the place to read results.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SMALL_ENV = "SPECREF_NB_SMALL"  # "1": every notebook runs its reduced sizes


def run_notebook(path: Path, *, small: bool, timeout: int = 1800, out: Path = None):
    """Execute one notebook in a fresh python3 kernel; returns (executed notebook, wall seconds,
    CPU seconds of the kernel process, which a loaded machine does not inflate as much).

    Raises nbclient's CellExecutionError (with the failing cell's traceback) on any error."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get(SMALL_ENV)
    os.environ[SMALL_ENV] = "1" if small else "0"  # the kernel inherits this process's environment
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        NotebookClient(nb, kernel_name="python3", timeout=timeout,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if saved is None:
            os.environ.pop(SMALL_ENV, None)
        else:
            os.environ[SMALL_ENV] = saved
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
    ap.add_argument("--out", type=Path, default=None, help="folder for executed copies (e.g. executed/)")
    ap.add_argument("--small", action="store_true", help=f"reduced sizes ({SMALL_ENV}=1)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    ap.add_argument("only", nargs="*", help="name prefixes to run (default: all)")
    args = ap.parse_args(argv)
    paths = [p for p in notebooks() if not args.only or any(p.name.startswith(o) for o in args.only)]
    if not paths:
        print("no notebook matched", args.only, file=sys.stderr)
        return 2
    total = total_cpu = 0.0
    for path in paths:
        _, seconds, cpu = run_notebook(path, small=args.small, timeout=args.timeout, out=args.out)
        total += seconds
        total_cpu += cpu
        print(f"{path.name}: {seconds:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    print(f"all {len(paths)}: {total:.1f} s wall, {total_cpu:.1f} s CPU ({'reduced' if args.small else 'full'} sizes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
