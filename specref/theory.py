"""Closed forms of speculative decoding (Leviathan et al. 2023, Sec. 3.1-3.4).

- acceptance rate (Definition 3.1, Corollary 3.6): beta = sum_x min(p(x), q(x)) = 1 - TV(p, q);
  alpha is its expectation over contexts;
- expected tokens per target forward (Eq. 1): (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1;
- expected walltime improvement (Theorem 3.8): (1 - alpha^(k+1)) / ((1 - alpha)(1 + c k)), c the
  cost of one draft step relative to one target forward;
- the optimal k (Sec. 3.4, Figure 3): the integer argmax of the improvement over k = 1..k_max;
- the number of accepted drafts N under i.i.d. acceptance (the paper's simplifying assumption):
  P(N = n) = alpha^n (1 - alpha) for n < k, P(N = k) = alpha^k (a capped geometric).
Left out: the arithmetic-operations bound (Theorem 3.11) and non-i.i.d. acceptance.
"""
from __future__ import annotations

import torch


def _check_alpha(alpha: float) -> float:
    if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_k(k: int, least: int = 0) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < least:
        raise ValueError(f"k must be an int >= {least}, got {k!r}")
    return k


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """beta = sum_x min(p(x), q(x)) over the last dim: the probability that one draft token sampled
    from q is accepted by p. p, q (..., V) -> (...)."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)  # (...)


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per target forward] = (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha = 1."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """Expected walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(1 + c k))."""
    if not isinstance(c, (int, float)) or not c >= 0 or c == float("inf"):
        raise ValueError(f"c (draft cost / target cost) must be a finite number >= 0, got {c!r}")
    return expected_tokens(alpha, k) / (1.0 + c * k)


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The k in 1..k_max maximising speedup(alpha, k, c) (the smallest one on ties). k_max bounds
    the search: at c = 0 the improvement grows with k for every alpha > 0."""
    _check_k(k_max, 1)
    best = max(range(1, k_max + 1), key=lambda k: (speedup(alpha, k, c), -k))
    return best


def accepted_length_pmf(alpha: float, k: int) -> torch.Tensor:
    """P(N = n), n = 0..k accepted drafts when each is accepted independently with probability
    alpha: alpha^n (1 - alpha) for n < k, alpha^k for n = k. Returns (k+1,) float64, sums to 1;
    the mean of N + 1 is expected_tokens(alpha, k)."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    n = torch.arange(k + 1, dtype=torch.float64)  # (k+1,)
    pmf = alpha ** n * (1.0 - alpha)  # (k+1,)
    pmf[k] = alpha ** k
    return pmf
