"""EAGLE-2's dynamic tree with sampled siblings: a tree for traversal verification.

EAGLE-2 (Li et al., EMNLP 2024; eagle_tree.py) fills its tree with the head's top-k tokens, so its
siblings are deterministic and token-wise verification is already the best lossless rule for it.
Traversal verification (Weng et al. 2025, traversal.py) and Sequoia's rule (Chen et al. 2024) are
written for siblings drawn WITHOUT replacement from their parent's q; so are the trees of the
traversal paper's experiments. This proposer keeps EAGLE-2's two phases (expansion of the best
frontier with one head forward per level, reranking of the pool into at most total_tokens nodes)
and draws every node's children without replacement from the head's q at the sampling temperature
(q = the head's distribution warped as the target's, sampling.logits_to_probs).

The shape must not look at a node's own token. If it did (EAGLE-2's value V = prod q(t) along the
path, the node's own q(t) included), a kept node would no longer be a draw from q: a child kept only
when q(t) is large is biased towards the head's favourites, and every verifier that assumes q is
lossy. So a node's rank is its SLOT value, known before its token is drawn:

  pi(c_j) = min(pi(v), V(v) * q_v^(j)),   V(v) = prod_{t on the path to v} q(t),

c_j the j-th child drawn at node v (j = 1..top_k, in draw order) and q_v^(j) the j-th largest
probability of v's q: the value EAGLE-2's top-k tree gives the same slot. V(v) is the path's
actual value (v's own token is known when its children are ranked). pi never grows along a path
nor along a node's draws, and ties go to the earlier node, so the best total_tokens nodes by pi
hold their parents and, at each node, the first m children in draw order: Draft.siblings="without"
holds. `min_value` applies to pi as eagle_tree's to V. Whole-loop chi-square tests: tests/test_eagle_sampled.py.

At T = 0 (greedy) it drafts eagle_tree's top-k tree (siblings "deterministic", q None): greedy
verification is exact match whatever the siblings. Randomness: per row, top_k uniforms for the
root's children and frontier x top_k per later level, from that row's generator (a row never
depends on the others).
"""
from __future__ import annotations

import torch

from .draft_model import to_target_vocab
from .eagle_tree import Eagle2Proposer
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig, logits_to_probs, sample_from_probs, uniforms


