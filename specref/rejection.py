"""Speculative sampling: accept a prefix of the draft, then one recovered or bonus token.

Chain (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling", Algorithm 2):
draft token x_i, sampled from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection one token is drawn from the residual norm(max(0, p_i - q_i)); if all of a row's
n_b drafts are accepted, a bonus token is drawn from p_{n_b}. The emitted tokens are distributed
exactly as sampling from p (Leviathan et al. 2023, Theorem 3.5). A deterministic draft (n-gram,
argmax heads) has q one-hot on its token: pass q=None; then x is accepted with probability p(x)
and the residual is p with x removed, renormalised.

Tree (SpecInfer, Miao et al. 2024, "multi-step speculative sampling"; SpecTr, Sun et al. 2023):
walk down from the root; at each node try its children in index order with recursive rejection:
child x with draft distribution q is accepted with probability min(1, r(x) / q(x)), r the current
residual (p at the node before any rejection); a rejected child updates r <- norm(max(0, r - q))
and the next child is tried. If a child is accepted the walk continues below it with r = p at that
child; if none is (or the node is a leaf), one token is drawn from r. Which q a child is tested
against depends on how the siblings were drawn, the node's kind (SIBLING_KINDS; Draft.siblings,
docs/sibling_kinds.md), never guessed:
- "deterministic" (top-k of a head, n-gram, EAGLE-2, Medusa; q = None): q one-hot on the token, so
  x is accepted with probability r(x) and a rejection removes x from r, renormalised;
- "sampled": each node an independent draw from its own q row (SpecInfer's i.i.d. siblings, or
  siblings from different draft distributions, as hybrid.py's two branches);
- "without" (Sequoia, Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware
  Speculative Decoding"): the siblings of a node drawn without replacement from their parent's q
  (Gumbel-top-k, k distinct samples, a trie of merged i.i.d. sequences): child j is tested against
  q_j = q with the tokens of the earlier rejected "without" siblings removed, renormalised, and the
  residual update uses that q_j. A node's q row may be the parent's q before any removal or the q_j
  it was drawn from: removing already-removed tokens changes nothing, so both give this rule.
Per-node kinds mix them in one tree (top-k levels over sampled levels, a top-k sibling beside
sampled ones): each child is tested as its own kind. Each rule is lossless for its draws (SpecInfer's
and Sequoia's arguments; the oracle's lossless check in the tests) and lossy for the others'.

Greedy: accept while the draft equals the target's argmax, then emit the target's argmax (for a
tree: the longest path whose every token is the argmax at its parent).

Randomness, per row and per call (so one generator per row makes rows independent and
reproducible, see sampling.ragged_uniforms): a row with a chain of L_b draft tokens consumes L_b + 1
uniforms, u[b, i] for the accept test of draft position i (drawn even if unused) and u[b, L_b] for
the final token by inverse CDF; a row with a tree of N_b nodes consumes N_b + 1: u[b, i] for node
i, u[b, N_b] for the final token. With one generator per row, a row's draws therefore never depend
on the other rows' draft lengths (batch independence). A chain and the same chain written
as a tree (parents [-1, 0, 1, ...]) give identical results from identical generators.
`verify_chain(..., draws=k + 1)` (generate.py's loop) has every row consume exactly k + 1 instead,
a constant of the proposer: rows stay independent and no length is read back to the host.

Other lossless laws, re-exported here: `verify_chain_block` (block verification, Sun et al. 2025,
block_verify.py: the optimal rule for one drafted chain) and `verify_tree_traversal` (traversal
verification, Weng et al. 2025, traversal.py: leaf-to-root over trees of siblings drawn without
replacement). The results and input checks they share with this file: rejection_common.py.
Left out: typical acceptance (lossy, Medusa's: typical.py), SpecTr's optimal-transport
verification.
"""
from __future__ import annotations
from typing import Optional

import torch

