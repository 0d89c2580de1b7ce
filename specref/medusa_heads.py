"""Medusa: extra decoding heads on the target's last hidden state, verified as a token tree.

Cai et al. 2024 ("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", Sec. 2.1.1): K heads read h_t, the target's final (normed) hidden state at position t,
the state its own LM head reads to predict x_{t+1}; head k predicts x_{t+k+1}:

    p_t^(k) = softmax(W_2^(k) (SiLU(W_1^(k) h_t + b^(k)) + h_t))      k = 1..K

W_1 starts at zero (a fresh head is the identity followed by an LM head); W_2 is the target's LM
head (shared and frozen here, as EAGLE's; `own_lm_head=True` gives each head a trainable copy, as
Medusa-1 trains). W_2 may be restricted to a reduced draft vocabulary of the Vd most frequent
target tokens (`token_map`, the trained draft's device): the projection is the costly part
(576 x 49152 = 28M parameters per head for the default model), and since the heads' drafts are
deterministic (q one-hot) tokens outside the vocabulary are never drafted and come from the
residual: lossless.

In specref's loop (proposer.py) the root of every step is the pending token x_r, already sampled,
whose feature does not exist yet; the newest feature is h_{r-1} (the token before it, which
predicted x_r). Head d applied to h_{r-1} therefore drafts position r + d: depth d of the tree.
The tree is Medusa's `medusa_choices` (medusa_tree.py: a default sized for this CPU, or the tree
built from measured head accuracies that the trained file stores). Acceptance (MedusaConfig):
- temperature 0: the longest path whose every token is the target's argmax (exact);
- "lossless": recursive rejection sampling over the deterministic siblings (rejection.py,
  q one-hot per node, Draft.siblings="deterministic": the heads' top-s tokens are a function of the
  history): distributed exactly as p;
- "typical": Medusa's typical acceptance (typical.py, Sec. 2.3.1), LOSSY.
Training (Medusa-1, frozen target): training/medusa.py. Left out: Medusa-2 (joint training with
the target), self-distillation on the target's own answers (the data is training's business).

Hydra (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", Sec. 3):
Medusa's head k cannot know which tokens the tree put before its own; a Hydra head reads them.
`sequential=True` gives head k an input projection over h_t and the input embeddings of the k
tokens before its position, x_{t+1} .. x_{t+k} (the pending token and the path's drafts):

    u_t^(k) = W_in^(k) [h_t; e(x_{t+1}); ...; e(x_{t+k})]      W_in^(k) in R^{D x (k+1)D}
    p_t^(k) = softmax(W_2 (SiLU(W_1^(k) u + b^(k)) + u))

W_in starts as [I | 0], so a fresh (or Medusa-started: `hydra_from_medusa`) head is the Medusa
head. The tree keeps Medusa's choices, but a node's rank-i token is now the head's rank-i token
given the node's own path, so the proposer expands the tree level by level, one head call per
distinct parent. The drafts remain a function of the history (siblings "deterministic"): the
acceptance is unchanged and lossless.

Prefix attention (Hydra++, Ankner et al. 2024, Sec. 4): a head reads one state h_t, the target's
summary of the prefix for predicting x_{t+1}; Hydra++ adds one decoder layer over the target's
states, attending over the whole prefix, whose output the heads read instead:

    h~_t = PrefixLayer(h_{<=t})       causal attention over the target's final states
    p_t^(k) = the head of above on h~_t

`prefix="layer"` is that decoder layer (a copy of the target's last); `prefix="attention"` (our
variant, a quarter of the parameters) keeps its attention block only: h~_t = h_t + Attn(Norm(h))_t.
Neither layer knows the pending token x_{t+1} when it attends, so neither can look for that token's
earlier occurrences and what followed them (copying from the prompt). `prefix="pairs"` (our
variant, EAGLE-1's input) runs the decoder layer over pairs, each state with the token after it:

    h~_t = PrefixLayer(W_p [h_j; e(x_{j+1})]  for j <= t)       W_p in R^{D x 2D}, starting as [I | 0]

(x_{j+1} for j <= t is committed: x_{t+1} is the pending token, already sampled). `prefix="eagle"`
(our variant) makes that layer EAGLE-1's head (eagle_head.py: input norms, FC, decoder layer,
output norm), so h~_t is its predicted feature f^_{t+1}, and `hydra_on_eagle` starts Hydra heads on a
trained EAGLE-1 head: head 1 the identity (its logits are the EAGLE head's first draft), head k+1
the given Hydra heads' head k one position on (f^_{t+1} in the place of h_{t+1}). The other kinds start as
the identity (W_p as [I | 0], the layer's attention output and MLP down projections zero), so
heads given a prefix (`add_prefix`) start as themselves. The layer reads only the target's states at committed
positions, never a draft, so its own KV cache grows by the tokens each verification commits and
never rolls back; its output is a function of the history, and the acceptance stays lossless.
Left out: Hydra++'s teacher-distillation objective (our labels already are the target's own
distribution).
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .picker.costs import median_block_times
from .target import device_sync
from .eagle_head import EagleHead
from .kv_rollback import SpecCache
from .medusa_tree import DEFAULT_CHOICES, check_choices, tree_arrays
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig
from .target import Target, additive_mask, attending
from .typical import TypicalAcceptance
from .weights import FOLDER, fingerprint, load_tensors, load_token_map, save_trained, weights_info

FORMAT = "specref-medusa-1"
WEIGHTS = FOLDER / "smollm2_135m_medusa.safetensors.xz"
HYDRA_WEIGHTS = FOLDER / "smollm2_135m_hydra.safetensors.xz"  # sequential heads, the same format


class ResBlock(torch.nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: the identity at the start of training."""

    def __init__(self, D: int):
        super().__init__()
        self.linear = torch.nn.Linear(D, D)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))  # (..., D)


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


