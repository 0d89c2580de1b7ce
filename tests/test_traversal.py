"""Traversal verification (specref/traversal.py: rejection.verify_tree_traversal, Weng et al. 2025).

Statistical tests: ONE batched call of B = 200,000 tree steps per case, significance 1e-3, fixed
seeds, the power against TV 0.02 asserted. Setting as tests/test_rejection_tree.py: the target at a
node of depth i whose token is s is P[i, s] (s = V: the root); the siblings of a node are drawn
without replacement (Gumbel-top-k) from Q[depth, token of the parent]. Exact law checked: the
"completed joint" (each row's emitted tokens continued by direct sampling from P up to L = D + 1
tokens are distributed as the Markov joint), on trees that branch below the root's children, with
ragged rows (a row's node count cut at a prefix). Lossy control: the final token from p at the
accepted node instead of its residual (a published implementation's mistake) fails the same test.
On a chain the rule is block verification, at the root's children Sequoia's: identical results.
The whole loop: test_verify_rules.py.
"""
import pytest
import torch

from specref.oracle import chi_square_gof, counts, detectable_tv, joint_index
from specref.oracle.lossless_selftest import drawn_cases
from specref.oracle.tree_cases import shallow, standard_tree_cases
from specref.oracle.tree_check import check_tree_sampler
from specref.rejection import TreeResult, verify_chain_block, verify_tree, verify_tree_traversal
from specref.sampling import make_generators, sample_from_probs

ALPHA = 1e-3
B_BIG = 200_000
V = 5
SHAPES = {  # parents; -1 = child of the root
    "binary": [-1, -1, 0, 0, 1, 1],  # two levels of two siblings
    "mixed": [-1, 0, 0, -1, 1, 3, 2],  # root -> {0, 3}; 0 -> {1, 2}; 1 -> {4}; 3 -> {5}; 2 -> {6}: depth 3
}


def _depths(parents):
    d = []
    for par in parents:
        d.append(1 if par < 0 else d[par] + 1)
    return d