from .block_verify import verify_chain_block  # noqa: F401  (re-exported: Sun et al.'s block rule)
from .rejection_common import (PROB_SUM_TOL, ChainResult, TreeResult, _check_probs, _check_tree_probs, chain_inputs,  # noqa: F401
                               _draft_lengths, _path_of, _target_argmax, _tree_output, _tree_structure, _vocab_of)
from .sampling import Generators, ragged_uniforms, sample_from_probs
from .traversal import verify_tree_traversal  # noqa: F401  (re-exported: Weng et al.'s traversal rule)
from .tree import DETERMINISTIC, SIBLING_KINDS, WITHOUT, Siblings, sibling_kinds  # noqa: F401

# ---------------------------------------------------------------- chain

def verify_chain(draft_tokens: torch.Tensor, p: torch.Tensor, q: Optional[torch.Tensor] = None, *,
                 lengths: Optional[torch.Tensor] = None, generator: Generators = None,
                 validate: bool = True, draws: Optional[int] = None) -> ChainResult:
    """Speculative sampling of a batch of ragged draft chains. Vectorised over rows and positions.

    draft_tokens (B, K) long, -1 beyond a row's length; lengths (B,) (default: count before the
    first -1); p (B, K+1, V): p[b, i] is the target distribution after the row's first i drafts
    (already warped, sampling.logits_to_probs); q (B, K, V): the draft distributions the tokens
    were sampled from, or None for a deterministic draft. Only rows i <= lengths[b] of p and
    i < lengths[b] of q are read (and checked). generator: one, or one per row.

    Defined cases (the maths decides; no error):
      - p(x) = 0 for a drafted x: rejected (accept probability 0).
      - q(x) = 0 for a drafted x: rejected (never accepted with probability p/0), then the token is
        drawn from max(0, p - q) as usual (it may be x itself). A correct draft never samples such
        an x; rejection rather than an error also covers q underflowing to 0 in low precision.
      - residual max(0, p - q) all zero (p == q): a rejection has probability 0 then, but rounding
        (u q(x) == p(x)) can still produce one; the token is then drawn from p, never from 0/0.
    Errors (ValueError naming the value): shapes that disagree, a token id outside [0, V) other than
    -1, -1 inside a row's length, NaN/inf/negative entries or a distribution not summing to 1.
    validate=False skips those checks (and their host syncs): for callers that guarantee valid
    inputs, as generate.py's loop does after its own checks (checks.py); lengths must be given.
    draws: with one generator per row, each row draws exactly `draws` (>= K + 1) uniforms instead
    of lengths[b] + 1 (the loop passes its proposer's k + 1: a constant, so rows stay independent,
    and no length is read back from the device).
    """
    draft_tokens, p, q, lengths, valid = chain_inputs(draft_tokens, p, q, lengths, validate)
    B, K = draft_tokens.shape
    dev = p.device
    u = ragged_uniforms(lengths + 1, K + 1, generator, dev, fixed=draws)  # (B, K+1), row b uses lengths[b] + 1
    x = draft_tokens.clamp(min=0)  # (B, K) placeholders read token 0, masked by `valid`
    rows = torch.arange(B, device=dev)  # (B,)

    # 1. accept test at every position at once: u < p(x) / q(x), written u q(x) < p(x)
    px = p[:, :K].gather(2, x[..., None]).squeeze(-1)  # (B, K)
    if q is None:
        accept = u[:, :K] < px  # (B, K) q(x) = 1
    else:
        qx = q.gather(2, x[..., None]).squeeze(-1)  # (B, K)
        accept = (qx > 0) & (u[:, :K] * qx < px)  # (B, K)
    accept &= valid
    n_acc = accept.long().cumprod(1).sum(1)  # (B,) accepted prefix length

    # 2. the last token: residual at the first rejection, else the bonus from p[b, n_b]
    p_j = p[rows, n_acc]  # (B, V) target after the accepted prefix
    dist = p_j
    if K > 0:
        rejected = n_acc < lengths  # (B,)
        j = n_acc.clamp(max=K - 1)  # (B,) the rejected position (clamped where nothing was)
        if q is None:
            resid = p_j.scatter(1, x[rows, j][:, None], 0.0)  # (B, V) p without the draft token
        else:
            resid = (p_j - q[rows, j]).clamp(min=0)  # (B, V) max(0, p - q)
        dist = torch.where(rejected[:, None], resid, p_j)  # (B, V)
        dist = torch.where(dist.sum(1, keepdim=True) > 0, dist, p_j)  # empty residual -> p
    last = sample_from_probs(dist, u[rows, lengths])  # (B,) inverse CDF, normalises internally

    pos = torch.arange(K + 1, device=dev)[None, :]  # (1, K+1)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((B, 1), -1).long()], 1)  # (B, K+1)
    out = torch.where(pos < n_acc[:, None], padded, -1)  # (B, K+1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return ChainResult(out, n_acc)


