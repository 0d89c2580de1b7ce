"""The oracle for whole decoders: is the joint of the first L generated tokens exactly the target's?

A lossless speculative decoder must emit sequences distributed as direct sampling from the target
(Leviathan et al. 2023, Theorem 3.5, applied token after token). On a model whose sequence
distribution specref computes exactly - a tiny HF causal LM with a small vocabulary
(exact.hf_joint_distribution, V^L continuations enumerated by the chain rule) or the toy Markov LM
(toy.MarkovLM.joint_probs) - `check_generator` runs the user's decoder on many copies of one
prompt and tests the joint distribution of the first L tokens (a chi-square goodness-of-fit over
V^L cells, rare cells pooled), each position's marginal, and reports TV distances with confidence
intervals, the worst cells and the smallest TV deviation the run could detect with 95% power.
Bonferroni over the L + 1 tests keeps the family-wise significance at alpha.
Left out: sequential early stopping (the decoder is run once, in batches).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from ..sampling import SamplingConfig
from . import stats
from .report import Report, TestResult, check_bound, decide, needed


def exact_joint(model, prompt: torch.Tensor, L: int, sampling: SamplingConfig) -> np.ndarray:
    """Exact (V^L,) joint of the next L tokens for an HF causal LM or a toy MarkovLM."""
    if hasattr(model, "joint_probs"):
        return model.joint_probs(prompt.view(1, -1), L, sampling).double().numpy().reshape(-1)
    from .exact import hf_joint_distribution

    return hf_joint_distribution(model, prompt.view(-1), L, sampling).double().numpy()


def _test(name: str, kind: str, counts: np.ndarray, probs: np.ndarray, threshold: float,
          labels: Callable[[int], str]) -> TestResult:
    gof = stats.chi_square_gof(counts, probs)
    n = int(counts.sum())
    keep = probs * n >= 5  # the partition the test uses after pooling
    pooled = np.append(probs[keep], probs[~keep].sum())
    det = stats.detectable_tv(n, len(pooled), alpha=threshold, power=0.95, probs=pooled)
    worst = tuple((labels(c.index), c.expected, c.observed) for c in gof.worst_cells)
    return TestResult(name=name, kind=kind, p_value=gof.p_value, statistic=gof.statistic, dof=gof.dof,
                      n=n, tv=stats.tv_distance(counts, probs), detectable_tv=det, worst=worst)


def check_generator(fn: Callable, model, prompt, *, length: int = 3, samples: int = 50_000,
                    sampling: SamplingConfig = SamplingConfig(), alpha: float = 1e-3, seed: int = 0,
                    batch: Optional[int] = None, tv_bound: float = 0.05) -> Report:
    """Check a whole decoder against the exact distribution of `model`.

    fn(input_ids (n, T) long, max_new_tokens, generator) -> tokens (n, >= length): the decoder under
    test, sampling with `sampling`'s settings from `model` (e.g. a lambda around
    specref.speculative_generate or another engine). prompt: (T,) token ids. Runs `samples` rows
    in batches of `batch` (default: all at once). Verdict PASS / FAIL / INCONCLUSIVE (no failure,
    but the joint test's detectable TV is above tv_bound).
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    check_bound(tv_bound)
    prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
    exact = exact_joint(model, prompt, length, sampling)  # (V^L,)
    V = int(round(exact.size ** (1.0 / length)))
    gen = torch.Generator().manual_seed(seed)
    batch = batch or samples
    rows, errors = [], []
    for s in range(0, samples, batch):
        n = min(batch, samples - s)
        out = torch.as_tensor(fn(prompt.expand(n, -1).clone(), length, gen))
        if out.dim() != 2 or out.shape[0] != n or out.shape[1] < length:
            errors.append(f"decoder returned shape {tuple(out.shape)}, expected ({n}, >= {length})")
            break
        rows.append(out[:, :length].cpu().numpy())
    if errors:
        return Report(False, alpha, 0.0, (), tuple(errors), 0, float("nan"), False, "FAIL", tv_bound)
    toks = np.concatenate(rows)  # (S, L)
    bad = (toks < 0) | (toks >= V)
    if bad.any():
        errors.append(f"{int(bad.any(1).sum())} rows hold tokens outside [0, {V}) in the first {length}")
        toks = np.clip(toks, 0, V - 1)
    threshold = alpha / (length + 1)
    joint_counts = stats.counts(stats.joint_index(toks, V), V ** length)
    tests = [_test(f"joint of the first {length} tokens", "joint", joint_counts, exact, threshold,
                   lambda i: str(tuple(int(x) for x in np.unravel_index(i, (V,) * length))))]
    marg = exact.reshape((V,) * length)
    for i in range(length):
        axes = tuple(a for a in range(length) if a != i)
        p_i = marg.sum(axis=axes) if axes else marg
        tests.append(_test(f"token {i + 1}", "pos", np.bincount(toks[:, i], minlength=V), p_i, threshold,
                           lambda c: f"token {c}"))
    det = tests[0].detectable_tv
    verdict = decide(errors, tests, threshold, det, tv_bound)
    return Report(passed=verdict == "PASS", alpha=alpha, threshold=threshold, tests=tuple(tests), errors=tuple(errors),
                  samples=int(toks.shape[0]), detectable_tv=det, stopped_early=False, verdict=verdict,
                  tv_bound=tv_bound, samples_needed=needed(samples, det, tv_bound))
