"""k by batch: each step's draft length chosen from the measured costs at the batch's size.

Leviathan et al. 2023 (Sec. 3.4) price a step of k drafts at 1 + c k target steps because a
memory-bound forward of k + 1 tokens costs about one of 1 token. Batching spends the same spare
compute on more rows: once B rows x (k + 1) tokens make the verify forward compute-bound, its cost
grows with k, and past some B speculation loses to plain decoding (specref's batch bench measures
it). So k is chosen per step, for the rows decoding now: with t_v(B, W) the measured seconds of a
verify forward of B rows x W tokens and t_d(B, k) the proposer's seconds for k drafts of B rows,

    k* = argmax_{k = 0..K}  sum_b E_b(k) / (t_v(B, k + 1) + t_d(B, k)),   E_b(k) = sum_{i=0..k} a_b^i

(Eq. 1's expected tokens per step with row b's acceptance a_b, tracked per row with a decaying
prior: theory.DecayedAcceptance), k = 0 being plain decoding: the proposer is not asked to draft
(it catches up on the committed tokens the next time, as for a row outside ctx.active). A row's
own k below k* saves nothing here (the verify block is padded to the widest row), so per row the
option is confidence: `threshold` ends a row's sampled draft after the first token x_i whose draft
probability q_i(x_i) is below it (x_i kept: the decision to draft x_{i+1} reads only tokens already
drafted, so each verified position is still a draw from its q and the step stays lossless;
dropping x_i itself because of its own q would bias the output, and is not offered).
A k chosen from the costs depends on the rows decoding with a request (their number, their
acceptance), so a sampled output is then the same in distribution whatever B, not token for token.

Lossless: any k per step or per row is a valid draft (a prefix of the chain with its q); the
rejection step is unchanged and each row still draws a fixed K + 1 uniforms per step (K the
wrapped proposer's k), so a request's randomness does not depend on the k chosen. The chi-square
over steps whose k changes per step and per row: tests/test_scheduler.py.
`auto` (picker/auto.py) wraps the picker's pick at the batch size in it, with the costs at B.
Left out: tree proposers (their node budget is their own: eagle_tree.py), costs that depend on the
context length (measured at one cache length).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from .proposer import Context, Draft
from .sampling import Generators, SamplingConfig
from .target import Target, device_sync
from .theory import DecayedAcceptance


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds: verify[B][W - 1] for B rows x W tokens, draft[B][k] for k drafts of B rows
    (draft[B][0] = 0). Batch sizes between two measured ones are interpolated linearly, beyond the
    largest scaled linearly from it."""

    verify: Dict[int, Sequence[float]]  # {B: [t(W=1), t(W=2), ...]} seconds
    draft: Optional[Dict[int, Sequence[float]]] = None  # {B: [0, t(k=1), ...]} seconds; None: free

    def __post_init__(self) -> None:
        if not self.verify or any(not v for v in self.verify.values()):
            raise ValueError("StepCosts.verify needs at least one batch size with at least one width")

    def at(self, B: int, table: Dict[int, Sequence[float]], i: int) -> float:
        sizes = sorted(table)
        i = min(i, min(len(table[s]) for s in sizes) - 1)
        if B <= sizes[0]:
            return float(table[sizes[0]][i]) * (B / sizes[0] if B < sizes[0] else 1.0)
        if B >= sizes[-1]:
            return float(table[sizes[-1]][i]) * B / sizes[-1]
        hi = next(s for s in sizes if s >= B)
        lo = max(s for s in sizes if s <= B)
        if hi == lo:
            return float(table[lo][i])
        w = (B - lo) / (hi - lo)
        return (1 - w) * float(table[lo][i]) + w * float(table[hi][i])

    def step(self, B: int, k: int) -> float:
        """Seconds of one step of k drafts for B rows: verify of k + 1 tokens plus drafting."""
        t = self.at(B, self.verify, k)
        return t + (self.at(B, self.draft, k) if self.draft is not None and k > 0 else 0.0)


