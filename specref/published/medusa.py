"""Published Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads"), as FasterDecoding/Medusa builds and loads them, onto MedusaHeads.

Head i is medusa_num_layers ResBlocks (x + SiLU(W x + b)) and then (Medusa-1, `medusa_model.py`)
its own LM head `medusa_head.{i}.{n}.weight`, or (the layout of the authors' current training
script, config `version` "2", `medusa_model_legacy.py`) no LM head of its own: its logits are the
base model's LM head over the last ResBlock's output. Tensors `medusa_head.{i}.{j}.linear.*`
(the prefix `medusa_head.` optional).

As the authors' loading does:
- the head count is the file's: the authors build five heads whatever the config says ("the
  uploaded config only includes 2 heads", `medusa_model.py`) and load with strict=False; here the
  file's heads are counted, and a config that disagrees is named in a warning;
- `[ResBlock] * n` is ONE block shared n times (the authors' construction), which torch.save writes
  under n names pointing at one storage; each name is read and copied, so a shared-block file loads
  (safetensors cannot hold such a file; their pickles can: files.py reads them weights-only).
"""
from __future__ import annotations

import re
import warnings

import torch

from ..medusa_heads import MedusaHeads
from ..medusa_tree import check_choices
from .files import check_target, copy_into, read_checkpoint, strip

_NAME = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _layout(path, tensors):
    """(heads, ResBlocks per head, own LM heads) counted from the tensor names."""
    heads, blocks, lm = set(), {}, {}
    for n in tensors:
        m = _NAME.match(n)
        if m is None:
            continue
        i, j, what = int(m.group(1)), int(m.group(2)), m.group(3)
        heads.add(i)
        if what.startswith("linear"):
            blocks.setdefault(i, set()).add(j)
        else:
            lm[i] = j
    if not heads:
        raise ValueError(f"{path}: no Medusa head tensors (named [medusa_head.]<i>.<j>.linear.weight)")
    if sorted(heads) != list(range(len(heads))):
        raise ValueError(f"{path}: Medusa heads {sorted(heads)} are not numbered 0..{len(heads) - 1}")
    n_blocks = {len(blocks.get(i, ())) for i in heads}
    if len(n_blocks) != 1 or any(sorted(blocks.get(i, ())) != list(range(len(blocks.get(i, ())))) for i in heads):
        raise ValueError(f"{path}: the Medusa heads have different or gapped ResBlock counts")
    n = n_blocks.pop()
    if lm and (set(lm) != heads or set(lm.values()) != {n}):
        raise ValueError(f"{path}: every head needs its LM head at index {n} (after its {n} ResBlocks), or none")
    return len(heads), n, bool(lm)


def load_published_medusa(target: torch.nn.Module, path) -> MedusaHeads:
    """MedusaHeads holding FasterDecoding's Medusa heads: each with its own LM head (Medusa-1), or
    the version-2 layout reading the target's LM head; the tree is config.json's `medusa_choices`
    when present (else MedusaConfig's default)."""
    cfg, tensors = read_checkpoint(path)
    tensors = strip(tensors, ("medusa_head.",))
    n_heads, n_layers, own = _layout(path, tensors)
    if n_layers < 1:
        raise ValueError(f"{path}: Medusa heads without a ResBlock are not supported (medusa_num_layers >= 1)")
    c_heads, c_layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers")
    if c_layers is not None and int(c_layers) != n_layers:
        raise ValueError(f"{path}: config medusa_num_layers {c_layers}, but the file's heads have {n_layers} "
                         "ResBlocks each")
    if c_heads is not None and int(c_heads) != n_heads:
        warnings.warn(f"{path}: config medusa_num_heads {c_heads}, the file holds {n_heads} heads; the file's "
                      f"{n_heads} are used (the authors' loader builds 5 and loads the file over them)")
    version = str(cfg.get("version", "1" if own else "2"))
    if version == "2" and own:
        raise ValueError(f"{path}: config version 2 (heads read the base model's LM head), but the file holds an "
                         "LM head per head")
    if not own and version != "2":
        raise ValueError(f"{path}: the heads have no LM heads of their own (the version-2 layout), but the config "
                         f"says version {version}")
    V, D = target.get_output_embeddings().weight.shape
    if own:
        lm = tensors[f"0.{n_layers}.weight"]
        check_target(path, "Medusa heads", [("hidden_size", lm.shape[1], D), ("vocab_size", lm.shape[0], V)])
    else:
        check_target(path, "Medusa heads", [("hidden_size", tensors["0.0.linear.weight"].shape[1], D)])
    heads = MedusaHeads(target, n_heads, None, num_layers=n_layers, own_lm_head=own)
    mapping = {}
    for i in range(n_heads):
        for j in range(n_layers):
            for k in ("weight", "bias"):
                mapping[f"{i}.{j}.linear.{k}"] = f"blocks.{i}.{j}.linear.{k}"
        if own:
            mapping[f"{i}.{n_layers}.weight"] = f"lm_heads.{i}.weight"
    copy_into(path, "Medusa heads", heads, tensors, mapping)
    if cfg.get("medusa_choices"):
        heads.choices = check_choices(cfg["medusa_choices"], heads.num_heads)
    return heads.eval()
