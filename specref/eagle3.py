"""EAGLE-3: the head reads fused low, middle and high target features, and has its own LM head
(Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

EAGLE-3 (Sec. 3) drops EAGLE-1's feature prediction. The head's input at position t is no longer
the target's top-layer feature alone but the fusion of three of its layers,

    g_t = FC([l_t; m_t; h_t])  (3D -> D; here after layers 2, L/2 and L-3 by default)

paired with the next token as in EAGLE-1 (eagle_head.py: [Norm(e(x_{t+1})); Norm(g_t)] -> FC ->
one decoder layer -> norm). The head's output a_{t+1} is not regressed onto any target feature;
it only has to predict the token (its own LM head, trained, over the reduced draft vocabulary of the
most frequent target tokens: `token_map` maps draft ids back to target ids, q is 0 outside, so
speculative sampling stays lossless). When drafting, a_{t+1} takes g's place as the next step's
input feature; what makes that work is the training-time test (Sec. 3.2; training/eagle3.py):
training unrolls the head on its own outputs for several steps, with the attention pattern
drafting has, so the head learns on the inputs it will see.

Drafting is EAGLE-1's: the chain (eagle_head.EagleProposer) and EAGLE-2's dynamic tree
(eagle_tree.Eagle2Proposer) take an Eagle3Head as they take an EagleHead; the proposer asks the
target for the head's `hidden_layers` and stores the fused g_t (`embed_features`).
Left out: the paper's larger heads for larger targets (one decoder layer here, as EAGLE-1's).
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from .eagle_head import EagleHead
from .weights import FOLDER, load_tensors, load_token_map, save_trained, warn_if_other_target, weights_info

FORMAT = "specref-eagle-3"
WEIGHTS = FOLDER / "smollm2_135m_eagle3.safetensors.xz"


def default_layers(num_layers: int) -> tuple:
    """hidden_states indices after layers 2, L/2 and L-3 (the paper's low, middle and high), kept
    distinct and inside 1..L for small models."""
    L = int(num_layers)
    picks = [min(2, L), max(L // 2, 1), max(L - 3, 1)]
    out = sorted(set(picks))
    while len(out) < 3 and len(out) < L:  # tiny models: fill with the remaining layers
        out = sorted(set(out) | {next(i for i in range(1, L + 1) if i not in out)})
    return tuple(out)


class Eagle3Head(EagleHead):
    """EagleHead with the fused input g_t = FC(3D -> D) over `layers` (hidden_states indices:
    0 = embeddings, i = after decoder layer i) and a trainable LM head (initialised from the
    target's rows of the draft vocabulary)."""

    def __init__(self, target: torch.nn.Module, token_map: torch.Tensor, layers: Optional[Sequence[int]] = None,
                 seed: int = 0):
        super().__init__(target, token_map, seed=seed)
        L = int(target.config.num_hidden_layers)
        layers = default_layers(L) if layers is None else tuple(layers)
        if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= L for i in layers):
            raise ValueError(f"layers must be hidden_states indices in 0..{L} (0 = embeddings), got {layers!r}")
        self.layers = layers
        D = self.hidden_size
        p = self.fc.weight
        self.fuse = torch.nn.Linear(len(layers) * D, D, bias=False)
        g, bound = torch.Generator().manual_seed(seed + 1), (len(layers) * D) ** -0.5
        with torch.no_grad():
            self.fuse.weight.uniform_(-bound, bound, generator=g)
        self.fuse.to(device=p.device, dtype=p.dtype)
        self.lm_head.weight.requires_grad_(True)  # EAGLE-3: the head's own LM head

    @property
    def hidden_layers(self) -> tuple:  # what the proposer asks the target for
        return self.layers

    @property
    def feature_size(self) -> int:
        return len(self.layers) * self.hidden_size

    def embed_features(self, h: torch.Tensor) -> torch.Tensor:
        """[l; m; h] (..., 3D) -> g (..., D)."""
        return self.fuse(h.to(self.fuse.weight.dtype))


def save_eagle3(path, head: Eagle3Head, target_fingerprint: str, record: dict,
                dtype: torch.dtype = torch.float16) -> None:
    """The trained tensors (fuse, FC, layer, norms, LM head) + token_map + layers + a record."""
    save_trained(path, head, FORMAT, target_fingerprint, record, meta={"layers": json.dumps(list(head.layers))},
                 dtype=dtype)


def eagle3_info(path=WEIGHTS) -> dict:
    return weights_info(path, FORMAT, "EAGLE-3 head", "train one with `python -m specref train --method eagle3`")


def load_eagle3(target: torch.nn.Module, path=WEIGHTS) -> Eagle3Head:
    """An Eagle3Head for `target` with the weights of a file written by save_eagle3."""
    meta = eagle3_info(path)
    warn_if_other_target(path, meta, target)
    head = Eagle3Head(target, load_token_map(path), layers=json.loads(meta.get("layers", "null")))
    load_tensors(path, dict(head.trainable()), "EAGLE-3 head")
    return head.eval()
