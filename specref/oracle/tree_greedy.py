"""The oracle for greedy tree verifiers: exact, no statistics.

Greedy verification (Medusa, Cai et al. 2024; EAGLE, Li et al. 2024; specref.rejection.
verify_tree_greedy) must emit what plain greedy decoding emits: with the target's argmax after a
token path t written f(t), the greedy sequence is g_1 = f(()), g_{k+1} = f(g_1..g_k); the accepted
path is a deepest path of the tree spelling g_1..g_m, and the final token is g_{m+1} (the argmax
after the path). The target here is a function of the whole token path, as a language model is,
so duplicate siblings (equal paths) have equal argmaxes and any deepest matching path is correct.
Rows are random trees (depth <= 4, width <= 4, ragged, empty ones too) whose node tokens are the
argmax at their parent with probability 0.7 (so paths match often, also under repeated siblings),
the target given as logits with a margin (no ties). Every row is compared with the brute-force
answer; each kind of mismatch is reported with its count and an example row, naming the case.

Left out: ties in the target's logits (conventions differ: first index, smallest node index).
"""
from __future__ import annotations

import random
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from .adapters import Malformed, check_args
from .report import Report
from .tree_adapters import adapt_tree, path_errors

GREEDY_CASES = (("V2", 2, 8), ("V5", 5, 10), ("V50", 50, 12))  # (name, vocab, most nodes per row)


def _argmax_table(V: int, rng: random.Random):
    table = {}

    def f(path: Tuple[int, ...]) -> int:
        if path not in table:
            table[path] = rng.randrange(V)
        return table[path]
    return f


def greedy_rows(V: int, n_max: int, rows: int, seed: int):
    """tokens (B, n_max) -1 padded, parents (B, n_max), lengths (B,), logits (B, n_max+1, V) and the
    expected (accepted m (B,), emitted tokens list per row)."""
    rng = random.Random(seed)
    tokens = torch.full((rows, n_max), -1, dtype=torch.long)  # (B, N)
    parents = torch.full((rows, n_max), -1, dtype=torch.long)  # (B, N)
    lengths = torch.zeros(rows, dtype=torch.long)  # (B,)
    logits = torch.randn(rows, n_max + 1, V, generator=torch.Generator().manual_seed(seed)) * 0.3  # (B, N+1, V)
    want_m, want = [], []
    for b in range(rows):
        f = _argmax_table(V, rng)
        n = rng.randrange(n_max + 1)
        par, tok, paths, kids = [], [], [()], {-1: 0}
        for i in range(n):
            open_ = [j for j in [-1] + list(range(i)) if len(paths[j + 1]) < 4 and kids.get(j, 0) < 4]
            pa = rng.choice(open_)
            t = f(paths[pa + 1]) if rng.random() < 0.7 else rng.randrange(V)
            par.append(pa)
            tok.append(t)
            paths.append(paths[pa + 1] + (t,))
            kids[pa] = kids.get(pa, 0) + 1
            kids[i] = 0
        for node, path in enumerate(paths):  # row 0 after the root, 1 + i after node i
            logits[b, node, f(path)] += 5.0
        g = [f(())]
        while len(g) <= 5:
            g.append(f(tuple(g)))
        m = max([len(pt) for pt in paths if list(pt) == g[: len(pt)]])
        lengths[b] = n
        if n:
            tokens[b, :n] = torch.tensor(tok)
            parents[b, :n] = torch.tensor(par)
        want_m.append(m)
        want.append(g[: m + 1])
    return tokens, parents, lengths, logits, np.array(want_m), want


def check_greedy_verifier(fn: Callable, *, api: str = "specref", samples: int = 2000, seed: int = 0,
                          cases: Optional[Tuple[Tuple[str, int, int], ...]] = None) -> Report:
    """Run the greedy tree verifier `fn` on `samples` random rows per case and compare every row with
    the exact answer (conventions: tree_adapters, greedy forms). The Report has no tests; it passes
    when there are no errors."""
    check_args(samples, seed, 0.5)
    call = adapt_tree(fn, api, greedy=True)
    errors: List[str] = []
    total = 0
    for ci, (name, V, n_max) in enumerate(cases or GREEDY_CASES):
        tokens, parents, lengths, logits, want_m, want = greedy_rows(V, n_max, samples, seed * 1000 + ci)
        total += samples
        try:
            path, last = call(tokens, parents, lengths, logits, None, None)
        except Malformed as e:
            errors.append(f"greedy/{name}: malformed output: {e}")
            continue
        except Exception as e:
            errors.append(f"greedy/{name}: the verifier raised {type(e).__name__}: {e}")
            continue
        path, last = path.numpy(), last.numpy()
        bad_path, bad_tok = path_errors(path, last, parents.numpy(), lengths.numpy(), V)
        m = (path >= 0).sum(1)  # (B,)
        tok = tokens.numpy()
        got = [[] if bad_path[b] else [int(tok[b, i]) for i in path[b, : m[b]]] + [int(last[b])] for b in range(samples)]
        kinds = (
            (bad_path, "the accepted path is not a root-to-node path of the tree"),
            (bad_tok, f"final token not in [0, {V})"),
            (~bad_path & (m != want_m), "the accepted path is not the longest path matching the target argmax"),
            (~bad_path & (m == want_m) & np.array([g[:-1] != w[:-1] for g, w in zip(got, want)]),
             "accepted tokens are not the target argmax at their parents"),
            (~bad_path & ~bad_tok & (m == want_m) & np.array([g[-1] != w[-1] for g, w in zip(got, want)]),
             "the final token is not the target argmax after the path"),
        )
        for mask, what in kinds:
            if mask.any():
                b = int(np.flatnonzero(mask)[0])
                n = int(lengths[b])
                errors.append(f"greedy/{name}: {int(mask.sum())}/{samples} rows: {what} (e.g. row {b}: parents "
                              f"{parents[b, :n].tolist()}, tokens {tokens[b, :n].tolist()}, expected {want[b]} "
                              f"(path length {int(want_m[b])}), got path {path[b, : m[b]].tolist()} emitting {got[b]})")
    return Report(not errors, 0.0, 0.0, (), tuple(errors), total, 0.0, False, "FAIL" if errors else "PASS")
