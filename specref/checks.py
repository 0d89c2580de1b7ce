"""Validation at the public boundary: what a user passes is checked once, and the error names it.

specref's loop trusts its own parts (the built-in proposers, its internal calls to rejection.py);
what comes from a user is checked before any allocation or forward: the prompts, the sampling
settings, eos ids, seeds and generators, max_new_tokens and max_len, the proposer object, and,
every step, the Draft of a proposer that is not entirely specref's own (a user's class, or a
library class whose methods a user overrode or replaced: `trusted`), its shapes, dtypes, ids in
the vocabulary, lengths, q, parents and sibling kinds. NaN or infinite distributions are reported with the model,
the row and the step at any temperature. ArgumentTypeError (a TypeError that is also a
ValueError) for a wrong type, ValueError for a wrong value; each message names the argument, the value and what is allowed. Accepted as a user would pass
them: Python ints, numpy integers and 0-d integer tensors for ints; lists, tuples, numpy arrays
and 1-d tensors where a sequence is meant.
"""
from __future__ import annotations

import functools
import numbers
import types
from typing import List, Optional

import numpy as np
import torch

from .proposer import AuxBlock, Draft
from .tree import DETERMINISTIC, check_parents, sibling_kinds

PROB_SUM_TOL = 1e-3  # |sum(q) - 1| allowed for a user's draft distribution


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type: a TypeError, and also a ValueError, the one class every user error of specref
    raises (DESIGN.md), so `except ValueError` still catches every bad input."""


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def as_int(value, name: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An int from a Python int, numpy integer or 0-d integer tensor (not a bool, float or str)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {_short(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        rng = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def normalise_ints(cfg, *names: str) -> None:
    """In a frozen config dataclass, numpy integers and 0-d integer tensors in int fields become
    ints (what a user passes from an array); other types are left to the config's own checks."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, np.integer) or (isinstance(v, torch.Tensor) and v.dim() == 0
                                         and not v.is_floating_point() and v.dtype != torch.bool):
            object.__setattr__(cfg, name, int(v))


def as_float(value, name: str) -> float:
    """A float from a Python/numpy number or a 0-d floating tensor (not a bool or str)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {_short(value)}")
    return float(value)


def int_list(value, name: str) -> List[int]:
    """A list of ints from one int-like value or a sequence / 1-d tensor / array of them."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must be an int or a 1-d integer tensor, got {value.dtype} of shape "
                            f"{tuple(value.shape)}")
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, np.ndarray):
        value = value.tolist() if value.ndim else value.item()
    if isinstance(value, (list, tuple)):
        return [as_int(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return [as_int(value, name)]


def eos_ids(eos_token_id, vocab: int) -> List[int]:
    """eos_token_id: None, an id, or a sequence of ids, each in [0, vocab)."""
    if eos_token_id is None:
        return []
    ids = int_list(eos_token_id, "eos_token_id")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"eos_token_id must be token ids in [0, {vocab}) (the target's vocabulary), got {bad}")
    return ids


def seed_value(seed, batch: int) -> int:
    """seed: an int in [0, 2**64 - batch] (rows are seeded seed, seed+1, ...)."""
    return as_int(seed, "seed", 0, 2**64 - max(batch, 1))


def generators(generator, batch: int):
    """generator: None, one torch.Generator, or a list/tuple of exactly `batch` of them."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if not isinstance(generator, (list, tuple)):
        raise ArgumentTypeError(f"generator must be a torch.Generator or a list of one per row, got "
                        f"{type(generator).__name__} {_short(generator)}")
    bad = [i for i, g in enumerate(generator) if not isinstance(g, torch.Generator)]
    if bad:
        raise ArgumentTypeError(f"generator[{bad[0]}] must be a torch.Generator, got {type(generator[bad[0]]).__name__}")
    if len(generator) != batch:
        raise ValueError(f"generator: got {len(generator)} generators for a batch of {batch}; pass one, "
                         "or one per row")
    return list(generator)


def as_token_tensor(x, name: str, mask: bool = False) -> torch.Tensor:
    """input_ids (mask=False: integers only) or an attention mask (any dtype; the caller checks
    its values are 0/1) as a tensor: a tensor, a numpy array or a (nested) list."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, (list, tuple, np.ndarray)):
        try:
            t = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError) as e:
            raise ArgumentTypeError(f"{name} must be a tensor or a rectangular list of ints ({e})") from None
    else:
        raise ArgumentTypeError(f"{name} must be a torch.Tensor (or a list of ints), got {type(x).__name__}")
    if t.is_complex() or (t.is_floating_point() and not mask):
        raise ArgumentTypeError(f"{name} must hold integers, got {t.dtype}")
    return t


