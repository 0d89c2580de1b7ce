"""Tests of tree verification (specref/rejection.py: verify_tree, verify_tree_greedy).

Statistical tests: ONE batched call of B = 200,000 copies of a tree step per case, significance
1e-3, fixed seeds, power against TV 0.02 stated with oracle.samples_for_tv / detectable_tv.

Setting: the target at a node of depth i whose token is s is P[i, s] (s = V: the root), so two
nodes with equal paths get equal p, as for a real model. Draft tokens are either sampled, node i
from Q[depth - 1, token of its parent] (siblings i.i.d. from the q at their parent), or fixed.
Exact laws checked:
  - the first emitted token is P[0, root];
  - "completed joint": each row's emitted y_1..y_{m+1} continued by direct sampling from P up to
    L = D + 1 tokens is distributed as the Markov joint of L tokens (a lossless step emits a prefix
    of a target sample, cut at a stopping time);
  - for a fixed deterministic tree: the joint (m, y_1..y_{m+1}) is that of a target sample cut at
    the first token that leaves the tree (recursive rejection over distinct children accepts child
    x with probability exactly p(x)).
"""
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specref.oracle import chi_square_gof, counts, detectable_tv, joint_index, samples_for_tv
from specref.rejection import TreeResult, verify_chain, verify_chain_greedy, verify_tree, verify_tree_greedy
from specref.sampling import SamplingConfig, logits_to_probs, make_generators, sample_from_probs, uniforms

ALPHA = 1e-3
B_BIG = 200_000
V = 5

SHAPES = {  # parents; -1 = child of the root
    "chain": [-1, 0, 1, 2],  # deep chain, depth 4
    "fan": [-1, -1, -1, -1],  # wide fan: four siblings under the root
    "mixed": [-1, 0, 0, -1, 1, 3],  # root -> {0, 3}; 0 -> {1, 2}; 1 -> {4}; 3 -> {5}; depth 3
}
FIXED_TOKENS = {  # deterministic trees (same in every row)
    "chain": [2, 0, 4, 1],
    "fan": [3, 1, 3, 0],  # a duplicate sibling (3 twice): the second is never accepted
    "mixed": [1, 2, 0, 4, 3, 1],
}


def _verify(tokens, parents, p, q=None, **kw):
    """verify_tree on this file's drafts: sampled ones (i.i.d. at their parent) with q, else fixed."""
    return verify_tree(tokens, parents, p, q, siblings="sampled" if q is not None else None, **kw)


def _depths(parents):
    d = []
    for par in parents:
        d.append(1 if par < 0 else d[par] + 1)
    return d


def _tables(D: int, seed: int, warp=SamplingConfig(temperature=0.9, top_k=4)):
    """P (D+1, V+1, V) target after a token at depth i (s = V: the root), warped; Q (D, V+1, V)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(D + 1, V + 1, V, generator=g) * 1.3
    P = logits_to_probs(t, warp).double()
    Q = logits_to_probs(t[:D] + torch.randn(D, V + 1, V, generator=g), SamplingConfig()).double()
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


def _simulate(shape: str, P, Q, mode: str, verify, seed: int, n: int = B_BIG):
    """n copies of one tree step. mode: "q" sampled drafts with q, "none" sampled drafts verified
    as deterministic, "fixed" the FIXED_TOKENS tree. Returns (result, tokens)."""
    parents = SHAPES[shape]
    depth = _depths(parents)
    N = len(parents)
    Pf, Qf = P.float(), Q.float()
    g = torch.Generator().manual_seed(seed)
    toks, qs = [], []
    for i, par in enumerate(parents):  # parents come first: a node's parent token is known
        s = torch.full((n,), V) if par < 0 else toks[par]
        qi = Qf[depth[i] - 1, s]  # (n, V) the q at the parent
        if mode == "fixed":
            x = torch.full((n,), FIXED_TOKENS[shape][i])
        else:
            x = sample_from_probs(qi, torch.rand(n, generator=g))  # (n,)
        toks.append(x)
        qs.append(qi)
    tokens = torch.stack(toks, 1)  # (n, N)
    p = torch.stack([Pf[0, torch.full((n,), V)]] + [Pf[depth[i], toks[i]] for i in range(N)], 1)  # (n, N+1, V)
    q = torch.stack(qs, 1) if mode == "q" else None  # (n, N, V)
    par_t = torch.tensor(parents).expand(n, N)
    kind = {"siblings": "sampled"} if q is not None and verify is verify_tree else {}  # i.i.d. draws
    return verify(tokens, par_t, p, q, generator=torch.Generator().manual_seed(seed + 1), **kind), tokens


def _markov_joint(P, L):
    """Exact joint (V^L,) of L target tokens from the root (first token most significant)."""
    prob = P[0, V].clone()  # (V,)
    last = torch.arange(V)
    for i in range(1, L):
        prob = (prob[:, None] * P[i, last]).reshape(-1)  # (V^(i+1),)
        last = torch.arange(V).repeat(prob.shape[0] // V)
    return prob


def _completed(res: TreeResult, P, L: int, seed: int) -> torch.Tensor:
    """Continue each row's emitted tokens by direct sampling from P up to L tokens. -> (n, L)."""
    n = res.tokens.shape[0]
    m = res.num_accepted
    out = torch.full((n, L), -1, dtype=torch.long)
    out[:, : res.tokens.shape[1]] = res.tokens[:, :L]
    g = torch.Generator().manual_seed(seed)
    Pf = P.float()
    for j in range(1, L):  # position j: emitted if j <= m, else sampled after out[:, j-1]
        draw = sample_from_probs(Pf[j, out[:, j - 1]], torch.rand(n, generator=g))
        out[:, j] = torch.where(j > m, draw, out[:, j])
    return out


