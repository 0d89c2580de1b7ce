"""Tests of the chain rejection step (specref/rejection.py: verify_chain, verify_chain_greedy).

Statistical tests run ONE batched call of B = 200,000 independent copies of a step, with fixed
seeds, and test at significance 1e-3 with Pearson chi-square (specref/oracle/stats.py). Each states its
power against a total-variation deviation of 0.02 via oracle.samples_for_tv (power 0.99).

The step under test, for each copy: drafts x_1..x_K are drawn from a draft whose distribution at
position i depends on i and on the previous token (Q[i, prev]); the target's rows are P[i, prev]
(prev = the previous draft token, or a start state), warped by temperature / top-k / top-p. So
p depends on the drafted prefix, as for a real model. Exact laws (derived in _exact_joint):
  - the token emitted at position i, given that it exists and the previous token is s, is P[i, s];
  - the joint of (accepted length m, emitted y_1..y_{m+1}) is
    prod_{i<m} A_i(y_{i+1} | y_i) * R_m(y_{m+1} | y_m), with A = min(p, q) and R = max(0, p - q)
    for m < K, R = p for m = K (the bonus); for q None (the drafts verified as deterministic)
    A = q p and R = p (1 - q).
"""
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specref.oracle import chi_square_gof, counts, detectable_tv, joint_index, samples_for_tv
from specref.rejection import ChainResult, verify_chain, verify_chain_greedy
from specref.sampling import SamplingConfig, logits_to_probs, make_generators, sample_from_probs, uniforms
from specref.theory import acceptance_rate, accepted_length_pmf

ALPHA = 1e-3  # significance of every statistical test
B_BIG = 200_000  # copies per batched call
V = 6  # vocabulary of the statistical tests

WARPS = {  # the target's sampling settings (the draft uses its own, see _tables)
    "temperature": SamplingConfig(temperature=0.7),
    "top_k": SamplingConfig(top_k=4),
    "top_p": SamplingConfig(temperature=1.3, top_k=5, top_p=0.8),  # all three together
}


def _oh(tok, v=4):
    return torch.nn.functional.one_hot(torch.tensor(tok), v).float()  # one-hot rows


# ---------------------------------------------------------------- hand-built cases

def test_hand_built_deterministic_drafts():
    # V = 4, K = 3; p rows are one-hot so every outcome is forced, whatever the uniforms.
    d = torch.tensor([[1, 2, 3],  # row 0: p agrees at every position -> all 3 accepted + bonus 0
                      [2, 2, 3],  # row 1: p[0] is one-hot on 1, so p(2) = 0 -> rejected at once; residual -> 1
                      [1, 2, 3],  # row 2: accept 1, p[1] one-hot on 0 -> reject 2, residual -> 0
                      [1, -1, -1],  # row 3: ragged (length 1, placeholders): accept 1, bonus from p[1] -> 2
                      [-1, -1, -1]])  # row 4: empty draft: only the bonus from p[0] -> 1
    p = torch.stack([
        torch.stack([_oh(1), _oh(2), _oh(3), _oh(0)]),
        torch.stack([_oh(1), _oh(2), _oh(3), _oh(0)]),
        torch.stack([_oh(1), _oh(0), _oh(3), _oh(0)]),
        torch.stack([_oh(1), _oh(2), _oh(3), _oh(0)]),
        torch.stack([_oh(1), _oh(2), _oh(3), _oh(0)]),
    ])  # (5, 4, 4)
    want = [[1, 2, 3, 0], [1, -1, -1, -1], [1, 0, -1, -1], [1, 2, -1, -1], [1, -1, -1, -1]]
    for seed in range(5):
        for q in (None, p[:, :3]):  # q = p one-hot: accept with min(1, 1/1) -> the same outcomes
            res = verify_chain(d, p, q, generator=torch.Generator().manual_seed(seed))
            assert res.tokens.tolist() == want
            assert res.num_accepted.tolist() == [3, 0, 1, 1, 0]
    # explicit lengths win over the placeholders' positions: row 0 with length 1 reads only token 1
    res = verify_chain(d[:1], p[:1], lengths=torch.tensor([1]))
    assert res.tokens.tolist() == [[1, 2, -1, -1]] and res.num_accepted.tolist() == [1]


