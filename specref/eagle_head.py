"""EAGLE: a one-layer draft head that extrapolates the target's features (Li et al. 2024).

EAGLE-1 (Li et al., ICML 2024, Sec. 3): drafting at the feature level is easier than at the token
level, and the feature sequence is made predictable by also feeding the token that was sampled.
The head reads the pair (f_t, x_{t+1}) - the target's top-layer feature at position t (the normed
state its LM head reads) and the embedding of the next token - and predicts f_{t+1}:

    g_t = FC([Norm(e(x_{t+1})); Norm(f_t)])  (2D -> D; the input norms are EAGLE-3's)
    f^_{t+1} = Norm(DecoderLayer(g_{<=t}))  one decoder layer, attention over earlier pairs
    q(x_{t+2}) = softmax(LMHead(f^_{t+1}) / T)

The head's LM head is the target's, frozen, restricted to the Vd most frequent tokens (EAGLE-3's
reduced draft vocabulary, Li et al. 2025; `token_map` maps draft ids to target ids; q is 0 outside,
which keeps speculative sampling lossless). Training (Sec. 3.2) regresses f^ onto the target's
f with Smooth-L1 and adds w_cls times the cross-entropy of q against the target's p (here the
stored top-k of p, soft cross-entropy); inputs get uniform noise U(-eps, eps) (Sec. 3.2's data
augmentation against the error accumulation of drafting on predicted features).

`extra_layers` (not in the paper, whose head has one layer; EAGLE's code takes the count from its
config): more decoder layers after the first, each starting as the identity (its attention output
and MLP down projections zero), so a head continued from a one-layer file starts as that head. With
one layer a key at pair j holds (f_j, x_{j+1}), never x_j itself, so matching the query's token
against an earlier occurrence of it (copying from the prompt) has to read x_j out of f_j; a second
layer can first move each token to its successor's slot (the two-layer induction circuit).
`current_token` (not in the paper) gives one layer that token directly, a third FC input:

    g_t = FC([Norm(e(x_{t+1})); Norm(f_t); Norm(e(x_t))])  (3D -> D)

x_t is the token the target read at position t (a drafted pair's: the token drafted before it), the
state EAGLE-3's low-layer feature carries; its FC columns start at zero, so a head continued from a
two-input file starts as that head.

Drafting (Sec. 3.1, chain): the head's own KV cache holds the pairs with TRUE features; a step
first feeds the pairs that verification just made true (catch-up), then k-1 pairs of its own
predicted features and drafted tokens; after verification those speculative slots are dropped
(they were computed from predicted features) and the accepted positions are re-fed with the
target's features next step. With `EagleConfig(adaptive=True)` (not in the paper) each row drafts the
k' <= k that maximises the closed-form speed-up for its own measured acceptance, the rule of
ngram.py's adaptive mode (at least one draft, so acceptance keeps being measured).
EAGLE-2's dynamic draft tree is eagle_tree.py (the same head); EAGLE-3's fused multi-layer features
and own LM head are eagle3.py (a subclass of this head, drafted by the same proposers).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .backends.cpu_linear import pack_on_cpu, packed
from .checks import normalise_ints
from .draft_model import to_target_vocab
from .kv_rollback import SpecCache
from .proposer import Context, Draft, Generators, refill_context
from .sampling import SamplingConfig, logits_to_probs, sample_rows
from .target import additive_mask, attending
from .theory import DecayedAcceptance, best_draft_length, check_costs
from .weights import (FOLDER, load_tensors, load_token_map, save_trained, tensor_names, warn_if_other_target,
                      weights_info)

FORMAT = "specref-eagle-1"
WEIGHTS = FOLDER / "smollm2_135m_eagle.safetensors.xz"


def cur_kwargs(head: torch.nn.Module, cur: torch.Tensor) -> dict:
    """The head's keyword for its pairs' current tokens x_t (B, Q): only a current_token EagleHead
    reads them (EAGLE-3's and the published heads' forward takes no such argument)."""
    return {"cur_tokens": cur} if getattr(head, "current_token", False) else {}


class EagleHead(torch.nn.Module):
    """FC + one decoder layer (a copy of the target's last; `extra_layers` more) + norm; the frozen
    reduced LM head.

    The target's input embedding and rotary embedding are used by reference (not parameters here)."""

    def __init__(self, target: torch.nn.Module, token_map: torch.Tensor, seed: int = 0, extra_layers: int = 0,
                 current_token: bool = False):
        """token_map (Vd,): target ids of the draft vocabulary; seed: the FC's initialisation (all
        other weights start as copies of the target's); extra_layers: decoder layers after the first,
        each the identity at initialisation (o_proj and down_proj zero); current_token: the FC also
        reads Norm(e(x_t)), its columns zero at initialisation."""
        super().__init__()
        inner = getattr(target, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
            raise ValueError(f"{type(target).__name__} is not a Llama-family causal LM (model.layers, "
                             "model.norm, model.rotary_emb); EAGLE needs one")
        if not isinstance(extra_layers, int) or isinstance(extra_layers, bool) or extra_layers < 0:
            raise ValueError(f"extra_layers must be an int >= 0, got {extra_layers!r}")
        if not isinstance(current_token, bool):
            raise ValueError(f"current_token must be a bool, got {current_token!r}")
        token_map = torch.as_tensor(token_map, dtype=torch.long)
        V, D = target.get_output_embeddings().weight.shape
        if token_map.dim() != 1 or token_map.numel() < 2 or int(token_map.min()) < 0 or int(token_map.max()) >= V:
            raise ValueError(f"token_map must be a 1-D tensor of >= 2 target ids in [0, {V})")
        p = next(target.parameters())
        self.vocab_size, self.hidden_size = int(V), int(D)
        # EAGLE-3's input norms: the embedding (RMS ~0.14 on the default model) and the feature
        # (RMS ~1.9) enter the FC at one scale, so the token is not drowned out at initialisation
        self.norm_e, self.norm_f = copy.deepcopy(inner.norm), copy.deepcopy(inner.norm)
        for n in (self.norm_e, self.norm_f):
            torch.nn.init.ones_(n.weight)
        self.current_token = current_token
        self.norm_c = copy.deepcopy(inner.norm) if current_token else None
        if current_token:
            torch.nn.init.ones_(self.norm_c.weight)
        self.fc = torch.nn.Linear((3 if current_token else 2) * D, D, bias=True)
        g, bound = torch.Generator().manual_seed(seed), (2 * D) ** -0.5  # nn.Linear's default init range
        with torch.no_grad():
            self.fc.weight[:, : 2 * D].uniform_(-bound, bound, generator=g)
            if current_token:
                self.fc.weight[:, 2 * D:].zero_()  # e(x_t)'s columns start at zero
            self.fc.bias.uniform_(-bound, bound, generator=g)
        self.fc.to(device=p.device, dtype=p.dtype)
        self.layer = copy.deepcopy(layers[-1])
        self.layer.self_attn.layer_idx = 0  # the head's cache has one layer per decoder layer
        self.extra = torch.nn.ModuleList()
        for i in range(extra_layers):
            m = copy.deepcopy(layers[-1])
            m.self_attn.layer_idx = i + 1
            with torch.no_grad():  # the residual branches start at 0: the layer is the identity
                m.self_attn.o_proj.weight.zero_()
                m.mlp.down_proj.weight.zero_()
            self.extra.append(m)
        self.norm = copy.deepcopy(inner.norm)
        head = target.get_output_embeddings().weight.detach()  # (V, D)
        self.lm_head = torch.nn.Linear(D, token_map.numel(), bias=False).to(device=p.device, dtype=p.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(head[token_map.to(head.device)])  # (Vd, D)
        for m in (self.layer, self.extra, self.norm, self.norm_e, self.norm_f, self.norm_c):
            if m is not None:
                m.requires_grad_(True)  # copies of a (usually frozen) target's modules: trained here
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("token_map", token_map.to(p.device), persistent=False)  # (Vd,)
        self._shared = (inner.embed_tokens, inner.rotary_emb)  # not submodules: never trained or saved

    def forward(self, feats: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                mask: Optional[torch.Tensor], cache=None, cur_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """feats (B, Q, D) f_t, next_tokens (B, Q) x_{t+1}, positions (B, Q), mask (B, 1, Q, S)
        additive or None, cur_tokens (B, Q) x_t (a current_token head's; ignored otherwise) ->
        predicted features f^_{t+1} (B, Q, D)."""
        embed, rotary = self._shared
        e = embed(next_tokens.clamp(min=0)).to(feats.dtype)  # (B, Q, D)
        parts = [self.norm_e(e), self.norm_f(feats)]
        if self.current_token:
            if cur_tokens is None or cur_tokens.shape != next_tokens.shape:
                raise ValueError("a current_token head needs cur_tokens (B, Q), the tokens x_t of its pairs")
            parts.append(self.norm_c(embed(cur_tokens.clamp(min=0)).to(feats.dtype)))  # (B, Q, D)
        g = self.fc(torch.cat(parts, dim=-1))  # (B, Q, D)
        pe = rotary(g, position_ids=positions)  # (cos, sin), each (B, Q, head_dim)
        h = g
        for layer in (self.layer, *self.extra):
            h = layer(h, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                      position_embeddings=pe)  # (B, Q, D)
        return self.norm(h)  # (B, Q, D)

    hidden_layers = (-1,)  # the target's states the head reads: its final normed state

    @property
    def num_layers(self) -> int:
        """Decoder layers (the head's KV cache holds one per layer)."""
        return 1 + len(self.extra)

    @property
    def feature_size(self) -> int:
        """Width of the target's features the head reads (ctx.hidden): D."""
        return self.hidden_size

    def embed_features(self, h: torch.Tensor) -> torch.Tensor:
        """The target's features (..., feature_size) -> the head's input feature (..., D): EAGLE-1
        reads f_t itself (EAGLE-3 fuses several layers here, eagle3.py)."""
        return h

    def logits(self, f_hat: torch.Tensor) -> torch.Tensor:
        return self.lm_head(f_hat)  # (..., Vd)

    def trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(n, q) for n, q in self.named_parameters() if q.requires_grad]


# ----------------------------------------------------------------------------- drafting


@dataclass(frozen=True)
class EagleConfig:
    """Settings of the EAGLE-1 chain proposer."""

    k: int = 4  # draft tokens per step (chain depth); with adaptive, the most per step
    greedy_draft: bool = False  # draft argmax tokens (q = None) even when the target samples
    adaptive: bool = False  # True: each row drafts the k' in 1..k maximising the closed-form speed-up
    # for its own measured acceptance rate (the rule of NgramConfig.adaptive, never below 1 draft)
    draft_cost: float = 0.1  # adaptive: c, cost of one more drafted token (a head step plus one more
    # verified token) over a 1-token target step (picker.costs: measure_head_cost, measure_verify_cost)
    verify_cost_fixed: float = 0.07  # adaptive: c0, extra cost of any multi-token verify block
    memory: float = 0.9  # adaptive: per-step decay of the acceptance counts (~10 steps of memory)
    prior_accept: float = 0.5  # adaptive: prior mean of the per-token acceptance rate

    def __post_init__(self) -> None:
        normalise_ints(self, "k")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        check_costs(self)


class EagleProposer:
    """Proposer protocol: chain drafts from an EagleHead. generate.py hands it the target's features
    (`hidden_layers` below) in ctx.hidden after the prefill and after every verification."""

    hidden_layers = (-1,)  # the target's final normed state, what its LM head reads (an EAGLE-3
    # head reads its low, middle and high layers: the instance takes the head's)

    def __init__(self, head: EagleHead, config: EagleConfig = EagleConfig()):
        if not isinstance(head, EagleHead):
            raise ValueError(f"head must be an EagleHead, got {type(head).__name__}")
        self.head, self.config, self.k = head.eval(), config, config.k
        self.variable_k = True  # batch_k.py may lower self.k for one propose() (it drafts k tokens then)
        self.hidden_layers = tuple(head.hidden_layers)
        self.vocab_size = head.vocab_size
        self.cache: Optional[SpecCache] = None
        # CPU: the head's linears pre-packed for oneDNN, as the target's (backends/cpu_linear.py)
        self.packed = pack_on_cpu(head, head.fc.weight.device)

    @torch.no_grad()
    def _store(self, ctx: Context) -> None:
        """Copy the features ctx.hidden (rows valid: ctx.hidden_len) to their positions in self.feat."""
        if ctx.hidden is None or ctx.hidden_len is None:
            raise ValueError("EagleProposer needs the target's features: run it through speculative_generate, "
                             "which passes them when the proposer sets `hidden_layers`")
        B, W, D = ctx.hidden.shape
        if D != self.head.feature_size:
            raise ValueError(f"features have width {D}, the head expects {self.head.feature_size}")
        j = torch.arange(W, device=ctx.hidden.device).view(1, W)  # (1, W)
        start = (ctx.lengths - 1 - ctx.hidden_len).view(B, 1)  # (B, 1) position of hidden[:, 0]
        ok = j < ctx.hidden_len.view(B, 1)  # (B, W)
        rows = torch.arange(B, device=ctx.hidden.device).view(B, 1).expand(B, W)  # (B, W)
        self.feat[rows[ok], (start + j)[ok]] = self.head.embed_features(ctx.hidden[ok].to(self.feat))  # (M, D)

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, T = ctx.tokens.shape
        dev = ctx.tokens.device
        # 2T slots: a row outside ctx.active for some steps catches up later in one block, written
        # at every row's next slots; only that block's padding columns get positions past the context
        self.cache = SpecCache(self.head.num_layers, B, 2 * T + self._spec_slots() + 2, dev)
        self.feat = torch.zeros(B, T, self.head.hidden_size, device=dev, dtype=self.head.fc.weight.dtype)  # (B, T, D)
        self._store(ctx)
        self.base = torch.zeros(B, dtype=torch.long, device=dev)  # (B,) pairs fed with true features
        self.acceptance = DecayedAcceptance(B, self.config.prior_accept, self.config.memory)  # per row
        self.drafted = np.zeros(B, dtype=np.int64)  # (B,) draft length of the last step

    @torch.no_grad()
    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        """Rows that took a new request (scheduler.py): their head cache emptied, their features the
        new prompt's (hidden, R x P x D), their acceptance the prior; as begin() for those rows only.
        The catch-up of the next propose() feeds their prompt's pairs."""
        if self.cache is None:
            raise ValueError("EagleProposer.reset_rows() called before begin()")
        rows = rows.to(self.base.device)
        r = rows.cpu().numpy()  # (R,)
        self.cache.lengths[rows] = 0
        self.base[rows] = 0
        self.feat[rows] = 0
        self.acceptance.hits[r] = 2.0 * self.config.prior_accept
        self.acceptance.misses[r] = 2.0 * (1.0 - self.config.prior_accept)
        self.drafted[r] = 0
        new = refill_context(ctx, rows, hidden)
        if new is not None:
            self._store(new)

    def _spec_slots(self) -> int:
        """Head-cache slots one step's drafting writes after the true pairs (a chain: k)."""
        return self.k

    def _forward(self, f_in: torch.Tensor, x_in: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        """Feed pairs (B, Q) at the cache's next slots (position = slot); cur (B, Q) their tokens x_t.
        -> f^ (B, Q, D)"""
        Q = x_in.shape[1]
        slots = self.cache.begin_block(Q)  # (B, Q)
        S = int(slots.max()) + 1
        ar = torch.arange(S, device=slots.device)  # (S,)
        allowed = ar.view(1, 1, S) <= slots.unsqueeze(-1)  # (B, Q, S) committed pairs + causal block
        with attending(self.cache, S):
            return self.head(f_in, x_in, slots, additive_mask(allowed, f_in.dtype), cache=self.cache,
                             **cur_kwargs(self.head, cur))

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if self.cache is None:
            raise ValueError("EagleProposer.propose() called before begin()")
        with packed(self.packed):
            return self._propose(ctx, sampling, generator)

    @staticmethod
    def pending(ctx: Context) -> torch.Tensor:
        """(B,) each row's last token, the one whose feature the catch-up predicts."""
        return ctx.tokens.gather(1, (ctx.lengths - 1).clamp(min=0).view(-1, 1))[:, 0]

    def _catch_up(self, ctx: Context) -> torch.Tensor:
        """1. catch up: feed the pairs (f_t, x_{t+1}) for t = base .. L-2, all with the target's
        features, and commit them. -> f^ at each row's pending token (B, D)."""
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        todo = (ctx.lengths - 1 - self.base).clamp(min=0) * ctx.active  # (B,)
        W = max(int(todo.max()), 1)
        t = (self.base.view(B, 1) + torch.arange(W, device=dev)).clamp(max=ctx.tokens.shape[1] - 2)  # (B, W)
        f_in = self.feat.gather(1, t.unsqueeze(-1).expand(B, W, self.feat.shape[-1]))  # (B, W, D)
        f_hat = self._forward(f_in, ctx.tokens.gather(1, t + 1), ctx.tokens.gather(1, t))  # (B, W, D)
        self.cache.commit(todo)
        self.base = self.base + todo
        return f_hat[torch.arange(B, device=dev), (todo - 1).clamp(min=0)]  # (B, D)

    def _propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, k, dev = ctx.tokens.shape[0], self.k, ctx.tokens.device
        k_row = np.full(B, k, dtype=np.int64)  # (B,)
        if self.config.adaptive:  # the closed form per row, on its measured acceptance
            cfg = self.config
            k_row = np.maximum(best_draft_length(self.acceptance.rate, k, cfg.draft_cost,
                                                 cfg.verify_cost_fixed), 1)  # (B,)
        active = ctx.active.cpu().numpy()  # (B,)
        k = int(k_row[active].max()) if active.any() else 1
        last = self._catch_up(ctx)  # (B, D)
        # 2. draft k tokens, feeding the head its own features after the first
        tokens, qs = [], []
        prev = self.pending(ctx)  # (B,) x_t of the next pair: the pending token, then each draft
        for i in range(k):
            logits = self.head.logits(last).float()  # (B, Vd)
            if sampling.greedy or self.config.greedy_draft:
                x = logits.argmax(-1)  # (B,) draft ids
            else:
                q_i = logits_to_probs(logits, sampling)  # (B, Vd)
                x = sample_rows(q_i, generator, torch.as_tensor(i < k_row, device=dev) & ctx.active)  # (B,)
                qs.append(to_target_vocab(q_i, self.head.token_map, self.vocab_size))  # (B, V)
            x = self.head.token_map[x]  # (B,) target ids
            tokens.append(x)
            if i + 1 < k:
                last = self._forward(last.unsqueeze(1), x.view(B, 1), prev.view(B, 1))[:, 0]  # (B, D)
                prev = x
                self.cache.commit(ctx.active.long())
        toks = torch.stack(tokens, dim=1)  # (B, k)
        self.drafted = k_row * active  # (B,)
        lengths = torch.as_tensor(self.drafted, device=dev)  # (B,)
        toks = torch.where(torch.arange(k, device=dev).view(1, k) < lengths.view(B, 1), toks,
                           torch.full_like(toks, -1))  # (B, k)
        return Draft(tokens=toks, lengths=lengths, q=torch.stack(qs, dim=1) if qs else None)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        # 4. roll back the speculative pairs (predicted features); keep the new true features
        self.cache.rollback_to(torch.minimum(self.cache.lengths, self.base))
        self._store(ctx)
        # acceptance counts of a truncated geometric: n accepted, one miss unless all were accepted
        n = num_accepted.cpu().numpy()  # (B,)
        self.acceptance.observe(n, (n < self.drafted).astype(np.float64), self.drafted > 0)
        self.drafted = np.zeros_like(self.drafted)  # counted once: an update without a propose sees none


# ----------------------------------------------------------------------------- weights


def save_eagle(path, head: EagleHead, target_fingerprint: str, record: dict,
               dtype: torch.dtype = torch.float16) -> None:
    """The trained tensors + token_map + a training record, as safetensors (atomic)."""
    save_trained(path, head, FORMAT, target_fingerprint, record, dtype=dtype)


def eagle_info(path=WEIGHTS) -> dict:
    """The metadata of an EAGLE head file: target_fingerprint, record (dict)."""
    return weights_info(path, FORMAT, "EAGLE head", "train one with `python -m specref train --method eagle`")


def _layout(path) -> Tuple[int, bool]:
    """(decoder layers after the first, current_token) of a head file, from its tensor names."""
    names = tensor_names(path)
    idx = {int(n.split(".")[1]) for n in names if n.startswith("extra.")}
    return (max(idx) + 1 if idx else 0), "norm_c.weight" in names


def extra_layers_in(path) -> int:
    """How many decoder layers after the first a head file holds (its `extra.{i}.` tensors)."""
    return _layout(path)[0]


def load_eagle(target: torch.nn.Module, path=WEIGHTS, extra_layers: Optional[int] = None,
               current_token: Optional[bool] = None) -> EagleHead:
    """An EagleHead for `target` with the weights of a file written by save_eagle (default: the
    committed head of the default model). extra_layers / current_token: None, the file's; more
    layers than the file's add identity layers after its own, and current_token=True on a
    two-input file adds e(x_t)'s zero FC columns (to continue training a larger head from it)."""
    meta = eagle_info(path)
    warn_if_other_target(path, meta, target)
    have, has_cur = _layout(path)
    if extra_layers is not None and extra_layers < have:
        raise ValueError(f"{path} holds {have} extra layers; cannot load it into a head with {extra_layers}")
    if current_token is False and has_cur:
        raise ValueError(f"{path} is a current_token head; cannot load it without its third input")
    head = EagleHead(target, load_token_map(path), extra_layers=have if extra_layers is None else extra_layers,
                     current_token=has_cur if current_token is None else current_token)
    added = tuple(f"extra.{i}." for i in range(have, head.num_layers - 1)) + (() if has_cur else ("norm_c.",))
    expected = {n: q for n, q in head.trainable() if not n.startswith(added)}
    if head.current_token and not has_cur:  # the file's two-input FC into the first 2D columns (a view)
        expected["fc.weight"] = head.fc.weight.detach()[:, : 2 * head.hidden_size]
    load_tensors(path, expected, "EAGLE head")
    return head.eval()
