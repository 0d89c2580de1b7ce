"""Block verification: the optimal lossless verifier of one drafted chain.

Sun et al. 2025, "Block Verification Accelerates Speculative Decoding" (ICLR 2025), Algorithm 2.
Token-wise verification (rejection.verify_chain) accepts draft X_i with min(1, p(X_i) / q(X_i)) on
its own and stops at the first rejection. Block verification judges the drafted block as a whole,
from the end: with M_b = p the target, M_s = q the draft and eta_i ~ U(0, 1),

    p_0 = 1,   p_i = min(1, p_{i-1} M_b(X_i | X_<i) / M_s(X_i | X_<i))              (a running weight)
    h_i = sum_x [p_i M_b(x | X_<=i) - M_s(x | X_<=i)]_+ / (sum_x [...]_+ + 1 - p_i)   for i < L,
    h_L = p_L,

it keeps tau = the last i with eta_i < h_i (0 if none), emits X_1..X_tau and then one token Y:
Y ~ M_b(. | X_<=L) if tau = L (the bonus), else Y ~ norm([p_tau M_b(. | X_<=tau) - M_s(. | X_<=tau)]_+).
The emitted tokens follow the target exactly (Sun et al., Theorem 1), and among all verifiers that
are lossless for the draft's q, none accepts more in expectation (Theorem 2): E[tau] >= token-wise
E[tau], strictly more where a late draft token is much likelier under p than under q (the weight
p_i carries the surplus of one position to the next). Measured gain: +0.05-0.08 tokens per step
in vLLM's Model Runner V2, which ships it.

Deterministic drafts (q one-hot, q=None) gain nothing: no lossless verifier accepts the prefix
X_<=i more often than the target samples it, prod_j p(X_j), and token-wise verification already
does exactly that. verify_chain_block takes q=None (q one-hot, its own law of tau equal to the
token-wise one); generate.py's loop verifies such chains token-wise under verify="block".

Randomness, as rejection.verify_chain's (so one generator per row keeps rows independent): a row of
L_b drafts consumes L_b + 1 uniforms, u[b, i-1] = eta_i and u[b, L_b] for Y by inverse CDF; `draws`
makes every row consume exactly that many instead (the loop's k + 1). The arithmetic runs in float64
(float32 on devices without it). Errors and defined cases (p(x) = 0, q(x) = 0: rejected; an empty
residual: p) as verify_chain's. Left out: the greedy case, which is rejection.verify_chain_greedy's
exact match (a one-hot p makes every lossless rule that one).
"""
from __future__ import annotations

from typing import Optional

import torch

from .rejection_common import ChainResult, chain_inputs
from .sampling import Generators, ragged_uniforms, sample_from_probs


def wide(device: torch.device) -> torch.dtype:
    """The dtype the block and traversal rules compute in: float64 where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def verify_chain_block(draft_tokens: torch.Tensor, p: torch.Tensor, q: Optional[torch.Tensor] = None, *,
                       lengths: Optional[torch.Tensor] = None, generator: Generators = None,
                       validate: bool = True, draws: Optional[int] = None) -> ChainResult:
    """Block verification (module docstring) of a batch of ragged draft chains, with
    rejection.verify_chain's calling convention: draft_tokens (B, K) long, -1 beyond a row's
    length; p (B, K+1, V) the target after each prefix (warped); q (B, K, V) the draft distributions
    or None (deterministic); lengths (B,); generator one or one per row; validate=False skips the
    checks (lengths then required); draws as verify_chain's. Vectorised over rows; one loop over
    the K positions for the running weight. Returns ChainResult(tokens (B, K+1), num_accepted (B,)).
    """
    draft_tokens, p, q, lengths, valid = chain_inputs(draft_tokens, p, q, lengths, validate)
    B, K = draft_tokens.shape
    V = p.shape[-1]
    dev, dt = p.device, wide(p.device)
    u = ragged_uniforms(lengths + 1, K + 1, generator, dev, fixed=draws)  # (B, K+1), row b uses lengths[b] + 1
    x = draft_tokens.clamp(min=0).long()  # (B, K) placeholders read token 0, masked by `valid`
    rows = torch.arange(B, device=dev)  # (B,)
    P = p.to(dt)  # (B, K+1, V) M_b after 0..K drafts
    Q = (torch.nn.functional.one_hot(x, V).to(dt) if q is None else q.to(dt))  # (B, K, V) M_s at 0..K-1

    # 1. the running weights p_0..p_K: p_i = min(1, p_{i-1} M_b(X_i) / M_s(X_i)); M_s(X_i) = 0 -> 0
    px = P[:, :K].gather(2, x[..., None]).squeeze(-1)  # (B, K)
    qx = Q.gather(2, x[..., None]).squeeze(-1)  # (B, K)
    ratio = torch.where(qx > 0, px / qx.clamp(min=torch.finfo(dt).tiny), torch.zeros_like(px))  # (B, K)
    w = [torch.ones(B, dtype=dt, device=dev)]  # p_0
    for i in range(K):
        w.append(torch.clamp(w[-1] * ratio[:, i], max=1.0))
    W = torch.stack(w, 1)  # (B, K+1)

    # 2. h_i for i = 1..L: the residual's mass S_i over S_i + 1 - p_i; h_L = p_L
    R = (W[:, :K, None] * P[:, :K] - Q).clamp(min=0)  # (B, K, V) [p_i M_b(. | X_<=i) - M_s(. | X_<=i)]_+, i = 0..K-1
    S = R.sum(-1)  # (B, K)
    h = torch.where(S[:, 1:] > 0, S[:, 1:] / (S[:, 1:] + 1 - W[:, 1:K]).clamp(min=torch.finfo(dt).tiny),
                    torch.zeros_like(S[:, 1:]))  # (B, K-1) h_1..h_{K-1}
    h = torch.cat([h, h.new_zeros(B, 1)], 1) if K else h.new_zeros(B, 0)  # (B, K) h_1..h_K
    i_idx = torch.arange(1, K + 1, device=dev)[None, :]  # (1, K) paper's i
    h = torch.where(i_idx == lengths[:, None], W[:, 1:], h)  # (B, K) h_L = p_L
    keep = (u[:, :K] < h) & (i_idx <= lengths[:, None])  # (B, K) eta_i < h_i
    tau = (keep.long() * i_idx).max(1).values if K else torch.zeros_like(lengths)  # (B,) the last such i, else 0

    # 3. Y: the bonus from M_b(. | X_<=L) at tau = L, else the residual at tau (normalised)
    p_t = P[rows, tau]  # (B, V)
    dist = p_t
    if K:
        r_t, s_t = R[rows, tau.clamp(max=K - 1)], S[rows, tau.clamp(max=K - 1)]  # (B, V), (B,)
        res = torch.where((s_t > 0)[:, None], r_t / s_t.clamp(min=torch.finfo(dt).tiny)[:, None], p_t)  # empty -> p
        dist = torch.where((tau == lengths)[:, None], p_t, res)  # (B, V)
    last = sample_from_probs(dist, u[rows, lengths].to(dt))  # (B,)

    pos = torch.arange(K + 1, device=dev)[None, :]  # (1, K+1)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((B, 1), -1).long()], 1)  # (B, K+1)
    out = torch.where(pos < tau[:, None], padded, -1)  # (B, K+1)
    out.scatter_(1, tau[:, None], last[:, None])
    return ChainResult(out, tau)
