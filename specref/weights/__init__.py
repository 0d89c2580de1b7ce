"""Trained proposer files: the committed weights in this folder, and the code that writes and reads them.

Every learned proposer (the trained draft model, the EAGLE head, Medusa heads, MTP modules, the MLP
speculator) is saved the same way: its trained tensors in ONE safetensors file (never pickle) with
string metadata: a `format` tag naming the kind of file, the `target_fingerprint` of the model it
was trained for, and a JSON `record` of how it was made (data, settings, held-out numbers). Method
modules load their files through this module and training writes them through it, so a method
never imports training code.

Storage: tensors as trained (16-bit), or `int8` (`compact`, what the committed files use): every
2-D floating matrix as int8 with one fp16 scale per row (symmetric absmax, row r = round(W_r / s_r),
s_r = max|W_r| / 127; the scale stored as `NAME.int8_scale`), dequantised into the module's dtype
on load. It halves the files; its effect on agreement with the target is measured before a file
is committed as int8 (docs/experiments/weights.md). `int4` (`compact(..., bits=4)`) goes further: every 2-D
floating matrix whose columns split into groups of GROUP as 4-bit integers q in [-7, 7], two per
byte (column 2j in the low nibble, 2j+1 in the high one, each stored as q + 8), with one fp16
scale per group of a row (s = max|W| / 7 over the group; `NAME.int4_scale`, (R, C / GROUP));
other 2-D matrices as int8 rows. It halves the files again but costs the EAGLE heads, Medusa, MTP
and the draft 0.013-0.036 of agreement (docs/experiments/weights.md, "int4 weight storage"), so none of their
files is int4 throughout; the MLP speculator's is (it lost 0.002). `compact(..., int4=NAMES)` stores
only the named matrices as int4 and the rest as int8 rows (storage `int8+int4`): the draft's file
holds its two MLPs so (0.002 of agreement for 2.4 MB; its LM head as int4 would cost 0.008 more).
A file whose name ends in `.xz` is the same safetensors
bytes xz-compressed (Python's lzma; written so by save_weights, read transparently): on int8 rows
it saves a further ~11%, which is what keeps the tracked tree small. Rebuild a committed file from
the committed corpus: `python -m specref rebuild NAME --work DIR` (training/rebuild.py: the chain
of exports, stores, runs and compactions that made it).

The files committed here (BENCHMARKS.md has the numbers):
  smollm2_135m_draft.safetensors.xz           the trained 2-layer draft of the default model
  smollm2_135m_eagle.safetensors.xz           the EAGLE-1 head of the default model
  smollm2_135m_eagle3.safetensors.xz          the EAGLE-3 head of the default model
  smollm2_135m_medusa.safetensors.xz          the Medusa heads of the default model (and their tree)
  smollm2_135m_hydra.safetensors.xz           Hydra heads on the EAGLE-1 head as their prefix layer
  smollm2_135m_mtp.safetensors.xz             the MTP modules of the default model
  smollm2_135m_mlp_speculator.safetensors.xz  the MLP speculator of the default model (3 tied stages)
"""
from __future__ import annotations

import functools
import hashlib
import json
import lzma
import struct
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

FOLDER = Path(__file__).resolve().parent


def fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits identifying a model's weights: names, shapes and a strided sample of values."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(p.detach().flatten()[::4099].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save_weights(path, tensors: Dict[str, torch.Tensor], meta: Dict[str, str]) -> None:
    """A trained proposer's tensors + string metadata as one safetensors file (atomic, mode 644);
    xz-compressed when `path` ends in `.xz`."""
    from safetensors.torch import save, save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path) + ".tmp"
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if str(path).endswith(".xz"):
        Path(tmp).write_bytes(lzma.compress(save(tensors, metadata=meta), preset=9 | lzma.PRESET_EXTREME))
    else:
        save_file(tensors, tmp, metadata=meta)
    Path(tmp).chmod(0o644)
    Path(tmp).replace(path)


