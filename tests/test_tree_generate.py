"""Tree drafts through the whole loop: greedy parity for any shape, chi-square vs exact for sampling.

The proposer here is a test device: a bigram draft q(x | parent token) looked up in a table (built
from the target's next-token distributions after each single token, so it is a decent but imperfect
draft), filling a fixed tree shape with i.i.d. samples from q at each parent (sampled drafts,
SpecInfer), with distinct samples drawn without replacement by Gumbel-top-k (Sequoia; kind
"without"), or with the parent's most probable distinct tokens (deterministic, q = None).
"""
import pytest
import torch

from _stats import power_sample_size
from specref import oracle
from specref.oracle.exact import hf_joint_distribution
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.proposer import Draft
from specref.sampling import SamplingConfig, sample, uniforms

ALPHA = 1e-3
SHAPES = {
    "deep_chain": [-1, 0, 1, 2],  # r - a - b - c - d
    "wide_fan": [-1, -1, -1, -1],  # four children of the root
    "mixed": [-1, -1, 0, 0, 1, 2],  # r -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {5}
}


def bigram_table(target, V):
    """q(. | a) = the target's next-token distribution after the single token a. -> (V, V)"""
    with torch.no_grad():
        return torch.softmax(target(input_ids=torch.arange(V).view(V, 1)).logits[:, -1].float(), -1)


class BigramTreeProposer:
    """sampled: True (i.i.d. siblings), "without" (Gumbel-top-k: the siblings of a node are the top
    of log q + Gumbel noise, distinct, in the order of sampling without replacement), False (top-k)."""

    def __init__(self, table, parents, sampled):
        self.table, self.parents, self.sampled = table, torch.tensor(parents), sampled
        self.k = len(parents)
        # rank of each node among its siblings: the deterministic fill takes the (rank+1)-th best
        self.rank = torch.tensor([int((self.parents[:i] == self.parents[i]).sum()) for i in range(self.k)])

    def begin(self, ctx, sampling, generator):
        pass

    def update(self, ctx, num_accepted):
        pass

    def propose(self, ctx, sampling, generator):
        B, N = ctx.tokens.shape[0], self.k
        rows = torch.arange(B)
        root = ctx.tokens[rows, ctx.lengths - 1]  # (B,)
        tokens = torch.full((B, N), -1, dtype=torch.long)  # (B, N)
        q_all = torch.zeros(B, N, self.table.shape[0])  # (B, N, V)
        keys = {}  # Gumbel-top-k: parent node -> (B, V) log q + Gumbel noise, drawn once per parent
        for i in range(N):  # topological order: the parent's token is known
            j = int(self.parents[i])
            parent_tok = root if j < 0 else tokens[:, j]  # (B,)
            q = self.table[parent_tok]  # (B, V)
            if self.sampled == "without" and not sampling.greedy:
                if j not in keys:
                    u = uniforms((q.shape[1],), B, generator, q.device).clamp(min=1e-12)  # (B, V)
                    keys[j] = q.log() - (-u.log()).log()  # (B, V)
                tokens[:, i] = keys[j].topk(int(self.rank[i]) + 1, dim=-1).indices[:, -1]  # rank-th largest key
                q_all[:, i] = q  # the q the parent's siblings were drawn from, before any removal
            elif self.sampled and not sampling.greedy:
                tokens[:, i] = sample(q, generator)
                q_all[:, i] = q
            else:
                tokens[:, i] = q.topk(int(self.rank[i]) + 1, dim=-1).indices[:, -1]
        lengths = torch.full((B,), N) * ctx.active
        q = q_all if self.sampled and not sampling.greedy else None
        kind = "deterministic" if q is None else ("without" if self.sampled == "without" else "sampled")
        return Draft(tokens=tokens, lengths=lengths, q=q, parents=self.parents.expand(B, N).clone(), siblings=kind)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tree_greedy_parity(shape):
    target = tiny_model("llama", vocab_size=32, seed=21, logit_scale=3.0)
    draft = tiny_model("llama", vocab_size=32, seed=22, num_layers=1, logit_scale=3.0)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 0, 0, 9, 9]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=12, temperature=0)
    for table in (bigram_table(draft, 32), bigram_table(target, 32)):
        sp = speculative_generate(target, BigramTreeProposer(table, SHAPES[shape], sampled=False), ids, mask,
                                  max_new_tokens=12, temperature=0)
        assert torch.equal(sp.tokens, ar.tokens), shape
    assert sp.stats.num_accepted_tokens > 0


