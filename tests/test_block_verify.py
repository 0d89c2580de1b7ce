"""Block verification (specref/block_verify.py: rejection.verify_chain_block, Sun et al. 2025).

Statistical tests: ONE batched call of B = 200,000 chain steps per case, significance 1e-3, fixed
seeds, the power against TV 0.02 asserted. Setting: Markov tables, the target after a token s at
position i is P[i, s] (s = V: the root), the draft's Q[i, s]; draft chains sampled from Q.
Exact laws checked:
  - "completed joint": each row's emitted tokens continued by direct sampling from P up to L = K + 1
    tokens are distributed as the Markov joint of L target tokens (a lossless step emits a prefix of
    a target sample, cut at a stopping time); ragged rows (lengths 0..K) in the same batch;
  - the accepted length: E[tau] exactly (every draft enumerated, Algorithm 2's h_i in scalars), strictly
    above token-wise's exact E[tau] on this case (Sun et al.: never below it).
The product rule (vLLM-Ascend's mutant, lossless_selftest.block_product_rule) fails the same test.
The whole loop: test_verify_rules.py. Results and input checks come from rejection_common.py.
"""
import itertools

import numpy as np
import pytest
import torch

from specref.oracle import chi_square_gof, counts, detectable_tv, joint_index
from specref.oracle.check import check_rejection_sampler
from specref.oracle.lossless_selftest import block_product_rule
from specref.oracle.tree_cases import chain_cases, shallow
from specref.rejection import ChainResult, verify_chain, verify_chain_block
from specref.sampling import make_generators, sample_from_probs

ALPHA = 1e-3
B_BIG = 200_000
V, K = 5, 3


def _tables(seed: int):
    """P (K+1, V+1, V) the target after a token at position i (s = V: the root), Q (K, V+1, V)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(K + 1, V + 1, V, generator=g) * 1.3
    P = torch.softmax(t, -1).double()
    Q = torch.softmax(t[:K] + torch.randn(K, V + 1, V, generator=g) * 1.2, -1).double()
    return P, Q


def _draw(P, Q, n: int, seed: int, ragged: bool):
    """n chains of K draft tokens from Q with their p (n, K+1, V) and q (n, K, V); lengths 0..K when
    ragged (row b: b mod (K+1)), else K."""
    g = torch.Generator().manual_seed(seed)
    s = torch.full((n,), V)
    toks, ps, qs = [], [P[0, s].float()], []
    for i in range(K):
        qi = Q[i, s].float()  # (n, V)
        x = sample_from_probs(qi, torch.rand(n, generator=g))  # (n,)
        toks.append(x)
        qs.append(qi)
        ps.append(P[i + 1, x].float())
        s = x
    lengths = torch.arange(n) % (K + 1) if ragged else torch.full((n,), K)
    tokens = torch.where(torch.arange(K)[None] < lengths[:, None], torch.stack(toks, 1), -1)  # (n, K)
    return tokens, torch.stack(ps, 1), torch.stack(qs, 1), lengths


def _markov_joint(P, L):
    """Exact joint (V^L,) of L target tokens from the root (first token most significant)."""
    prob = P[0, V].clone()  # (V,)
    last = torch.arange(V)
    for i in range(1, L):
        prob = (prob[:, None] * P[i, last]).reshape(-1)  # (V^(i+1),)
        last = torch.arange(V).repeat(prob.shape[0] // V)
    return prob


def _completed(res: ChainResult, P, L: int, seed: int) -> torch.Tensor:
    """Each row's emitted tokens continued by direct sampling from P up to L tokens. -> (n, L)."""
    n = res.tokens.shape[0]
    m = res.num_accepted
    out = res.tokens[:, :L].clone()
    g = torch.Generator().manual_seed(seed)
    for j in range(1, L):  # position j: emitted if j <= m, else sampled after out[:, j-1]
        draw = sample_from_probs(P[j, out[:, j - 1]].float(), torch.rand(n, generator=g))
        out[:, j] = torch.where(j > m, draw, out[:, j])
    return out


def _joint_test(fn, seed: int, ragged: bool = True):
    P, Q = _tables(seed)
    tokens, p, q, lengths = _draw(P, Q, B_BIG, seed + 1, ragged)
    res = fn(tokens, p, q, lengths=lengths, generator=torch.Generator().manual_seed(seed + 2))
    full = _completed(res, P, K + 1, seed + 3).numpy()
    joint = _markov_joint(P, K + 1).numpy()
    return chi_square_gof(counts(joint_index(full, V), V ** (K + 1)), joint), joint, res


@pytest.mark.parametrize("seed", [0, 1])
def test_block_step_is_lossless_on_a_ragged_batch(seed):
    r, joint, res = _joint_test(verify_chain_block, seed)
    assert detectable_tv(B_BIG, int((joint * B_BIG >= 5).sum()) + 1, alpha=ALPHA, power=0.99) <= 0.02
    assert r.p_value > ALPHA, r
    assert set(res.num_accepted.tolist()) == set(range(K + 1))  # every accepted length occurs


def test_product_rule_fails_the_same_test():
    r, _, _ = _joint_test(block_product_rule, 0)
    assert r.p_value < ALPHA, r