class MedusaHeads(torch.nn.Module):
    """K heads over the target's final normed state, each num_layers ResBlocks and an LM head over
    the draft vocabulary token_map (default: the whole vocabulary); sequential=True: Hydra's heads,
    head k also reading the embeddings of the k tokens before its position; prefix ("attention",
    "layer", "pairs" or "eagle"): the heads read the output of a prefix layer over the target's
    states (the module docstring)."""

    def __init__(self, target: torch.nn.Module, num_heads: int = 3, token_map: Optional[torch.Tensor] = None, *,
                 num_layers: int = 1, own_lm_head: bool = False, sequential: bool = False,
                 prefix: Optional[str] = None):
        super().__init__()
        out = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        if out is None or not hasattr(out, "weight"):
            raise ValueError(f"{type(target).__name__} has no output embedding (LM head); Medusa needs one")
        for name, v in (("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        W = out.weight.detach()  # (V, D)
        V, D = W.shape
        token_map = torch.arange(V) if token_map is None else torch.as_tensor(token_map, dtype=torch.long)
        if token_map.dim() != 1 or token_map.numel() < 2 or int(token_map.min()) < 0 or int(token_map.max()) >= V:
            raise ValueError(f"token_map must be a 1-D tensor of >= 2 target ids in [0, {V})")
        self.vocab_size, self.hidden_size, self.num_heads = int(V), int(D), num_heads
        self.num_layers, self.own_lm_head = num_layers, bool(own_lm_head)
        dev, dt = W.device, W.dtype
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[ResBlock(D) for _ in range(num_layers)]) for _ in range(num_heads)).to(dev, dt)
        rows = W[token_map.to(dev)]  # (Vd, D) the target's LM head restricted to the draft vocabulary
        n_proj = num_heads if own_lm_head else 1
        self.lm_heads = torch.nn.ModuleList(torch.nn.Linear(D, rows.shape[0], bias=False) for _ in range(n_proj)).to(dev, dt)
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(rows)
                lm.weight.requires_grad_(own_lm_head)
        self.register_buffer("token_map", token_map.to(dev), persistent=False)  # (Vd,)
        self.choices: Optional[List[Tuple[int, ...]]] = None  # the tree a trained file ships, if any
        self.sequential = bool(sequential)
        if self.sequential:  # Hydra: head k also reads the embeddings of the k tokens before its position
            emb = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
            if emb is None:
                raise ValueError(f"{type(target).__name__} has no input embedding; Hydra heads need one")
            self._embed = (emb,)  # not a submodule: the target's, never trained or saved
            self.inputs = torch.nn.ModuleList(
                torch.nn.Linear((k + 1) * D, D, bias=False) for k in range(1, num_heads + 1)).to(dev, dt)
            with torch.no_grad():
                for lin in self.inputs:  # [I | 0]: the Medusa head until training says otherwise
                    lin.weight.zero_()
                    lin.weight[:, :D].copy_(torch.eye(D))
        self.prefix_kind: Optional[str] = None
        self.prefix: Optional[torch.nn.Module] = None
        self.prefix_in: Optional[torch.nn.Linear] = None  # "pairs": W_p over [h_j; e(x_{j+1})]
        if prefix is not None:
            self.add_prefix(target, prefix)

    def untie_lm_heads(self) -> "MedusaHeads":
        """Give every head a trainable copy of the shared LM head (Medusa-1's own LM heads): the same
        logits until training moves the copies."""
        if self.own_lm_head:
            raise ValueError("the heads already have their own LM heads")
        rows = self.lm_heads[0].weight.detach()  # (Vd, D)
        Vd, D = rows.shape
        self.lm_heads = torch.nn.ModuleList(
            torch.nn.Linear(D, Vd, bias=False) for _ in range(self.num_heads)).to(rows.device, rows.dtype)
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(rows)
        self.own_lm_head = True
        return self

    def add_prefix(self, target: torch.nn.Module, kind: str = "layer", eagle: Optional[EagleHead] = None
                   ) -> "MedusaHeads":
        """Give the heads a prefix layer (`kind` "layer", "attention", "pairs" or "eagle", the module
        docstring). The first three start as the identity: heads whose logits are these heads' until
        training moves it. "eagle" is a copy of `eagle` (an EAGLE-1 EagleHead of this target; None: a
        fresh one, its FC random)."""
        if kind not in PREFIX_KINDS:
            raise ValueError(f"prefix must be one of {PREFIX_KINDS}, got {kind!r}")
        if self.prefix is not None:
            raise ValueError(f"the heads already have a prefix {self.prefix_kind!r}")
        if eagle is not None and kind != "eagle":
            raise ValueError(f"an EAGLE head is the prefix of kind 'eagle' only, not {kind!r}")
        inner = getattr(target, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "rotary_emb"):
            raise ValueError(f"{type(target).__name__} is not a Llama-family causal LM (model.layers, "
                             "model.rotary_emb); a prefix layer copies its last decoder layer")
        w = self.lm_heads[0].weight
        if kind == "eagle":
            if eagle is None:
                eagle = EagleHead(target, self.token_map)
            if type(eagle) is not EagleHead or eagle.hidden_size != self.hidden_size:
                raise ValueError(f"an 'eagle' prefix is an EAGLE-1 EagleHead of width {self.hidden_size} (EAGLE-3's "
                                 f"reads fused features the heads do not have), got {type(eagle).__name__}")
            shared = {id(m): m for m in eagle._shared}  # the target's embeddings: referenced, never copied
            self.prefix = copy.deepcopy(eagle, shared).to(w.device, w.dtype).train(self.training)
            self.prefix_kind = "eagle"
            return self
        layer = copy.deepcopy(layers[-1]).to(w.device, w.dtype)
        layer.self_attn.layer_idx = 0  # the prefix's own cache has one layer
        with torch.no_grad():  # the residual branches start at 0: the layer is the identity
            layer.self_attn.o_proj.weight.zero_()
            if getattr(layer.self_attn.o_proj, "bias", None) is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
        self.prefix = (PrefixAttention(layer) if kind == "attention" else layer).requires_grad_(True)
        if kind == "pairs":
            D = self.hidden_size
            self.prefix_in = torch.nn.Linear(2 * D, D, bias=False).to(w.device, w.dtype)
            with torch.no_grad():  # [I | 0]: the state alone at the start
                self.prefix_in.weight.zero_()
                self.prefix_in.weight[:, :D].copy_(torch.eye(D))
            self._prefix_embed = (inner.embed_tokens,)  # not a submodule: the target's
        self.prefix_kind = kind
        self._rotary = (inner.rotary_emb,)  # not a submodule: the target's
        return self

    @property
    def prefix_layers(self) -> int:
        """Decoder layers of the prefix (its KV cache holds one per layer); 0 without one."""
        if self.prefix is None:
            return 0
        return self.prefix.num_layers if self.prefix_kind == "eagle" else 1

    def contextualise(self, h: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor],
                      cache=None, next_tokens: Optional[torch.Tensor] = None,
                      cur_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prefix layer on the target's states h (B, Q, D) at positions (B, Q), mask (B, 1, Q, S)
        additive (S: the cache's slots, or Q without one); "pairs" and "eagle" also read next_tokens
        (B, Q), the token after each state, and a current-token EAGLE head cur_tokens (B, Q), the
        token at each state's position -> h~ (B, Q, D); h itself without a prefix."""
        if self.prefix is None:
            return h
        if self.prefix_kind in ("pairs", "eagle") and (next_tokens is None or next_tokens.shape != h.shape[:-1]):
            raise ValueError(f"a '{self.prefix_kind}' prefix needs next_tokens of shape {tuple(h.shape[:-1])}, got "
                             f"{None if next_tokens is None else tuple(next_tokens.shape)}")
        if self.prefix_kind == "eagle":
            return self.prefix(h, next_tokens, positions, mask, cache, cur_tokens=cur_tokens)  # (B, Q, D) f^_{t+1}
        if self.prefix_in is not None:
            with torch.no_grad():
                e = self._prefix_embed[0](next_tokens.clamp(min=0)).to(h.dtype)  # (B, Q, D)
            h = self.prefix_in(torch.cat([h, e], dim=-1))  # (B, Q, D)
        pe = self._rotary[0](h, position_ids=positions)  # (cos, sin), each (B, Q, head_dim)
        return self.prefix(h, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                           position_embeddings=pe)  # (B, Q, D)

    def head(self, k: int, h: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Head k (1-based) on h (..., D) -> logits (..., Vd). Sequential heads also need tokens
        (..., k): the target ids of x_{t+1} .. x_{t+k}, the tokens before the position head k drafts."""
        x = h
        if self.sequential:
            if tokens is None or tokens.shape[-1] != k or tokens.shape[:-1] != h.shape[:-1]:
                raise ValueError(f"Hydra head {k} needs tokens of shape {tuple(h.shape[:-1]) + (k,)}, got "
                                 f"{None if tokens is None else tuple(tokens.shape)}")
            with torch.no_grad():
                e = self._embed[0](tokens.clamp(min=0)).to(h.dtype)  # (..., k, D)
            x = self.inputs[k - 1](torch.cat([h, e.flatten(-2)], dim=-1))  # (..., D)
        return self.lm_heads[(k - 1) if self.own_lm_head else 0](self.blocks[k - 1](x))  # (..., Vd)

    def forward(self, h: torch.Tensor, heads: Optional[int] = None, tokens: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """h (..., D) final normed states -> logits (..., heads, Vd) of the first `heads` heads
        (sequential heads: tokens (..., heads), head k reading tokens[..., :k])."""
        n = self.num_heads if heads is None else heads
        outs = [self.head(k, h, None if tokens is None else tokens[..., :k]) for k in range(1, n + 1)]  # (..., Vd) each
        return torch.stack(outs, dim=-2)  # (..., n, Vd)

    def trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(n, q) for n, q in self.named_parameters() if q.requires_grad]

    def deepen(self, num_layers: int) -> "MedusaHeads":
        """Append zero-initialised ResBlocks (the identity) to every head up to num_layers: deeper
        heads whose logits are these heads' until training moves the new blocks."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < self.num_layers:
            raise ValueError(f"num_layers must be an int >= the heads' {self.num_layers}, got {num_layers!r}")
        w = self.lm_heads[0].weight
        for seq in self.blocks:
            for _ in range(num_layers - self.num_layers):
                seq.append(ResBlock(self.hidden_size).to(w.device, w.dtype))
        self.num_layers = num_layers
        return self


@dataclass(frozen=True)
class MedusaConfig:
    """Settings of the Medusa tree proposer."""

    choices: Optional[Tuple[Tuple[int, ...], ...]] = None  # the tree (medusa_tree.py); None: the tree the
    # heads' file ships (built from its held-out accuracies), else medusa_tree.DEFAULT_CHOICES
    acceptance: str = "lossless"  # T > 0: "lossless" (rejection sampling, exact) or "typical" (LOSSY)
    posterior_threshold: float = 0.09  # typical: epsilon (Medusa's default)
    posterior_alpha: float = 0.3  # typical: delta (Medusa's default)

    def __post_init__(self) -> None:
        if self.acceptance not in ("lossless", "typical"):
            raise ValueError(f"acceptance must be 'lossless' or 'typical', got {self.acceptance!r}")
        TypicalAcceptance(self.posterior_threshold, self.posterior_alpha)  # ValueError on bad values


class MedusaProposer:
    """Proposer protocol: one tree per row and step from the heads' top tokens (q = None: the
    siblings are deterministic, distinct top-s tokens). k = the tree's node count."""

    hidden_layers = (-1,)  # the target's final normed state

    def __init__(self, heads: MedusaHeads, config: MedusaConfig = MedusaConfig()):
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"heads must be MedusaHeads, got {type(heads).__name__}")
        if not isinstance(config, MedusaConfig):
            raise ValueError(f"config must be a MedusaConfig, got {type(config).__name__}")
        self.heads, self.config = heads.eval(), config
        self.choices = check_choices(config.choices or heads.choices or DEFAULT_CHOICES, heads.num_heads)
        self.parents, self.head_of, self.rank = (t.to(heads.token_map.device) for t in tree_arrays(self.choices))
        self.k = len(self.choices)  # nodes per tree
        self.depth = int(self.head_of.max()) + 1  # heads the tree uses
        self.top_s = int(self.rank.max()) + 1  # ranks it reads per head
        if self.top_s > heads.token_map.numel():
            raise ValueError(f"the tree reads rank {self.top_s - 1} but the draft vocabulary has "
                             f"{heads.token_map.numel()} tokens")
        self.vocab_size = heads.vocab_size
        # generate.py reads `acceptance_rule`: None = rejection sampling, else typical acceptance
        self.acceptance_rule = (TypicalAcceptance(config.posterior_threshold, config.posterior_alpha)
                           if config.acceptance == "typical" else None)
        self.last: Optional[torch.Tensor] = None
        self.cache: Optional[SpecCache] = None  # the prefix layer's KV cache, if the heads have one
        self.levels = _levels(self.choices, self.parents.device) if heads.sequential else None

    @torch.no_grad()
    def _store(self, ctx: Context) -> None:
        """Keep each row's newest feature: h at the token before the pending one."""
        if ctx.hidden is None or ctx.hidden_len is None:
            raise ValueError("MedusaProposer needs the target's features: run it through speculative_generate, "
                             "which passes them when the proposer sets `hidden_layers`")
        B, W, D = ctx.hidden.shape
        if D != self.heads.hidden_size:
            raise ValueError(f"features have width {D}, the heads expect {self.heads.hidden_size}")
        n = ctx.hidden_len.to(ctx.hidden.device)  # (B,)
        if W == 0:
            return
        h = self._contextualise(ctx, n) if self.cache is not None else ctx.hidden  # (B, W, D)
        newest = h[torch.arange(B, device=ctx.hidden.device), (n - 1).clamp(min=0)]  # (B, D)
        fresh = n > 0  # (B,) rows whose last forward committed tokens
        self.last = torch.where(fresh[:, None], newest.to(self.last), self.last)  # (B, D)
        self.has |= fresh

    def _contextualise(self, ctx: Context, n: torch.Tensor) -> torch.Tensor:
        """The prefix layer on the newly committed states ctx.hidden (B, W, D), n (B,) valid per row,
        at each row's next cache slots (= their positions: the cache holds every committed state
        from position 0); the valid ones committed. -> h~ (B, W, D)"""
        w = self.heads.lm_heads[0].weight
        return _prefix_step(self.heads, self.cache, ctx.hidden.to(w.dtype), n, ctx.tokens)

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        w = self.heads.lm_heads[0].weight
        # the prefix layer's cache: every committed state, plus one block's padding past a row's end
        self.cache = (SpecCache(self.heads.prefix_layers, B, 2 * ctx.tokens.shape[1] + 2, dev)
                      if self.heads.prefix is not None else None)
        self.last = torch.zeros(B, self.heads.hidden_size, device=dev, dtype=w.dtype)  # (B, D)
        self.has = torch.zeros(B, dtype=torch.bool, device=dev)  # (B,) a feature seen (prompt > 1 token)
        self._store(ctx)

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if self.last is None:
            raise ValueError("MedusaProposer.propose() called before begin()")
        B, N = ctx.tokens.shape[0], self.k
        if self.levels is None:
            z = self.heads(self.last, heads=self.depth)  # (B, depth, Vd)
            top = z.topk(self.top_s, dim=-1).indices  # (B, depth, S) draft ids, most likely first
            ids = top[:, self.head_of, self.rank]  # (B, N) node n: head_of[n]'s rank[n] token
            tokens = self.heads.token_map[ids]  # (B, N) target ids
        else:
            tokens = self._sequential_tree(ctx)  # (B, N) target ids
        lengths = N * (ctx.active & self.has).long()  # (B,)
        tokens = torch.where(lengths[:, None] > 0, tokens, -1)  # (B, N)
        return Draft(tokens=tokens, lengths=lengths, parents=self.parents.expand(B, N).clone(),
                     siblings="deterministic")  # top-k of each head: q one-hot (None)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        self._store(ctx)

    def _sequential_tree(self, ctx: Context) -> torch.Tensor:
        """Hydra: the tree level by level; head d runs once per distinct parent at depth d - 1, on
        the path from the pending token x_r to that parent. -> (B, N) target ids."""
        B, N, D = ctx.tokens.shape[0], self.k, self.heads.hidden_size
        rows = torch.arange(B, device=ctx.tokens.device)
        pending = ctx.tokens[rows, (ctx.lengths.to(rows.device) - 1).clamp(min=0)]  # (B,) x_r
        tokens = torch.zeros(B, N, dtype=torch.long, device=pending.device)  # (B, N)
        for d, (nodes, slot, paths) in enumerate(self.levels, start=1):
            P = paths.shape[0]  # distinct parents at depth d - 1
            path = torch.cat([pending[:, None, None].expand(B, P, 1), tokens[:, paths]], dim=-1)  # (B, P, d)
            z = self.heads.head(d, self.last[:, None].expand(B, P, D), path)  # (B, P, Vd)
            top = z.topk(self.top_s, dim=-1).indices  # (B, P, S)
            tokens[:, nodes] = self.heads.token_map[top[:, slot, self.rank[nodes]]]  # (B, n_d)
        return tokens


def _levels(choices, device) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per depth d = 1..: (nodes (n_d,) the tree's nodes at depth d, slot (n_d,) each one's parent's
    index among the level's distinct parents, paths (P_d, d - 1) those parents' paths as node
    indices, root excluded)."""
    index = {c: n for n, c in enumerate(choices)}
    out = []
    for d in range(1, max(len(c) for c in choices) + 1):
        level = [c for c in choices if len(c) == d]
        parents = sorted({c[:-1] for c in level}, key=lambda c: index.get(c, -1))
        slot = [parents.index(c[:-1]) for c in level]
        paths = [[index[p[:j]] for j in range(1, d)] for p in parents]
        out.append((torch.tensor([index[c] for c in level], device=device),
                    torch.tensor(slot, device=device),
                    torch.tensor(paths, dtype=torch.long, device=device).view(len(parents), d - 1)))
    return out


@torch.no_grad()
def measure_heads_cost(target, heads: MedusaHeads, depth: Optional[int] = None, reps: int = 21) -> dict:
    """Median seconds of the heads' step (one row, `depth` heads + top-k) and of a 1-token target
    forward on a 200-token cache; c = their ratio."""
    tgt = target if isinstance(target, Target) else Target(target)
    t_target = median_block_times(tgt, [1], 200, 15, warmup=2)[1]
    w = heads.lm_heads[0].weight
    h = torch.randn(1, heads.hidden_size, device=w.device, dtype=w.dtype)  # (1, D)
    n = heads.num_heads if depth is None else depth
    tokens = torch.zeros(1, n, dtype=torch.long, device=w.device) if heads.sequential else None  # (1, n): one path
    cache, Q = None, 2  # the prefix layer: Q newly committed states on a 200-state cache per step
    if heads.prefix is not None:
        cache = SpecCache(heads.prefix_layers, 1, 200 + Q + 1, w.device)
        prefill = torch.randn(1, 200, heads.hidden_size, device=w.device, dtype=w.dtype)  # (1, 200, D)
        _prefix_step(heads, cache, prefill, torch.full((1,), 200))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        if cache is not None:
            h = _prefix_step(heads, cache, h[:, None].expand(1, Q, heads.hidden_size), torch.full((1,), Q))[:, -1]
            cache.rollback_to(cache.lengths - Q)
        heads(h, heads=depth, tokens=tokens).topk(4, dim=-1)
        device_sync(w.device)
        times.append(time.perf_counter() - t0)
    t_heads = sorted(times[2:])[reps // 2]
    return {"t_target": t_target, "t_draft": t_heads, "c": t_heads / t_target}


def _prefix_step(heads: MedusaHeads, cache: SpecCache, h: torch.Tensor, keep: torch.Tensor,
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


# ----------------------------------------------------------------------------- weights


def save_medusa(path, heads: MedusaHeads, target_fingerprint: str, record: dict,
                choices: Optional[List[Tuple[int, ...]]] = None, dtype: torch.dtype = torch.float16) -> None:
    """The trained tensors + token_map + architecture + the tree to ship + a record, as safetensors."""
    arch = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "own_lm_head": heads.own_lm_head,
            "sequential": heads.sequential, "prefix": heads.prefix_kind}
    if heads.prefix_kind == "eagle":  # the EAGLE head's layout, to rebuild it before loading
        arch.update(prefix_extra_layers=heads.prefix.num_layers - 1, prefix_current_token=heads.prefix.current_token)
    save_trained(path, heads, FORMAT, target_fingerprint, record,
                 {"arch": json.dumps(arch), "choices": json.dumps(choices or [])}, dtype)


def medusa_info(path=WEIGHTS) -> dict:
    """The metadata of a Medusa heads file: target_fingerprint, arch, choices, record (dict)."""
    meta = weights_info(path, FORMAT, "Medusa heads file", "train them with `python -m specref train --method medusa`")
    meta["arch"] = json.loads(meta.get("arch", "{}"))
    meta["choices"] = [tuple(c) for c in json.loads(meta.get("choices", "[]"))]
    return meta


def load_medusa(target: torch.nn.Module, path=WEIGHTS) -> MedusaHeads:
    """MedusaHeads for `target` with the weights of a file written by save_medusa (default: the
    committed heads of the default model); ValueError if the file was trained for another model."""
    meta = medusa_info(path)
    fp = fingerprint(target)
    if meta.get("target_fingerprint") != fp:
        raise ValueError(f"{path} holds Medusa heads for the model with fingerprint "
                         f"{meta.get('target_fingerprint')!r}, not this one ({fp!r}): heads read one "
                         "model's hidden states and mean nothing on another's")
    a = meta["arch"]
    token_map, eagle = load_token_map(path), a.get("prefix") == "eagle"
    heads = MedusaHeads(target, a.get("num_heads", 3), token_map, num_layers=a.get("num_layers", 1),
                        own_lm_head=a.get("own_lm_head", False), sequential=a.get("sequential", False),
                        prefix=None if eagle else a.get("prefix"))
    if eagle:
        heads.add_prefix(target, "eagle", EagleHead(target, token_map, extra_layers=a.get("prefix_extra_layers", 0),
                                                    current_token=a.get("prefix_current_token", False)))
    load_tensors(path, dict(heads.trainable()), "Medusa heads")
    heads.choices = meta["choices"] or None
    return heads.eval()


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
