"""The statistical core of the oracle: does a sampler reproduce an exact distribution?

Every sampling path in specref is checked against the distribution it must reproduce (Leviathan
et al. 2023, Theorem 3.5: speculative sampling emits tokens distributed exactly as p). This module
holds the statistics only; check.py and generator.py drive samplers through them.

- `chi_square_gof`: Pearson's chi-square goodness of fit of counts against exact probabilities,
  X^2 = sum_i (o_i - n p_i)^2 / (n p_i), with dof = cells - 1 (Pearson 1900). Cells whose expected
  count is below `min_expected` are pooled so the chi-square approximation holds (Cochran's rule).
- `chi_square_two_sample`: the chi-square test of homogeneity of two count vectors (2 x C table).
- `tv_distance`: total variation TV(r_hat, p) = 1/2 sum_i |o_i/n - p_i| with a distribution-free
  confidence interval for TV(r, p), r the sampler's true distribution (derivation in the docstring).
- `samples_for_tv` / `detectable_tv`: power of the chi-square test against a TV deviation through
  the noncentral chi-square distribution of X^2 under an alternative (Cochran 1952; Mitra 1958).

Left out: exact multinomial tests, sequential (early-stopping) tests, G-tests.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

PROB_SUM_TOL = 1e-4  # |sum(p) - 1| allowed: float32 softmax outputs sum to 1 within ~1e-6 * V


@dataclass(frozen=True)
class Cell:
    """One cell of a test with its standardised residual (o - e) / sqrt(e)."""

    index: int  # flat cell index in the caller's layout (see joint_index)
    expected: float  # n * p_i (for two-sample tests: expected count of sample a)
    observed: float  # o_i (for two-sample tests: count of sample a)
    residual: float  # (o - e) / sqrt(e); +inf where e == 0 < o


@dataclass(frozen=True)
class GofResult:
    statistic: float  # Pearson X^2 (inf when a probability-0 cell was observed)
    dof: int  # degrees of freedom after pooling (0: nothing to test)
    p_value: float  # P(chi2_dof >= statistic); 0.0 for an impossible observation
    n: int  # total number of samples (for two-sample: n_a + n_b)
    num_cells_used: int  # cells after pooling
    worst_cells: Tuple[Cell, ...]  # largest |residual| first, before pooling
    hidden_mass: float = 0.0  # p-mass of the pooled group: a deviation that moves mass inside it is invisible
    method: str = "pearson"  # "pearson", "binomial" (two groups, exact), "lr" (G^2 / Williams, gof_test)

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


@dataclass(frozen=True)
class TvResult:
    tv: float  # empirical TV(r_hat, p)
    lower: float  # lower confidence bound on the true TV(r, p)
    upper: float  # upper confidence bound
    confidence: float  # coverage of [lower, upper]
    n: int  # samples


def _as_array(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of cells, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite, got {a[~np.isfinite(a)][:3]}")
    if np.any(a < 0):
        raise ValueError(f"{name} must be non-negative, got min {a.min()}")
    return a


def _as_probs(probs, size: Optional[int] = None) -> np.ndarray:
    p = _as_array(probs, "probs")
    if size is not None and p.size != size:
        raise ValueError(f"probs has {p.size} cells but observed has {size}; shapes must match")
    if abs(p.sum() - 1.0) > PROB_SUM_TOL:
        raise ValueError(f"probs must sum to 1 (within {PROB_SUM_TOL}), got {p.sum():.8f}")
    return p / p.sum()


def _pool(expected: np.ndarray, min_expected: float) -> np.ndarray:
    """Group labels (C,): cells with expected < min_expected share one group; if that group is still
    below min_expected it is merged with the smallest remaining cell, repeatedly."""
    order = np.argsort(expected, kind="stable")  # (C,) ascending
    small = expected[order] < min_expected  # (C,)
    n_small = min(int(small.sum()), max(expected.size - 1, 0))  # the largest cell never joins the pool
    pooled = expected[order][:n_small].sum()
    # absorb the next smallest cells until the pooled cell is large enough; never the largest cell, so
    # that two groups remain to test (a pool that took every cell would leave the table untested)
    while n_small > 0 and pooled < min_expected and n_small < expected.size - 1:
        pooled += expected[order[n_small]]
        n_small += 1
    labels = np.empty(expected.size, dtype=np.int64)  # (C,)
    labels[order] = np.arange(expected.size)
    if n_small > 0:
        labels[order[:n_small]] = order.size  # one shared label for the pooled cell
    return labels


def _worst(index, expected, observed, k: int = 5) -> Tuple[Cell, ...]:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (observed - expected) / np.sqrt(expected)  # (C,)
    r = np.where(expected > 0, r, np.where(observed > 0, np.inf, 0.0))  # (C,)
    top = np.argsort(-np.abs(r), kind="stable")[:k]  # (k,)
    return tuple(Cell(int(index[i]), float(expected[i]), float(observed[i]), float(r[i])) for i in top)


def _counts_and_probs(observed, probs, min_expected: float):
    """Checked counts o (C,), probabilities p (C,), n, expected counts n p (C,) and the worst cells."""
    o = _as_array(observed, "observed")
    p = _as_probs(probs, o.size)
    if min_expected < 0:
        raise ValueError(f"min_expected must be >= 0, got {min_expected}")
    n = float(o.sum())
    if n <= 0:
        raise ValueError("observed must contain at least one count, got all zeros")
    e = n * p  # (C,)
    return o, p, n, e, _worst(np.arange(o.size), e, o)


def chi_square_gof(observed, probs, *, min_expected: float = 5.0) -> GofResult:
    """Pearson chi-square goodness of fit of `observed` counts (C,) against exact `probs` (C,).

    Cells with p_i = 0 must be empty: one observation there proves the sampler wrong, so the result
    has statistic inf and p_value 0.0. Cells with expected count n p_i < min_expected are pooled
    (see _pool; never every cell into one group). Two groups of which one is still small: the exact
    binomial p-value. Only a p with a single cell of support leaves nothing to test: dof 0, p 1.
    """
    from scipy import stats

    o, p, n, e, worst = _counts_and_probs(observed, probs, min_expected)
    if np.any((p == 0) & (o > 0)):
        return GofResult(math.inf, o.size - 1, 0.0, int(round(n)), o.size, worst)
    o_g, e_g, hidden = _grouped(o, p, e, min_expected)  # (G,), (G,)
    dof = o_g.size - 1
    if dof < 1:  # one cell carries all of p's mass: only an impossible token could deviate
        return GofResult(0.0, 0, 1.0, int(round(n)), int(o_g.size), worst)
    stat = float(np.sum((o_g - e_g) ** 2 / e_g))
    if dof == 1 and e_g.min() < min_expected:  # two groups, one still small: the exact binomial
        return GofResult(stat, 1, _binomial_p(o_g, e_g, n), int(round(n)), 2, worst, hidden, "binomial")
    return GofResult(stat, dof, float(stats.chi2.sf(stat, dof)), int(round(n)), int(o_g.size), worst, hidden)


def _grouped(o: np.ndarray, p: np.ndarray, e: np.ndarray, min_expected: float):
    """Observed and expected counts per group after pooling (_pool) on p's support, and the p-mass
    of the pooled group when it merged two or more cells (0 otherwise)."""
    support = np.flatnonzero(p > 0)  # (C',)
    labels = _pool(e[support], min_expected)  # (C',)
    _, groups = np.unique(labels, return_inverse=True)  # (C',)
    o_g = np.bincount(groups, weights=o[support])  # (G,)
    e_g = np.bincount(groups, weights=e[support])  # (G,)
    pooled = labels == support.size  # (C',) the shared label of the pooled cell
    hidden = float(p[support][pooled].sum()) if pooled.sum() >= 2 else 0.0
    return o_g, e_g, hidden


def _binomial_p(o_g: np.ndarray, e_g: np.ndarray, n: float) -> float:
    """Exact two-sided binomial p-value of the smaller group's count (two groups)."""
    from scipy import stats

    i = int(np.argmin(e_g))
    return float(stats.binomtest(int(round(o_g[i])), int(round(n)), float(e_g[i] / n)).pvalue)


