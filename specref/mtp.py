"""Multi-token prediction (MTP) modules as a draft: DeepSeek-V3's sequential heads (DeepSeek-AI 2024).

DeepSeek-V3 technical report, Sec. 2.2: D sequential modules; module k (k = 1..D) at position i
reads the representation h^{k-1}_i of the depth before (h^0_i: the main model's) and the embedding
of token t_{i+k}, and predicts t_{i+k+1}:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]   (enorm, hnorm; M_k = eh_proj, 2D -> D)
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                          (one transformer block, causal)
    P^k_{i+k+1} = OutHead(h^k_i)                               (the SHARED output head: norm + LM head)

The concatenation order [emb; h] is the one of the released weights as vLLM's deepseek_mtp reads
them (the report's equation writes the two the other way round). The embedding and the output
head are the target's, shared and frozen here; the block starts as a copy of the target's last
decoder layer (not the report's; as EagleHead's). Here h^0 is the target's final normed state (what its
LM head reads: `hidden_layers = (-1,)`, as vLLM passes it); h^k is the block's output before the
module's own `shared_head.norm`. An optional reduced draft vocabulary (`token_map` to target ids)
restricts the head's rows; q is 0 outside it, which keeps speculative sampling lossless.

Drafting (a chain): with x_0..x_{L-1} committed (x_{L-1} pending, the target has no feature for it
yet) all depths predict from position i = L-2: module 1 drafts x_L; module d drafts x_{L-1+d} from
h^{d-1}_{L-2} and the draft x_{L-2+d}. Each module keeps its own KV cache of positions whose inputs
are all TRUE (module d: i <= L-1-d), caught up on newly committed positions every step; module d's
positions L-d..L-2 read drafted tokens, so they are a speculative block of d-1 slots (their h^{d-1}
come from module d-1's own block), dropped after verification. Module d's catch-up and its
speculative block run as ONE forward (the block's columns right after each row's new true ones), so
a step costs one module forward per depth, not two. Past depth D, module D is reused on
its own output one position further per token (h^D_{i-1} standing in for h^{D-1}_i), which is how
D = 1 drafts more than one token (vLLM's chain for DeepSeek's single module). vLLM runs every depth
that way, one position further with module (step mod D); depths d <= D here instead give module d
the inputs the report trains it on.

MTP vs EAGLE-1 (eagle_head.py). Different: one module per depth (module d drafts depth d) where
EAGLE reuses its one head at every depth; DeepSeek trains the modules WITH the model (the loss
lambda * mean_k L_MTP^k beside the main loss; training/mtp.py trains them on a frozen target, the
only option for a model that ships none); CE only, no feature regression; no bias in the
projection. The same: the input pair (feature, next token's embedding) and norms, the projection
2D -> D, one decoder layer, the shared frozen LM head, the cache dance (true catch-up, speculative
slots dropped), and D = 1 reused past depth 1 is EAGLE-1's chain.
`current_token` (not in the report; EagleHead's for EAGLE-1): module k also reads the token t_{i+k-1} before
the one it embeds (for k = 1 the token the main model read at i, whose state h^0_i is), a third
projection input with its columns zero at initialisation, so modules continued from a two-input file
start as those modules:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k-1}))]   (cnorm; 3D -> D)

Module 1 and a one-layer EAGLE-1 head read the same inputs for the same label, so
`training.mtp_from_eagle` starts modules as a trained head (a warm start for training).
Checkpoints that ship MTP layers in the DeepSeek-V3 layout load with `published.load_native_mtp`.
Left out: the main model's own next-token loss (the target is frozen), vLLM's zeroed embedding at
position 0, trees over the MTP drafts, adaptive draft lengths.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .backends.cpu_linear import pack_on_cpu, packed
from .checks import normalise_ints
from .draft_model import to_target_vocab
from .kv_rollback import SpecCache
from .proposer import Context, Draft, Generators, refill_context
from .sampling import SamplingConfig, logits_to_probs, sample_rows
from .target import additive_mask, attending
from .weights import (FOLDER, load_tensors, load_token_map, save_trained, tensor_names, warn_if_other_target,
                      weights_info)

FORMAT = "specref-mtp-1"
WEIGHTS = FOLDER / "smollm2_135m_mtp.safetensors.xz"


def positive_int(value, name: str) -> int:
    """An int >= 1 from an int, a numpy integer or a 0-d integer tensor; else ValueError naming it."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if isinstance(value, bool) or n is None or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return n


