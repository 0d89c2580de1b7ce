"""The tree oracle's cases: token trees with known target (p) and draft (q) tables.

A `TreeVariant` is one tree shape (parents, topologically ordered, -1 = child of the root) in one of
two draft regimes, the two SpecInfer (Miao et al. 2024) verifies with multi-step speculative sampling:
- deterministic siblings (`tokens` given; q one-hot, passed as q=None): EAGLE-2 / Medusa top-k
  trees, n-gram and lookahead candidates. p is one row per node: row 0 after the root, row 1 + i
  after node i; nodes whose token paths are equal get equal rows (as a real model would);
- sampled siblings (`tokens` None): the children of a node whose token path is t are drawn from
  q(t), i.i.d. (SpecInfer) or without replacement (Sequoia, Chen et al. 2024), as the check is told.
  p and q are tables over every token path of length d <= D in heap order: the path (x_1..x_d) is
  row sum_{d'<d} V^d' + joint_index(x) (root row 0; the child x of row r is row r V + 1 + x), so
  the target depends on the whole token path, like a language model.
- mixed (`ranks` given in a sampled variant, `mixed_cases`): some nodes deterministic, the token of
  rank r of q at their parent's path (a top-k head's r-th choice; q passed is that q, the one they
  were ranked by), the others sampled as the check is told: top-k levels over sampled levels, a
  top-k sibling beside sampled ones (hybrid.py's n-gram and learned branches). Verified with
  per-node kinds (rejection.verify_tree); the exact SpecInfer law is not tabulated for them.
`TreeCase` groups variants of one vocabulary and one regime; the check interleaves them in one
batch (rows ragged: each has its own shape and length). `standard_tree_cases` covers depth 1-4,
width 1-4, temperature / top-k / top-p shaped p, near one-hot p and q, p == q, empty trees, a
p(x) = 0 draft and (a case of its own, see `duplicates`) repeated deterministic siblings.
`draw_tree_rows` draws the rows the sampler sees.

Left out: sampled siblings each from a different q (SpecInfer with several draft models; the
mixed cases' deterministic siblings are the one-hot instance of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .cases import _filtered


@dataclass(frozen=True)
class TreeVariant:
    parents: Tuple[int, ...]  # (N,) parent of each node: -1 the root, else an earlier node
    tokens: Optional[Tuple[int, ...]]  # (N,) fixed sibling tokens (q one-hot), or None: sampled
    p: torch.Tensor  # deterministic: (N+1, V) per node; sampled: (rows(D), V) per token path (heap order)
    q: Optional[torch.Tensor]  # sampled: (rows(D-1), V) the q a path's children are drawn from; else None
    label: str
    ranks: Optional[Tuple[int, ...]] = None  # sampled variants: (N,) -1 sampled, r >= 0 deterministic,
    # the token of rank r of q at the parent's path (mixed trees); None: every node sampled

    @property
    def n(self) -> int:
        return len(self.parents)


@dataclass(frozen=True)
class TreeCase:
    name: str
    vocab: int  # V
    width: int  # N_max, the padded node count of the batch
    variants: Tuple[TreeVariant, ...]  # all deterministic or all sampled (mixed ones count as sampled)


def depths(parents) -> Tuple[int, ...]:
    """Depth of each node (root children 1)."""
    d = []
    for par in parents:
        d.append(1 if par < 0 else d[par] + 1)
    return tuple(d)


def children(parents, node: int) -> Tuple[int, ...]:
    """Children of `node` (-1: the root) in index order (the order a verifier tries them)."""
    return tuple(i for i, par in enumerate(parents) if par == node)


def heap_rows(vocab: int, depth: int) -> int:
    """Rows of a table over every token path of length 0..depth: sum_d V^d."""
    return sum(vocab ** d for d in range(depth + 1))


def _sampled(V, D, g, make_p, make_q, parents, label) -> TreeVariant:
    logits = torch.randn(heap_rows(V, D), V, generator=g) * 1.5  # (rows(D), V)
    p = make_p(logits)  # (rows(D), V)
    q = make_q(logits[: heap_rows(V, D - 1)] + torch.randn(heap_rows(V, D - 1), V, generator=g))  # (rows(D-1), V)
    return TreeVariant(tuple(parents), None, p, q, label)


def _fixed(V, g, parents, tokens, make_p, label, zero_at: Optional[int] = None) -> TreeVariant:
    """Deterministic variant; nodes with equal token paths share their p row. zero_at: node whose
    token gets p = 0 at its parent (a draft the target cannot emit)."""
    by_path, paths, rows = {}, [()], []
    for par, t in zip(parents, tokens):
        paths.append(paths[par + 1] + (t,))
    for path in paths:
        if path not in by_path:
            by_path[path] = make_p(torch.randn(1, V, generator=g) * 1.5)[0]  # (V,)
        rows.append(by_path[path])
    p = torch.stack(rows)  # (N+1, V)
    if zero_at is not None:
        par = parents[zero_at]
        p[par + 1, tokens[zero_at]] = 0.0
        p[par + 1] /= p[par + 1].sum()
    return TreeVariant(tuple(parents), tuple(tokens), p, None, label)


def _topk_tokens(parents, p_nodes: torch.Tensor, shift: int) -> Tuple[int, ...]:
    """Deterministic siblings as a top-k drafter makes them: the children of a node are the tokens
    of rank shift, shift + 1, ... of p at that node (distinct; shift > 0: a draft worse than p)."""
    order = p_nodes.argsort(-1, descending=True)  # (N+1, V)
    toks = []
    for i, par in enumerate(parents):
        rank = sum(1 for j in range(i) if parents[j] == par)
        toks.append(int(order[par + 1, (shift + rank) % p_nodes.shape[1]]))
    return tuple(toks)


CHAIN4 = (-1, 0, 1, 2)  # depth 4, width 1
FAN4 = (-1, -1, -1, -1)  # depth 1, width 4
BINARY2 = (-1, -1, 0, 0, 1, 1)  # depth 2, width 2
MIXED3 = (-1, 0, 0, -1, 1, 3)  # root -> {0, 3}; 0 -> {1, 2}; 1 -> {4}; 3 -> {5}: depth 3, ragged
EAGLE4 = (-1, -1, -1, 0, 0, 1, 3, 6)  # an EAGLE-like tree: width 3 at the root, depth 4


def standard_tree_cases(seed: int = 0, duplicates: bool = True) -> Tuple[TreeCase, ...]:
    """The standard cases (see the module docstring). duplicates=False leaves out the case with
    repeated deterministic siblings, for verifiers whose drafters never produce them (top-k)."""
    g = torch.Generator().manual_seed(seed)
    sm = lambda x: torch.softmax(x, -1)
    soft = lambda x: torch.softmax(x / 1.3, -1)
    V = 5
    iid = TreeCase("sampled", V, 6, (
        _sampled(V, 4, g, sm, sm, CHAIN4, "chain depth 4"),
        _sampled(V, 1, g, sm, soft, FAN4, "fan width 4"),
        _sampled(V, 2, g, sm, sm, BINARY2, "binary depth 2"),
        _sampled(V, 3, g, lambda x: _filtered(x, top_k=4), sm, MIXED3, "mixed depth 3, top-k p"),
        _sampled(V, 1, g, sm, sm, (-1,), "one node"),
        _sampled(V, 0, g, sm, sm, (), "empty tree"),
    ))
    eq = _sampled(V, 2, g, sm, sm, (-1, -1, -1, 0, 0), "p == q, width 3")
    near = torch.tensor([0.996, 0.001, 0.001, 0.001, 0.001])
    qsmall = torch.tensor([0.001, 0.4, 0.3, 0.2, 0.099])
    rows2 = heap_rows(V, 2)
    degenerate = TreeCase("degenerate", V, 5, (
        TreeVariant(eq.parents, None, eq.p, eq.p[: heap_rows(V, 1)].clone(), eq.label),
        TreeVariant((-1, -1, 0), None, near.expand(rows2, V).clone(), qsmall.expand(heap_rows(V, 1), V).clone(),
                    "p ~ one-hot, q small there"),
        TreeVariant((-1, -1, 0), None, torch.nn.functional.one_hot(torch.arange(rows2) % V, V).float(),
                    sm(torch.randn(heap_rows(V, 1), V, generator=g)), "p one-hot"),
        TreeVariant((-1, -1, 0), None, sm(torch.randn(rows2, V, generator=g)),
                    torch.tensor([0.001, 0.001, 0.001, 0.001, 0.996]).expand(heap_rows(V, 1), V).clone(), "q ~ one-hot"),
    ))
    V = 6
    fixed = TreeCase("fixed", V, 8, (
        _fixed(V, g, CHAIN4, (2, 0, 4, 1), sm, "chain depth 4"),
        _fixed(V, g, FAN4, (3, 1, 5, 0), sm, "fan width 4"),
        _fixed(V, g, MIXED3, (1, 2, 0, 4, 3, 1), lambda x: _filtered(x, top_k=4), "mixed depth 3, top-k p",
               zero_at=2),
        _fixed(V, g, (-1,), (0,), sm, "one node"),
        _fixed(V, g, (), (), sm, "empty tree"),
        _fixed(V, g, (-1, -1, 0), (5, 2, 5), lambda x: torch.softmax(4 * x, -1), "near one-hot p"),
    ))
    V = 32
    warm = lambda x: _filtered(x, 0.7, top_k=8)
    nucleus = lambda x: _filtered(x, top_p=0.8)
    filtered = TreeCase("filtered", V, 5, (
        _sampled(V, 2, g, warm, lambda x: _filtered(x, 1.3), (-1, -1, 0, 0, 1), "T0.7 top-k8 p vs T1.3 q"),
        _sampled(V, 1, g, nucleus, lambda x: _filtered(x, top_p=0.95), (-1, -1, -1), "top-p0.8 p vs top-p0.95 q"),
    ))
    p_e = _fixed(V, g, EAGLE4, (0,) * len(EAGLE4), nucleus, "")
    p_w = _fixed(V, g, CHAIN4, (0,) * 4, warm, "")
    fixed_filtered = TreeCase("fixed-filtered", V, len(EAGLE4), (
        _fixed(V, torch.Generator().manual_seed(seed + 1), EAGLE4, _topk_tokens(EAGLE4, p_e.p, 0), nucleus,
               "top-k tree depth 4, top-p p"),
        _fixed(V, torch.Generator().manual_seed(seed + 2), CHAIN4, _topk_tokens(CHAIN4, p_w.p, 1), warm,
               "second-choice chain, T0.7 top-k8 p"),
    ))
    cases = [iid, degenerate, fixed, filtered, fixed_filtered]
    if duplicates:
        V = 5
        cases.append(TreeCase("duplicates", V, 5, (
            _fixed(V, g, (-1, -1, -1), (3, 1, 3), sm, "repeated sibling"),
            _fixed(V, g, (-1, -1, 0, 1, 3), (2, 2, 4, 0, 1), sm, "subtree under the repeat"),
        )))
    return tuple(cases)


def sequence_cases(seed: int = 0) -> Tuple[TreeCase, ...]:
    """k i.i.d. draft sequences (chains from the root, each token ~ q at its path), the draft law
    "trie" of check_tree_sampler; small vocabularies so that sequences often share a prefix (a trie
    merge of them then differs from SpecInfer's law, not from the target's)."""
    g = torch.Generator().manual_seed(seed + 7)
    sm = lambda x: torch.softmax(x, -1)
    flat = lambda x: torch.softmax(x / 3, -1)  # a q that repeats tokens often
    V = 3
    return (TreeCase("sequences", V, 9, (
        _sampled(V, 3, g, sm, flat, (-1, 0, 1, -1, 3, 4, -1, 6, 7), "3 sequences of 3"),
        _sampled(V, 2, g, sm, sm, (-1, 0, -1, 2, -1, 4, -1, 6), "4 sequences of 2"),
        _sampled(V, 2, g, lambda x: _filtered(x, top_k=2), flat, (-1, 0, -1, 2), "2 sequences of 2, top-k p"),
    )),)


def mixed_cases(seed: int = 0) -> Tuple[TreeCase, ...]:
    """Sampled trees with deterministic (top-k) nodes (`ranks`): top-k levels over sampled levels,
    sampled levels over top-k, a top-k sibling beside sampled ones (hybrid.py's tree), a top-k chain
    beside a sampled chain. Verified with per-node kinds."""
    g = torch.Generator().manual_seed(seed + 13)
    sm = lambda x: torch.softmax(x, -1)
    V = 5

    def mixed(D, parents, ranks, label):
        v = _sampled(V, D, g, sm, sm, parents, label)
        return TreeVariant(v.parents, None, v.p, v.q, v.label, tuple(ranks))

    return (TreeCase("mixed kinds", V, 5, (
        mixed(2, (-1, -1, 0, 0, 1), (0, 1, -1, -1, -1), "top-2 level, then sampled"),
        mixed(2, (-1, -1, 0, 1), (-1, -1, 0, 0), "sampled level, then top-1"),
        mixed(1, (-1, -1, -1), (0, -1, -1), "top-1 beside two samples"),
        mixed(2, (-1, 0, -1, 2), (1, 0, -1, -1), "top-k chain beside a sampled chain"),
    )),)


def chain_cases(seed: int = 0) -> Tuple[TreeCase, ...]:
    """Chains whose target p depends on the drafted prefix (a table over token paths, as a language
    model's), ragged lengths, sampled and deterministic drafts: the chain check's lossless law."""
    g = torch.Generator().manual_seed(seed + 11)
    sm = lambda x: torch.softmax(x, -1)
    V = 4
    near = torch.tensor([0.997, 0.001, 0.001, 0.001])  # a near one-hot p: its minor cells pool
    q_near = torch.softmax(torch.randn(heap_rows(V, 1), V, generator=torch.Generator().manual_seed(seed + 12)), -1)
    sampled = TreeCase("chain", V, 4, (
        _sampled(V, 4, g, sm, sm, CHAIN4, "L4"),
        _sampled(V, 2, g, lambda x: _filtered(x, top_k=3), sm, CHAIN4[:2], "L2 top-k p"),
        _sampled(V, 1, g, sm, lambda x: torch.softmax(x / 2, -1), CHAIN4[:1], "L1"),
        _sampled(V, 0, g, sm, sm, (), "L0"),
        TreeVariant(CHAIN4[:2], None, near.expand(heap_rows(V, 2), V).clone(), q_near, "L2 near one-hot p"),
    ))
    V = 24
    filtered = TreeCase("chain-filtered", V, 2, (
        _sampled(V, 2, g, lambda x: _filtered(x, 0.7, top_k=8), lambda x: _filtered(x, 1.3), CHAIN4[:2], "T0.7 top-k8 vs T1.3 L2"),
    ))
    V = 6
    fixed = TreeCase("chain-fixed", V, 3, (
        _fixed(V, g, CHAIN4[:3], (2, 0, 4), sm, "L3"),
        _fixed(V, g, CHAIN4[:3], (1, 3, 3), sm, "p(x)=0 draft L3", zero_at=1),
        _fixed(V, g, CHAIN4[:1], (5,), sm, "L1"),
    ))
    return (sampled, filtered, fixed)


# ---------------------------------------------------------------- the rows a sampler sees

def draw_tree_rows(case: TreeCase, vid: torch.Tensor, siblings: str, gen: torch.Generator):
    """Rows of `case` for variant ids vid (B,): tokens (B, N) -1 padded, parents (B, N), lengths
    (B,), p (B, N+1, V), q (B, N, V) or None, kinds (B, N) or None. Sampled siblings ~ q at their
    parent, i.i.d. (siblings="iid") or without replacement ("without": from q without the tokens of
    the earlier sampled siblings); q[b, i] is the parent's q (before any removal). A case with mixed
    variants (`ranks`) gets kinds, the per-node indices of tree.SIBLING_KINDS (deterministic nodes
    0, the others the draws' kind), else None. Padding rows of p and q are uniform (valid, never to
    be read)."""
    B, N, V = vid.shape[0], case.width, case.vocab
    sampled = case.variants[0].tokens is None
    tokens = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
    parents = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
    p = torch.full((B, N + 1, V), 1.0 / V)  # (B, N+1, V)
    q = torch.full((B, N, V), 1.0 / V) if sampled else None  # (B, N, V)
    lengths = torch.tensor([v.n for v in case.variants], dtype=torch.long)[vid]  # (B,)
    drawn = 2 if siblings == "without" else 1  # tree.SIBLING_KINDS index of the sampled nodes
    kinds = torch.full((B, N), drawn, dtype=torch.long) if any(v.ranks for v in case.variants) else None  # (B, N)
    for vi, var in enumerate(case.variants):
        rows = torch.nonzero(vid == vi).reshape(-1)  # (n,)
        n, k = rows.numel(), var.n
        if n == 0:
            continue
        if k:
            parents[rows, :k] = torch.tensor(var.parents)
        if not sampled:
            if k:
                tokens[rows, :k] = torch.tensor(var.tokens)
            p[rows, : k + 1] = var.p.float()
            continue
        heap = torch.zeros(n, k, dtype=torch.long)  # (n, k) table row of each node's token path
        p[rows, 0] = var.p[0].float()
        for i, par in enumerate(var.parents):  # parents first: the parent's path is known
            prow = heap[:, par] if par >= 0 else torch.zeros(n, dtype=torch.long)  # (n,)
            qi = var.q[prow].double()  # (n, V)
            rank = var.ranks[i] if var.ranks else -1
            if rank >= 0:  # deterministic: the token of rank `rank` of q (stable on ties)
                x = torch.sort(qi, dim=-1, descending=True, stable=True).indices[:, rank]  # (n,)
                kinds[rows, i] = 0
            else:
                draw = qi.clone()
                if siblings == "without":
                    for j in range(i):  # earlier sampled siblings' tokens are no longer available
                        if var.parents[j] == par and not (var.ranks and var.ranks[j] >= 0):
                            draw[torch.arange(n), tokens[rows, j]] = 0.0
                cdf = draw.cumsum(-1)  # (n, V)
                u = torch.rand(n, 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]  # (n, 1)
                x = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=V - 1)  # (n,)
            tokens[rows, i] = x
            heap[:, i] = prow * V + 1 + x
            p[rows, 1 + i] = var.p[heap[:, i]].float()
            q[rows, i] = qi.float()
    return tokens, parents, lengths, p, q, kinds


POWER_SAMPLES = 30_000  # rows per variant at which correct verifiers PASS the shallow cases (depth <= 1)


def shallow(cases, max_depth: int = 2) -> Tuple[TreeCase, ...]:
    """The variants of `cases` no deeper than max_depth (cases left empty dropped): fewer prefixes per
    depth and fewer depths per step, so an honest PASS needs far fewer rows (the self-tests' cases)."""
    out = []
    for c in cases:
        keep = tuple(v for v in c.variants if max(depths(v.parents), default=0) <= max_depth)
        if keep:
            out.append(TreeCase(c.name, c.vocab, c.width, keep))
    return tuple(out)
