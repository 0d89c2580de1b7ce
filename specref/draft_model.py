"""An independent small LM as the proposer: vanilla speculative decoding.

Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023: a draft model M_q runs k autoregressive
steps, sampling x_i ~ q_i (kept for the rejection step) or taking argmax under greedy decoding
(q = None: a deterministic draft). The draft keeps its own static KV cache (kv_rollback.py): after
verification it rolls back to the accepted prefix, and the next step begins with a catch-up block
of the tokens it has not processed yet: the target's recovered/bonus token, plus the last draft
token when all k were accepted (the draft never fed its own k-th token).

`truncated_draft(model, num_layers)` builds the zero-training draft: the target's first L
decoder layers with its embeddings, final norm and LM head (weights shared, no copy). Untrained
it is accepted rarely (DESIGN.md: ~1% for 4 of 30 layers on the default model); train.py
distils it. Left out: draft-side tree search (that is EAGLE-2's), a draft with another tokenizer.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from .kv_rollback import SpecCache
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig, greedy_tokens, logits_to_probs, sample_rows
from .target import Target, TargetConfig


@dataclass(frozen=True)
class DraftModelConfig:
    """Settings of the draft-model proposer."""

    k: int = 4  # draft tokens per step (Leviathan et al.'s gamma)
    compile: bool = False  # run the draft forward under torch.compile
    greedy_draft: bool = False  # draft argmax tokens (q = None) even when the target samples

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")


class DraftModelProposer:
    """Proposer protocol implementation around an HF causal LM sharing the target's vocabulary."""

    def __init__(self, draft_model: torch.nn.Module, config: DraftModelConfig = DraftModelConfig(),
                 token_map: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None):
        """token_map (Vd,): a reduced draft vocabulary (EAGLE-3's trick): the draft's LM head scores
        Vd tokens and token_map[i] is the target id of draft token i; q is 0 outside it, which stays
        lossless (those tokens can still come from the residual). vocab_size: the target's V
        (required with token_map)."""
        self.config = config
        self.k = config.k
        self.lm = draft_model if isinstance(draft_model, Target) else Target(
            draft_model, TargetConfig(compile=config.compile), name="draft model")
        self.token_map = None
        self.vocab_size = self.lm.vocab_size
        if token_map is not None:
            token_map = torch.as_tensor(token_map, dtype=torch.long, device=self.lm.device)
            if token_map.dim() != 1 or token_map.numel() != self.lm.vocab_size:
                raise ValueError(f"token_map must have shape ({self.lm.vocab_size},) (the draft head's size), "
                                 f"got {tuple(token_map.shape)}")
            if vocab_size is None or int(token_map.max()) >= vocab_size or int(token_map.min()) < 0:
                raise ValueError(f"with token_map, vocab_size (the target's V) is required and must exceed "
                                 f"every mapped id; got vocab_size={vocab_size}")
            if torch.unique(token_map).numel() != token_map.numel():
                raise ValueError("token_map must not map two draft tokens to one target id")
            self.token_map = token_map
            self.vocab_size = int(vocab_size)
        self.cache: Optional[SpecCache] = None
        self.done = None  # (B,) context tokens whose K/V the draft cache holds
        self.ctx_len = None  # (B,) context length at the last propose

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, T = ctx.tokens.shape
        # 2T: a row left out of some steps (hybrid.py) catches up later in one block, and a block is
        # written at every row's next slots, also those of rows already caught up
        self.cache = self.lm.new_cache(B, 2 * T + self.k + 2)
        P = int(ctx.lengths.max()) - 1
        self.lm.prefill(self.cache, ctx.tokens[:, :P], ctx.lengths - 1, logits=False)
        self.done = ctx.lengths - 1  # (B,)

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if self.cache is None:
            raise ValueError("DraftModelProposer.propose() called before begin()")
        B, k = ctx.tokens.shape[0], self.k
        dev = ctx.tokens.device
        # catch-up block: context tokens the draft has not processed (1, or 2 after a full accept)
        todo = (ctx.lengths - self.done) * ctx.active  # (B,)
        W = max(int(todo.max()), 1)
        j = torch.arange(W, device=dev)  # (W,)
        idx = (self.done.view(B, 1) + j).clamp(max=ctx.tokens.shape[1] - 1)  # (B, W)
        block = ctx.tokens.gather(1, idx)  # (B, W)
        logits = self.lm.verify_chain(self.cache, block, pad_to=2).logits  # (B, W, V)
        self.cache.commit(todo)
        last = logits[torch.arange(B, device=dev), (todo - 1).clamp(min=0)]  # (B, V)
        tokens, qs = [], []
        for i in range(k):
            if sampling.greedy or self.config.greedy_draft:
                x = greedy_tokens(last)  # (B,) draft-vocab ids
            else:
                q_i = logits_to_probs(last, sampling)  # (B, Vd)
                x = sample_rows(q_i, generator, ctx.active)  # (B,) rows left out draw nothing
                qs.append(q_i if self.token_map is None else
                          to_target_vocab(q_i, self.token_map, self.vocab_size))  # (B, V)
            if self.token_map is not None:
                x = self.token_map[x]  # (B,) target ids: the next input is a target id
            tokens.append(x)
            if i + 1 < k:  # feed x_i to get q_{i+1}; the k-th token is never fed this step
                last = self.lm.verify_chain(self.cache, x.view(B, 1)).logits[:, 0]  # (B, V)
                self.cache.commit(ctx.active.long())
        self.ctx_len = ctx.lengths.clone()
        self.done = torch.where(ctx.active, ctx.lengths + (k - 1), self.done)  # (B,) inactive rows: as was
        toks = torch.stack(tokens, dim=1)  # (B, k)
        lengths = torch.full((B,), k, dtype=torch.long, device=dev) * ctx.active  # (B,)
        toks = torch.where(lengths.view(B, 1) > 0, toks, torch.full_like(toks, -1))  # (B, k)
        q = torch.stack(qs, dim=1) if qs else None  # (B, k, V)
        return Draft(tokens=toks, lengths=lengths, q=q)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        if self.ctx_len is None:  # no draft since the last update (a step hybrid.py gave prompt lookup)
            return
        # valid draft K/V: the old context plus the accepted drafts it fed (at most k-1)
        keep = torch.minimum(self.done, self.ctx_len + num_accepted.to(self.done))  # (B,)
        keep = torch.minimum(keep, self.cache.lengths)
        self.cache.rollback_to(keep)
        self.done = keep
        self.ctx_len = None


def to_target_vocab(q: torch.Tensor, token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, Vd) draft-vocabulary probabilities -> (B, V) over target ids (token_map (Vd,)), zero
    outside the draft vocabulary (a reduced draft vocabulary stays lossless: q = 0 there)."""
    full = q.new_zeros(q.shape[0], vocab_size)  # (B, V)
    return full.scatter_(1, token_map.expand(q.shape[0], -1), q)


def truncated_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target's first `num_layers` decoder layers + its final norm and LM head, weights shared.

    Works for models that keep their decoder layers in `model.model.layers` (the Llama family).
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} keeps no `model.layers`; cannot truncate it")
    if not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers!r}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    draft = copy.copy(model)  # shallow: shares every parameter with the target
    draft._modules = dict(model._modules)  # own module dicts, so the target stays untouched
    sub = copy.copy(inner)
    sub._modules = dict(inner._modules)
    sub.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    sub.config = cfg
    draft.model = sub
    draft.config = cfg
    return draft
