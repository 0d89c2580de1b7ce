"""Published EAGLE-1/2 (Li et al., ICML 2024 / EMNLP 2024) and EAGLE-3 (Li et al. 2025) heads, as
SafeAILab/EAGLE's inference builds them (`eagle/model/ea_model.py`, `cnets1.py`, `cnets.py`) and
vLLM's `llama_eagle` / `llama_eagle3` read them, onto specref's EagleHead / Eagle3Head.

- EAGLE-1/2: `fc` Linear(2D -> D) over [e(x_{t+1}); f_t] (bias per config `bias`, default true;
  the authors load with strict=False, so a file's `fc.bias` is dropped where the config says
  false), `layers.0.*` one Llama decoder layer WITHOUT input_layernorm, no input norms, no final
  norm; q = softmax(LMHead(f^)) with the target's LM head; f^ is fed back as the next feature.
- EAGLE-3: `fc` Linear(3D -> D) over the target's hidden states entering layers (2, L/2, L-3),
  `midlayer.*` a decoder layer whose attention reads [input_layernorm(e); hidden_norm(g)] (2D) with
  the residual g, `norm`, `lm_head` over the draft vocabulary, `d2t` (draft id d -> target id
  d + d2t[d]), `t2d`; the pre-norm output is fed back, logits read norm(a).
The draft layer is built from the HEAD's config, as the authors' is: its own attention heads,
key/value heads (default: as many as attention heads), head dimension D / heads, intermediate size,
rms_norm_eps (default 1e-6), `qkv_bias` (EAGLE-1), and its own rotary embedding (rotary.py: base
`rope_theta` or 10000, linear / dynamic scaling), whatever the target's. A head's `embed_tokens`,
where the file has one that differs from the target's, is the one used (the authors' load_state_dict
puts it over the target's copy), with a warning.
Left out: heads of more than one decoder layer, EAGLE-3's target_hidden_size != hidden_size.
"""
from __future__ import annotations

import copy
import warnings

import torch

from ..eagle3 import Eagle3Head
from ..eagle_head import EagleHead
from .files import check_target, copy_into, read_checkpoint, strip
from .rotary import HeadRotary, rope_settings


def _head_shape(path, cfg: dict, target) -> dict:
    """The draft layer's fields from the head's config, the authors' defaults where absent."""
    tc = target.config
    H = int(cfg.get("num_attention_heads", tc.num_attention_heads))
    D = int(tc.hidden_size)
    if D % H:
        raise ValueError(f"{path}: hidden_size {D} is not a multiple of num_attention_heads {H}")
    KV = int(cfg.get("num_key_value_heads") or H)  # EConfig: None -> num_attention_heads
    if H % KV:
        raise ValueError(f"{path}: num_attention_heads {H} is not a multiple of num_key_value_heads {KV}")
    return {"num_attention_heads": H, "num_key_value_heads": KV, "head_dim": D // H,
            "intermediate_size": int(cfg.get("intermediate_size", tc.intermediate_size)),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "hidden_act": cfg.get("hidden_act", "silu")}


def draft_layer(path, cfg: dict, target, qkv_bias: bool = False) -> torch.nn.Module:
    """A decoder layer of the target's family with the head's own attention and MLP shape."""
    shape = _head_shape(path, cfg, target)
    lc = copy.deepcopy(target.config)
    for k, v in shape.items():
        setattr(lc, k, v)
    lc.attention_bias = bool(qkv_bias)
    last = target.model.layers[-1]
    layer = type(last)(lc, layer_idx=0)
    if qkv_bias:
        layer.self_attn.o_proj.bias = None  # the authors' o_proj has no bias
    p = next(target.parameters())
    return layer.to(device=p.device, dtype=p.dtype)


def _own_rotary(path, cfg: dict, target, head_dim: int) -> HeadRotary:
    base, kind, factor, M = rope_settings(cfg, path, head_dim)
    tc = target.config
    t_params = getattr(tc, "rope_parameters", None) or {}
    t_theta = getattr(tc, "rope_theta", None) or t_params.get("rope_theta")
    t_kind = (getattr(tc, "rope_scaling", None) or t_params or {}).get("rope_type", "default")
    if (t_theta is not None and float(t_theta) != base) or (t_kind or "default") != (kind or "default"):
        warnings.warn(f"{path}: the head's rotary embedding (base {base:g}, scaling {kind}) differs from the "
                      f"target's (theta {t_theta}, {t_kind}); the head's is used, as the authors' code does")
    return HeadRotary(head_dim, base, kind, factor, M).to(next(target.parameters()).device)


