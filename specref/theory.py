"""Closed forms of speculative decoding (Leviathan et al. 2023, Sec. 3.1-3.4).

- acceptance rate (Definition 3.1, Corollary 3.6): beta = sum_x min(p(x), q(x)) = 1 - TV(p, q);
  alpha is its expectation over contexts;
- expected tokens per target forward (Eq. 1): (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1;
- expected walltime improvement (Theorem 3.8): (1 - alpha^(k+1)) / ((1 - alpha)(1 + c k)), c the
  cost of one draft step relative to one target forward;
- the optimal k (Sec. 3.4, Figure 3): the integer argmax of the improvement over k = 1..k_max;
- the number of accepted drafts N under i.i.d. acceptance (the paper's simplifying assumption):
  P(N = n) = alpha^n (1 - alpha) for n < k, P(N = k) = alpha^k (a capped geometric).

Adaptive draft length (used by ngram.py and eagle_head.py, our addition): per row, a decayed
estimate of the per-token acceptance rate (`DecayedAcceptance`) and the k' <= k maximising the
improvement with a verify cost 1 + c0 [k' > 0] + c k' (`best_draft_length`, `check_costs`).
Left out: the arithmetic-operations bound (Theorem 3.11) and non-i.i.d. acceptance.
"""
from __future__ import annotations

import numpy as np
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


# ----------------------------------------------------------------------------- adaptive draft length


def best_draft_length(a: np.ndarray, k: int, c: float, c0: float = 0.0, min_gain: float = 0.0) -> np.ndarray:
    """argmax over k' in 0..k of (1 - a^(k'+1)) / ((1 - a)(1 + c0 [k' > 0] + c k')), per row;
    ties -> shorter; 0 unless the best expected speed-up is at least 1 + min_gain."""
    kk = np.arange(k + 1)  # (k+1,)
    a = np.clip(np.asarray(a, dtype=np.float64), 0.0, 1.0 - 1e-9)[:, None]  # (B, 1)
    cost = 1.0 + c0 * (kk > 0) + c * kk  # (k+1,) verify cost of a block of k'+1 tokens
    gain = (1.0 - a ** (kk + 1)) / ((1.0 - a) * cost)  # (B, k+1)
    best = gain.argmax(axis=1).astype(np.int64)  # (B,) first maximum = shortest
    return np.where(gain.max(axis=1) >= 1.0 + min_gain, best, 0)  # (B,)


def check_costs(cfg) -> None:
    """ValueError unless an adaptive config's cost fields are finite and >= 0 (draft_cost,
    verify_cost_fixed and, where present, min_gain), memory is in [0, 1] and prior_accept in (0, 1)."""
    for name in ("draft_cost", "verify_cost_fixed", "min_gain"):
        v = getattr(cfg, name, 0.0)
        if not (isinstance(v, (int, float)) and 0.0 <= v < float("inf")):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if not (isinstance(cfg.memory, (int, float)) and 0.0 <= cfg.memory <= 1.0):
        raise ValueError(f"memory must be in [0, 1], got {cfg.memory!r}")
    if not (isinstance(cfg.prior_accept, (int, float)) and 0.0 < cfg.prior_accept < 1.0):
        raise ValueError(f"prior_accept must be in (0, 1), got {cfg.prior_accept!r}")


class DecayedAcceptance:
    """Per-row posterior mean of the per-token acceptance rate a, from counts of accepted and
    rejected draft tokens that decay by `memory` per observed step, started from 2
    pseudo-observations at rate `prior` (which decay too, so a row whose drafts keep failing
    converges to a -> 0)."""

    def __init__(self, batch: int, prior: float, memory: float):
        self.memory = memory
        self.hits = np.full(batch, 2.0 * prior)  # (B,)
        self.misses = np.full(batch, 2.0 * (1.0 - prior))  # (B,)

    @property
    def rate(self) -> np.ndarray:
        return self.hits / (self.hits + self.misses)  # (B,)

    def observe(self, hits: np.ndarray, misses: np.ndarray, seen: np.ndarray) -> None:
        """Rows with seen (B,) True add hits / misses (B,) after decaying; the others stay."""
        decay = np.where(seen, self.memory, 1.0)  # (B,)
        self.hits = self.hits * decay + np.where(seen, hits, 0.0)
        self.misses = self.misses * decay + np.where(seen, misses, 0.0)
