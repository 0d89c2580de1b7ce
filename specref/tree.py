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

Sibling kinds (SIBLING_KINDS, `sibling_kinds`): how each node was drawn among its siblings,
"deterministic", "sampled" (independent draws) or "without" (without replacement); they decide the
rule that verifies the tree (rejection.py, docs/sibling_kinds.md) and are given, never guessed.

This module is structure only: the verification maths (greedy longest path, recursive rejection
over children) lives in rejection.py, the compaction of the accepted path in kv_rollback.py.
Loops run over depth levels (at most N), never over rows or nodes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch


SIBLING_KINDS = ("deterministic", "sampled", "without")  # how a tree node was drawn; a per-node
# kinds tensor holds the index (0, 1, 2), a per-node list the names (docs/sibling_kinds.md)
DETERMINISTIC, SAMPLED, WITHOUT = range(3)
Siblings = Union[None, str, Sequence[str], torch.Tensor]


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


_HOW = ("name how the nodes were drawn: siblings='sampled' (each node an independent draw from its q "
        "row, SpecInfer), 'without' (siblings drawn without replacement from their parent's q: Gumbel-top-k, "
        "distinct samples, merged sequences; Sequoia), 'deterministic' (q=None: top-k, n-gram), or one kind "
        "per node (a list of names, or a tensor (N,) / (B, N) of indices into SIBLING_KINDS)")


def sibling_kinds(siblings: Siblings, has_q: bool, B: int, N: int, device, valid: Optional[torch.Tensor] = None,
                  validate: bool = True, name: str = "siblings"):
    """The kind of every node of a tree draft, never guessed: a name of SIBLING_KINDS (one kind for
    every node) or a (B, N) long tensor of their indices (per-node kinds).

    siblings: None (only with q None: deterministic), a name, a sequence of N names (shared by the
    rows) or an integer tensor (N,) or (B, N) of indices. With q every kind is allowed per node (the q
    rows of deterministic nodes are not read); a single "deterministic" with a q is refused (a q next to
    top-k siblings is the mislabel this guards against: pass q=None, or per-node kinds); without q every
    node must be deterministic. valid (B, N): the real nodes (whose indices are checked). validate=False:
    no checks beyond the type (the loop's own calls). ValueError naming `name` otherwise.
    """
    if siblings is None:
        if has_q:  # also with validate=False: a host-side check, and the one thing never guessed
            raise ValueError(f"{name} is None but a q was given: {_HOW}. The rule is never guessed from q")
        return "deterministic"
    if isinstance(siblings, str):
        if not validate:
            return siblings
        if siblings not in SIBLING_KINDS:
            raise ValueError(f"{name} must be one of {SIBLING_KINDS} or one kind per node, got {siblings!r}")
        if siblings == "deterministic" and has_q:
            raise ValueError(f"{name}='deterministic' with a q: deterministic (top-k) siblings are verified with "
                             "q=None; the rules for sampled siblings are not lossless for them. A tree mixing "
                             "top-k and sampled nodes gives one kind per node")
        if siblings != "deterministic" and not has_q:
            raise ValueError(f"{name}={siblings!r} needs the q the nodes were drawn from (q=None means "
                             "deterministic siblings)")
        return siblings
    if isinstance(siblings, torch.Tensor):
        codes = siblings
        if validate and (codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool
                         or tuple(codes.shape) not in ((N,), (B, N))):
            raise ValueError(f"{name} as a tensor must hold integer kind indices (0 deterministic, 1 sampled, "
                             f"2 without) of shape ({N},) or ({B}, {N}), got {codes.dtype} {tuple(codes.shape)}")
        codes = codes.to(device=device, dtype=torch.long)
    elif isinstance(siblings, (list, tuple)):
        if validate:
            bad = [s for s in siblings if s not in SIBLING_KINDS]
            if len(siblings) != N or bad:
                raise ValueError(f"{name} as a list must name one kind of {SIBLING_KINDS} per node ({N} nodes), "
                                 f"got {len(siblings)} entries" + (f" with {bad[0]!r}" if bad else ""))
        codes = torch.tensor([SIBLING_KINDS.index(s) for s in siblings[:N]], dtype=torch.long, device=device)
    else:
        raise ValueError(f"{name} must be None, one of {SIBLING_KINDS}, a list of them (one per node) or a "
                         f"tensor of their indices, got {type(siblings).__name__}")
    codes = codes.expand(B, N) if codes.dim() == 1 else codes  # (B, N)
    if validate:
        real = valid if valid is not None else torch.ones(B, N, dtype=torch.bool, device=device)  # (B, N)
        bad = real & ((codes < 0) | (codes >= len(SIBLING_KINDS)))  # (B, N)
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name}[{b}, {i}] = {int(codes[b, i])} is not a kind index in 0..2 {SIBLING_KINDS}")
        drawn = real & (codes != DETERMINISTIC)  # (B, N)
        if not has_q and bool(drawn.any()):
            b, i = (int(v) for v in drawn.nonzero()[0])
            raise ValueError(f"{name}: node {i} of row {b} is {SIBLING_KINDS[int(codes[b, i])]!r} but q is None: "
                             "sampled nodes need the q they were drawn from")
    return codes


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


