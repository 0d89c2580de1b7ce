"""Pre-packed oneDNN linear layers for CPU inference: a block of Q tokens costs about one token.

Speculative decoding pays off only if scoring a block of Q = k+1 tokens costs little more than
scoring one token (Leviathan et al. 2023, Sec. 3.4: the cost ratio of a forward of k+1 tokens to a
forward of one). On a GPU that holds by memory-boundedness. On a CPU it does not with the default
kernel: torch's fp32 `F.linear` calls MKL sgemm, which re-packs the weight matrix on every call
with more than one row; measured here (2 cores, SmolLM2-135M, fp32) a 2-token forward cost 1.6-1.7x
a 1-token forward and a 4-token forward 1.7-2.1x. Packing each weight once into oneDNN's blocked
layout (what torch.compile's inductor does for frozen CPU linears) makes the 1/2/4/8-token forwards
cost 82/101/116/127 ms instead of 81/137/166/167 ms.

`PackedLinears(model)` packs every fp32 (and, where supported, bf16) `nn.Linear` of a model once;
`with packed.active():` swaps their forwards for the packed kernel and restores the originals on
exit, so the user's model object is left unchanged for other code (e.g. transformers' generate). The
packed copy costs one extra copy of the linear weights in memory. A layer whose weight changes (in
place or replaced) is repacked on the next outermost `active()`. One-row inputs use the packed
kernel too: on the default model's shapes it reads the weights faster than MKL's gemv (30 layers of
linears + LM head, 2 threads: 61 vs 77 ms median), and its rows are bit-for-bit independent of how
many rows are computed together (checked for M = 1, 2, 11), so a token scored alone (autoregressive
decoding) and the same token scored inside a verify block get the same linear outputs. That held for
every M on AVX2 machines; on AVX-512 (AMD Zen 4) one-row products with K = 1536 take another kernel,
so each shape is probed (`one_row_differs`) and where a row alone differs, a one-row input is
computed as a block of two, which takes the block kernel (measured no slower there: 57 vs 78 us for
the 1536 x 576 layer in fp32; rows 2..8 always agreed with the block). Results differ from
`F.linear`'s by fp32 rounding (the summation order differs). A layer shared by two models
(`truncated_draft`) is packed once per model and stays swapped in while either packing is active.
bf16 weights are packed too where the CPU supports oneDNN's bf16 path (`packable_dtypes()`); on an
AMD EPYC (Zen 4, AVX-512 BF16, 2 threads) a packed bf16 linear cost 33/37 us for 1/4 rows of 576 x
1536 against 55/58 us packed fp32 and 66/80 us bf16 `F.linear`, and the LM head 1.8 ms against 5.0
ms (fp32 packed). fp16 only where oneDNN has an fp16 path (AVX-512 FP16, AVX-NE-CONVERT). Used by
target.py on CPU (TargetConfig.pack_linears) and by the learned proposers (`pack_on_cpu`, `packed`). Left out: training (with autograd enabled a layer
falls back to F.linear), GPUs (not needed).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Dict, Iterator

import torch
from torch import nn


def packing_available() -> bool:
    """True if this torch build has the oneDNN (mkldnn) CPU linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.lru_cache(maxsize=None)
def packable_dtypes() -> tuple:
    """The weight dtypes oneDNN packs on this CPU: float32 always; bfloat16 and float16 where the
    CPU has the instructions oneDNN needs for them (bf16: AVX-512 BF16 / AMX or a fast emulation;
    fp16: AVX-512 FP16 or AVX-NE-CONVERT; torch refuses to pack fp16 elsewhere)."""
    out = [torch.float32]
    ops = torch.ops.mkldnn
    if hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported():
        out.append(torch.bfloat16)
    if hasattr(ops, "_is_mkldnn_fp16_supported") and ops._is_mkldnn_fp16_supported():
        out.append(torch.float16)
    return tuple(out)


