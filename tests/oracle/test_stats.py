"""Tests of the oracle's statistics (specref/oracle/stats.py), on counts drawn with seeded numpy
multinomials from known distributions, so the truth is known exactly."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from specref.oracle import (
    chi_square_gof,
    chi_square_two_sample,
    counts,
    detectable_tv,
    joint_index,
    samples_for_tv,
    tv_distance,
)


def _probs(c: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(c))  # (C,)


def _least_favourable(c: int, tv: float):
    """p with two halves of equal mass and r = p shifted by +-2 tv p on the halves: TV(r, p) = tv
    and sum d^2/p = 4 tv^2, the least favourable deviation for the chi-square test."""
    half = _probs(c // 2, 1) / 2  # (C/2,)
    p = np.concatenate([half, half])  # (C,)
    sign = np.concatenate([np.ones(c // 2), -np.ones(c // 2)])  # (C,)
    r = p * (1 + 2 * tv * sign)  # (C,)
    assert abs(0.5 * np.abs(r - p).sum() - tv) < 1e-12
    return p, r


def test_gof_false_alarm_rate_matches_alpha():
    # 2000 runs under the null, with and without small cells that get pooled.
    rng = np.random.default_rng(0)
    for p in (_probs(10, 2), np.r_[_probs(10, 3) * 0.97, np.full(10, 0.003)]):
        obs = rng.multinomial(1000, p, size=2000)  # (R, C)
        pv = np.array([chi_square_gof(o, p).p_value for o in obs])  # (R,)
        hits = int((pv < 0.05).sum())
        # two-sided binomial test of the false-alarm rate against 0.05 at significance 1e-3
        assert stats.binomtest(hits, pv.size, 0.05).pvalue > 1e-3, hits
        # and the whole p-value distribution is uniform (KS at 1e-3); pooling keeps it so
        assert stats.kstest(pv, "uniform").pvalue > 1e-3


def test_gof_power_at_samples_for_tv():
    # Least favourable deviation of TV 0.02 over 20 cells; n from samples_for_tv for power 0.99 at
    # alpha 1e-3. Over 40 seeded runs the test must reject at least 36 times (if the true power
    # were 0.99, P(<= 35 rejections) = 8e-5; at our own threshold we demand the claim holds).
    p, r = _least_favourable(20, 0.02)
    n = samples_for_tv(0.02, 20, alpha=1e-3, power=0.99)
    assert 30000 < n < 45000, n  # lambda ~ 59 for 19 dof / (4 * 0.02^2)
    obs = np.random.default_rng(1).multinomial(n, r, size=40)  # (R, C)
    rejected = sum(chi_square_gof(o, p).p_value < 1e-3 for o in obs)
    assert rejected >= 36, rejected
    # The power model is not just conservative: at n/3 the predicted power (ncx2) is ~0.5, and the
    # measured rejection rate over 300 runs agrees with it (binomial test at 1e-3).
    m = n // 3
    crit = stats.chi2.isf(1e-3, 19)
    predicted = stats.ncx2.sf(crit, 19, m * 4 * 0.02**2)
    assert 0.2 < predicted < 0.8
    obs = np.random.default_rng(2).multinomial(m, r, size=300)  # (R, C)
    hits = sum(chi_square_gof(o, p).p_value < 1e-3 for o in obs)
    assert stats.binomtest(hits, 300, predicted).pvalue > 1e-3, (hits, predicted)


def test_samples_and_detectable_tv_are_inverse():
    n = samples_for_tv(0.02, 50, alpha=1e-3, power=0.95)
    assert detectable_tv(n, 50, alpha=1e-3, power=0.95) <= 0.02
    assert detectable_tv(n - 1, 50, alpha=1e-3, power=0.95) > 0.02
    # more cells, stricter alpha or higher power all need more samples
    assert samples_for_tv(0.02, 100) > samples_for_tv(0.02, 10)
    assert samples_for_tv(0.02, 10, alpha=1e-6) > samples_for_tv(0.02, 10, alpha=1e-3)
    assert samples_for_tv(0.02, 10, power=0.999) > samples_for_tv(0.02, 10, power=0.9)
    # halving the TV quadruples n (noncentrality is n * 4 tv^2)
    assert abs(samples_for_tv(0.01, 10) / samples_for_tv(0.02, 10) - 4) < 1e-3
    # a dominant cell (p_max = 0.9): least favourable deviation moves mass off it; exact form
    p = np.r_[0.9, np.full(9, 0.1 / 9)]
    lam_per = 0.02**2 / (0.9 * 0.1)
    n_p, n_plain = samples_for_tv(0.02, 10, probs=p), samples_for_tv(0.02, 10)
    assert abs(n_p * lam_per - n_plain * 4 * 0.02**2) <= lam_per + 4 * 0.02**2  # same lambda
    assert samples_for_tv(0.02, 10, probs=p) < samples_for_tv(0.02, 10)
    # without a dominant cell, the probs-free bound is kept
    assert samples_for_tv(0.02, 10, probs=np.full(10, 0.1)) == samples_for_tv(0.02, 10)


def test_pooling_small_cells():
    # expected counts with n = 100: [50, 45, 4, 1] -> cells 2 and 3 (5 together) are pooled
    res = chi_square_gof([50, 40, 6, 4], [0.50, 0.45, 0.04, 0.01])
    assert res.num_cells_used == 3 and res.dof == 2
    assert res.statistic == pytest.approx(0 / 50 + 25 / 45 + 25 / 5)
    # expected [50, 49, 0.5, 0.5]: the pooled cell (1.0) is still small -> merged with 49
    res = chi_square_gof([50, 45, 3, 2], [0.5, 0.49, 0.005, 0.005])
    assert res.num_cells_used == 2 and res.dof == 1
    assert res.statistic == pytest.approx(0.0)  # 50 vs 50 and 50 vs 50
    # the worst cells still name the unpooled culprit: cell 2, 3 observed vs 0.5 expected
    assert res.worst_cells[0].index == 2 and res.worst_cells[0].expected == pytest.approx(0.5)
    # every cell small: the pool never takes the largest cell too (that left nothing to test): two
    # groups, the exact binomial of the pooled one (expected 1.8 of 3, observed 2)
    res = chi_square_gof([1, 1, 1], [0.3, 0.3, 0.4])
    assert res.dof == 1 and res.method == "binomial"
    assert res.p_value == pytest.approx(stats.binomtest(2, 3, 0.6).pvalue)
    # min_expected=0 disables pooling
    assert chi_square_gof([1, 1, 1], [0.3, 0.3, 0.4], min_expected=0).num_cells_used == 3


def test_zero_probability_cells():
    # one observation in a probability-0 cell: impossible under p, p_value exactly 0
    res = chi_square_gof(np.array([500, 499, 1]), np.array([0.5, 0.5, 0.0]))
    assert res.p_value == 0.0 and math.isinf(res.statistic)
    assert res.worst_cells[0].index == 2 and math.isinf(res.worst_cells[0].residual)
    # an empty probability-0 cell is fine and does not count as a cell
    res = chi_square_gof(np.array([500, 500, 0]), np.array([0.5, 0.5, 0.0]))
    assert res.p_value == pytest.approx(1.0) and res.num_cells_used == 2


def test_torch_inputs_and_hand_value():
    # X^2 = (60-50)^2/50 + (40-50)^2/50 = 4 with 1 dof
    res = chi_square_gof(torch.tensor([60, 40]), torch.tensor([0.5, 0.5], dtype=torch.float32))
    assert res.statistic == pytest.approx(4.0) and res.dof == 1
    assert res.p_value == pytest.approx(stats.chi2.sf(4.0, 1))
    assert res.rejects(0.05) and not res.rejects(0.01)


def test_two_sample():
    rng = np.random.default_rng(3)
    p = _probs(12, 4)
    a = rng.multinomial(3000, p, size=1000)  # (R, C)
    b = rng.multinomial(2000, p, size=1000)  # (R, C)
    pv = np.array([chi_square_two_sample(x, y).p_value for x, y in zip(a, b)])  # (R,)
    assert stats.binomtest(int((pv < 0.05).sum()), pv.size, 0.05).pvalue > 1e-3
    # a TV 0.05 shift with 20k per side is rejected at 1e-3
    q, r = _least_favourable(12, 0.05)
    res = chi_square_two_sample(rng.multinomial(20000, q), rng.multinomial(20000, r))
    assert res.p_value < 1e-3
    # hand value: 2 x 2 table [[30, 20], [20, 30]], expected 25 everywhere, X^2 = 4 * 25/25 = 4
    assert chi_square_two_sample([30, 20], [20, 30]).statistic == pytest.approx(4.0)


def test_tv_interval_covers_truth():
    # 500 runs of n = 2000 from r with TV(r, p) = 0.05; the 0.99 interval must miss at most ~1%
    p, r = _least_favourable(10, 0.05)
    obs = np.random.default_rng(5).multinomial(2000, r, size=500)  # (R, C)
    res = [tv_distance(o, p, confidence=0.99) for o in obs]
    misses = sum(not (t.lower <= 0.05 <= t.upper) for t in res)
    assert stats.binomtest(misses, 500, 0.01, alternative="greater").pvalue > 1e-3, misses
    # the interval is informative: it excludes 0 at this n and shrinks like 1/sqrt(n)
    big = tv_distance(np.random.default_rng(6).multinomial(200000, r), p)
    assert 0 < big.lower <= 0.05 <= big.upper and big.upper - big.lower < 0.03
    # hand value: |0.6 - 0.5| + |0.4 - 0.5| = 0.2 -> TV 0.1
    assert tv_distance([60, 40], [0.5, 0.5]).tv == pytest.approx(0.1)


def test_joint_index_and_counts():
    tokens = np.array([[0, 0],  # -> 0
                       [1, 2],  # -> 1 * 3 + 2 = 5
                       [2, 2]])  # -> 8, the last cell of 3^2
    assert joint_index(tokens, 3).tolist() == [0, 5, 8]
    assert joint_index(torch.tensor(tokens), 3).tolist() == [0, 5, 8]
    assert counts(np.array([0, 5, 5, 8]), 9).tolist() == [1, 0, 0, 0, 0, 2, 0, 0, 1]
    with pytest.raises(ValueError, match="tokens must be in"):
        joint_index(np.array([[0, 3]]), 3)
    with pytest.raises(ValueError, match="int64"):
        joint_index(np.zeros((1, 20), dtype=np.int64), 10000)
    with pytest.raises(ValueError, match="indices"):
        counts(np.array([9]), 9)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: chi_square_gof([-1, 2], [0.5, 0.5]), "non-negative"),  # negative count
        (lambda: chi_square_gof([1, 2], [0.5, 0.6]), "sum to 1"),  # probs do not sum to 1
        (lambda: chi_square_gof([1, 2, 3], [0.5, 0.5]), "shapes must match"),  # shape mismatch
        (lambda: chi_square_gof([[1, 2]], [0.5, 0.5]), "1-D"),  # not 1-D
        (lambda: chi_square_gof([0, 0], [0.5, 0.5]), "at least one"),  # no samples
        (lambda: chi_square_gof([1, np.nan], [0.5, 0.5]), "finite"),  # NaN count
        (lambda: chi_square_gof([1, 2], [1.5, -0.5]), "non-negative"),  # negative probability
        (lambda: chi_square_two_sample([1, 2], [1, 2, 3]), "shapes must match"),
        (lambda: tv_distance([1, 2], [0.5, 0.5], confidence=1.0), "confidence"),
        (lambda: samples_for_tv(0.0, 10), "tv"),
        (lambda: samples_for_tv(0.02, 1), "num_cells"),
        (lambda: samples_for_tv(0.02, 10, alpha=0.0), "alpha"),
        (lambda: samples_for_tv(0.02, 10, power=1e-4), "power"),
        (lambda: samples_for_tv(0.02, 3, probs=[0.5, 0.5]), "shapes must match"),
        (lambda: detectable_tv(0, 10), "n must be"),
    ],
)
def test_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
