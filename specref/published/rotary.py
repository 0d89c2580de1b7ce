"""The rotary position embedding of a published EAGLE head, as its authors' inference applies it.

SafeAILab/EAGLE's draft layers (`eagle/model/cnets1.py` for EAGLE-1/2, `cnets.py` for EAGLE-3) build
their rotary embedding from the HEAD's config.json, not the target's (Su et al. 2021, RoFormer):

    inv_freq_i = base^(-2i / d)  (i < d/2, d the head dimension hidden_size / num_attention_heads)
    angle(t, i) = t' inv_freq_i,  cos/sin over [angle; angle]  (the rotate-half layout)

- no `rope_scaling`: base = config `rope_theta`, 10000 where the config states none; t' = t;
- `rope_scaling` {"type": "linear", "factor": s}: t' = t / s, base 10000 (the authors' linear class
  is built without rope_theta);
- {"type": "dynamic", "factor": s} (dynamic NTK): base 10000, and once the sequence is longer than
  `max_position_embeddings` (M, default 2048), base' = base (s L / M - (s - 1))^(d / (d - 2)) with L
  its length. The authors' L is their draft KV cache's length, which also counts the tree nodes
  drafted so far; here L = 1 + the largest position in the call, equal to theirs for every chain
  step and for any sequence of at most M tokens (a tree's first levels past M can differ).
- any other type (e.g. "llama3", "yarn") is refused, as the authors' config class refuses it.
A target whose own RoPE differs (Llama-3's theta 5e5, llama3 scaling) leaves the head's unchanged:
running the head with the target's rotary drafts what no published head was trained on.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rope_settings(cfg: dict, path, head_dim: int) -> Tuple[float, Optional[str], float, int]:
    """(base, scaling type or None, factor, max_position_embeddings) of a head's config dict, as the
    authors' code reads it; ValueError for a scaling it does not know."""
    scaling = cfg.get("rope_scaling")
    M = int(cfg.get("max_position_embeddings", 2048))
    if scaling is None:
        return float(cfg.get("rope_theta", 10000.0)), None, 1.0, M
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if kind not in ("linear", "dynamic") or not isinstance(factor, (int, float)) or factor <= 1:
        raise ValueError(f"{path}: rope_scaling {scaling!r} is not one the EAGLE authors' code applies "
                         "(type 'linear' or 'dynamic' with a factor > 1; their config class refuses others)")
    if head_dim % 2 or head_dim < 4:
        raise ValueError(f"{path}: head dimension {head_dim} cannot carry rotary embeddings")
    return 10000.0, kind, float(factor), M


class HeadRotary(torch.nn.Module):
    """RoPE with a published head's own settings; forward(x, position_ids) -> (cos, sin), each
    (B, Q, d) in x's dtype, the convention of transformers' rotary modules."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: Optional[str] = None, factor: float = 1.0,
                 max_positions: int = 2048):
        super().__init__()
        self.head_dim, self.base, self.scaling = int(head_dim), float(base), scaling
        self.factor, self.max_positions = float(factor), int(max_positions)
        self.register_buffer("inv_freq", self._inv_freq(self.base), persistent=False)  # (d/2,)

    def _inv_freq(self, base: float) -> torch.Tensor:
        d = self.head_dim
        return 1.0 / (base ** (torch.arange(0, d, 2).float() / d))  # (d/2,)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        t = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)  # (B, Q)
        inv_freq = self.inv_freq
        if self.scaling == "linear":
            t = t / self.factor
        elif self.scaling == "dynamic":
            L = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if L > self.max_positions:
                d = self.head_dim
                base = self.base * ((self.factor * L / self.max_positions) - (self.factor - 1)) ** (d / (d - 2))
                inv_freq = self._inv_freq(base).to(self.inv_freq.device)
        freqs = t[..., None] * inv_freq  # (B, Q, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, Q, d)
        return emb.cos().to(device=x.device, dtype=x.dtype), emb.sin().to(device=x.device, dtype=x.dtype)
