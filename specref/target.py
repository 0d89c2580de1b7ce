"""Wraps a HuggingFace decoder-only causal LM for speculative decoding on a SpecCache.

The target model's job in speculative decoding (Leviathan et al. 2023, Sec. 2.3) is to score a
block of tokens in ONE forward: the row's last committed token followed by the draft, giving the
K+1 distributions p_1..p_{K+1} that rejection.py needs. A token tree (Miao et al. 2024, SpecInfer)
is scored the same way with a tree attention mask (each node sees the committed prefix and its own
ancestors) and position ids equal to prefix length + depth.

Every forward here passes explicit position ids and a 4D additive attention mask (B, 1, Q, S)
over the static cache, so rows of different lengths share one batch without padding tokens
inside the cache, and stale slots beyond a row's committed length are never read. Eager forwards
attend only the cache's used prefix (slots up to the highest one any row writes); compiled ones
the whole cache (static shapes). On CPU, fp32 (and bf16 where oneDNN supports it) linears run with
weights pre-packed for oneDNN (backends/cpu_linear.py), so a block of k+1 tokens costs little more
than one token.

Works with the transformers 5.x Llama-family attention code path (Llama, Qwen2/3, Mistral,
SmolLM, Gemma, Phi-3, OLMo, Granite...; any model that forwards a prepared 4D mask unchanged and
updates `cache` through `Cache.update`). Not supported, with a ValueError: encoder-decoder models,
non-causal models, models with sliding-window or linear-attention layers (the mask here is a full
causal one, and recurrent state cannot be rolled back by a length change).

Models placed by accelerate (`from_pretrained(..., device_map=...)`, `accelerate.dispatch_model`,
CPU or disk offload) work as they are: every forward goes through accelerate's hooks, each cache
layer's keys and values live on the device of the layer that writes them, and the logits and
hidden states come back to the input device (the embedding's), where the loop runs.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .backends.cpu_linear import PackedLinears, packing_available, tensor_version
from .hf.compat import cache_keyword, check_transformers
from .kv_rollback import SpecCache


@dataclass(frozen=True)
class TargetConfig:
    """Settings of the target wrapper."""

    compile: bool = False  # run verify forwards under torch.compile (prefill stays eager); drafted
    # chain blocks are padded to k+1 and trees to the proposer's node budget (generate.py), so two
    # graphs (1 and k+1 tokens) serve every step. On CUDA mode="reduce-overhead" (CUDA graphs). On
    # CPU the weights are frozen into the graph (inductor freezing): to change them, build a new
    # Target (a changed weight raises ValueError at the next generation)
    pack_linears: Optional[bool] = None  # CPU fp32 (bf16 where supported): run linears with weights
    # pre-packed for oneDNN (backends/cpu_linear.py; a k+1-token block then costs little more than
    # one token). None = on wherever it applies (CPU, fp32 or supported bf16 linears, no compile);
    # True requires it to apply
    hidden_layers: Optional[tuple] = None  # None: no hidden states; else layer indices to return
    # (-1 = final normed state, as Medusa/EAGLE use; EAGLE-3 uses low/mid/high layers)


@dataclass
class BlockOutput:
    logits: torch.Tensor  # (B, Q, V) float32
    hidden: Optional[torch.Tensor] = None  # (B, Q, len(hidden_layers) * D) or None


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock measures it; no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_causal_lm(model: torch.nn.Module, name: str = "model") -> None:
    """Raise ValueError unless `model` is a decoder-only causal LM this library can drive."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"{name} must be a HuggingFace causal LM (a PreTrainedModel with an LM head), "
                         f"got {type(model).__name__}")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model ({type(model).__name__}); "
                         "only decoder-only causal LMs are supported")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_names = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal_names.update([v] if isinstance(v, str) else v)
    if (not any(c.__name__ in causal_names for c in type(model).__mro__)
            or not getattr(cfg, "is_causal", True)
            or model.get_output_embeddings() is None):
        raise ValueError(f"{name} ({type(model).__name__}) is not a causal LM (no LM head or is_causal=False)")
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", window is not None)
    if any(t != "full_attention" for t in layer_types) or (window is not None and uses_window
                                                            and not layer_types):
        raise ValueError(f"{name} ({type(model).__name__}) has sliding-window or non-attention layers "
                         f"({sorted(set(layer_types)) or 'sliding_window=' + str(window)}); only full-"
                         "attention decoders are supported")