class SampledTree(NamedTuple):
    """tree_from_sequences with q: a Tree plus what verifies it (Draft's q and siblings fields)."""

    tokens: torch.Tensor  # (B, N) long, -1 padded
    parents: torch.Tensor  # (B, N) long
    lengths: torch.Tensor  # (B,) long
    q: torch.Tensor  # (B, N, V): q[b, i] the q node i's token was drawn from (at its parent's path)
    siblings: str  # "without": the merged siblings are distinct, in order of first appearance


def tree_from_sequences(seqs: Sequence[Sequence[Sequence[int]]], *, q=None, pad_to: Optional[int] = None,
                        device: Optional[torch.device] = None):
    """Merge each row's token sequences (continuations of the root) into one tree, sharing prefixes.

    seqs[b] is a list of sequences for row b; equal prefixes become one path. Nodes are numbered
    in order of first appearance (sequences in order, each from its first token), which is
    topological. Returns Tree(tokens (B, N), parents (B, N), lengths (B,)), N = the largest node
    count (or pad_to). Example: [[5, 6], [5, 7], [8]] -> tokens [5, 6, 7, 8], parents [-1, 0, 0, -1].

    Deterministic sequences (n-gram candidates, beams, top-k paths) merge as they are: verify the
    tree with q=None. Sampled sequences are different: merging changes how the siblings were drawn
    (a repeated token is dropped, so the siblings are no longer i.i.d.), and verifying the merged
    tree with the i.i.d. rule ("sampled") is lossy (docs/sibling_kinds.md: P 0.26 instead of 0.2).
    What keeps them verifiable: q. Pass q[b][s] (a (len(seqs[b][s]), V) tensor, or a tensor
    (B, S, L, V)), row j the distribution token j of sequence s was drawn from (at its prefix); then
    the result is a SampledTree(tokens, parents, lengths, q (B, N, V), siblings="without"): the
    distinct tokens that k i.i.d. draws show, in order of first appearance, are draws without
    replacement from q (each new one is q restricted to the tokens not seen yet), at every node, so
    Sequoia's rule ("without") verifies the merged tree losslessly (the oracle's trie law in
    tests/test_sibling_kinds.py). This needs the sequences in the order they were drawn (not sorted
    or deduplicated by value), each an independent draw given its prefix, their lengths not chosen
    from their own tokens. ValueError (naming q) when sequences that share a prefix give different q
    rows after it (they were not drawn from one q there) or a row is missing.
    """
    rows_tok, rows_par, rows_src = [], [], []
    for b, row in enumerate(seqs):
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        tok: list[int] = []
        par: list[int] = []
        src: list[tuple[int, int]] = []  # (sequence, position) that created each node
        after: dict[int, tuple[int, int]] = {}  # node -> the first (sequence, position) drawn after it
        for si, seq in enumerate(row):
            at = -1
            for pos, t in enumerate(seq):
                t = int(t)
                if t < 0:
                    raise ValueError(f"tokens must be >= 0, got {t} in row {b}")
                if q is not None:
                    _same_q(q, b, si, pos, after.setdefault(at, (si, pos)))
                if (at, t) not in index:
                    index[(at, t)] = len(tok)
                    tok.append(t)
                    par.append(at)
                    src.append((si, pos))
                at = index[(at, t)]
        rows_tok.append(tok)
        rows_par.append(par)
        rows_src.append(src)
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
    if q is None:
        return Tree(tokens.to(device), parents.to(device), lengths.to(device))
    V = next((_q_row(q, b, *src[0]).shape[-1] for b, src in enumerate(rows_src) if src), 1)
    qt = torch.zeros(B, N, V)  # (B, N, V) padding rows zero (never read)
    for b, src in enumerate(rows_src):
        for i, (si, pos) in enumerate(src):
            qt[b, i] = _q_row(q, b, si, pos)
    return SampledTree(tokens.to(device), parents.to(device), lengths.to(device), qt.to(device), "without")


def _q_row(q, b: int, s: int, j: int) -> torch.Tensor:
    """q[b][s][j] as a float (V,) tensor, or ValueError naming q."""
    try:
        row = torch.as_tensor(q[b][s][j])
    except (IndexError, TypeError, KeyError) as e:
        raise ValueError(f"q[{b}][{s}][{j}] is missing: q[b][s] must hold one row per token of sequence s "
                         f"({type(e).__name__}: {e})") from None
    if row.dim() != 1 or not row.is_floating_point():
        raise ValueError(f"q[{b}][{s}][{j}] must be a float distribution (V,), got {row.dtype} {tuple(row.shape)}")
    return row.float()


def _same_q(q, b: int, s: int, j: int, first: tuple) -> None:
    """Sequences sharing a prefix drew their next tokens from one q: q[b][s][j] must equal the row of
    the first sequence drawn after that prefix."""
    if (s, j) == first:
        return
    a, ref = _q_row(q, b, s, j), _q_row(q, b, *first)
    if a.shape != ref.shape or not torch.allclose(a, ref, atol=1e-5, rtol=1e-4):
        raise ValueError(f"q[{b}][{s}][{j}] differs from q[{b}][{first[0]}][{first[1]}], though sequences {first[0]} "
                         f"and {s} share the prefix before it: i.i.d. sequences draw the token after a prefix from "
                         "one q (merging them needs it)")


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
