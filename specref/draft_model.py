"""An independent small LM as the proposer: vanilla speculative decoding.

Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023: a draft model M_q runs k autoregressive
steps, sampling x_i ~ q_i (kept for the rejection step) or taking argmax under greedy decoding
(q = None: a deterministic draft). The draft keeps its own static KV cache (kv_rollback.py): after
verification it rolls back to the accepted prefix, and the next step begins with a catch-up block
of the tokens it has not processed yet: the target's recovered/bonus token, plus the last draft
token when all k were accepted (the draft never fed its own k-th token).

`truncated_draft(model, num_layers)` builds the zero-training draft: the target's first L
decoder layers with its embeddings, final norm and LM head (weights shared, no copy). Untrained
it is accepted rarely (DESIGN.md: ~1% for 4 of 30 layers on the default model).
`build_draft` / `load_trained_draft` below give the trained reduced-vocabulary draft of the
default model (training/draft.py trains it). Left out: draft-side tree search (that is EAGLE-2's),
a draft with another tokenizer.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from .checks import normalise_ints
from .kv_rollback import SpecCache
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig, greedy_tokens, logits_to_probs, sample_rows
from .target import Target, TargetConfig
from .weights import FOLDER, load_tensors, load_token_map, save_weights, warn_if_other_target, weights_info


@dataclass(frozen=True)
class DraftModelConfig:
    """Settings of the draft-model proposer."""

    k: int = 4  # draft tokens per step (Leviathan et al.'s gamma)
    compile: bool = False  # run the draft forward under torch.compile
    greedy_draft: bool = False  # draft argmax tokens (q = None) even when the target samples

    def __post_init__(self) -> None:
        normalise_ints(self, "k")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")


class DraftModelProposer:
    """Proposer protocol implementation around an HF causal LM sharing the target's vocabulary."""

    def __init__(self, draft_model: torch.nn.Module, config: DraftModelConfig = DraftModelConfig(),
                 token_map: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None):
        """token_map (Vd,): a reduced draft vocabulary (EAGLE-3's trick): the draft's LM head scores
        Vd tokens and token_map[i] is the target id of draft token i; q is 0 outside it, which stays
        lossless (those tokens can still come from the residual). vocab_size: the target's V
        (required with token_map). Without token_map, a vocab_size other than the draft's head size
        declares a padded vocabulary of the same tokenizer (Qwen2.5-0.5B's 151,936 rows vs 7B's
        152,064: shared ids agree, the extra rows are padding): a larger draft head is scored on
        its first V rows only (q = 0 on its padding), a smaller one maps its ids to the same target
        ids (q = 0 on the target's extra rows); sizes that differ by more than max(V / 64, 256) are
        refused (another tokenizer)."""
        self.config = config
        self.k = config.k
        self.lm = draft_model if isinstance(draft_model, Target) else Target(
            draft_model, TargetConfig(compile=config.compile), name="draft model")
        self.token_map = None
        self.vocab_size = self.lm.vocab_size
        self.head_rows: Optional[int] = None  # a padded draft head: score only its first V rows
        emb = self.lm.model.get_input_embeddings()
        self.in_rows = int(emb.num_embeddings) if emb is not None else None  # ids the draft can read
        if token_map is None and vocab_size is not None and int(vocab_size) != self.lm.vocab_size:
            V, Vd = int(vocab_size), self.lm.vocab_size
            if abs(Vd - V) > max(V // 64, 256):
                raise ValueError(f"the draft's vocabulary ({Vd}) and the target's ({V}) differ by more than "
                                 "padding: the draft must use the target's tokenizer (or pass a token_map)")
            if Vd > V:
                self.head_rows, self.vocab_size = V, V
            else:
                token_map = torch.arange(Vd)  # draft id i is target id i
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
        self.variable_k = True  # batch_k.py may lower self.k for one propose() (it drafts k tokens then)
        self.done = None  # (B,) context tokens whose K/V the draft cache holds
        self.ctx_len = None  # (B,) context length at the last propose (= done after an update)

    def _readable(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids the draft's embedding can read: a draft with fewer rows (a padded vocabulary)
        sees the target's extra ids, which a shared tokenizer never produces, as its last row."""
        if self.in_rows is not None and self.in_rows < self.vocab_size:
            return tokens.clamp(max=self.in_rows - 1)
        return tokens

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, T = ctx.tokens.shape
        # 2T slots: a row outside ctx.active for some steps catches up later in one block, written
        # at every row's next slots; only that block's padding columns get positions past the context
        self.cache = self.lm.new_cache(B, 2 * T + self.k + 2)
        P = int(ctx.lengths.max()) - 1
        self.lm.prefill(self.cache, self._readable(ctx.tokens[:, :P]), ctx.lengths - 1, logits=False)
        self.done = ctx.lengths - 1  # (B,)
        self.ctx_len = self.done  # (B,) nothing speculative yet: an update() now keeps everything

    @torch.no_grad()
    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden=None) -> None:
        """Rows that took a new request (scheduler.py): each new prompt but its last token prefilled
        alone into the row's slots of the draft cache, as begin() does for a whole batch."""
        P = ctx.lengths[rows] - 1  # (R,) tokens to prefill per row
        Pm = int(P.max())
        tmp = self.lm.new_cache(rows.shape[0], max(Pm, 1))
        if Pm > 0:
            self.lm.prefill(tmp, self._readable(ctx.tokens[rows, :Pm]), P, logits=False)
        self.cache.write_rows(rows, tmp)
        self.done, self.ctx_len = self.done.clone(), self.ctx_len.clone()
        self.done[rows] = P
        self.ctx_len[rows] = P

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
        block = self._readable(ctx.tokens.gather(1, idx))  # (B, W)
        logits = self.lm.verify_chain(self.cache, block, pad_to=2).logits[..., :self.head_rows]  # (B, W, V)
        self.cache.commit(todo)
        last = logits[torch.arange(B, device=dev), (todo - 1).clamp(min=0)]  # (B, V)
        tokens, qs = [], []
        procs = sampling.processors if self.token_map is None else None  # (a reduced vocabulary: unprocessed q)
        if procs is not None:  # the target's processors on the draft's own side: q_i on context + x_<i
            ext = torch.cat([ctx.tokens, ctx.tokens.new_zeros(B, k)], dim=1)  # (B, T + k)
            base = ctx.prompt_lengths if ctx.prompt_lengths is not None else ctx.lengths
            new0 = ctx.lengths - base.to(ctx.lengths)  # (B,) generated tokens in the context
        for i in range(k):
            if procs is not None:
                last = procs(ext, ctx.lengths + i, new0 + i, last)  # (B, V) on the drafted prefix
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
            if procs is not None:
                ext.scatter_(1, (ctx.lengths + i).view(B, 1), x.view(B, 1))
            if i + 1 < k:  # feed x_i to get q_{i+1}; the k-th token is never fed this step
                last = self.lm.verify_chain(self.cache, x.view(B, 1)).logits[:, 0, :self.head_rows]  # (B, V)
                self.cache.commit(ctx.active.long())
        self.ctx_len = ctx.lengths.clone()
        self.done = torch.where(ctx.active, ctx.lengths + (k - 1), self.done)  # (B,) inactive rows: as was
        toks = torch.stack(tokens, dim=1)  # (B, k)
        lengths = torch.full((B,), k, dtype=torch.long, device=dev) * ctx.active  # (B,)
        toks = torch.where(lengths.view(B, 1) > 0, toks, torch.full_like(toks, -1))  # (B, k)
        q = torch.stack(qs, dim=1) if qs else None  # (B, k, V)
        return Draft(tokens=toks, lengths=lengths, q=q)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        # valid draft K/V: the old context plus the accepted drafts it fed (at most k-1); rows it
        # did not draft since the last update (done <= ctx_len) keep what they had
        keep = torch.minimum(self.done, self.ctx_len + num_accepted.to(self.done))  # (B,)
        keep = torch.minimum(keep, self.cache.lengths)
        self.cache.rollback_to(keep)
        self.done = self.ctx_len = keep


def to_target_vocab(q: torch.Tensor, token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, Vd) draft-vocabulary probabilities -> (B, V) over target ids (token_map (Vd,)), zero
    outside the draft vocabulary (a reduced draft vocabulary stays lossless: q = 0 there)."""
    full = q.new_zeros(q.shape[0], vocab_size)  # (B, V)
    return full.scatter_(1, token_map.expand(q.shape[0], -1), q)


def _first_layers(model: torch.nn.Module, num_layers: int):
    """(model.model, its decoder layers, a copy of the config cut to num_layers) of a Llama-family
    LM; ValueError if it keeps no `model.layers` or num_layers is out of range."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} keeps no `model.layers`; cannot build a draft from its layers")
    if not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers!r}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    return inner, layers, cfg


