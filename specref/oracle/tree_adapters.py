"""Calling conventions of tree verifiers, and the retrieve-indices layout of EAGLE / Medusa.

Every convention is turned into one batched call returning (path (B, W) node indices of the accepted
path, -1 padded, last (B,) the final token); a verifier's malformed output raises `Malformed`
(the check reports it as a structural failure of the case, never a crash). Conventions:
- specref: fn(tokens (B, N), parents (B, N), p (B, N+1, V), q (B, N, V) | None, *, lengths, generator
  [, siblings]) -> TreeResult (or a tuple (tokens (B, D+1), path (B, D), num_accepted (B,))), as
  specref.rejection.verify_tree; greedy: fn(tokens, parents, logits (B, N+1, V), *, lengths).
  A verifier with a `siblings` parameter (verify_tree's) is told how the check drew the nodes, the
  kind of tree.SIBLING_KINDS: "sampled" (draft laws iid and trie: k chains from the root, each
  root child an independent draw), "without", "deterministic" (q None), or for mixed cases the
  per-node kinds (B, N) with, at the deterministic nodes, the q they were ranked by.
- plain: one row a call: fn(tokens (N,), parents (N,), p (N+1, V), q (N, V) | None, generator)
  -> (path (m,) node indices, last token); greedy: fn(tokens, parents, logits (N+1, V)).
- eagle: one row a call, in the layout of EAGLE (SafeAILab/EAGLE, utils.py) and Medusa: the tree is
  flattened as [root, node_0 .. node_{N-1}] (flat index 0 the root, 1 + i node i) and every root-
  to-leaf path is a row of retrieve_indices (P, D+1) (flat indices, -1 padded; rows sorted so that
  siblings appear in index order); candidates (P, D+1) are the tokens of those rows (column 0 the
  root token, here 0; -1 padded), logits (P, D+1, V) the target logits at each row position (log p;
  padding holds the last flat node's, as tree_logits[0, retrieve_indices] gives in EAGLE) and draft_probs (P, D+1, V) the q each position's token was
  drawn from (None for deterministic siblings). fn(candidates, retrieve_indices, logits,
  draft_probs, generator) -> (best_candidate, accept_length, next_token): the accepted path is
  candidates[best_candidate, 1 : 1 + accept_length]; greedy: fn(candidates, retrieve_indices, logits).
  (SGLang's kernels take the same tree as retrive_next_token / retrive_next_sibling links; a wrapper
  can build them from parents: first child and next sibling in index order.)
A verifier that is not told the kind (plain, eagle, a specref one without `siblings`) gets q one-hot
on the deterministic nodes of mixed cases: the one way to say "deterministic" in a q, under which
the rule for independent draws is the deterministic one.
"""
from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

from .adapters import Malformed, int_tensor

TREE_APIS = ("specref", "plain", "eagle")


def retrieve_layout(tokens, parents):
    """candidates (P, D+1), retrieve_indices (P, D+1) of one tree (see the module docstring)."""
    tokens, parents = [int(t) for t in tokens], [int(x) for x in parents]
    N = len(parents)
    has_child = {par for par in parents}
    paths = []
    for leaf in [i for i in range(N) if i not in has_child] or [-1]:
        path, cur = [], leaf
        while cur >= 0:
            path.append(1 + cur)
            cur = parents[cur]
        paths.append([0] + path[::-1])
    paths.sort()  # lexicographic on flat indices: siblings in index order
    D = max(len(pt) for pt in paths)
    retrieve = torch.full((len(paths), D), -1, dtype=torch.long)  # (P, D+1)
    for r, pt in enumerate(paths):
        retrieve[r, : len(pt)] = torch.tensor(pt)
    flat = torch.tensor([0] + tokens + [-1], dtype=torch.long)  # (N+2,) -1 for padding
    return flat[retrieve], retrieve  # (P, D+1), (P, D+1)


