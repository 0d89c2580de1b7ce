"""The calibration's stand-ins: a target that replays a known greedy answer, and the wrappers
that capture features, share one prefill and time a proposer's setup and the verify forwards.

`Replay` (greedy, batch 1): a stand-in target that puts all mass on the answer's next token and
returns the recorded features, so a method's own loop (proposer, acceptance, rollback) runs for
real on a known answer at the cost of its proposer alone; its verify forwards are priced later
from the fitted verify-cost curve (costs.fit_verify_curve) at the widths it logged. Exact for
greedy decoding: a block row off the answer follows a mismatch, which ends the step before that
row's token matters. `Capture` records the target features the loop hands a proposer (the
answer's features for Replay). `SharedPrefill` continues a prefill from the last prefilled
context (the windows of one generation pay only their new tokens). `Timed` times a proposer's
`begin`; `clock_verifies` logs (width, seconds) of every verify forward.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import List, Optional

import torch

from ..target import BlockOutput, Target
from .costs import device_sync

# ----------------------------------------------------------------------------- one shared prefill


def layer_union(sets) -> Optional[tuple]:
    """The target layers of several proposers' `hidden_layers`, in first-seen order (None: none)."""
    out: list = []
    for layers in sets:
        out += [x for x in (layers or ()) if x not in out]
    return tuple(out) or None


def select_layers(hidden: Optional[torch.Tensor], have: Optional[tuple], want: Optional[tuple]):
    """The columns of features (..., len(have) * D) that hold layers `want` (..., len(want) * D)."""
    if hidden is None or want is None or have is None or tuple(want) == tuple(have):
        return None if want is None else hidden
    D = hidden.shape[-1] // len(have)
    return torch.cat([hidden[..., have.index(x) * D: (have.index(x) + 1) * D] for x in want], dim=-1)


class SharedPrefill:
    """A Target whose prefill continues from the last prefilled context when the new one extends
    it row by row: the saved cache is copied and only the new tokens run through the model. The
    calibration's windows are consecutive pieces of one generation, so each window's prefill costs
    its own few tokens, not the whole prompt again."""

    def __init__(self, target: Target, hidden_layers: Optional[tuple]):
        self.target, self.hidden_layers, self.state = target, hidden_layers, None

    def wrap(self) -> Target:
        t = copy.copy(self.target)
        t.prefill = self.prefill
        return t

    def _restore(self, cache) -> torch.Tensor:
        kv, lengths = self.state["kv"], self.state["lengths"]
        for layer, saved in zip(cache.layers, kv):
            if saved is not None:
                k, v = saved
                if not layer.is_initialized:
                    layer.lazy_initialization(k, v)
                layer.keys[:, :, : k.shape[2]].copy_(k)
                layer.values[:, :, : v.shape[2]].copy_(v)
        cache.lengths.copy_(lengths.to(cache.lengths.device))
        return lengths

    def prefill(self, cache, tokens, lengths, logits=True, hidden_layers=None):
        want = self.hidden_layers
        if logits or tokens.shape[1] == 0 or (hidden_layers is not None and (
                want is None or any(x not in want for x in hidden_layers))):
            return self.target.prefill(cache, tokens, lengths, logits=logits, hidden_layers=hidden_layers)
        tok, lens = tokens.cpu(), lengths.cpu()  # (B, T), (B,)
        B, dev = tok.shape[0], tokens.device
        st = self.state
        start = torch.zeros_like(lens)
        if st is not None and st["tokens"].shape[0] == B and bool((st["lengths"] <= lens).all()) and all(
                torch.equal(st["tokens"][b, : int(st["lengths"][b])], tok[b, : int(st["lengths"][b])])
                for b in range(B)):
            start = self._restore(cache)
        ext_len = lens - start  # (B,)
        E = int(ext_len.max())
        hidden = None
        if E > 0:
            ext = torch.zeros(B, E, dtype=torch.long)  # (B, E) right-padded new tokens of each row
            for b in range(B):
                ext[b, : int(ext_len[b])] = tok[b, int(start[b]): int(lens[b])]
            out = self.target.prefill(cache, ext.to(dev), ext_len.to(dev), logits=False, hidden_layers=want)
            hidden = out.hidden
        H = None
        if want is not None:
            D = hidden.shape[-1] if hidden is not None else st["hidden"].shape[-1]
            H = torch.zeros(B, tok.shape[1], D, dtype=self.target.dtype, device=dev)  # (B, T, D)
            for b in range(B):
                s0, n = int(start[b]), int(ext_len[b])
                if s0:
                    H[b, :s0] = st["hidden"][b, :s0]
                if n:
                    H[b, s0: s0 + n] = hidden[b, :n]
        L = int(lens.max())
        self.state = dict(tokens=tok.clone(), lengths=lens.clone(), hidden=H,
                          kv=[(layer.keys[:, :, :L].clone(), layer.values[:, :, :L].clone())
                              if layer.is_initialized else None for layer in cache.layers])
        V = self.target.vocab_size
        return BlockOutput(logits=torch.zeros(B, 0, V, device=dev), hidden=select_layers(H, want, hidden_layers))


