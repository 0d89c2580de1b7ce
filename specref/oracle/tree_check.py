"""The oracle for tree verifiers: is a tree (multi-draft) sampler lossless? Answered with p-values.

law="lossless" (the default) asks only that the emitted tokens follow p prefix by prefix
(lossless.py): any correct rule passes. law="specinfer" asks the stricter question below.
SpecInfer's multi-step speculative sampling (Miao et al. 2024; specref.rejection.verify_tree) with
deterministic, i.i.d. or without-replacement siblings (Sequoia, Chen et al. 2024) has an exact law
for the outcome of a step, the cell (end node e, path tokens x_1..x_m, final token y), computed in
closed form by tree_exact.py. The check draws trees from tree_cases.py (drafts ~ q by the check),
runs the verifier through a calling convention (tree_adapters.py), and tests with chi-square
(stats.py), Bonferroni over every test of every variant, two looks (1/8 of the samples, then all):
- first: the first emitted token (distributed as p at the root for any lossless verifier);
- length: the number of accepted nodes m; node: the end node e (when the tree branches);
- pos j: the token emitted at position j >= 2, over rows that emitted it;
- final e: the final token of the rows that end at node e (residual or bonus there);
- joint: every cell (or, past max_joint_cells, (e, x_m, y), then (e, y)).
Plus structural checks (a path of the tree, accepted tokens equal the path's, -1 padding, tokens
in the vocabulary, well-formed output); each alone fails the check and names the case.

Left out: trees larger than depth 4 / V^depth contexts beyond ~10^5 (the exact law is tabulated),
SpecTr's optimal transport. Greedy verifiers: tree_greedy.check_greedy_verifier.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .adapters import check_args
from .lossless import lossless_tests, num_depths
from .report import Report, TestResult, check_bound, run_looks
from .stats import chi_square_gof, detectable_tv, tv_distance
from .tree_adapters import adapt_tree, path_errors
from .tree_cases import TreeCase, depths, draw_tree_rows, sequence_cases, standard_tree_cases
from .tree_exact import exact_cells

SIBLINGS = ("iid", "without")  # the sampled sibling kinds of the exact SpecInfer law (tree_exact)
DRAFT_LAWS = ("iid", "without", "trie", "topk")  # how the check draws the trees (check_tree_sampler)
TREE_LAWS = ("lossless", "specinfer")


def _keys(V: int, N: int, D: int):
    """The tests of one variant: (label, kind, key(end, m, x, y) -> category or -1, categories)."""
    def first(e, m, x, y):
        return np.where(m >= 1, x[:, 0], y) if D else y

    def pos(j):  # 1-based position j >= 2
        return lambda e, m, x, y: np.where(m >= j, x[:, min(j - 1, D - 1)], np.where(m == j - 1, y, -1))

    def final(node):
        return lambda e, m, x, y: np.where(e == node, y, -1)

    keys = [("first", "pos", first, V)]
    if N == 0:
        return keys
    keys.append(("length", "length", lambda e, m, x, y: m, D + 1))
    if N > D:
        keys.append(("node", "node", lambda e, m, x, y: e + 1, N + 1))
    keys += [(f"pos {j}", "pos", pos(j), V) for j in range(2, D + 2)]
    keys += [(f"final {'root' if node < 0 else f'node {node}'}", "final", final(node), V) for node in range(-1, N)]
    return keys


def _variant_tests(case: TreeCase, vi: int, mode: str, max_cells: int):
    """The tests of variant vi under mode: (label, kind, key, categories, exact probs per category)."""
    v, V = case.variants[vi], case.vocab
    cells = exact_cells(v, V, mode)
    dep = (0,) + depths(v.parents)
    N, D, fixed = v.n, max(dep), mode == "fixed"
    sizes = [V * (1 if fixed else V ** d) for d in dep]  # cells per end node (root first)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    keys = _keys(V, N, D)
    if N:
        if sum(sizes) <= max_cells:
            def joint(e, m, x, y):
                ctx = np.zeros(e.shape, dtype=np.int64)  # (n,) flat index of the path tokens
                if not fixed:
                    for j in range(D):
                        ctx = np.where(j < m, ctx * V + np.maximum(x[:, j], 0), ctx)
                return offsets[e + 1] + ctx * V + y
            keys.append(("joint", "joint", joint, int(sum(sizes))))
        elif (N + 1) * V * V <= max_cells:
            last_tok = lambda e, m, x, y: np.where(m > 0, x[np.arange(m.size), np.maximum(m - 1, 0)], 0)
            keys.append(("joint (end, last, final)", "joint", lambda e, m, x, y: ((e + 1) * V + last_tok(e, m, x, y)) * V + y,
                         (N + 1) * V * V))
        else:
            keys.append(("joint (end, final)", "joint", lambda e, m, x, y: (e + 1) * V + y, (N + 1) * V))
    tests = []
    for label, kind, key, size in keys:
        k = key(cells.end, cells.m, cells.x, cells.y)  # (C,)
        use = k >= 0
        probs = np.bincount(k[use], weights=cells.prob[use], minlength=size)  # (size,)
        if probs.sum() > 1e-12:
            tests.append((label, kind, key, size, probs / probs.sum()))
    return tests


def _run_tests(name: str, tests, rec, threshold: float):
    out = []
    e, m, x, y = rec
    for label, kind, key, size, probs in tests:
        k = key(e, m, x, y)  # (n,)
        k = k[k >= 0]
        if k.size == 0:
            continue
        obs = np.bincount(k, minlength=size).astype(np.float64)  # (size,)
        g = chi_square_gof(obs, probs)
        det = detectable_tv(g.n, max(2, g.num_cells_used), alpha=threshold, power=0.95)
        worst = tuple((f"cell {c.index}", c.expected, c.observed) for c in g.worst_cells)
        out.append(TestResult(f"{name} {label}", kind, g.p_value, g.statistic, g.dof, g.n, tv_distance(obs, probs), det, worst))
    return out


def _records(path: np.ndarray, last: np.ndarray, tokens: np.ndarray, D: int):
    """(end, m, x (n, D), y) of valid rows."""
    n, W = path.shape
    m = (path >= 0).sum(1)  # (n,)
    end = np.where(m > 0, path[np.arange(n), np.maximum(m - 1, 0)] if W else -1, -1)  # (n,)
    x = np.full((n, max(D, 1)), -1, dtype=np.int64)  # (n, D)
    for j in range(min(W, D)):
        node = path[:, j]
        x[:, j] = np.where(node >= 0, tokens[np.arange(n), np.maximum(node, 0)] if tokens.shape[1] else -1, -1)
    return end, m, x[:, :D] if D else x[:, :0], last


def check_tree_sampler(fn: Callable, *, api: str = "specref", cases: Optional[Sequence[TreeCase]] = None,
                       siblings: str = "iid", law: str = "lossless", samples: int = 20_000, alpha: float = 1e-3,
                       seed: int = 0, early_stop: bool = True, max_joint_cells: int = 4096,
                       per_row_generators: bool = False, tv_bound: float = 0.05, device="cpu") -> Report:
    """Run the tree verifier `fn` (conventions: tree_adapters) on `samples` rows per variant of each
    case and test its output.

    law: "lossless" (lossless.py: the emitted tokens follow p prefix by prefix; any correct rule
    passes) or "specinfer" (the exact law of SpecInfer's rule, siblings tried in index order: a
    stricter question). siblings, the draft law: "iid" (sampled siblings i.i.d. from q, SpecInfer's),
    "without" (without replacement, Sequoia's), "trie" (k i.i.d. sequences drawn from q as k chains
    from the root, default cases lossless.sequence_cases(); a verifier may merge their shared
    prefixes) or "topk" (only the deterministic cases; q None). Default cases: standard_tree_cases();
    tree_cases.mixed_cases() (top-k and sampled nodes in one tree) under law "lossless" with "iid" or
    "without". The verifier is told the kind of the draws (tree_adapters: a specref verifier with a
    `siblings` parameter gets it; per-node kinds for mixed cases). Verdict PASS / FAIL / INCONCLUSIVE
    (no failure, but detectable_tv above tv_bound)."""
    check_args(samples, seed, alpha)
    call = adapt_tree(fn, api, draft_law=siblings)
    return run_tree_check(call, cases, siblings, law, samples, alpha, seed, early_stop, max_joint_cells,
                          per_row_generators, tv_bound, device)


def run_tree_check(call: Callable, cases, siblings: str, law: str, samples: int, alpha: float, seed: int,
                   early_stop: bool, max_joint_cells: int, per_row_generators: bool, tv_bound: float,
                   device="cpu", what: str = "verifier") -> Report:
    """check_tree_sampler after the adapter: call(tokens, parents, lengths, p, q, gens) -> (path, last)."""
    if siblings not in DRAFT_LAWS:
        raise ValueError(f"siblings must be one of {DRAFT_LAWS}, got {siblings!r}")
    if law not in TREE_LAWS:
        raise ValueError(f"law must be one of {TREE_LAWS}, got {law!r}")
    check_bound(tv_bound)
    if cases is None:
        cases = sequence_cases() if siblings == "trie" else standard_tree_cases()
    cases = tuple(cases)
    if siblings == "topk":
        cases = tuple(c for c in cases if c.variants[0].tokens is not None)
        if not cases:
            raise ValueError("siblings='topk' needs cases with deterministic tokens; none were given")
    has_mixed = any(v.ranks for c in cases for v in c.variants)
    if has_mixed and (law != "lossless" or siblings == "trie"):
        raise ValueError(f"cases with mixed (top-k and sampled) nodes are checked with law='lossless' and siblings "
                         f"'iid' or 'without' (their exact SpecInfer law is not tabulated), got law={law!r}, "
                         f"siblings={siblings!r}")
    draw_as = "iid" if siblings in ("trie", "topk") else siblings  # trie: k i.i.d. sequences, chains from the root
    looks = [max(1, samples // 8), samples] if early_stop else [samples]
    plan = {}  # (case, variant) -> tests
    for ci, case in enumerate(cases):
        for vi, v in enumerate(case.variants):
            if law == "lossless":
                plan[ci, vi] = [None] * num_depths(v)
            else:
                plan[ci, vi] = _variant_tests(case, vi, "fixed" if v.tokens is not None else draw_as, max_joint_cells)
    threshold = alpha / len(looks) / max(1, sum(len(t) for t in plan.values()))

    def draw(ci, case, start, stop):
        s0, s1, s2 = np.random.SeedSequence([seed, ci, start]).generate_state(3)
        vid = torch.arange(start, stop) % len(case.variants)  # (B,)
        tok, par, lens, P, Q, kinds = draw_tree_rows(case, vid, draw_as, torch.Generator().manual_seed(int(s0)))
        gens = ([torch.Generator().manual_seed(int(s)) for s in np.random.SeedSequence([seed, ci, start, 1]).generate_state(stop - start)]
                if per_row_generators else torch.Generator().manual_seed(int(s1)))
        return vid, tok, par, lens, P, Q, kinds, gens, int(s2)

    def run(case, drawn):
        vid, tok, par, lens, P, Q, kinds, gens, s2 = drawn
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        kind = "deterministic" if Q is None else ("without" if draw_as == "without" else "sampled")
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(s2)  # for verifiers that use the global RNG
            path, last = call(to(tok), to(par), to(lens), to(P), to(Q), gens, kind=kind, kinds=to(kinds))
        return vid.numpy(), path.numpy(), last.numpy(), tok.numpy(), par.numpy(), lens.numpy()

    def analyse(ci, case, chunks, thr):
        vid, path, last, tok, par, lens = _concat(chunks)
        bad_path, bad_tok = path_errors(path, last, par, lens, case.vocab)
        errors, tests, firsts = [], [], []
        for vi, v in enumerate(case.variants):
            name = f"{case.name}/{v.label}"
            sel = vid == vi
            for mask, what in ((bad_path, "the accepted path is not a root-to-node path of the tree"),
                               (bad_tok, f"final token not in [0, {case.vocab})")):
                if (mask & sel).any():
                    r = int(np.flatnonzero(mask & sel)[0])
                    errors.append(f"{name}: {int((mask & sel).sum())}/{int(sel.sum())} rows: {what} (e.g. parents "
                                  f"{par[r, :lens[r]].tolist()}, path {path[r].tolist()}, final token {int(last[r])})")
            ok = sel & ~bad_path & ~bad_tok
            D = max(depths(v.parents), default=0)
            rec = _records(path[ok], last[ok], tok[ok], D)
            if law == "lossless":
                t, power = lossless_tests(name, v, case.vocab, rec, thr, TestResult)
                firsts += power
            else:
                t = _run_tests(name, plan[ci, vi], rec, thr)
                firsts += [t[0].detectable_tv] if t else []
            tests += t
        return errors, tests, firsts, vid.size

    chunk = lambda case: max(len(case.variants), (2 ** 21 // ((case.width + 1) * case.vocab))  # noqa: E731
                             // len(case.variants) * len(case.variants))
    has_fixed = any(c.variants[0].tokens is not None for c in cases)
    has_sampled = any(c.variants[0].tokens is None for c in cases)
    draft_law = "topk" if siblings == "topk" else "+".join([siblings] * has_sampled + ["topk"] * (has_fixed or has_mixed))
    return run_looks(cases, looks, alpha, threshold, chunk, draw, run, analyse, what, tv_bound, law, draft_law)


def _concat(chunks):
    W = max([c[1].shape[1] for c in chunks] + [0])
    pad = lambda a: np.pad(a, ((0, 0), (0, W - a.shape[1])), constant_values=-1)
    vid, path, last, tok, par, lens = zip(*chunks)
    return (np.concatenate(vid), np.concatenate([pad(a) for a in path]), np.concatenate(last),
            np.concatenate(tok), np.concatenate(par), np.concatenate(lens))
