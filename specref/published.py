"""Published draft heads as their authors ship them: EAGLE-1/2 (Li et al., ICML 2024 / EMNLP 2024),
EAGLE-3 (Li et al. 2025), Medusa-1 (Cai et al. 2024), DeepSeek-V3's MTP layers (DeepSeek-AI 2024)
and IBM's MLP speculators (Wertheimer et al. 2024), mapped onto specref's own head classes.

The formats (names and config fields as SafeAILab/EAGLE's `ea_model`, vLLM's `llama_eagle` /
`llama_eagle3` and FasterDecoding/Medusa's `medusa_model` read them; docs/published_heads.md has
the full name mapping):
- EAGLE-1/2: `fc` Linear(2D -> D) over [e(x_{t+1}); f_t] (bias per config `bias`), `layers.0.*` one
  Llama decoder layer WITHOUT input_layernorm, no input norms, no final norm; q = softmax(LMHead(f^))
  with the target's LM head; f^ is fed back as the next feature. -> EagleHead, its input norms,
  the layer's input norm and the final norm replaced by identities, token_map = the whole vocabulary.
- EAGLE-3: `fc` Linear(3D -> D) over the target's hidden states entering layers (2, L/2, L-3),
  `midlayer.*` a decoder layer whose attention reads [input_layernorm(e); hidden_norm(g)] (2D)
  with the residual g, `norm`, `lm_head` over the draft vocabulary, `d2t` (draft id d -> target id
  d + d2t[d]), `t2d`; the pre-norm output is fed back, logits read norm(a). -> Eagle3Head
  (PublishedEagle3Head: its forward is the published layer's).
- Medusa: `medusa_head.{i}.{j}.linear.*` (ResBlocks, SiLU) and `medusa_head.{i}.{n}.weight` (each
  head's own LM head), config medusa_num_heads / medusa_num_layers -> MedusaHeads(own_lm_head=True).
- DeepSeek-V3 MTP (`load_native_mtp`): layer num_hidden_layers + j of a checkpoint is MTP module j
  (`enorm`, `hnorm`, `eh_proj`, `shared_head.*` and a decoder layer's tensors) -> MTPStack. Run
  only on tiny random checkpoints written in that layout, not on a real model.
- MLP speculator (`load_published_mlp_speculator`): vLLM's MLPSpeculatorConfig fields (vocab_size,
  emb_dim, inner_dim, n_predict, tie_weights, scale_input) and tensors emb.i / proj.i / head.i /
  ln.i, an optional `speculator.` prefix -> MLPSpeculator.

Loading is from a local folder (config.json + *.safetensors) or a .safetensors file with its
config.json beside it; pickle files (.bin/.pt/.pth) are refused. A checkpoint for another target
(hidden size, vocabulary, layer shapes) is refused naming what differs; unknown tensors are listed.
Left out: hub downloads, pickle checkpoints (convert them), heads of more than one decoder layer or
of another width than the target's (EAGLE-3's target_hidden_size != hidden_size), Medusa-2
checkpoints that also hold a fine-tuned target.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch

from .eagle3 import Eagle3Head
from .eagle_head import EagleHead
from .medusa_heads import MedusaHeads
from .medusa_tree import check_choices
from .mlp_speculator import MLPSpeculator
from .mtp import MTPStack, positive_int

PICKLE = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _refuse_pickle(path: Path) -> None:
    raise ValueError(f"{path} is a pickle file; specref loads safetensors only: convert it to safetensors "
                     "(safetensors.torch.save_file on its state dict) and pass that")


def is_published(path) -> bool:
    """True for a folder or a file that is not one of specref's own weight files (format tag)."""
    p = Path(path)
    if p.is_dir() or p.suffix in PICKLE:
        return True
    if p.suffix != ".safetensors" or not p.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:
        return not str((f.metadata() or {}).get("format", "")).startswith("specref-")