def copy_weights(src, dst) -> None:
    """Copy a file from save_weights to `dst`, compressed or not as `dst`'s name says (`.xz`); tensors
    it references (refs.py) stay references."""
    tensors, meta = read_weights(src, resolve_refs=False)
    save_weights(dst, tensors, meta)


@functools.lru_cache(maxsize=8)
def _xz_bytes(path: str, mtime_ns: int, size: int) -> bytes:
    """The decompressed safetensors bytes of an .xz weight file (cached per file version)."""
    try:
        return lzma.decompress(Path(path).read_bytes())
    except lzma.LZMAError as e:
        raise ValueError(f"{path} is not a valid xz-compressed safetensors file ({e})") from None


def _xz_raw(p: Path) -> bytes:
    """The decompressed bytes of the .xz weight file p (cached per file version)."""
    st = p.stat()
    return _xz_bytes(str(p.resolve()), st.st_mtime_ns, st.st_size)


def _header(raw: bytes) -> dict:
    """The JSON header of safetensors bytes: u64 header length, then the header."""
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


def read_weights(path, names: Optional[Sequence[str]] = None,
                 resolve_refs: bool = True) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, string metadata) of a file from save_weights, plain or `.xz`; names: only these
    tensors (None: all; (): the metadata alone). Tensors the file holds by reference to another
    (refs.py) are read from it unless resolve_refs is False."""
    from safetensors import safe_open
    from safetensors.torch import load

    from .refs import REFS, resolve

    p = Path(path)
    if not str(p).endswith(".xz"):
        with safe_open(str(p), framework="pt") as f:
            meta, keys = dict(f.metadata() or {}), list(f.keys())
            own = keys if names is None else [n for n in names if n in keys or not meta.get(REFS)]
            t = {n: f.get_tensor(n) for n in own}
    else:
        raw = _xz_raw(p)
        meta = dict(_header(raw).get("__metadata__") or {})
        if names is not None and not names:
            return {}, meta
        t = load(raw)
        t = t if names is None else {k: t[k] for k in names if k in t or not meta.get(REFS)}
    if resolve_refs and meta.get(REFS) and (names is None or names):
        t = resolve(path, t, meta, names)
    return t, meta


def tensor_names(path) -> List[str]:
    """The tensor names of a file from save_weights, plain or `.xz`, read from its header alone; those
    it holds by reference (refs.py) too, from the referenced file's header."""
    from safetensors import safe_open

    from .refs import REFS, referenced_names

    p = Path(path)
    if not str(p).endswith(".xz"):
        with safe_open(str(p), framework="pt") as f:
            names, meta = list(f.keys()), dict(f.metadata() or {})
    else:
        header = _header(_xz_raw(p))
        names, meta = [k for k in header if k != "__metadata__"], dict(header.get("__metadata__") or {})
    return names + (referenced_names(path, meta) if meta.get(REFS) else [])


def save_trained(path, module: torch.nn.Module, fmt: str, target_fingerprint: str, record: dict,
                 meta: Dict[str, str] = None, dtype: torch.dtype = torch.float16) -> None:
    """A learned proposer's trainable tensors (`module.trainable()`, in `dtype`) and its token_map
    (int32), with the format tag, the target's fingerprint, the JSON record and any `meta` strings."""
    tensors = {n: q.detach().to(dtype).cpu() for n, q in module.trainable()}
    tensors["token_map"] = module.token_map.to(torch.int32).cpu()
    save_weights(path, tensors, {"format": fmt, "target_fingerprint": target_fingerprint, **(meta or {}),
                                 "record": json.dumps(record)})


def weights_info(path, fmt: str, what: str, how: str) -> dict:
    """The metadata of a file from save_weights, its "record" parsed; ValueError if the file is
    missing ("no {what} at ...; {how}") or of another format than `fmt`."""
    if not Path(path).is_file():
        raise ValueError(f"no {what} at {path}; {how}")
    meta = read_weights(path, names=())[1]
    if meta.get("format") != fmt:
        raise ValueError(f"{path} is not a specref {what} (format {meta.get('format')!r})")
    meta["record"] = json.loads(meta.get("record", "{}"))
    return meta


