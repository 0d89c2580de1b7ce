"""python -m specref.weights compact FILE [--out OUT] [--bits 8|4 [--group G]] [--int4 NAME ...]
[--ref PREFIX REF_FILE]: rewrite a trained proposer file in int8 (or int4) storage, in place or at OUT
(a name ending in .xz is written xz-compressed, as the committed files are); --int4 names the
matrices stored as int4 while the rest are int8 rows; --ref stores the tensors under PREFIX as a
reference to REF_FILE, whose tensors they are."""
from __future__ import annotations

import argparse
import json

from . import GROUP, compact


def compact_parser() -> argparse.ArgumentParser:
    """The command line of `python -m specref.weights` (rebuild.py checks its recipes against it)."""
    ap = argparse.ArgumentParser(prog="python -m specref.weights", description=__doc__)
    ap.add_argument("command", choices=["compact"])
    ap.add_argument("files", nargs="+", metavar="FILE")
    ap.add_argument("--out", default=None, help="where to write (one FILE only; default: in place)")
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8,
                    help="8: int8 rows; 4: int4, one scale per --group columns (an int8 file may be compacted to int4)")
    ap.add_argument("--group", type=int, default=GROUP, help=f"int4: columns per fp16 scale (even; default {GROUP})")
    ap.add_argument("--int4", nargs="+", default=None, metavar="NAME",
                    help="these matrices as int4 (one scale per --group columns), every other matrix as int8 rows")
    ap.add_argument("--ref", nargs=2, default=None, metavar=("PREFIX", "REF_FILE"),
                    help="the tensors under PREFIX are REF_FILE's (a frozen copy, e.g. prefix. and the committed "
                    "EAGLE-1 file): store a reference to REF_FILE instead (refs.py)")
    return ap


def main(argv=None) -> int:
    """Compact each FILE; print what was written, one JSON line per file."""
    ap = compact_parser()
    a = ap.parse_args(argv)
    if a.out is not None and len(a.files) != 1:
        ap.error("--out takes one FILE")
    for p in a.files:
        print(json.dumps(compact(p, a.out, bits=a.bits, group=a.group, int4=a.int4,
                                 ref=None if a.ref is None else tuple(a.ref))))
    return 0