class Replay(Target):
    """A stand-in target that replays one known greedy generation z (prompt + answer, (T,)) and its
    recorded features (T-1, D): a verify block's row at position t gets all its mass on z[t+1], the
    target's own greedy choice there, and the features at t. A method's loop then runs for real
    (its proposer, the acceptance rule, the rollback, the bookkeeping) while the target's forwards
    cost nothing; what they would cost comes from the fitted verify-cost curve (fit_verify_curve)
    at the widths logged in `widths`. Exact for greedy decoding: a row off the trajectory follows a mismatch,
    which ends the step before its token matters. Not for lookahead (it reads the target's logits
    on its own window) or T > 0."""

    def __init__(self, target: Target, z: torch.Tensor, feats: Optional[torch.Tensor],
                 layers: Optional[tuple] = None):
        self.base, self.z, self.feats = target, z, feats  # (T,), (T - 1, len(layers) * D) or None
        self.layers = layers  # the target layers feats holds (each proposer gets its own)
        for name in ("model", "config", "vocab_size", "device", "dtype", "max_positions", "packed"):
            setattr(self, name, getattr(target, name))
        self.num_layers = 0  # the cache only counts committed tokens
        self.widths: List[int] = []
        self.seconds = 0.0  # the stand-in's own time (taken out of the loop's measured time)

    def session(self):
        return self.base.session()  # the proposers' heads run as they would with the real target

    def _rows(self, positions: torch.Tensor, hidden_layers) -> BlockOutput:
        B, Q = positions.shape
        nxt = self.z[(positions + 1).clamp(max=self.z.shape[0] - 1)]  # (B, Q) the target's choices
        logits = torch.zeros(B, Q, self.vocab_size, device=self.device)
        logits.scatter_(2, nxt.unsqueeze(-1), 30.0)
        hidden = None
        if hidden_layers is not None and self.feats is not None:
            hidden = select_layers(self.feats[positions.clamp(max=self.feats.shape[0] - 1)], self.layers,
                                   hidden_layers)  # (B, Q, D_h)
        return BlockOutput(logits=logits, hidden=hidden)

    def prefill(self, cache, tokens, lengths, logits=True, hidden_layers=None):
        t0 = time.perf_counter()
        B, T = tokens.shape
        cache.begin_block(T)
        cache.commit(lengths)
        hidden = None if hidden_layers is None or self.feats is None else \
            select_layers(self.feats[:T], self.layers, hidden_layers).unsqueeze(0).expand(B, -1, -1)  # (B, T, D_h)
        self.seconds += time.perf_counter() - t0
        return BlockOutput(logits=torch.zeros(B, 0, self.vocab_size, device=self.device), hidden=hidden)

    def verify_chain(self, cache, block, pad_to=None, hidden_layers=None, committed_max=None):
        t0 = time.perf_counter()
        Q = block.shape[1]
        self.widths.append(Q)
        L = cache.lengths.clone()  # (B,)
        cache.begin_block(Q, committed_max)
        out = self._rows(L.view(-1, 1) + torch.arange(Q, device=L.device), hidden_layers)  # (B, Q)
        self.seconds += time.perf_counter() - t0
        return out

    def verify_tree(self, cache, block, ancestors, depth, hidden_layers=None, committed_max=None, pad_to=None):
        t0 = time.perf_counter()
        Q = block.shape[1]
        self.widths.append(Q)
        L = cache.lengths.clone()
        cache.begin_block(Q, committed_max)
        out = self._rows(L.view(-1, 1) + depth, hidden_layers)  # (B, Q)
        self.seconds += time.perf_counter() - t0
        return out


class Capture:
    """A proposer wrapper that records the target features the loop hands it (ctx.hidden after the
    prefill and after every step) at their positions: the answer's features for Replay."""

    def __init__(self, proposer, hidden_layers: tuple, length: int, dim: int, dtype, device):
        self.p, self.feats = proposer, torch.zeros(length, dim * len(hidden_layers), dtype=dtype,
                                                   device=device)  # (T, len(layers) * D)
        self.hidden_layers = hidden_layers  # asked for even if the wrapped proposer reads none (or fewer)
        self.own = getattr(proposer, "hidden_layers", None)  # what the wrapped proposer is handed
        for name in ("k", "vocab_size", "acceptance_rule"):
            if hasattr(proposer, name):
                setattr(self, name, getattr(proposer, name))

    def _store(self, ctx) -> None:
        if ctx.hidden is None:
            return
        n = int(ctx.hidden_len[0])
        start = int(ctx.lengths[0]) - 1 - n
        self.feats[start: start + n] = ctx.hidden[0, :n].to(self.feats)

    def _own(self, ctx):
        return dataclasses.replace(ctx, hidden=select_layers(ctx.hidden, self.hidden_layers, self.own))

    def begin(self, ctx, sampling, generator) -> None:
        self._store(ctx)
        self.p.begin(self._own(ctx), sampling, generator)

    def propose(self, ctx, sampling, generator):
        return self.p.propose(ctx, sampling, generator)

    def update(self, ctx, num_accepted) -> None:
        self._store(ctx)
        self.p.update(self._own(ctx), num_accepted)


class Timed:
    """A proposer whose begin() (its per-request setup) is timed."""

    def __init__(self, proposer):
        self.proposer, self.begin_s = proposer, 0.0
        begin = proposer.begin

        def timed(*a, **kw):
            t0 = time.perf_counter()
            begin(*a, **kw)
            self.begin_s += time.perf_counter() - t0
        proposer.begin = timed


def clock_verifies(tgt, log: list) -> None:
    """Time every verify forward of `tgt` (a wrapped copy): (block width, seconds) into `log`."""
    for name in ("verify_chain", "verify_tree"):
        fn = getattr(tgt, name)

        def timed(cache, block, *a, _fn=fn, **kw):
            device_sync(tgt.device)
            t0 = time.perf_counter()
            out = _fn(cache, block, *a, **kw)
            device_sync(tgt.device)
            log.append((int(block.shape[1]), time.perf_counter() - t0))
            return out
        setattr(tgt, name, timed)
