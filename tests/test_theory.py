"""Closed forms of speculative decoding (specref/theory.py) against the paper's numbers and their
own definitions. The Monte-Carlo checks of these forms against verify_chain are in test_rejection.py."""
import math

import pytest
import torch

from specref.theory import acceptance_rate, accepted_length_pmf, expected_tokens, optimal_k, speedup

# (alpha, c) -> speedup at k = 3, 5, 7, rounded to 2 decimals (the table).
TABLE = [
    (0.75, 0.05, (2.38, 2.63, 2.67)),  # a good draft, cheap: longer drafts still pay
    (0.55, 0.20, (1.26, 1.08, 0.92)),  # a mediocre draft, costly: k = 7 is slower than no speculation
    (0.25, 0.00, (1.33, 1.33, 1.33)),  # a free but poor draft: 1/(1 - alpha) caps it
    (0.75, 0.40, (1.24, 1.10, 0.95)),  # a good but expensive draft
]


@pytest.mark.parametrize("alpha,c,want", TABLE)
def test_speedup_table(alpha, c, want):
    got = tuple(round(speedup(alpha, k, c), 2) for k in (3, 5, 7))
    assert got == want


def test_expected_tokens_closed_form_and_limits():
    # the geometric sum 1 + alpha + ... + alpha^k
    for alpha in (0.0, 0.3, 0.9, 0.999999):
        for k in (0, 1, 4):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)), rel=1e-6)
    assert expected_tokens(1.0, 4) == 5.0  # alpha = 1: every draft accepted, plus the bonus
    assert expected_tokens(0.0, 4) == 1.0  # alpha = 0: only the recovered token
    assert speedup(1.0, 4, 0.25) == 2.5  # 5 / (1 + 0.25 * 4)


def test_optimal_k():
    # brute force agrees; a poor expensive draft wants k = 1, a free good one wants k_max
    for alpha, c in ((0.75, 0.05), (0.55, 0.2), (0.9, 0.01), (0.2, 0.5)):
        best = max(range(1, 17), key=lambda k: speedup(alpha, k, c))
        assert optimal_k(alpha, c) == best
    assert optimal_k(0.1, 0.5) == 1
    assert optimal_k(0.9, 0.0, k_max=10) == 10
    assert optimal_k(0.8, 0.05) == 8  # speedups 3.082 (k=7), 3.092 (k=8), 3.078 (k=9)
    s = [speedup(0.8, k, 0.05) for k in (7, 8, 9)]
    assert s[1] > s[0] and s[1] > s[2]


def test_acceptance_rate_is_one_minus_tv():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(7, 11, generator=g), -1)  # (7, 11)
    q = torch.softmax(torch.randn(7, 11, generator=g), -1)  # (7, 11)
    tv = 0.5 * (p - q).abs().sum(-1)  # (7,)
    assert torch.allclose(acceptance_rate(p, q), 1 - tv, atol=1e-6)
    assert torch.allclose(acceptance_rate(p, p), torch.ones(7), atol=1e-6)
    # hand-built: p = (.5, .5, 0), q = (1, 0, 0) -> min = (.5, 0, 0)
    assert acceptance_rate(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.0])).item() == 0.5


def test_accepted_length_pmf():
    pmf = accepted_length_pmf(0.6, 3)
    # n = 0: reject at once; 1, 2: accept n then reject; 3: accept all three
    want = torch.tensor([0.4, 0.6 * 0.4, 0.36 * 0.4, 0.216], dtype=torch.float64)
    assert torch.allclose(pmf, want)
    for alpha, k in ((0.0, 2), (1.0, 2), (0.37, 6)):
        pmf = accepted_length_pmf(alpha, k)
        assert pmf.sum().item() == pytest.approx(1.0)
        mean_tokens = float((pmf * torch.arange(k + 1)).sum()) + 1  # E[N] + the last token
        assert mean_tokens == pytest.approx(expected_tokens(alpha, k))


@pytest.mark.parametrize("call", [
    lambda: expected_tokens(1.5, 3),
    lambda: expected_tokens(0.5, -1),
    lambda: expected_tokens(0.5, 2.0),
    lambda: speedup(0.5, 3, -0.1),
    lambda: optimal_k(0.5, 0.1, k_max=0),
    lambda: accepted_length_pmf(float("nan"), 3),
    lambda: acceptance_rate(torch.ones(3) / 3, torch.ones(4) / 4),
])
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()