def read_checkpoint(path) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config.json as a dict ({} if absent), tensors) of a published head's folder or file."""
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            pickles = sorted(q for q in p.iterdir() if q.suffix in PICKLE)
            if pickles:
                _refuse_pickle(pickles[0])
            raise ValueError(f"no .safetensors file in {p}")
        folder = p
    elif p.suffix in PICKLE:
        _refuse_pickle(p)
    elif p.suffix == ".safetensors" and p.is_file():
        files, folder = [p], p.parent
    else:
        raise ValueError(f"{p} is neither a folder nor a .safetensors file")
    tensors: Dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    cfg = folder / "config.json"
    return (json.loads(cfg.read_text()) if cfg.is_file() else {}), tensors


def _strip(tensors: Dict[str, torch.Tensor], prefixes) -> Dict[str, torch.Tensor]:
    out = {}
    for n, t in tensors.items():
        for pre in prefixes:
            if n.startswith(pre):
                n = n[len(pre):]
                break
        out[n] = t
    return out


def _check_target(path, what: str, target: torch.nn.Module, pairs) -> None:
    """ValueError naming every (field, checkpoint value, target value) that differs."""
    bad = [f"{name} {mine} (target: {theirs})" for name, mine, theirs in pairs
           if mine is not None and int(mine) != int(theirs)]
    if bad:
        raise ValueError(f"{path} holds {what} for another target: " + ", ".join(bad))


def _copy_into(path, what: str, module: torch.nn.Module, tensors: Dict[str, torch.Tensor],
               mapping: Dict[str, str], optional=()) -> None:
    """Copy tensors[published] into module's parameter mapping[published]; ValueError listing
    unknown, missing and mis-shaped names."""
    params = dict(module.named_parameters(remove_duplicate=False))  # fc is fuse in PublishedEagle3Head
    unknown = sorted(set(tensors) - set(mapping) - set(optional))
    missing = sorted(n for n, s in mapping.items() if n not in tensors)
    if unknown or missing:
        raise ValueError(f"{path} does not match the {what} layout: unknown tensors {unknown}, missing {missing}")
    for n, s in mapping.items():
        if tuple(tensors[n].shape) != tuple(params[s].shape):
            raise ValueError(f"{path}: {n} has shape {tuple(tensors[n].shape)}, this target needs "
                             f"{tuple(params[s].shape)}")
    with torch.no_grad():
        for n, s in mapping.items():
            params[s].copy_(tensors[n].to(device=params[s].device, dtype=params[s].dtype))
            params[s].requires_grad_(False)


def _layer_checks(path, what, target, cfg) -> list:
    tc = target.config
    return [("hidden_size", cfg.get("hidden_size"), tc.hidden_size), ("vocab_size", cfg.get("vocab_size"), tc.vocab_size),
            ("num_attention_heads", cfg.get("num_attention_heads"), tc.num_attention_heads),
            ("num_key_value_heads", cfg.get("num_key_value_heads"), getattr(tc, "num_key_value_heads", None)
             or tc.num_attention_heads),
            ("intermediate_size", cfg.get("intermediate_size"), tc.intermediate_size)]


def _layer_names(layer: torch.nn.Module, src: str, dst: str, skip=()) -> Dict[str, str]:
    return {f"{src}{n}": f"{dst}{n}" for n, _ in layer.named_parameters() if n not in skip}


def load_published_eagle(target: torch.nn.Module, path) -> EagleHead:
    """An EagleHead holding a published EAGLE-1/2 head (SafeAILab's / vLLM's llama_eagle names)."""
    cfg, tensors = read_checkpoint(path)
    tensors = _strip(tensors, ("model.",))
    n_layers = cfg.get("num_hidden_layers", 1)
    if n_layers != 1:
        raise ValueError(f"{path}: num_hidden_layers {n_layers}; specref's EAGLE head has one decoder layer")
    _check_target(path, "an EAGLE head", target, _layer_checks(path, "EAGLE head", target, cfg))
    V = target.get_output_embeddings().weight.shape[0]
    head = EagleHead(target, torch.arange(V))
    if "fc.bias" not in tensors and not cfg.get("bias", True):
        head.fc.bias = None
    ident = torch.nn.Identity
    head.norm_e, head.norm_f, head.norm = ident(), ident(), ident()  # EAGLE-1/2 have none of these
    skip = () if "layers.0.input_layernorm.weight" in tensors else ("input_layernorm.weight",)
    if skip:
        head.layer.input_layernorm = ident()  # EAGLE-1/2's first layer reads the fc output as it is
    mapping = {"fc.weight": "fc.weight", **({"fc.bias": "fc.bias"} if head.fc.bias is not None else {}),
               **_layer_names(head.layer, "layers.0.", "layer.", skip)}
    _check_embed(path, tensors, target)
    _copy_into(path, "EAGLE-1/2 head", head, tensors, mapping, optional=("embed_tokens.weight",))
    return head.eval()


