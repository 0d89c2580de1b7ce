"""Step 2 of the data path, scoring: one teacher-forced target forward -> features and p.

EAGLE (Li et al. 2024, Sec. 4) trains on the target's features; Medusa-2 and DistillSpec distil q
towards the target's p(. | x_{<=t}). Both come from ONE frozen forward over x_{1..L}: the decoder
runs once over the whole batch, and the LM head (V columns, the largest matrix of a small model)
runs only where a label is kept, positions prompt_len-1 .. L-2, in chunks of `head_chunk` rows, so
memory is (B, T, D) for the trunk plus (head_chunk, V) for the head, never (B, T, V).

    score         the store's labels and features (build.py), and the top-k of the target's own
                  answers when data.distill keeps them
    teacher_topk  p's top-k at EVERY position of a right-padded Batch through the full forward (the
                  on-the-fly teacher of DraftDistillTask; the reference the tests check score against)
    pack          sequences sorted by length and cut into batches of <= batch_tokens (B * T)

Imports nothing from training, so every stage can use it.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

Layer = Union[str, int]  # "final": the normed state the LM head reads; int i: hidden_states[i]
TOPK = 32  # target top-k log-probs kept per labelled position (the store and self-distillation)


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


@torch.no_grad()
def teacher_topk(target: torch.nn.Module, batch, k: int, max_logits: int = 1 << 27):
    """The frozen target's top-k log-probs at every position of a right-padded batch (batches.Batch).

    The rows run in chunks whose (rows, T, V) logits hold at most `max_logits` values: a full batch
    of long prompts (64 x 1,500 positions x 49,152 words) would otherwise hold ~19 GB of fp32
    logits, twice. Rows are independent, so chunking changes nothing but the memory.

    Returns (ids (B, T, k) long, logprobs (B, T, k) float32)."""
    B, T = batch.tokens.shape
    emb = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    V = None if emb is None else emb.weight.shape[0]
    rows = B if V is None else max(1, max_logits // max(1, T * V))
    ids, vals = [], []
    for r0 in range(0, B, rows):
        out = target(input_ids=batch.tokens[r0:r0 + rows], attention_mask=batch.attention[r0:r0 + rows].long())
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # (rows, T, V)
        v, i = logp.topk(k, dim=-1)  # (rows, T, k)
        ids.append(i)
        vals.append(v)
        del out, logp
    return torch.cat(ids), torch.cat(vals)


def pack(lengths: Sequence[int], batch_tokens: int) -> List[List[int]]:
    """Indices sorted by length (longest first), cut into batches with B * max(L) <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])