@dataclass(frozen=True)
class BatchKConfig:
    """Settings of BatchKProposer."""

    costs: Optional[StepCosts] = None  # None: no cost-based choice (k = the proposer's k every step);
    # any object with step(B, k) -> seconds will do
    threshold: Optional[float] = None  # None: off; else a row's draft ends after its first token whose
    # draft probability q_i(x_i) < threshold (sampled drafts only: a q = None draft is not cut)
    prior_accept: float = 0.6  # the acceptance a row starts from (2 pseudo-observations)
    memory: float = 0.9  # per observed step, the weight of what a row's acceptance knew before


def choose_k(costs: StepCosts, rates: np.ndarray, K: int) -> int:
    """k* in 0..K maximising the rows' expected tokens per second (module docstring). rates (B,) the
    acceptance of the rows decoding now."""
    B = int(rates.shape[0])
    if B == 0:
        return 0
    best, best_k = -1.0, 0
    for k in range(K + 1):
        E = ((1 - rates ** (k + 1)) / np.maximum(1 - rates, 1e-9)).sum()  # sum_b E_b(k)
        v = E / max(costs.step(B, k), 1e-12)
        if v > best:
            best, best_k = v, k
    return best_k


class BatchKProposer:
    """Wraps a chain proposer: each step's k from the costs at the batch's size, a row's draft cut
    at its first unconfident token (optional). Drafts of the wrapped proposer, never changed but cut."""

    def __init__(self, proposer, config: BatchKConfig = BatchKConfig()):
        if not isinstance(config, BatchKConfig):
            raise ValueError(f"config must be a BatchKConfig, got {type(config).__name__}")
        if config.threshold is not None and not 0.0 < config.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] or None, got {config.threshold!r}")
        self.inner, self.config = proposer, config
        self.k = int(proposer.k)  # the widest step; the loop sizes its buffers and draws by it
        self.parts = (proposer,)  # checks.trusted: trusted as far as the wrapped proposer is
        for name in ("vocab_size", "hidden_layers"):
            if getattr(proposer, name, None) is not None:
                setattr(self, name, getattr(proposer, name))
        if not callable(getattr(proposer, "reset_rows", None)):
            self.reset_rows = None  # scheduler.py: static batches, as for the wrapped proposer
        self.acc = DecayedAcceptance(0, config.prior_accept, config.memory)
        self.last_k = self.k  # the k of the last step (what the costs chose)
        self.ks: list = []  # every step's k, for inspection
        self.cuts = 0  # row-steps whose draft the threshold shortened (a 0-d tensor once counted)
        self._drafted = None

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        self.acc = DecayedAcceptance(ctx.tokens.shape[0], self.config.prior_accept, self.config.memory)
        self.ks, self._drafted = [], None
        self.inner.begin(ctx, sampling, generator)

    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden=None) -> None:
        r = rows.cpu().numpy()
        self.acc.hits[r] = 2.0 * self.config.prior_accept
        self.acc.misses[r] = 2.0 * (1.0 - self.config.prior_accept)
        self.inner.reset_rows(ctx, rows, hidden)

    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        k = self.k
        if self.config.costs is not None:
            active = ctx.active.cpu().numpy().astype(bool)  # (B,) the rows decoding now
            k = choose_k(self.config.costs, self.acc.rate[active], self.k)
        self.last_k = k
        self.ks.append(k)
        if k == 0:  # plain decoding: the proposer drafts nothing, and catches up next time
            self._drafted = None
            return Draft.empty(B, dev)
        if k < self.k and getattr(self.inner, "variable_k", False):  # it drafts only k (saves its time)
            self.inner.k = k
            try:
                draft = self.inner.propose(ctx, sampling, generator)
            finally:
                self.inner.k = self.k
        else:
            draft = self.inner.propose(ctx, sampling, generator)
        lengths = draft.lengths.clamp(max=k)  # (B,)
        if self.config.threshold is not None and draft.q is not None and draft.tokens.shape[1]:
            K = draft.tokens.shape[1]
            qx = draft.q.gather(2, draft.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, K) q_i(x_i)
            low = qx < self.config.threshold  # (B, K)
            first = torch.where(low.any(1), low.float().argmax(1) + 1, torch.full_like(lengths, K))  # (B,) kept
            self.cuts = self.cuts + (first < lengths).sum()  # stays on the device
            lengths = torch.minimum(lengths, first)
        K = int(lengths.max()) if B else 0
        tokens = draft.tokens[:, :K]  # (B, K)
        pos = torch.arange(K, device=tokens.device).view(1, K)  # (1, K)
        tokens = torch.where(pos < lengths.view(B, 1).to(tokens.device), tokens, -1)  # (B, K)
        self._drafted = lengths
        return Draft(tokens=tokens, lengths=lengths, q=None if draft.q is None else draft.q[:, :K])

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        if self._drafted is not None:
            n = self._drafted.cpu().numpy()  # (B,)
            acc = num_accepted.cpu().numpy()  # (B,)
            self.acc.observe(acc, (acc < n).astype(np.float64), n > 0)
        self._drafted = None
        self.inner.update(ctx, num_accepted)


