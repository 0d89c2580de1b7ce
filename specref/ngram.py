"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's last n-gram.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `NgramProposer`) drafts
without a model: take the last n tokens of the committed context, find an earlier occurrence of
them in the same context, and propose the (up to) k tokens that followed it. n runs from max_n
down to min_n: the longest suffix n-gram with any earlier occurrence wins. The draft is
deterministic, so q is one-hot on the drafted tokens (`q=None`, Leviathan et al. 2023 notation).

Which occurrence (checked against vLLM's `_find_longest_matched_ngram_and_propose_tokens`, which
runs KMP over the reversed context): an occurrence is any start s with
context[s:s+n] == context[T-n:T] and s + n <= T - 1, i.e. any position other than the suffix
itself; it may overlap the suffix (in [7,7,7,7] the 2-gram [7,7] occurs at s = 0 and s = 1). vLLM
takes the EARLIEST such s and drafts context[s+n : s+n+k], fewer than k when the context ends
there. `match="latest"` takes the most recent occurrence instead (an option, not vLLM's rule).
Example (vLLM's docstring): [1,2,3,4,2,3], min_n 2, max_n 3, k 4: [4,2,3] has no earlier
occurrence, [2,3] occurs at s = 1, draft [4,2,3] (three tokens: the context ends).

How: instead of a Python-level KMP loop, one vectorised numpy pass over the batch. For every
candidate end e (exclusive) of an occurrence, compare the max_n tokens before e with the last max_n
tokens of the context, position by position (max_n comparisons of a (B, T) array) and take the
length of the run of matches from e backwards: m[e] = longest n <= max_n with context[e-n:e] equal
to the suffix n-gram. The longest n is max over e < T of m[e]; the chosen occurrence is the first
(or last) e with m[e] >= n. O(max_n * T) work per row, linear in T like KMP, and the same answer
as vLLM's KMP (tested against a naive search).

Adaptive draft length (our addition; off by default, so the default is vLLM's stateless rule):
n-gram drafts are nearly free to make but not to verify (each drafted token widens the target's
verify block), and outside copy-heavy text they are mostly rejected. With `adaptive=True` each row
keeps an estimate a of the per-token acceptance rate and drafts the k' <= k tokens that maximise the
expected speed-up of the i.i.d. model (Leviathan et al. 2023, Eq. 1 and Theorem 3.8),
    (1 - a^(k'+1)) / ((1 - a) (1 + c0 + c k')),   k' = 0 meaning no draft (speed-up exactly 1),
with c = `draft_cost`, the verify cost of one more draft token relative to one target step, and
c0 = `verify_cost_fixed`, the extra cost of ANY block of two or more tokens over a one-token step
(on CPUs the kernels of one-row and multi-row matrix products differ: measured here ~0.6 with
torch's default kernels, 0.0-0.14 with target.py's packed linears; about 0 on GPUs).
`costs.measure_verify_cost(target, k)` fits both on the machine at hand. A row drafts only
where the best expected speed-up is at least 1 + `min_gain`. The
estimate comes from "shadow" drafts: the full match continuation is compared with the tokens that
were actually emitted, also where fewer (or no) tokens were drafted; this costs nothing and is an
unbiased sample of acceptance, because for a deterministic draft token x the emitted token equals x
with probability p(x), exactly the acceptance probability min(1, p(x)/q(x)) with q one-hot. Counts
decay by `memory` per observed step, starting from 2 pseudo-observations at rate `prior_accept`
(which decay too, so a row whose drafts keep failing stops drafting: a -> 0 < c).
The rule has no randomness: drafts are a deterministic function of the committed history.

Left out: vLLM's max_model_len clipping (generate.py bounds the block), suffix trees / suffix
automata over many documents, multiple candidates per step (see lookahead.py for an n-gram pool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .checks import normalise_ints
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig
from .theory import DecayedAcceptance, best_draft_length, check_costs

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[int]]


@dataclass(frozen=True)
class NgramConfig:
    """Settings of prompt lookup (vLLM names: prompt_lookup_min/max, num_speculative_tokens)."""

    min_n: int = 2  # shortest suffix n-gram to match (vLLM defaults both to 5; 1 matches noise)
    max_n: int = 5  # longest suffix n-gram to match, tried first (vLLM's default)
    k: int = 5  # the most tokens drafted per row and step (a chain of 5 verifies in ~1.1 steps here)
    match: str = "earliest"  # which occurrence of the n-gram: "earliest" (vLLM) or "latest"
    adaptive: bool = False  # False: always draft min(k, continuation) (vLLM); True: see module doc
    draft_cost: float = 0.04  # c: verify cost of one more token / one target step (measured here:
    # 0.03-0.04 on 2 CPU cores with packed linears, SmolLM2-135M; DESIGN's estimate was ~0.06)
    verify_cost_fixed: float = 0.05  # c0: extra cost of a multi-token block over a 1-token step
    # (measured here 0.0-0.14 with packed linears; ~0.6 without them)
    min_gain: float = 0.05  # adaptive: draft only where the expected speed-up is >= 1 + min_gain
    # (a margin for what the i.i.d. model and the measured costs get wrong)
    memory: float = 0.9  # adaptive: per-step decay of the acceptance counts (~10 steps of memory)
    prior_accept: float = 0.5  # adaptive: prior mean of the per-token acceptance rate a

    def __post_init__(self) -> None:
        normalise_ints(self, "min_n", "max_n", "k")
        _check_nk(self.min_n, self.max_n, self.k)
        if self.match not in ("earliest", "latest"):
            raise ValueError(f"match must be 'earliest' or 'latest', got {self.match!r}")
        check_costs(self)


def _check_nk(min_n: int, max_n: int, k: int) -> None:
    for name, v in (("min_n", min_n), ("max_n", max_n), ("k", k)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n, got min_n={min_n}, max_n={max_n}")


def propose_ngram_batch(
    tokens: ArrayLike, lengths: ArrayLike, *, min_n: int, max_n: int, k: int, match: str = "earliest"
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lookup for a right-padded batch: row b's context is tokens[b, :lengths[b]].

    Returns (draft (B, k) int64 padded with -1, draft_lengths (B,) int64 in 0..k).
    """
    _check_nk(min_n, max_n, k)
    if match not in ("earliest", "latest"):
        raise ValueError(f"match must be 'earliest' or 'latest', got {match!r}")
    tok = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int64)
    lens = np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths, dtype=np.int64)
    if tok.ndim != 2 or lens.shape != (tok.shape[0],):
        raise ValueError(f"tokens must be (B, T) and lengths (B,), got {tok.shape} and {lens.shape}")
    B, T = tok.shape
    if ((lens < 0) | (lens > T)).any():
        raise ValueError(f"lengths must be in 0..{T}, got {lens.tolist()}")
    if T == 0 or B == 0:
        return np.full((B, k), -1, np.int64), np.zeros(B, np.int64)  # (B, k), (B,)
    rows = np.arange(B)  # (B,)
    # suffix n-gram read backwards: suf[b, j] = context[T_b - 1 - j]; -2 past the row's start
    j_ar = np.arange(max_n)  # (n,)
    suf_idx = lens[:, None] - 1 - j_ar  # (B, n)
    suf = np.where(suf_idx >= 0, tok[rows[:, None], suf_idx.clip(min=0)], -2)  # (B, n)
    # context left-padded by max_n sentinels (-1, never equal to a token or to -2)
    padded = np.concatenate([np.full((B, max_n), -1, np.int64), tok], axis=1)  # (B, n+T)
    # m[b, e] = length of the run of matches of context[..e) against the suffix, from e backwards
    run = np.ones((B, T), dtype=bool)  # (B, T), column e = candidate exclusive end
    m = np.zeros((B, T), dtype=np.int64)  # (B, T)
    for j in range(max_n):  # over n-gram positions (max_n <= ~8), not over rows or tokens
        before = padded[:, max_n - 1 - j : max_n - 1 - j + T]  # (B, T): context[e-1-j]
        run &= before == suf[:, j : j + 1]
        m += run
    e_ar = np.arange(T)  # (T,)
    m = np.where(e_ar[None, :] <= lens[:, None] - 1, m, 0)  # an occurrence ends at e <= T_b - 1
    n_best = m.max(axis=1)  # (B,) longest matched n (<= max_n)
    found = n_best >= min_n  # (B,)
    hit = m >= np.maximum(n_best, 1)[:, None]  # (B, T) ends of occurrences of the n_best-gram
    if match == "earliest":
        e_star = hit.argmax(axis=1)  # (B,) first hit
    else:
        e_star = T - 1 - hit[:, ::-1].argmax(axis=1)  # (B,) last hit
    # draft = context[e*, e*+k), clipped at the row's end
    src = e_star[:, None] + np.arange(k)  # (B, k)
    ok = found[:, None] & (src < lens[:, None])  # (B, k)
    draft = np.where(ok, tok[rows[:, None], src.clip(max=T - 1)], -1)  # (B, k)
    return draft, ok.sum(axis=1).astype(np.int64)


def propose_ngram(context: ArrayLike, *, min_n: int, max_n: int, k: int,
                  match: str = "earliest") -> np.ndarray:
    """Prompt lookup for one context (1-D). Returns the draft, 0..k tokens (empty: no match)."""
    ctx = np.asarray(context.cpu() if isinstance(context, torch.Tensor) else context, dtype=np.int64)
    if ctx.ndim != 1:
        raise ValueError(f"context must be 1-D, got shape {ctx.shape}")
    draft, n = propose_ngram_batch(ctx[None, :], np.array([ctx.shape[0]]), min_n=min_n, max_n=max_n,
                                   k=k, match=match)  # (1, k), (1,)
    return draft[0, : int(n[0])]  # (n,)


class NgramProposer:
    """The Proposer protocol for prompt lookup: chain drafts, q = None."""

    def __init__(self, config: NgramConfig = NgramConfig()):
        if not isinstance(config, NgramConfig):
            raise ValueError(f"config must be an NgramConfig, got {type(config).__name__}")
        self.config = config
        self.k = config.k
        self._acc = DecayedAcceptance(0, config.prior_accept, config.memory)  # per-row shadow acceptance
        self._shadow: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    @property
    def acceptance(self) -> np.ndarray:
        """Per-row posterior mean of the per-token acceptance rate a of the n-gram drafts. (B,)"""
        return self._acc.rate  # (B,)

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        self._acc = DecayedAcceptance(ctx.tokens.shape[0], self.config.prior_accept, self.config.memory)
        self._shadow = None

    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden=None) -> None:
        """Rows that took a new request (scheduler.py) start again from the prior acceptance."""
        if self._acc.hits.shape[0] != ctx.tokens.shape[0]:
            return self.begin(ctx, None, None)
        r = rows.cpu().numpy()  # (R,)
        self._acc.hits[r], self._acc.misses[r] = 2.0 * self.config.prior_accept, 2.0 * (1.0 - self.config.prior_accept)

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        cfg = self.config
        B = ctx.tokens.shape[0]
        if self._acc.hits.shape[0] != B:
            self.begin(ctx, sampling, generator)
        lens = ctx.lengths.cpu().numpy().astype(np.int64)  # (B,)
        T = int(lens.max()) if B else 0
        shadow, shadow_len = propose_ngram_batch(
            ctx.tokens[:, :T], lens, min_n=cfg.min_n, max_n=cfg.max_n, k=cfg.k, match=cfg.match
        )  # (B, k), (B,)
        active = ctx.active.cpu().numpy().astype(bool)  # (B,)
        shadow_len = np.where(active, shadow_len, 0)  # (B,)
        self._shadow = (shadow, shadow_len, lens)
        n = shadow_len
        if cfg.adaptive:
            n = np.minimum(n, best_draft_length(self.acceptance, cfg.k, cfg.draft_cost, cfg.verify_cost_fixed,
                                             cfg.min_gain))  # (B,)
        K = int(n.max()) if B else 0
        draft = np.where(np.arange(K)[None, :] < n[:, None], shadow[:, :K], -1)  # (B, K)
        dev = ctx.tokens.device
        return Draft(tokens=torch.as_tensor(draft, dtype=torch.long, device=dev),  # (B, K)
                     lengths=torch.as_tensor(n, dtype=torch.long, device=dev))  # (B,)

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        """Score the shadow draft of the last step against the tokens actually emitted.

        num_accepted is not needed: the emitted tokens (ctx grew by them) carry the same information
        for the drafted positions and also score the shadow tokens that were not drafted.
        """
        if self._shadow is None:
            return
        shadow, shadow_len, old_lens = self._shadow
        self._shadow = None
        new_lens = ctx.lengths.cpu().numpy().astype(np.int64)  # (B,)
        emitted_n = np.clip(new_lens - old_lens, 0, None)  # (B,)
        W = min(int(emitted_n.max()) if emitted_n.size else 0, shadow.shape[1])
        if W == 0:
            return
        idx = old_lens[:, None] + np.arange(W)  # (B, W)
        T = int(new_lens.max())
        tok = ctx.tokens[:, :T].cpu().numpy()  # (B, T)
        emitted = tok[np.arange(len(idx))[:, None], idx.clip(max=T - 1)]  # (B, W) garbage where not seen
        seen = np.minimum(shadow_len, emitted_n).clip(max=W)  # (B,) positions we can score
        valid = np.arange(W)[None, :] < seen[:, None]  # (B, W)
        agree = np.cumprod((emitted == shadow[:, :W]) & valid, axis=1)  # (B, W) matching prefix
        hits = agree.sum(axis=1)  # (B,)
        misses = (hits < seen).astype(np.float64)  # (B,) the first disagreement, if any
        self._acc.observe(hits, misses, seen > 0)
