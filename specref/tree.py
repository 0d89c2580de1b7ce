"""Token trees: the structure shared by tree drafts (Medusa, EAGLE-2, lookahead's candidate n-grams).

A tree draft verifies several continuations in ONE target forward (SpecInfer, Miao et al. 2024,
"tree attention"; Medusa, Cai et al. 2024, Sec. 2.1.2): the candidates are merged into a token tree,
its nodes are laid out as one block after the row's committed tokens, and each node attends only to
the committed tokens, the root and its own ancestors, with position id = root position + depth.

Representation (per row b, the Draft contract of proposer.py): tokens (B, N) and parents (B, N);
parents[b, i] is the index of node i's parent, -1 for a child of the root (the root is the row's
last committed token, which the target has not processed yet); nodes are topologically ordered
(parent < index). Rows are ragged: `lengths[b]` real nodes, the rest padding (tokens -1; parents
of padding are ignored, -1 by convention). Depth of a root child is 1.

Verify block layout (matches kv_rollback.SpecCache): with c_b = committed_lengths[b] tokens already
in row b's KV cache, the block [root, node_0 .. node_{N-1}] is written at slots c_b + 0..N: the
root at slot c_b (position c_b), node i at slot c_b + 1 + i (position c_b + depth_i).

This module is structure only: the verification maths (greedy longest path, recursive rejection
over children) lives in rejection.py, the compaction of the accepted path in kv_rollback.py.
Loops run over depth levels (at most N), never over rows or nodes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch


class Tree(NamedTuple):
    """A batch of token trees; unpacks as (tokens, parents, lengths)."""

    tokens: torch.Tensor  # (B, N) long, -1 padded
    parents: torch.Tensor  # (B, N) long, -1 = child of the root (and padding)
    lengths: torch.Tensor  # (B,) long, real nodes per row


def check_parents(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ValueError unless parents (B, N) is an integer tensor whose real nodes (valid (B, N)) each
    have parent -1 (the root) or an earlier node; returns parents as long with padding set to -1."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.is_floating_point():
        raise ValueError(f"parents must be an integer tensor (B, N), got {getattr(parents, 'dtype', type(parents))} "
                         f"of shape {tuple(getattr(parents, 'shape', ()))}")
    if tuple(parents.shape) != tuple(valid.shape):
        raise ValueError(f"parents must have shape {tuple(valid.shape)} (the draft's), got {tuple(parents.shape)}")
    ar = torch.arange(parents.shape[1], device=parents.device)  # (N,)
    par = torch.where(valid, parents.long(), -1)  # (B, N)
    bad = valid & ((par < -1) | (par >= ar[None, :]))  # (B, N)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parents[{b}, {i}] = {int(parents[b, i])}: a node's parent must be -1 (the root) or an "
            f"earlier node index in 0..{i - 1} (topological order)")
    return par


def _valid(parents: torch.Tensor, lengths: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the tree and return (parents with padding set to -1, valid (B, N) bool)."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2:
        raise ValueError(f"parents must be (B, N), got shape {tuple(getattr(parents, 'shape', ()))}")
    B, N = parents.shape
    ar = torch.arange(N, device=parents.device)  # (N,)
    if lengths is None:
        valid = torch.ones(B, N, dtype=torch.bool, device=parents.device)  # (B, N)
    else:
        lengths = torch.as_tensor(lengths, device=parents.device)
        if lengths.shape != (B,) or bool(((lengths < 0) | (lengths > N)).any()):
            raise ValueError(f"lengths must be (B,) = ({B},) with values in 0..{N}, got {lengths.tolist()}")
        valid = ar[None, :] < lengths[:, None]  # (B, N)
    return check_parents(parents.long(), valid), valid  # structure only: any numeric parents


def ancestor_mask(parents: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, N, N) bool: node i may attend node j iff j is i or an ancestor of i (padding: itself only)."""
    par, _ = _valid(parents, lengths)
    B, N = par.shape
    anc = torch.eye(N, dtype=torch.bool, device=par.device).expand(B, N, N).clone()  # (B, N, N)
    self_idx = torch.arange(N, device=par.device).expand(B, N)  # (B, N)
    cur = par  # (B, N): the ancestor `level` steps up, -1 once past the root
    for _ in range(N):  # one iteration per depth level
        up = cur >= 0  # (B, N)
        if not bool(up.any()):
            break
        anc.scatter_(2, torch.where(up, cur, self_idx)[..., None], True)  # mark the ancestor (or self)
        cur = torch.where(up, par.gather(1, cur.clamp(min=0)), -1)  # (B, N)
    return anc


def depths(parents: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, N) long: depth of each node, 1 for a child of the root, 0 for padding."""
    _, valid = _valid(parents, lengths)
    return ancestor_mask(parents, lengths).sum(-1) * valid  # (B, N)


def position_ids(parents: torch.Tensor, base_lengths: torch.Tensor,
                 lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, N) long: position of each node = base_lengths[b] + depth.

    base_lengths[b] is the root's position, i.e. the number of tokens already in the row's KV cache
    (the root itself is at position base_lengths[b]; padding nodes get base_lengths[b]).
    """
    base = torch.as_tensor(base_lengths, device=parents.device).long()  # (B,)
    return base[:, None] + depths(parents, lengths)  # (B, N)


