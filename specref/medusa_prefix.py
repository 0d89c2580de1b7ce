"""Prefix layers for Medusa / Hydra heads: one decoder layer over the target's states (Hydra++).

Hydra++ (Ankner et al. 2024, Sec. 4): a head reads one state h_t, the target's
summary of the prefix for predicting x_{t+1}; Hydra++ adds one decoder layer over the target's
states, attending over the whole prefix, whose output the heads read instead:

    h~_t = PrefixLayer(h_{<=t})       causal attention over the target's final states
    p_t^(k) = the head of above on h~_t

`prefix="layer"` is that decoder layer (a copy of the target's last); `prefix="attention"` (a
quarter of the parameters) keeps its attention block only: h~_t = h_t + Attn(Norm(h))_t.
Neither layer knows the pending token x_{t+1} when it attends, so neither can look for that token's
earlier occurrences and what followed them (copying from the prompt). `prefix="pairs"` (not in
the paper; EAGLE-1's input) runs the decoder layer over pairs, each state with the token after it:

    h~_t = PrefixLayer(W_p [h_j; e(x_{j+1})]  for j <= t)       W_p in R^{D x 2D}, starting as [I | 0]

(x_{j+1} for j <= t is committed: x_{t+1} is the pending token, already sampled). `prefix="eagle"`
(not in the paper) makes that layer EAGLE-1's head (eagle_head.py: input norms, FC, decoder layer,
output norm), so h~_t is its predicted feature f^_{t+1}, and `training.hydra_on_eagle` starts Hydra heads
on a trained EAGLE-1 head: head 1 the identity (its logits are the EAGLE head's first draft), head k+1
the given Hydra heads' head k one position on (f^_{t+1} in the place of h_{t+1}). The other kinds start as
the identity (W_p as [I | 0], the layer's attention output and MLP down projections zero), so heads
given a prefix (`add_prefix`) start as themselves. The layer reads only the target's states at
committed positions, never a draft, so its own KV cache grows by the tokens each verification commits and
never rolls back; its output is a function of the history, and the acceptance stays lossless.
Left out: Hydra++'s teacher-distillation objective (the labels already are the target's
own distribution).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from .eagle_head import EagleHead
from .kv_rollback import SpecCache
from .target import additive_mask, attending

class PrefixAttention(torch.nn.Module):
    """A decoder layer's attention block alone: h + Attn(Norm(h)), called as a decoder layer."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn

    def forward(self, h: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None) -> torch.Tensor:
        a, _ = self.self_attn(hidden_states=self.input_layernorm(h), attention_mask=attention_mask,
                              position_ids=position_ids, cache=cache, use_cache=use_cache,
                              position_embeddings=position_embeddings)
        return h + a  # (B, Q, D)


PREFIX_KINDS = ("attention", "layer", "pairs", "eagle")


def add_prefix(heads: torch.nn.Module, target: torch.nn.Module, kind: str = "layer",
               eagle: Optional[EagleHead] = None) -> torch.nn.Module:
    """Give `heads` (in place) a prefix layer (`kind` "layer", "attention", "pairs" or "eagle", the module
    docstring). The first three start as the identity: heads whose logits are these heads' until
    training moves it. "eagle" is a copy of `eagle` (an EAGLE-1 EagleHead of this target; None: a
    fresh one, its FC random)."""
    if kind not in PREFIX_KINDS:
        raise ValueError(f"prefix must be one of {PREFIX_KINDS}, got {kind!r}")
    if heads.prefix is not None:
        raise ValueError(f"the heads already have a prefix {heads.prefix_kind!r}")
    if eagle is not None and kind != "eagle":
        raise ValueError(f"an EAGLE head is the prefix of kind 'eagle' only, not {kind!r}")
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb"):
        raise ValueError(f"{type(target).__name__} is not a Llama-family causal LM (model.layers, "
                         "model.rotary_emb); a prefix layer copies its last decoder layer")
    w = heads.lm_heads[0].weight
    if kind == "eagle":
        if eagle is None:
            eagle = EagleHead(target, heads.token_map)
        if type(eagle) is not EagleHead or eagle.hidden_size != heads.hidden_size:
            raise ValueError(f"an 'eagle' prefix is an EAGLE-1 EagleHead of width {heads.hidden_size} (EAGLE-3's "
                             f"reads fused features the heads do not have), got {type(eagle).__name__}")
        shared = {id(m): m for m in eagle._shared}  # the target's embeddings: referenced, never copied
        heads.prefix = copy.deepcopy(eagle, shared).to(w.device, w.dtype).train(heads.training)
        heads.prefix_kind = "eagle"
        return heads
    layer = copy.deepcopy(layers[-1]).to(w.device, w.dtype)
    layer.self_attn.layer_idx = 0  # the prefix's own cache has one layer
    with torch.no_grad():  # the residual branches start at 0: the layer is the identity
        layer.self_attn.o_proj.weight.zero_()
        if getattr(layer.self_attn.o_proj, "bias", None) is not None:
            layer.self_attn.o_proj.bias.zero_()
        layer.mlp.down_proj.weight.zero_()
    heads.prefix = (PrefixAttention(layer) if kind == "attention" else layer).requires_grad_(True)
    if kind == "pairs":
        D = heads.hidden_size
        heads.prefix_in = torch.nn.Linear(2 * D, D, bias=False).to(w.device, w.dtype)
        with torch.no_grad():  # [I | 0]: the state alone at the start
            heads.prefix_in.weight.zero_()
            heads.prefix_in.weight[:, :D].copy_(torch.eye(D))
        heads._prefix_embed = (inner.embed_tokens,)  # not a submodule: the target's
    heads.prefix_kind = kind
    heads._rotary = (inner.rotary_emb,)  # not a submodule: the target's
    return heads


def prefix_step(heads: torch.nn.Module, cache: SpecCache, h: torch.Tensor, keep: torch.Tensor,
                 tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The prefix layer on states h (B, W, D) at each row's next cache slots (= their positions), the
    first keep (B,) of each row committed; tokens (B, T): the sequence whose x_{j+1} a "pairs" or
    "eagle" prefix reads beside state j, and x_j a current-token EAGLE head (None: token 0, for
    timing). -> h~ (B, W, D)"""
    slots = cache.begin_block(h.shape[1])  # (B, W)
    S = int(slots.max()) + 1
    allowed = torch.arange(S, device=slots.device).view(1, 1, S) <= slots.unsqueeze(-1)  # (B, W, S)
    nxt = (torch.zeros_like(slots) if tokens is None
           else tokens.gather(1, (slots + 1).clamp(max=tokens.shape[1] - 1)))  # (B, W) x_{j+1} of state j
    cur = (torch.zeros_like(slots) if tokens is None
           else tokens.gather(1, slots.clamp(max=tokens.shape[1] - 1)))  # (B, W) x_j
    with attending(cache, S):
        out = heads.contextualise(h, slots, additive_mask(allowed, h.dtype), cache=cache, next_tokens=nxt,
                                  cur_tokens=cur)
    cache.commit(keep.to(slots.device))
    return out
