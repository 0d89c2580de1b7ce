"""The oracle's power statement means what it says (specref/oracle/lossless.py, stats.py, power_mutants.py).

Three ways a lossy sampler got PASS before: rows of prefixes too sparse for a table counted as
tested; a pool that took the dominant cell too left a depth with no test (dof 0, p 1); the verdict
took the worst depth while deviations at several depths add up in the output law. And the chi-square
tail was 4-8x nominal at the per-test threshold on skewed tables. Each is pinned here.
"""
import numpy as np
import pytest
from scipy import stats

import specref
from specref.oracle.check import check_rejection_sampler
from specref.oracle.lossless import MIN_EXPECTED, MIN_ROWS, depth_claim
from specref.oracle.power_mutants import POWER_MUTANTS, chain_mutant, tree_mutant
from specref.oracle.stats import chi_square_gof, gof_test, null_tail
from specref.oracle.tree_cases import standard_tree_cases
from specref.oracle.tree_check import check_tree_sampler

SMALL = tuple(c for c in standard_tree_cases() if c.vocab <= 6)


def test_a_near_one_hot_table_keeps_a_test():
    # p = (0.997, 0.001 x 3) over 2,000 rows: the minor cells expect 2 each, 6 together; every row
    # emitting a p = 0.001 token (TV 0.997) used to pool into one group: dof 0, p 1. Now the minor
    # group keeps its own cell, tested by the exact binomial
    p = np.array([0.997, 0.001, 0.001, 0.001])
    for test in (chi_square_gof, gof_test):
        res = test(np.array([0, 2000, 0, 0]), p, min_expected=10.0)
        assert res.dof == 1 and res.method == "binomial" and res.p_value < 1e-300, res
        assert test(np.array([1994, 2, 3, 1]), p, min_expected=10.0).p_value > 0.1  # as expected: no rejection
    assert gof_test(np.array([1994, 2, 3, 1]), p).hidden_mass == pytest.approx(0.003)  # what the pool hides


def test_per_prefix_test_is_calibrated_at_the_per_test_threshold():
    # exact null tails, every grouped outcome enumerated: within 2x nominal at 2e-5 on skewed tables
    # (Pearson's X^2 against chi-square: 4.6-8x there)
    for p, n in (([0.9, 0.05, 0.05], 200), ([0.98, 0.01, 0.01], 1000), ([0.997, 0.001, 0.001, 0.001], 1000),
                 ([0.6, 0.3, 0.1], 60), ([0.5, 0.25, 0.25], 40), ([0.8, 0.1, 0.1], 10)):
        assert null_tail(np.array(p), n, 2e-5, min_expected=MIN_EXPECTED) <= 2 * 2e-5, (p, n)
    # the enumeration agrees with gof_test outcome by outcome on a table it cannot pool
    p, n = np.array([0.6, 0.2, 0.2]), 40
    brute = sum(stats.multinomial.pmf([a, b, n - a - b], n, p) for a in range(n + 1) for b in range(n + 1 - a)
                if gof_test([a, b, n - a - b], p).p_value < 0.01)
    assert null_tail(p, n, 0.01) == pytest.approx(brute, rel=1e-9)


def test_depth_claim_counts_untested_rows_and_pooled_mass_as_unpowered():
    V = 4
    P = np.full((3, V), 0.25)  # three prefixes, uniform p
    # every prefix below MIN_ROWS: nothing is claimed for them: the whole depth's share of the rows
    N = np.array([MIN_ROWS - 1, 3, 1], dtype=float)
    assert depth_claim(N, P, 1000, 1e-4) == pytest.approx(N.sum() / 1000)
    # one prefix tested: its visible part shrinks with rows, the untested rows stay whole
    N2 = np.array([5000, 3, 1], dtype=float)
    c = depth_claim(N2, P, 10_000, 1e-4)
    assert 4 / 10_000 < c < 4 / 10_000 + 5000 / 10_000
    # a pooled group hides its p-mass: (0.9, 0.04, 0.03, 0.03) at 100 rows expects 90, 4, 3, 3: the
    # three small cells pool (10), so their mass 0.1 of the 100 rows is claimed as unseen
    P3 = np.array([[0.9, 0.04, 0.03, 0.03]])
    assert depth_claim(np.array([100.0]), P3, 100, 1e-4) >= 0.1


def test_the_step_claim_sums_its_depths():
    rep = check_rejection_sampler(specref.verify_chain, samples=600, seed=1)
    lines = dict(rep.power)
    for name in {n.rsplit(" depth ", 1)[0] for n in lines if " depth " in n}:
        depths = [v for n, v in lines.items() if n.startswith(name + " depth ")]
        assert lines[name + " step"] == pytest.approx(min(1.0, sum(depths)))
    assert rep.detectable_tv == max(v for n, v in rep.power if n.endswith(" step"))


@pytest.mark.parametrize("name", sorted(POWER_MUTANTS))
def test_mutants_that_hide_in_thin_power_never_pass(name):
    # (a) a corrupted bonus on rare paths, (b) a tiny-probability bonus under a near one-hot p,
    # (c) a thin deviation over every depth: FAIL or INCONCLUSIVE, never PASS, chains and trees
    chain = check_rejection_sampler(chain_mutant(name), samples=2_000, seed=4)
    tree = check_tree_sampler(tree_mutant(name), samples=1_500, seed=4, cases=SMALL)
    assert chain.verdict != "PASS" and tree.verdict != "PASS", (chain.summary(), tree.summary())
    assert chain.verdict == "FAIL", chain.summary()  # the exact tests of the sparse rows see these
    with pytest.raises(ValueError, match="name"):
        chain_mutant("nope")
