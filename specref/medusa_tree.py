"""Medusa's candidate trees: which top-s tokens of which heads one target forward verifies.

Cai et al. 2024 (Medusa, Sec. 2.1.2 "tree attention"): the Cartesian product of the heads' top
tokens is merged into a token tree. A tree is a list of choices (Medusa's `medusa_choices`): the
choice (i_1, ..., i_d) is the node at depth d reached by taking the rank-i_1 token of head 1 (0 =
the most likely), then the rank-i_2 token of head 2, ...; every prefix of a choice is a choice too.
Heads do not see the draft tokens, so head d's rank-i token is the same under every parent.

Sec. 3.3.3 / Appendix ("optimised tree construction"): with a_d(i) the measured probability that
head d's rank-i token is the target's token at its position (heads taken as independent), node
(i_1, ..., i_d) is accepted with probability prod_j a_j(i_j), and the expected number of accepted
draft tokens of a tree is the sum of its nodes' probabilities. The n-node tree with the largest
sum is built greedily: add, n times, the addable node (parent already in) of largest probability -
optimal, because a node's probability never exceeds its parent's, so the n most probable nodes
always form a tree. `best_tree` then picks n for the machine at hand: the expected speed-up
(1 + E[accepted](n)) / (v(1 + n) + c) with v the measured verify cost of a block of 1 + n tokens
relative to a 1-token forward (costs.measure_verify_cost) and c the heads' cost per step.
Left out: Medusa's sparse trees tuned per model by search over many data points (the greedy tree
from measured accuracies is the paper's construction).
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

Choice = Tuple[int, ...]

# Sized for a 2-core CPU: a block of 8-12 nodes costs ~1.4 one-token forwards there (measured:
# costs.measure_verify_cost), and beyond ~12 nodes the cost grows faster than the expected gain.
# 3 heads, 10 nodes: the greedy tree for typical head accuracies (head 1 top-1 ~0.5, decaying).
DEFAULT_CHOICES: Tuple[Choice, ...] = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 2), (2, 0), (0, 0, 1))


def check_choices(choices: Sequence[Sequence[int]], num_heads: int) -> List[Choice]:
    """The choices as tuples sorted by (depth, ranks): topological order. ValueError naming the
    bad choice unless every choice is a non-empty tuple of ranks >= 0, no deeper than num_heads,
    unique, with every prefix present."""
    if isinstance(choices, (str, bytes)) or not hasattr(choices, "__len__") or len(choices) == 0:
        raise ValueError(f"choices must be a non-empty list of tuples of ranks, got {choices!r}")
    out = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not hasattr(c, "__len__") or len(c) == 0:
            raise ValueError(f"each choice must be a non-empty tuple of ranks, got {c!r}")
        t = tuple(int(i) for i in c)
        if any(i < 0 for i in t) or any(int(i) != i for i in c):
            raise ValueError(f"choice {c!r}: ranks must be integers >= 0")
        if len(t) > num_heads:
            raise ValueError(f"choice {c!r} has depth {len(t)} but there are only {num_heads} heads")
        out.append(t)
    if len(set(out)) != len(out):
        dup = next(c for c in out if out.count(c) > 1)
        raise ValueError(f"choice {dup!r} appears twice")
    have = set(out)
    for c in out:
        if len(c) > 1 and c[:-1] not in have:
            raise ValueError(f"choice {c!r} needs its parent {c[:-1]!r} in the tree")
    return sorted(out, key=lambda c: (len(c), c))


def tree_arrays(choices: Sequence[Choice]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents (N,), head (N,), rank (N,)) long for checked, sorted choices: node n's parent index
    (-1 = child of the root), the head (0-based: depth - 1) and rank its token is taken from."""
    index = {c: n for n, c in enumerate(choices)}
    parents = torch.tensor([index[c[:-1]] if len(c) > 1 else -1 for c in choices], dtype=torch.long)  # (N,)
    head = torch.tensor([len(c) - 1 for c in choices], dtype=torch.long)  # (N,)
    rank = torch.tensor([c[-1] for c in choices], dtype=torch.long)  # (N,)
    return parents, head, rank


def _check_acc(acc) -> np.ndarray:
    a = np.asarray(acc, dtype=np.float64)
    if a.ndim != 2 or a.size == 0 or not np.all((a >= 0) & (a <= 1)):
        raise ValueError(f"accuracies must be a (heads, ranks) array of probabilities in [0, 1], got shape "
                         f"{a.shape}")
    return a


def node_probability(choice: Choice, acc) -> float:
    """prod_d a_d(i_d): the chance that every token on the choice's path is the target's."""
    a = _check_acc(acc)
    if len(choice) > a.shape[0] or max(choice) >= a.shape[1]:
        raise ValueError(f"choice {choice!r} is outside the accuracy table of shape {a.shape}")
    return float(np.prod([a[d, i] for d, i in enumerate(choice)]))


def expected_accepted(choices: Sequence[Choice], acc) -> float:
    """Expected accepted draft tokens of a tree: the sum of its nodes' probabilities."""
    return float(sum(node_probability(tuple(c), acc) for c in choices))


def greedy_tree(acc, num_nodes: int) -> List[Choice]:
    """The num_nodes-node tree of largest expected accepted length for accuracies acc (K heads,
    S ranks): acc[d, i] = P(head d+1's rank-i token is right). Nodes are taken by path probability;
    equal probabilities go to the lexicographically smaller choice tuple (the ranks compared from the
    root, a path before its extensions): (0, 1) before (1,), so a tie may take the deeper node."""
    a = _check_acc(acc)
    K, S = a.shape
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    heap = [(-a[0, i], (i,)) for i in range(S)]  # max-heap by probability
    heapq.heapify(heap)
    out: List[Choice] = []
    while heap and len(out) < num_nodes:
        negp, c = heapq.heappop(heap)
        out.append(c)
        if len(c) < K:
            for i in range(S):
                heapq.heappush(heap, (negp * a[len(c), i], c + (i,)))
    return sorted(out, key=lambda c: (len(c), c))


def best_tree(acc, verify_ratios: Sequence[float], head_cost: float = 0.0) -> Tuple[List[Choice], Dict]:
    """The greedy tree whose predicted speed-up (1 + E[accepted](n)) / (v(1 + n) + c) is largest
    over the sizes the verify-cost curve covers: verify_ratios[W - 1] = v(W), a block of W tokens
    relative to one (costs.measure_verify_cost's "ratios"). -> (choices, {n: predicted speed-up})."""
    v = [float(x) for x in verify_ratios]
    if len(v) < 2 or v[0] <= 0 or not all(x > 0 for x in v):
        raise ValueError(f"verify_ratios must hold v(1), v(2), ... > 0 (at least two), got {verify_ratios!r}")
    if not head_cost >= 0:
        raise ValueError(f"head_cost must be >= 0, got {head_cost!r}")
    pred: Dict[int, float] = {}
    best_n, best_s = 1, -1.0
    for n in range(1, len(v)):
        s = (1 + expected_accepted(greedy_tree(acc, n), acc)) / (v[n] / v[0] + head_cost)
        pred[n] = s
        if s > best_s:
            best_n, best_s = n, s
    return greedy_tree(acc, best_n), pred