def prompt_rows(input_ids, attention_mask, vocab: int) -> List[torch.Tensor]:
    """The prompts, one tensor per row: (B, T) left- or right-padded with an attention mask, or (T,)
    (tensors, arrays or lists of ints); every row non-empty, its ids in [0, vocab)."""
    input_ids = as_token_tensor(input_ids, "input_ids")
    if attention_mask is not None:
        attention_mask = as_token_tensor(attention_mask, "attention_mask", mask=True)
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = None if attention_mask is None else attention_mask.view(1, -1)
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape (B, T) with B >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is None or bool(attention_mask.bool().all()):  # no padding: one check
        if input_ids.shape[1] == 0:
            raise ValueError("prompt row 0 is empty: every row needs at least one token")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): min {lo}, max {hi}")
        return list(input_ids.long())
    rows = []
    for b in range(input_ids.shape[0]):
        r = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
        if r.numel() == 0:
            raise ValueError(f"prompt row {b} is empty: every row needs at least one token")
        if int(r.min()) < 0 or int(r.max()) >= vocab:
            raise ValueError(f"prompt row {b} has token ids outside [0, {vocab}): "
                             f"min {int(r.min())}, max {int(r.max())}")
        rows.append(r.long())
    return rows


# ----------------------------------------------------------------------------- proposers


def check_proposer(proposer) -> int:
    """The proposer contract checked once, before the prefill: an instance with begin / propose /
    update and an int k >= 0. Returns k."""
    if isinstance(proposer, type):
        raise ArgumentTypeError(f"proposer must be an instance, got the class {proposer.__name__}; pass "
                        f"{proposer.__name__}(...)")
    missing = [m for m in ("begin", "propose", "update") if not callable(getattr(proposer, m, None))]
    if missing:
        raise ArgumentTypeError(f"proposer {type(proposer).__name__} lacks the Proposer methods {missing} "
                        "(specref/proposer.py: k, begin, propose, update)")
    if not hasattr(proposer, "k"):
        raise ArgumentTypeError(f"proposer {type(proposer).__name__} has no attribute k (the most draft tokens per step)")
    return as_int(proposer.k, f"{type(proposer).__name__}.k", low=0)


def _own(fn) -> bool:
    """fn (a function, or a method / static / class method / property wrapping one) is defined in a
    specref module."""
    for attr in ("__func__", "fget"):
        fn = getattr(fn, attr, fn)
    return getattr(fn, "__module__", "").startswith("specref.")


def trusted(proposer) -> bool:
    """True when every method the proposer runs is specref's own, so its drafts skip the per-step
    check: each method its class resolves (propose, _propose, _catch_up, the drafting hooks, and every
    other: the library cannot tell which ones a draft depends on) is defined in a specref module, no
    function is set on the instance, and so for its parts (combining proposers list them in `parts`).
    A user's subclass that changes nothing keeps the library's drafts (trusted); one that overrides a
    method, or an instance whose method was replaced, is checked every step (check_draft)."""
    cls = type(proposer)
    if not _own(cls) and not any(_own(k) for k in cls.__mro__):
        return False  # a user's class: no library drafting at all
    seen = set()
    for klass in cls.__mro__[:-1]:  # every class but `object`
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if (callable(attr) or isinstance(attr, (staticmethod, classmethod, property))) and not _own(attr):
                return False  # resolved to a method defined outside specref
    inst = getattr(proposer, "__dict__", {})
    if any(isinstance(v, (types.FunctionType, types.MethodType, functools.partial)) and not _own(v)
           for v in inst.values()):
        return False  # a function set on the instance (a drafting method replaced)
    return all(trusted(p) for p in getattr(proposer, "parts", ()))


