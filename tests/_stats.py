"""Shared helper of the whole-loop statistical tests."""
import numpy as np

from specref import oracle


def power_sample_size(exact: np.ndarray, n: int, tv: float = 0.02, alpha: float = 1e-3) -> int:
    """Samples needed for power 0.99 against a TV deviation `tv`, on the partition the chi-square
    test actually uses at n samples (cells with expected count < 5 pooled into one)."""
    keep = exact * n >= 5
    pooled = np.append(exact[keep], exact[~keep].sum())
    return oracle.samples_for_tv(tv, len(pooled), alpha=alpha, power=0.99, probs=pooled)


def power_rows(exact: np.ndarray, cap: int = 80_000, step: int = 5_000) -> int:
    """The fewest rows (a multiple of `step`, at most `cap`) with power_sample_size(exact, n) <= n:
    a whole-loop test sized to the power it states, not to a round number. AssertionError if even
    `cap` rows lack it."""
    for n in range(step, cap + 1, step):
        if power_sample_size(exact, n) <= n:
            return n
    raise AssertionError(f"{cap} rows give too little power ({power_sample_size(exact, cap)} needed)")
