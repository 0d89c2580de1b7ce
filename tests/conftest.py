"""Test-wide settings.

Tiny models spend their time in thread synchronisation, not arithmetic: one intra-op thread is
~10x faster for them on a loaded 2-core machine, and keeps runs comparable. Override with
SPECREF_TEST_THREADS. The whole-loop statistical tests (marker `two_threads`: tens of thousands of
rows per batch) take SPECREF_TEST_BIG_THREADS (2: measured 35-40% faster each when the suite runs in
one process; 1 under pytest-xdist, whose two workers already fill the two cores: the README runs
`pytest -n 2`). tests/test_models.py runs first (see pytest_collection_modifyitems). The tests mirror the package: tests/oracle/,
tests/training/, tests/bench/, tests/backends/ beside the core and method tests; their file names
are unique (pytest's default import mode) and the shared helper _stats.py is importable from every
folder.
"""
import os
import random
import sys
import zlib

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `import _stats`

torch.set_num_threads(int(os.environ.get("SPECREF_TEST_THREADS", "1")))
BIG_THREADS = int(os.environ.get("SPECREF_TEST_BIG_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))
FIRST = "test_models.py"  # its default-model tests convert the GGUF first and seed the cache (below)


def pytest_configure(config):
    config.addinivalue_line("markers", "two_threads: a whole-loop statistical test over tens of thousands of rows "
                            "in one batch; runs with SPECREF_TEST_BIG_THREADS (default 2) intra-op threads")
    config.addinivalue_line("markers", "devices: parametrized over _devices.DEVICES (the CPU, and CUDA where "
                            "present); scripts/gpu_check.sh runs these on a GPU")


def pytest_collection_modifyitems(session, config, items):
    """tests/test_models.py first (a stable sort): its fixture converts the default model's GGUF
    offline into a temporary cache and then seeds the user's cache with it when that is empty (a
    fresh CI machine), so the GGUF is converted once per run, not twice (~40 s each)."""
    items.sort(key=lambda item: 0 if item.path.name == FIRST else 1)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts from global RNG states that depend on its own id only (crc32, not the
    per-process salted hash()), so a test that draws from torch's, numpy's or random's global
    generator sees the same numbers whichever pytest-xdist worker runs it and whatever ran before."""
    s = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)
    yield


@pytest.fixture(autouse=True)
def _two_threads(request):
    """Whole-loop chi-square tests batch 25,000-80,000 rows: large tensors, where a second thread
    pays (unlike the tiny models' single-row steps)."""
    if request.node.get_closest_marker("two_threads") is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(BIG_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)