def gof_test(observed, probs, *, min_expected: float = 5.0) -> GofResult:
    """The oracle's per-prefix goodness of fit, calibrated out to the tiny per-test thresholds.

    Pearson's X^2 against chi-square is anticonservative far in the tail when a cell's expected
    count is small (an upward count over an expected 10 has a Poisson tail; exact enumeration:
    P(p < 1e-5) is 5-8x nominal on tables such as n = 1000, p = (0.98, 0.01, 0.01), pooled at 10). Here:
    - two groups after pooling: the exact binomial test of the smaller group;
    - three or more: the likelihood-ratio G^2 = 2 sum o ln(o / e) with Williams' correction
      q = 1 + (sum_g 1/pi_g - 1) / (6 n (G - 1)) (Williams 1976), G^2 / q against chi-square
      (at most 1.75x nominal at thresholds 2e-5 and 7.5e-6 on skewed tables of 10 to 1,000 rows
      pooled at 5; `null_tail` computes such tails exactly);
    - a token p cannot emit: p-value 0.
    `statistic` is the chi-square(dof) quantile of the p-value, so independent tables add up to a
    test of their sum (conservative: a discrete p-value is super-uniform). Pooling as chi_square_gof's
    (never every cell into one group); `hidden_mass` is what pooling hides.
    """
    from scipy import stats

    o, p, n, e, worst = _counts_and_probs(observed, probs, min_expected)
    if np.any((p == 0) & (o > 0)):
        return GofResult(math.inf, max(1, int((p > 0).sum()) - 1), 0.0, int(round(n)), o.size, worst, 0.0, "lr")
    o_g, e_g, hidden = _grouped(o, p, e, min_expected)  # (G,), (G,)
    G = o_g.size
    if G < 2:
        return GofResult(0.0, 0, 1.0, int(round(n)), G, worst, 0.0, "lr")
    if G == 2:
        pv, method = _binomial_p(o_g, e_g, n), "binomial"
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            g2 = 2.0 * float(np.sum(np.where(o_g > 0, o_g * np.log(o_g / e_g), 0.0)))
        q = 1.0 + (float(np.sum(n / e_g)) - 1.0) / (6.0 * n * (G - 1))
        pv, method = float(stats.chi2.sf(max(g2, 0.0) / q, G - 1)), "lr"
    stat = math.inf if pv <= 0.0 else float(stats.chi2.isf(min(pv, 1.0), G - 1))
    return GofResult(stat, G - 1, pv, int(round(n)), G, worst, hidden, method)