def check_siblings(draft, who: str) -> None:
    """The sibling kinds of a tree draft (tree.sibling_kinds) paired with its q, run for every tree
    draft, the library's own included (host-side for a kind name, the library's only form): q given
    needs a kind ("sampled", "without", or one per node), "deterministic" needs q None, no kind is
    ever guessed from q. Chains (no parents) have no siblings."""
    if draft.parents is None:
        return
    s, tok = getattr(draft, "siblings", None), draft.tokens
    B, N = tok.shape
    valid = None
    if not (s is None or isinstance(s, str)):
        valid = torch.arange(N, device=tok.device).view(1, N) < draft.lengths.to(tok.device).view(B, 1)  # (B, N)
    try:
        sibling_kinds(s, draft.q is not None, B, N, tok.device, valid, name="Draft.siblings")
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None


def check_draft(draft, who: str, batch: int, vocab: int, k: int) -> None:
    """A user proposer's Draft, checked before the target sees it (one host sync per check)."""
    if not isinstance(draft, Draft):
        raise ArgumentTypeError(f"{who}.propose() returned {type(draft).__name__}, not a specref Draft")
    tok, n = draft.tokens, draft.lengths
    if not isinstance(tok, torch.Tensor) or tok.dim() != 2 or tok.is_floating_point() or tok.dtype == torch.bool:
        raise ArgumentTypeError(f"{who}: Draft.tokens must be an integer tensor (B, K), got "
                        f"{getattr(tok, 'dtype', type(tok).__name__)} of shape {tuple(getattr(tok, 'shape', ()))}")
    if tok.shape[0] != batch:
        raise ValueError(f"{who}: Draft.tokens has {tok.shape[0]} rows for a batch of {batch}")
    if not isinstance(n, torch.Tensor) or tuple(n.shape) != (batch,) or n.is_floating_point() or n.dtype == torch.bool:
        raise ArgumentTypeError(f"{who}: Draft.lengths must be an integer tensor of shape ({batch},), got "
                        f"{getattr(n, 'dtype', type(n).__name__)} {tuple(getattr(n, 'shape', ()))}")
    N = tok.shape[1]
    n = n.to(tok.device)
    if bool(((n < 0) | (n > N) | (n > max(k, 1))).any()):
        raise ValueError(f"{who}: Draft.lengths must be in 0..min(K, k) = 0..{min(N, max(k, 1))} (K = "
                         f"{N} token columns, k = {k}), got {n.tolist()}")
    valid = torch.arange(N, device=tok.device).view(1, N) < n.view(batch, 1)  # (B, N)
    bad = valid & ((tok < 0) | (tok >= vocab))  # (B, N)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{who}: Draft.tokens[{b}, {i}] = {int(tok[b, i])} is not a token id in [0, {vocab}) "
                         f"(row {b} drafts {int(n[b])} tokens)")
    if draft.parents is not None:
        try:
            check_parents(draft.parents.to(tok.device) if isinstance(draft.parents, torch.Tensor)
                          else draft.parents, valid)
        except ValueError as e:
            raise ValueError(f"{who}: Draft.{e}") from None
    if draft.q is not None:
        used = valid  # (B, N) the q rows that are read: a tree's deterministic nodes have none
        if draft.parents is not None:
            check_siblings(draft, who)
            used = _drawn(draft, who, valid)
        _check_q(draft.q, who, batch, int(n.max()) if batch else 0, vocab, used)
    if draft.aux is not None:
        _check_aux(draft.aux, who, batch, N, vocab)


def _drawn(draft, who: str, valid: torch.Tensor) -> torch.Tensor:
    """The nodes (B, N) of a tree draft with q whose q rows are read: per-node kinds, the non-
    deterministic ones; one kind, every node, and then a q row of zeros (a node with no draft
    distribution: a deterministic node in a mixed tree) is an error naming Draft.siblings."""
    B, N = valid.shape
    kinds = sibling_kinds(draft.siblings, True, B, N, valid.device, valid, name="Draft.siblings")
    if isinstance(kinds, torch.Tensor):
        return valid & (kinds != DETERMINISTIC)  # (B, N)
    q = draft.q
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] == B and q.shape[1] >= N:
        empty = valid & (q[:, :N].float().sum(-1).to(valid.device) == 0)  # (B, N)
        if bool(empty.any()):
            b, i = (int(v) for v in empty.nonzero()[0])
            raise ValueError(f"{who}: Draft.q[{b}, {i}] is all zero under Draft.siblings={kinds!r}: node {i} has no "
                             "draft distribution. A tree mixing deterministic (top-k) nodes with sampled ones gives "
                             "one kind per node: Draft.siblings=[...] with 'deterministic' for them")
    return valid