def _as_int_tensor(x, what: str, dim: int) -> torch.Tensor:
    t = int_tensor(x, what)
    if t.dim() != dim:
        raise Malformed(f"{what} must be an integer tensor of {dim} dims, got shape {tuple(t.shape)}")
    return t


def _row_out(out, b: int, api: str):
    """(path list, last int) from one row's output in the plain or eagle convention."""
    if not isinstance(out, (tuple, list)) or len(out) != (2 if api == "plain" else 3):
        raise Malformed(f"row {b}: expected a tuple of {2 if api == 'plain' else 3}, got {type(out).__name__}")
    if api == "plain":
        path = _as_int_tensor(out[0], f"row {b}: path", 1).tolist()
        return path, int(_as_int_tensor(out[1], f"row {b}: last token", 0).reshape(()))
    return tuple(int(_as_int_tensor(v, f"row {b}: {w}", 0)) for v, w in zip(out, ("best_candidate", "accept_length", "next_token")))


def adapt_tree(fn: Callable, api: str, greedy: bool = False, draft_law: str = "iid") -> Callable:
    """Wrap fn as call(tokens, parents, lengths, p_or_logits, q, gens) -> (path (B, W), last (B,)).
    gens: one generator, or a list of one per row (per_row_generators). draft_law: the check's
    `siblings`, told to a specref-convention fn that takes a `siblings` argument."""
    if api not in TREE_APIS:
        raise ValueError(f"api must be one of {TREE_APIS}, got {api!r}")
    told = api == "specref" and not greedy and _takes_siblings(fn)

    def call(tokens, parents, lengths, p, q, gens, kind=None, kinds=None):
        B = tokens.shape[0]
        if kinds is not None and q is not None and not told:  # deterministic nodes: q one-hot on the token
            det = (kinds == 0) & (tokens >= 0)  # (B, N)
            q = torch.where(det[..., None], torch.nn.functional.one_hot(tokens.clamp(min=0), q.shape[-1]).to(q), q)
        if api == "specref":
            if greedy:
                out = fn(tokens, parents, p, lengths=lengths)
            elif told:
                out = fn(tokens, parents, p, q, lengths=lengths, generator=gens,
                         siblings=kinds if kinds is not None else kind)
            else:
                out = fn(tokens, parents, p, q, lengths=lengths, generator=gens)
            return _specref_out(out, tokens, B)
        paths, last = [], []
        for b in range(B):  # one row a call
            n = int(lengths[b])
            g = gens[b] if isinstance(gens, list) else gens
            tk, pa = tokens[b, :n], parents[b, :n]
            if api == "plain":
                out = fn(tk, pa, p[b, : n + 1]) if greedy else fn(tk, pa, p[b, : n + 1], None if q is None else q[b, :n], g)
                path, y = _row_out(out, b, api)
            else:
                cand, ret = retrieve_layout(tk.tolist(), pa.tolist())
                idx = torch.where(ret >= 0, ret, n)  # (P, D+1) padding reads flat index -1, the last node, as EAGLE's
                logits = p[b, idx] if greedy else torch.log(p[b, idx])  # (P, D+1, V)
                dq = None
                if q is not None and not greedy:
                    qf = torch.cat([torch.full_like(q[b, :1], 1.0 / q.shape[-1]), q[b, :n]])  # (n+1, V) root row uniform
                    dq = qf[idx]  # (P, D+1, V)
                out = fn(cand, ret, logits) if greedy else fn(cand, ret, logits, dq, g)
                best, a, y = _row_out(out, b, api)
                if not 0 <= best < ret.shape[0] or not 0 <= a < ret.shape[1] or int(ret[best, a]) < 0:
                    raise Malformed(f"row {b}: best_candidate {best}, accept_length {a} is not a path of "
                                    f"retrieve_indices of shape {tuple(ret.shape)}")
                path = [int(i) - 1 for i in ret[best, 1 : 1 + a]]
            paths.append(path)
            last.append(y)
        W = max([len(pt) for pt in paths] + [0])
        out_path = torch.full((B, W), -1, dtype=torch.long)  # (B, W)
        for b, pt in enumerate(paths):
            if pt:
                out_path[b, : len(pt)] = torch.tensor(pt)
        return out_path, torch.tensor(last, dtype=torch.long).reshape(B)
    return call


