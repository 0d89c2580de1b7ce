"""Tensors by reference: a weight file whose part under a name prefix is another committed file.

A trained file may hold a copy of another one: Hydra heads on an EAGLE-1 prefix layer (medusa_heads.py,
`prefix="eagle"`) trained with the prefix frozen hold the EAGLE-1 head's tensors unchanged under
`prefix.`. Stored twice, they cost the repository the head's megabytes twice. `link` (`compact(...,
ref=(PREFIX, FILE))`, `python -m specref.weights compact ... --ref PREFIX FILE`) drops them from the
file and records, in its metadata `tensor_refs`, {PREFIX: {"file": FILE's name, "sha256": of FILE's
safetensors bytes}}; `resolve` (every read_weights of the file) puts them back from FILE, found beside
the file or among the committed weights, whichever has those bytes. It refuses to link tensors that
are not FILE's (a prefix that training moved), and to read a file whose FILE has changed since:
the heads were trained on that prefix and mean little on another.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

REFS = "tensor_refs"  # metadata key: {prefix: {"file": name, "sha256": hex}}


def content_sha256(path) -> str:
    """sha256 of a weight file's safetensors bytes (decompressed for .xz: the tensors, not the packing)."""
    from . import _xz_raw

    p = Path(path)
    return hashlib.sha256(_xz_raw(p) if str(p).endswith(".xz") else p.read_bytes()).hexdigest()


def _find(path, name: str, sha: str) -> Path:
    """The referenced file `name` with content `sha`: beside `path`, else among the committed weights."""
    from . import FOLDER

    seen = []
    for folder in dict.fromkeys((Path(path).resolve().parent, FOLDER)):
        cand = folder / name
        if cand.is_file():
            if content_sha256(cand) == sha:
                return cand
            seen.append(str(cand))
    if seen:
        raise ValueError(f"{path} takes tensors from {name} (sha256 {sha[:12]}...), but {', '.join(seen)} "
                         "holds other tensors: it changed after the link was made; rebuild the file or restore "
                         "that one")
    raise ValueError(f"{path} takes tensors from {name}, which is neither beside it nor among the committed weights")


def resolve(path, tensors: Dict[str, torch.Tensor], meta: Dict[str, str],
            names: Optional[Sequence[str]]) -> Dict[str, torch.Tensor]:
    """`tensors` of `path` with the referenced ones added (only those in `names`, if given)."""
    from . import read_weights

    refs = json.loads(meta.get(REFS) or "{}")
    for prefix, r in refs.items():
        want = None if names is None else [n for n in names if n.startswith(prefix)]
        if want == []:
            continue
        sub, _ = read_weights(_find(path, r["file"], r["sha256"]))
        sub = {prefix + k: v for k, v in sub.items() if k != "token_map"}
        tensors.update(sub if want is None else {n: sub[n] for n in want})
    return tensors


def referenced_names(path, meta: Dict[str, str]) -> list:
    """The names of the tensors `path` holds by reference, read from the referenced files' headers."""
    from . import tensor_names

    out = []
    for prefix, r in json.loads(meta.get(REFS) or "{}").items():
        out += [prefix + n for n in tensor_names(_find(path, r["file"], r["sha256"])) if n != "token_map"]
    return out


def link(path, tensors: Dict[str, torch.Tensor], meta: Dict[str, str], prefix: str,
         ref) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, meta) with the tensors under `prefix` dropped and referenced to the file `ref`;
    ValueError unless they are `ref`'s tensors (names; values within a 16-bit copy's rounding)."""
    from . import dequantise, read_weights

    if not prefix or not isinstance(prefix, str):
        raise ValueError(f"a reference needs a non-empty name prefix (e.g. 'prefix.'), got {prefix!r}")
    if meta.get(REFS):
        raise ValueError(f"{path} already references {sorted(json.loads(meta[REFS]))}")
    theirs, their_meta = read_weights(ref)
    if their_meta.get(REFS):
        raise ValueError(f"{ref} references other files itself: link to a file that holds its tensors")
    theirs = dequantise(theirs)
    theirs.pop("token_map", None)
    mine = dequantise({n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
    if set(mine) != set(theirs):
        raise ValueError(f"{path}'s {prefix}* tensors are not {ref}'s (only in the file: "
                         f"{sorted(set(mine) - set(theirs))[:3]}, only in {Path(ref).name}: "
                         f"{sorted(set(theirs) - set(mine))[:3]})")
    for n, b in theirs.items():
        a, b = mine[n].float(), b.float()
        tol = 2.0 ** -10 * b.abs().max().item() + 1e-6  # a 16-bit copy of the same values rounds by <= 2^-11
        if a.shape != b.shape or (a - b).abs().max().item() > tol:
            raise ValueError(f"{path}'s {prefix}{n} is not {Path(ref).name}'s {n}: trained away from it (a frozen "
                             "prefix can be linked; a trained one must be stored)")
    kept = {n: t for n, t in tensors.items() if not n.startswith(prefix)}
    return kept, {**meta, REFS: json.dumps({prefix: {"file": Path(ref).name, "sha256": content_sha256(ref)}})}
