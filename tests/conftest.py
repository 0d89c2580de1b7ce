"""Test-wide settings.

Tiny models spend their time in thread synchronisation, not arithmetic: one intra-op thread is
~10x faster for them on a loaded 2-core machine, and keeps runs comparable. Override with
SPECREF_TEST_THREADS.
"""
import os

import torch

torch.set_num_threads(int(os.environ.get("SPECREF_TEST_THREADS", "1")))
