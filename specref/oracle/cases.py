"""The oracle's standard test cases: fixed (p, q, length) variants of a chain rejection step.

A `Case` is one vocabulary size and draft width with a few `Variant`s (p per position, q per
position or None for a deterministic draft, the row's draft length); check.py interleaves the
variants in one batch and compares each one's output with its exact distribution. The standard
set covers small vocabularies (joint tests), ragged rows, q = None, temperature / top-k / top-p,
near-degenerate p and q, a larger vocabulary and a long draft.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class Variant:
    p: torch.Tensor  # (K+1, V) target probs; rows after length+1 are junk the sampler must ignore
    q: Optional[torch.Tensor]  # (K, V) draft probs (rows after length are junk), or None
    drafts: Optional[torch.Tensor]  # (K,) fixed draft tokens when q is None, else None
    length: int  # L, draft tokens of this row (0..K)
    label: str


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int  # V
    k: int  # K, the padded draft width
    variants: Tuple[Variant, ...]  # all with q, or all with q None



def _filtered(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k and the top-p nucleus, renormalised (rows)."""
    probs = torch.softmax(logits / temperature, -1)  # (R, V)
    srt, idx = probs.sort(-1, descending=True)  # (R, V)
    keep = torch.ones_like(srt, dtype=torch.bool)  # (R, V)
    if top_k:
        keep[:, top_k:] = False
    keep &= (srt.cumsum(-1) - srt) < top_p  # a token stays while the mass before it is < top_p
    probs = torch.zeros_like(probs).scatter(-1, idx, torch.where(keep, srt, 0.0))  # (R, V)
    return probs / probs.sum(-1, keepdim=True)


def standard_cases(seed: int = 0) -> Tuple[Case, ...]:
    """Small vocabularies (joint tests), ragged rows, q None, temperature/top-k/top-p, near-degenerate
    p and q, a larger vocabulary and a long draft."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    sm = lambda x: torch.softmax(x, -1)
    V = 6
    p_k = _filtered(rnd(4, V), top_k=3)  # (4, V) with zeros
    p_eq = sm(rnd(4, V))
    small = Case("small", V, 3, (
        Variant(sm(rnd(4, V)), sm(rnd(3, V)), None, 3, "dense L3"),
        Variant(sm(rnd(4, V)), sm(rnd(3, V)), None, 1, "ragged L1"),
        Variant(sm(rnd(4, V)), sm(rnd(3, V)), None, 0, "empty L0"),
        Variant(p_k, sm(rnd(3, V)), None, 3, "top-k p L3"),
        Variant(p_eq, torch.cat([p_eq[:2], sm(rnd(1, V))]), None, 2, "p==q L2"),
    ))
    p_a, p_z = sm(2 * rnd(4, V)), _filtered(rnd(4, V), top_k=4)
    z_tok = int(torch.nonzero(p_z[1] == 0)[0])  # a token with p = 0 at position 2
    qnone = Case("qnone", V, 3, (
        Variant(p_a, None, p_a[:3].argmax(-1), 3, "argmax drafts L3"),
        Variant(p_z, None, torch.tensor([int(p_z[0].argmax()), z_tok, 1]), 3, "p(x)=0 draft L3"),
        Variant(sm(rnd(4, V)), None, torch.tensor([2, 3, 0]), 2, "ragged L2"),
        Variant(sm(rnd(4, V)), None, torch.tensor([-1, -1, -1]), 0, "empty L0"),
    ))
    V = 40
    lg1, lg2 = rnd(5, V) * 2, rnd(5, V) * 2
    filtered = Case("filtered", V, 4, (
        Variant(_filtered(lg1, 0.7, top_k=8), _filtered(lg1[:4] + rnd(4, V) * 0.5, 1.3), None, 4, "T0.7 top-k8 vs T1.3 L4"),
        Variant(_filtered(lg2, top_p=0.8), _filtered(lg2[:4] + rnd(4, V) * 0.5, top_p=0.95), None, 2, "top-p0.8 vs top-p0.95 L2"),
    ))
    V = 5
    near = torch.tensor([0.998, 0.0005, 0.0005, 0.0005, 0.0005]).expand(3, V)  # (3, V)
    qsmall = torch.tensor([0.001, 0.4, 0.3, 0.2, 0.099]).expand(2, V)  # (2, V)
    onehot = torch.nn.functional.one_hot(torch.tensor([2, 2, 2]), V).float()  # (3, V)
    q4 = torch.tensor([0.001, 0.001, 0.001, 0.001, 0.996]).expand(2, V)  # (2, V)
    degenerate = Case("degenerate", V, 2, (
        Variant(near.clone(), qsmall.clone(), None, 2, "p~one-hot q small there"),
        Variant(onehot, sm(rnd(2, V)), None, 2, "p one-hot"),
        Variant(sm(rnd(3, V)), q4.clone(), None, 2, "q~one-hot"),
    ))
    V = 300
    lg = rnd(3, V) * 2
    big = Case("vocab300", V, 2, (
        Variant(sm(lg), sm(lg[:2] + rnd(2, V) * 0.7), None, 2, "L2"),
        Variant(sm(rnd(3, V)), sm(rnd(2, V)), None, 1, "L1"),
    ))
    V = 4
    long = Case("k5", V, 5, (
        Variant(sm(rnd(6, V)), sm(rnd(5, V)), None, 5, "L5"),
        Variant(sm(rnd(6, V)), sm(rnd(5, V)), None, 3, "L3"),
    ))
    return (small, qnone, filtered, degenerate, big, long)
