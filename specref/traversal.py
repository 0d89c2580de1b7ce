"""Traversal verification: token trees verified from the leaves to the root.

Weng et al. 2025, "Traversal Verification for Speculative Tree Decoding" (NeurIPS 2025, arXiv
2505.12398; no public code). Token-wise tree verification (rejection.verify_tree) walks down from
the root and drops a node's whole subtree when the node is rejected; traversal verification walks
the tree in post-order (a node after all of its subtree, siblings in index order) and judges each
node by the whole path from the root to it, block verification's rule (block_verify.py) applied to
every root-to-leaf path in turn. With M_b(. | v) = p at node v, M_s(. | v) = the q v's children were
drawn from, and a weight p_v per node (p_root = 1):

  initial weights:  p_c = min(1, p_v M_b(x_c | v) / M_s(x_c | v)) for a child c of v (token x_c);
  1. alpha = the first node in post-order still in the tree (a leaf: its subtree is gone);
     draw eta ~ U(0, 1); if eta < p_alpha, accept the path root..alpha and go to 3;
  2. else delete alpha and, at its parent beta:
       S = sum_x [p_beta M_b(x | beta) - M_s(x | beta)]_+,
       M_b(. | beta) <- norm([p_beta M_b(. | beta) - M_s(. | beta)]_+),
       M_s(. | beta) <- norm(M_s(. | beta) without x_alpha)     (siblings without replacement),
       p_beta <- S / (S + 1 - p_beta)                           (p_root stays 1),
     the weights of beta's remaining subtree follow from the new values; go to 1 (once every child
     of the root is gone the root is accepted: p_root = 1);
  3. emit the accepted path, then Y ~ M_b(. | alpha) (the residual if alpha had children).
On a chain this is block verification exactly (p_beta's update is h_i); at the root's children it is
Sequoia's rule for siblings drawn without replacement (rejection.verify_tree, "without"). The paper
proves the emitted tokens follow the target and reports +2-6% accepted length over token-wise tree
verification.

What the paper covers, and so what this accepts: siblings drawn without replacement from their
parent's q (tree.SIBLING_KINDS "without": Gumbel-top-k, tree_from_sequences' merged i.i.d. drafts),
the M_s update of step 2. Other kinds are a ValueError naming siblings: i.i.d. siblings ("sampled",
the paper's update is not written for them) and top-k siblings ("deterministic", q = None: there
token-wise verification already accepts the longest prefix of a target sample that the tree holds,
which no lossless rule beats). The rule as written here comes from the paper's description and its
algorithm as quoted by others (the paper's text itself was not available to this implementation);
its losslessness is checked, not assumed: the exact chi-square tests (tests/test_traversal.py) and
the oracle's lossless law on its tree cases.

Randomness, as rejection.verify_tree's: a row of N_b nodes consumes N_b + 1 uniforms, u[b, i] for
the test of node i, u[b, N_b] for Y. A chain written as a tree gives block_verify's result from the
same generators. Vectorised over rows (each row its own post-order); one step per node.
"""
from __future__ import annotations

from typing import Optional

import torch

from .block_verify import wide
from .rejection_common import (TreeResult, _check_tree_probs, _draft_lengths, _path_of, _tree_output,
                               _tree_structure, _vocab_of)
from .sampling import Generators, ragged_uniforms, sample_from_probs
from .tree import SIBLING_KINDS, WITHOUT, Siblings, sibling_kinds

COVERED = ("without",)  # the sibling kinds the paper's update covers


