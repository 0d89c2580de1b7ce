"""A toy language model with an exactly known distribution, and a speculative loop over it.

`MarkovLM` is a seeded random Markov table over a small vocabulary: the next-token distribution
depends on the last `order` tokens only (order 1 or 2), so the probability of any continuation,
and the whole joint distribution of the next L tokens (V^L cells), is computable exactly. A
draft is `target.perturb(eps)`: the mixture (1 - eps) p + eps r with an unrelated random table r,
so TV(p, q) <= eps and the acceptance rate sum min(p, q) >= 1 - eps.

`speculative_sample` is Leviathan et al. 2023, Algorithm 1 on these tables, batched over many
independent sequences: draft k tokens from q, score k+1 target rows, `rejection.verify_chain`;
`sample_direct` is plain ancestral sampling from the target. Both take a SamplingConfig, applied
to the table's log-probabilities, so p and q are warped as a real model's would be.
Left out: anything learned; contexts shorter than `order` are left-padded with token 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..rejection import ChainResult, verify_chain
from ..sampling import Generators, SamplingConfig, logits_to_probs, sample

DEFAULT_SAMPLING = SamplingConfig()  # temperature 1, no top-k / top-p: p is the table itself


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 8  # V, small enough to enumerate V^L
    order: int = 1  # tokens of context the next token depends on (1 or 2)
    sharpness: float = 1.0  # scale of the random logits (an inverse temperature): 0 = uniform rows
    seed: int = 0  # seeds the table


def _random_table(vocab: int, order: int, sharpness: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    logits = torch.randn(vocab ** order, vocab, generator=g, dtype=torch.float64) * sharpness
    return torch.softmax(logits, -1)  # (V^order, V)


class MarkovLM:
    """Next-token distribution table[state], state = the last `order` tokens (first most significant)."""

    def __init__(self, table: torch.Tensor, order: int):
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order!r}")
        V = table.shape[-1]
        if table.dim() != 2 or table.shape[0] != V ** order:
            raise ValueError(f"table must be (V^order, V) = ({V ** order}, {V}), got {tuple(table.shape)}")
        if bool((table < 0).any()) or bool(((table.sum(-1) - 1).abs() > 1e-6).any()):
            raise ValueError("table rows must be probability distributions")
        self.table = table.double()  # (V^order, V)
        self.order = order
        self.vocab = V

    @classmethod
    def from_config(cls, cfg: ToyConfig) -> "MarkovLM":
        if cfg.vocab < 2 or cfg.sharpness < 0:
            raise ValueError(f"need vocab >= 2 and sharpness >= 0, got {cfg}")
        return cls(_random_table(cfg.vocab, cfg.order, cfg.sharpness, cfg.seed), cfg.order)

    def perturb(self, eps: float, seed: int, sharpness: float = 1.0) -> "MarkovLM":
        """A draft: (1 - eps) * table + eps * (an independent random table seeded by `seed`)."""
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"eps must be in [0, 1], got {eps!r}")
        other = _random_table(self.vocab, self.order, sharpness, seed)  # (V^order, V)
        return MarkovLM((1.0 - eps) * self.table + eps * other, self.order)

    def states(self, contexts: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """State index (B,) of each row's last `order` tokens before lengths[b] (default T)."""
        B, T = contexts.shape
        lengths = torch.full((B,), T, dtype=torch.long) if lengths is None else lengths.long()
        state = torch.zeros(B, dtype=torch.long, device=contexts.device)  # (B,)
        for j in range(self.order, 0, -1):  # the order-th last token first
            at = lengths - j  # (B,)
            t = contexts.gather(1, at.clamp(min=0)[:, None]).squeeze(1)  # (B,)
            state = state * self.vocab + torch.where(at >= 0, t, 0)  # (B,) BOS pad = token 0
        return state

    def next_probs(self, contexts: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                   sampling: SamplingConfig = DEFAULT_SAMPLING) -> torch.Tensor:
        """p(. | context) (B, V) float32, warped by `sampling` (temperature, top-k, top-p)."""
        rows = self.table[self.states(contexts, lengths)]  # (B, V)
        return logits_to_probs(rows.log(), sampling)  # (B, V)

    def joint_probs(self, prefix: torch.Tensor, L: int,
                    sampling: SamplingConfig = DEFAULT_SAMPLING) -> torch.Tensor:
        """Exact P(next L tokens = s | prefix) for all V^L sequences s, flat (V^L,) float64 in
        oracle.joint_index order (first token most significant)."""
        V = self.vocab
        grid = torch.cartesian_prod(*[torch.arange(V)] * L) if L > 1 else torch.arange(V)[:, None]  # (V^L, L)
        S = grid.shape[0]
        ctx = torch.cat([prefix.long().expand(S, -1), grid], 1)  # (S, T0+L)
        logp = torch.zeros(S, dtype=torch.float64)  # (S,)
        T0 = prefix.shape[-1]
        for i in range(L):  # positions of the continuation
            probs = self.next_probs(ctx, torch.full((S,), T0 + i), sampling).double()  # (S, V)
            probs = probs / probs.sum(-1, keepdim=True)
            logp += probs.gather(1, grid[:, i:i + 1]).squeeze(1).log()
        return logp.exp()  # (V^L,)

    def sequence_prob(self, prefix: torch.Tensor, continuation: torch.Tensor,
                      sampling: SamplingConfig = DEFAULT_SAMPLING) -> float:
        """Exact probability of one continuation (L,) after prefix (T0,)."""
        ctx = torch.cat([prefix.long(), continuation.long()])[None, :]  # (1, T0+L)
        T0, L = prefix.shape[0], continuation.shape[0]
        prob = 1.0
        for i in range(L):
            probs = self.next_probs(ctx, torch.tensor([T0 + i]), sampling).double()[0]  # (V,)
            prob *= float(probs[int(continuation[i])] / probs.sum())
        return prob