def _check_embed(path, tensors, target) -> None:
    """A head's own embed_tokens (a frozen copy of the target's) must have the target's shape; the
    target's embedding is used."""
    e = tensors.get("embed_tokens.weight")
    w = target.get_input_embeddings().weight
    if e is not None and tuple(e.shape) != tuple(w.shape):
        raise ValueError(f"{path}: embed_tokens.weight has shape {tuple(e.shape)}, the target's embedding "
                         f"{tuple(w.shape)}: a head for another target")


class PublishedEagle3Head(Eagle3Head):
    """Eagle3Head with the published EAGLE-3 layer: attention over [Norm_e(e); Norm_h(g)] (2D
    wide q/k/v), residual g; the output a (pre-norm) is fed back, logits = LMHead(Norm(a)).
    `fc` is `fuse` (the 3D -> D fusion), so the proposers' device/dtype reads work unchanged."""

    def __init__(self, target: torch.nn.Module, token_map: torch.Tensor, layers):
        super().__init__(target, token_map, layers=layers)
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


def load_published_eagle3(target: torch.nn.Module, path) -> PublishedEagle3Head:
    """A PublishedEagle3Head holding a published EAGLE-3 head (SafeAILab's cnets / vLLM's llama_eagle3)."""
    cfg, tensors = read_checkpoint(path)
    tensors = _strip(tensors, ("model.",))
    tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t for n, t in tensors.items()}
    L = int(target.config.num_hidden_layers)
    _check_target(path, "an EAGLE-3 head", target, _layer_checks(path, "EAGLE-3 head", target, cfg)
                  + [("target_hidden_size", cfg.get("target_hidden_size"), target.config.hidden_size)])
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    if any(not 0 <= int(i) < L for i in ids):
        raise ValueError(f"{path}: the head reads the states entering layers {list(ids)}, but the target has {L} "
                         "layers (set eagle_config.eagle_aux_hidden_state_layer_ids in its config.json)")
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()  # (Vd,) target id - draft id
        token_map = torch.arange(d2t.numel()) + d2t  # (Vd,)
    else:
        token_map = torch.arange(target.get_output_embeddings().weight.shape[0])
    t2d = tensors.get("t2d")
    V = target.get_output_embeddings().weight.shape[0]
    if t2d is not None and (t2d.numel() != V or int(t2d.bool().sum()) != token_map.numel()):
        raise ValueError(f"{path}: t2d covers {t2d.numel()} target tokens ({int(t2d.bool().sum())} drafted); "
                         f"the target has {V}, d2t {token_map.numel()}")
    if t2d is not None and not bool(t2d.bool()[token_map.clamp(0, V - 1)].all()):
        raise ValueError(f"{path}: d2t and t2d disagree")
    head = PublishedEagle3Head(target, token_map, layers=tuple(int(i) for i in ids))
    mapping = {"fc.weight": "fuse.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
               "midlayer.input_layernorm.weight": "norm_e.weight", "midlayer.hidden_norm.weight": "norm_f.weight",
               **_layer_names(head.layer, "midlayer.", "layer.")}
    _check_embed(path, tensors, target)
    _copy_into(path, "EAGLE-3 head", head, tensors, mapping, optional=("embed_tokens.weight", "d2t", "t2d"))
    return head.eval()