def verify_tree_traversal(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor,
                          q: Optional[torch.Tensor] = None, *, lengths: Optional[torch.Tensor] = None,
                          generator: Generators = None, validate: bool = True,
                          siblings: Siblings = None) -> TreeResult:
    """Traversal verification (module docstring) of a batch of token trees, with
    rejection.verify_tree's calling convention: tokens (B, N) long, -1 padded; parents (B, N), -1 a
    child of the root; p (B, N+1, V) (row 0 after the root, row 1+i after node i); q (B, N, V), q[b, i]
    the q node i was drawn from at its parent (the parent's q before any removal, or after: both give
    this rule); siblings "without" (or one kind per node, every one "without"); lengths, generator,
    validate as verify_tree's. ValueError naming siblings for any other kind (q None included).
    Returns TreeResult(tokens (B, D+1), path (B, D), num_accepted (B,)).
    """
    V = _vocab_of(p, "(B, N+1, V)")
    if isinstance(tokens, torch.Tensor) and isinstance(parents, torch.Tensor):
        tokens, parents = tokens.to(p.device), parents.to(p.device)
    lengths, valid = _draft_lengths(tokens, lengths, V, "tokens", validate)
    B, N = tokens.shape
    kinds = sibling_kinds(siblings, q is not None, B, N, p.device, valid, validate)  # a name, or (B, N)
    check_covered(kinds, valid)
    par, depth, D = _tree_structure(parents, valid, validate)
    p, q = _check_tree_probs(p, q, kinds, valid, lengths, V, validate)
    dev, dt = p.device, wide(p.device)
    u = ragged_uniforms(lengths + 1, N + 1, generator, dev)  # (B, N+1), row b uses lengths[b] + 1
    rows = torch.arange(B, device=dev)  # (B,)
    x = tokens.clamp(min=0).long()  # (B, N)
    order, anc = _post_order(par, depth, valid, D)  # (B, N), (B, N, D)

    # state per node, index 0 the root and 1 + i node i
    Mb = p.to(dt).clone()  # (B, N+1, V) M_b(. | v): p, then the residual after a rejected child
    Ms = _children_q(q.to(dt), par, valid)  # (B, N+1, V) M_s(. | v): the q of v's children
    w = torch.ones(B, N + 1, dtype=dt, device=dev)  # (B, N+1) the weights p_v
    ready = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)  # (B, N+1) p_v initialised
    ready[:, 0] = True
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # (B,) nothing accepted yet
    acc = torch.full((B,), -1, dtype=torch.long, device=dev)  # (B,) the accepted node, -1 the root
    tiny = torch.finfo(dt).tiny
    for t in range(N):  # 1. the t-th node in post-order, per row
        v = order[:, t].clamp(min=0)  # (B,)
        has = alive & (order[:, t] >= 0)  # (B,)
        for d in range(D):  # its path's weights, top-down, where not yet set (a new subtree)
            a = anc[rows, v, d]  # (B,) the ancestor at depth d + 1 (v itself last), -1 past v
            todo = has & (a >= 0) & ~ready[rows, 1 + a.clamp(min=0)]  # (B,)
            a = a.clamp(min=0)
            b = 1 + par[rows, a]  # (B,) its parent's state index
            ms, mb = Ms[rows, b, x[rows, a]], Mb[rows, b, x[rows, a]]  # (B,), (B,)
            init = torch.clamp(w[rows, b] * torch.where(ms > 0, mb / ms.clamp(min=tiny), torch.zeros_like(ms)), max=1.0)
            w[rows, 1 + a] = torch.where(todo, init, w[rows, 1 + a])
            ready[rows, 1 + a] |= todo
        accept = has & (u[rows, v].to(dt) < w[rows, 1 + v])  # (B,) eta < p_alpha
        acc = torch.where(accept, v, acc)
        alive &= ~accept
        # 2. a rejected node leaves the tree: its parent's residual, draft and weight
        rej = has & ~accept  # (B,)
        b = 1 + par[rows, v]  # (B,)
        wb, mb, ms = w[rows, b], Mb[rows, b], Ms[rows, b]  # (B,), (B, V), (B, V)
        R = (wb[:, None] * mb - ms).clamp(min=0)  # (B, V)
        S = R.sum(1)  # (B,)
        Mb[rows, b] = torch.where((rej & (S > 0))[:, None], R / S.clamp(min=tiny)[:, None], mb)  # empty: keep p
        ms = ms.scatter(1, x[rows, v][:, None], 0.0)  # (B, V) without x_alpha
        Ms[rows, b] = torch.where(rej[:, None], ms / ms.sum(1, keepdim=True).clamp(min=tiny), Ms[rows, b])
        w_new = torch.where(b == 0, torch.ones_like(wb),
                            torch.where(S > 0, S / (S + 1 - wb).clamp(min=tiny), torch.zeros_like(wb)))  # (B,)
        w[rows, b] = torch.where(rej, w_new, wb)
    # 3. the accepted path (the root where every node was rejected), then Y from M_b at its end
    last = sample_from_probs(Mb[rows, 1 + acc], u[rows, lengths].to(dt))  # (B,)
    n_acc = torch.where(acc >= 0, depth.gather(1, acc.clamp(min=0)[:, None]).squeeze(1), 0) if N else acc + 1  # (B,)
    return _tree_output(_path_of(acc, par, depth, D), tokens, n_acc, last)


