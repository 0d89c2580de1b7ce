"""python -m specref.weights compact FILE [--out OUT]: rewrite a trained proposer file in int8
storage, in place or at OUT (a name ending in .xz is written xz-compressed, as the committed files are)."""
import argparse
import json

from . import compact

ap = argparse.ArgumentParser(prog="python -m specref.weights")
ap.add_argument("command", choices=["compact"])
ap.add_argument("files", nargs="+", metavar="FILE")
ap.add_argument("--out", default=None, help="where to write (one FILE only; default: in place)")
a = ap.parse_args()
if a.out is not None and len(a.files) != 1:
    ap.error("--out takes one FILE")
for p in a.files:
    print(json.dumps(compact(p, a.out)))