def test_hand_built_k0_and_residual():
    # K = 0: tokens (B, 0), p (B, 1, V): the bonus only
    p = torch.stack([_oh(3)[None], _oh(0)[None]])  # (2, 1, 4)
    res = verify_chain(torch.zeros(2, 0, dtype=torch.long), p)
    assert res.tokens.tolist() == [[3], [0]] and res.num_accepted.tolist() == [0, 0]
    # p = (.5, .5, 0, 0), deterministic draft 0: accepted w.p. 1/2, else the residual is one-hot on 1
    p = torch.tensor([[[0.5, 0.5, 0, 0], [0, 0, 0, 1.0]]]).expand(1000, 2, 4)  # (1000, 2, 4)
    res = verify_chain(torch.zeros(1000, 1, dtype=torch.long), p, generator=torch.Generator().manual_seed(0))
    acc = res.num_accepted == 1  # (1000,)
    assert res.tokens[acc].tolist() == [[0, 3]] * int(acc.sum())  # accepted: 0 then the bonus 3
    assert res.tokens[~acc].tolist() == [[1, -1]] * int((~acc).sum())  # rejected: 1 from the residual
    assert 400 < int(acc.sum()) < 600  # P(outside) < 1e-9
    # sampled draft: p = (.5, .5, 0, 0), q = (.8, .2, 0, 0), draft 0 accepted w.p. .5/.8; residual
    # max(0, p - q) = (0, .3, 0, 0) -> 1
    q = torch.tensor([[[0.8, 0.2, 0, 0]]]).expand(1000, 1, 4)  # (1000, 1, 4)
    res = verify_chain(torch.zeros(1000, 1, dtype=torch.long), p, q, generator=torch.Generator().manual_seed(1))
    acc = res.num_accepted == 1
    assert res.tokens[~acc, 0].eq(1).all() and res.tokens[acc, 1].eq(3).all()
    assert 540 < int(acc.sum()) < 710  # 625 expected; P(outside) < 1e-9


def test_q_zero_and_p_zero_for_a_drafted_token():
    # row 0: q(x) = 0 for the drafted x = 2 (no correct draft can do this): rejected, although p(2) = 1
    #        (p/q = inf would accept); the residual max(0, p - q) = one-hot 2 then emits 2.
    # row 1: p(x) = 0 for the drafted x = 0: rejected; residual max(0, p - q) = one-hot on 1.
    d = torch.tensor([[2], [0]])
    p = torch.stack([torch.stack([_oh(2), _oh(3)]), torch.stack([_oh(1), _oh(3)])])  # (2, 2, 4)
    q = torch.stack([_oh(1)[None], _oh(0)[None]])  # (2, 1, 4)
    for seed in range(5):
        res = verify_chain(d, p, q, generator=torch.Generator().manual_seed(seed))
        assert res.num_accepted.tolist() == [0, 0] and res.tokens.tolist() == [[2, -1], [1, -1]]


def test_empty_residual_falls_back_to_p():
    # p slightly below q everywhere (p = q (1 - 5e-4), within the normalisation tolerance):
    # max(0, p - q) is all zero, yet a rejection happens w.p. 5e-4 per draft. The rejected rows must
    # still emit a token of p's support, never a division by zero or an out-of-range id.
    n = 100_000
    q1 = torch.tensor([0.0, 0.5, 0.3, 0.2])
    p = (q1 * (1 - 5e-4)).expand(n, 2, 4).contiguous()  # (n, 2, 4)
    q = q1.expand(n, 1, 4)  # (n, 1, 4)
    d = sample_from_probs(q1.expand(n, 4), torch.rand(n, generator=torch.Generator().manual_seed(2)))[:, None]
    res = verify_chain(d, p, q, generator=torch.Generator().manual_seed(3))
    rej = res.num_accepted == 0  # (n,)
    assert 10 <= int(rej.sum()) <= 120  # ~50 expected
    assert bool((res.tokens[rej, 0] >= 1).all())  # token 0 has p = 0
    # p == q exactly: the ratio is 1 and u < 1, so every draft is accepted
    res = verify_chain(d, q1.expand(n, 2, 4), q, generator=torch.Generator().manual_seed(4))
    assert bool((res.num_accepted == 1).all())