class MTPModule(torch.nn.Module):
    """One depth: enorm, hnorm, eh_proj (2D -> D, no bias), one block, its shared_head.norm; with
    current_token also cnorm and eh_proj 3D -> D (the third input's columns zero at initialisation)."""

    def __init__(self, inner: torch.nn.Module, seed: int, current_token: bool = False):
        super().__init__()
        D = inner.norm.weight.shape[0]
        self.enorm, self.hnorm = copy.deepcopy(inner.norm), copy.deepcopy(inner.norm)
        self.cnorm = copy.deepcopy(inner.norm) if current_token else None
        for n in (self.enorm, self.hnorm, self.cnorm):
            if n is not None:
                torch.nn.init.ones_(n.weight)
        w = inner.norm.weight
        self.eh_proj = torch.nn.Linear((3 if current_token else 2) * D, D, bias=False)
        with torch.no_grad():  # nn.Linear's default range (of the two-input projection), from an explicit generator
            bound, g = (2 * D) ** -0.5, torch.Generator().manual_seed(seed)
            self.eh_proj.weight[:, : 2 * D].uniform_(-bound, bound, generator=g)
            self.eh_proj.weight[:, 2 * D:].zero_()  # t_{i+k-1}'s columns (current_token) start at zero
        self.eh_proj.to(device=w.device, dtype=w.dtype)
        self.block = copy.deepcopy(inner.layers[-1])
        self.block.self_attn.layer_idx = 0  # each module's cache has one layer
        self.norm = copy.deepcopy(inner.norm)  # shared_head.norm: the output head's norm, per module
        self.requires_grad_(True)  # copies of a (usually frozen) target's modules: trained here