def verify_chain_greedy(draft_tokens: torch.Tensor, target: torch.Tensor, *,
                        lengths: Optional[torch.Tensor] = None, validate: bool = True) -> ChainResult:
    """Greedy verification: accept while draft_tokens[b, i] == argmax of target row i, then emit the
    target's argmax at the first mismatch (or the bonus argmax after n_b accepted drafts).

    target: logits (B, K+1, V) (argmax taken here, first index on ties) or argmax ids (B, K+1).
    validate=False: no input checks (see verify_chain).
    """
    B, K = draft_tokens.shape if isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() == 2 else (0, -1)
    vocab = target.shape[-1] if isinstance(target, torch.Tensor) and target.is_floating_point() else None
    lengths, valid = _draft_lengths(draft_tokens, lengths, vocab, "draft_tokens", validate)
    a = _target_argmax(target, B, K + 1, validate).to(draft_tokens.device)  # (B, K+1)
    match = valid & (draft_tokens == a[:, :K])  # (B, K)
    n_acc = match.long().cumprod(1).sum(1)  # (B,)
    pos = torch.arange(K + 1, device=a.device)[None, :]  # (1, K+1)
    out = torch.where(pos <= n_acc[:, None], a, -1)  # (B, K+1) accepted drafts equal the argmax
    return ChainResult(out, n_acc)


# ---------------------------------------------------------------- tree

