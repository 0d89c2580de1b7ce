"""The oracle's lossless mode: is what a verification step EMITS distributed as the target's?

Leviathan et al. 2023 (Theorem 3.5) prove one rule lossless; many others are too (SpecInfer's
multi-step speculative sampling in any sibling order, a trie merge of repeated siblings, SpecTr,
block verification of Sun et al. 2024). What they share is a property of the emitted tokens e_1..e_n
(n >= 1, random): for every token prefix s,

    P(e_{|s|+1} = t | e_1..e_|s| = s, n > |s|) = p(t | s)    (s empty: the first token ~ p at the root).

If every step of a loop has this property (with fresh randomness per step), the loop's output is
distributed as the target's: the token after s is either emitted by this step (law p(. | s) by the
property) or is the next step's first token (law p(. | s) again), whatever decided where the step
stopped. And it is necessary: a step that violates it at some s changes the law of the token after s.
The test is per depth d = |s|: over the rows that emitted more than d tokens, grouped by their first
d tokens, a chi-square of the next token against p(. | s) per prefix (rare cells pooled, stats.py),
the statistics and degrees of freedom summed over the prefixes of depth d (one test per depth, so the
count of tests is fixed before the data; Bonferroni over them). It tests the conditionals, not the
length of the step or which node emitted a token: `law="specinfer"` (tree_check) and the chain's
token-wise law ask those stricter questions.

Power per depth: a deviation of TV t in the conditional at every prefix of depth d gives the summed
statistic a noncentrality of at least 4 t^2 N_d (N_d rows tested at depth d, stats.py), so the
conditional's detectable TV is t_d; the step's output law moves by pi_d t_d (pi_d = N_d / rows, the
share of rows that reach depth d), the per-depth detectable TV of the output law that the verdict
compares with its bound.

Left out: dependence ACROSS steps (a reused seed, a residual carried over): a single step cannot show
it; pair a lossless verdict with check_generator on a whole decoder. Prefix-by-prefix tests (one
deviating prefix among many is diluted in its depth's sum; the worst prefix is named).
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from .stats import chi_square_gof, detectable_tv, tv_distance
from .tree_cases import TreeVariant, depths, heap_rows

MIN_ROWS = 25  # a prefix with fewer rows carries no test (unless it emits a token p cannot): pooled sparse tables
#                inflate the chi-square tail (measured: 3.7% of depth-1 p-values below 0.01 with 10 rows)
MIN_EXPECTED = 10.0  # cells pooled up to this expected count (stats.py pools at 5): an upward count over an
#                      expected 5 has a heavier tail than chi-square; one correct run gave p 1e-6 that way


def prefix_table(v: TreeVariant, vocab: int) -> Tuple[np.ndarray, np.ndarray]:
    """keys (R,) sorted heap keys of the token prefixes whose p the variant defines, table (R, V) p(. | s).

    A prefix (x_1..x_d) has the heap key sum_{d'<d} V^d' + joint_index(x) (the root 0; the child x of
    key r is r V + 1 + x), the row order of sampled variants' tables; deterministic variants define
    p at their nodes' token paths (equal paths share a row, tree_cases._fixed)."""
    p = v.p.double().cpu().numpy()
    p = p / p.sum(1, keepdims=True)
    if v.tokens is None:
        return np.arange(p.shape[0], dtype=np.int64), p
    keys = [0]
    for par, t in zip(v.parents, v.tokens):
        keys.append(keys[par + 1] * vocab + 1 + t)
    keys = np.array(keys, dtype=np.int64)  # (N+1,)
    uniq, first = np.unique(keys, return_index=True)  # equal token paths: the first node's row
    return uniq, p[first]


def num_depths(v: TreeVariant) -> int:
    """Depths tested: 0..D, D the tree's depth (a step emits at most D + 1 tokens)."""
    return 1 + max(depths(v.parents), default=0)


def emitted(m: np.ndarray, x: np.ndarray, y: np.ndarray, D: int) -> np.ndarray:
    """Emitted tokens (n, D+1), -1 padded: the accepted path's tokens x (n, D) then the final y."""
    n = m.shape[0]
    E = np.full((n, D + 1), -1, dtype=np.int64)  # (n, D+1)
    if D:
        E[:, :D] = np.where(np.arange(D)[None] < m[:, None], x[:, :D], -1)
    E[np.arange(n), m] = y
    return E


def _prefix_name(key: int, vocab: int) -> str:
    toks = []
    while key > 0:
        key, t = divmod(key - 1, vocab)
        toks.append(t)
    return "(" + ",".join(str(t) for t in toks[::-1]) + ")"


def lossless_tests(name: str, v: TreeVariant, vocab: int, rec, threshold: float, test_result: Callable):
    """The per-depth tests of one variant's rows rec = (end, m, x, y): -> (tests, power lines)."""
    from scipy import stats

    _, m, x, y = rec
    n_rows, V = m.shape[0], vocab
    D = num_depths(v) - 1
    keys, table = prefix_table(v, V)
    E = emitted(m, x, y, D)  # (n, D+1)
    key = np.zeros(n_rows, dtype=np.int64)  # (n,) heap key of the first d emitted tokens
    tests, power = [], []
    for d in range(D + 1):
        if d:
            key = key * V + 1 + np.maximum(E[:, d - 1], 0)
        sel = m >= d  # rows that emitted more than d tokens
        if not sel.any():
            continue
        k, nxt = key[sel], E[sel, d]  # (N_d,), (N_d,)
        uk, grp = np.unique(k, return_inverse=True)  # (S,), (N_d,)
        at = np.searchsorted(keys, uk)  # (S,)
        known = (at < keys.size) & (keys[np.minimum(at, keys.size - 1)] == uk)  # (S,)
        assert known.all(), f"{name}: emitted prefixes outside the tree's paths reached the test"
        obs = np.zeros((uk.size, V))  # (S, V) counts of the next token per prefix
        np.add.at(obs, (grp, nxt), 1.0)
        probs = table[at]  # (S, V)
        stat, dof, n_used, best = 0.0, 0, 0, (2.0, None)
        impossible = ((probs == 0) & (obs > 0)).any(1)  # (S,) a token p(. | s) cannot emit
        for s in np.flatnonzero((obs.sum(1) >= MIN_ROWS) | impossible):  # fewer rows: the chi-square tail is not trusted
            g = chi_square_gof(obs[s], probs[s], min_expected=MIN_EXPECTED)
            stat, dof = stat + g.statistic, dof + g.dof
            n_used += g.n if g.dof > 0 or g.p_value == 0.0 else 0
            if g.p_value < best[0]:
                best = (g.p_value, (uk[s], g))
        p_value = 0.0 if not np.isfinite(stat) else (float(stats.chi2.sf(stat, dof)) if dof > 0 else 1.0)
        w = obs.sum(1, keepdims=True) / sel.sum()  # (S, 1) share of each prefix
        tv = tv_distance(obs.reshape(-1), (w * probs).reshape(-1))  # weighted TV of the conditionals
        det = detectable_tv(max(n_used, 1), max(2, dof + 1), alpha=threshold, power=0.95)
        worst = ()
        if best[1] is not None:
            s_key, g = best[1]
            pre = _prefix_name(int(s_key), V)
            worst = tuple((f"prefix {pre} token {c.index}", c.expected, c.observed) for c in g.worst_cells)
        label = f"{name} depth {d}"
        tests.append(test_result(label, "depth", p_value, stat, dof, int(sel.sum()), tv, det, worst))
        power.append((label, det * n_used / n_rows))
    return tests, power