class MTPStack(torch.nn.Module):
    """D MTP modules over a target; the target's embedding and rotary embedding by reference, its LM
    head rows `token_map` as the shared frozen output head."""

    def __init__(self, target: torch.nn.Module, token_map: Optional[torch.Tensor] = None, num_modules: int = 1,
                 seed: int = 0, current_token: bool = False):
        """token_map (Vd,): target ids of the draft vocabulary (None: all); num_modules: D; seed: the
        projections' initialisation (module d gets seed + d; the rest starts as copies of the target's);
        current_token: every module also reads the token before the one it embeds (zero columns at first)."""
        super().__init__()
        if not isinstance(current_token, bool):
            raise ValueError(f"current_token must be a bool, got {current_token!r}")
        inner = getattr(target, "model", None)
        if getattr(inner, "layers", None) is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
            raise ValueError(f"{type(target).__name__} is not a Llama-family causal LM (model.layers, "
                             "model.norm, model.rotary_emb); MTP modules need one")
        head = target.get_output_embeddings().weight.detach()  # (V, D)
        V, D = head.shape
        token_map = torch.arange(V) if token_map is None else torch.as_tensor(token_map, dtype=torch.long)
        if token_map.dim() != 1 or token_map.numel() < 2 or int(token_map.min()) < 0 or int(token_map.max()) >= V:
            raise ValueError(f"token_map must be a 1-D tensor of >= 2 target ids in [0, {V})")
        self.vocab_size, self.hidden_size, self.num_modules = int(V), int(D), positive_int(num_modules, "num_modules")
        self.current_token = current_token
        self.layers = torch.nn.ModuleList(MTPModule(inner, seed + d, current_token) for d in range(self.num_modules))
        self.lm_head = torch.nn.Linear(D, token_map.numel(), bias=False).to(device=head.device, dtype=head.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(head[token_map.to(head.device)])  # (Vd, D)
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("token_map", token_map.to(head.device), persistent=False)  # (Vd,)
        self._shared = (inner.embed_tokens, inner.rotary_emb)  # not submodules: never trained or saved

    def forward(self, d: int, h_prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: Optional[torch.Tensor], cache=None, cur_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Module d (0-based): h_prev (B, Q, D) h^{d}_i, tokens (B, Q) t_{i+d+1}, positions (B, Q),
        mask (B, 1, Q, S) additive or None, cur_tokens (B, Q) t_{i+d} (a current_token stack's; ignored
        otherwise) -> h^{d+1}_i (B, Q, D)."""
        m, (embed, rotary) = self.layers[d], self._shared
        e = embed(tokens.clamp(min=0)).to(h_prev.dtype)  # (B, Q, D)
        parts = [m.enorm(e), m.hnorm(h_prev)]
        if self.current_token:
            if cur_tokens is None or cur_tokens.shape != tokens.shape:
                raise ValueError("a current_token MTP stack needs cur_tokens (B, Q), the token before each input token")
            parts.append(m.cnorm(embed(cur_tokens.clamp(min=0)).to(h_prev.dtype)))  # (B, Q, D)
        g = m.eh_proj(torch.cat(parts, dim=-1))  # (B, Q, D)
        pe = rotary(g, position_ids=positions)  # (cos, sin), each (B, Q, head_dim)
        return m.block(g, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                       position_embeddings=pe)  # (B, Q, D)

    def logits(self, d: int, h: torch.Tensor) -> torch.Tensor:
        """OutHead of module d: the shared LM head over its norm. (..., D) -> (..., Vd)"""
        return self.lm_head(self.layers[d].norm(h))  # (..., Vd)

    def trainable(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(n, q) for n, q in self.named_parameters() if q.requires_grad]


# ----------------------------------------------------------------------------- drafting


@dataclass(frozen=True)
class MTPConfig:
    """Settings of the MTP chain proposer."""

    k: int = 3  # draft tokens per step; depth d <= D drafts with module d, deeper ones reuse module D
    greedy_draft: bool = False  # draft argmax tokens (q = None) even when the target samples
    modules: Optional[int] = None  # draft with the first `modules` modules only (None: all D);
    # 1 is how DeepSeek-V3 is served (its one module reused for every further draft token)

    def __post_init__(self) -> None:
        normalise_ints(self, "k", "modules")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        if self.modules is not None and (isinstance(self.modules, bool) or not isinstance(self.modules, int)
                                         or self.modules < 1):
            raise ValueError(f"modules must be None or an int >= 1, got {self.modules!r}")


class MTPProposer:
    """Proposer protocol: chain drafts from an MTPStack, one module per depth (module D past depth D)."""

    hidden_layers = (-1,)  # h^0: the target's final normed state, what its LM head reads

    def __init__(self, stack: MTPStack, config: MTPConfig = MTPConfig()):
        if not isinstance(stack, MTPStack):
            raise ValueError(f"stack must be an MTPStack, got {type(stack).__name__}")
        n = stack.num_modules if config.modules is None else config.modules
        if n > stack.num_modules:
            raise ValueError(f"MTPConfig.modules = {n}, but the stack has {stack.num_modules} module(s)")
        self.stack, self.config, self.k = stack.eval(), config, config.k
        self.variable_k = True  # batch_k.py may lower self.k for one propose() (it drafts k tokens then)
        self.D = min(n, config.k)  # modules in use (deeper ones would never draft)
        self.vocab_size = stack.vocab_size
        self.caches: List[SpecCache] = []
        self.packed = pack_on_cpu(stack, stack.lm_head.weight.device)  # CPU: oneDNN-packed linears

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        B, T = ctx.tokens.shape
        dev, dt = ctx.tokens.device, self.stack.lm_head.weight.dtype
        # 2T slots: a row left out for some steps catches up in one block later (as EagleProposer)
        self.caches = [SpecCache(1, B, 2 * T + self.k + 2, dev) for _ in range(self.D)]
        # h[d] (B, T, D): module d's outputs at its true positions (h[0]: the target's features)
        self.h = [torch.zeros(B, T, self.stack.hidden_size, device=dev, dtype=dt) for _ in range(max(self.D, 2))]
        self.base = [torch.zeros(B, dtype=torch.long, device=dev) for _ in range(self.D)]  # (B,) true positions
        self._store(ctx)

    @torch.no_grad()
    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        """Rows that took a new request (scheduler.py): every module's cache and outputs emptied, h^0
        the new prompt's features (hidden, R x P x D), as begin() for those rows only; each module
        catches up on the prompt at the next propose()."""
        if not self.caches:
            raise ValueError("MTPProposer.reset_rows() called before begin()")
        rows = rows.to(self.h[0].device)
        for cache, base in zip(self.caches, self.base):
            cache.lengths[rows] = 0
            base[rows] = 0
        for h in self.h:
            h[rows] = 0
        new = refill_context(ctx, rows, hidden)
        if new is not None:
            self._store(new)

    def _store(self, ctx: Context) -> None:
        """The target's features ctx.hidden (rows valid: ctx.hidden_len) into h[0] at their positions."""
        if ctx.hidden is None or ctx.hidden_len is None:
            raise ValueError("MTPProposer needs the target's features: run it through speculative_generate, "
                             "which passes them when the proposer sets `hidden_layers`")
        B, W, D = ctx.hidden.shape
        if D != self.stack.hidden_size:
            raise ValueError(f"features have width {D}, the MTP modules expect {self.stack.hidden_size}")
        self._put(0, ctx.lengths - 1 - ctx.hidden_len, ctx.hidden, ctx.hidden_len)

    def _put(self, d: int, start: torch.Tensor, vals: torch.Tensor, n: torch.Tensor) -> None:
        """h[d][b, start[b] + j] = vals[b, j] for j < n[b]."""
        B, W, _ = vals.shape
        j = torch.arange(W, device=vals.device).view(1, W)  # (1, W)
        ok = j < n.view(B, 1)  # (B, W)
        rows = torch.arange(B, device=vals.device).view(B, 1).expand(B, W)  # (B, W)
        self.h[d][rows[ok], (start.view(B, 1) + j)[ok]] = vals[ok].to(self.h[d])

    def _forward(self, d: int, h_in: torch.Tensor, x_in: torch.Tensor, c_in: torch.Tensor) -> torch.Tensor:
        """Module d (0-based) over a block (B, Q) at its cache's next slots (position = slot); c_in (B, Q)
        the token before each of x_in (read by a current_token stack only). -> (B, Q, D)"""
        cache = self.caches[d]
        slots = cache.begin_block(x_in.shape[1])  # (B, Q)
        S = int(slots.max()) + 1
        allowed = torch.arange(S, device=slots.device).view(1, 1, S) <= slots.unsqueeze(-1)  # (B, Q, S)
        with attending(cache, S):
            return self.stack(d, h_in, x_in, slots, additive_mask(allowed, h_in.dtype), cache=cache, cur_tokens=c_in)

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if not self.caches:
            raise ValueError("MTPProposer.propose() called before begin()")
        with packed(self.packed):
            return self._propose(ctx, sampling, generator)

    def _catch_up(self, d: int, ctx: Context, spec_h: Optional[torch.Tensor] = None,
                  spec_x: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Module d (1-based) over its new true positions base_d .. L-1-d (inputs h^{d-1}_t and x_{t+d},
        all true), followed in the SAME forward by its speculative block, if given: spec_h (B, n, D) and
        spec_x (B, n) target ids, at positions L-d .. L-2 (n = d - 1). The true outputs go to h[d]; the
        block's slots are committed now and dropped by update(). -> the block's outputs (B, n, D) or None."""
        B, T = ctx.tokens.shape
        dev, L, act, Dh = ctx.tokens.device, ctx.lengths, ctx.active, self.stack.hidden_size
        base = self.base[d - 1]
        todo = (L - d - base).clamp(min=0) * act  # (B,) new true positions per row
        n = 0 if spec_h is None else spec_h.shape[1]
        W = max(int(todo.max()) + n, 1)
        col = torch.arange(W, device=dev).view(1, W)  # (1, W)
        t = (base.view(B, 1) + col).clamp(max=T - 1 - d)  # (B, W) position of each true column
        h_in = self.h[d - 1].gather(1, t.unsqueeze(-1).expand(B, W, Dh))  # (B, W, D)
        x_in = ctx.tokens.gather(1, t + d)  # (B, W)
        c_in = ctx.tokens.gather(1, t + d - 1)  # (B, W) the token before each input token
        if n:  # row b's block starts right after its todo[b] true columns (ragged rows)
            s = col - todo.view(B, 1)  # (B, W) index into the block
            in_block = (s >= 0) & (s < n)  # (B, W)
            s = s.clamp(0, n - 1)
            h_in = torch.where(in_block.unsqueeze(-1), spec_h.gather(1, s.unsqueeze(-1).expand(B, W, Dh)), h_in)
            x_in = torch.where(in_block, spec_x.gather(1, s), x_in)
            pending = ctx.tokens.gather(1, (L - 1).clamp(min=0).view(B, 1))  # (B, 1) x_{L-1}
            spec_c = torch.cat([pending, spec_x[:, :-1]], dim=1)  # (B, n) the tokens before the block's
            c_in = torch.where(in_block, spec_c.gather(1, s), c_in)
        out = self._forward(d - 1, h_in, x_in, c_in)  # (B, W, D) h^d
        if d < len(self.h):
            self._put(d, base, out, todo)
        self.caches[d - 1].commit(todo + act.long() * n)
        self.base[d - 1] = base + todo
        if not n:
            return None
        at = todo.view(B, 1) + torch.arange(n, device=dev).view(1, n)  # (B, n) the block's columns
        return out.gather(1, at.unsqueeze(-1).expand(B, n, Dh))  # (B, n, D)

    def _propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, T = ctx.tokens.shape
        dev, k, D, L, act = ctx.tokens.device, self.k, self.D, ctx.lengths, ctx.active
        rows = torch.arange(B, device=dev)  # (B,)
        # 1. module 1 catches up (positions base_1 .. L-2, all inputs true): depth 1 drafts from h^1_{L-2}
        self._catch_up(1, ctx)
        last = self.h[1][rows, (L - 2).clamp(min=0)]  # (B, D)
        spec = last.new_zeros(B, 0, last.shape[-1])  # (B, j-2, D) module j-1's block outputs
        tokens, qs = [], []
        for j in range(1, k + 1):
            if 2 <= j <= D:  # 2. module j: its catch-up and its block at L-j .. L-2 in one forward
                h0 = self.h[j - 1][rows, (L - j).clamp(min=0)].unsqueeze(1)  # (B, 1, D) true h^{j-1}_{L-j}
                spec = self._catch_up(j, ctx, torch.cat([h0, spec], dim=1), torch.stack(tokens, dim=1))  # (B, j-1, D)
                last = spec[:, -1]  # (B, D) h^j_{L-2}
            elif j > D:  # module D one position further, on its own output
                before = tokens[-2] if len(tokens) > 1 else ctx.tokens[rows, (L - 1).clamp(min=0)]  # (B,)
                last = self._forward(D - 1, last.unsqueeze(1), tokens[-1].view(B, 1), before.view(B, 1))[:, 0]  # (B, D)
                self.caches[D - 1].commit(act.long())
            logits = self.stack.logits(min(j, D) - 1, last).float()  # (B, Vd)
            if sampling.greedy or self.config.greedy_draft:
                x = logits.argmax(-1)  # (B,) draft ids
            else:
                q_j = logits_to_probs(logits, sampling)  # (B, Vd)
                x = sample_rows(q_j, generator, act)  # (B,) rows outside ctx.active draw nothing
                qs.append(to_target_vocab(q_j, self.stack.token_map, self.vocab_size))  # (B, V)
            tokens.append(self.stack.token_map[x])  # (B,) target ids
        toks = torch.stack(tokens, dim=1)  # (B, k)
        lengths = act.long() * k  # (B,)
        toks = torch.where(act.view(B, 1), toks, torch.full_like(toks, -1))  # (B, k)
        return Draft(tokens=toks, lengths=lengths, q=torch.stack(qs, dim=1) if qs else None)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        # 4. roll back every module's speculative slots; keep the new true features
        for cache, base in zip(self.caches, self.base):
            cache.rollback_to(torch.minimum(cache.lengths, base))
        self._store(ctx)


# ----------------------------------------------------------------------------- weights


def save_mtp(path, stack: MTPStack, target_fingerprint: str, record: dict, dtype: torch.dtype = torch.float16) -> None:
    """The trained tensors + token_map + a training record, as safetensors (atomic)."""
    save_trained(path, stack, FORMAT, target_fingerprint, record, {"num_modules": str(stack.num_modules)}, dtype)


def mtp_info(path=WEIGHTS) -> dict:
    """The metadata of an MTP file: target_fingerprint, num_modules, record (dict)."""
    return weights_info(path, FORMAT, "MTP modules", "train them with `python -m specref train --method mtp`")


def load_mtp(target: torch.nn.Module, path=WEIGHTS, current_token: Optional[bool] = None) -> MTPStack:
    """An MTPStack for `target` with the weights of a file written by save_mtp (default: the
    committed modules of the default model). current_token: None, the file's; True on a two-input
    file adds the third input's zero projection columns (to continue training from it)."""
    meta = mtp_info(path)
    warn_if_other_target(path, meta, target)
    has_cur = "layers.0.cnorm.weight" in tensor_names(path)
    if current_token is False and has_cur:
        raise ValueError(f"{path} holds current_token MTP modules; cannot load them without their third input")
    stack = MTPStack(target, load_token_map(path), num_modules=int(meta.get("num_modules", 1)),
                     current_token=has_cur if current_token is None else current_token)
    expected = {n: q for n, q in stack.trainable() if has_cur or ".cnorm." not in n}
    if stack.current_token and not has_cur:  # each file's two-input projection into the first 2D columns (views)
        for d, m in enumerate(stack.layers):
            expected[f"layers.{d}.eh_proj.weight"] = m.eh_proj.weight.detach()[:, : 2 * stack.hidden_size]
    load_tensors(path, expected, "MTP modules")
    return stack.eval()