def truncated_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target's first `num_layers` decoder layers + its final norm and LM head, weights shared.

    Works for models that keep their decoder layers in `model.model.layers` (the Llama family).
    """
    inner, layers, cfg = _first_layers(model, num_layers)
    draft = copy.copy(model)  # shallow: shares every parameter with the target
    draft._modules = dict(model._modules)  # own module dicts, so the target stays untouched
    sub = copy.copy(inner)
    sub._modules = dict(inner._modules)
    sub.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    sub.config = cfg
    draft.model = sub
    draft.config = cfg
    return draft


# ----------------------------------------------------------------------------- the trained draft
# A draft for the default model trained by `python -m specref train` (training/draft.py): the
# target's frozen input embedding (storage shared), its first L decoder layers and final norm
# (copied, trained), and an LM head over the Vd most frequent tokens (a reduced vocabulary).

WEIGHTS = FOLDER / "smollm2_135m_draft.safetensors.xz"
FORMAT = "specref-draft-1"


def build_draft(target: torch.nn.Module, num_layers: int, token_map: torch.Tensor) -> torch.nn.Module:
    """An HF causal LM: the target's frozen input embedding (storage shared), copies of its first
    num_layers layers and final norm, and an LM head (Vd, D) = the target's output rows token_map."""
    from transformers import AutoModelForCausalLM

    inner, layers, cfg = _first_layers(target, num_layers)
    token_map = torch.as_tensor(token_map, dtype=torch.long)
    cfg.vocab_size = int(token_map.numel())  # the LM head's size; inputs are still target ids
    cfg.tie_word_embeddings = False
    p = next(target.parameters())
    draft = AutoModelForCausalLM.from_config(cfg).to(device=p.device, dtype=p.dtype)
    for i in range(num_layers):
        draft.model.layers[i].load_state_dict(layers[i].state_dict())
    draft.model.norm.load_state_dict(inner.norm.state_dict())
    emb = inner.embed_tokens.weight.detach()  # (V, D), shared storage, never trained
    draft.model.embed_tokens = torch.nn.Embedding(emb.shape[0], emb.shape[1], _weight=emb, _freeze=True)
    with torch.no_grad():
        head = target.get_output_embeddings().weight  # (V, D)
        draft.lm_head.weight.copy_(head[token_map.to(head.device)])  # (Vd, D)
    return draft.eval()


