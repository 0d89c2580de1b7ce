"""What the verifiers share: their results, the tree bookkeeping and the input checks (ValueError).

rejection.py (token-wise chain and tree rules), block_verify.py (Sun et al.'s block verification)
and traversal.py (Weng et al.'s traversal verification) return the same ChainResult / TreeResult
and check their inputs the same way, so each rule reads one of them and the errors read alike.
The tree helpers: a tree's depths from its parents (_tree_structure), a node's root-to-node path
(_path_of) and the TreeResult of an accepted path (_tree_output).
"""
from __future__ import annotations
from dataclasses import dataclass
from typing import Optional

import torch

from .sampling import greedy_tokens
from .tree import DETERMINISTIC, check_parents


PROB_SUM_TOL = 1e-3  # |sum(p) - 1| allowed per distribution (float32 softmax: ~1e-6)


@dataclass(frozen=True)
class ChainResult:
    tokens: torch.Tensor  # (B, K+1) long: accepted drafts, then the recovered or bonus token; -1 after
    num_accepted: torch.Tensor  # (B,) long, 0..lengths[b]; the row emits num_accepted + 1 tokens


@dataclass(frozen=True)
class TreeResult:
    tokens: torch.Tensor  # (B, D+1) long: tokens of the accepted path, then one more; -1 after
    path: torch.Tensor  # (B, D) long: node indices of the accepted path (depth 1, 2, ..); -1 after
    num_accepted: torch.Tensor  # (B,) long: accepted nodes (path length)



# ---------------------------------------------------------------- trees

def _tree_structure(parents: torch.Tensor, valid: torch.Tensor, validate: bool = True):
    """Check parents (B, N) (-1 = child of the root, else an earlier node) and return
    (parents with padding set to -1 (B, N), depth (B, N) with root children at 1, padding 0, D)."""
    par = check_parents(parents, valid) if validate else torch.where(valid, parents.long(), -1)  # (B, N)
    N = valid.shape[1]
    depth = valid.long()  # (B, N)
    anc = par  # (B, N) ancestor one more level up, -1 past the root
    for _ in range(N):  # one iteration per depth level
        up = anc >= 0  # (B, N)
        if not bool(up.any()):
            break
        depth = depth + up.long()
        anc = torch.where(up, par.gather(1, anc.clamp(min=0)), -1)  # (B, N)
    D = int(depth.max()) if depth.numel() else 0
    return par, depth, D


def _path_of(node: torch.Tensor, par: torch.Tensor, depth: torch.Tensor, D: int) -> torch.Tensor:
    """Root-to-node path (B, D) of node (B,) (-1: the root itself), -1 padded."""
    B = node.shape[0]
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=par.device)  # (B, D+1), col D = discard
    for _ in range(D):  # walk up one level per iteration
        up = node >= 0  # (B,)
        col = torch.where(up, depth.gather(1, node.clamp(min=0)[:, None]).squeeze(1) - 1, D)  # (B,)
        path.scatter_(1, col[:, None], node[:, None])
        node = torch.where(up, par.gather(1, node.clamp(min=0)[:, None]).squeeze(1), -1)  # (B,)
    return path[:, :D]  # (B, D)


def _tree_output(path: torch.Tensor, tokens: torch.Tensor, n_acc: torch.Tensor, last: torch.Tensor):
    """TreeResult from the accepted path (B, D), its length (B,) and the final token (B,)."""
    B, D = path.shape
    tok = torch.where(path >= 0, tokens.long().gather(1, path.clamp(min=0)), -1)  # (B, D)
    out = torch.cat([tok, tok.new_full((B, 1), -1)], 1)  # (B, D+1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return TreeResult(out, path, n_acc)


# ---------------------------------------------------------------- input checks (ValueError)

def _draft_lengths(tokens: torch.Tensor, lengths, vocab: Optional[int], name: str, validate: bool = True):
    """Check draft tokens (B, K) and return (lengths (B,), valid (B, K) bool).

    Entries must be -1 (placeholder) or a token id in [0, vocab). lengths=None: the count before the
    first -1. Given lengths: 0..K, no -1 inside a row's length; entries beyond it are ignored.
    validate=False (the loop's own calls, lengths given): no checks, no host sync.
    """
    if not validate:
        lengths = lengths.long()  # (B,)
        return lengths, torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor (B, K), got "
                         f"{getattr(tokens, 'dtype', type(tokens))} of shape {tuple(getattr(tokens, 'shape', ()))}")
    B, K = tokens.shape
    hi = vocab if vocab is not None else torch.iinfo(torch.long).max
    bad = (tokens < -1) | (tokens >= hi)  # (B, K)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}[{b}, {i}] = {int(tokens[b, i])} is not a token id in [0, {vocab}) "
                         f"nor the placeholder -1")
    pos = torch.arange(K, device=tokens.device)  # (K,)
    if lengths is None:
        lengths = (tokens >= 0).long().cumprod(1).sum(1)  # (B,) count before the first -1
    else:
        lengths = torch.as_tensor(lengths, device=tokens.device)
        if lengths.shape != (B,) or lengths.is_floating_point():
            raise ValueError(f"lengths must be an integer tensor (B,) = ({B},), got shape {tuple(lengths.shape)}")
        lengths = lengths.long()
        if bool(((lengths < 0) | (lengths > K)).any()):
            raise ValueError(f"lengths must be in 0..{K} (the draft width), got {lengths.tolist()}")
        hole = (pos[None, :] < lengths[:, None]) & (tokens < 0)  # (B, K)
        if bool(hole.any()):
            b, i = (int(v) for v in hole.nonzero()[0])
            raise ValueError(f"{name}[{b}, {i}] = -1 lies inside row {b}'s length {int(lengths[b])}")
    return lengths, pos[None, :] < lengths[:, None]  # (B,), (B, K)