def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor,
                q: Optional[torch.Tensor] = None, *, lengths: Optional[torch.Tensor] = None,
                generator: Generators = None, validate: bool = True,
                siblings: Siblings = None) -> TreeResult:
    """Recursive rejection sampling down a batch of token trees (see the module docstring).

    tokens (B, N) long, -1 padded; parents (B, N) long, -1 = child of the root, else an earlier
    node; lengths (B,) real nodes per row (default: count before the first -1); p (B, N+1, V): row
    0 the target after the root (the last committed token), row 1+i after node i; q None
    (deterministic drafts) or (B, N, V): q[b, i] the distribution node i was drawn from (at its
    parent; siblings drawn from one q share it). siblings, the kind of every node (module docstring,
    SIBLING_KINDS; required with a q, never guessed from it): "sampled", "without", "deterministic"
    (q None), or one kind per node, a list of N names or an integer tensor (N,) / (B, N) of indices
    into SIBLING_KINDS; the q rows of deterministic nodes are then not read. Duplicate sibling tokens
    are allowed: a repeated deterministic token is rejected (its mass is already removed), a repeated
    "without" token has q_j = 0 there and is rejected. Edge cases and errors as verify_chain
    (validate=False as there); a q without siblings, and a single kind for a tree with a q row of
    zeros (a deterministic node without a q: give per-node kinds), are ValueErrors naming siblings.
    Loops over depth levels and, within a level, over sibling rank; vectorised over rows. Returns
    TreeResult(tokens (B, D+1), path (B, D), num_accepted (B,)), D the deepest node.
    """
    V = _vocab_of(p, "(B, N+1, V)")
    if isinstance(tokens, torch.Tensor) and isinstance(parents, torch.Tensor):
        tokens, parents = tokens.to(p.device), parents.to(p.device)
    lengths, valid = _draft_lengths(tokens, lengths, V, "tokens", validate)
    B, N = tokens.shape
    kinds = sibling_kinds(siblings, q is not None, B, N, p.device, valid, validate)  # a name, or (B, N)
    mixed = isinstance(kinds, torch.Tensor)
    if not mixed and kinds == "deterministic":
        q = None  # (validate=False only: checked callers never pair it with a q)
    par, depth, D = _tree_structure(parents, valid, validate)
    p, q = _check_tree_probs(p, q, kinds, valid, lengths, V, validate)
    dev = p.device
    u = ragged_uniforms(lengths + 1, N + 1, generator, dev)  # (B, N+1), row b uses lengths[b] + 1
    rows = torch.arange(B, device=dev)  # (B,)
    tok = tokens.clamp(min=0)  # (B, N)
    track = q is not None and (mixed or kinds == "without")  # Sequoia's rule: rejected tokens leave q

    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # (B,) current node, -1 = root
    r = p[:, 0]  # (B, V) residual at the current node, unnormalised ...
    mass = torch.ones(B, dtype=p.dtype, device=dev)  # (B,) ... with this total (1 for a fresh p row)
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # (B,) accepted at every level so far
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    for _ in range(D):  # 1. one depth level per iteration
        child = valid & (par == cur[:, None]) & alive[:, None]  # (B, N) children of the current node
        rank = child.long().cumsum(1) - 1  # (B, N) sibling rank in index order
        taken = torch.zeros(B, dtype=torch.bool, device=dev)  # (B,) a child accepted at this level
        removed = torch.zeros(B, V, dtype=torch.bool, device=dev) if track else None  # (B, V) Sequoia's
        for s in range(int(child.sum(1).max()) if B else 0):  # 2. siblings in index order
            sel = child & (rank == s)  # (B, N) at most one node per row
            has = sel.any(1) & ~taken  # (B,)
            j = sel.long().argmax(1)  # (B,) the sibling's node index
            x, u_j = tok[rows, j], u[rows, j]  # (B,), (B,)
            kind = kinds[rows, j] if mixed else kinds  # (B,) per node, or one name
            accept, nxt = _test_sibling(kind, r, mass, x, u_j, None if q is None else q[rows, j], removed)
            accept &= has  # (B,)
            if track:  # a rejected "without" sibling's token leaves q for the siblings after it
                wo = has if not mixed else has & (kind == WITHOUT)  # (B,)
                removed |= torch.zeros_like(removed).scatter_(1, x[:, None], True) & (wo & ~accept)[:, None]
            nmass = nxt.sum(1)  # (B,)
            upd = has & ~accept & (nmass > 0)  # (B,) an empty residual keeps r (see verify_chain)
            r = torch.where(upd[:, None], nxt, r)  # (B, V)
            mass = torch.where(upd, nmass, mass)  # (B,)
            # 3. an accepted child becomes the current node; r restarts from p at that node
            taken |= accept
            cur = torch.where(accept, j, cur)  # (B,)
            r = torch.where(accept[:, None], p[rows, 1 + j], r)  # (B, V)
            mass = torch.where(accept, torch.ones_like(mass), mass)  # (B,)
        n_acc += taken.long()
        alive &= taken
    # 4. the final token: from the residual after the last rejection, or p at the deepest accepted node
    last = sample_from_probs(r, u[rows, lengths])  # (B,)
    return _tree_output(_path_of(cur, par, depth, D), tokens, n_acc, last)


def _test_sibling(kind, r, mass, x, u_x, q_x, removed):
    """One child x (B,) per row tested by the rule of its kind (one name for the tree, or (B,) per
    node) against the residual r (B, V), unnormalised with total mass (B,), with its uniform u_x (B,).
    Each rule returns (accept (B,), the residual after a rejection (B, V), again times the mass)."""
    if q_x is None:
        return _deterministic_rule(r, mass, x, u_x)
    if not isinstance(kind, torch.Tensor):
        return _sequoia_rule(r, mass, x, u_x, q_x, removed) if kind == "without" else \
            _specinfer_rule(r, mass, x, u_x, q_x)
    accept, nxt = _specinfer_rule(r, mass, x, u_x, q_x)  # "sampled" rows
    for code, (acc, res) in ((WITHOUT, _sequoia_rule(r, mass, x, u_x, q_x, removed)),
                             (DETERMINISTIC, _deterministic_rule(r, mass, x, u_x))):
        mine = kind == code  # (B,)
        accept, nxt = torch.where(mine, acc, accept), torch.where(mine[:, None], res, nxt)
    return accept, nxt