def load_published_medusa(target: torch.nn.Module, path) -> MedusaHeads:
    """MedusaHeads holding FasterDecoding's Medusa-1 heads (each with its own LM head); the tree is
    config.json's `medusa_choices` when present (else MedusaConfig's default)."""
    cfg, tensors = read_checkpoint(path)
    tensors = _strip(tensors, ("medusa_head.",))
    n_heads, n_layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers")
    if n_heads is None or n_layers is None:
        raise ValueError(f"{path}: config.json needs medusa_num_heads and medusa_num_layers")
    V, D = target.get_output_embeddings().weight.shape
    lm = tensors.get(f"0.{n_layers}.weight")
    if lm is not None:
        _check_target(path, "Medusa heads", target, [("hidden_size", lm.shape[1], D), ("vocab_size", lm.shape[0], V)])
    heads = MedusaHeads(target, int(n_heads), None, num_layers=int(n_layers), own_lm_head=True)
    mapping = {}
    for i in range(int(n_heads)):
        for j in range(int(n_layers)):
            for w in ("weight", "bias"):
                mapping[f"{i}.{j}.linear.{w}"] = f"blocks.{i}.{j}.linear.{w}"
        mapping[f"{i}.{n_layers}.weight"] = f"lm_heads.{i}.weight"
    _copy_into(path, "Medusa heads", heads, tensors, mapping)
    if cfg.get("medusa_choices"):
        heads.choices = check_choices(cfg["medusa_choices"], heads.num_heads)
    return heads.eval()


# ----------------------------------------------------------------------------- DeepSeek-V3's MTP layers


def _native_tensors(src, first_layer: int) -> Dict[int, Dict[str, torch.Tensor]]:
    """{layer index >= first_layer: {name inside the layer: tensor}} of the tensors named
    model.layers.<i>.* in a state dict, a .safetensors file or a folder of them (read once)."""
    def wanted(name: str):
        parts = name.split(".", 3)
        ok = (len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
              and int(parts[2]) >= first_layer)
        return (int(parts[2]), parts[3]) if ok and "rotary_emb" not in parts[3] else None

    out: Dict[int, Dict[str, torch.Tensor]] = {}
    if isinstance(src, dict):
        items = src.items()
    else:
        from safetensors import safe_open

        p = Path(src)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files or not files[0].is_file():
            raise ValueError(f"{src} is neither a state dict, a .safetensors file nor a folder holding some")
        items = []
        for f in files:
            with safe_open(str(f), framework="pt") as s:
                items += [(n, s.get_tensor(n)) for n in s.keys() if wanted(n)]
    for name, t in items:
        w = wanted(name)
        if w is not None:
            out.setdefault(w[0], {})[w[1]] = t
    return out


def load_native_mtp(target: torch.nn.Module, state_dict_or_path: Union[dict, str, Path], *,
                    num_modules: Optional[int] = None, token_map: Optional[torch.Tensor] = None) -> MTPStack:
    """An MTPStack from a checkpoint that ships MTP layers in the DeepSeek-V3 layout: layer
    num_hidden_layers + j is module j, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
    `shared_head.head` and the block's tensors under their decoder-layer names (`embed_tokens`
    optional). Embedding and head stay the target's (shared; a warning if the file's differ); the block
    must have the structure of the target's last layer. ValueError names a missing or misshaped tensor.
    num_modules: the first n MTP layers (None: all found); token_map: a reduced draft vocabulary."""
    n_layers = int(target.config.num_hidden_layers)
    layers = _native_tensors(state_dict_or_path, n_layers)
    found = 0
    while n_layers + found in layers:
        found += 1
    if not found:
        raise ValueError(f"no MTP layer in the checkpoint: expected tensors named model.layers.{n_layers}.* "
                         f"(the layer after the target's {n_layers} decoder layers)")
    n = found if num_modules is None else positive_int(num_modules, "num_modules")
    if n > found:
        raise ValueError(f"num_modules = {n}, but the checkpoint has {found} MTP layer(s)")
    stack = MTPStack(target, token_map, num_modules=n)
    shared = {"embed_tokens.weight": target.get_input_embeddings().weight,
              "shared_head.head.weight": target.get_output_embeddings().weight}
    for j, m in enumerate(stack.layers):
        pre, got = f"model.layers.{n_layers + j}.", layers[n_layers + j]
        want = {"enorm.weight": m.enorm.weight, "hnorm.weight": m.hnorm.weight, "eh_proj.weight": m.eh_proj.weight,
                "shared_head.norm.weight": m.norm.weight, **m.block.state_dict(keep_vars=True)}
        extra = sorted(set(got) - set(want) - set(shared))
        if extra:
            raise ValueError(f"unexpected MTP tensor {pre + extra[0]!r}: the MTP block must have the structure "
                             "of the target's last decoder layer")
        for name in sorted(want) + ["shared_head.head.weight"]:
            if name not in got:
                raise ValueError(f"the checkpoint lacks the MTP tensor {pre + name!r}")
        for name, ref in {**want, **shared}.items():
            if name in got and tuple(got[name].shape) != tuple(ref.shape):
                raise ValueError(f"MTP tensor {pre + name!r} has shape {tuple(got[name].shape)}, "
                                 f"expected {tuple(ref.shape)}")
        with torch.no_grad():
            for name, ref in want.items():
                ref.copy_(got[name].to(device=ref.device, dtype=ref.dtype))
        for name, ref in shared.items():
            if name in got and not torch.allclose(got[name].to(ref), ref.detach(), atol=1e-3, rtol=1e-3):
                warnings.warn(f"{pre + name} differs from the target's; MTP shares the target's, which is used")
    return stack.eval()