def _eligible(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype in packable_dtypes()


def tensor_version(t) -> tuple:
    """(storage address, in-place version) of a tensor: changes when it is modified in place or
    replaced. Inference tensors keep no version counter: only a replacement is seen."""
    return None if t is None else (t.data_ptr(), -1 if t.is_inference() else t._version)


# how many active packings swap each layer in: layers shared by two models (truncated_draft)
# are swapped in by the first and restored by the last to leave
_ACTIVE: "weakref.WeakKeyDictionary[nn.Linear, int]" = weakref.WeakKeyDictionary()


# (in, out, dtype, bias, threads) -> does a row alone take other bits than inside a block?
_ONE_ROW_DIFFERS: Dict[tuple, bool] = {}


def one_row_differs(weight: torch.Tensor, bias, n_in: int, n_out: int) -> bool:
    """True if the packed kernel gives a row alone other bits than the same row inside a block.

    oneDNN picks its kernel by shape, dtype and CPU: on AVX-512 (AMD Zen 4) a one-row product with
    K = 1536 (the default model's down projection) takes another path than two or more rows (fp32:
    every row differs; bf16: 2-11 rows of 64 once rounded), while on AVX2 machines every row count
    agreed. Probed with 64 rows alone against the block, once per shape, dtype and thread count."""
    key = (n_in, n_out, weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _ONE_ROW_DIFFERS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, n_in, generator=g).to(weight.dtype)  # (64, in)
        linear = torch.ops.mkldnn._linear_pointwise
        with torch.no_grad():
            block = linear(x, weight, bias, "none", [], "")  # (64, out)
            _ONE_ROW_DIFFERS[key] = any(not torch.equal(linear(x[j: j + 1], weight, bias, "none", [], ""),
                                                        block[j: j + 1]) for j in range(64))
    return _ONE_ROW_DIFFERS[key]


def _packed_forward(m: nn.Linear, weight: torch.Tensor, bias, pad_one_row: bool):
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out)
        if torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad):
            return nn.functional.linear(x, m.weight, m.bias)  # autograd: the packed op has no backward
        if pad_one_row and x.numel() == x.shape[-1]:  # one row: computed as a block of two, so that
            two = x.reshape(1, -1).expand(2, -1)  # it takes the block kernel (the bits of a verify)
            return linear(two, weight, bias, "none", [], "")[:1].reshape(*x.shape[:-1], -1)  # (..., out)
        return linear(x, weight, bias, "none", [], "")
    return forward


class PackedLinears:
    """The fp32 (bf16 where supported) CPU `nn.Linear` layers of a model, packed once for oneDNN.

    `PackedLinears.of(model)` returns the one packing of a model (kept while the model lives), so
    every Target built on it, one per generate call or a draft sharing the target, shares it."""

    _of: "weakref.WeakKeyDictionary[nn.Module, PackedLinears]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: nn.Module) -> "PackedLinears":
        packed = cls._of.get(model)
        if packed is None:  # the value holds the model's layers, not the model: the key can die
            packed = cls._of[model] = cls(model)
        return packed

    def __init__(self, model: nn.Module):
        if not packing_available():
            raise ValueError("this torch build has no oneDNN (mkldnn) linear ops: cannot pack linears")
        self._forwards: Dict[nn.Linear, object] = {}
        self._versions: Dict[nn.Linear, tuple] = {}  # weights changed since packing -> repack
        self._depth = 0  # nesting of active()
        for m in model.modules():
            if _eligible(m):
                self._pack(m)

    def _pack(self, m: nn.Linear) -> None:
        w = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
        b = None if m.bias is None else m.bias.detach()
        self._forwards[m] = _packed_forward(m, w, b, one_row_differs(w, b, m.in_features, m.out_features))
        self._versions[m] = self._version_of(m)

    @staticmethod
    def _version_of(m: nn.Linear) -> tuple:
        return tensor_version(m.weight), tensor_version(m.bias)

    def __len__(self) -> int:
        return len(self._forwards)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, every packed layer runs the packed kernel (repacked first if its weight
        was modified in place or replaced since it was packed). Re-entrant: a nested `active()`
        costs nothing, so a generation loop can enter it once around all its forwards."""
        if self._depth == 0:
            for m in list(self._forwards):
                if self._versions[m] != self._version_of(m):  # modified, replaced, moved or cast
                    if _eligible(m):
                        self._pack(m)
                    else:  # now on another device or in another dtype: no longer ours to pack
                        del self._forwards[m], self._versions[m]
            for m, f in self._forwards.items():  # a layer shared with another model's packing
                n = _ACTIVE.get(m, 0)             # (truncated_draft) keeps the forward installed first
                if n == 0:
                    m.__dict__["forward"] = f  # instance attribute shadows nn.Linear.forward
                _ACTIVE[m] = n + 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for m in self._forwards:  # unchanged while active: repacking happens on entry
                    n = _ACTIVE.pop(m) - 1
                    if n:
                        _ACTIVE[m] = n
                    else:
                        m.__dict__.pop("forward", None)


def pack_on_cpu(module: nn.Module, device: torch.device) -> "PackedLinears | None":
    """A proposer's linears packed once when it runs on a CPU with oneDNN; None elsewhere."""
    return PackedLinears.of(module) if device.type == "cpu" and packing_available() else None


def packed(p: "PackedLinears | None"):
    """`with packed(p):` p's packed kernels active (p.active()), or nothing when p is None."""
    return p.active() if p is not None else contextlib.nullcontext()