def paths(parents: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Root-to-leaf paths: (B, P, D) long node indices, -1 padded.

    paths[b, p, :d] are the nodes (depth 1 .. d) from the root to row b's p-th leaf, leaves in node
    order; P is the most leaves of any row, D the greatest depth. A row with fewer leaves has
    all -1 paths after its last; a row with no nodes has none.
    """
    par, valid = _valid(parents, lengths)
    B, N = par.shape
    anc = ancestor_mask(parents, lengths)  # (B, N, N)
    dep = anc.sum(-1) * valid  # (B, N)
    is_parent = torch.zeros(B, N + 1, dtype=torch.bool, device=par.device)  # (B, N+1), column N = root
    is_parent.scatter_(1, torch.where(par >= 0, par, N), True)
    leaf = valid & ~is_parent[:, :N]  # (B, N)
    P = int(leaf.sum(1).max()) if B * N else 0
    D = int(dep.max()) if B * N else 0
    # order[b, p] = index of row b's p-th leaf (a stable sort puts leaves first, in node order)
    order = torch.sort((~leaf).to(torch.uint8), dim=1, stable=True).indices[:, :P]  # (B, P)
    has = leaf.gather(1, order)  # (B, P) real leaf?
    on_path = anc.gather(1, order[..., None].expand(B, P, N)) & has[..., None]  # (B, P, N)
    out = torch.full((B, P, D + 1), -1, dtype=torch.long, device=par.device)  # (B, P, D+1)
    col = torch.where(on_path, dep[:, None, :] - 1, D)  # (B, P, N): column = depth - 1; D = discard
    node = torch.arange(N, device=par.device).expand(B, P, N)  # (B, P, N)
    out.scatter_(2, col, torch.where(on_path, node, -1))
    return out[..., :D]  # (B, P, D)


def tree_from_sequences(seqs: Sequence[Sequence[Sequence[int]]], *, pad_to: Optional[int] = None,
                        device: Optional[torch.device] = None) -> Tree:
    """Merge each row's token sequences (continuations of the root) into one tree, sharing prefixes.

    seqs[b] is a list of sequences for row b; equal prefixes become one path. Nodes are numbered
    in order of first appearance (sequences in order, each from its first token), which is
    topological. Returns Tree(tokens (B, N), parents (B, N), lengths (B,)), N = the largest node
    count (or pad_to). Example: [[5, 6], [5, 7], [8]] -> tokens [5, 6, 7, 8], parents [-1, 0, 0, -1].
    """
    rows_tok, rows_par = [], []
    for b, row in enumerate(seqs):
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        tok: list[int] = []
        par: list[int] = []
        for seq in row:
            at = -1
            for t in seq:
                t = int(t)
                if t < 0:
                    raise ValueError(f"tokens must be >= 0, got {t} in row {b}")
                if (at, t) not in index:
                    index[(at, t)] = len(tok)
                    tok.append(t)
                    par.append(at)
                at = index[(at, t)]
        rows_tok.append(tok)
        rows_par.append(par)
    n_max = max((len(t) for t in rows_tok), default=0)
    N = n_max if pad_to is None else pad_to
    if N < n_max:
        raise ValueError(f"pad_to={pad_to} is smaller than the largest tree ({n_max} nodes)")
    B = len(rows_tok)
    tokens = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
    parents = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
    for b in range(B):  # building from Python lists: one copy per row
        tokens[b, : len(rows_tok[b])] = torch.tensor(rows_tok[b], dtype=torch.long)
        parents[b, : len(rows_par[b])] = torch.tensor(rows_par[b], dtype=torch.long)
    lengths = torch.tensor([len(t) for t in rows_tok], dtype=torch.long)  # (B,)
    return Tree(tokens.to(device), parents.to(device), lengths.to(device))


def block_mask(parents: torch.Tensor, committed_lengths: torch.Tensor, max_len: int,
               lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention mask of the verify block [root, node_0 .. node_{N-1}] over a max_len-slot cache.

    (B, 1, 1+N, max_len) bool, True = may attend. Query 0 is the root (slot c_b), query 1+i node i
    (slot c_b + 1 + i). Every query attends slots < c_b and the root slot; node i also attends the
    slots of itself and its ancestors. For a chain (parents [-1, 0, 1, ...]) this is the causal mask.
    """
    par, _ = _valid(parents, lengths)
    B, N = par.shape
    c = torch.as_tensor(committed_lengths, device=par.device).long()  # (B,)
    if c.shape != (B,):
        raise ValueError(f"committed_lengths must be (B,) = ({B},), got shape {tuple(c.shape)}")
    if B and (bool((c < 0).any()) or int(c.max()) + 1 + N > max_len):
        raise ValueError(f"a block of 1+{N} slots after committed lengths {c.tolist()} does not fit "
                         f"max_len={max_len}")
    anc = ancestor_mask(parents, lengths)  # (B, N, N)
    blk = torch.zeros(B, 1 + N, 1 + N, dtype=torch.bool, device=par.device)  # (B, 1+N, 1+N)
    blk[:, :, 0] = True  # everyone attends the root
    blk[:, 1:, 1:] = anc
    committed = torch.arange(max_len, device=par.device)[None, :] < c[:, None]  # (B, S)
    mask = committed[:, None, :].repeat(1, 1 + N, 1)  # (B, 1+N, S)
    slots = (c[:, None] + torch.arange(1 + N, device=par.device))[:, None, :]  # (B, 1, 1+N)
    mask.scatter_(2, slots.expand(B, 1 + N, 1 + N), blk)  # block columns c_b + 0..N
    return mask[:, None]  # (B, 1, 1+N, S)