def null_tail(probs, n: int, threshold: float, *, min_expected: float = 5.0) -> float:
    """Exact P(gof_test's p-value < threshold) under the null, for n draws from probs that pool into
    at most three groups: every grouped outcome is enumerated (the test sees only the grouped counts,
    which are multinomial). The calibration of the oracle's test at the per-test threshold: a
    calibrated test gives at most `threshold`."""
    from scipy import stats

    p = _as_probs(probs)
    support = np.flatnonzero(p > 0)
    labels = _pool(n * p[support], min_expected)
    _, groups = np.unique(labels, return_inverse=True)
    pg = np.bincount(groups, weights=p[support])  # (G,)
    G = pg.size
    if G > 3:
        raise ValueError(f"null_tail enumerates at most 3 groups, got {G}")
    if G < 2:
        return 0.0
    a = np.arange(n + 1, dtype=np.float64)
    if G == 2:  # the exact binomial's own two-sided p-values (scipy's rule: pmf <= pmf(k) (1 + 1e-7))
        i = int(np.argmin(pg))
        pmf = stats.binom.pmf(a, n, pg[i])  # (n+1,)
        order = np.sort(pmf)
        pv = np.cumsum(order)[np.searchsorted(order, pmf * (1 + 1e-7), side="right") - 1]  # (n+1,)
        return float(pmf[np.minimum(pv, 1.0) < threshold].sum())
    o1, o2 = np.meshgrid(a, a, indexing="ij")
    o3 = n - o1 - o2
    ok = o3 >= 0
    O = np.stack([o1[ok], o2[ok], o3[ok]], 1)  # (M, 3)
    E = n * pg  # (3,)
    with np.errstate(divide="ignore", invalid="ignore"):
        g2 = 2.0 * np.where(O > 0, O * np.log(O / E), 0.0).sum(1)  # (M,)
    q = 1.0 + (float(np.sum(n / E)) - 1.0) / (6.0 * n * 2)
    pv = stats.chi2.sf(np.maximum(g2, 0.0) / q, 2)  # (M,)
    return float(np.exp(stats.multinomial.logpmf(O[pv < threshold], n, pg)).sum())