def test_greedy_mismatch_at_each_position():
    # target argmax ids (B, K+1) with K = 4
    a = torch.tensor([[5, 1, 2, 3, 4]] * 7)  # (7, 5)
    d = torch.tensor([[0, 1, 2, 3],  # row 0: mismatch at position 0 -> emit a[0] = 5
                      [5, 0, 2, 3],  # row 1: mismatch at 1 -> 5, then a[1] = 1
                      [5, 1, 0, 3],  # row 2: mismatch at 2 -> 5 1 2
                      [5, 1, 2, 0],  # row 3: mismatch at 3 -> 5 1 2 3
                      [5, 1, 2, 3],  # row 4: all 4 accepted + bonus a[4] = 4
                      [5, 1, -1, -1],  # row 5: ragged (length 2): both accepted + bonus a[2] = 2
                      [-1, -1, -1, -1]])  # row 6: empty draft: a[0] only
    want = [[5, -1, -1, -1, -1], [5, 1, -1, -1, -1], [5, 1, 2, -1, -1], [5, 1, 2, 3, -1],
            [5, 1, 2, 3, 4], [5, 1, 2, -1, -1], [5, -1, -1, -1, -1]]
    res = verify_chain_greedy(d, a)
    assert res.tokens.tolist() == want and res.num_accepted.tolist() == [0, 1, 2, 3, 4, 2, 0]
    logits = torch.nn.functional.one_hot(a, 6).float() * 3.0 + 0.5  # (7, 5, 6) argmax = a
    assert torch.equal(verify_chain_greedy(d, logits).tokens, res.tokens)
    # ties in the logits go to the first index (torch.argmax), as in plain greedy decoding
    tie = torch.zeros(1, 2, 6)
    assert verify_chain_greedy(torch.tensor([[0]]), tie).tokens.tolist() == [[0, 0]]


BAD_INPUTS = [
    # (description, call, message fragment)
    ("draft id = V", lambda d, p, q: verify_chain(torch.tensor([[4, 0]]), p, q), r"\[0, 1\] = 4|\[0, 0\] = 4"),
    ("draft id -2", lambda d, p, q: verify_chain(torch.tensor([[-2, 0]]), p, q), "= -2"),
    ("-1 inside the length", lambda d, p, q: verify_chain(torch.tensor([[-1, 0]]), p, q, lengths=torch.tensor([2])),
     "inside row 0"),
    ("length > K", lambda d, p, q: verify_chain(d, p, q, lengths=torch.tensor([3])), "lengths"),
    ("NaN in p", lambda d, p, q: verify_chain(d, p.index_put((torch.tensor(0), torch.tensor(1), torch.tensor(2)),
                                                             torch.tensor(float("nan"))), q), r"p\[0, 1, 2\] = nan"),
    ("negative q", lambda d, p, q: verify_chain(d, p, q - 0.3), "negative"),
    ("unnormalised p", lambda d, p, q: verify_chain(d, p * 1.1, q), "sums to 1.1"),
    ("logits for p", lambda d, p, q: verify_chain(d, p.log(), q), "negative|NaN"),
    ("p with K+2 rows", lambda d, p, q: verify_chain(d, torch.cat([p, p[:, :1]], 1), q), "shape"),
    ("q with another V", lambda d, p, q: verify_chain(d, p, q[..., :3] / q[..., :3].sum(-1, keepdim=True)), "shape"),
    ("p not 3-D", lambda d, p, q: verify_chain(d, p[0], q), "shape"),
    ("float draft", lambda d, p, q: verify_chain(d.float(), p, q), "integer"),
    ("greedy target shape", lambda d, p, q: verify_chain_greedy(d, torch.zeros(1, 2, dtype=torch.long)), "target"),
]


