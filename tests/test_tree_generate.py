"""Tree drafts through the whole loop: greedy parity for any shape, chi-square vs exact for sampling.

The proposer here is a test device: it recomputes a small draft model on every root-to-node path
(no cache), and fills a fixed tree shape either with i.i.d. samples from q at each parent (sampled
drafts, SpecInfer) or with the parent's most probable distinct tokens (deterministic, q = None).
"""
import pytest
import torch

from _stats import power_sample_size
from specref import oracle
from specref.exact import hf_joint_distribution
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import perturbed_copy, tiny_model
from specref.proposer import Draft
from specref.sampling import SamplingConfig, logits_to_probs, sample

ALPHA = 1e-3
SHAPES = {
    "deep_chain": [-1, 0, 1, 2],  # r - a - b - c - d
    "wide_fan": [-1, -1, -1, -1],  # four children of the root
    "mixed": [-1, -1, 0, 0, 1, 2],  # r -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {5}
}


class StatelessTreeProposer:
    def __init__(self, model, parents, sampled):
        self.model, self.parents, self.sampled = model, torch.tensor(parents), sampled
        self.k = len(parents)

    def begin(self, ctx, sampling, generator):
        pass

    def update(self, ctx, num_accepted):
        pass

    @torch.no_grad()
    def propose(self, ctx, sampling, generator):
        B, N = ctx.tokens.shape[0], self.k
        tokens = torch.full((B, N), -1, dtype=torch.long)
        q_all = torch.zeros(B, N, self.model.config.vocab_size)
        rank = torch.zeros(N, dtype=torch.long)  # index among siblings
        for i in range(N):
            rank[i] = int((self.parents[:i] == self.parents[i]).sum())
        for i in range(N):
            # the path root..parent of node i, per row
            path, j = [], int(self.parents[i])
            while j >= 0:
                path.insert(0, j)
                j = int(self.parents[j])
            seqs = [torch.cat([ctx.row(b), tokens[b, path]]) for b in range(B)]
            T = max(len(s) for s in seqs)
            ids = torch.zeros(B, T, dtype=torch.long)
            am = torch.zeros(B, T, dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, T - len(s):], am[b, T - len(s):] = s, 1
            logits = self.model(input_ids=ids, attention_mask=am).logits[:, -1]  # (B, V)
            if self.sampled and not sampling.greedy:
                q = logits_to_probs(logits, sampling)  # (B, V)
                tokens[:, i] = sample(q, generator)
                q_all[:, i] = q
            else:  # the parent's (rank+1)-th most probable token: distinct siblings
                tokens[:, i] = logits.topk(int(rank[i]) + 1, dim=-1).indices[:, -1]
        lengths = torch.full((B,), N) * ctx.active
        q = q_all if self.sampled and not sampling.greedy else None
        return Draft(tokens=tokens, lengths=lengths, q=q, parents=self.parents.expand(B, N).clone())


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tree_greedy_parity(shape):
    target = tiny_model("llama", vocab_size=32, seed=21, logit_scale=3.0)
    draft = tiny_model("llama", vocab_size=32, seed=22, num_layers=1, logit_scale=3.0)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 0, 0, 9, 9]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=12, temperature=0)
    for d in (draft, target):  # target as draft: the whole first branch is accepted
        sp = speculative_generate(target, StatelessTreeProposer(d, SHAPES[shape], sampled=False), ids, mask,
                                  max_new_tokens=12, temperature=0)
        assert torch.equal(sp.tokens, ar.tokens), shape
    assert sp.stats.tokens_per_forward > 1.5


@pytest.mark.parametrize("shape,sampled", [("deep_chain", True), ("wide_fan", True), ("mixed", True),
                                           ("wide_fan", False), ("mixed", False)])
def test_tree_whole_loop_lossless(shape, sampled):
    """Joint of the first 2 tokens vs exact (V = 16, 256 cells), 50,000 rows: power >= 0.99 against
    TV 0.02 at 1e-3 (after pooling) is asserted."""
    V, L, n = 16, 2, 50_000
    target = tiny_model("llama", vocab_size=V, seed=31, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    draft = perturbed_copy(target, 0.3, seed=0)
    prompt = torch.tensor([1, 2, 3])
    s = SamplingConfig(0.9)
    exact = hf_joint_distribution(target, prompt, L, s).numpy()
    assert power_sample_size(exact, n) <= n
    out = speculative_generate(target, StatelessTreeProposer(draft, SHAPES[shape], sampled), prompt.expand(n, -1),
                               max_new_tokens=L, temperature=0.9,
                               generator=torch.Generator().manual_seed(len(shape) * 10 + sampled))
    counts = oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L)
    assert oracle.chi_square_gof(counts, exact).p_value > ALPHA
    assert out.stats.num_accepted_tokens > 0.2 * n
