"""Tests of token-tree structure (specref/tree.py): hand-built trees, chains, merges, ragged batches."""
from __future__ import annotations

import pytest
import torch

from specref.tree import Tree, ancestor_mask, block_mask, depths, paths, position_ids, tree_from_sequences

# Two hand-built trees, padded to N = 5 (row 1 has 3 nodes):
# row 0:  root ─ 0 ─ 1 ─ 3        parents [-1, 0, -1, 1, 2]
#              └ 2 ─ 4
# row 1:  root ─ 0                parents [-1, -1, 0] + padding
#              └ 1
#                 (2 is a child of 0)
PARENTS = torch.tensor([[-1, 0, -1, 1, 2],
                        [-1, -1, 0, -1, -1]])
LENGTHS = torch.tensor([5, 3])


def naive_ancestors(par, n):
    """Walk up from every node: set of (node, ancestor-or-self)."""
    out = set()
    for i in range(n):
        j = i
        while j >= 0:
            out.add((i, j))
            j = par[j]
    return out


def test_depths_hand_built():
    d = depths(PARENTS, LENGTHS)
    assert d.tolist() == [[1, 2, 1, 3, 2],  # row 0: 0 and 2 under the root, 1 under 0, 3 under 1, 4 under 2
                          [1, 1, 2, 0, 0]]  # row 1: 0 and 1 under the root, 2 under 0; padding depth 0


def test_ancestor_mask_hand_built():
    m = ancestor_mask(PARENTS, LENGTHS).int()
    assert m[0].tolist() == [[1, 0, 0, 0, 0],  # node 0: itself
                             [1, 1, 0, 0, 0],  # node 1: 0, itself
                             [0, 0, 1, 0, 0],  # node 2: itself (another root child)
                             [1, 1, 0, 1, 0],  # node 3: 0, 1, itself
                             [0, 0, 1, 0, 1]]  # node 4: 2, itself
    assert m[1].tolist() == [[1, 0, 0, 0, 0],  # node 0
                             [0, 1, 0, 0, 0],  # node 1
                             [1, 0, 1, 0, 0],  # node 2: 0, itself
                             [0, 0, 0, 1, 0],  # padding: itself only (a query row is never empty)
                             [0, 0, 0, 0, 1]]  # padding


def test_position_ids():
    # root positions 7 and 3 (cache lengths): node position = root position + depth
    pos = position_ids(PARENTS, torch.tensor([7, 3]), LENGTHS)
    assert pos.tolist() == [[8, 9, 8, 10, 9],
                            [4, 4, 5, 3, 3]]  # padding at the root's position


def test_paths_hand_built():
    p = paths(PARENTS, LENGTHS)
    assert p.shape == (2, 2, 3)  # at most 2 leaves per row, depth 3
    assert p[0].tolist() == [[0, 1, 3],  # leaf 3: root -> 0 -> 1 -> 3
                             [2, 4, -1]]  # leaf 4: root -> 2 -> 4
    assert p[1].tolist() == [[1, -1, -1],  # leaf 1 (node order)
                             [0, 2, -1]]  # leaf 2: root -> 0 -> 2


def test_block_mask_hand_built():
    # row 0 has 2 committed slots (root at slot 2, node i at 3 + i); row 1 has 0 (root at slot 0)
    m = block_mask(PARENTS, torch.tensor([2, 0]), 9, LENGTHS)
    assert m.shape == (2, 1, 6, 9) and m.dtype == torch.bool
    assert m[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # root: committed 0, 1 and itself
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # node 0: + root, itself
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # node 1: + 0, itself
        [1, 1, 1, 0, 0, 1, 0, 0, 0],  # node 2: itself
        [1, 1, 1, 1, 1, 0, 1, 0, 0],  # node 3: 0, 1, itself
        [1, 1, 1, 0, 0, 1, 0, 1, 0]]  # node 4: 2, itself; the last slot is beyond the block
    assert m[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # node 0
        [1, 0, 1, 0, 0, 0, 0, 0, 0],  # node 1
        [1, 1, 0, 1, 0, 0, 0, 0, 0],  # node 2: 0, itself
        [1, 0, 0, 0, 1, 0, 0, 0, 0],  # padding: root, itself
        [1, 0, 0, 0, 0, 1, 0, 0, 0]]  # padding


@pytest.mark.parametrize("N", [1, 4, 16])
def test_chain_is_causal(N):
    chain = torch.arange(-1, N - 1).expand(3, N)  # parents [-1, 0, 1, ..., N-2] in 3 rows
    c = torch.tensor([0, 5, 11])
    S = 11 + 1 + N + 2
    m = block_mask(chain, c, S)  # (3, 1, 1+N, S)
    q = torch.arange(1 + N)[None, :, None]  # (1, 1+N, 1) query q sits at slot c + q
    causal = torch.arange(S)[None, None, :] <= c[:, None, None] + q  # (3, 1+N, S)
    assert torch.equal(m[:, 0], causal)
    assert depths(chain).tolist() == [list(range(1, N + 1))] * 3
    assert paths(chain).tolist() == [[list(range(N))]] * 3  # one path through every node