def _check_probs(x: torch.Tensor, name: str, shape: tuple, used: torch.Tensor, validate: bool = True) -> torch.Tensor:
    """x must have `shape`; rows where used (B, R) is True must be finite, >= 0, sum to 1 (+-tol).
    Returns x in at least float32 (validate=False: only that)."""
    if not validate:
        return x.to(torch.promote_types(x.dtype, torch.float32))
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be a float tensor of shape {shape}, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if x.numel() == 0:
        return x
    used3 = used[..., None]  # (B, R, 1)
    for what, bad in (("NaN or infinite", ~torch.isfinite(x) & used3), ("negative", (x < 0) & used3)):
        if bool(bad.any()):
            b, i, v = (int(t) for t in bad.nonzero()[0])
            raise ValueError(f"{name}[{b}, {i}, {v}] = {float(x[b, i, v])} is {what}; "
                             f"probabilities must be finite and >= 0")
    off = ((x.sum(-1) - 1).abs() > PROB_SUM_TOL) & used  # (B, R)
    if bool(off.any()):
        b, i = (int(t) for t in off.nonzero()[0])
        raise ValueError(f"{name}[{b}, {i}] sums to {float(x[b, i].sum()):.6f}; a distribution must "
                         f"sum to 1 (within {PROB_SUM_TOL}); pass probabilities, not logits")
    return x


def _target_argmax(x: torch.Tensor, B: int, R: int, validate: bool = True) -> torch.Tensor:
    """Target argmax (B, R) from logits (B, R, V) or from argmax ids (B, R)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 3 and x.shape[:2] == (B, R):
        if validate and bool(torch.isnan(x).any()):
            raise ValueError("target logits contain NaN; the argmax is undefined")
        return greedy_tokens(x)  # (B, R)
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and tuple(x.shape) == (B, R):
        return x.long()  # (B, R)
    raise ValueError(f"target must be logits (B, R, V) or argmax ids (B, R) with (B, R) = ({B}, {R}), "
                     f"got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")


def chain_inputs(draft_tokens, p, q, lengths, validate: bool):
    """The checked inputs of a chain rule (verify_chain's convention): draft_tokens (B, K) on p's
    device, p (B, K+1, V), q (B, K, V) or None, lengths (B,), valid (B, K) bool."""
    V = _vocab_of(p, "(B, K+1, V)")
    if isinstance(draft_tokens, torch.Tensor):
        draft_tokens = draft_tokens.to(p.device)
    lengths, valid = _draft_lengths(draft_tokens, lengths, V, "draft_tokens", validate)
    B, K = draft_tokens.shape
    rows_p = torch.arange(K + 1, device=p.device)[None, :] <= lengths[:, None]  # (B, K+1)
    p = _check_probs(p, "p", (B, K + 1, V), rows_p, validate)
    if q is not None:
        q = _check_probs(q, "q", (B, K, V), valid, validate)
    return draft_tokens, p, q, lengths, valid


def _vocab_of(p, shape: str) -> int:
    """V of the target distributions p, which must be 3-d: shape names the expected (B, R, V)."""
    if not isinstance(p, torch.Tensor) or p.dim() != 3:
        raise ValueError(f"p must be a {shape} tensor, got shape {tuple(getattr(p, 'shape', ()))}")
    return p.shape[-1]


def _check_tree_probs(p, q, kinds, valid, lengths, V: int, validate: bool):
    """verify_tree's p (B, N+1, V) and q (B, N, V) checked (validate) and promoted to float32: p's rows
    up to each row's length, q's rows of the drawn nodes; under one kind a q row of zeros (a
    deterministic node without a q) is an error naming siblings."""
    B, N = valid.shape
    rows_p = torch.arange(N + 1, device=valid.device)[None, :] <= lengths[:, None]  # (B, N+1)
    p = _check_probs(p, "p", (B, N + 1, V), rows_p, validate)
    one_kind = not isinstance(kinds, torch.Tensor)
    drawn = valid if one_kind else valid & (kinds != DETERMINISTIC)  # (B, N) the q rows that are read
    if validate and one_kind and isinstance(q, torch.Tensor) and tuple(q.shape) == (B, N, V):
        empty = drawn & (q.sum(-1) == 0)  # (B, N)
        if bool(empty.any()):
            b, i = (int(t) for t in empty.nonzero()[0])
            raise ValueError(f"q[{b}, {i}] is all zero under siblings={kinds!r}: node {i} has no draft "
                             "distribution. A tree mixing deterministic (top-k) nodes with sampled ones gives "
                             "one kind per node: siblings=[...] with 'deterministic' for them")
    return p, None if q is None else _check_probs(q, "q", (B, N, V), drawn, validate)