def check_covered(kinds, valid: torch.Tensor, name: str = "siblings") -> None:
    """ValueError naming `name` unless every real node's kind is one the paper covers (COVERED)."""
    if isinstance(kinds, torch.Tensor):
        bad = valid & (kinds != WITHOUT)  # (B, N)
        if not bool(bad.any()):
            return
        b, i = (int(t) for t in bad.nonzero()[0])
        kind = SIBLING_KINDS[int(kinds[b, i])]
        where = f" (node {i} of row {b} is {kind!r})"
    elif kinds in COVERED:
        return
    else:
        kind, where = kinds, ""
    raise ValueError(f"traversal verification covers siblings drawn without replacement ({name}='without', "
                     f"Weng et al.'s setting), got {name}={kind!r}{where}: i.i.d. siblings ('sampled') are "
                     "outside the paper's update, and top-k siblings ('deterministic', q=None) gain nothing "
                     "over token-wise verification; verify them with rejection.verify_tree")


def _post_order(par: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, D: int):
    """Each row's nodes in post-order (children in index order, a node after its subtree), -1
    padded (B, N); and anc (B, N, D): node i's ancestor at depth d + 1 (i itself at its own depth),
    -1 below it. The order sorts the nodes by their sibling ranks from the root, a missing rank
    (past the node's depth) counted larger than any."""
    B, N = par.shape
    dev = par.device
    idx = torch.arange(N, device=dev)  # (N,)
    same = (par[:, :, None] == par[:, None, :]) & valid[:, None, :] & (idx[None, :] < idx[:, None])[None]  # (B, N, N)
    rank = same.sum(-1)  # (B, N) earlier siblings
    digit = torch.full((B, N, D), N + 1, dtype=torch.long, device=dev)  # (B, N, D) past the depth: last
    anc = torch.full((B, N, D), -1, dtype=torch.long, device=dev)  # (B, N, D)
    node = torch.where(valid, idx[None, :].expand(B, N), -1)  # (B, N) walking up from every node
    for _ in range(D):
        up = node >= 0  # (B, N)
        nc = node.clamp(min=0)  # (B, N)
        col = torch.where(up, depth.gather(1, nc) - 1, 0)[..., None]  # (B, N, 1)
        digit.scatter_(2, col, torch.where(up, rank.gather(1, nc), digit.gather(2, col)[..., 0])[..., None])
        anc.scatter_(2, col, torch.where(up, node, anc.gather(2, col)[..., 0])[..., None])
        node = torch.where(up, par.gather(1, nc), -1)  # (B, N)
    digit[..., :1] = torch.where(valid[..., None], digit[..., :1], N + 2)  # padding after every real node
    order = idx[None, :].expand(B, N).clone()  # (B, N)
    for d in reversed(range(D)):  # radix sort, the last digit first, each pass stable
        key = digit.gather(1, order[..., None].expand(B, N, D))[..., d]  # (B, N)
        order = order.gather(1, torch.sort(key, dim=1, stable=True).indices)
    return torch.where(valid.gather(1, order), order, -1), anc


def _children_q(q: torch.Tensor, par: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """M_s per node (B, N+1, V): row 1 + v (row 0: the root) is the q row of v's first child (the
    parent's q before any removal); zeros for a node without children."""
    B, N, V = q.shape
    owner = torch.arange(-1, N, device=q.device)  # (N+1,) the root, then the nodes
    kid = (par[:, None, :] == owner[None, :, None]) & valid[:, None, :]  # (B, N+1, N)
    first = kid.long().argmax(-1)  # (B, N+1) first child (0 where none)
    Ms = q.gather(1, first[..., None].expand(B, N + 1, V)) if N else q.new_zeros(B, 1, V)  # (B, N+1, V)
    return torch.where(kid.any(-1)[..., None], Ms, torch.zeros_like(Ms))
