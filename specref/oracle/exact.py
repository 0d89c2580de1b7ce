"""Exact sequence distributions of a causal LM, by enumeration: the oracle's ground truth.

The joint probability of the next L tokens is the product of the target's conditionals
p(x_1..x_L | prompt) = prod_i p(x_i | prompt, x_<i) (the chain rule), each conditional warped by the
same SamplingConfig as generation uses. Enumerating all V^L continuations is feasible for the small
vocabularies of test models (V = 16, L = 3: 4096 sequences, 273 distinct prefixes to score).
Sampling from this distribution directly is what every lossless method must reproduce.
"""
from __future__ import annotations

import itertools

import torch

from ..sampling import SamplingConfig, logits_to_probs


@torch.no_grad()
def hf_joint_distribution(model: torch.nn.Module, prompt: torch.Tensor, L: int,
                          sampling: SamplingConfig, *, batch: int = 4096, processor=None) -> torch.Tensor:
    """Exact joint distribution of the next L tokens after `prompt` (T,), as a flat (V**L,) float64
    tensor indexed by x_1 * V^(L-1) + ... + x_L (see oracle.joint_index).

    processor: a transformers-style logits processor, (input_ids (b, T+d), scores (b, V)) -> scores,
    applied along each path (prompt + x_<i) before the warping (e.g. RepetitionPenaltyLogitsProcessor)."""
    if L < 1:
        raise ValueError(f"L must be >= 1, got {L}")
    V = int(model.get_output_embeddings().weight.shape[0])
    if V ** L > 2_000_000:
        raise ValueError(f"V**L = {V ** L} sequences is too many to enumerate; use a smaller vocab or L")
    dev = next(model.parameters()).device
    prompt = prompt.to(dev).view(1, -1)
    joint = torch.ones(1, dtype=torch.float64, device=dev)  # (V^0,)
    for depth in range(L):
        prefixes = torch.tensor(list(itertools.product(range(V), repeat=depth)), dtype=torch.long,
                                device=dev).view(V ** depth, depth)  # (V^d, d)
        conds = []
        for s in range(0, prefixes.shape[0], batch):
            chunk = prefixes[s: s + batch]  # (b, d)
            seq = torch.cat([prompt.expand(chunk.shape[0], -1), chunk], dim=1)  # (b, T+d)
            logits = model(input_ids=seq).logits[:, -1].float()  # (b, V)
            if processor is not None:
                logits = processor(seq, logits.clone())  # (b, V) on each path's own context
            conds.append(next_token_probs(logits, sampling))  # (b, V)
        cond = torch.cat(conds).double()  # (V^d, V)
        joint = (joint.view(-1, 1) * cond).reshape(-1)  # (V^(d+1),)
    return joint.cpu()


def next_token_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution generation samples from: warped softmax, or one-hot argmax when greedy."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()  # (b, V)
    return logits_to_probs(logits, sampling)  # (b, V)
