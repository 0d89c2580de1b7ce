"""python -m specref.weights compact FILE ...: rewrite trained proposer files in int8 storage."""
import json
import sys

from . import compact

if len(sys.argv) < 3 or sys.argv[1] != "compact":
    raise SystemExit("usage: python -m specref.weights compact FILE ...")
for p in sys.argv[2:]:
    print(json.dumps(compact(p)))
