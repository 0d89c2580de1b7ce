"""Calling conventions of chain rejection samplers, and what every check shares.

`adapt` turns a sampler written in one of three conventions (specref's, vLLM v1's flattened ragged
layout, a one-row "plain" one) into one batched call (draft, p, q, lengths, generator) -> (tokens
(B, K+1), num_accepted (B,)); a malformed output raises `Malformed`, which the checks report as a
structural failure of the case instead of crashing. `check_args` validates the arguments every
check shares (samples, seed, alpha) with a ValueError naming the argument. `chain_as_tree` turns an
adapted chain sampler into a tree verifier of chains (the chain check's lossless law).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

APIS = ("specref", "vllm", "plain")


class Malformed(Exception):
    """A sampler's output that is not a result (wrong type, shape or count): a structural failure."""


def int_tensor(x, what: str) -> torch.Tensor:
    """x as a long CPU tensor, or Malformed naming `what` (None, floats, ragged lists)."""
    try:
        t = torch.as_tensor(x)
    except Exception as e:
        raise Malformed(f"{what} is not a tensor ({type(x).__name__}: {e})") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise Malformed(f"{what} must hold integer token ids, got {t.dtype}")
    return t.detach().cpu().long()


def check_args(samples, seed, alpha) -> None:
    """ValueError for the arguments every check shares, naming the argument."""
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 8:
        raise ValueError(f"samples must be an int >= 8 (rows per variant), got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


# ---------------------------------------------------------------- adapters: everything -> (tokens, num_accepted)
def adapt(fn: Callable, api: str) -> Callable:
    """Wrap `fn` so that it is called as f(draft (B,K), p (B,K+1,V), q (B,K,V)|None, lengths (B,), generator)
    and returns (tokens (B, K+1) -1 padded, num_accepted (B,)). Conventions:
    - specref: fn(draft_tokens, p, q, *, lengths, generator) -> obj with .tokens/.num_accepted or a tuple;
    - vllm: fn(draft_token_ids (T,), num_draft_tokens (B,) list, draft_probs (T, V)|None,
      target_logits (T + B, V), generator) -> (B, max_k + 1) -1 padded; each request's rows of
      target_logits are consecutive: its drafts' rows then its bonus row; logits = log p (temperature 1);
    - plain: fn(p (L+1, V), q (L, V)|None, draft (L,), generator) -> emitted tokens (a+1,), one row a call.
    generator: one torch.Generator, or (per_row_generators) a list of one per row. Malformed output
    raises Malformed (the check reports it).
    """
    if api == "specref":
        def call(draft, p, q, lengths, gen):
            out = fn(draft, p, q, lengths=lengths, generator=gen)
            if hasattr(out, "tokens") and hasattr(out, "num_accepted"):
                out = (out.tokens, out.num_accepted)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise Malformed(f"expected a ChainResult or (tokens, num_accepted), got {type(out).__name__}")
            return int_tensor(out[0], "tokens"), int_tensor(out[1], "num_accepted").reshape(-1)
    elif api == "vllm":
        def call(draft, p, q, lengths, gen):
            B, K = draft.shape
            pos = torch.arange(K + 1, device=draft.device)  # (K+1,)
            has_draft = pos[:K] < lengths[:, None]  # (B, K)
            has_row = pos < lengths[:, None] + 1  # (B, K+1)
            logits = torch.log(p[has_row])  # (T + B, V), -inf where p = 0
            out = int_tensor(fn(draft[has_draft], lengths.tolist(), None if q is None else q[has_draft], logits, gen),
                             "the output")  # (B, max_k + 1)
            if out.dim() != 2 or out.shape[0] != B or not 1 <= out.shape[1] <= K + 1:
                raise Malformed(f"expected tokens (B, max_k + 1) with B = {B}, max_k <= {K}, got shape {tuple(out.shape)}")
            toks = torch.full((B, K + 1), -1, dtype=torch.long)  # (B, K+1)
            toks[:, : out.shape[1]] = out
            return toks, (toks != -1).sum(1) - 1
    elif api == "plain":
        def call(draft, p, q, lengths, gen):
            B, K = draft.shape
            toks = torch.full((B, K + 1), -1, dtype=torch.long)  # (B, K+1)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one tiny row per call: intra-op threads only add overhead
            try:
                for b in range(B):  # the plain convention is one row per call
                    L = int(lengths[b])
                    g = gen[b] if isinstance(gen, list) else gen
                    y = int_tensor(fn(p[b, : L + 1], None if q is None else q[b, :L], draft[b, :L], g),
                                   f"row {b}'s emitted tokens").reshape(-1)  # (a+1,)
                    if not 1 <= y.numel() <= L + 1:
                        raise Malformed(f"row {b} emitted {y.numel()} tokens; expected 1..{L + 1} "
                                        f"(the accepted drafts, then one more)")
                    toks[b, : y.numel()] = y
            finally:
                torch.set_num_threads(threads)
            return toks, (toks != -1).sum(1) - 1
    else:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    return call


def chain_as_tree(call: Callable) -> Callable:
    """An adapted chain sampler as a tree verifier of chains: (path (B, K), last (B,)); accepted
    tokens that differ from the drafts, a count out of range or bad padding are Malformed."""
    def tree_call(tok, par, lens, P, Q, gens, kind=None, kinds=None):  # a chain: no siblings, kinds unused
        B, K = tok.shape
        toks, acc = call(tok, P, Q, lens, gens)
        if toks.shape != (B, K + 1) or acc.shape != (B,):
            raise Malformed(f"tokens of shape {tuple(toks.shape)} and num_accepted of shape {tuple(acc.shape)}, "
                            f"expected {(B, K + 1)} and {(B,)}")
        lens = lens.cpu().long()  # (B,)
        pos = torch.arange(K + 1)  # (K+1,)
        bad = {"num_accepted outside [0, length]": (acc < 0) | (acc > lens),
               "accepted tokens differ from the drafts": ((pos[None, :K] < acc[:, None]) & (toks[:, :K] != tok.cpu())).any(1),
               "tokens after the emitted ones are not -1": ((pos[None] > acc[:, None]) & (toks != -1)).any(1)}
        for what, mask in bad.items():
            if bool(mask.any()):
                b = int(mask.nonzero()[0])
                raise Malformed(f"{int(mask.sum())}/{B} rows: {what} (e.g. row {b}: length {int(lens[b])}, "
                                f"tokens {toks[b].tolist()}, num_accepted {int(acc[b])})")
        path = torch.where(pos[None, :K] < acc[:, None], pos[None, :K].expand(B, K), -1)  # (B, K)
        return path, toks[torch.arange(B), acc.clamp(0, K)]  # (B, K), (B,)
    return tree_call