def chi_square_two_sample(counts_a, counts_b, *, min_expected: float = 5.0) -> GofResult:
    """Chi-square test that two count vectors (C,) come from the same distribution (2 x C table).

    Expected counts under homogeneity: E_si = n_s (a_i + b_i) / (n_a + n_b). Cells are pooled on
    the smaller of the two rows' expected counts; dof = cells - 1. worst_cells report sample a.
    """
    from scipy import stats

    a = _as_array(counts_a, "counts_a")
    b = _as_array(counts_b, "counts_b")
    if a.size != b.size:
        raise ValueError(f"counts_a has {a.size} cells, counts_b {b.size}; shapes must match")
    na, nb = float(a.sum()), float(b.sum())
    if na <= 0 or nb <= 0:
        raise ValueError(f"both samples need counts, got totals {na} and {nb}")
    tot = a + b  # (C,)
    ea, eb = na * tot / (na + nb), nb * tot / (na + nb)  # (C,), (C,)
    worst = _worst(np.arange(a.size), ea, a)
    support = np.flatnonzero(tot > 0)  # (C',)
    labels = _pool(np.minimum(ea, eb)[support], min_expected)  # (C',)
    _, groups = np.unique(labels, return_inverse=True)  # (C',)
    a_g, b_g = (np.bincount(groups, weights=x[support]) for x in (a, b))  # (G,), (G,)
    ea_g, eb_g = (np.bincount(groups, weights=x[support]) for x in (ea, eb))  # (G,), (G,)
    dof = a_g.size - 1
    n = int(round(na + nb))
    if dof < 1:
        return GofResult(0.0, 0, 1.0, n, int(a_g.size), worst)
    stat = float(np.sum((a_g - ea_g) ** 2 / ea_g) + np.sum((b_g - eb_g) ** 2 / eb_g))
    return GofResult(stat, dof, float(stats.chi2.sf(stat, dof)), n, int(a_g.size), worst)


def tv_distance(observed, probs, *, confidence: float = 0.99) -> TvResult:
    """Empirical TV(r_hat, p) and a confidence interval for TV(r, p), r the sampler's distribution.

    Bound (distribution-free, finite n, valid for any r): by the triangle inequality
    |TV(r_hat, p) - TV(r, p)| <= TV(r_hat, r). Then E TV(r_hat, r) = 1/2 sum_i E|r_hat_i - r_i|
    <= 1/2 sum_i sqrt(r_i (1 - r_i) / n) <= 1/2 sqrt((C - 1) / n) (Jensen, then Cauchy-Schwarz with
    sum_i r_i (1 - r_i) <= 1 - 1/C), and TV(r_hat, r) changes by at most 1/n when one of the n i.i.d.
    samples changes, so McDiarmid's inequality gives TV(r_hat, r) <= E + sqrt(ln(1/delta) / (2n))
    with probability >= 1 - delta. Hence TV(r, p) lies in tv_hat -/+ eps with
    eps = 1/2 sqrt((C - 1)/n) + sqrt(ln(1/delta)/(2n)), delta = 1 - confidence. Conservative
    (coverage is well above `confidence`), chosen over a bootstrap because it needs no randomness
    and holds at every n, including when tv_hat is 0, where bootstrap intervals are known to fail.
    """
    o = _as_array(observed, "observed")
    p = _as_probs(probs, o.size)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = float(o.sum())
    if n <= 0:
        raise ValueError("observed must contain at least one count, got all zeros")
    tv = 0.5 * float(np.abs(o / n - p).sum())
    eps = 0.5 * math.sqrt((o.size - 1) / n) + math.sqrt(math.log(1.0 / (1.0 - confidence)) / (2 * n))
    return TvResult(tv, max(0.0, tv - eps), min(1.0, tv + eps), confidence, int(round(n)))


def _noncentrality_per_sample(tv: float, probs) -> float:
    """min over deviations d (sum d = 0, 1/2 sum |d| = tv) of sum_i d_i^2 / p_i, or a lower bound.

    Splitting the cells into a rising set A (mass P_A) and a falling set (mass 1 - P_A), Cauchy-
    Schwarz gives sum d^2/p >= tv^2 (1/P_A + 1/(1 - P_A)) >= 4 tv^2, with equality for d proportional
    to p within each set. So 4 tv^2 is a bound valid for every p (used when probs is None). With probs
    whose largest cell has p_max >= 1/2, the minimising split is exact: A = {argmax}, giving
    tv^2 / (p_max (1 - p_max)). Otherwise we keep 4 tv^2, a lower bound (conservative: it can only
    overstate the samples needed, never understate them).
    """
    if probs is None:
        return 4.0 * tv * tv
    p_max = float(np.max(probs))
    if p_max >= 0.5:
        return tv * tv / (p_max * (1.0 - p_max)) if p_max < 1.0 else math.inf
    return 4.0 * tv * tv