def _embedding(path, tensors, target):
    """The embedding the head reads: the target's, or the file's own where it differs."""
    w = target.get_input_embeddings().weight
    e = tensors.get("embed_tokens.weight")
    if e is None:
        return target.get_input_embeddings()
    if tuple(e.shape) != tuple(w.shape):
        raise ValueError(f"{path}: embed_tokens.weight has shape {tuple(e.shape)}, the target's embedding "
                         f"{tuple(w.shape)}: a head for another target")
    if torch.equal(e.to(device=w.device, dtype=w.dtype), w.detach()):
        return target.get_input_embeddings()
    warnings.warn(f"{path}: its embed_tokens differ from the target's; the head reads its own, as the authors' "
                  "load does")
    return torch.nn.Embedding.from_pretrained(e.to(device=w.device, dtype=w.dtype), freeze=True)


def _checks(path, cfg, target, what: str, extra=()):
    tc = target.config
    n_layers = cfg.get("num_hidden_layers", 1)
    if n_layers != 1:
        raise ValueError(f"{path}: num_hidden_layers {n_layers}; specref's {what} has one decoder layer")
    check_target(path, f"an {what}", [("hidden_size", cfg.get("hidden_size"), tc.hidden_size),
                                      ("vocab_size", cfg.get("vocab_size"), tc.vocab_size), *extra])


def _names(layer: torch.nn.Module, src: str, dst: str, skip=()) -> dict:
    return {f"{src}{n}": f"{dst}{n}" for n, _ in layer.named_parameters() if n not in skip}


def load_published_eagle(target: torch.nn.Module, path) -> EagleHead:
    """An EagleHead holding a published EAGLE-1/2 head (SafeAILab's / vLLM's llama_eagle names)."""
    cfg, tensors = read_checkpoint(path)
    tensors = strip(tensors, ("model.",))
    _checks(path, cfg, target, "EAGLE head")
    V = target.get_output_embeddings().weight.shape[0]
    head = EagleHead(target, torch.arange(V))
    bias = bool(cfg.get("bias", True))
    if not bias and "fc.bias" in tensors:
        warnings.warn(f"{path}: config says bias false but the file has fc.bias; it is dropped, as the authors' "
                      "strict=False load drops it")
        tensors.pop("fc.bias")
    if "fc.bias" not in tensors:
        if bias:
            warnings.warn(f"{path}: no fc.bias in the file though the config asks for one; the FC runs without "
                          "(the authors' code would keep its random initialisation)")
        head.fc.bias = None
    head.layer = draft_layer(path, cfg, target, qkv_bias=bool(cfg.get("qkv_bias", False)))
    ident = torch.nn.Identity
    head.norm_e, head.norm_f, head.norm = ident(), ident(), ident()  # EAGLE-1/2 have none of these
    skip = () if "layers.0.input_layernorm.weight" in tensors else ("input_layernorm.weight",)
    if skip:
        head.layer.input_layernorm = ident()  # EAGLE-1/2's first layer reads the fc output as it is
    mapping = {"fc.weight": "fc.weight", **({"fc.bias": "fc.bias"} if head.fc.bias is not None else {}),
               **_names(head.layer, "layers.0.", "layer.", skip)}
    rotary = _own_rotary(path, cfg, target, head.layer.self_attn.head_dim)
    head._shared = (_embedding(path, tensors, target), rotary)
    copy_into(path, "EAGLE-1/2 head", head, tensors, mapping, optional=("embed_tokens.weight",))
    return head.eval()


