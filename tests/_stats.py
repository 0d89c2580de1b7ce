"""Shared helper of the whole-loop statistical tests."""
import numpy as np

from specref import oracle


def power_sample_size(exact: np.ndarray, n: int, tv: float = 0.02, alpha: float = 1e-3) -> int:
    """Samples needed for power 0.99 against a TV deviation `tv`, on the partition the chi-square
    test actually uses at n samples (cells with expected count < 5 pooled into one)."""
    keep = exact * n >= 5
    pooled = np.append(exact[keep], exact[~keep].sum())
    return oracle.samples_for_tv(tv, len(pooled), alpha=alpha, power=0.99, probs=pooled)
