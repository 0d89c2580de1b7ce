"""EAGLE-2: a dynamic draft tree grown from the EAGLE head's confidence (Li et al., EMNLP 2024).

EAGLE-2 (Sec. 4) keeps EAGLE-1's head (eagle_head.py) and replaces its fixed draft shape by a tree
that depends on the context. Its observation (Sec. 3): the head is well calibrated, so the product
of its probabilities along a path, the path's value V_i = prod_{j on path} q(t_j), approximates the
probability that the target accepts the whole path. Two phases per step:

1. expansion: from the root, for `depth` steps, the `top_k` nodes of the current level with the
   highest V_i are the frontier; ONE head forward scores the whole frontier (a tree-masked block on
   the head's own cache: node i attends the true pairs and its own ancestors, at position
   root + depth_i - 1), and each frontier node proposes its own top_k children, V_child =
   V_parent * q(child). Of those top_k^2 children the top_k best are the next frontier.
2. reranking: every drafted node (the root's top_k children and top_k^2 per later level) is ranked
   by V_i, and the best `total_tokens` become the tree the target verifies in one forward. A node's
   value never exceeds its parent's, and ties go to the earlier node, so parents are always kept.

Not in the paper, for ragged rows (`min_value`): a node is kept only if V_i >= min_value, so a row whose
head is unsure drafts a smaller tree than a confident one (each node costs the target a wider
verify block; a node worth less than that cost is not worth verifying).

Siblings are the head's top-k: deterministic, so q is one-hot per node (q = None,
Draft.siblings="deterministic") and rejection.py's recursive rule over deterministic siblings keeps
sampling exact (the rule the EAGLE repo and SGLang use); at T = 0 the longest path of target
argmaxes. The tree is a function of the history alone: the same at every temperature.
Left out: EAGLE-2's GPU sizes (total_tokens 60, depth 6, top_k 10; see Eagle2Config for this CPU's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checks import normalise_ints
from .eagle_head import EagleConfig, EagleHead, EagleProposer, cur_kwargs
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig
from .target import additive_mask, attending


@dataclass(frozen=True)
class Eagle2Config:
    """Settings of the EAGLE-2 dynamic tree. The paper's GPU sizes (total_tokens 60, depth 6,
    top_k 10) assume a verify forward whose cost is flat in the block width. Where a verify block of
    W tokens costs more than one token's forward (a CPU) and each level costs a head step, the rule
    is: small, shallow trees chosen from a wide candidate pool. A node is worth verifying when its
    path's head probability (its expected accepted tokens) exceeds the marginal cost of one more
    block token, and a level is worth expanding when the tokens it adds outweigh one head step; the
    defaults follow it for the default model on CPU (the measurements: docs/experiments/eagle3.md)."""

    top_k: int = 4  # children per expanded node and frontier width (paper: 10): the pool to rerank
    # is top_k + (depth-1) top_k^2 = 20 candidates; a frontier row costs the head little
    depth: int = 2  # expansion steps = the deepest level (paper: 6): each costs one head step
    total_tokens: int = 4  # the most nodes verified per step (paper: 60)
    min_value: float = 0.05  # keep a node only if V_i (its path's head probability) >= this: about
    # the marginal verify cost of one more node, in target steps; 0 keeps total_tokens always

    def __post_init__(self) -> None:
        normalise_ints(self, "top_k", "depth", "total_tokens")
        for name in ("top_k", "depth", "total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.min_value, (int, float)) or not 0 <= self.min_value < 1 \
                or math.isnan(self.min_value):
            raise ValueError(f"min_value must be a number in [0, 1), got {self.min_value!r}")


class Eagle2Proposer(EagleProposer):
    """Proposer protocol: EAGLE-2 dynamic trees from an EagleHead (the EAGLE-1 head). The head's
    cache handling (catch-up on the target's true features, roll-back of the speculative slots) is
    EagleProposer's; only the drafting differs. k = total_tokens (the most nodes per row and step)."""

    def __init__(self, head: EagleHead, config: Eagle2Config = Eagle2Config()):
        if not isinstance(config, Eagle2Config):
            raise ValueError(f"config must be an Eagle2Config, got {type(config).__name__}")
        super().__init__(head, EagleConfig(k=1))
        self.tree, self.k = config, config.total_tokens
        self.variable_k = False  # k is a node budget here, not a chain length
        self.tree_sizes: list = []  # nodes per drafted row and step (for the bench's tree size)

    def _spec_slots(self) -> int:
        return (self.tree.depth - 1) * self.tree.top_k  # one frontier block per expansion step

    def _forward_tree(self, f_in: torch.Tensor, x_in: torch.Tensor, positions: torch.Tensor,
                      anc: torch.Tensor, base: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        """Feed a frontier block of pairs (B, Q) at the cache's next slots. Node j attends the true
        pairs (slots < base) and the speculative slots base + m with anc[:, j, m] (its ancestors and
        itself). positions (B, Q); anc (B, Q, M) bool; base (B,); cur (B, Q) each node's parent's
        token (x_t of its pair). -> f^ (B, Q, D)"""
        B, Q = x_in.shape
        M = anc.shape[-1]
        slots = self.cache.begin_block(Q)  # (B, Q)
        S = int(slots.max()) + 1
        rel = torch.arange(S, device=slots.device).view(1, 1, S) - base.view(B, 1, 1)  # (B, 1, S)
        spec = (rel >= 0) & (rel < M)  # (B, 1, S) this step's speculative slots
        allowed = (rel < 0) | (spec & anc.gather(2, rel.clamp(0, M - 1).expand(B, Q, S)))  # (B, Q, S)
        with attending(self.cache, S):
            return self.head(f_in, x_in, positions, additive_mask(allowed, f_in.dtype), cache=self.cache,
                             **cur_kwargs(self.head, cur))

    def _propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        """The tree (EagleProposer.propose runs it: no grad, the packed linears); the same at
        every temperature, so sampling and generator play no part."""
        cfg, head = self.tree, self.head
        B, dev, K = ctx.tokens.shape[0], ctx.tokens.device, cfg.top_k
        last = self._catch_up(ctx)  # (B, D) f^ at the pending token
        base = self.cache.lengths.clone()  # (B,) true pairs in the head's cache
        M = max(self._spec_slots(), 1)
        # 1. expansion. Level 1: the root's top_k children, V = q(x)
        logq = torch.log_softmax(head.logits(last).float(), -1)  # (B, Vd)
        K1 = min(K, logq.shape[-1])
        score, tok = logq.topk(K1, -1)  # (B, K1) log V, draft ids
        pool_s, pool_t = [score], [tok]  # per level: log V (B, n), draft ids (B, n)
        pool_p = [torch.full((B, K1), -1, dtype=torch.long, device=dev)]  # parent pool index, -1 root
        f_par = last.unsqueeze(1).expand(B, K1, last.shape[-1])  # (B, F, D) f^ at each node's parent
        front, n_pool = torch.arange(K1, device=dev).expand(B, K1), K1  # (B, F) pool index of the frontier
        anc = torch.zeros(B, K1, M, dtype=torch.bool, device=dev)  # (B, F, M) ancestors' slots
        cur = self.pending(ctx).view(B, 1).expand(B, K1)  # (B, F) each frontier node's parent's token
        for level in range(1, cfg.depth):
            F = front.shape[1]
            own = torch.arange(F, device=dev) + (level - 1) * K  # (F,) the frontier's slots - base
            anc = anc.clone()
            anc[:, torch.arange(F, device=dev), own] = True
            f_hat = self._forward_tree(f_par, head.token_map[tok], (base + level - 1).view(B, 1).expand(B, F),
                                       anc, base, cur)  # (B, F, D)
            self.cache.commit(ctx.active.long() * F, validate=False)
            logq = torch.log_softmax(head.logits(f_hat).float(), -1)  # (B, F, Vd)
            s, x = logq.topk(K1, -1)  # (B, F, K1)
            s = (score.unsqueeze(-1) + s).reshape(B, F * K1)  # (B, F*K1) log V of every child
            x = x.reshape(B, F * K1)  # (B, F*K1)
            par = front.repeat_interleave(K1, dim=1)  # (B, F*K1) pool index of each child's parent
            pool_s.append(s)
            pool_t.append(x)
            pool_p.append(par)
            if level + 1 < cfg.depth:  # the next frontier: the top_k children by V
                score, pick = s.topk(min(K, F * K1), -1)  # (B, F')
                src = pick // K1  # (B, F') the frontier row each one hangs from
                cur = head.token_map[tok.gather(1, src)]  # (B, F') their parents' tokens
                tok = x.gather(1, pick)  # (B, F')
                f_par = f_hat.gather(1, src.unsqueeze(-1).expand(-1, -1, f_hat.shape[-1]))  # (B, F', D)
                anc = anc.gather(1, src.unsqueeze(-1).expand(-1, -1, M))  # (B, F', M)
                front = pick + n_pool  # (B, F')
            n_pool += F * K1
        # 2. reranking: the best total_tokens nodes by V (a stable sort: parents before children)
        tokens, lengths, parents, _ = self._rerank(ctx, torch.cat(pool_s, 1), torch.cat(pool_t, 1),
                                                   torch.cat(pool_p, 1))
        return Draft(tokens=tokens, lengths=lengths, parents=parents, siblings="deterministic")

    def _rerank(self, ctx: Context, s_all: torch.Tensor, t_all: torch.Tensor, p_all: torch.Tensor):
        """The best total_tokens pool nodes by score s_all (B, P) (log V here; eagle_sampled.py's log
        pi), finite and >= log min_value, in pool order (topological: parents first). t_all (B, P) draft
        ids; p_all (B, P) parent pool index (-1 the root). Scores never grow from a parent to its
        children, so the kept prefix of the ranking is closed under parents. Returns tokens (B, N)
        target ids, lengths (B,), parents (B, N), and sel (B, N) the pool index of each node."""
        B, P = s_all.shape
        dev, N = s_all.device, min(self.tree.total_tokens, P)
        order = torch.sort(-s_all, dim=1, stable=True).indices[:, :N]  # (B, N) best first
        s_top = s_all.gather(1, order)  # (B, N)
        floor = math.log(self.tree.min_value) if self.tree.min_value > 0 else -math.inf
        keep = (s_top >= floor) & torch.isfinite(s_top) & ctx.active.view(B, 1)  # (B, N)
        keep = keep.cumprod(1).bool()  # a prefix of the ranking
        lengths = keep.sum(1)  # (B,)
        sel = torch.sort(torch.where(keep, order, P), dim=1).values  # (B, N) pool order = topological
        real = sel < P  # (B, N)
        sel_c = sel.clamp(max=P - 1)
        inv = torch.full((B, P + 1), -1, dtype=torch.long, device=dev)  # (B, P+1) pool -> node index
        inv.scatter_(1, sel, torch.arange(N, device=dev).expand(B, N))
        par_pool = p_all.gather(1, sel_c)  # (B, N)
        parents = torch.where(real & (par_pool >= 0), inv.gather(1, par_pool.clamp(min=0)), -1)  # (B, N)
        tokens = torch.where(real, self.head.token_map[t_all.gather(1, sel_c)], -1)  # (B, N) target ids
        self.drafted = (lengths * ctx.active).cpu().numpy()  # (B,)
        self.tree_sizes.extend(self.drafted[ctx.active.cpu().numpy()].tolist())
        return tokens, lengths, parents, sel_c