@pytest.mark.parametrize("what,call,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_value_error(what, call, match):
    d = torch.tensor([[1, 2]])  # (1, 2)
    p = torch.full((1, 3, 4), 0.25)  # (1, 3, 4)
    q = torch.full((1, 2, 4), 0.25)  # (1, 2, 4)
    with pytest.raises(ValueError, match=match):
        call(d, p, q)


def test_unused_rows_are_not_checked():
    # a ragged row of length 0 only reads p[b, 0]: garbage in its unused rows is ignored
    p = torch.full((1, 3, 4), float("nan"))
    p[0, 0] = 0.25
    res = verify_chain(torch.full((1, 2), -1), p, torch.full((1, 2, 4), float("nan")))
    assert res.num_accepted.tolist() == [0] and 0 <= res.tokens[0, 0] < 4


# ---------------------------------------------------------------- statistical machinery

def _tables(K: int, warp: SamplingConfig, seed: int):
    """P (K+1, V+1, V): target at position i after previous token s (s = V: the start), warped;
    Q (K, V+1, V): a draft near it (its logits plus noise), with its own temperature 1."""
    g = torch.Generator().manual_seed(seed)
    t_logits = torch.randn(K + 1, V + 1, V, generator=g) * 1.5  # (K+1, V+1, V)
    d_logits = t_logits[:K] + torch.randn(K, V + 1, V, generator=g)  # (K, V+1, V)
    P = logits_to_probs(t_logits, warp).double()  # (K+1, V+1, V)
    Q = logits_to_probs(d_logits, SamplingConfig()).double()  # (K, V+1, V)
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


def _simulate(P, Q, with_q: bool, verify, seed: int, n: int = B_BIG, lengths=None):
    """n copies of one step: drafts from Q (sequentially, each after the previous token), target
    rows gathered from P; ONE call of verify. Returns (result, drafts)."""
    K = Q.shape[0]
    P, Q = P.float(), Q.float()
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((n,), V, dtype=torch.long)  # (n,)
    toks, ps, qs = [], [], []
    for i in range(K):  # drafting is sequential by nature
        qi = Q[i, prev]  # (n, V)
        x = sample_from_probs(qi, torch.rand(n, generator=g))  # (n,)
        ps.append(P[i, prev])
        qs.append(qi)
        toks.append(x)
        prev = x
    ps.append(P[K, prev])
    d = torch.stack(toks, 1) if K else torch.zeros(n, 0, dtype=torch.long)  # (n, K)
    if lengths is not None:
        d = torch.where(torch.arange(K)[None, :] < lengths[:, None], d, -1)  # (n, K)
    p = torch.stack(ps, 1)  # (n, K+1, V)
    q = (torch.stack(qs, 1) if K else torch.zeros(n, 0, V)) if with_q else None  # (n, K, V)
    return verify(d, p, q, lengths=lengths, generator=torch.Generator().manual_seed(seed + 1)), d


def _exact_joint(P, Q, with_q: bool) -> torch.Tensor:
    """Exact probabilities of the cells (m, y_1..y_{m+1}), m = 0..K, flat: offset_m + joint_index."""
    K = Q.shape[0]
    Pk = P[:K]  # (K, V+1, V)
    A = torch.minimum(Pk, Q) if with_q else Q * Pk  # (K, V+1, V) accept and emit y
    R = (Pk - Q).clamp(min=0) if with_q else Pk * (1 - Q)  # (K, V+1, V) reject and emit y
    R = torch.cat([R, P[K:]], 0)  # (K+1, V+1, V) m = K: the bonus
    acc = torch.ones(1, dtype=torch.float64)  # (S,) prob of each accepted prefix
    last = torch.full((1,), V, dtype=torch.long)  # (S,) its last token
    out = []
    for m in range(K + 1):
        out.append((acc[:, None] * R[m, last]).reshape(-1))  # (S*V,) index = prefix * V + y
        if m < K:
            acc = (acc[:, None] * A[m, last]).reshape(-1)  # (S*V,)
            last = torch.arange(V).repeat(acc.shape[0] // V)  # (S*V,)
    return torch.cat(out)  # (sum_m V^(m+1),)


def _observed_cells(res: ChainResult, K: int) -> np.ndarray:
    m = res.num_accepted.numpy()  # (n,)
    toks = res.tokens.numpy()  # (n, K+1)
    offsets = np.cumsum([0] + [V ** (j + 1) for j in range(K + 1)])  # (K+2,)
    cell = np.empty(m.shape, dtype=np.int64)
    for j in range(K + 1):  # group by accepted length
        rows = m == j
        cell[rows] = offsets[j] + joint_index(toks[rows, : j + 1], V)
    return counts(cell, int(offsets[-1]))


def _joint_test(res, P, Q, with_q):
    K = Q.shape[0]
    exact = _exact_joint(P, Q, with_q)
    assert abs(float(exact.sum()) - 1) < 1e-9
    return chi_square_gof(_observed_cells(res, K), exact.numpy())


def _position_pvalues(res, P, K):
    """For each position i: tokens emitted at i, grouped by the previous token, against P[i, prev];
    the groups' chi-square statistics and dofs add up (independent groups)."""
    toks, m = res.tokens.numpy(), res.num_accepted.numpy()
    out = []
    for i in range(K + 1):
        rows = m >= i  # position i is emitted
        prev = toks[rows, i - 1] if i else np.full(int(rows.sum()), V)
        table = np.bincount(prev * V + toks[rows, i], minlength=(V + 1) * V).reshape(V + 1, V)  # (V+1, V)
        stat, dof = 0.0, 0
        for s in np.flatnonzero(table.sum(1)):  # previous tokens that occur
            r = chi_square_gof(table[s], P[i, s].numpy())
            stat, dof = stat + r.statistic, dof + r.dof
        out.append(float(stats.chi2.sf(stat, dof)) if dof else 1.0)
    return out


def _power_cells(probs: np.ndarray, n: int) -> int:
    """Cells the chi-square test keeps at n samples (expected >= 5, plus one pooled cell)."""
    e = probs * n
    return int((e >= 5).sum()) + int(((e > 0) & (e < 5)).any())


# ---------------------------------------------------------------- the step is distributed as p

# every K with q given and q None; every warp with q given and q None (a Latin square over K x warp)
CASES = [(1, "temperature", True), (3, "top_k", True), (5, "top_p", True),
         (1, "top_p", False), (3, "temperature", False), (5, "top_k", False)]


@pytest.mark.parametrize("K,warp,with_q", CASES, ids=[f"K{k}-{w}-{'q' if wq else 'qNone'}" for k, w, wq in CASES])
def test_step_matches_exact_law(K, warp, with_q):
    P, Q = _tables(K, WARPS[warp], seed=K * 10 + len(warp))
    res, d = _simulate(P, Q, with_q, verify_chain, seed=K + 100 * with_q)
    # emitted tokens at every position, given the previous token, are distributed as p
    pv = _position_pvalues(res, P, K)
    assert min(pv) > ALPHA, pv
    # the joint (accepted length, tokens) matches Algorithm 1's exact law
    joint = _joint_test(res, P, Q, with_q)
    assert joint.p_value > ALPHA, joint
    # power: B_BIG samples detect any TV 0.02 deviation over the cells kept after pooling, and the
    # first position (n = B_BIG over V cells per start state) with power >= 0.99 at alpha 1e-3
    exact = _exact_joint(P, Q, with_q).numpy()
    assert B_BIG >= samples_for_tv(0.02, _power_cells(exact, B_BIG), alpha=ALPHA, power=0.99)
    assert B_BIG >= samples_for_tv(0.02, V, alpha=ALPHA, power=0.99)


def test_ragged_batch_matches_exact_law():
    # one call, K = 4, each row its own length 0..4 (uniform); each length group against its own law
    K = 4
    P, Q = _tables(K, WARPS["top_k"], seed=77)
    lengths = torch.randint(0, K + 1, (B_BIG,), generator=torch.Generator().manual_seed(6))  # (B,)
    res, d = _simulate(P, Q, True, verify_chain, seed=9, lengths=lengths)
    assert bool((res.num_accepted <= lengths).all())
    for ell in range(K + 1):
        rows = lengths == ell
        sub = ChainResult(res.tokens[rows][:, : ell + 1], res.num_accepted[rows])
        r = _joint_test(sub, P[: ell + 1], Q[:ell], True)
        assert r.p_value > ALPHA, (ell, r)
        # ~40,000 rows per group over <= 335 kept cells: power 0.99 against any TV >= 0.035 (TV 0.02
        # needs ~105,000 rows per group; the fixed-length cases above have that power)
        n = int(rows.sum())
        cells = _power_cells(_exact_joint(P[: ell + 1], Q[:ell], True).numpy(), n)
        assert detectable_tv(n, max(cells, 2), alpha=ALPHA, power=0.99) < 0.035


def test_per_row_generators_match_exact_law():
    # 40,000 rows, one generator each (rows independent); K = 3, q given, top-p target.
    # Power 0.99 against TV 0.02 on the first position (6 cells need ~26,300 samples).
    K, n = 3, 40_000
    P, Q = _tables(K, WARPS["top_p"], seed=31)
    verify = partial(_with_generators, gens=make_generators(1234, n))
    res, _ = _simulate(P, Q, True, verify, seed=9, n=n)
    assert min(_position_pvalues(res, P, K)) > ALPHA
    assert _joint_test(res, P, Q, True).p_value > ALPHA
    assert n >= samples_for_tv(0.02, V, alpha=ALPHA, power=0.99)


def _with_generators(d, p, q, *, lengths=None, generator=None, gens=None):
    return verify_chain(d, p, q, lengths=lengths, generator=gens)


def test_deterministic_argmax_draft_matches_exact_law():
    # q None with a truly deterministic draft: x_i = argmax of the draft after the previous token
    K = 3
    P, Q = _tables(K, WARPS["temperature"], seed=55)
    Qdet = torch.nn.functional.one_hot(Q.argmax(-1), V).double()  # (K, V+1, V)
    res, _ = _simulate(P, Qdet, False, verify_chain, seed=12)
    assert min(_position_pvalues(res, P, K)) > ALPHA
    assert _joint_test(res, P, Qdet, False).p_value > ALPHA


# ---------------------------------------------------------------- acceptance: rate and length law

def test_acceptance_rate_and_accepted_length_law():
    # the same (p, q) at every position, drafts i.i.d. from q: acceptances are i.i.d. Bernoulli(alpha)
    # with alpha = sum min(p, q), and the accepted length is the capped geometric of theory.py.
    K = 5
    g = torch.Generator().manual_seed(21)
    p1 = logits_to_probs(torch.randn(V, generator=g) * 1.5, WARPS["top_p"]).double()  # (V,)
    q1 = logits_to_probs(torch.randn(V, generator=g) * 1.5, SamplingConfig()).double()  # (V,)
    P = p1.expand(K + 1, V + 1, V)
    Q = q1.expand(K, V + 1, V)
    alpha = float(acceptance_rate(p1, q1))
    res, d = _simulate(P, Q, True, verify_chain, seed=3)
    # acceptance rate at the first position: all B_BIG rows test one draft there. A two-sided
    # binomial test at 1e-3; the CI is +-3.3 sd = +-0.004 at alpha ~ 0.5.
    hits = int((res.num_accepted >= 1).sum())
    assert stats.binomtest(hits, B_BIG, alpha).pvalue > ALPHA, (hits / B_BIG, alpha)
    ci = stats.binomtest(hits, B_BIG, alpha).proportion_ci(confidence_level=1 - ALPHA)
    assert ci.low <= alpha <= ci.high
    # accepted-length distribution vs P(N = n) = alpha^n (1 - alpha), alpha^K at n = K
    pmf = accepted_length_pmf(alpha, K).numpy()
    obs = np.bincount(res.num_accepted.numpy(), minlength=K + 1)
    r = chi_square_gof(obs, pmf)
    assert r.p_value > ALPHA, (obs / B_BIG, pmf)
    assert B_BIG >= samples_for_tv(0.02, K + 1, alpha=ALPHA, power=0.99)
    # ... and the test sees a wrong alpha: the law for alpha - 0.02 is rejected
    assert chi_square_gof(obs, accepted_length_pmf(alpha - 0.02, K).numpy()).p_value < ALPHA


# ---------------------------------------------------------------- mutants the oracle must reject

def _variant(d, p, q=None, *, lengths=None, generator=None, bug=None):
    """A second implementation of the chain step with switchable bugs. bug=None must equal
    verify_chain exactly (same uniforms, same layout): that keeps the mutants honest."""
    B, K = d.shape
    lengths = (d >= 0).long().cumprod(1).sum(1) if lengths is None else lengths  # (B,)
    u = uniforms((K + 1,), B, generator, p.device)  # (B, K+1)
    x = d.clamp(min=0)  # (B, K)
    rows = torch.arange(B)
    px = p[:, :K].gather(2, x[..., None]).squeeze(-1)  # (B, K)
    use_q = q is not None and bug != "ignore_q"
    qx = q.gather(2, x[..., None]).squeeze(-1) if use_q else torch.ones_like(px)  # (B, K)
    if bug == "no_min":  # one uniform against the running product of p/q, never capped at 1
        accept = u[:, :1] < torch.cumprod(px / qx, 1)
    elif bug == "cumprod_with_min":  # the same vectorisation with the min: correct (a control)
        accept = u[:, :1] < torch.cumprod((px / qx).clamp(max=1), 1)
    else:
        accept = (qx > 0) & (u[:, :K] * qx < px)
    accept &= torch.arange(K)[None, :] < lengths[:, None]
    n_acc = accept.long().cumprod(1).sum(1)  # (B,)
    p_j = p[rows, n_acc]  # (B, V)
    dist = p_j
    if K:
        j = n_acc.clamp(max=K - 1)
        resid = (p_j - q[rows, j]).clamp(min=0) if use_q else p_j.scatter(1, x[rows, j][:, None], 0.0)
        if bug == "no_residual":  # resample from p after a rejection
            resid = p_j
        bonus = p[rows, (n_acc - 1).clamp(min=0)] if bug == "bonus_wrong_row" else p_j  # the last draft's row
        dist = torch.where((n_acc < lengths)[:, None], resid, bonus)
        dist = torch.where(dist.sum(1, keepdim=True) > 0, dist, p_j)
    if bug == "unnormalised":  # inverse CDF against the raw residual; overflow lands on the last id
        last = torch.searchsorted(dist.cumsum(1), u[:, K:].contiguous(), right=True).squeeze(1).clamp(max=p.shape[-1] - 1)
    else:
        last = sample_from_probs(dist, u[:, K])
    out = torch.where(torch.arange(K + 1)[None, :] < n_acc[:, None],
                      torch.cat([d, torch.full((B, 1), -1)], 1), -1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return ChainResult(out, n_acc)


def test_variant_without_bug_equals_verify_chain():
    K = 3
    P, Q = _tables(K, WARPS["top_k"], seed=3)
    for with_q in (True, False):
        a, _ = _simulate(P, Q, with_q, verify_chain, seed=1, n=20_000)
        b, _ = _simulate(P, Q, with_q, partial(_variant, bug=None), seed=1, n=20_000)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


MUTANTS = [
    # (bug, with q?, the per-position test must reject too?)
    ("no_residual", True, True),  # resample from p: p's overlap with q is emitted too often
    ("no_residual", False, True),
    ("unnormalised", True, True),  # residual mass missing from 1 lands on the last token
    ("unnormalised", False, True),
    ("no_min", True, True),  # running product of p/q above 1 accepts later drafts too often
    ("bonus_wrong_row", True, True),  # the bonus drawn from p after K-1 drafts
    ("bonus_wrong_row", False, True),
    # ignoring q (verifying sampled drafts as deterministic) still emits tokens distributed as p (a
    # q-None verification is valid for any independent draft), but not with Algorithm 1's joint law
    # nor its acceptance rate: only the joint test can reject it, and does.
    ("ignore_q", True, False),
]


@pytest.mark.parametrize("bug,with_q,marginal", MUTANTS, ids=[f"{b}-{'q' if w else 'qNone'}" for b, w, _ in MUTANTS])
def test_oracle_rejects_mutant(bug, with_q, marginal):
    K = 3
    P, Q = _tables(K, WARPS["top_k"], seed=41)
    # a quarter of the sample size the correct implementation passes with (p-values here are ~0)
    res, _ = _simulate(P, Q, with_q, partial(_variant, bug=bug), seed=17, n=B_BIG // 4)
    assert _joint_test(res, P, Q, with_q).p_value < ALPHA
    if marginal:
        assert min(_position_pvalues(res, P, K)) < ALPHA


def test_control_variant_passes():
    # the single-uniform vectorisation WITH the min is a correct algorithm: the oracle accepts it,
    # so rejecting "no_min" is about the missing min, not about the vectorisation
    K = 3
    P, Q = _tables(K, WARPS["top_k"], seed=41)
    res, _ = _simulate(P, Q, True, partial(_variant, bug="cumprod_with_min"), seed=17)
    assert _joint_test(res, P, Q, True).p_value > ALPHA
    assert min(_position_pvalues(res, P, K)) > ALPHA


# ---------------------------------------------------------------- properties (hypothesis)

def _random_probs(g, shape, zero_frac=0.3):
    w = torch.rand(shape, generator=g, dtype=torch.float64)
    w = torch.where(torch.rand(shape, generator=g) < zero_frac, 0.0, w)
    w[..., 0] += (w.sum(-1) == 0).double()  # at least one positive entry per row
    return (w / w.sum(-1, keepdim=True)).float()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(B=st.integers(0, 5), K=st.integers(0, 5), vocab=st.integers(1, 7), with_q=st.booleans(),
       seed=st.integers(0, 2 ** 31 - 1), data=st.data())
def test_chain_properties(B, K, vocab, with_q, seed, data):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, K), min_size=B, max_size=B)), dtype=torch.long)
    lengths = lengths.reshape(B)
    d = torch.randint(0, vocab, (B, K), generator=g)
    d = torch.where(torch.arange(K)[None, :] < lengths[:, None], d, -1)  # (B, K)
    p = _random_probs(g, (B, K + 1, vocab))
    q = _random_probs(g, (B, K, vocab)) if with_q else None
    if with_q and B * K:  # drafts must have q > 0 (they were sampled from q)
        q = q + 0.5 * torch.nn.functional.one_hot(d.clamp(min=0), vocab)
        q = q / q.sum(-1, keepdim=True)
    res = verify_chain(d, p, q, generator=make_generators(seed, B))
    n = res.num_accepted
    assert res.tokens.shape == (B, K + 1) and n.shape == (B,)
    assert res.tokens.dtype == torch.long and n.dtype == torch.long
    assert bool(((n >= 0) & (n <= lengths)).all())
    pos = torch.arange(K + 1)[None, :]
    assert bool((res.tokens[pos > n[:, None]] == -1).all())  # -1 padding after the last token
    emitted = res.tokens[pos <= n[:, None]]
    assert bool(((emitted >= 0) & (emitted < vocab)).all())  # tokens in range
    assert torch.equal(torch.where(pos[:, :K] < n[:, None], res.tokens[:, :K], -1),
                       torch.where(pos[:, :K] < n[:, None], d, -1))  # accepted = the drafts
    last = res.tokens.gather(1, n[:, None]).squeeze(1)  # (B,)
    assert bool((p[torch.arange(B), n, last] > 0).all())  # never a zero-mass token
    # deterministic under the seeds
    again = verify_chain(d, p, q, generator=make_generators(seed, B))
    assert torch.equal(again.tokens, res.tokens)
    # a row alone, with its own generator (seed + b), gives the same result: rows are independent
    if B:
        b = data.draw(st.integers(0, B - 1))
        alone = verify_chain(d[b:b + 1], p[b:b + 1], None if q is None else q[b:b + 1],
                             generator=make_generators(seed + b, 1))
        assert torch.equal(alone.tokens[0], res.tokens[b])
        # greedy: the same properties and row independence
        gr = verify_chain_greedy(d, p)
        assert gr.tokens.shape == (B, K + 1) and bool((gr.num_accepted <= lengths).all())
        assert torch.equal(verify_chain_greedy(d[b:b + 1], p[b:b + 1]).tokens[0], gr.tokens[b])