def _weight_versions(model: torch.nn.Module) -> tuple:
    """Identity and in-place version of every parameter (inference tensors: identity only)."""
    return tuple(tensor_version(p) for p in model.parameters())


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (B, Q, S) -> additive float mask (B, 1, Q, S): 0 where allowed, dtype-min elsewhere."""
    neg = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), neg, dtype=dtype, device=allowed.device)).unsqueeze(1)


@contextlib.contextmanager
def attending(cache: SpecCache, S: int):
    """During one forward, the cache hands the model its first S slots (all of them: None). Every
    module that runs a forward on a SpecCache (the target, the EAGLE head) enters it."""
    cache.attend_len = None if S == cache.max_len else S
    try:
        yield
    finally:
        cache.attend_len = None


class Target:
    """A causal LM scored block by block on a SpecCache. One instance can serve many generations."""

    def __init__(self, model: torch.nn.Module, config: TargetConfig = TargetConfig(), name: str = "target"):
        check_transformers()  # the cache API and forward keyword this wrapper relies on (compat.py)
        check_causal_lm(model, name)
        self.model = model.eval()
        self.config = config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.num_layers = int(model.config.num_hidden_layers)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_keyword(model.forward, name)  # `cache` from 5.24, `past_key_values` before
        self._keep_kw = "logits_to_keep" in params
        p = next(model.parameters())
        # the input device: where the first resident weight (the embedding) lives; a model placed by
        # accelerate (device_map, offload) has its offloaded weights on "meta" until its hooks run
        self.device = next((q.device for q in model.parameters() if q.device.type != "meta"), p.device)
        self.dtype = p.dtype
        mp = getattr(model.config, "max_position_embeddings", None)
        self.max_positions: Optional[int] = int(mp) if mp else None  # the model's position window
        self.packed: Optional[PackedLinears] = None
        if config.pack_linears or (config.pack_linears is None and not config.compile
                                   and self.device.type == "cpu" and packing_available()):
            if config.compile:
                raise ValueError("pack_linears and compile are exclusive (inductor packs its own weights)")
            self.packed = PackedLinears.of(model)
            if config.pack_linears and not len(self.packed):
                raise ValueError(f"pack_linears=True but {name} has no CPU nn.Linear layers in a dtype "
                                 "oneDNN packs here")
        self._forward = self._eager_forward
        self._frozen = None  # weight versions a CPU compile froze into its graphs
        if config.compile:
            # on CPU, inductor's freezing folds the weights into the graph as constants and packs
            # the linears for oneDNN (without it a compiled CPU forward is no faster than eager)
            freeze = self.device.type == "cpu"
            if self.device.type == "cuda":  # CUDA graphs (inductor's cudagraph trees): the launch
                # overhead of a small model's step is what they remove. Static shapes make it one
                # graph per block width (chains padded to k+1, trees to the node budget); the KV
                # tensors are static addresses (kv_rollback.py marks them), other inputs are copied
                # into the graph's buffers, and outputs are cloned before the next replay reuses them
                compiled = torch.compile(self._eager_forward, dynamic=False, fullgraph=False, mode="reduce-overhead")

                def forward(*args, **kwargs):
                    torch.compiler.cudagraph_mark_step_begin()
                    out = compiled(*args, **kwargs)
                    return BlockOutput(out.logits.clone(), None if out.hidden is None else out.hidden.clone())
                self._forward = forward
            else:
                self._forward = torch.compile(self._eager_forward, dynamic=False, fullgraph=False,
                                              options={"freezing": True} if freeze else None)
            self._frozen = _weight_versions(model) if freeze else None

    def session(self):
        """Context for a run of forwards (a generation loop): on CPU, the packed linears are swapped
        into the model once for all of them instead of once per forward. Forwards outside a
        session work the same (each enters its own). Raises ValueError if a CPU compile froze
        weights that have changed since."""
        if self._frozen is not None and self._frozen != _weight_versions(self.model):
            raise ValueError("the model's weights changed after compile=True froze them into the compiled "
                             "graph (CPU); build a new Target(model, TargetConfig(compile=True))")
        return self._packing()

    def _packing(self):
        return self.packed.active() if self.packed is not None else contextlib.nullcontext()

    def new_cache(self, batch: int, max_len: int) -> SpecCache:
        """A cache of max_len slots per row. Slots are not positions: a cache may hold more slots than
        the model has positions (a draft's room for rows that catch up later, compile's rounded
        size); what must fit the window is the positions of committed tokens (generate.py checks)."""
        return SpecCache(self.num_layers, batch, max_len, self.device)

    def _eager_forward(self, cache: SpecCache, tokens, positions, mask, keep_logits: bool = True,
                       hidden_layers: Optional[tuple] = None) -> BlockOutput:
        layers = self.config.hidden_layers if hidden_layers is None else hidden_layers
        want_hidden = layers is not None
        if self.max_positions is not None:
            # committed tokens fit the window (generate.py checks); only columns that are never
            # committed (compile's padding, tree nodes past the token budget) can reach its end
            positions = positions.clamp(max=self.max_positions - 1)
        extra = {} if keep_logits or not self._keep_kw else {"logits_to_keep": 1}  # skip the LM head
        with self._packing():
            out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                             use_cache=True, output_hidden_states=want_hidden, **{self._cache_kw: cache},
                             **extra)
        hidden = None
        if want_hidden:
            hs = out.hidden_states  # tuple of (B, Q, D), embeddings first, last one normed
            hidden = torch.cat([hs[i].to(self.device) for i in layers], dim=-1)  # (B, Q, L*D)
        logits = out.logits.float().to(self.device) if keep_logits else out.logits.new_zeros(tokens.shape[0], 0, self.vocab_size)
        return BlockOutput(logits=logits, hidden=hidden)

    @torch.no_grad()
    def forward_block(self, cache: SpecCache, tokens: torch.Tensor, positions: torch.Tensor,
                      allowed: torch.Tensor, slots: Optional[torch.Tensor] = None,
                      hidden_layers: Optional[tuple] = None, span_checked: bool = False) -> BlockOutput:
        """One forward of a block. tokens/positions (B, Q); allowed (B, Q, S) bool attention;
        slots (B, Q) where the block's K/V are written (default: after each row's length);
        hidden_layers: return these layers' states (default: TargetConfig.hidden_layers);
        span_checked: the caller built `allowed` to cover the block's slots (skips a device read)."""
        if slots is None:
            cache.begin_block(tokens.shape[1])
        else:
            cache.set_block_slots(slots)
        S = allowed.shape[-1]
        if S != cache.max_len and (self.config.compile or (not span_checked and S < int(cache.block_slots.max()) + 1)):
            raise ValueError(f"allowed covers {S} slots: need all {cache.max_len} under compile, else at "
                             f"least up to the block's last slot {int(cache.block_slots.max())}")
        mask = additive_mask(allowed, self.dtype)  # (B, 1, Q, S)
        if tokens.shape[0] * tokens.shape[1] == 1 and S != cache.max_len and bool(allowed.all()):
            mask = None  # one row, one token seeing every attended slot: the model needs no mask
        with attending(cache, S):
            return self._forward(cache, tokens, positions, mask, True, hidden_layers)

    def _span(self, cache: SpecCache, top: int) -> int:
        """Slots a forward attends: all max_len under compile (static shapes), else 0..top-1, the
        highest slot any row uses (attention then skips the never-written tail of the cache)."""
        return cache.max_len if self.config.compile else min(int(top), cache.max_len)

    # -- the three block shapes generate.py uses ------------------------------------------------
    @torch.no_grad()
    def prefill(self, cache: SpecCache, tokens: torch.Tensor, lengths: torch.Tensor,
                logits: bool = True, hidden_layers: Optional[tuple] = None) -> BlockOutput:
        """Write tokens[b, :lengths[b]] of every row (right-padded (B, T)) and commit them.

        Returns the logits (B, T, V) (hidden states too if configured); logits=False skips the LM
        head where the model allows (`logits_to_keep`) and returns logits of shape (B, 0, V)."""
        B, T = tokens.shape
        if T == 0:
            layers = self.config.hidden_layers if hidden_layers is None else hidden_layers
            D = len(layers) * int(self.model.config.hidden_size) if layers is not None else 0
            return BlockOutput(logits=torch.zeros(B, 0, self.vocab_size, device=tokens.device),
                               hidden=None if layers is None else torch.zeros(B, 0, D, device=tokens.device,
                                                                              dtype=self.dtype))
        slots = cache.begin_block(T)  # (B, T)
        S = min(int(slots.max()) + 1, cache.max_len)  # prefill is eager: attend only written slots
        ar = torch.arange(S, device=tokens.device)  # (S,)
        allowed = ar.view(1, 1, S) <= slots.unsqueeze(-1)  # (B, T, S) causal over own row
        cache.set_block_slots(slots)
        with attending(cache, S):
            out = self._eager_forward(cache, tokens.clamp(min=0), slots, additive_mask(allowed, self.dtype),
                                      keep_logits=logits, hidden_layers=hidden_layers)
        cache.commit(lengths)
        return out

    def verify_chain(self, cache: SpecCache, block: torch.Tensor, pad_to: Optional[int] = None,
                     hidden_layers: Optional[tuple] = None, committed_max: Optional[int] = None) -> BlockOutput:
        """Score block (B, Q) = [last committed token, draft_1..draft_{Q-1}] (-1 padding allowed).

        Returns logits (B, Q, V): row i is the target's next-token logits after block[:, :i+1].
        The caller then commits 1 + accepted slots per row. With compile=True a block of Q > 1 is
        padded to `pad_to` columns (static shapes: one compiled graph for every drafted block, one
        for the undrafted Q = 1 steps); the padding's logits are dropped and its slots stay beyond
        the committed length. committed_max: the longest row's committed length, if the caller knows
        it on the host (generate.py's loop does): the block then needs no device read.
        """
        Q = block.shape[1]
        if self.config.compile and pad_to is not None and pad_to > Q > 1:
            block = torch.cat([block, block.new_zeros(block.shape[0], pad_to - Q)], dim=1)  # (B, pad_to)
        W = block.shape[1]
        slots = cache.begin_block(W, committed_max)  # (B, W) == position ids
        S = self._span(cache, (int(slots.max()) if committed_max is None else committed_max + W - 1) + 1)
        ar = torch.arange(S, device=block.device)  # (S,)
        allowed = ar.view(1, 1, S) <= slots.unsqueeze(-1)  # (B, W, S)
        out = self.forward_block(cache, block.clamp(min=0), slots, allowed, slots=slots,
                                 hidden_layers=hidden_layers, span_checked=True)
        if W != Q:
            out = BlockOutput(out.logits[:, :Q], None if out.hidden is None else out.hidden[:, :Q])
        return out

    def verify_tree(self, cache: SpecCache, block: torch.Tensor, ancestors: torch.Tensor,
                    depth: torch.Tensor, hidden_layers: Optional[tuple] = None,
                    committed_max: Optional[int] = None, pad_to: Optional[int] = None) -> BlockOutput:
        """Score a tree block (B, 1+N) = [root, node_1..node_N] in one forward.

        ancestors (B, 1+N, 1+N) bool: block position i may attend block position j (j == i or an
        ancestor; the root is everyone's ancestor). depth (B, 1+N): 0 for the root.
        committed_max: the longest row's committed length if the caller knows it (no device read).
        pad_to: with compile=True a tree of 1+N < pad_to positions is padded to pad_to (static
        shapes: one compiled graph for every tree up to the proposer's node budget). A padding node
        attends the committed prefix and itself only, no real node attends it, its logits are
        dropped and its slot lies beyond what the commit keeps.
        """
        Q = block.shape[1]
        if self.config.compile and pad_to is not None and pad_to > Q > 1:
            B, P = block.shape[0], pad_to - Q
            block = torch.cat([block, block.new_zeros(B, P)], dim=1)  # (B, pad_to)
            anc = torch.zeros(B, pad_to, pad_to, dtype=torch.bool, device=ancestors.device)  # (B, pad_to, pad_to)
            anc[:, :Q, :Q] = ancestors
            anc[:, Q:, Q:] = torch.eye(P, dtype=torch.bool, device=ancestors.device)
            depth = torch.cat([depth, depth.new_ones(B, P)], dim=1)  # (B, pad_to)
            out = self.verify_tree(cache, block, anc, depth, hidden_layers, committed_max)
            return BlockOutput(out.logits[:, :Q], None if out.hidden is None else out.hidden[:, :Q])
        slots = cache.begin_block(Q, committed_max)  # (B, Q)
        S = self._span(cache, (int(slots.max()) if committed_max is None else committed_max + Q - 1) + 1)
        L = cache.lengths.view(-1, 1, 1)  # (B, 1, 1)
        ar = torch.arange(S, device=block.device).view(1, 1, S)  # (1, 1, S)
        rel = (ar - L).clamp(min=0, max=Q - 1).expand(block.shape[0], Q, S)  # (B, Q, S)
        in_block = ancestors.gather(2, rel)  # (B, Q, S): ancestor relation read at slot - L
        allowed = (ar < L) | ((ar >= L) & (ar < L + Q) & in_block)  # (B, Q, S)
        positions = cache.lengths.unsqueeze(1) + depth  # (B, Q)
        return self.forward_block(cache, block.clamp(min=0), positions, allowed, slots=slots,
                                  hidden_layers=hidden_layers, span_checked=True)