class PublishedEagle3Head(Eagle3Head):
    """Eagle3Head with the published EAGLE-3 layer: attention over [Norm_e(e); Norm_h(g)] (2D
    wide q/k/v), residual g; the output a (pre-norm) is fed back, logits = LMHead(Norm(a)).
    `fc` is `fuse` (the 3D -> D fusion), so the proposers' device/dtype reads work unchanged.
    layer: the decoder layer to widen (default: a copy of the target's last)."""

    def __init__(self, target: torch.nn.Module, token_map: torch.Tensor, layers, layer=None):
        super().__init__(target, token_map, layers=layers)
        if layer is not None:
            self.layer = layer
        D, attn = self.hidden_size, self.layer.self_attn
        w = self.fuse.weight
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            new = torch.nn.Linear(2 * D, old.out_features, bias=old.bias is not None)
            setattr(attn, name, new.to(device=w.device, dtype=w.dtype))
        self.layer.input_layernorm = torch.nn.Identity()  # norm_e and norm_f play its part
        self.fc = self.fuse

    def forward(self, feats, next_tokens, positions, mask, cache=None):
        """feats (B, Q, D) g or a, next_tokens (B, Q), positions (B, Q) -> a (B, Q, D), pre-norm."""
        embed, rotary = self._shared
        e = embed(next_tokens.clamp(min=0)).to(feats.dtype)  # (B, Q, D)
        x = torch.cat([self.norm_e(e), self.norm_f(feats)], dim=-1)  # (B, Q, 2D)
        pe = rotary(feats, position_ids=positions)
        a, _ = self.layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=positions, cache=cache,
                                    use_cache=cache is not None, position_embeddings=pe)  # (B, Q, D)
        h = feats + a  # (B, Q, D)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))  # (B, Q, D)

    def logits(self, f_hat: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(f_hat))  # (..., Vd)


def _token_map(path, tensors, V: int) -> torch.Tensor:
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()  # (Vd,) target id - draft id
        token_map = torch.arange(d2t.numel()) + d2t  # (Vd,)
    else:
        token_map = torch.arange(V)
    t2d = tensors.get("t2d")
    if t2d is not None and (t2d.numel() != V or int(t2d.bool().sum()) != token_map.numel()):
        raise ValueError(f"{path}: t2d covers {t2d.numel()} target tokens ({int(t2d.bool().sum())} drafted); "
                         f"the target has {V}, d2t {token_map.numel()}")
    if t2d is not None and not bool(t2d.bool()[token_map.clamp(0, V - 1)].all()):
        raise ValueError(f"{path}: d2t and t2d disagree")
    return token_map


def load_published_eagle3(target: torch.nn.Module, path) -> PublishedEagle3Head:
    """A PublishedEagle3Head holding a published EAGLE-3 head (SafeAILab's cnets / vLLM's llama_eagle3)."""
    cfg, tensors = read_checkpoint(path)
    tensors = strip(tensors, ("model.",))
    tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t for n, t in tensors.items()}
    L = int(target.config.num_hidden_layers)
    _checks(path, cfg, target, "EAGLE-3 head",
            [("target_hidden_size", cfg.get("target_hidden_size"), target.config.hidden_size)])
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    if any(not 0 <= int(i) < L for i in ids):
        raise ValueError(f"{path}: the head reads the states entering layers {list(ids)}, but the target has {L} "
                         "layers (set eagle_config.eagle_aux_hidden_state_layer_ids in its config.json)")
    token_map = _token_map(path, tensors, target.get_output_embeddings().weight.shape[0])
    layer = draft_layer(path, cfg, target)
    head = PublishedEagle3Head(target, token_map, layers=tuple(int(i) for i in ids), layer=layer)
    mapping = {"fc.weight": "fuse.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
               "midlayer.input_layernorm.weight": "norm_e.weight", "midlayer.hidden_norm.weight": "norm_f.weight",
               **_names(head.layer, "midlayer.", "layer.")}
    rotary = _own_rotary(path, cfg, target, head.layer.self_attn.head_dim)
    head._shared = (_embedding(path, tensors, target), rotary)
    for norm in (head.norm_e, head.norm_f, head.norm):  # the head's own eps (copies of the target's norm)
        norm.variance_epsilon = float(cfg.get("rms_norm_eps", 1e-6))
    copy_into(path, "EAGLE-3 head", head, tensors, mapping, optional=("embed_tokens.weight", "d2t", "t2d"))
    return head.eval()