@torch.no_grad()
def measure_step_costs(target, batch_sizes: Sequence[int], max_k: int, proposer_factory=None,
                       cache_len: int = 128, reps: int = 5) -> StepCosts:
    """Median seconds of a verify forward of B rows x W tokens (W = 1..max_k + 1) on a cache of
    cache_len tokens per row, and with proposer_factory (k -> a fresh proposer) of its propose() at
    each k, for each B in batch_sizes."""
    t = target if isinstance(target, Target) else Target(target)
    g = torch.Generator().manual_seed(0)
    hi = min(1000, t.vocab_size)
    verify, draft = {}, {} if proposer_factory is not None else None
    for B in batch_sizes:
        cache = t.new_cache(B, cache_len + max_k + 3)
        t.prefill(cache, torch.randint(0, hi, (B, cache_len), generator=g).to(t.device),
                  torch.full((B,), cache_len, device=t.device), logits=False)
        times = {W: [] for W in range(1, max_k + 2)}
        for i in range(reps + 1):
            for W in times:
                blk = torch.randint(0, hi, (B, W), generator=g).to(t.device)  # (B, W)
                device_sync(t.device)
                a = time.perf_counter()
                t.verify_chain(cache, blk)
                device_sync(t.device)
                if i:
                    times[W].append(time.perf_counter() - a)
                cache.commit(torch.zeros(B, dtype=torch.long, device=t.device))
        verify[B] = [statistics.median(times[W]) for W in sorted(times)]
        if draft is not None:
            ids = torch.randint(0, hi, (B, cache_len), generator=g).to(t.device)  # (B, T)
            draft[B] = [0.0] + [_propose_seconds(proposer_factory(k), ids, reps) for k in range(1, max_k + 1)]
    return StepCosts(verify, draft)


def _propose_seconds(proposer, ids: torch.Tensor, reps: int) -> float:
    """Median seconds of proposer.propose() on rows ids (B, T), after begin()."""
    B, T = ids.shape
    ctx = Context(tokens=torch.cat([ids, ids.new_zeros(B, proposer.k + 2)], 1), lengths=torch.full(
        (B,), T, device=ids.device), active=torch.ones(B, dtype=torch.bool, device=ids.device),
        prompt_lengths=torch.full((B,), T, device=ids.device))
    s = SamplingConfig(temperature=0.0)
    proposer.begin(ctx, s, None)
    times = []
    for _ in range(reps + 1):
        device_sync(ids.device)
        a = time.perf_counter()
        proposer.propose(ctx, s, None)
        device_sync(ids.device)
        times.append(time.perf_counter() - a)
        proposer.update(ctx, torch.zeros(B, dtype=torch.long, device=ids.device))
    return statistics.median(times[1:])
