"""Lossy verifiers that hide from a test with too little power: what the oracle's power statement
must not call PASS (lossless.depth_claim, report.run_looks).

Each wraps a correct verifier (specref.rejection.verify_chain / verify_tree) and changes only the
final token y of some rows, to p's least likely token at that row (or a token drawn uniformly
from p's support), so every structural check passes and the deviation sits where a careless power
statement does not look:
- `rare_bonus` (class a): rows whose accepted path is rare (its p-probability prod_j p(x_j | x_<j)
  below `RARE`): the prefixes too sparse to get a table of their own carry the whole deviation;
- `tiny_bonus` (class b): rows whose final p is near one-hot (max > 0.995): the minor cells are
  pooled, and a pool that took the dominant cell too left the depth with no test at all;
- `thin_spread` (class c): every row with probability `THIN`: a deviation spread thinly over every
  depth, below each depth's detectable TV, adding up in the output law.
An honest oracle calls each FAIL or INCONCLUSIVE, never PASS (lossless_selftest runs them).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..rejection import verify_chain, verify_tree

RARE = 0.005  # class (a): a path of p-probability below this counts as rare
THIN = 0.02  # class (c): share of rows whose final token is redrawn uniformly over p's support
POWER_MUTANTS = {
    "rare_bonus": "the final token after a rare accepted path is p's least likely token (class a)",
    "tiny_bonus": "the final token under a near one-hot p (max > 0.995) is p's least likely token (class b)",
    "thin_spread": f"the final token of {THIN:.0%} of rows drawn uniformly over p's support (class c)",
}


def _corrupt(name: str, last: torch.Tensor, final_p: torch.Tensor, path_p: torch.Tensor, m: torch.Tensor,
             generator) -> torch.Tensor:
    """The corrupted final tokens (B,) of mutant `name`: last (B,) the correct ones, final_p (B, V)
    p at the final row, path_p (B,) the accepted path's p-probability, m (B,) its length."""
    V = final_p.shape[-1]
    least = torch.where(final_p > 0, final_p, torch.full_like(final_p, 2.0)).argmin(-1)  # (B,)
    if name == "rare_bonus":
        return torch.where((m >= 1) & (path_p < RARE), least, last)
    if name == "tiny_bonus":
        return torch.where(final_p.max(-1).values > 0.995, least, last)
    g = generator[0] if isinstance(generator, (list, tuple)) else generator
    seed = int(torch.randint(2**62, (1,), generator=g)) if g is not None else 0
    h = torch.Generator().manual_seed(seed)
    flip = torch.rand(last.shape[0], generator=h, dtype=torch.float64) < THIN  # (B,)
    support = (final_p > 0).double()  # (B, V)
    redraw = torch.multinomial(support, 1, generator=h)[:, 0]  # (B,) uniform over the support
    return torch.where(flip, redraw.clamp(max=V - 1), last)


def chain_mutant(name: str) -> Callable:
    """verify_chain with the final token of mutant `name` (specref chain convention)."""
    if name not in POWER_MUTANTS:
        raise ValueError(f"name must be one of {sorted(POWER_MUTANTS)}, got {name!r}")

    def fn(draft, p, q=None, *, lengths=None, generator=None):
        out = verify_chain(draft, p, q, lengths=lengths, generator=generator)
        B, K = draft.shape
        rows, a = torch.arange(B), out.num_accepted  # (B,), (B,)
        px = p[:, :K].double().gather(-1, draft.clamp(min=0)[..., None])[..., 0]  # (B, K)
        path_p = torch.where(torch.arange(K)[None] < a[:, None], px, 1.0).prod(-1)  # (B,)
        tokens = out.tokens.clone()  # (B, K+1)
        tokens[rows, a] = _corrupt(name, tokens[rows, a], p[rows, a].double(), path_p, a, generator)
        return type(out)(tokens, a)
    fn.__name__ = f"chain_{name}"
    return fn


def tree_mutant(name: str) -> Callable:
    """verify_tree with the final token of mutant `name` (specref tree convention)."""
    if name not in POWER_MUTANTS:
        raise ValueError(f"name must be one of {sorted(POWER_MUTANTS)}, got {name!r}")

    def fn(tokens, parents, p, q=None, *, lengths=None, generator=None, siblings=None):
        out = verify_tree(tokens, parents, p, q, lengths=lengths, generator=generator, siblings=siblings)
        B = tokens.shape[0]
        rows, m = torch.arange(B), out.num_accepted  # (B,), (B,)
        path = out.path.clamp(min=0)  # (B, D)
        on = out.path >= 0  # (B, D)
        par_row = parents.gather(1, path) + 1  # (B, D) p row of each path node's parent
        tok = tokens.gather(1, path).clamp(min=0)  # (B, D)
        px = p.double()[rows[:, None], par_row, tok]  # (B, D)
        path_p = torch.where(on, px, 1.0).prod(-1)  # (B,)
        end = torch.where(m > 0, path[rows, (m - 1).clamp(min=0)] + 1, 0)  # (B,) p row after the path
        toks = out.tokens.clone()  # (B, D+1)
        toks[rows, m] = _corrupt(name, toks[rows, m], p[rows, end].double(), path_p, m, generator)
        return type(out)(toks, out.path, m)
    fn.__name__ = f"tree_{name}"
    return fn
