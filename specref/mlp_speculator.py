"""The MLP speculator: n sequential MLP stages over the target's last state (Wertheimer et al. 2024).

Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding Speculators"
(IBM; vLLM's V0 `mlp_speculator`). Stage i (i = 1..n) reads the state s_{i-1} of the stage before
(s_0: the target's last hidden state h_t, the normed state its LM head reads) and the embedding of
the token just drafted (stage 1: x_{t+1}, the token the target itself sampled from h_t), and
predicts x_{t+i+1}:

    s_0 = h_t                      (scale_input: s_0 = LN_0(h_t) / sqrt(2), LN_0 without parameters)
    s_i = GELU(LN_i(P_i s_{i-1} + (w_e / w_s) E_i(x_{t+i})))     w_s = 0.5 ** (0.5 / n)
    q_i = softmax(H_i s_i / T)                                   w_e = sqrt((1 - w_s ** 2) * d / 2)

P_1 (emb_dim -> d), P_i (d -> d), E_i (V x d), H_i (Vd x d; d = inner_dim) are bias-free; LN_i is
the speculator's layer norm: x / sqrt(mean(x ** 2) + 1e-6) (no mean subtracted), times a weight,
plus a bias. The state and embedding weights w_s, w_e are the published scalars (vLLM adds
(w_e / w_s) E_i to P_i s_{i-1}: LN_i removes the common factor w_s). tie_weights: one E, one H, one
LN for every stage and one P for stages 2..n (P_1 reads a state of another width). No attention and
no KV cache: a stage costs two small matmuls plus its head, so a chain of k <= n drafts is cheaper
than MTP's modules or EAGLE's layer, and there is no state to roll back: each step starts from the
newest target state (`hidden_layers = (-1,)`, h at the token before the pending one).

Reduced draft vocabulary (as the other heads): H_i keeps the rows `token_map` (target ids of the
Vd most frequent tokens); q is 0 outside it, which keeps speculative sampling lossless. Not in the
paper: `target_embedding=True` uses the target's input embedding (frozen, shared by every
stage, never saved: needs d = emb_dim) for E_i, so a trained file holds only P, LN and H.
Checkpoints in the published format (vLLM's MLPSpeculatorConfig) load with
`published.load_published_mlp_speculator`. Training on the frozen target:
training/mlp_speculator.py. Left out: the candidate trees of top_k_tokens_per_head / n_candidates
(vLLM leaves them unused too), the paper's two-stage schedule (the data is training's business).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .checks import normalise_ints
from .draft_model import to_target_vocab
from .proposer import Context, Draft, Generators, refill_context
from .sampling import SamplingConfig, logits_to_probs, sample_rows
from .weights import FOLDER, load_tensors, load_token_map, save_trained, warn_if_other_target, weights_info

FORMAT = "specref-mlp-speculator-1"
WEIGHTS = FOLDER / "smollm2_135m_mlp_speculator.safetensors.xz"


class SpeculatorLayerNorm(torch.nn.Module):
    """The speculator's layer norm: x / sqrt(mean(x^2) + eps) (no mean subtracted), then an
    elementwise weight and bias (none for LN_0)."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = torch.nn.Parameter(torch.ones(dim))
            self.bias = torch.nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., d)
        return y if self.weight is None else y * self.weight + self.bias  # (..., d)


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class MLPSpeculator(torch.nn.Module):
    """n_predict stages over a target: emb.i (V, d), proj.i, ln.i, head.i (Vd, d) (tied: index 0
    for every stage, proj.1 for stages 2..n); the target's embedding by reference if target_embedding."""

    def __init__(self, target: torch.nn.Module, n_predict: int = 3, inner_dim: int = 0, *,
                 tie_weights: bool = False, scale_input: bool = False, token_map: Optional[torch.Tensor] = None,
                 target_embedding: bool = False, seed: int = 0):
        """inner_dim: d (0: the target's hidden size); token_map (Vd,): target ids of the draft
        vocabulary (None: all); seed: the initialisation (N(0, 1/d) for E, P, H as IBM's reference;
        LN weight 1, bias 0)."""
        super().__init__()
        emb, head = target.get_input_embeddings(), target.get_output_embeddings()
        if emb is None or head is None or not hasattr(head, "weight"):
            raise ValueError(f"{type(target).__name__} has no input and output embeddings; the speculator needs both")
        W = head.weight.detach()  # (V, D)
        V, D = W.shape
        n = _count(n_predict, "n_predict")
        if isinstance(inner_dim, bool) or not isinstance(inner_dim, int) or inner_dim < 0:
            raise ValueError(f"inner_dim must be 0 (the target's hidden size) or an int >= 1, got {inner_dim!r}")
        d = inner_dim or D
        if tie_weights and n < 2:
            raise ValueError("tie_weights needs n_predict >= 2 (weights are tied between stages)")
        if target_embedding and d != D:
            raise ValueError(f"target_embedding needs inner_dim = the target's hidden size {D}, got {d}")
        token_map = torch.arange(V) if token_map is None else torch.as_tensor(token_map, dtype=torch.long)
        if token_map.dim() != 1 or token_map.numel() < 2 or int(token_map.min()) < 0 or int(token_map.max()) >= V:
            raise ValueError(f"token_map must be a 1-D tensor of >= 2 target ids in [0, {V})")
        self.vocab_size, self.emb_dim, self.inner_dim, self.n_predict = int(V), int(D), int(d), n
        self.tie_weights, self.scale_input, self.target_embedding = bool(tie_weights), bool(scale_input), \
            bool(target_embedding)
        self.state_weight = 0.5 ** (0.5 / n)  # w_s
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (d / 2))  # w_e
        u = 1 if tie_weights else n  # distinct stages
        g = torch.Generator().manual_seed(seed)
        normal = lambda *shape: torch.randn(*shape, generator=g) / math.sqrt(d)  # noqa: E731
        self.emb = torch.nn.ModuleList() if target_embedding else torch.nn.ModuleList(
            torch.nn.Embedding(V, d, _weight=normal(V, d)) for _ in range(u))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D if i == 0 else d, d, bias=False)
                                        for i in range(min(n, 2) if tie_weights else n))
        self.ln = torch.nn.ModuleList(SpeculatorLayerNorm(d) for _ in range(u))
        self.head = torch.nn.ModuleList(torch.nn.Linear(d, token_map.numel(), bias=False) for _ in range(u))
        with torch.no_grad():
            for lin in list(self.proj) + list(self.head):
                lin.weight.copy_(normal(*lin.weight.shape))
        self.ln0 = SpeculatorLayerNorm(D, affine=False) if scale_input else None
        self.to(device=W.device, dtype=W.dtype)
        self.register_buffer("token_map", token_map.to(W.device), persistent=False)  # (Vd,)
        self._shared = (emb,) if target_embedding else ()  # not a submodule: never trained or saved

    def _at(self, mods: torch.nn.ModuleList, i: int, proj: bool = False):
        """Stage i's (0-based) module of a list: tied lists hold one (proj: P_1 and the shared P)."""
        if not self.tie_weights:
            return mods[i]
        return mods[min(i, 1)] if proj else mods[0]

    def start(self, h: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's state h (..., D)."""
        return h if self.ln0 is None else self.ln0(h) / math.sqrt(2)  # (..., D)

    def stage(self, i: int, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Stage i (0-based): s (..., D or d) s_i, x (...) target ids of x_{t+i+1} -> s_{i+1} (..., d)."""
        e = (self._shared[0] if self.target_embedding else self._at(self.emb, i))(x).to(s.dtype)  # (..., d)
        z = self._at(self.proj, i, proj=True)(s) + (self.emb_weight / self.state_weight) * e  # (..., d)
        return torch.nn.functional.gelu(self._at(self.ln, i)(z))  # (..., d)

    def logits(self, i: int, s: torch.Tensor) -> torch.Tensor:
        """H_i s (..., d) -> (..., Vd) over the draft vocabulary."""
        return self._at(self.head, i)(s)  # (..., Vd)

    def arch(self) -> dict:
        return {"n_predict": self.n_predict, "inner_dim": self.inner_dim, "tie_weights": self.tie_weights,
                "scale_input": self.scale_input, "target_embedding": self.target_embedding}

    def trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(n, q) for n, q in self.named_parameters() if q.requires_grad]


# ----------------------------------------------------------------------------- drafting


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    """Settings of the MLP speculator's chain proposer."""

    k: int = 3  # draft tokens per step: stages 1..k (k <= n_predict, as vLLM)
    greedy_draft: bool = False  # draft argmax tokens (q = None) even when the target samples

    def __post_init__(self) -> None:
        normalise_ints(self, "k")
        _count(self.k, "k")


class MLPSpeculatorProposer:
    """Proposer protocol: a chain of k tokens, stage j drafting depth j from the newest target state."""

    hidden_layers = (-1,)  # h: the target's final normed state, what its LM head reads

    def __init__(self, speculator: MLPSpeculator, config: MLPSpeculatorConfig = MLPSpeculatorConfig()):
        if not isinstance(speculator, MLPSpeculator):
            raise ValueError(f"speculator must be an MLPSpeculator, got {type(speculator).__name__}")
        if not isinstance(config, MLPSpeculatorConfig):
            raise ValueError(f"config must be an MLPSpeculatorConfig, got {type(config).__name__}")
        if config.k > speculator.n_predict:
            raise ValueError(f"MLPSpeculatorConfig.k = {config.k}, but the speculator has "
                             f"{speculator.n_predict} stage(s) (n_predict)")
        self.spec, self.config, self.k = speculator.eval(), config, config.k
        self.variable_k = True  # batch_k.py may lower self.k for one propose() (it drafts k tokens then)
        self.vocab_size = speculator.vocab_size
        self.last: Optional[torch.Tensor] = None

    def _store(self, ctx: Context) -> None:
        """Keep each row's newest target state: h at the token before the pending one."""
        if ctx.hidden is None or ctx.hidden_len is None:
            raise ValueError("MLPSpeculatorProposer needs the target's features: run it through "
                             "speculative_generate, which passes them when the proposer sets `hidden_layers`")
        B, W, D = ctx.hidden.shape
        if D != self.spec.emb_dim:
            raise ValueError(f"features have width {D}, the speculator expects {self.spec.emb_dim}")
        if W == 0:
            return
        n = ctx.hidden_len.to(ctx.hidden.device)  # (B,)
        newest = ctx.hidden[torch.arange(B, device=ctx.hidden.device), (n - 1).clamp(min=0)]  # (B, D)
        fresh = n > 0  # (B,) rows whose last forward committed tokens
        self.last = torch.where(fresh[:, None], newest.to(self.last), self.last)  # (B, D)
        self.has |= fresh

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        dt = self.spec.proj[0].weight.dtype
        self.last = torch.zeros(B, self.spec.emb_dim, device=dev, dtype=dt)  # (B, D)
        self.has = torch.zeros(B, dtype=torch.bool, device=dev)  # (B,) a state seen (prompt > 1 token)
        self._store(ctx)

    @torch.no_grad()
    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        """Rows that took a new request (scheduler.py): their newest state the new prompt's (from
        hidden, R x P x D), as begin() for those rows only."""
        if self.last is None:
            raise ValueError("MLPSpeculatorProposer.reset_rows() called before begin()")
        rows = rows.to(self.last.device)
        self.last[rows] = 0
        self.has[rows] = False
        new = refill_context(ctx, rows, hidden)
        if new is not None:
            self._store(new)

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if self.last is None:
            raise ValueError("MLPSpeculatorProposer.propose() called before begin()")
        B, k, dev = ctx.tokens.shape[0], self.k, ctx.tokens.device
        act = ctx.active & self.has  # (B,) rows that draft
        rows = torch.arange(B, device=dev)  # (B,)
        x = ctx.tokens[rows, (ctx.lengths - 1).clamp(min=0)]  # (B,) x_{t+1}: the pending token
        s = self.spec.start(self.last)  # (B, D) s_0
        tokens, qs = [], []
        for j in range(k):  # stage j+1 drafts depth j+1
            s = self.spec.stage(j, s, x)  # (B, d)
            logits = self.spec.logits(j, s).float()  # (B, Vd)
            if sampling.greedy or self.config.greedy_draft:
                y = logits.argmax(-1)  # (B,) draft ids
            else:
                q_j = logits_to_probs(logits, sampling)  # (B, Vd)
                y = sample_rows(q_j, generator, act)  # (B,) rows that do not draft draw nothing
                qs.append(to_target_vocab(q_j, self.spec.token_map, self.vocab_size))  # (B, V)
            x = self.spec.token_map[y]  # (B,) target ids
            tokens.append(x)
        toks = torch.stack(tokens, dim=1)  # (B, k)
        lengths = act.long() * k  # (B,)
        toks = torch.where(act.view(B, 1), toks, torch.full_like(toks, -1))  # (B, k)
        return Draft(tokens=toks, lengths=lengths, q=torch.stack(qs, dim=1) if qs else None)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        self._store(ctx)  # nothing to roll back: the next step starts from the newest target state


# ----------------------------------------------------------------------------- weights


def save_mlp_speculator(path, speculator: MLPSpeculator, target_fingerprint: str, record: dict,
                        dtype: torch.dtype = torch.bfloat16) -> None:
    """The trained tensors (the published names emb.i / proj.i / ln.i / head.i) + token_map +
    architecture + a training record, as safetensors (atomic)."""
    save_trained(path, speculator, FORMAT, target_fingerprint, record, {"arch": json.dumps(speculator.arch())}, dtype)


def mlp_speculator_info(path=WEIGHTS) -> dict:
    """The metadata of an MLP speculator file: target_fingerprint, arch (dict), record (dict)."""
    meta = weights_info(path, FORMAT, "MLP speculator",
                        "train one with `python -m specref train --method mlp_speculator`")
    meta["arch"] = json.loads(meta.get("arch", "{}"))
    return meta


def load_mlp_speculator(target: torch.nn.Module, path=WEIGHTS) -> MLPSpeculator:
    """An MLPSpeculator for `target` with the weights of a file written by save_mlp_speculator
    (default: the committed speculator of the default model)."""
    meta = mlp_speculator_info(path)
    warn_if_other_target(path, meta, target)
    spec = MLPSpeculator(target, token_map=load_token_map(path), **meta["arch"])
    load_tensors(path, dict(spec.trainable()), "MLP speculator")
    return spec.eval()
