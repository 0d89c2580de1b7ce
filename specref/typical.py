"""Medusa's typical acceptance: faster than rejection sampling, and LOSSY (not distributed as p).

Cai et al. 2024 (Medusa, Sec. 2.3.1): instead of matching the target's distribution, accept a
draft token x whose target probability is "typical enough":

    p(x) > min(epsilon, delta * exp(-H(p)))      H(p) the entropy of the target's p at that position

(epsilon = `posterior_threshold` 0.09, delta = `posterior_alpha` 0.3: the defaults of the Medusa
repository). Along a tree every root-to-node path is tested token by token; the longest path whose
every token passes is accepted (ties: the larger sum of log p along the path, as Medusa picks the
most likely of the longest candidates); then one more token is sampled from p at the path's last
node, truncated to the tokens that pass the same test (Medusa's `get_typical_one_token`; the top
token always passes, since exp(-H) <= max p; Medusa's `fast=True` path takes the argmax instead). p is the warped distribution (temperature, top-k,
top-p), as the Medusa repository applies its temperature before the test.

Why it is lossy: a typical token is accepted with probability 1 where speculative sampling accepts
it with probability p(x) (deterministic drafts), and the final token's truncation drops p's tail.
The output's distribution therefore differs from p: the whole-loop chi-square test
(tests/test_medusa.py) rejects it and reports the measured total-variation distance. At
temperature 0 the loop uses greedy verification, which is exact.

Randomness as rejection.py: a row with N_b nodes consumes N_b + 1 uniforms per call (only the last
is used), so rows stay independent under one generator per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .rejection import TreeResult, _draft_lengths, _path_of, _tree_output, _tree_structure
from .sampling import Generators, ragged_uniforms, sample_from_probs


@dataclass(frozen=True)
class TypicalAcceptance:
    """Settings of Medusa's typical acceptance (a proposer sets `acceptance_rule` to one of these)."""

    posterior_threshold: float = 0.09  # epsilon: a token with p(x) > epsilon always passes
    posterior_alpha: float = 0.3  # delta: ... and one with p(x) > delta * exp(-H(p)) passes too

    def __post_init__(self) -> None:
        for name in ("posterior_threshold", "posterior_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")


def typical_threshold(p: torch.Tensor, cfg: TypicalAcceptance) -> torch.Tensor:
    """min(epsilon, delta * exp(-H(p))) over the last axis: (..., V) -> (...)."""
    H = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)  # (...) entropy in nats (0 log 0 = 0)
    return torch.clamp(cfg.posterior_alpha * torch.exp(-H), max=cfg.posterior_threshold)  # (...)


def verify_tree_typical(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor,
                        cfg: TypicalAcceptance = TypicalAcceptance(), *, lengths: Optional[torch.Tensor] = None,
                        generator: Generators = None, validate: bool = True) -> TreeResult:
    """Typical acceptance down a batch of token trees (see the module docstring).

    tokens (B, N) long, -1 padded; parents (B, N) (-1 = child of the root); p (B, N+1, V) the warped
    target distributions (row 0 after the root, row 1+i after node i); lengths (B,) real nodes.
    A chain is the tree with parents [-1, 0, 1, ...]. Returns TreeResult as rejection.verify_tree.
    """
    if not isinstance(cfg, TypicalAcceptance):
        raise ValueError(f"cfg must be a TypicalAcceptance, got {type(cfg).__name__}")
    if not isinstance(p, torch.Tensor) or p.dim() != 3 or not p.is_floating_point():
        raise ValueError(f"p must be a float (B, N+1, V) tensor, got shape {tuple(getattr(p, 'shape', ()))}")
    V = p.shape[-1]
    tokens, parents = tokens.to(p.device), parents.to(p.device)
    lengths, valid = _draft_lengths(tokens, lengths, V, "tokens", validate)
    B, N = tokens.shape
    if tuple(p.shape[:2]) != (B, N + 1):
        raise ValueError(f"p must have shape ({B}, {N + 1}, V), got {tuple(p.shape)}")
    par, depth, D = _tree_structure(parents, valid, validate)
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    dev = p.device
    u = ragged_uniforms(lengths + 1, N + 1, generator, dev)  # (B, N+1), the last one per row is used
    rows = torch.arange(B, device=dev)  # (B,)
    thr = typical_threshold(p, cfg)  # (B, N+1)
    at_parent = par + 1  # (B, N) row of p that scores node i (its parent's)
    px = p[rows[:, None], at_parent, tokens.clamp(min=0)]  # (B, N) p(x_i) at node i's parent
    ok = valid & (px > thr.gather(1, at_parent))  # (B, N) the node's own test
    logp = torch.where(ok, torch.log(px.clamp(min=1e-30)), 0.0)  # (B, N)
    path_ok, path_logp, anc = ok, logp, par  # (B, N) each: every token from the root passes; its log p
    for _ in range(D):  # one level up per iteration
        up = anc >= 0  # (B, N)
        a = anc.clamp(min=0)
        path_ok = path_ok & (~up | ok.gather(1, a))
        path_logp = path_logp + torch.where(up, logp.gather(1, a), 0.0)
        anc = torch.where(up, par.gather(1, a), -1)
    # the longest passing path; among equally long, the most likely; then the smaller node index
    score = torch.where(path_ok, depth.double() * 1e6 + path_logp.double().clamp(min=-1e5), float("-inf"))  # (B, N)
    has = path_ok.any(1) if N else torch.zeros(B, dtype=torch.bool, device=dev)  # (B,)
    best = score.argmax(1) if N else torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    node = torch.where(has, best, -1)  # (B,)
    n_acc = torch.where(has, depth.gather(1, best[:, None]).squeeze(1) if N else best, 0)  # (B,)
    # the final token: p at the path's last node (the root if none), truncated to its typical tokens
    last_p = p[rows, node + 1]  # (B, V)
    typ = torch.where(last_p > typical_threshold(last_p, cfg)[:, None], last_p, 0.0)  # (B, V)
    typ = torch.where(typ.sum(1, keepdim=True) > 0, typ, last_p)  # (B, V) never empty (see docstring)
    last = sample_from_probs(typ / typ.sum(1, keepdim=True), u[rows, lengths])  # (B,)
    return _tree_output(_path_of(node, par, depth, D), tokens, n_acc, last)
