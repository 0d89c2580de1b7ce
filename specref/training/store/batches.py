"""Step 4 of the data path, what the trainer reads: scored sequences and right-padded batches.

A `Seq` is one sequence of the store (or of a distilled folder, or built in memory by a test):
prompt + answer tokens, the target's top-k at every labelled position (the label is p, never the
next token), and optionally the target's features. `collate` right-pads a list of them into a
`Batch` whose position t is trained to predict token t + 1; loop.fit calls it on each step's
sequences, read from the store in memory or on demand (files.StreamedStore).
Imports nothing from training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class Seq:
    """One scored sequence: prompt + response tokens, the target's top-k at response slots."""

    tokens: torch.Tensor  # (L,) long
    prompt_len: int  # the response is tokens[prompt_len:]
    topk_ids: Optional[torch.Tensor] = None  # (L - prompt_len, K) long
    topk_logprobs: Optional[torch.Tensor] = None  # (L - prompt_len, K) float
    features: Optional[torch.Tensor] = None  # (L, D) target features (EAGLE), attached in memory


@dataclass
class Batch:
    """Right-padded training batch; position t is trained to predict tokens[:, t + 1]."""

    tokens: torch.Tensor  # (B, T) long, 0-padded
    attention: torch.Tensor  # (B, T) bool, real tokens
    loss_mask: torch.Tensor  # (B, T) bool, positions whose next token is a response token
    topk_ids: Optional[torch.Tensor] = None  # (B, T, K) long, target top-k at loss positions
    topk_logprobs: Optional[torch.Tensor] = None  # (B, T, K) float, -inf outside loss positions
    features: Optional[torch.Tensor] = None  # (B, T, D) target features, 0-padded, or None

    def to(self, device) -> "Batch":
        f = (lambda x: None if x is None else x.to(device))
        return Batch(f(self.tokens), f(self.attention), f(self.loss_mask), f(self.topk_ids),
                     f(self.topk_logprobs), f(self.features))


def collate(seqs: Sequence[Seq], max_len: Optional[int] = None) -> Batch:
    """Right-pad sequences into a Batch (truncated to max_len tokens when given)."""
    lens = [min(len(s.tokens), max_len or len(s.tokens)) for s in seqs]
    B, T = len(seqs), max(lens)
    tokens = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    attention = torch.zeros((B, T), dtype=torch.bool)  # (B, T)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)  # (B, T)
    have_topk = all(s.topk_ids is not None for s in seqs)
    K = seqs[0].topk_ids.shape[1] if have_topk else 0
    ids = torch.zeros((B, T, K), dtype=torch.long)  # (B, T, K)
    logp = torch.full((B, T, K), float("-inf"))  # (B, T, K)
    for b, (s, L) in enumerate(zip(seqs, lens)):
        tokens[b, :L] = s.tokens[:L]
        attention[b, :L] = True
        P = s.prompt_len
        loss_mask[b, P - 1: L - 1] = True  # position t predicts token t + 1 in the response
        if have_topk and L > P:
            ids[b, P - 1: L - 1] = s.topk_ids[: L - P]
            logp[b, P - 1: L - 1] = s.topk_logprobs[: L - P].float()
    feats = None
    if all(s.features is not None for s in seqs):
        feats = seqs[0].features.new_zeros(B, T, seqs[0].features.shape[-1])  # (B, T, D)
        for b, (s, L) in enumerate(zip(seqs, lens)):
            feats[b, :L] = s.features[:L]
    if not have_topk:
        return Batch(tokens, attention, loss_mask, features=feats)
    return Batch(tokens, attention, loss_mask, ids, logp, feats)