def _check_q(q, who: str, batch: int, K: int, vocab: int, valid: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() != 3 \
            or q.shape[0] != batch or q.shape[1] < K or q.shape[2] != vocab:
        raise ValueError(f"{who}: Draft.q must be a float tensor (B, K, V) = ({batch}, >= {K}, {vocab}), got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    used = valid[:, :q.shape[1]] if valid.shape[1] >= q.shape[1] else torch.nn.functional.pad(
        valid, (0, q.shape[1] - valid.shape[1]))  # (B, Kq)
    x = q.float()
    rows = x[used.to(q.device)]  # (M, V) the drafted positions' distributions
    for what, bad in (("NaN or infinite", ~torch.isfinite(rows)), ("negative", rows < 0)):
        if bool(bad.any()):
            b, i = (int(v) for v in used.nonzero()[int(bad.any(1).nonzero()[0])])
            raise ValueError(f"{who}: Draft.q[{b}, {i}] is {what}: q must be the distribution each drafted "
                             "token was sampled from")
    off = (rows.sum(-1) - 1).abs() > PROB_SUM_TOL  # (M,)
    if bool(off.any()):
        b, i = (int(v) for v in used.nonzero()[int(off.nonzero()[0])])
        raise ValueError(f"{who}: Draft.q[{b}, {i}] sums to {float(x[b, i].sum()):.6f}, not 1: q must be "
                         "probabilities (not logits)")


def _check_aux(aux, who: str, batch: int, N: int, vocab: int) -> None:
    if not isinstance(aux, AuxBlock):
        raise ArgumentTypeError(f"{who}: Draft.aux must be an AuxBlock, got {type(aux).__name__}")
    t = aux.tokens
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != batch or t.is_floating_point() \
            or bool(((t < 0) | (t >= vocab)).any()):
        raise ValueError(f"{who}: Draft.aux.tokens must be token ids in [0, {vocab}) of shape ({batch}, E)")
    E = t.shape[1]
    if tuple(aux.mask.shape) != (batch, E, 1 + N + E) or aux.mask.dtype != torch.bool:
        raise ValueError(f"{who}: Draft.aux.mask must be bool ({batch}, {E}, {1 + N + E}), got "
                         f"{aux.mask.dtype} {tuple(aux.mask.shape)}")
    if tuple(aux.depth.shape) != (batch, E) or aux.depth.is_floating_point() or bool((aux.depth < 1).any()):
        raise ValueError(f"{who}: Draft.aux.depth must be integers >= 1 of shape ({batch}, {E})")


# ----------------------------------------------------------------------------- distributions


def finite_or_raise(step: int, who: str, logits: Optional[torch.Tensor] = None,
                    p: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None) -> None:
    """One host sync for a step's distributions: the target's logits (greedy decoding: NaN has no
    argmax), its distributions p (sampling: NaN or inf after warping) and the draft's q (B, K, V).
    On failure the error names the model, the row and the step."""
    named = [(x, test, what) for x, test, what in (
        (logits, lambda t: torch.isnan(t), "the target's logits are NaN"),
        (p, lambda t: ~torch.isfinite(t), "the target's distribution p (its logits after temperature, "
                                          "top-k, top-p) is NaN or infinite"),
        (q, lambda t: ~torch.isfinite(t), f"the draft distribution q of {who} is NaN or infinite"),
    ) if x is not None]
    if not named:
        return
    flags = torch.stack([test(x).any() for x, test, _ in named])  # (n,) bool
    if not bool(flags.any()):
        return
    x, test, what = named[int(flags.long().argmax())]
    b = int(test(x).flatten(1).any(1).long().argmax())
    raise ValueError(f"{what} in row {b} at step {step}: the model's forward produced NaN/inf logits "
                     "(check its weights and dtype)")
