"""The teacher's labels: one teacher-forced target forward -> features and p at labelled positions.

EAGLE (Li et al. 2024, Sec. 4) trains on the target's features; Medusa-2 and DistillSpec distil q
towards the target's p(. | x_{<=t}). Both come from ONE frozen forward over x_{1..L}: the decoder
runs once over the whole batch, and the LM head (V columns, the largest matrix of a small model)
runs only where a label is kept, positions prompt_len-1 .. L-2, in chunks of `head_chunk` rows, so
memory is (B, T, D) for the trunk plus (head_chunk, V) for the head, never (B, T, V).

Used by the feature store (store.py: features + top-k) and by self-distillation (data.py: top-k
of the target's own answers, no features). Imports nothing from training, so both can use it.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

Layer = Union[str, int]  # "final": the normed state the LM head reads; int i: hidden_states[i]


@torch.no_grad()
def score(target: torch.nn.Module, rows: Sequence[Tuple[List[int], int]], layers: Sequence[Layer], topk: int,
          head_chunk: int = 512, causal: bool = True) -> List[dict]:
    """One teacher-forced forward over right-padded rows (ids, prompt_len): per row the features of
    each layer (L, D) and the target's top-k at labelled positions (L - prompt_len, K).
    causal: the target is a decoder-only LM (pads at the right need no attention mask)."""
    dev = next(target.parameters()).device
    lens = [len(r) for r, _ in rows]
    B, T = len(rows), max(lens)
    tok = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    att = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    lab = torch.zeros(B, T, dtype=torch.bool)  # (B, T) positions whose p labels the next token
    for b, ((ids, p), L) in enumerate(zip(rows, lens)):
        tok[b, :L], att[b, :L] = torch.as_tensor(ids), 1
        lab[b, p - 1: L - 1] = True
    tok, att, lab = tok.to(dev), att.to(dev), lab.to(dev)
    hidden = any(x != "final" for x in layers)
    # right padding + causal attention: no real position sees a pad, so no mask is needed (the
    # causal kernel, exact); `att` is passed only for models that are not causal-only (None here)
    out = target.model(input_ids=tok, attention_mask=None if causal else att, output_hidden_states=hidden)
    h = out.last_hidden_state  # (B, T, D)
    feats = {x: (h if x == "final" else out.hidden_states[x]) for x in layers}  # each (B, T, D)
    hl = h[lab]  # (N, D) labelled positions, row-major: row b's are contiguous
    lm = target.get_output_embeddings()
    ids, vals = [], []
    for c in range(0, hl.shape[0], head_chunk):  # the LM head only where a label is kept
        z = lm(hl[c: c + head_chunk]).float()  # (n, V) logits
        v, i = z.topk(topk, dim=-1)  # (n, K)
        ids.append(i)
        vals.append(v - z.logsumexp(-1, keepdim=True))  # (n, K) log p = z - log sum exp z
    ids, vals = torch.cat(ids).cpu(), torch.cat(vals).cpu()  # (N, K)
    res, r = [], 0
    for b, ((_, p), L) in enumerate(zip(rows, lens)):
        R = L - p
        res.append({"features": {x: f[b, :L].to(torch.float16).cpu() for x, f in feats.items()},  # (L, D)
                    "topk_ids": ids[r: r + R], "topk_logprobs": vals[r: r + R]})  # (R, K)
        r += R
    return res