def sample_direct(model: MarkovLM, prefix: torch.Tensor, num_tokens: int, batch: int,
                  generator: Generators = None, sampling: SamplingConfig = DEFAULT_SAMPLING) -> torch.Tensor:
    """Ancestral sampling of num_tokens after prefix (T0,) for `batch` rows -> (B, L)."""
    T0 = prefix.shape[0]
    buf = torch.cat([prefix.long().expand(batch, -1), torch.zeros(batch, num_tokens, dtype=torch.long)], 1)
    for i in range(num_tokens):  # autoregressive by nature
        probs = model.next_probs(buf, torch.full((batch,), T0 + i), sampling)  # (B, V)
        buf[:, T0 + i] = sample(probs, generator)
    return buf[:, T0:]  # (B, L)


def speculative_sample(target: MarkovLM, draft: MarkovLM, prefix: torch.Tensor, num_tokens: int,
                       batch: int, k: int, generator: Generators = None,
                       sampling: SamplingConfig = DEFAULT_SAMPLING, draft_greedy: bool = False,
                       verify: Callable[..., ChainResult] = verify_chain):
    """The speculative loop on toy LMs: `batch` independent sequences of num_tokens after prefix.

    Each step: 1. draft k tokens from q (draft_greedy: the draft's argmax, q None); 2. the k+1
    target rows p; 3. `verify(tokens, p, q, lengths=..., generator=...)` (a mutant can be passed in
    tests); 4. append the emitted tokens. Rows that are done get empty drafts. Returns
    (tokens (B, L), forwards (B,) target forwards per row, accepted (B,) accepted drafts per row).
    """
    if k < 0 or num_tokens < 1:
        raise ValueError(f"need k >= 0 and num_tokens >= 1, got k={k}, num_tokens={num_tokens}")
    B, T0, V = batch, prefix.shape[0], target.vocab
    buf = torch.zeros(B, T0 + num_tokens + k + 1, dtype=torch.long)  # (B, T_max)
    buf[:, :T0] = prefix.long()
    length = torch.full((B,), T0, dtype=torch.long)  # (B,)
    rows = torch.arange(B)  # (B,)
    accepted = torch.zeros(B, dtype=torch.long)  # (B,)
    forwards = torch.zeros(B, dtype=torch.long)  # (B,)
    while bool((length < T0 + num_tokens).any()):
        active = length < T0 + num_tokens  # (B,)
        n = torch.where(active, torch.clamp(T0 + num_tokens - 1 - length, min=0, max=k), 0)  # (B,)
        work = buf.clone()  # (B, T_max) committed tokens, then this step's drafts
        # 1. draft
        qs, toks = [], []
        for i in range(k):  # a draft is autoregressive by nature
            qi = draft.next_probs(work, length + i, sampling)  # (B, V)
            xi = qi.argmax(-1) if draft_greedy else sample(qi, generator)  # (B,)
            work[rows, length + i] = xi
            qs.append(qi)
            toks.append(xi)
        pos = torch.arange(k)[None, :]  # (1, k)
        d_tok = torch.stack(toks, 1) if k else torch.zeros(B, 0, dtype=torch.long)  # (B, k)
        d_tok = torch.where(pos < n[:, None], d_tok, -1)  # (B, k)
        q = None if draft_greedy else (torch.stack(qs, 1) if k else torch.zeros(B, 0, V))  # (B, k, V)
        # 2. target rows after 0..k drafts
        p = torch.stack([target.next_probs(work, length + i, sampling) for i in range(k + 1)], 1)  # (B, k+1, V)
        # 3. accept
        res = verify(d_tok, p, q, lengths=n, generator=generator)
        # 4. append the emitted tokens of active rows
        emit = torch.where(active, res.num_accepted + 1, 0)  # (B,)
        j = torch.arange(k + 1)[None, :]  # (1, k+1)
        idx = (length[:, None] + j).clamp(max=buf.shape[1] - 1)  # (B, k+1)
        write = j < emit[:, None]  # (B, k+1)
        buf.scatter_(1, idx, torch.where(write, res.tokens, buf.gather(1, idx)))
        length += emit
        accepted += torch.where(active, res.num_accepted, 0)
        forwards += active.long()
    return buf[:, T0:T0 + num_tokens], forwards, accepted
