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

W_in starts as [I | 0], so a fresh (or Medusa-started: `training.hydra_from_medusa`) head is the Medusa
head. The tree keeps Medusa's choices, but a node's rank-i token is now the head's rank-i token
given the node's own path, so the proposer expands the tree level by level, one head call per
distinct parent. The drafts remain a function of the history (siblings "deterministic"): the
acceptance is unchanged and lossless.

Prefix layers (Hydra++, Ankner et al. 2024, Sec. 4; medusa_prefix.py): `prefix=` gives the heads one
decoder layer over the target's states, whose output they read instead of h_t; it reads only
committed states, so the drafts stay a function of the history and the acceptance lossless.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .eagle_head import EagleHead
from .kv_rollback import SpecCache
from .medusa_prefix import add_prefix, prefix_step
from .medusa_tree import DEFAULT_CHOICES, check_choices, tree_arrays
from .proposer import Context, Draft, Generators, refill_context
from .sampling import SamplingConfig
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

    def add_prefix(self, target: torch.nn.Module, kind: str = "layer", eagle: Optional[EagleHead] = None
                   ) -> "MedusaHeads":
        """Give the heads a prefix layer of `kind` (medusa_prefix.add_prefix). -> the heads."""
        return add_prefix(self, target, kind, eagle)

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
        return prefix_step(self.heads, self.cache, ctx.hidden.to(w.dtype), n, ctx.tokens)

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
    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        """Rows that took a new request (scheduler.py): their newest feature the new prompt's (from
        hidden, R x P x D; a prefix layer's cache emptied and run over the prompt's states first), as
        begin() for those rows only."""
        if self.last is None:
            raise ValueError("MedusaProposer.reset_rows() called before begin()")
        rows = rows.to(self.last.device)
        self.last[rows] = 0
        self.has[rows] = False
        if self.cache is not None:
            self.cache.lengths[rows.to(self.cache.lengths.device)] = 0
        new = refill_context(ctx, rows, hidden)
        if new is not None:
            self._store(new)

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