def draw_without_replacement(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Successive draws without replacement: draw j from q without draws 1..j-1, renormalised
    (inverse CDF on u[..., j]). q (..., V) >= 0; u (..., K) uniforms. -> (..., K) long, in draw
    order. Past q's support the draws are arbitrary (callers give those slots value 0)."""
    left, out = q.clone(), []
    for j in range(u.shape[-1]):
        x = sample_from_probs(left, u[..., j])  # (...)
        out.append(x)
        left.scatter_(-1, x.unsqueeze(-1), 0.0)
    return torch.stack(out, dim=-1)  # (..., K)


class Eagle2SampledProposer(Eagle2Proposer):
    """Proposer protocol: EAGLE-2 trees from an EagleHead whose siblings are drawn without
    replacement from the head's q (module docstring); Draft.siblings="without", q per node the
    parent's q over the target vocabulary. k = total_tokens; Eagle2Proposer(head, Eagle2Config)'s
    arguments."""

    def _propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        if sampling.greedy:
            return super()._propose(ctx, sampling, generator)
        cfg, head = self.tree, self.head
        B, dev, K = ctx.tokens.shape[0], ctx.tokens.device, cfg.top_k
        last = self._catch_up(ctx)  # (B, D) f^ at the pending token
        base = self.cache.lengths.clone()  # (B,)
        M = max(self._spec_slots(), 1)
        q = logits_to_probs(head.logits(last).float(), sampling).unsqueeze(1)  # (B, 1, Vd) the root's q
        K1 = min(K, q.shape[-1])
        val = torch.zeros(B, 1, device=dev)  # (B, F) log V of the nodes being expanded (the root: 0)
        rank = torch.zeros(B, 1, device=dev)  # (B, F) their log pi
        cur = self.pending(ctx).view(B, 1)  # (B, F) the tokens they were fed after
        pool_s, pool_t, pool_p, pool_q = [], [], [], []  # per level: (B, n) each
        front = torch.full((B, 1), -1, dtype=torch.long, device=dev)  # (B, F) pool index, -1 the root
        q_all, q_base = [q], 0  # the q of each expanded node, (B, F, Vd) per level; q_base its offset
        f_par, f_hat, anc, n_pool = None, None, torch.zeros(B, 1, M, dtype=torch.bool, device=dev), 0
        for level in range(cfg.depth):
            F = q.shape[1]
            u = uniforms((F, K1), B, generator, dev)  # (B, F, K1)
            x = draw_without_replacement(q, u)  # (B, F, K1) draft ids, in draw order
            slot = torch.log(q.topk(K1, -1).values)  # (B, F, K1) log q^(j): -inf past q's support
            s = torch.minimum(rank.unsqueeze(-1), val.unsqueeze(-1) + slot).reshape(B, F * K1)  # (B, F*K1) log pi
            v = (val.unsqueeze(-1) + torch.log(q.gather(-1, x))).reshape(B, F * K1)  # (B, F*K1) log V
            pool_s.append(s)
            pool_t.append(x.reshape(B, F * K1))
            pool_p.append(front.repeat_interleave(K1, dim=1))  # (B, F*K1) parent pool index
            pool_q.append((q_base + torch.arange(F, device=dev)).repeat_interleave(K1).expand(B, F * K1))
            q_base += F
            if level + 1 == cfg.depth:
                break
            # the next frontier: the best top_k of this level by pi (a stable sort: ties to the earlier)
            pick = torch.sort(-s, dim=1, stable=True).indices[:, :min(K, F * K1)]  # (B, F')
            F2, src = pick.shape[1], pick // K1  # (B, F') the row each one hangs from
            tok = x.reshape(B, F * K1).gather(1, pick)  # (B, F') draft ids
            rank, val = s.gather(1, pick), v.gather(1, pick)  # (B, F')
            if level == 0:
                f_par = last.unsqueeze(1).expand(B, F2, last.shape[-1])  # (B, F', D) f^ at their parents
            else:
                f_par = f_hat.gather(1, src.unsqueeze(-1).expand(-1, -1, f_hat.shape[-1]))
                anc = anc.gather(1, src.unsqueeze(-1).expand(-1, -1, M))
            cur = cur.gather(1, src) if level > 0 else cur.expand(B, F2)  # (B, F') their parents' tokens
            anc = anc.expand(B, F2, M).clone() if level == 0 else anc.clone()  # (B, F', M)
            own = torch.arange(F2, device=dev) + level * K  # (F',) their slots - base
            anc[:, torch.arange(F2, device=dev), own] = True
            f_hat = self._forward_tree(f_par, head.token_map[tok], (base + level).view(B, 1).expand(B, F2),
                                       anc, base, cur)  # (B, F', D)
            self.cache.commit(ctx.active.long() * F2, validate=False)
            q = logits_to_probs(head.logits(f_hat).float(), sampling)  # (B, F', Vd)
            q_all.append(q)
            cur, front = head.token_map[tok], pick + n_pool
            n_pool += F * K1
        return self._sampled_draft(ctx, pool_s, pool_t, pool_p, pool_q, torch.cat(q_all, 1))

    def _sampled_draft(self, ctx: Context, pool_s, pool_t, pool_p, pool_q, q_all: torch.Tensor) -> Draft:
        """Eagle2Proposer._rerank over pi (siblings in draw order), each node with the q it was drawn
        from. q_all (B, E, Vd): the q of every expanded node; pool_q its index per pool node."""
        tokens, lengths, parents, sel = self._rerank(ctx, *(torch.cat(x, 1) for x in (pool_s, pool_t, pool_p)))
        B, N = tokens.shape
        qi = torch.cat(pool_q, 1).gather(1, sel)  # (B, N) which expanded node's q each node was drawn from
        qd = q_all.gather(1, qi.unsqueeze(-1).expand(-1, -1, q_all.shape[-1]))  # (B, N, Vd)
        q = to_target_vocab(qd.reshape(B * N, -1), self.head.token_map, self.vocab_size).view(B, N, -1)  # (B, N, V)
        return Draft(tokens=tokens, lengths=lengths, parents=parents, q=q, siblings="without")