def _exact_expected_tau(P, Q, block: bool) -> float:
    """E[tau] of one full chain, exactly, over every draft x_1..x_K (V^K, each with its q(x)).
    Token-wise: P(tau >= i | x) = prod_{j<=i} min(1, p_j/q_j). Block: tau = the last i with
    eta_i < h_i, so P(tau = i | x) = h_i prod_{j>i} (1 - h_j), the h_i of Sun et al.'s Algorithm 2
    written out here with scalars."""
    total = 0.0
    for xs in itertools.product(range(V), repeat=K):
        s, qx, w, surv, h, ctx = V, 1.0, 1.0, 1.0, [], []
        for j, x in enumerate(xs):
            pj, qj = P[j, s], Q[j, s]  # (V,) each
            qx *= float(qj[x])
            w = min(1.0, w * float(pj[x]) / float(qj[x]))  # p_{j+1}
            surv *= min(1.0, float(pj[x]) / float(qj[x]))
            ctx.append((w, x, surv))
            s = x
        if not block:
            total += qx * sum(c[2] for c in ctx)
            continue
        for i, (w, x, _) in enumerate(ctx, start=1):
            if i == K:
                h.append(w)
            else:
                S = float((w * P[i, x] - Q[i, x]).clamp(min=0).sum())
                h.append(S / (S + 1 - w) if S > 0 else 0.0)
        e = sum(i * h[i - 1] * float(np.prod([1 - hj for hj in h[i:]])) for i in range(1, K + 1))
        total += qx * e
    return total


def test_block_accepts_more_than_tokenwise_as_sun_et_al_prove():
    P, Q = _tables(0)
    e_block, e_token = _exact_expected_tau(P, Q, True), _exact_expected_tau(P, Q, False)
    assert e_block > e_token + 0.01  # strictly more here: 1.918 against 1.899 (Sun et al.: never less)
    tokens, p, q, lengths = _draw(P, Q, B_BIG, 1, ragged=False)
    for fn, exact in ((verify_chain_block, e_block), (verify_chain, e_token)):
        tau = fn(tokens, p, q, lengths=lengths, generator=torch.Generator().manual_seed(2)).num_accepted.double()
        se = float(tau.std()) / B_BIG ** 0.5
        assert abs(float(tau.mean()) - exact) < 5 * se, (fn.__name__, float(tau.mean()), exact)


def test_hand_built_cases():
    # row 0: q = p everywhere: every draft accepted (p_i = 1, h_L = 1), the bonus from p after 2 drafts
    # row 1: the first draft impossible under p (p(x) = 0): tau = 0, y from norm([p - q]_+)
    # row 2: no drafts: y from p at the root
    p = torch.tensor([[[0.5, 0.5, 0.0]] * 3, [[0.0, 0.5, 0.5]] * 3, [[0.0, 0.0, 1.0]] * 3])  # (3, 3, 3)
    q = torch.tensor([[[0.5, 0.5, 0.0]] * 2, [[1.0, 0.0, 0.0]] * 2, [[1.0, 0.0, 0.0]] * 2])  # (3, 2, 3)
    d = torch.tensor([[1, 0], [0, 1], [-1, -1]])
    res = verify_chain_block(d, p, q, generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [2, 0, 0]
    assert res.tokens[0, :2].tolist() == [1, 0] and res.tokens[0, 2] in (0, 1)
    assert res.tokens[1, 0] in (1, 2) and res.tokens[1, 1:].tolist() == [-1, -1]
    assert res.tokens[2].tolist() == [2, -1, -1]


def test_rows_are_independent_and_draws_fixed():
    P, Q = _tables(3)
    tokens, p, q, lengths = _draw(P, Q, 12, 4, ragged=True)
    full = verify_chain_block(tokens, p, q, lengths=lengths, generator=make_generators(7, 12), draws=K + 1)
    for b in range(12):
        alone = verify_chain_block(tokens[b:b + 1], p[b:b + 1], q[b:b + 1], lengths=lengths[b:b + 1],
                                   generator=make_generators(7 + b, 1), draws=K + 1)
        assert torch.equal(alone.tokens[0], full.tokens[b])


def test_deterministic_drafts_accept_as_tokenwise():
    # q one-hot (q=None): no lossless rule accepts a prefix more often than p samples it, and
    # token-wise already does; block verification's law of tau is the same
    P, Q = _tables(5)
    tokens, p, _, lengths = _draw(P, Q, B_BIG, 6, ragged=False)
    a = verify_chain_block(tokens, p, None, lengths=lengths, generator=torch.Generator().manual_seed(1))
    b = verify_chain(tokens, p, None, lengths=lengths, generator=torch.Generator().manual_seed(2))
    ca, cb = (np.bincount(r.num_accepted.numpy(), minlength=K + 1) for r in (a, b))
    assert chi_square_gof(ca, cb / cb.sum()).p_value > ALPHA


def test_bad_inputs_name_the_value():
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_chain_block(torch.tensor([[0, 9]]), p)
    with pytest.raises(ValueError, match="q must be"):
        verify_chain_block(torch.tensor([[0, 1]]), p, torch.ones(1, 3, 4))


def test_oracle_verdict_under_the_lossless_law():
    # the oracle's chain cases at depth <= 1, enough rows for a PASS; the token-wise law FAILS it
    cs = shallow(chain_cases(), 1)
    rep = check_rejection_sampler(verify_chain_block, samples=30_000, seed=0, cases=cs)
    assert rep.verdict == "PASS", rep.summary()
    assert check_rejection_sampler(verify_chain_block, law="tokenwise", samples=4_000, seed=0).verdict == "FAIL"


def test_chain_inputs_shared_by_both_chain_rules():
    """rejection_common.chain_inputs: the checks verify_chain and verify_chain_block share."""
    from specref.rejection_common import chain_inputs

    p = torch.full((2, 3, 4), 0.25)
    toks, p2, q2, lengths, valid = chain_inputs(torch.tensor([[1, 2], [3, -1]]), p, None, None, True)
    assert lengths.tolist() == [2, 1] and valid.tolist() == [[True, True], [True, False]] and q2 is None
    with pytest.raises(ValueError):
        chain_inputs(torch.tensor([[1, 2]]), p, None, None, True)  # p for 2 rows, 1 draft row
