"""Logits -> probabilities: temperature, top-k, top-p (nucleus); greedy as its own path.

Speculative sampling is lossless with respect to the distribution p the target is *sampled from*
(Leviathan et al. 2023, Sec. 2.3), so whatever warping is applied to the target's logits must be
applied the same way when computing p for verification; the draft may use any q, as long as q is
the distribution its tokens were actually drawn from. This module is the one place where logits
become p (and q): temperature (divide logits by T), top-k (keep the k largest logits), top-p (keep
the smallest set of most probable tokens whose mass reaches top_p; Holtzman et al. 2020), in that
order, as HF transformers applies them. Ties at the top-k boundary keep every tied token.

Greedy decoding (temperature 0) is not a tiny temperature: it is argmax, handled by
`SamplingConfig.greedy` and `greedy_tokens`. Inverse-CDF sampling from explicit uniforms
(`sample_from_probs`) keeps randomness explicit and per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

Generators = Union[None, torch.Generator, Sequence[torch.Generator]]


@dataclass(frozen=True)
class SamplingConfig:
    """How the target (and a sampled draft) turns logits into a distribution."""

    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = 0  # 0 = off; else keep the k most probable tokens
    top_p: float = 1.0  # 1.0 = off; else keep the smallest prefix of mass >= top_p
    processors: object = None  # processors.Processors that read the context (repetition penalty, ...),
    # applied to the logits BEFORE the warping above, each position on its own context; None = none

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
                and self.temperature == self.temperature and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig(temperature=0.0)


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Apply temperature, top-k and top-p; removed tokens get -inf. Works on (..., V)."""
    if cfg.greedy:
        raise ValueError("temperature 0 is greedy: use greedy_tokens(), not a distribution")
    x = logits.float()  # (..., V)
    x = (x - x.amax(-1, keepdim=True)) / cfg.temperature  # (..., V) the max at 0: no overflow at tiny T
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))  # (..., V)
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # (..., V)
        sorted_p = torch.softmax(sorted_x, dim=-1)  # (..., V)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # (..., V) mass strictly above
        drop_sorted = mass_before >= cfg.top_p  # (..., V); the most probable token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (..., V)
        x = x.masked_fill(drop, float("-inf"))  # (..., V)
    return x


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """p = softmax(warp(logits)) in float32. logits (..., V) -> probs (..., V)."""
    return torch.softmax(warp_logits(logits, cfg), dim=-1)  # (..., V)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary (the first index on ties, as torch.argmax). (..., V) -> (...)."""
    return torch.argmax(logits, dim=-1)


def as_generators(generator: Generators, batch: int) -> list:
    """Normalise `generator` to a list: [g] shared by the batch, or one per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return [generator]
    gens = list(generator)
    if len(gens) != batch:
        raise ValueError(f"got {len(gens)} generators for a batch of {batch}; pass one or one per row")
    return gens


def make_generators(seed: int, batch: int, device: Union[str, torch.device] = "cpu") -> list:
    """One torch.Generator per row, seeded seed, seed+1, ...: rows reproduce independently."""
    gens = []
    for b in range(batch):
        g = torch.Generator(device=device)
        g.manual_seed(int(seed) + b)
        gens.append(g)
    return gens


def uniforms(shape_per_row: Sequence[int], batch: int, generator: Generators,
             device: Union[str, torch.device]) -> torch.Tensor:
    """Uniform(0, 1) draws of shape (B, *shape_per_row). With one generator per row, row b's draws
    come from generator b alone, so a row never depends on the other rows."""
    gens = as_generators(generator, batch)
    if len(gens) == 1:
        g = gens[0]
        gdev = g.device if g is not None else torch.device(device)
        u = torch.rand((batch, *shape_per_row), generator=g, device=gdev)  # (B, ...)
        return u.to(device)
    if not gens:  # an empty batch with an empty list of generators
        return torch.empty((0, *shape_per_row), device=device)  # (0, ...)
    rows = [torch.rand(tuple(shape_per_row), generator=g, device=g.device) for g in gens]
    return torch.stack(rows).to(device)  # (B, ...)


def ragged_uniforms(counts: torch.Tensor, width: int, generator: Generators,
                    device: Union[str, torch.device], fixed: Optional[int] = None) -> torch.Tensor:
    """Uniform(0, 1) draws (B, width) where row b needs only its first counts[b] (<= width). With one
    generator per row, row b draws exactly counts[b] from generator b (the rest of the row is 0.5,
    never to be read), so how much a row consumes never depends on the other rows. With one shared
    generator the whole (B, width) block is drawn (rows are not independent then anyway).
    fixed: every row draws exactly `fixed` (>= width) from its generator instead, a constant of the
    caller (generate.py's loop: the proposer's k + 1), so rows stay independent and no count is read
    back from the device."""
    B = int(counts.shape[0])
    if not isinstance(generator, (list, tuple)):  # one shared generator (or torch's global one)
        return uniforms((width,), B, generator, device)
    gens = as_generators(generator, B)
    if not gens:
        return torch.empty((0, width), device=device)  # (0, width)
    if fixed is not None:
        if fixed < width:
            raise ValueError(f"fixed draws {fixed} < width {width}")
        return torch.stack([torch.rand(fixed, generator=g, device=g.device)[:width] for g in gens]).to(device)
    rows = []
    for b, g in enumerate(gens):
        n = int(counts[b])
        r = torch.rand(n, generator=g, device=g.device)  # (n,)
        rows.append(torch.cat([r, r.new_full((width - n,), 0.5)]))  # (width,)
    return torch.stack(rows).to(device)  # (B, width)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the smallest index whose cumulative mass exceeds u * total.

    probs (..., V) non-negative (need not be normalised); u (...) uniforms in [0, 1).
    Returns (...) long. Tokens with zero mass are never returned (given some positive mass).
    The cumulative sum is taken in float64: in float32 it drifts by a few per cent of one token's
    mass over a 50k-150k vocabulary, which shifts the sampled index for some u (a systematic bias).
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # (..., V)
    total = cdf[..., -1:]  # (..., 1)
    target = u.unsqueeze(-1).double() * total  # (..., 1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)  # (...)
    # u * total < total, so idx < V unless rounding; clamp, then step back over zero-mass tails.
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    last_pos = (probs > 0).float().flip(-1).argmax(-1)  # (...) distance of the last positive from the end
    last_pos = probs.shape[-1] - 1 - last_pos  # (...) index of the last positive-mass token
    return torch.minimum(idx, last_pos)


def sample(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """Draw one token per row from probs (B, V) with explicit generator(s). -> (B,)."""
    u = uniforms((), probs.shape[0], generator, probs.device)  # (B,)
    return sample_from_probs(probs, u)


def sample_rows(probs: torch.Tensor, generator: Generators, rows: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs (B, V), but only in `rows` (B,) bool (0 elsewhere): with one
    generator per row, a row that does not draft this position draws nothing (ragged_uniforms), so
    its stream never depends on the other rows' draft lengths or on a combined proposer leaving it
    out. -> (B,)"""
    u = ragged_uniforms(rows.long(), 1, generator, probs.device)[:, 0]  # (B,)
    return torch.where(rows, sample_from_probs(probs, u), 0)  # (B,)