# ----------------------------------------------------------------------------- IBM's MLP speculators


CONFIG_FIELDS = ("vocab_size", "emb_dim", "inner_dim", "n_predict", "tie_weights", "scale_input")


def _mlp_checkpoint(src) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config dict, tensors without the `speculator.` prefix) of a folder (config.json and
    *.safetensors) or of a (config, state dict) pair."""
    if isinstance(src, tuple) and len(src) == 2 and isinstance(src[0], dict) and isinstance(src[1], dict):
        config, sd = src
    else:
        from safetensors.torch import load_file

        p = Path(src)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
        if not (p / "config.json").is_file() or not files:
            raise ValueError(f"{src} is not a folder with config.json and *.safetensors, nor a (config, state "
                             "dict) pair")
        config = json.loads((p / "config.json").read_text())
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
    return config, {(n[len("speculator."):] if n.startswith("speculator.") else n): t for n, t in sd.items()}


def load_published_mlp_speculator(target: torch.nn.Module, src: Union[str, Path, tuple], *,
                                  token_map: Optional[torch.Tensor] = None) -> MLPSpeculator:
    """An MLPSpeculator from a checkpoint in the published format (IBM's speculators as vLLM reads
    them): a folder with config.json (MLPSpeculatorConfig's fields; top_k_tokens_per_head and
    n_candidates are read by no one) and safetensors, or a (config dict, state dict) pair.
    vocab_size and emb_dim must be the target's; tied stages may repeat their tensors under every
    index (the first is used). token_map: a reduced draft vocabulary (the rows of each head kept).
    ValueError names a missing, misshaped or unexpected tensor."""
    config, sd = _mlp_checkpoint(src)
    V, D = target.get_output_embeddings().weight.shape
    for name, want in (("vocab_size", V), ("emb_dim", D)):
        if int(config.get(name, -1)) != want:
            raise ValueError(f"config {name} = {config.get(name)!r}, the target's is {want}")
    spec = MLPSpeculator(target, int(config.get("n_predict", 3)), int(config.get("inner_dim", 0)),
                         tie_weights=bool(config.get("tie_weights", False)),
                         scale_input=bool(config.get("scale_input", False)), token_map=token_map)
    want = dict(spec.named_parameters())
    allowed = {f"{m}.{i}.weight" for m in ("emb", "proj", "head", "ln") for i in range(spec.n_predict)} | \
        {f"ln.{i}.bias" for i in range(spec.n_predict)}  # tied: indices past the first are copies, unused
    extra = sorted(set(sd) - allowed)
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} for an MLP speculator with n_predict = {spec.n_predict}")
    with torch.no_grad():
        for name, ref in want.items():
            if name not in sd:
                raise ValueError(f"the checkpoint lacks the MLP speculator tensor {name!r}")
            t = sd[name]
            if name.startswith("head."):
                if tuple(t.shape) != (V, spec.inner_dim):
                    raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {(V, spec.inner_dim)}")
                t = t[spec.token_map.to(t.device)]  # (Vd, d) the draft vocabulary's rows
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            ref.copy_(t.to(device=ref.device, dtype=ref.dtype))
    return spec.eval()
