"""The exact law of one step of tree verification, from the recursive-rejection semantics.

SpecInfer (Miao et al. 2024, multi-step speculative sampling), as specref.rejection describes it: at
a node with target p, try the children in index order; child x drawn from q is accepted with
probability min(1, r(x) / q(x)), r the running residual (p before any rejection); a rejection
updates r <- norm(max(0, r - q)); an accepted child becomes the node (r = p there); when no child is
accepted (or at a leaf) the final token is drawn from r. Per node, in closed form:
- deterministic siblings (q one-hot on a fixed x_j): P(accept j) = prod_{i<j}(1 - r_i(x_i)) r_j(x_j),
  r_{j+1} = r_j without x_j, renormalised (a repeated token is never accepted);
- i.i.d. siblings from q: P(accept j with token x) = prod_{i<j} beta_i min(q, r_j)(x), beta_i =
  1 - sum min(q, r_i), r_{j+1} = norm(max(0, r_j - q)) (the update does not depend on the rejected
  token, so the siblings factorise);
- siblings without replacement (Sequoia, Chen et al. 2024): sibling j is drawn from q_j = q without
  the earlier siblings' tokens, renormalised, and tested with min(1, r(x) / q_j(x)); on rejection
  r <- norm(max(0, r - q_j)). The update depends on the rejected tokens: enumerated (V^j states).
A step's outcome is the cell (end node e, the tokens x_1..x_m of the path to e, final token y). Its
probability is the product of the per-node factors down the path (`exact_cells`), vectorised over
every token path the node can have (V^depth contexts for sampled trees, one for fixed ones).

Left out: SpecTr's optimal-transport verification, siblings with distinct q's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .tree_cases import TreeVariant, children, depths, heap_rows

MODES = ("fixed", "iid", "without")


@dataclass(frozen=True)
class Cells:
    """Every outcome of one variant with its exact probability (C cells)."""

    end: np.ndarray  # (C,) end node, -1 the root
    m: np.ndarray  # (C,) accepted nodes (depth of end)
    x: np.ndarray  # (C, D) tokens of the accepted path, -1 padded
    y: np.ndarray  # (C,) final token
    prob: np.ndarray  # (C,) float64, sums to 1


def _norm(r: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Rows of r (C, V) renormalised; rows of mass 0 keep `old` (probability-0 branches)."""
    s = r.sum(1, keepdims=True)  # (C, 1)
    return np.where(s > 0, r / np.where(s > 0, s, 1.0), old)


def local_law(r0: np.ndarray, q: Optional[np.ndarray], kids, mode: str):
    """One node, contexts (C, V): acc (C, k, V) = P(child j accepted with token x), fin (C, V) =
    P(no child accepted and final token y). kids: the children's fixed tokens (mode "fixed") or
    their count."""
    C, V = r0.shape
    k = len(kids) if mode == "fixed" else int(kids)
    acc = np.zeros((C, k, V))  # (C, k, V)
    r = _norm(r0, r0)
    if k == 0:  # a leaf: the bonus token from p
        return acc, r
    if mode == "fixed":
        reach = np.ones(C)  # (C,)
        for j, x in enumerate(kids):
            acc[:, j, x] = reach * r[:, x]
            reach = reach * (1.0 - r[:, x])
            nxt = r.copy()
            nxt[:, x] = 0.0
            r = _norm(nxt, r)
        return acc, reach[:, None] * r
    if mode == "iid":
        reach = np.ones(C)  # (C,)
        for j in range(k):
            mn = np.minimum(q, r)  # (C, V)
            acc[:, j] = reach[:, None] * mn
            reach = reach * np.clip(1.0 - mn.sum(1), 0.0, 1.0)
            r = _norm(np.maximum(r - q, 0.0), r)
        return acc, reach[:, None] * r
    assert mode == "without", mode
    states = [(np.ones(C), r, _norm(q, q))]  # (weight (C,), residual (C, V), current q (C, V))
    for j in range(k):
        nxt_states = []
        for w, r, qc in states:
            acc[:, j] += w[:, None] * np.minimum(qc, r)
            rej = np.maximum(qc - r, 0.0)  # (C, V) P(draw x and reject it)
            r2 = _norm(np.maximum(r - qc, 0.0), r)
            for x in np.flatnonzero((w[:, None] * rej).max(0) > 0):
                q2 = qc.copy()
                q2[:, x] = 0.0
                nxt_states.append((w * rej[:, x], r2, _norm(q2, qc)))
        states = nxt_states
    fin = np.zeros((C, V))  # (C, V)
    for w, r, _ in states:
        fin += w[:, None] * r
    return acc, fin


def exact_cells(v: TreeVariant, vocab: int, mode: str) -> Cells:
    """The exact law of (end node, path tokens, final token) for variant v under `mode`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    V, N = vocab, v.n
    dep = (0,) + depths(v.parents)  # dep[1 + i]: depth of node i; dep[0] = 0 the root
    D = max(dep)
    p = v.p.double().cpu().numpy()
    q = None if v.q is None else v.q.double().cpu().numpy()
    if (mode == "fixed") != (v.tokens is not None):
        raise ValueError(f"mode {mode!r} does not fit variant {v.label!r} (tokens {'given' if v.tokens else 'None'})")
    reach = {-1: np.ones(1)}  # node -> (C_node,) probability of accepting its path, per context
    blocks = []
    for node in [-1] + list(range(N)):  # parents before children
        d = dep[1 + node]
        kids = children(v.parents, node)
        if mode == "fixed":
            r0 = p[1 + node][None]  # (1, V)
            acc, fin = local_law(r0, None, [v.tokens[c] for c in kids], mode)
        else:
            lo, hi = heap_rows(V, d - 1), heap_rows(V, d)  # rows of the paths of length d
            r0 = p[lo:hi]  # (V^d, V)
            qn = q[lo:hi] if kids else None
            acc, fin = local_law(r0, qn, len(kids), mode)
        for s, c in enumerate(kids):
            if mode == "fixed":
                reach[c] = reach[node] * acc[:, s, v.tokens[c]]  # (1,)
            else:
                reach[c] = (reach[node][:, None] * acc[:, s, :]).reshape(-1)  # (V^(d+1),)
        law = reach[node][:, None] * fin  # (C, V)
        C = law.shape[0]
        if mode == "fixed":
            path, cur = [], node
            while cur >= 0:
                path.append(v.tokens[cur])
                cur = v.parents[cur]
            xs = np.array(path[::-1], dtype=np.int64).reshape(1, d)  # (1, d)
        else:
            xs = np.stack(np.unravel_index(np.arange(C), (V,) * d), 1) if d else np.zeros((1, 0), np.int64)  # (C, d)
        xpad = np.full((C * V, D), -1, dtype=np.int64)  # (C V, D)
        xpad[:, :d] = np.repeat(xs, V, axis=0)
        blocks.append((np.full(C * V, node), np.full(C * V, d), xpad, np.tile(np.arange(V), C), law.reshape(-1)))
    end, m, x, y, prob = (np.concatenate([b[i] for b in blocks]) for i in range(5))
    assert abs(prob.sum() - 1.0) < 1e-8, prob.sum()
    return Cells(end.astype(np.int64), m.astype(np.int64), x, y.astype(np.int64), prob)
