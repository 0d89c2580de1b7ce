"""Prompt lookup first, a learned proposer elsewhere: one chain draft per row from either source.

Why (measured on Spec-Bench with the default model, BENCHMARKS.md): the learned drafts (the
trained draft model, the EAGLE-1 head) and prompt lookup fail in opposite places. Teacher-forced on
the target's own greedy answers, the EAGLE head's top-1 is 0.45-0.47 on writing / reasoning / math
but 0.09-0.18 on rag / translation / roleplay / summarisation, where the target copies its prompt or
repeats itself and a suffix match predicts the next token 84-89% of the time. Neither alone reaches
2 tokens per target forward. This proposer is our composition, not a published method: prompt
lookup is nearly free to run (c ~0.005), so it goes first, and its adaptive rule (ngram.py: per-row
shadow acceptance, closed-form draft length) decides per row and step whether its continuation is
worth verifying; every other active row gets the learned proposer's draft.

`HybridConfig(mode="tree")`: every active row drafts from both sources every step, and the two
chains are verified together as two branches of one token tree (SpecInfer's tree attention, tree.py):
the n-gram chain first, then the learned chain as the root's second child; the target keeps the
longer accepted branch (greedy) or walks the tree by recursive rejection (sampling: the n-gram
child, q one-hot, is tried first; the learned child, sampled from its own q independently of it, is
tried on the residual). The two siblings come from different q's: the draft says
siblings="sampled", SpecInfer's rule for independent draws, each tested against its own q row, which
is lossless for draws from different distributions and, for the n-gram node's one-hot q, is exactly
the deterministic rule (docs/sibling_kinds.md; tests/test_sibling_kinds.py checks such mixed
siblings with the oracle's lossless mode, tests/test_hybrid.py the whole loop). A greedy-drafting
learned part (q None) makes both deterministic. Costs a wider verify block and a learned draft every
step; wins the steps where prompt lookup has a match but is wrong and the learned draft is right.

Both sources are deterministic functions of the history given their own state, so the choice of
source is too, and it never looks at the target's distribution of the tokens being drafted: the
verification is the usual one (rejection.py), and the method is exactly as lossless as its parts
(tested: greedy parity and the whole-loop chi-square of tests/test_hybrid.py). Sampled drafts of the
learned proposer carry their q; n-gram rows in the same batch get q one-hot on their tokens, which
rejection.py treats exactly as q = None.

State: the n-gram proposer scores its shadow draft every step whatever was drafted. The learned
proposer sees the rows prompt lookup took as inactive for that step (it neither drafts nor catches
up there; it catches up the next time it drafts the row) and is told 0 accepted tokens for them.
With batch 1 it is not called at all in a step that prompt lookup takes. A tree proposer as the
learned part (Medusa) works in "select" mode: its rows keep their tree, prompt lookup's rows are
chains in the same tree draft; mode "tree" and lookahead (auxiliary tokens) take chains only.

The lookup part may be SuffixDecoding instead of prompt lookup (suffix.py, registry `hybrid_suffix`):
ArcticInference's hybrid keeps a suffix draft where its score (expected accepted tokens) reaches
the model drafter's k (SuffixConfig(min_score=k)) and gives the other rows to the model; a suffix
tree (SuffixConfig(tree=True)) is merged like a learned tree, its rows deterministic nodes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .ngram import NgramProposer
from .proposer import Context, Draft, Generators
from .sampling import SamplingConfig
from .suffix import SuffixProposer
from .tree import DETERMINISTIC, SIBLING_KINDS, sibling_kinds


@dataclass(frozen=True)
class HybridConfig:
    """How the two sources combine."""

    mode: str = "select"  # "select": per row and step one chain, prompt lookup's where its adaptive
    # rule drafts, else the learned one; "tree": both chains, as two branches of one token tree

    def __post_init__(self) -> None:
        if self.mode not in ("select", "tree"):
            raise ValueError(f"mode must be 'select' or 'tree', got {self.mode!r}")


class HybridProposer:
    """Proposer protocol: rows with a worthwhile prompt-lookup match draft it; the rest draft from
    `learned` (DraftModelProposer, EagleProposer, MedusaProposer or any proposer that honours
    ctx.active). `ngram`: the lookup part, an NgramProposer or a SuffixProposer."""

    def __init__(self, ngram, learned, config: HybridConfig = HybridConfig()):
        if not isinstance(ngram, (NgramProposer, SuffixProposer)):
            raise ValueError(f"ngram must be an NgramProposer or a SuffixProposer, got {type(ngram).__name__}")
        if not all(callable(getattr(learned, m, None)) for m in ("begin", "propose", "update")) \
                or not isinstance(getattr(learned, "k", None), int):
            raise ValueError(f"learned must implement the Proposer protocol, got {type(learned).__name__}")
        if isinstance(learned, (NgramProposer, SuffixProposer, HybridProposer)) or callable(getattr(learned, "observe", None)):
            raise ValueError(f"learned must be a model-based chain proposer, got {type(learned).__name__}")
        if getattr(learned, "acceptance_rule", None) is not None:
            raise ValueError("HybridProposer verifies losslessly: give it a learned proposer without an "
                             "acceptance_rule (e.g. MedusaConfig(acceptance='lossless'))")
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
        if config.mode == "tree" and isinstance(ngram, SuffixProposer) and ngram.config.tree:
            raise ValueError("HybridConfig(mode='tree') combines chain drafts only: SuffixConfig(tree=False)")
        self.ngram, self.learned, self.config = ngram, learned, config
        self.parts = (ngram, learned)  # checks.trusted: a user's learned part makes the drafts a user's
        tree = config.mode == "tree"
        self.k = int(ngram.k) + int(learned.k) if tree else max(int(ngram.k), int(learned.k))  # nodes / tokens
        self.vocab_size = getattr(learned, "vocab_size", None)
        self.hidden_layers = getattr(learned, "hidden_layers", None)  # features for EAGLE, else None
        self._from_learned: Optional[torch.Tensor] = None  # (B,) bool rows the learned part drafted
        self._learned_draft: Optional[tuple] = None  # tree mode: (tokens (B, Kl), lengths (B,), ctx lengths (B,))
        self.source_counts = [0, 0]  # row-steps drafted by [prompt lookup, the learned proposer]
        if not all(callable(getattr(q, "reset_rows", None)) for q in self.parts):
            self.reset_rows = None  # scheduler.py: static batches, as for the part that cannot reset a row

    def begin(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> None:
        self.ngram.begin(ctx, sampling, generator)
        self.learned.begin(ctx, sampling, generator)
        self._from_learned = None

    def reset_rows(self, ctx: Context, rows: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> None:
        """Rows that took a new request (scheduler.py): both parts reset them (present when both can)."""
        self.ngram.reset_rows(ctx, rows, hidden)
        self.learned.reset_rows(ctx, rows, hidden)

    @torch.no_grad()
    def propose(self, ctx: Context, sampling: SamplingConfig, generator: Generators) -> Draft:
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        ng = self.ngram.propose(ctx, sampling, generator)
        if self.config.mode == "tree":
            return self._propose_tree(ctx, ng, sampling, generator)
        ng_rows = (ng.lengths.to(dev) > 0) & ctx.active  # (B,)
        rest = ctx.active & ~ng_rows  # (B,) rows the learned proposer drafts
        self._from_learned = rest
        self.source_counts[0] += int(ng_rows.sum())
        self.source_counts[1] += int(rest.sum())
        if not bool(rest.any()):
            return ng
        ld = self.learned.propose(dataclasses.replace(ctx, active=rest), sampling, generator)
        if ld.aux is not None:
            raise ValueError("HybridProposer cannot combine a draft with auxiliary tokens (lookahead)")
        if not bool(ng_rows.any()):
            return ld
        K = max(ng.tokens.shape[1], ld.tokens.shape[1])
        parents = None
        if ld.parents is not None or ng.parents is not None:  # a tree in either part: chains become trees
            chain = (torch.arange(K, device=dev) - 1).expand(B, K)  # (B, K)
            parents = chain.clone()
            for d, rows in ((ld, rest), (ng, ng_rows)):
                if d.parents is not None:
                    Kd = d.parents.shape[1]
                    parents[:, :Kd] = torch.where(rows.view(B, 1), d.parents.to(dev), parents[:, :Kd])
        tokens = torch.full((B, K), -1, dtype=torch.long, device=dev)  # (B, K)
        tokens[:, : ld.tokens.shape[1]] = torch.where(rest.view(B, 1), ld.tokens.to(dev), -1)
        tokens[ng_rows, : ng.tokens.shape[1]] = ng.tokens.to(dev)[ng_rows]
        lengths = torch.where(ng_rows, ng.lengths.to(dev), ld.lengths.to(dev) * rest)  # (B,)
        q = None
        if ld.q is not None:  # sampled learned drafts: n-gram rows get q one-hot on their tokens
            V = ld.q.shape[-1]
            q = ld.q.new_zeros(B, K, V)  # (B, K, V)
            q[:, : ld.q.shape[1]] = ld.q * rest.view(B, 1, 1)
            on = ng_rows.view(B, 1) & (tokens >= 0)  # (B, K) drafted n-gram positions
            q[on.nonzero(as_tuple=True) + (tokens[on],)] = 1.0
        siblings = None if parents is None else ld.siblings  # n-gram rows are chains: no siblings
        if ng.parents is not None:  # suffix trees: deterministic siblings (distinct trie children)
            siblings = "deterministic"
            if q is not None:  # per node: the lookup rows deterministic, the learned rows their kind
                kinds = torch.full((B, K), DETERMINISTIC, dtype=torch.long, device=dev)  # (B, K)
                Kl = ld.tokens.shape[1]
                lk = "sampled" if ld.parents is None else sibling_kinds(ld.siblings, True, B, Kl, dev, validate=False)
                if isinstance(lk, str):  # one kind for every learned node (a chain's: its own q row)
                    lk = torch.full((B, Kl), SIBLING_KINDS.index(lk), dtype=torch.long, device=dev)  # (B, Kl)
                kinds[:, :Kl] = torch.where(rest.view(B, 1), lk.to(dev), kinds[:, :Kl])
                siblings = kinds
        return Draft(tokens=tokens, lengths=lengths, q=q, parents=parents, siblings=siblings)

    def _propose_tree(self, ctx: Context, ng: Draft, sampling: SamplingConfig, generator: Generators) -> Draft:
        """Nodes [n-gram chain (a_b), learned chain (l_b)] per row; both chains hang from the root."""
        B, dev = ctx.tokens.shape[0], ctx.tokens.device
        ld = self.learned.propose(ctx, sampling, generator)
        if ld.is_tree:
            raise ValueError("HybridConfig(mode='tree') combines chain drafts only")
        a = ng.lengths.to(dev) * ctx.active  # (B,)
        l_len = ld.lengths.to(dev) * ctx.active  # (B,)
        self._learned_draft = (ld.tokens.to(dev), l_len, ctx.lengths.clone())
        self.source_counts[0] += int((a > 0).sum())
        self.source_counts[1] += int((l_len > 0).sum())
        N = int((a + l_len).max()) if B else 0
        j = torch.arange(N, device=dev).view(1, N)  # (1, N)
        in_ng = j < a.view(B, 1)  # (B, N)
        in_l = ~in_ng & (j < (a + l_len).view(B, 1))  # (B, N)
        jl = (j - a.view(B, 1)).clamp(min=0)  # (B, N) index into the learned chain
        ng_tok = ng.tokens.to(dev)
        t_ng = ng_tok.gather(1, j.clamp(max=max(ng_tok.shape[1] - 1, 0)).expand(B, N)) if ng_tok.shape[1] \
            else torch.full((B, N), -1, dtype=torch.long, device=dev)  # (B, N)
        t_l = ld.tokens.to(dev).gather(1, jl.clamp(max=max(ld.tokens.shape[1] - 1, 0)))  # (B, N)
        tokens = torch.where(in_ng, t_ng, torch.where(in_l, t_l, -1))  # (B, N)
        first_l = in_l & (jl == 0)  # (B, N) the learned chain's first node: a child of the root
        parents = torch.where(in_ng | (in_l & ~first_l), j - 1, -1).expand(B, N).clone()  # (B, N)
        parents[:, :1] = -1
        q = None
        if ld.q is not None:
            V = ld.q.shape[-1]
            q = ld.q.new_zeros(B, N, V)  # (B, N, V)
            src = ld.q.to(dev).gather(1, jl.clamp(max=ld.q.shape[1] - 1).unsqueeze(-1).expand(B, N, V))
            q = torch.where(in_l.unsqueeze(-1), src, q)
            q[in_ng.nonzero(as_tuple=True) + (tokens[in_ng],)] = 1.0  # n-gram nodes: one-hot
        # the n-gram child (q one-hot) and the learned child (drawn from its own q) are independent
        # draws, each from its own q row: sampled siblings
        return Draft(tokens=tokens, lengths=a + l_len, q=q, parents=parents,
                     siblings="deterministic" if q is None else "sampled")

    def update(self, ctx: Context, num_accepted: torch.Tensor) -> None:
        self.ngram.update(ctx, num_accepted)
        if self.config.mode == "tree":  # the learned chain's accepted count: its common prefix with the path
            toks, l_len, old = self._learned_draft
            self._learned_draft = None
            B, Kl = toks.shape
            j = torch.arange(Kl, device=toks.device).view(1, Kl)  # (1, Kl)
            idx = (old.view(B, 1) + j).clamp(max=ctx.tokens.shape[1] - 1)  # (B, Kl)
            on_path = j < num_accepted.to(toks.device).view(B, 1)  # (B, Kl) accepted path positions
            same = (ctx.tokens.gather(1, idx) == toks) & on_path & (j < l_len.view(B, 1))  # (B, Kl)
            self.learned.update(ctx, same.long().cumprod(dim=1).sum(dim=1).to(num_accepted))
            return
        rest = self._from_learned
        if rest is None:
            rest = torch.zeros_like(ctx.active)
        # the learned proposer rolls back every row (its speculative state of the rows it drafted;
        # nothing for the others) and stores the target's features; 0 accepted where it did not draft
        self.learned.update(ctx, num_accepted * rest.to(num_accepted.device))
        self._from_learned = None
