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

Power, honest about what is not tested (depth_claim): a depth's test detects, with 95% power, a
deviation of the step's output law of det(N_T) N_T / n (the rows of the prefixes with a table of
their own; 4 t^2 N noncentrality, stats.py) plus what it cannot see at all: the p-mass inside
pooled groups and every row of a prefix too sparse for a table (those rows still get an exact
test, pit_test, but no power is claimed for them). Deviations at different depths add up in the
output law, so a step's detectable TV is the SUM over its depths (the "step" power line), which
the verdict compares with its bound; report.samples_needed projects it to more rows.

Left out: dependence ACROSS steps (a reused seed, a residual carried over): a single step cannot show
it; pair a lossless verdict with check_generator on a whole decoder. Prefix-by-prefix tests (one
deviating prefix among many is diluted in its depth's sum; the worst prefix is named).
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from .stats import _grouped, detectable_tv, gof_test, tv_distance
from .tree_cases import TreeVariant, depths, heap_rows

MIN_ROWS = 10  # a prefix with fewer rows gets no table of its own: its rows go to the exact pit_test, unpowered
#                (the PIT's bins pool rows of many prefixes into one exact table)
MIN_EXPECTED = 5.0  # cells pooled up to this expected count; gof_test stays within 2x nominal far in the tail
#                      (exact tails: at most 1.75x nominal at the per-test thresholds, lossless_selftest)


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


def _detect_impossible(N: float) -> float:
    """The TV t of a deviation at a prefix whose p is one-hot that N rows show (an impossible token
    at least once) with probability 0.95: 1 - (1 - t)^N = 0.95."""
    return 1.0 - 0.05 ** (1.0 / N)


def pit_bins(untested: float) -> int:
    """Bins of the probability-integral test of the untested rows (expected >= 10 per bin, 2..10)."""
    return int(min(10, max(2, untested // 10)))


def depth_claim(N: np.ndarray, P: np.ndarray, n_rows: float, threshold: float) -> float:
    """The TV of the step's output law that the test of one depth detects with 95% power (an upper
    bound on what it can miss): N (S,) rows per prefix of that depth, P (S, V) p(. | s), n_rows rows
    of the variant. With T the prefixes tested (>= MIN_ROWS rows), N_T their rows, a deviation t_s
    per prefix moves the output law by sum_s (N_s / n) t_s. Three parts of it:
    - visible in T's grouped tables: the summed statistic has noncentrality >= 4 sum_T N_s t_s^2 >=
      4 (sum_T N_s t_s)^2 / N_T (Cauchy-Schwarz), so det(N_T, dof) N_T / n is detected;
    - inside a pooled group (mass h_s moved among its cells keeps the group's count): <= sum_T N_s h_s / n;
    - in untested prefixes (too few rows for a table): all of their rows, U / n; and where p is
      one-hot only an impossible token can deviate, seen once N t >~ 3.
    The bound is the sum (a deviation split over the parts escapes unless one part is detected)."""
    tested = N >= MIN_ROWS  # (S,)
    support = (P > 0).sum(1)  # (S,)
    n_used = dof = hidden = extra = 0.0
    for s in np.flatnonzero(tested):
        if support[s] == 1:
            extra += N[s] * _detect_impossible(N[s])
            continue
        _, e_g, h = _grouped(np.zeros_like(P[s]), P[s], N[s] * P[s], MIN_EXPECTED)
        dof += e_g.size - 1
        n_used += N[s]
        hidden += N[s] * h
    untested = float(N[~tested].sum())
    if untested >= 2:
        dof += pit_bins(untested) - 1  # the untested rows' test adds its dof to the depth's sum
    det = detectable_tv(max(n_used, 1.0), int(dof) + 1, alpha=threshold, power=0.95) if n_used and dof else 0.0
    return min(float(N.sum()), det * n_used + hidden + untested + extra) / n_rows


def pit_test(nxt: np.ndarray, probs: np.ndarray, seed: int):
    """The untested rows' test: the randomised probability integral transform u = F(x-) + w p(x)
    (tokens ordered by p, ties by index; w ~ U(0, 1)) is exactly U(0, 1) under the null, whatever
    each row's prefix, so rows of many sparse prefixes pool into one exact table of u's bins. It
    sees gross deviations (a bonus always p's least likely token); its rows count as unpowered."""
    order = np.argsort(-probs, axis=1, kind="stable")  # (n, V) tokens by p, descending
    ranked = np.take_along_axis(probs, order, 1)  # (n, V)
    rank = np.argsort(order, axis=1)[np.arange(nxt.size), nxt]  # (n,)
    below = np.cumsum(ranked, 1)[np.arange(nxt.size), rank] - ranked[np.arange(nxt.size), rank]  # (n,) F(x-)
    w = np.random.default_rng(seed).random(nxt.size)  # (n,)
    u = np.clip(below + w * probs[np.arange(nxt.size), nxt], 0.0, 1.0 - 1e-12)  # (n,)
    M = pit_bins(nxt.size)
    obs = np.bincount((u * M).astype(np.int64), minlength=M).astype(np.float64)  # (M,)
    return gof_test(obs, np.full(M, 1.0 / M), min_expected=0.0)


def lossless_tests(name: str, v: TreeVariant, vocab: int, rec, threshold: float, test_result: Callable):
    """The per-depth tests of one variant's rows rec = (end, m, x, y): -> (tests, power lines).

    One test per depth d: per prefix with >= MIN_ROWS rows (or a token p cannot emit) the calibrated
    table test stats.gof_test, the untested rows' pit_test, their chi-square equivalents summed. The
    power lines: (depth, its depth_claim) and last (step, the sum over depths, a projection rows ->
    claim): deviations at different depths add up in the output law, so the step's bound is the sum."""
    from scipy import stats

    _, m, x, y = rec
    n_rows, V = m.shape[0], vocab
    D = num_depths(v) - 1
    keys, table = prefix_table(v, V)
    E = emitted(m, x, y, D)  # (n, D+1)
    key = np.zeros(n_rows, dtype=np.int64)  # (n,) heap key of the first d emitted tokens
    tests, power, claims = [], [], []
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
        N = obs.sum(1)  # (S,)
        stat, dof, best = 0.0, 0, (2.0, None)
        impossible = ((probs == 0) & (obs > 0)).any(1)  # (S,) a token p(. | s) cannot emit
        tested = (N >= MIN_ROWS) | impossible  # (S,)
        for s in np.flatnonzero(tested):
            g = gof_test(obs[s], probs[s], min_expected=MIN_EXPECTED)
            stat, dof = stat + g.statistic, dof + g.dof
            if g.p_value < best[0]:
                best = (g.p_value, (uk[s], g))
        sparse = ~tested[grp]  # (N_d,) rows of untested prefixes
        if sparse.sum() >= 2:
            g = pit_test(nxt[sparse], probs[grp[sparse]], seed=d * 7919 + int(sparse.sum()))
            stat, dof = stat + g.statistic, dof + g.dof
            if g.p_value < best[0]:
                best = (g.p_value, (None, g))
        p_value = 0.0 if not np.isfinite(stat) else (float(stats.chi2.sf(stat, dof)) if dof > 0 else 1.0)
        w = N[:, None] / sel.sum()  # (S, 1) share of each prefix
        tv = tv_distance(obs.reshape(-1), (w * probs).reshape(-1))  # weighted TV of the conditionals
        claim = depth_claim(N, probs, n_rows, threshold)
        worst = ()
        if best[1] is not None:
            s_key, g = best[1]
            pre = "untested prefixes, u bin" if s_key is None else f"prefix {_prefix_name(int(s_key), V)} token"
            worst = tuple((f"{pre} {c.index}", c.expected, c.observed) for c in g.worst_cells)
        label = f"{name} depth {d}"
        tests.append(test_result(label, "depth", p_value, stat, dof, int(sel.sum()), tv, claim, worst))
        power.append((label, claim))
        claims.append((N, probs))
    project = lambda f: sum(depth_claim(N * f, P, n_rows * f, threshold) for N, P in claims)  # noqa: E731
    power.append((f"{name} step", min(1.0, sum(c for _, c in power)), lambda f: min(1.0, project(f))))
    return tests, power
