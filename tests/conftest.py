"""Test-wide settings.

Tiny models spend their time in thread synchronisation, not arithmetic: one intra-op thread is
~10x faster for them on a loaded 2-core machine, and keeps runs comparable. Override with
SPECREF_TEST_THREADS. The tests mirror the package: tests/oracle/, tests/training/, tests/bench/,
tests/backends/ beside the core and method tests; their file names are unique (pytest's default
import mode) and the shared helper _stats.py is importable from every folder.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `import _stats`

torch.set_num_threads(int(os.environ.get("SPECREF_TEST_THREADS", "1")))
