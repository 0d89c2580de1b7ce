"""Warm starts: new proposer weights that start as weights already trained, so training continues.

Each function returns heads whose outputs equal the ones they start from until training moves the
new parameters (an identity block, zero columns, a copied layer):
- `untie_lm_heads`: every Medusa head gets a trainable copy of the shared LM head (Medusa-1's own
  LM heads, Cai et al. 2024).
- `deepen`: zero-initialised ResBlocks appended to every Medusa head.
- `hydra_from_medusa`: Hydra's sequential heads (Ankner et al. 2024) from Medusa heads, each input
  projection [I | 0].
- `hydra_on_eagle`: Hydra heads with an EAGLE-1 head as their prefix layer; head 1 is the EAGLE
  head's first draft, head k + 1 the given Hydra head k one position on.
- `mtp_from_eagle`: DeepSeek-V3's MTP modules that start as a one-layer EAGLE-1 head.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..eagle_head import EagleHead
from ..medusa_heads import MedusaHeads, ResBlock
from ..mtp import MTPStack

__all__ = ["deepen", "hydra_from_medusa", "hydra_on_eagle", "mtp_from_eagle", "untie_lm_heads"]


def untie_lm_heads(heads: MedusaHeads) -> MedusaHeads:
    """Give every one of `heads` (in place) a trainable copy of the shared LM head (Medusa-1's own LM heads): the same
    logits until training moves the copies."""
    if heads.own_lm_head:
        raise ValueError("the heads already have their own LM heads")
    rows = heads.lm_heads[0].weight.detach()  # (Vd, D)
    Vd, D = rows.shape
    heads.lm_heads = torch.nn.ModuleList(
        torch.nn.Linear(D, Vd, bias=False) for _ in range(heads.num_heads)).to(rows.device, rows.dtype)
    with torch.no_grad():
        for lm in heads.lm_heads:
            lm.weight.copy_(rows)
    heads.own_lm_head = True
    return heads


def deepen(heads: MedusaHeads, num_layers: int) -> MedusaHeads:
    """Append (in place) zero-initialised ResBlocks (the identity) to every one of `heads` up to num_layers: deeper
    heads whose logits are these heads' until training moves the new blocks."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < heads.num_layers:
        raise ValueError(f"num_layers must be an int >= the heads' {heads.num_layers}, got {num_layers!r}")
    w = heads.lm_heads[0].weight
    for seq in heads.blocks:
        for _ in range(num_layers - heads.num_layers):
            seq.append(ResBlock(heads.hidden_size).to(w.device, w.dtype))
    heads.num_layers = num_layers
    return heads


@torch.no_grad()
def hydra_from_medusa(target: torch.nn.Module, heads: MedusaHeads, num_heads: Optional[int] = None) -> MedusaHeads:
    """Hydra heads (sequential) that start as the first `num_heads` of Medusa `heads`: the same
    ResBlocks, LM head and draft vocabulary, each input projection [I | 0]; their logits equal the
    Medusa heads' until training moves W_in."""
    if not isinstance(heads, MedusaHeads) or heads.sequential:
        raise ValueError("hydra_from_medusa needs Medusa (not already sequential) MedusaHeads")
    n = heads.num_heads if num_heads is None else num_heads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= heads.num_heads:
        raise ValueError(f"num_heads must be an int in [1, {heads.num_heads}], got {num_heads!r}")
    out = MedusaHeads(target, n, heads.token_map, num_layers=heads.num_layers, own_lm_head=heads.own_lm_head,
                      sequential=True)
    for k in range(n):
        out.blocks[k].load_state_dict(heads.blocks[k].state_dict())
    for k in range(len(out.lm_heads)):
        out.lm_heads[k].weight.copy_(heads.lm_heads[k].weight)
    return out.eval()


@torch.no_grad()
def hydra_on_eagle(target: torch.nn.Module, hydra: MedusaHeads, eagle: EagleHead,
                   num_heads: Optional[int] = None) -> MedusaHeads:
    """Hydra heads with an "eagle" prefix (a copy of `eagle`, an EAGLE-1 head) that start from it and
    from trained Hydra heads `hydra`: head 1 the identity (W_in [I | 0], zero ResBlocks), so its
    logits are the EAGLE head's first draft, LMHead(f^_{t+1}); head k >= 2 is hydra's head k - 1 one
    position on: it reads f^_{t+1} where that head read h_t and x_{t+2} .. x_{t+k} where it read
    x_{t+1} .. x_{t+k-1} (x_{t+1}'s columns zero). The draft vocabulary is the EAGLE head's (the LM
    head rows are the target's). num_heads: 1 .. hydra.num_heads + 1 (default hydra.num_heads)."""
    if not isinstance(hydra, MedusaHeads) or not hydra.sequential or hydra.own_lm_head or hydra.prefix is not None:
        raise ValueError("hydra_on_eagle needs sequential MedusaHeads (Hydra) that share the target's LM head and "
                         "have no prefix of their own (hydra_from_medusa makes Hydra heads from Medusa heads)")
    n = hydra.num_heads if num_heads is None else num_heads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= hydra.num_heads + 1:
        raise ValueError(f"num_heads must be an int in [1, {hydra.num_heads + 1}], got {num_heads!r}")
    out = MedusaHeads(target, n, eagle.token_map, num_layers=hydra.num_layers, sequential=True)
    out.add_prefix(target, "eagle", eagle)
    D = out.hidden_size
    for k in range(2, n + 1):
        src = hydra.inputs[k - 2].weight  # (D, k D): [h_t | e(x_{t+1}) .. e(x_{t+k-1})]
        w = torch.zeros_like(out.inputs[k - 1].weight)  # (D, (k + 1) D)
        w[:, :D], w[:, 2 * D:] = src[:, :D], src[:, D:]
        out.inputs[k - 1].weight.copy_(w)
        out.blocks[k - 1].load_state_dict(hydra.blocks[k - 2].state_dict())
    return out.eval()


def mtp_from_eagle(target: torch.nn.Module, head: torch.nn.Module, num_modules: int = 1) -> MTPStack:
    """MTP modules that start as a one-layer EAGLE-1 head (eagle_head.EagleHead, current_token or
    not) of `target`, its draft vocabulary kept. Module 1 and the head read the same inputs (the
    target's final normed state at i, the embedding of t_{i+1}, and, with current_token, of t_i) and
    predict the same token, so module 1 is the head: norms, projection, decoder layer and output norm
    copied; the head's FC bias is dropped (MTP's projection has none).
    Modules 2..D start as the head too, as EAGLE reuses it at every depth, with hnorm set to read
    module d-1's pre-norm output h as the head reads its own normed output f^ = norm(h):
    w_hnorm = w_norm_f * w_norm / rms(w_norm), exact when h's normalised entries are independent of
    w_norm. A warm start for training (`--init` with a head file), not DeepSeek-V3's."""
    if type(head) is not EagleHead:
        raise ValueError(f"head must be an EAGLE-1 EagleHead, got {type(head).__name__}")
    if head.num_layers != 1:
        raise ValueError(f"MTP modules hold one decoder layer; the head has {head.num_layers}")
    stack = MTPStack(target, head.token_map, num_modules=num_modules, current_token=head.current_token)
    if stack.hidden_size != head.hidden_size:
        raise ValueError(f"the head's width {head.hidden_size} is not the target's {stack.hidden_size}")
    w = head.norm.weight.detach()  # (D,)
    with torch.no_grad():
        for d, m in enumerate(stack.layers):
            m.enorm.weight.copy_(head.norm_e.weight)
            m.hnorm.weight.copy_(head.norm_f.weight if d == 0 else head.norm_f.weight * w / w.pow(2).mean().sqrt())
            if head.current_token:
                m.cnorm.weight.copy_(head.norm_c.weight)
            m.eh_proj.weight.copy_(head.fc.weight)
            m.block.load_state_dict(head.layer.state_dict())
            m.norm.weight.copy_(w)
    return stack.eval()