def save_draft(path, draft: torch.nn.Module, token_map: torch.Tensor, target_fingerprint: str,
               record: dict, dtype: torch.dtype = torch.float16) -> None:
    """The trained tensors (not the shared embedding) + token_map + a training record, safetensors."""
    tensors = {n: p.detach().to(dtype).cpu() for n, p in draft.named_parameters() if p.requires_grad}
    tensors["token_map"] = token_map.to(torch.int32).cpu()
    save_weights(path, tensors, {"format": FORMAT, "num_layers": str(draft.config.num_hidden_layers),
                                 "draft_vocab": str(token_map.numel()), "target_fingerprint": target_fingerprint,
                                 "record": json.dumps(record)})


def trained_draft_info(path=WEIGHTS) -> dict:
    """The metadata of a trained-draft file: num_layers, draft_vocab, fingerprint, record (dict)."""
    return weights_info(path, FORMAT, "trained draft", "make one with `python -m specref train`")


def load_trained_draft(target: Optional[torch.nn.Module] = None, path=None
                       ) -> Tuple[torch.nn.Module, torch.Tensor]:
    """(draft model, token_map (Vd,)) for DraftModelProposer(draft, cfg, token_map, vocab_size=V).

    target: the model the draft was trained for (default: models.load_default()); its embedding is
    shared. path: a file from `python -m specref train` (default: the committed weights)."""
    path = WEIGHTS if path is None else Path(path)
    info = trained_draft_info(path)
    if target is None:
        from .models import load_default

        target, _ = load_default()
    warn_if_other_target(path, info, target)
    token_map = load_token_map(path)  # (Vd,)
    draft = build_draft(target, int(info["num_layers"]), token_map)
    load_tensors(path, {n: q for n, q in draft.named_parameters() if q.requires_grad}, "trained draft")
    return draft.eval(), token_map.to(next(target.parameters()).device)