def warn_if_other_target(path, meta: dict, target: torch.nn.Module) -> None:
    """Warn (not raise) when the file was trained for another target: a draft of the same
    vocabulary stays lossless on any target, it is only accepted less often."""
    if meta.get("target_fingerprint") != fingerprint(target):
        dtype = next(target.parameters()).dtype
        other = "" if dtype == torch.float32 else (
            f", or for this model in another precision (this one is {str(dtype).replace('torch.', '')}: "
            "the fingerprint hashes the weights' exact values)")
        warnings.warn(f"{path} was trained for another target (fingerprint {meta.get('target_fingerprint')})"
                      f"{other}: it stays lossless but may be accepted rarely")


SCALE = ".int8_scale"  # suffix of a row-scale tensor in an int8 file
SCALE4 = ".int4_scale"  # suffix of a group-scale tensor in an int4 file
GROUP = 64  # int4: columns per scale


def to_int8(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Every 2-D floating matrix as int8 rows + an fp16 scale per row (absmax); others unchanged."""
    out = {}
    for n, w in tensors.items():
        if w.is_floating_point() and w.dim() == 2:
            s = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # (R,)
            out[n] = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)  # (R, C)
            out[n + SCALE] = s.to(torch.float16)
        else:
            out[n] = w
    return out


def to_int4(tensors: Dict[str, torch.Tensor], group: int = GROUP) -> Dict[str, torch.Tensor]:
    """Every 2-D floating matrix with C % group == 0 as packed int4 (R, C / 2) uint8 + an fp16
    scale per group of a row (R, C / group); other 2-D floating matrices as to_int8's rows; the
    rest unchanged. The scale is rounded to fp16 before q = round(W / s) is taken, so the stored
    pair reproduces W to within half a step s."""
    if not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"group must be an even int >= 2, got {group!r}")
    out = {}
    for n, w in tensors.items():
        if not (w.is_floating_point() and w.dim() == 2):
            out[n] = w
        elif w.shape[1] % group:
            out.update(to_int8({n: w}))
        else:
            R, C = w.shape
            g = w.float().reshape(R, C // group, group)  # (R, G, group)
            s = (g.abs().amax(dim=-1) / 7.0).clamp_min(1e-6).to(torch.float16)  # (R, G)
            q = torch.round(g / s.float()[..., None]).clamp(-7, 7).to(torch.int16)  # (R, G, group)
            q = (q + 8).reshape(R, C)  # (R, C) in [1, 15]
            out[n] = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # (R, C / 2)
            out[n + SCALE4] = s
    return out


def dequantise(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Undo to_int8 / to_int4 (float32 matrices); tensors without scales are returned as they are."""
    out = {n: w for n, w in tensors.items() if not n.endswith((SCALE, SCALE4))}
    for n in out:
        if n + SCALE in tensors:
            out[n] = out[n].float() * tensors[n + SCALE].float()[:, None]  # (R, C)
        elif n + SCALE4 in tensors:
            p, s = out[n], tensors[n + SCALE4].float()  # (R, C / 2) uint8, (R, G)
            q = torch.stack((p & 15, p >> 4), dim=-1).reshape(p.shape[0], -1).float() - 8  # (R, C)
            out[n] = (q.reshape(*s.shape, -1) * s[..., None]).reshape(q.shape)  # (R, C)
    return out


def compact(path, out=None, bits: int = 8, group: int = GROUP, int4: Optional[Sequence[str]] = None,
            ref: Optional[Tuple[str, str]] = None) -> dict:
    """Rewrite a trained proposer's file in int8 (or int4, bits=4, one scale per `group` columns)
    storage, metadata kept and `storage` added, at `out` (default: in place; a name ending in `.xz`
    is written xz-compressed). An int8 file may be compacted to int4 (dequantised first: its
    rounding, at most half an int8 step, is added); nothing is re-quantised to the same or more bits.

    `int4` (with bits=8): the names of the matrices to store as int4, the rest as int8 rows (storage
    `int8+int4`, the names in the metadata's `int4_tensors`): int4 where the bytes are and it costs
    little, e.g. a model's MLPs (an LM head's logits lose more). From an int8 file the other matrices keep their int8
    values as they are; ValueError for a name that is not a 2-D matrix of the file whose columns
    split into groups of `group`.

    `ref` = (PREFIX, FILE): the tensors under PREFIX are FILE's (a frozen copy of another weight file):
    drop them and reference FILE instead (refs.py; ValueError if they are not FILE's)."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    out = path if out is None else out
    tensors, meta = read_weights(path, resolve_refs=False)
    if ref is not None:
        from .refs import link

        tensors, meta = link(path, tensors, meta, *ref)
    storage = meta.get("storage")
    if storage == "int8" and bits == 8 and int4 is None or storage in ("int4", "int8+int4"):
        raise ValueError(f"{path} is already {storage}")
    if int4 is not None:
        return _compact_some_int4(path, out, tensors, meta, bits, group, int4)
    if bits == 4:
        save_weights(out, to_int4(dequantise(tensors), group), {**meta, "storage": "int4", "int4_group": str(group)})
    else:
        save_weights(out, to_int8(tensors), {**meta, "storage": "int8"})
    return {"path": str(out), "bytes": Path(out).stat().st_size}


def _compact_some_int4(path, out, tensors, meta, bits, group, int4) -> dict:
    """compact(..., int4=NAMES): the named matrices as int4, every other matrix as int8 rows."""
    names = [int4] if isinstance(int4, str) else list(int4)
    if bits != 8 or not names:
        raise ValueError(f"int4 takes a non-empty list of matrix names, with bits=8 (got bits={bits!r}, int4={int4!r})")
    for n in names:
        w = tensors.get(n)
        matrix = w is not None and w.dim() == 2 and (w.is_floating_point() or n + SCALE in tensors)
        if not matrix or w.shape[1] % group:
            raise ValueError(f"{path}: {n!r} is not a 2-D matrix of the file whose columns split into "
                             f"groups of {group} (shape {None if w is None else tuple(w.shape)})")
    picked = {n: tensors[n] for n in names}
    picked.update({n + SCALE: tensors[n + SCALE] for n in names if n + SCALE in tensors})
    rest = {n: w for n, w in tensors.items() if n not in picked}
    rest = rest if meta.get("storage") == "int8" else to_int8(rest)
    mixed = {**rest, **to_int4(dequantise(picked), group)}
    save_weights(out, mixed, {**meta, "storage": "int8+int4", "int4_group": str(group),
                              "int4_tensors": json.dumps(sorted(names))})
    return {"path": str(out), "bytes": Path(out).stat().st_size}


def load_tensors(path, expected: Dict[str, torch.Tensor], what: str) -> None:
    """Copy the tensors of a file from save_weights into `expected` (name -> parameter), in place,
    converted to each parameter's device and dtype (int8 / int4 files dequantised); ValueError naming
    missing or unexpected names."""
    tensors = dequantise(read_weights(path)[0])
    tensors.pop("token_map", None)
    if set(expected) != set(tensors):
        raise ValueError(f"{path} does not match the {what}'s parameters (missing "
                         f"{sorted(set(expected) - set(tensors))[:3]}, unexpected {sorted(set(tensors) - set(expected))[:3]})")
    with torch.no_grad():
        for n, t in tensors.items():
            expected[n].copy_(t.to(device=expected[n].device, dtype=expected[n].dtype))


def load_token_map(path) -> torch.Tensor:
    """The `token_map` (Vd,) of a trained proposer's file: target ids of its reduced vocabulary."""
    return read_weights(path, ["token_map"])[0]["token_map"].long()  # (Vd,)