def _takes_siblings(fn: Callable) -> bool:
    """fn has a parameter named `siblings` (rejection.verify_tree's sibling kinds)."""
    try:
        return "siblings" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and other callables without a signature
        return False


def _specref_out(out, tokens: torch.Tensor, B: int):
    """(path, last) from a TreeResult-like output, checking its tokens against the path's."""
    if hasattr(out, "tokens") and hasattr(out, "path") and hasattr(out, "num_accepted"):
        out = (out.tokens, out.path, out.num_accepted)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise Malformed(f"expected a TreeResult or (tokens, path, num_accepted), got {type(out).__name__}")
    toks, path, acc = (_as_int_tensor(x, w, d) for x, w, d in zip(out, ("tokens", "path", "num_accepted"), (2, 2, 1)))
    if toks.shape[0] != B or path.shape[0] != B or acc.shape != (B,) or toks.shape[1] < 1:
        raise Malformed(f"tokens {tuple(toks.shape)}, path {tuple(path.shape)}, num_accepted {tuple(acc.shape)} "
                        f"do not fit a batch of {B} (expected (B, D+1), (B, D), (B,))")
    W = path.shape[1]
    if bool(((acc < 0) | (acc > W) | (acc > toks.shape[1] - 1)).any()):
        b = int(((acc < 0) | (acc > W) | (acc > toks.shape[1] - 1)).nonzero()[0])
        raise Malformed(f"row {b}: num_accepted {int(acc[b])} outside [0, {min(W, toks.shape[1] - 1)}]")
    pos = torch.arange(W)[None]  # (1, W)
    inside = pos < acc[:, None]  # (B, W)
    bad_pad = (~inside & (path != -1)).any(1) | (torch.arange(toks.shape[1])[None] > acc[:, None]).logical_and(toks != -1).any(1)  # (B,)
    node = path.clamp(0, max(tokens.shape[1] - 1, 0))  # (B, W)
    want = tokens.cpu().long().gather(1, node) if tokens.shape[1] else torch.zeros_like(path)  # (B, W)
    bad_tok = (inside & ((path < 0) | (path >= tokens.shape[1]) | (toks[:, :W] != want))).any(1)  # (B,)
    for mask, what in ((bad_pad, "entries after the emitted ones are not -1"),
                       (bad_tok, "accepted tokens differ from the tokens of the path's nodes")):
        if bool(mask.any()):
            b = int(mask.nonzero()[0])
            raise Malformed(f"{int(mask.sum())}/{B} rows: {what} (e.g. row {b}: tokens {toks[b].tolist()}, "
                            f"path {path[b].tolist()}, num_accepted {int(acc[b])})")
    path = torch.where(inside, path, -1)  # (B, W)
    return path, toks.gather(1, acc[:, None]).reshape(B)


def path_errors(path: np.ndarray, last: np.ndarray, parents: np.ndarray, lengths: np.ndarray, vocab: int):
    """Rows (B,) bool whose path (B, W) is not a root-to-node path of the row's tree, and rows whose
    last token is outside [0, vocab)."""
    B, W = path.shape
    bad_path = np.zeros(B, dtype=bool)  # (B,)
    prev = np.full(B, -1)  # (B,)
    ended = np.zeros(B, dtype=bool)  # (B,)
    for j in range(W):
        node = path[:, j]  # (B,)
        ended |= node < 0
        real = ~ended
        ok_node = (node >= 0) & (node < lengths)  # (B,)
        par = parents[np.arange(B), np.clip(node, 0, max(parents.shape[1] - 1, 0))] if parents.shape[1] else prev
        bad_path |= real & (~ok_node | (par != prev))
        bad_path |= ended & (node >= 0)  # a node after the end of the path
        prev = np.where(real, node, prev)
    return bad_path, (last < 0) | (last >= vocab)