def _check_power_args(num_cells: int, alpha: float, power: float, probs):
    if int(num_cells) != num_cells or num_cells < 2:
        raise ValueError(f"num_cells must be an integer >= 2, got {num_cells}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not alpha < power < 1.0:
        raise ValueError(f"power must be in (alpha, 1) = ({alpha}, 1), got {power}")
    return None if probs is None else _as_probs(probs, int(num_cells))


@functools.lru_cache(maxsize=4096)  # the oracle asks for the same (dof, alpha, power) many times
def _noncentrality_for_power(dof: int, alpha: float, power: float) -> float:
    """lambda such that the level-alpha chi-square test with `dof` rejects ncx2(dof, lambda) with `power`."""
    from scipy import optimize, stats

    crit = stats.chi2.isf(alpha, dof)
    f = lambda lam: stats.ncx2.sf(crit, dof, lam) - power  # increasing in lam
    hi = 1.0
    while f(hi) < 0:
        hi *= 2.0
    return float(optimize.brentq(f, 0.0, hi, xtol=1e-10, rtol=1e-12))


def samples_for_tv(tv: float, num_cells: int, *, alpha: float = 1e-3, power: float = 0.99,
                   probs=None) -> int:
    """Smallest n at which the chi-square GOF test (level alpha, num_cells - 1 dof) detects every
    deviation of total variation `tv` with probability >= power.

    Under r = p + d, Pearson's X^2 is approximately noncentral chi-square with dof C - 1 and
    noncentrality n sum_i d_i^2 / p_i (Mitra 1958); its least value over deviations of TV `tv` is
    derived in `_noncentrality_per_sample`. Assumes no pooling (every n p_i >= min_expected at
    this n; pooling merges cells and can hide a deviation inside them).
    """
    if not 0.0 < tv <= 0.5:
        raise ValueError(f"tv must be in (0, 0.5] (the noncentrality bound needs tv <= 1/2), got {tv}")
    p = _check_power_args(num_cells, alpha, power, probs)
    lam = _noncentrality_for_power(int(num_cells) - 1, float(alpha), float(power))
    per = _noncentrality_per_sample(tv, p)
    return max(1, int(math.ceil(lam / per)))


def detectable_tv(n: int, num_cells: int, *, alpha: float = 1e-3, power: float = 0.95,
                  probs=None) -> float:
    """Smallest TV deviation that n samples detect with probability >= power (inverse of
    samples_for_tv; same assumptions)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = _check_power_args(num_cells, alpha, power, probs)
    lam = _noncentrality_for_power(int(num_cells) - 1, float(alpha), float(power))
    per_unit = _noncentrality_per_sample(1.0, p)  # noncentrality per sample is per_unit * tv^2
    return math.sqrt(lam / (n * per_unit)) if per_unit > 0 else math.inf


def joint_index(tokens, vocab: int):
    """Flat index in V^L of each row of tokens (S, L): sum_j tokens[:, j] * V^(L-1-j), row-major."""
    is_torch = hasattr(tokens, "detach")
    t = tokens.detach().cpu().numpy() if is_torch else np.asarray(tokens)
    if t.ndim != 2:
        raise ValueError(f"tokens must be (S, L), got shape {t.shape}")
    if vocab < 1 or t.shape[1] * math.log2(max(vocab, 2)) > 62:
        raise ValueError(f"vocab ** L = {vocab} ** {t.shape[1]} must fit in int64 (and vocab >= 1)")
    if t.size and (t.min() < 0 or t.max() >= vocab):
        raise ValueError(f"tokens must be in [0, {vocab}), got range [{t.min()}, {t.max()}]")
    weights = vocab ** np.arange(t.shape[1] - 1, -1, -1, dtype=np.int64)  # (L,)
    return t.astype(np.int64) @ weights  # (S,)


def counts(indices, num_cells: int) -> np.ndarray:
    """Histogram (num_cells,) of flat cell indices (numpy or torch)."""
    idx = indices.detach().cpu().numpy() if hasattr(indices, "detach") else np.asarray(indices)
    idx = idx.reshape(-1).astype(np.int64)  # (S,)
    if idx.size and (idx.min() < 0 or idx.max() >= num_cells):
        raise ValueError(f"indices must be in [0, {num_cells}), got [{idx.min()}, {idx.max()}]")
    return np.bincount(idx, minlength=num_cells).astype(np.float64)  # (num_cells,)