def _truncation_law(shape: str, P, L: int) -> torch.Tensor:
    """Exact law of the cells (m, y_1..y_{m+1}) for the fixed deterministic tree: a target sample
    y_1..y_L walked down the tree (first node with each token) until a token leaves it."""
    parents, tokens = SHAPES[shape], FIXED_TOKENS[shape]
    child = {}  # (parent, token) -> first node
    for i, (par, t) in enumerate(zip(parents, tokens)):
        child.setdefault((par, t), i)
    joint = _markov_joint(P, L)  # (V^L,)
    offsets = np.cumsum([0] + [V ** (j + 1) for j in range(L)])
    law = torch.zeros(int(offsets[-1]), dtype=torch.float64)
    for idx in range(V ** L):
        y = [(idx // V ** (L - 1 - j)) % V for j in range(L)]
        node, m = -1, 0
        while m < L - 1 and (node, y[m]) in child:
            node, m = child[(node, y[m])], m + 1
        law[offsets[m] + joint_index(np.array([y[: m + 1]]), V)[0]] += joint[idx]
    return law


def _observed_truncation(res: TreeResult, L: int) -> np.ndarray:
    m, toks = res.num_accepted.numpy(), res.tokens.numpy()
    offsets = np.cumsum([0] + [V ** (j + 1) for j in range(L)])
    cell = np.zeros(m.shape, dtype=np.int64)
    for j in range(L):
        rows = m == j
        cell[rows] = offsets[j] + joint_index(toks[rows, : j + 1], V)
    return counts(cell, int(offsets[-1]))


def _cells_kept(probs, n):
    e = np.asarray(probs) * n
    return max(2, int((e >= 5).sum()) + int(((e > 0) & (e < 5)).any()))


# ---------------------------------------------------------------- the tree step is distributed as p

CASES = [(s, m) for s in SHAPES for m in ("q", "none", "fixed")]


@pytest.mark.parametrize("shape,mode", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_tree_step_matches_target(shape, mode):
    D = max(_depths(SHAPES[shape]))
    L = D + 1
    P, Q = _tables(D, seed=len(shape) * 7 + len(mode))
    res, _ = _simulate(shape, P, Q, mode, _verify, seed=3 + len(mode))
    # first emitted token vs p at the root (power 0.99 against TV 0.02: 26,000 samples suffice)
    first = chi_square_gof(counts(res.tokens[:, 0], V), P[0, V].numpy())
    assert first.p_value > ALPHA, first
    assert B_BIG >= samples_for_tv(0.02, V, alpha=ALPHA, power=0.99)
    # completed joint of L tokens vs the Markov joint (V^L <= 3125 cells: power 0.99 at TV <= 0.02)
    joint = _markov_joint(P, L).numpy()
    full = _completed(res, P, L, seed=99)
    r = chi_square_gof(counts(joint_index(full, V), V ** L), joint)
    assert r.p_value > ALPHA, r
    assert detectable_tv(B_BIG, _cells_kept(joint, B_BIG), alpha=ALPHA, power=0.99) <= 0.02
    if mode == "fixed":  # the (accepted length, tokens) law of a fixed deterministic tree
        law = _truncation_law(shape, P, L).numpy()
        r = chi_square_gof(_observed_truncation(res, L), law)
        assert r.p_value > ALPHA, r


def test_chain_tree_equals_verify_chain():
    # a chain written as a tree consumes the same uniforms in the same layout: identical results
    P, Q = _tables(4, seed=1)
    for mode in ("q", "none"):
        res, toks = _simulate("chain", P, Q, mode, _verify, seed=5, n=20_000)
        _, p, q = _inputs_of_chain(P, Q, toks, mode)
        ch = verify_chain(toks, p, q, generator=torch.Generator().manual_seed(6))
        assert torch.equal(res.tokens, ch.tokens) and torch.equal(res.num_accepted, ch.num_accepted)


def _inputs_of_chain(P, Q, toks, mode):
    n = toks.shape[0]
    Pf, Qf = P.float(), Q.float()
    prev = torch.cat([torch.full((n, 1), V), toks], 1)  # (n, 5)
    p = torch.stack([Pf[i, prev[:, i]] for i in range(5)], 1)  # (n, 5, V)
    q = torch.stack([Qf[i, prev[:, i]] for i in range(4)], 1) if mode == "q" else None
    return toks, p, q


# ---------------------------------------------------------------- mutants

def _tree_ref(tokens, parents, p, q=None, *, lengths=None, generator=None, bug=None):
    """A second implementation, one loop over nodes in index order, with switchable bugs.
    bug=None must equal verify_tree exactly (same uniforms)."""
    B, N = tokens.shape
    u = uniforms((N + 1,), B, generator, "cpu")  # (B, N+1)
    rows = torch.arange(B)
    cur = torch.full((B,), -1)
    r, mass = p[:, 0].clone(), torch.ones(B)
    n_acc = torch.zeros(B, dtype=torch.long)
    path = torch.full((B, N), -1)
    for i in range(N):
        cand = parents[:, i] == cur  # (B,) node i is a child of the current node
        x = tokens[:, i]
        rx = r[rows, x]
        if q is None:
            acc = cand & (u[:, i] * mass < rx)
            nxt = r.scatter(1, x[:, None], 0.0)
        else:
            qx = q[rows, i, x]
            acc = cand & (qx > 0) & (u[:, i] * qx * mass < rx)
            nxt = (r - mass[:, None] * q[:, i]).clamp(min=0)
        nm = nxt.sum(1)
        upd = cand & ~acc & (nm > 0)
        if bug != "no_update":  # "no_update": every sibling is tested against the unchanged p
            r = torch.where(upd[:, None], nxt, r)
            if bug != "no_renorm":  # "no_renorm": the residual keeps the old total
                mass = torch.where(upd, nm, mass)
        path[rows, n_acc] = torch.where(acc, i, path[rows, n_acc])
        n_acc += acc.long()
        cur = torch.where(acc, i, cur)
        r = torch.where(acc[:, None], p[rows, 1 + cur.clamp(min=0)], r)
        mass = torch.where(acc, torch.ones_like(mass), mass)
    if bug == "final_from_p":  # none accepted: draw from p at the node, not from the residual
        r = p[rows, 1 + cur]
    last = sample_from_probs(r, u[:, N])
    out = torch.cat([torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1), torch.full((B, 1), -1)], 1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return TreeResult(out, path, n_acc)


def test_reference_without_bug_equals_verify_tree():
    for shape in SHAPES:
        D = max(_depths(SHAPES[shape]))
        P, Q = _tables(D, seed=2)
        for mode in ("q", "none"):
            a, _ = _simulate(shape, P, Q, mode, _verify, seed=7, n=20_000)
            b, _ = _simulate(shape, P, Q, mode, partial(_tree_ref, bug=None), seed=7, n=20_000)
            assert torch.equal(a.tokens[:, : D + 1], b.tokens[:, : D + 1]) and torch.equal(a.num_accepted, b.num_accepted)
            assert torch.equal(a.path, b.path[:, :D])


MUTANTS = [("no_update", "fan", "none"), ("no_update", "mixed", "q"), ("no_renorm", "fan", "none"),
           ("no_renorm", "fan", "q"), ("final_from_p", "mixed", "none"), ("final_from_p", "fan", "q")]


@pytest.mark.parametrize("bug,shape,mode", MUTANTS, ids=[f"{b}-{s}-{m}" for b, s, m in MUTANTS])
def test_oracle_rejects_tree_mutant(bug, shape, mode):
    D = max(_depths(SHAPES[shape]))
    L = D + 1
    # tables where each bug shows (no_renorm with q can be nearly harmless when the draft covers
    # the target's residual: with seed 11 its TV is ~0.001, with this seed 0.06)
    P, Q = _tables(D, seed=13)
    res, _ = _simulate(shape, P, Q, mode, partial(_tree_ref, bug=bug), seed=13, n=B_BIG // 4)
    first = chi_square_gof(counts(res.tokens[:, 0], V), P[0, V].numpy())
    full = _completed(res, P, L, seed=99)
    joint = chi_square_gof(counts(joint_index(full, V), V ** L), _markov_joint(P, L).numpy())
    assert min(first.p_value, joint.p_value) < ALPHA, (first, joint)


# ---------------------------------------------------------------- greedy

def test_greedy_tree_hand_built():
    # row 0: root -> {0: 5, 1: 3}; node 0 -> {2: 1, 3: 2}; node 3 -> {4: 4}. argmax after the root
    #        is 5 (node 0), after node 0 is 2 (node 3), after node 3 is 4 (node 4), after node 4 is 0
    #        -> path 0, 3, 4; emitted 5 2 4 then the bonus 0.
    # row 1: duplicate siblings (5 at nodes 0 and 1); only node 1's subtree continues with the
    #        argmax 2 -> the longer path 1, 2; emitted 5 2 then the argmax after node 2.
    # row 2: nothing matches at the root -> only the root argmax 7.
    # row 3: ragged: 2 real nodes (padding -1) -> path 0, 1 then the bonus.
    tokens = torch.tensor([[5, 3, 1, 2, 4],
                           [5, 5, 2, -1, -1],
                           [1, 2, 3, 4, 6],
                           [5, 2, -1, -1, -1]])
    parents = torch.tensor([[-1, -1, 0, 0, 3],
                            [-1, -1, 1, -1, -1],
                            [-1, -1, -1, 0, 1],
                            [-1, 0, -1, -1, -1]])
    # argmax ids (B, N+1): column 0 after the root, column 1+i after node i
    a = torch.tensor([[5, 2, 9, 9, 4, 0],
                      [5, 9, 2, 6, 9, 9],
                      [7, 9, 9, 9, 9, 9],
                      [5, 2, 8, 9, 9, 9]])
    res = verify_tree_greedy(tokens, parents, a)
    assert res.path.tolist() == [[0, 3, 4], [1, 2, -1], [-1, -1, -1], [0, 1, -1]]
    assert res.tokens.tolist() == [[5, 2, 4, 0], [5, 2, 6, -1], [7, -1, -1, -1], [5, 2, 8, -1]]
    assert res.num_accepted.tolist() == [3, 2, 0, 2]
    logits = torch.nn.functional.one_hot(a, 10).float()  # (4, 6, 10): the same argmax
    assert torch.equal(verify_tree_greedy(tokens, parents, logits).tokens, res.tokens)


def test_tree_bad_inputs():
    tok = torch.tensor([[1, 2]])
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(tok, torch.tensor([[-1, 1]]), p)  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parents"):
        verify_tree(tok, torch.tensor([[-2, 0]]), p)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(tok, torch.tensor([[-1, 0, 0]]), p)
    with pytest.raises(ValueError, match="shape"):
        verify_tree(tok, torch.tensor([[-1, 0]]), p[:, :2])
    with pytest.raises(ValueError, match="= 4"):
        verify_tree(torch.tensor([[4, 2]]), torch.tensor([[-1, 0]]), p)
    with pytest.raises(ValueError, match="sums to"):
        verify_tree(tok, torch.tensor([[-1, 0]]), p * 2)


# ---------------------------------------------------------------- properties

def _random_tree(draw, N):
    return [draw(st.integers(-1, i - 1)) for i in range(N)]


@settings(max_examples=120, deadline=None, derandomize=True)
@given(B=st.integers(1, 4), N=st.integers(0, 7), vocab=st.integers(1, 5), with_q=st.booleans(),
       kind=st.sampled_from(["sampled", "without", "per node"]), seed=st.integers(0, 2 ** 31 - 1), data=st.data())
def test_tree_properties(B, N, vocab, with_q, kind, seed, data):
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([_random_tree(data.draw, N) for _ in range(B)], dtype=torch.long).reshape(B, N)
    lengths = torch.tensor([data.draw(st.integers(0, N)) for _ in range(B)])
    tokens = torch.randint(0, vocab, (B, N), generator=g)
    tokens = torch.where(torch.arange(N)[None, :] < lengths[:, None], tokens, -1)
    p = torch.softmax(torch.randn(B, N + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, N, vocab, generator=g), -1) if with_q else None
    siblings = None  # q None: deterministic; with q a kind of each sibling (rejection.SIBLING_KINDS)
    if with_q:
        siblings = torch.randint(0, 3, (B, N), generator=g) if kind == "per node" else kind
    verify = partial(verify_tree, siblings=siblings)
    res = verify(tokens, parents, p, q, generator=make_generators(seed, B))
    D = res.path.shape[1]
    assert res.tokens.shape == (B, D + 1)
    for b in range(B):  # per-row checks of a small batch
        m = int(res.num_accepted[b])
        nodes = res.path[b, :m].tolist()
        assert res.path[b, m:].eq(-1).all() and res.tokens[b, m + 1:].eq(-1).all()
        prev = -1
        for node in nodes:  # a root-to-node path of real nodes
            assert 0 <= node < int(lengths[b]) and int(parents[b, node]) == prev
            prev = node
        assert res.tokens[b, :m].tolist() == [int(tokens[b, i]) for i in nodes]
        last = int(res.tokens[b, m])
        assert 0 <= last < vocab and float(p[b, 1 + prev, last]) > 0  # from p's support at the node
        one = partial(verify_tree, siblings=siblings[b:b + 1] if isinstance(siblings, torch.Tensor) else siblings)
        alone = one(tokens[b:b + 1], parents[b:b + 1], p[b:b + 1], None if q is None else q[b:b + 1],
                    generator=make_generators(seed + b, 1))
        assert torch.equal(alone.tokens[0, : m + 1], res.tokens[b, : m + 1])  # rows are independent
    again = verify(tokens, parents, p, q, generator=make_generators(seed, B))
    assert torch.equal(again.tokens, res.tokens)  # deterministic under the seeds


@settings(max_examples=150, deadline=None, derandomize=True)
@given(N=st.integers(0, 8), vocab=st.integers(1, 3), data=st.data())
def test_greedy_tree_parity_with_plain_greedy(N, vocab, data):
    # The target is greedy-Markov: argmax after token s is f[s] (f[vocab] after the root). Plain
    # greedy decoding emits y_1 = f[root], y_{i+1} = f[y_i]. For ANY tree, greedy verification must
    # emit y_1..y_{m+1} with m the longest tree path spelling y_1..y_m.
    parents = _random_tree(data.draw, N)
    tokens = [data.draw(st.integers(0, vocab - 1)) for _ in range(N)]
    f = [data.draw(st.integers(0, vocab - 1)) for _ in range(vocab + 1)]
    greedy = [f[vocab]]
    for _ in range(N + 1):
        greedy.append(f[greedy[-1]])
    a = torch.tensor([[f[vocab]] + [f[t] for t in tokens]])  # (1, N+1) argmax after root / each node
    res = verify_tree_greedy(torch.tensor([tokens], dtype=torch.long).reshape(1, N),
                             torch.tensor([parents], dtype=torch.long).reshape(1, N), a)
    depth = _depths(parents)
    best = 0
    for i in range(N):  # brute force: walk up from every node
        path, node = [], i
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        if path[::-1] == greedy[: depth[i]]:
            best = max(best, depth[i])
    m = int(res.num_accepted[0])
    assert m == best
    assert res.tokens[0, : m + 1].tolist() == greedy[: m + 1]