def test_fan_and_empty_tree():
    fan = torch.full((1, 4), -1)  # 4 children of the root
    assert depths(fan).tolist() == [[1, 1, 1, 1]]
    assert torch.equal(ancestor_mask(fan)[0], torch.eye(4, dtype=torch.bool))
    assert paths(fan).tolist() == [[[0], [1], [2], [3]]]
    # a batch whose rows have no nodes at all
    empty = torch.full((2, 0), -1)
    assert paths(empty).shape == (2, 0, 0)
    assert block_mask(empty, torch.tensor([1, 2]), 4)[:, 0].int().tolist() == [[[1, 1, 0, 0]], [[1, 1, 1, 0]]]


def test_tree_from_sequences_merges_prefixes():
    t = tree_from_sequences([
        [[5, 6, 7], [5, 6, 8], [5, 9], [4]],  # row 0: 5-6 shared, then 7 | 8; 5-9; 4 alone
        [[3, 3], [3, 3], [3]],  # row 1: duplicates and a prefix of another add nothing
        [],  # row 2: no candidates
    ])
    assert isinstance(t, Tree)
    assert t.tokens.tolist() == [[5, 6, 7, 8, 9, 4], [3, 3, -1, -1, -1, -1], [-1] * 6]
    assert t.parents.tolist() == [[-1, 0, 1, 1, 0, -1], [-1, 0, -1, -1, -1, -1], [-1] * 6]
    assert t.lengths.tolist() == [6, 2, 0]
    # every input sequence is a root-to-node path: read the tokens of each leaf's path back
    p = paths(t.parents, t.lengths)
    got = [[[int(t.tokens[b, i]) for i in path if i >= 0] for path in p[b] if path[0] >= 0] for b in range(3)]
    assert got == [[[5, 6, 7], [5, 6, 8], [5, 9], [4]], [[3, 3]], []]
    # pad_to pads; too small raises
    assert tree_from_sequences([[[1, 2]]], pad_to=4).tokens.tolist() == [[1, 2, -1, -1]]
    with pytest.raises(ValueError, match="pad_to"):
        tree_from_sequences([[[1, 2, 3]]], pad_to=2)
    with pytest.raises(ValueError, match=">= 0"):
        tree_from_sequences([[[1, -4]]])


def random_tree(g, n):
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]  # parent in -1..i-1


def test_ragged_batch_equals_rows_alone_and_naive():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        B = int(torch.randint(1, 5, (1,), generator=g))
        ns = [int(torch.randint(0, 12, (1,), generator=g)) for _ in range(B)]
        N = max(ns)
        rows = [random_tree(g, n) for n in ns]
        par = torch.tensor([r + [-1] * (N - len(r)) for r in rows]).reshape(B, N)  # (B, N)
        lens = torch.tensor(ns)
        c = torch.randint(0, 6, (B,), generator=g)
        S = 6 + 1 + N
        anc, dep = ancestor_mask(par, lens), depths(par, lens)
        pth, blk = paths(par, lens), block_mask(par, c, S, lens)
        for b, (r, n) in enumerate(zip(rows, ns)):
            pairs = naive_ancestors(r, n)
            want = {(i, j) for i in range(n) for j in range(n) if anc[b, i, j]}
            assert want == pairs
            assert dep[b, :n].tolist() == [sum(1 for (i, _) in pairs if i == x) for x in range(n)]
            # the row alone (no padding, no other rows) gives the same answers
            alone = torch.tensor([r]).reshape(1, n)
            assert torch.equal(ancestor_mask(alone)[0], anc[b, :n, :n])
            assert torch.equal(block_mask(alone, c[b:b + 1], S)[0, 0, : 1 + n], blk[b, 0, : 1 + n])
            leaves = [i for i in range(n) if i not in r]
            got = [[x for x in p if x >= 0] for p in pth[b].tolist() if p[0] >= 0]
            assert got == [sorted(j for (i, j) in pairs if i == leaf) for leaf in leaves]


def test_bad_trees_raise():
    with pytest.raises(ValueError, match=r"parents\[0, 1\]"):
        depths(torch.tensor([[-1, 1]]))  # a node cannot be its own parent
    with pytest.raises(ValueError, match=r"parents\[0, 0\]"):
        ancestor_mask(torch.tensor([[1, -1]]))  # parent after the child: not topological
    with pytest.raises(ValueError, match=r"parents\[0, 1\]"):
        paths(torch.tensor([[-1, -2]]))  # below -1
    depths(torch.tensor([[-1, 5]]), torch.tensor([1]))  # padding is not checked
    with pytest.raises(ValueError, match="lengths"):
        depths(torch.tensor([[-1, 0]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="B, N"):
        depths(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="max_len"):
        block_mask(torch.tensor([[-1, 0]]), torch.tensor([6]), 8)  # slots 6, 7, 8 > max_len 8