def _deterministic_rule(r, mass, x, u_x):
    """q one-hot on x (top-k, n-gram): accept with r(x)/mass; a rejection removes x from r."""
    return u_x * mass < r.gather(1, x[:, None]).squeeze(1), r.scatter(1, x[:, None], 0.0)


def _specinfer_rule(r, mass, x, u_x, q_x):
    """SpecInfer's i.i.d. siblings: accept with min(1, (r(x)/mass) / q_x(x)); a rejection leaves
    max(0, r/mass - q_x), written times mass. q_x(x) = 0: rejected."""
    qx, rx = q_x.gather(1, x[:, None]).squeeze(1), r.gather(1, x[:, None]).squeeze(1)  # (B,), (B,)
    return (qx > 0) & (u_x * qx * mass < rx), (r - mass[:, None] * q_x).clamp(min=0)


def _sequoia_rule(r, mass, x, u_x, q_x, removed):
    """Sequoia's siblings drawn without replacement: SpecInfer's test and residual against q_j, the
    parent's q without the tokens of the earlier rejected siblings (removed (B, V)), renormalised."""
    q_j = q_x.masked_fill(removed, 0.0)  # (B, V)
    q_j = q_j / q_j.sum(1, keepdim=True).clamp(min=torch.finfo(q_j.dtype).tiny)  # (B, V)
    return _specinfer_rule(r, mass, x, u_x, q_j)


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, *,
                       lengths: Optional[torch.Tensor] = None, validate: bool = True) -> TreeResult:
    """Greedy tree verification: the longest path from the root whose every token equals the
    target's argmax at its parent, then the argmax after its last node. Ties between equally long
    paths (duplicate siblings) go to the smaller node index. Equals plain greedy decoding for any
    tree shape. target: logits (B, N+1, V) or argmax ids (B, N+1); row 0 after the root.
    validate=False: no input checks (see verify_chain).
    """
    B, N = tokens.shape if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else (0, -1)
    vocab = target.shape[-1] if isinstance(target, torch.Tensor) and target.is_floating_point() else None
    lengths, valid = _draft_lengths(tokens, lengths, vocab, "tokens", validate)
    if isinstance(parents, torch.Tensor):
        parents = parents.to(tokens.device)
    par, depth, D = _tree_structure(parents, valid, validate)
    a = _target_argmax(target, B, N + 1, validate).to(tokens.device)  # (B, N+1)
    match = valid & (tokens == a.gather(1, par + 1))  # (B, N) token == argmax at its parent
    ok = match  # (B, N) ... and at every ancestor
    anc = par  # (B, N)
    for _ in range(D):  # one level up per iteration
        up = anc >= 0  # (B, N)
        ok = ok & (~up | match.gather(1, anc.clamp(min=0)))  # (B, N)
        anc = torch.where(up, par.gather(1, anc.clamp(min=0)), -1)  # (B, N)
    idx = torch.arange(N, device=tokens.device)[None, :]  # (1, N)
    score = torch.where(ok, depth * (N + 1) + (N - idx), -1)  # (B, N) deepest, then smallest index
    best = score.argmax(1) if N else torch.zeros(B, dtype=torch.long, device=tokens.device)  # (B,)
    has = ok.any(1)  # (B,)
    node = torch.where(has, best, -1)  # (B,)
    n_acc = torch.where(has, depth.gather(1, best[:, None]).squeeze(1) if N else best, 0)  # (B,)
    last = a.gather(1, (node + 1)[:, None]).squeeze(1)  # (B,) argmax after the path
    return _tree_output(_path_of(node, par, depth, D), tokens, n_acc, last)