@pytest.mark.two_threads
@pytest.mark.parametrize("shape,sampled", [("deep_chain", True), ("wide_fan", True), ("mixed", True),
                                           ("wide_fan", False), ("mixed", False), ("wide_fan", "without")])
def test_tree_whole_loop_lossless(shape, sampled):
    """Joint of the first 2 tokens vs exact (V = 16, 256 cells), 50,000 rows: power >= 0.99 against
    TV 0.02 at 1e-3 (after pooling) is asserted. ("wide_fan", "without"): four Gumbel-top-k
    siblings, verified under their own kind (Sequoia's rule, rejection.verify_tree)."""
    V, L, n = 16, 2, 50_000
    target = tiny_model("llama", vocab_size=V, seed=31, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    table = bigram_table(target, V)
    prompt = torch.tensor([1, 2, 3])
    s = SamplingConfig(0.9)
    exact = hf_joint_distribution(target, prompt, L, s).numpy()
    assert power_sample_size(exact, n) <= n
    out = speculative_generate(target, BigramTreeProposer(table, SHAPES[shape], sampled), prompt.expand(n, -1),
                               max_new_tokens=L, temperature=0.9,
                               generator=torch.Generator().manual_seed(len(shape) * 10 + int(bool(sampled))))
    counts = oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L)
    assert oracle.chi_square_gof(counts, exact).p_value > ALPHA
    assert out.stats.num_accepted_tokens > 0.2 * n


class _FeatureChecker:
    """Wraps a proposer, asks generate.py for the target's final features, and checks every
    ctx.hidden it gets against the features of a fresh forward over the committed tokens."""

    hidden_layers = (-1,)

    def __init__(self, inner, target):
        self.inner, self.target, self.k, self.checked = inner, target, inner.k, 0

    def _check(self, ctx):
        for b in range(ctx.tokens.shape[0]):
            n = int(ctx.hidden_len[b])
            if n == 0:
                continue
            row = ctx.row(b)  # (L,) the last token is pending: features exist for row[:-1]
            with torch.no_grad():
                ref = self.target.model(input_ids=row[None, :-1]).last_hidden_state[0]  # (L-1, D)
            assert torch.allclose(ctx.hidden[b, :n], ref[len(row) - 1 - n:], atol=1e-4, rtol=1e-4)
            self.checked += 1

    def begin(self, ctx, sampling, generator):
        self._check(ctx)
        self.inner.begin(ctx, sampling, generator)

    def propose(self, ctx, sampling, generator):
        return self.inner.propose(ctx, sampling, generator)

    def update(self, ctx, num_accepted):
        self._check(ctx)
        self.inner.update(ctx, num_accepted)


@pytest.mark.parametrize("shape", ["deep_chain", "mixed"])
def test_features_of_committed_tokens_reach_the_proposer(shape):
    """generate.py hands a proposer with `hidden_layers` the target's features of exactly the tokens
    each forward committed (prefill; a tree's accepted path, gathered from the block), in batches.
    Chain blocks: test_eagle's recomputation test."""
    V = 24
    target = tiny_model("llama", vocab_size=V, seed=5, init_std=0.2, logit_scale=3.0)
    inner = BigramTreeProposer(bigram_table(target, V), SHAPES[shape], sampled=False)
    prop = _FeatureChecker(inner, target)
    ids = torch.tensor([[0, 4, 2, 7, 1], [3, 3, 9, 8, 2]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=12, temperature=0)
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=12, temperature=0)
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.num_accepted_tokens > 0 and prop.checked >= 2 + 2 * 3  # accepted paths were checked
