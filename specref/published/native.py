"""Published multi-token drafters in others' native layouts: DeepSeek-V3's MTP layers (DeepSeek-AI
2024, "DeepSeek-V3 Technical Report", Sec. 2.2) and IBM's MLP speculators (Wertheimer et al. 2024,
"Accelerating Production LLMs with Combined Token/Embedding Speculators"), onto MTPStack and
MLPSpeculator.

- DeepSeek-V3 MTP (`load_native_mtp`): layer num_hidden_layers + j of a checkpoint is MTP module j
  (`enorm`, `hnorm`, `eh_proj`, `shared_head.*` and a decoder layer's tensors) -> MTPStack. Run
  only on tiny random checkpoints written in that layout, not on a real model.
- MLP speculator (`load_published_mlp_speculator`): vLLM's MLPSpeculatorConfig fields (vocab_size,
  emb_dim, inner_dim, n_predict, tie_weights, scale_input) and tensors emb.i / proj.i / head.i /
  ln.i, an optional `speculator.` prefix -> MLPSpeculator.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch

from ..mlp_speculator import MLPSpeculator
from ..mtp import MTPStack, positive_int
from .files import read_checkpoint


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
    weights, files.py's formats) or of a (config, state dict) pair."""
    if isinstance(src, tuple) and len(src) == 2 and isinstance(src[0], dict) and isinstance(src[1], dict):
        config, sd = src
    else:
        p = Path(src)
        if not p.is_dir() or not (p / "config.json").is_file():
            raise ValueError(f"{src} is not a folder with config.json and weights (safetensors, a weights-only "
                             "pickle or an index of shards), nor a (config, state dict) pair")
        config, sd = read_checkpoint(p)
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
