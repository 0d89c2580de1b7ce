"""Reading a published checkpoint as its authors ship it: safetensors, PyTorch pickles read with
`torch.load(weights_only=True)` (tensors and containers only: a pickle that would build any other
object, or run code, is refused before anything of it runs), and sharded checkpoints (an index
file, `*.index.json`, whose `weight_map` names the shard of every tensor).

The authors' own save paths: SafeAILab/EAGLE heads ship `pytorch_model.bin` (a `torch.save` of
the head's state dict) or `model.safetensors`, both with `config.json`; FasterDecoding/Medusa heads
ship `medusa_lm_head.pt` (Medusa-1) or `medusa_lm_head.safetensors` (its version-2 training script),
with `config.json`. `torch.save` keeps shared storage: Medusa's `[ResBlock] * n` writes one block
under n names, which safetensors refuses to write; read as a pickle, each name gets the tensor.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Dict, List, Tuple

import torch

PICKLE = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
WEIGHTS = (".safetensors",) + PICKLE


def load_pickle(path) -> Dict[str, torch.Tensor]:
    """The tensors of a PyTorch pickle, read with weights_only=True; ValueError naming the file and
    why if it holds anything but a (possibly nested) dict of tensors."""
    p = Path(path)
    try:
        sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{p} is refused: it is not a weights-only PyTorch pickle (torch.load(weights_only=True) "
                         f"says: {first}); specref never unpickles arbitrary objects, which can run code") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{p} is refused: it holds {type(sd).__name__}, not a state dict of named tensors")
    return dict(sd)


def load_weights(path) -> Dict[str, torch.Tensor]:
    """The tensors of one .safetensors or pickle file."""
    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    if p.suffix in PICKLE:
        return load_pickle(p)
    raise ValueError(f"{p} is neither a .safetensors file nor a PyTorch pickle ({', '.join(PICKLE)})")


def _from_index(index: Path) -> List[Path]:
    """The shard files an index names (each once, in the index's order)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a checkpoint index (a JSON object with a weight_map): {e}") from None
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise ValueError(f"{index} names shard(s) that are not in {index.parent}: {missing}")
    return [index.parent / s for s in shards]


def weight_files(folder: Path) -> List[Path]:
    """The files holding a folder's tensors: an index's shards, else every .safetensors, else every
    pickle (one format: safetensors win where both are present, as transformers' loading does)."""
    for pattern in ("*.safetensors.index.json", "*.bin.index.json", "*.index.json"):
        found = sorted(folder.glob(pattern))
        if found:
            return _from_index(found[0])
    for exts in ((".safetensors",), PICKLE):
        files = sorted(q for q in folder.iterdir() if q.suffix in exts and q.is_file())
        if files:
            return files
    raise ValueError(f"no weights in {folder}: expected *.safetensors, a PyTorch pickle ({', '.join(PICKLE)}) "
                     "or an index file naming shards")


def read_checkpoint(path) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config.json as a dict ({} if absent), tensors) of a published head: a folder, one weights
    file with its config.json beside it, or an index file."""
    p = Path(path)
    if p.is_dir():
        files, folder = weight_files(p), p
    elif p.is_file() and p.name.endswith(".index.json"):
        files, folder = _from_index(p), p.parent
    elif p.is_file() and p.suffix in WEIGHTS:
        files, folder = [p], p.parent
    else:
        raise ValueError(f"{p} is neither a folder, a weights file ({', '.join(WEIGHTS)}) nor an index file")
    tensors: Dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_weights(f))
    cfg = folder / "config.json"
    return (json.loads(cfg.read_text()) if cfg.is_file() else {}), tensors


def is_published(path) -> bool:
    """True for a folder, a pickle, an index or a safetensors file without specref's format tag."""
    p = Path(path)
    if p.is_dir() or p.suffix in PICKLE or p.name.endswith(".index.json"):
        return True
    if p.suffix != ".safetensors" or not p.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:
        return not str((f.metadata() or {}).get("format", "")).startswith("specref-")


def strip(tensors: Dict[str, torch.Tensor], prefixes) -> Dict[str, torch.Tensor]:
    """The tensors with the first matching prefix removed from each name."""
    out = {}
    for n, t in tensors.items():
        for pre in prefixes:
            if n.startswith(pre):
                n = n[len(pre):]
                break
        out[n] = t
    return out


def check_target(path, what: str, pairs) -> None:
    """ValueError naming every (field, checkpoint value, target value) that differs."""
    bad = [f"{name} {mine} (target: {theirs})" for name, mine, theirs in pairs
           if mine is not None and int(mine) != int(theirs)]
    if bad:
        raise ValueError(f"{path} holds {what} for another target: " + ", ".join(bad))


def copy_into(path, what: str, module: torch.nn.Module, tensors: Dict[str, torch.Tensor],
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