@pytest.mark.parametrize("with_q", [True, False])
def test_row_alone_equals_row_in_a_ragged_batch(with_q):
    """One generator per row: a row's result does not depend on the other rows' draft lengths (it
    consumes its own lengths[b] + 1 uniforms), so it equals the row verified alone. 64 rows, K = 4,
    lengths 0..4; the final token of a short row used to read u[:, K] of the batch's widest row."""
    B, K, Vv = 64, 4, 6
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(B, K + 1, Vv, generator=g) * 2, -1)  # (B, K+1, V)
    q = torch.softmax(torch.randn(B, K, Vv, generator=g) * 2, -1) if with_q else None  # (B, K, V)
    lengths = torch.randint(0, K + 1, (B,), generator=g)  # (B,)
    d = torch.randint(0, Vv, (B, K), generator=g)  # (B, K)
    d = torch.where(torch.arange(K)[None, :] < lengths[:, None], d, -1)
    both = verify_chain(d, p, q, lengths=lengths, generator=make_generators(77, B))
    for b in range(B):
        L = int(lengths[b])
        one = verify_chain(d[b:b + 1, :L], p[b:b + 1, :L + 1], None if q is None else q[b:b + 1, :L],
                           lengths=lengths[b:b + 1], generator=[make_generators(77, B)[b]])
        assert one.tokens[0, :L + 1].tolist() == both.tokens[b, :L + 1].tolist(), b