def _tables(D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(D + 1, V + 1, V, generator=g) * 1.3
    P = torch.softmax(t, -1).double()
    Q = torch.softmax(t[:D] + torch.randn(D, V + 1, V, generator=g) * 1.2, -1).double()
    return P, Q


def _draw(shape: str, P, Q, n: int, seed: int, ragged: bool):
    """n trees of the shape, each node's siblings the Gumbel-top-k of q at their parent (without
    replacement, in order of sampling), q[:, i] the parent's q. Ragged: row b keeps its first
    N - (b mod 3) nodes (a prefix of a topological order is a tree)."""
    parents = SHAPES[shape]
    depth, N = _depths(parents), len(parents)
    g = torch.Generator().manual_seed(seed)
    toks, qs, keys, rank = [], [], {}, {}
    for i, par in enumerate(parents):
        s = torch.full((n,), V) if par < 0 else toks[par]
        qi = Q[depth[i] - 1, s].float()  # (n, V)
        if par not in keys:
            u = torch.rand(n, V, generator=g).clamp(min=1e-12)
            keys[par] = qi.log() - (-u.log()).log()  # (n, V)
        rank[par] = rank.get(par, -1) + 1
        toks.append(keys[par].topk(rank[par] + 1, dim=-1).indices[:, -1])
        qs.append(qi)
    lengths = N - torch.arange(n) % 3 if ragged else torch.full((n,), N)
    tokens = torch.where(torch.arange(N)[None] < lengths[:, None], torch.stack(toks, 1), -1)  # (n, N)
    p = torch.stack([P[0, torch.full((n,), V)].float()] + [P[depth[i], toks[i]].float() for i in range(N)], 1)
    return tokens, torch.tensor(parents).expand(n, N), p, torch.stack(qs, 1), lengths


def _markov_joint(P, L):
    prob = P[0, V].clone()  # (V,)
    last = torch.arange(V)
    for i in range(1, L):
        prob = (prob[:, None] * P[i, last]).reshape(-1)  # (V^(i+1),)
        last = torch.arange(V).repeat(prob.shape[0] // V)
    return prob


def _completed(res: TreeResult, P, L: int, seed: int) -> torch.Tensor:
    n = res.tokens.shape[0]
    m = res.num_accepted
    out = torch.full((n, L), -1, dtype=torch.long)
    out[:, : res.tokens.shape[1]] = res.tokens[:, :L]
    g = torch.Generator().manual_seed(seed)
    for j in range(1, L):
        draw = sample_from_probs(P[j, out[:, j - 1]].float(), torch.rand(n, generator=g))
        out[:, j] = torch.where(j > m, draw, out[:, j])
    return out


def _bonus_from_p(tokens, parents, p, q, *, lengths, generator, siblings):
    """The lossy control: traversal verification, then the final token redrawn from p at the accepted
    node (or the root) where that node had children, i.e. where the rule draws from a residual."""
    res = verify_tree_traversal(tokens, parents, p, q, lengths=lengths, generator=generator, siblings=siblings)
    B, N = tokens.shape
    m = res.num_accepted
    end = torch.where(m > 0, res.path.gather(1, (m - 1).clamp(min=0)[:, None]).squeeze(1), -1)  # (B,)
    real = torch.arange(N)[None] < lengths[:, None]
    had_kids = ((parents == end[:, None]) & real).any(1)  # (B,)
    y = sample_from_probs(p[torch.arange(B), 1 + end], torch.rand(B, generator=torch.Generator().manual_seed(99)))
    out = res.tokens.clone()
    out[torch.arange(B), m] = torch.where(had_kids, y, out[torch.arange(B), m])
    return TreeResult(out, res.path, m)


def _joint_test(fn, shape: str, seed: int):
    D = max(_depths(SHAPES[shape]))
    P, Q = _tables(D, seed)
    tokens, parents, p, q, lengths = _draw(shape, P, Q, B_BIG, seed + 1, ragged=True)
    res = fn(tokens, parents, p, q, lengths=lengths, generator=torch.Generator().manual_seed(seed + 2),
             siblings="without")
    full = _completed(res, P, D + 1, seed + 3).numpy()
    joint = _markov_joint(P, D + 1).numpy()
    return chi_square_gof(counts(joint_index(full, V), V ** (D + 1)), joint), joint, res


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_traversal_step_is_lossless_on_a_ragged_batch(shape):
    r, joint, res = _joint_test(verify_tree_traversal, shape, 10 + len(shape))
    assert detectable_tv(B_BIG, int((joint * B_BIG >= 5).sum()) + 1, alpha=ALPHA, power=0.99) <= 0.02
    assert r.p_value > ALPHA, r
    assert int(res.num_accepted.max()) == max(_depths(SHAPES[shape]))  # deep paths are accepted


def test_bonus_from_p_instead_of_the_residual_fails_the_same_test():
    r, _, _ = _joint_test(_bonus_from_p, "binary", 12)
    assert r.p_value < ALPHA, r


def test_traversal_accepts_more_than_tokenwise_below_the_root():
    # a rejected node no longer drops its subtree's siblings of later rank: mean accepted length up
    D = 2
    P, Q = _tables(D, 12)
    tokens, parents, p, q, lengths = _draw("binary", P, Q, B_BIG, 13, ragged=False)
    a = verify_tree_traversal(tokens, parents, p, q, lengths=lengths, generator=torch.Generator().manual_seed(1),
                              siblings="without")
    b = verify_tree(tokens, parents, p, q, lengths=lengths, generator=torch.Generator().manual_seed(1),
                    siblings="without")
    ta, tb = a.num_accepted.double(), b.num_accepted.double()
    assert float(ta.mean() - tb.mean()) > 6 * float((ta - tb).std()) / B_BIG ** 0.5


def test_chain_is_block_verification_and_a_fan_is_sequoia():
    g = torch.Generator().manual_seed(0)
    B, K = 2000, 4
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 1.5, -1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    lengths = torch.arange(B) % (K + 1)
    d = torch.where(torch.arange(K)[None] < lengths[:, None], d, -1)
    chain = (torch.arange(K) - 1).expand(B, K)
    t = verify_tree_traversal(d, chain, p, q, lengths=lengths, generator=make_generators(3, B), siblings="without")
    c = verify_chain_block(d, p, q, lengths=lengths, generator=make_generators(3, B))
    assert torch.equal(t.tokens, c.tokens) and torch.equal(t.num_accepted, c.num_accepted)
    P, Q = _tables(1, 4)
    SHAPES["fan"] = [-1, -1, -1, -1]
    try:
        tokens, parents, p, q, lengths = _draw("fan", P, Q, B, 5, ragged=True)
    finally:
        del SHAPES["fan"]
    t = verify_tree_traversal(tokens, parents, p, q, lengths=lengths, generator=make_generators(6, B), siblings="without")
    s = verify_tree(tokens, parents, p, q, lengths=lengths, generator=make_generators(6, B), siblings="without")
    assert torch.equal(t.tokens, s.tokens)


def test_kinds_outside_the_paper_are_refused_by_name():
    tokens, parents = torch.tensor([[1, 2]]), torch.tensor([[-1, -1]])
    p, q = torch.full((1, 3, V), 1.0 / V), torch.full((1, 2, V), 1.0 / V)
    for kw in (dict(siblings="sampled"), dict(siblings=["without", "sampled"])):
        with pytest.raises(ValueError, match="siblings"):
            verify_tree_traversal(tokens, parents, p, q, **kw)
    with pytest.raises(ValueError, match="siblings='deterministic'"):
        verify_tree_traversal(tokens, parents, p)
    res = verify_tree_traversal(tokens, parents, p, q, siblings=["without", "without"])
    assert res.tokens.shape == (1, 2)


def test_oracle_verdicts():
    # lossless law: PASS on the shallow drawn cases with the power; no FAIL on the deeper ones;
    # SpecInfer's law (token-wise) FAILS below the root's children, where the rules differ
    shallow_drawn = drawn_cases(shallow(standard_tree_cases(), 1))
    rep = check_tree_sampler(verify_tree_traversal, siblings="without", samples=30_000, seed=0, cases=shallow_drawn)
    assert rep.verdict == "PASS", rep.summary()
    deep = drawn_cases(standard_tree_cases())
    assert check_tree_sampler(verify_tree_traversal, siblings="without", samples=4_000, seed=1,
                              cases=deep).verdict != "FAIL"
    assert check_tree_sampler(verify_tree_traversal, siblings="without", law="specinfer", samples=4_000, seed=1,
                              cases=deep).verdict == "FAIL"
