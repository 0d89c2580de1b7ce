"""suffix.py / suffix_tree.py (SuffixDecoding): counts and scores on hand-made sequences, the adaptive
length rule, path and tree drafts, eviction under both caps, cross-request reuse, greedy parity with
plain decoding (ragged batch), the whole-loop chi-square at T = 1 on a ragged batch with both trees
drafting, and a lossy control (the tree's estimates passed as q) that the same test rejects."""
import dataclasses

import numpy as np
import pytest
import torch

from _stats import power_sample_size
from specref import oracle
from specref.draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
from specref.generate import autoregressive_generate, speculative_generate
from specref.hybrid import HybridConfig, HybridProposer
from specref.models import tiny_model
from specref.oracle.exact import hf_joint_distribution
from specref.sampling import SamplingConfig
from specref.registry import Registry
from specref.suffix import SuffixConfig, SuffixProposer, max_spec
from specref.suffix_tree import SuffixCache, SuffixTree


def test_counts_by_hand():
    t = SuffixTree(4)
    t.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert t.total == 9  # the root counts every token (every suffix start)
    assert t.count([1]) == 3 and t.count([1, 2]) == 3  # [1, 2] at 0, 3, 6
    assert t.count([1, 2, 3]) == 2 and t.count([1, 2, 4]) == 1
    assert t.count([2, 3, 1, 2]) == 1  # length 4 = D: still held
    assert t.count([1, 2, 3, 1, 2]) == 0  # longer than D: never stored
    assert t.count([3, 3]) == 0
    t.extend("a", [1])  # appending extends the open suffixes: [2, 3, 1] and [3, 1] occur twice now
    assert t.count([2, 3, 1]) == 2 and t.count([3, 1]) == 2 and t.total == 10


def test_path_and_tree_scores_by_hand():
    t = SuffixTree(4)
    t.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    # context ...1 2: p = 1 ([2]: 3 times, children 3 (2), 4 (1)): MAX_SPEC 1, draft [3], D 2/3
    # p = 2 ([1, 2]: 3 times): MAX_SPEC 2, draft [3, 1] with D 2/3 and 2/3 * 1/2; score 1 wins
    s = t.speculate([9, 1, 2], k=5, alpha=1.0, offset=0.0, tau=0.1, tree=False)
    assert s.tokens == [3, 1] and s.parents == [-1, 0] and s.match_len == 2
    assert np.allclose(s.probs, [2 / 3, 1 / 3]) and abs(s.score - 1.0) < 1e-12
    # the tree: both children of [1, 2] (D 2/3, 1/3) before the grandchild (1/3, pushed later)
    s = t.speculate([9, 1, 2], k=5, alpha=1.0, offset=0.0, tau=0.1, tree=True)
    assert s.tokens == [3, 4] and s.parents == [-1, -1] and np.allclose(s.probs, [2 / 3, 1 / 3])
    s = t.speculate([9, 1, 2], k=5, alpha=2.0, offset=0.0, tau=0.1, tree=True)  # MAX_SPEC 4
    # D: 3 2/3, 4 1/3, then [.., 3, 1] 1/3 and [.., 4, 1] 1/3 (first pushed first); depth 4 = D ends it
    assert s.tokens == [3, 4, 1, 1] and s.parents == [-1, -1, 0, 1] and np.allclose(s.probs, [2 / 3] + [1 / 3] * 3)
    # tau: D(N) = 1/3 < 0.4 is not drafted
    s = t.speculate([9, 1, 2], k=5, alpha=2.0, offset=0.0, tau=0.4, tree=True)
    assert s.tokens == [3] and s.match_len == 2
    assert t.speculate([7, 7], k=5, alpha=1.0, offset=0.0, tau=0.1, tree=False).tokens == []  # no match


def test_adaptive_length_rule():
    cfg = SuffixConfig(k=6, max_spec_factor=0.5, max_spec_offset=1.0)
    assert [max_spec(p, cfg) for p in range(1, 13)] == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6]  # min(k, floor)
    assert [max_spec(p, SuffixConfig(max_spec_offset=-2.0)) for p in (1, 2, 3, 30)] == [0, 0, 1, 24]
    t = SuffixTree(24)
    t.extend(0, list(range(10)) * 2)  # 0..9 twice: the context 0..9 matches up to p = 9 (< T = 10)
    for alpha, want in ((1.0, 9), (0.5, 4), (0.25, 2)):
        s = t.speculate(list(range(10)), k=20, alpha=alpha, offset=0.0, tau=0.1, tree=False)
        assert s.tokens == list(range(want)) and s.match_len == 9, (alpha, s)
    t = SuffixTree(6)  # depth 6: match + draft <= 6, and p < min(T, D)
    t.extend(0, list(range(10)) * 2)
    s = t.speculate(list(range(10)), k=20, alpha=1.0, offset=0.0, tau=0.1, tree=False)
    assert s.match_len == 3 and s.tokens == [0, 1, 2]  # p = 3 drafts 3; p = 4, 5 reach depth 6 after 2, 1


def test_removal_and_eviction_under_the_caps():
    t = SuffixTree(5)
    t.extend(0, [1, 2, 3, 4])
    edges, nodes = dict(t.edges), t.num_nodes
    t.extend(1, [2, 3, 9, 2, 3])
    t.remove(1)  # back to exactly the first sequence's tree
    assert t.edges == edges and t.num_nodes == nodes == 10 and t.total == 4
    t.extend(2, [5, 6])  # freed ids are reused
    assert t.num_nodes == 13 and len(t.cnt) == 1 + 10 + 9  # the second sequence made 9 nodes
    c = SuffixCache(max_depth=4, max_requests=2, max_nodes=None)
    ids = [c.start() for _ in range(3)]
    for r in ids:
        c.extend(r, [r, r + 1])
    c.evict(protected=[ids[0]])  # 3 > 2 requests: the oldest unprotected one (1) goes
    assert c.requests == [0, 2] and c.evicted == 1 and c.tree.count([1, 2]) == 0 and c.tree.count([0, 1]) == 1
    c = SuffixCache(max_depth=4, max_requests=100, max_nodes=6)
    for r in range(4):
        c.extend(c.start(), [10 * r + 1, 10 * r + 2])  # 3 nodes each
    c.evict(protected=[3])
    assert c.requests == [2, 3] and c.tree.num_nodes == 6
    c.max_nodes = 3
    c.evict(protected=[2, 3])  # nothing evictable: the running requests stay over the cap
    assert c.requests == [2, 3] and c.tree.num_nodes == 6
    off = SuffixCache(max_depth=4, max_requests=0, max_nodes=None)
    assert not off.enabled and off.start() is None


V = 8


@pytest.fixture(scope="module")
def target():
    m = tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _left_padded(prompts):
    """(ids, mask) of prompts of several lengths, left-padded."""
    ids = torch.zeros(len(prompts), max(len(x) for x in prompts), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, x in enumerate(prompts):
        ids[r, ids.shape[1] - len(x):], mask[r, ids.shape[1] - len(x):] = x, 1
    return ids, mask


def _ragged(n, a, b):
    """n rows: the first half prompt a, the rest prompt b, left-padded (ids, mask)."""
    return _left_padded([a] * (n // 2) + [b] * (n - n // 2))


def test_cross_request_reuse(target):
    """A second request with the same prompt drafts the first's continuation from the global tree."""
    prompt = torch.tensor([[3, 1, 4, 1, 5, 7, 2]])
    prop = SuffixProposer(SuffixConfig(k=8))
    first = speculative_generate(target, prop, prompt, max_new_tokens=24, temperature=0.0)
    assert prop.cache.requests == [0] and prop.cache.tree.total == 24  # the output, not the prompt
    from_global = prop.source_counts[1]
    drafts = []
    orig = prop.propose

    def spy(ctx, s, g):
        d = orig(ctx, s, g)
        drafts.append((int(ctx.lengths[0]) - prompt.shape[1], d.tokens[0, : int(d.lengths[0])].tolist()))
        return d

    prop.propose = spy
    second = speculative_generate(target, prop, prompt, max_new_tokens=24, temperature=0.0)
    assert torch.equal(first.tokens, second.tokens) and prop.cache.requests == [0, 1]
    out = first.tokens[0].tolist()
    # the first output's continuation, drafted from the global tree, several tokens at a time
    assert sum(len(d) >= 3 and d == out[done: done + len(d)] for done, d in drafts) >= 2, (out, drafts)
    assert prop.source_counts[1] > from_global
    assert second.stats.target_forwards < first.stats.target_forwards / 2  # most of it drafted and kept


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_parity_ragged(target, tree):
    ids, mask = _left_padded([torch.tensor(x) for x in ([3, 1, 4, 1, 5, 7, 2, 6, 5, 3, 5], [7, 2, 7, 2, 7],
                                                        [1, 6, 1, 6, 0, 3, 4, 2], [7, 2, 7, 2, 7], [5, 4])])
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0.0)
    prop = SuffixProposer(SuffixConfig(k=5, tree=tree))
    for _ in range(2):  # the second call drafts from the first's outputs too
        out = speculative_generate(target, prop, ids, mask, max_new_tokens=20, temperature=0.0)
        assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_tokens, ref.num_tokens)
    assert out.stats.num_accepted_tokens > 0 and min(prop.source_counts) > 0


class _EstimatesAsQ(SuffixProposer):
    """LOSSY control: the tree's estimate D(N) passed as the draft's q (mass D on the drafted token,
    the rest spread evenly), as if the deterministic draft had been sampled from it."""

    def propose(self, ctx, sampling, generator):
        d = super().propose(ctx, sampling, generator)
        D = self.last_probs.float()  # (B, K)
        q = ((1 - D) / (V - 1)).unsqueeze(-1).expand(-1, -1, V).clone()  # (B, K, V)
        on = d.tokens >= 0  # (B, K)
        q[on.nonzero(as_tuple=True) + (d.tokens[on],)] = D[on]
        return dataclasses.replace(d, q=q)


def _whole_loop(target, make, n=50_000, L=2):
    """Rows of two prompts (ragged, left-padded) at T = 1; the global tree holds 40 earlier outputs
    of prompt a (its exact continuations), so a's rows draft from it and b's rows (a repetitive
    prompt) from their own trees. Returns (exact, counts, result, stats, proposer)."""
    a, b = torch.tensor([3, 1, 4, 1, 5, 7, 2, 6, 5, 3, 5]), torch.tensor([7, 2, 7, 2, 7])
    ea, eb = (hf_joint_distribution(target, x, L, SamplingConfig(1.0)).numpy() for x in (a, b))
    prop = make()
    cache = prop.ngram.cache if isinstance(prop, HybridProposer) else prop.cache
    rng = np.random.default_rng(0)
    for j in rng.choice(V ** L, size=40, p=ea / ea.sum()):
        cache.extend(cache.start(), a.tolist() + [int(j) // V, int(j) % V])
    ids, mask = _ragged(n, a, b)
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=L, temperature=1.0,
                               generator=torch.Generator().manual_seed(3))
    toks = out.tokens[:, :L].numpy()
    counts = np.concatenate([oracle.counts(oracle.joint_index(toks[: n // 2], V), V ** L),
                             oracle.counts(oracle.joint_index(toks[n // 2:], V), V ** L)])
    exact = np.concatenate([ea, eb]) / 2  # the joint of (prompt, 2 tokens): half the rows each
    return exact, counts, oracle.chi_square_gof(counts, exact), out.stats, prop


@pytest.mark.two_threads
@pytest.mark.parametrize("tree", [False, True])
def test_whole_loop_lossless_ragged(target, tree):
    """Joint of (prompt, first 2 tokens) vs exact, 50,000 rows of two prompt lengths in one batch
    (power >= 0.99 against TV 0.02 at 1e-3 asserted); both trees draft, most drafts are partly kept."""
    cfg = SuffixConfig(k=3 if tree else 2, tree=tree, max_cached_requests=10 ** 6)
    exact, counts, res, s, prop = _whole_loop(target, lambda: SuffixProposer(cfg))
    assert power_sample_size(exact, 50_000) <= 50_000
    assert res.p_value > 1e-3, res
    assert min(prop.source_counts) > 20_000, prop.source_counts  # the request's and the global tree
    assert s.num_accepted_tokens > 20_000 and s.num_draft_tokens - s.num_accepted_tokens > 20_000, s


@pytest.mark.two_threads
def test_lossy_control_fails_the_same_test(target):
    exact, counts, res, s, _ = _whole_loop(target, lambda: _EstimatesAsQ(SuffixConfig(k=2, max_cached_requests=10 ** 6)))
    tv = 0.5 * float(np.abs(counts / counts.sum() - exact).sum())
    assert res.p_value < 1e-12 and tv > 0.05, (res, tv)  # measured: TV 0.096


def test_a_refilled_row_is_a_new_request():
    """A row whose prompt length changes (a scheduler's refill) or whose context shrinks starts a new
    request: a new tree from its new prompt, a new id in the global tree; the old one stays cached."""
    from specref.proposer import Context

    prop = SuffixProposer(SuffixConfig(k=4))
    tok = torch.tensor([[1, 2, 3, 1, 2, 0, 0], [4, 5, 4, 5, 0, 0, 0]])  # (2, 7)
    ctx = Context(tokens=tok.clone(), lengths=torch.tensor([5, 4]), active=torch.ones(2, dtype=torch.bool),
                  prompt_lengths=torch.tensor([3, 4]))
    prop.begin(ctx, None, None)
    assert prop.cache.requests == [0, 1] and prop.cache.tree.total == 2  # row 0's output [1, 2]
    assert prop.propose(ctx, None, None).tokens[0, 0] == 3  # [.., 1, 2] -> 3 (its own tree)
    ctx.tokens[1] = torch.tensor([6, 6, 6, 0, 0, 0, 0])
    ctx.lengths, ctx.prompt_lengths = torch.tensor([5, 3]), torch.tensor([3, 3])
    prop.update(ctx, torch.zeros(2, dtype=torch.long))
    assert prop.cache.requests == [0, 1, 2] and prop._local[1].seqs[0] == [6, 6, 6]


def test_reset_rows_starts_a_new_request_even_at_the_old_prompt_length(target):
    """reset_rows (scheduler.py's refill): the row's new prompt alone in its tree, a new id in the
    global tree, though its prompt is as long as the old one's (where update() alone cannot tell);
    through the scheduler every request's tokens are `ar`'s and no row idles while requests wait."""
    from specref.proposer import Context
    from specref.scheduler import Request, schedule

    prop = SuffixProposer(SuffixConfig(k=4))
    tok = torch.tensor([[1, 2, 3, 1, 2, 0], [4, 5, 4, 5, 0, 0]])  # (2, 6)
    ctx = Context(tokens=tok.clone(), lengths=torch.tensor([5, 4]), active=torch.ones(2, dtype=torch.bool),
                  prompt_lengths=torch.tensor([3, 4]))
    prop.begin(ctx, None, None)
    ctx.tokens[0] = torch.tensor([7, 8, 9, 0, 0, 0])
    ctx.lengths = torch.tensor([3, 4])
    prop.reset_rows(ctx, torch.tensor([0]))
    assert prop.cache.requests == [0, 1, 2] and prop._local[0].seqs[0] == [7, 8, 9]
    assert prop._local[1].seqs[0] == [4, 5, 4, 5]  # the other row untouched
    g = torch.Generator().manual_seed(4)
    reqs = [Request(torch.randint(0, V, (int(torch.randint(2, 8, (), generator=g)),), generator=g).tolist(),
                    max_new_tokens=int(torch.randint(4, 20, (), generator=g))) for _ in range(7)]
    ref = [autoregressive_generate(target, torch.tensor(r.prompt), max_new_tokens=r.max_new_tokens,
                                   temperature=0).row(0) for r in reqs]
    prop = SuffixProposer(SuffixConfig(k=4))
    out = schedule(target, prop, reqs, batch_size=3, refill="row", temperature=0)
    assert out.tokens == ref and out.stats.idle_row_steps == 0
    assert prop.cache.requests == list(range(7)) and out.stats.num_draft_tokens > 0


def _hybrid(target, tree=False, min_score=1.5, k=2, **kw):
    """SuffixDecoding where its score reaches min_score, else a 1-layer truncated draft (sampled q)."""
    return HybridProposer(SuffixProposer(SuffixConfig(k=3, tree=tree, min_score=min_score, **kw)),
                          DraftModelProposer(truncated_draft(target, 1), DraftModelConfig(k=k)))


@pytest.mark.parametrize("tree", [False, True])
def test_hybrid_greedy_parity_and_both_sources(target, tree):
    ids, mask = _left_padded([torch.tensor(x) for x in ([3, 1, 4, 1, 5, 7, 2, 6, 5, 3, 5], [7, 2, 7, 2, 7],
                                                        [1, 6, 1, 6, 0, 3, 4, 2])])
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=24, temperature=0.0)
    prop = _hybrid(target, tree)
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=24, temperature=0.0)
    assert torch.equal(out.tokens, ref.tokens) and min(prop.source_counts) > 0, prop.source_counts
    with pytest.raises(ValueError, match="chain drafts only"):
        HybridProposer(SuffixProposer(SuffixConfig(tree=True)), prop.learned, HybridConfig(mode="tree"))


@pytest.mark.two_threads
def test_hybrid_suffix_tree_whole_loop(target):
    """The hybrid at T = 1: suffix trees (deterministic nodes) and sampled draft-model chains (q) in
    one tree draft, one sibling kind per node; the same ragged test as above."""
    exact, counts, res, s, prop = _whole_loop(target, lambda: _hybrid(target, True, 1.0, max_cached_requests=10 ** 6))
    assert power_sample_size(exact, 50_000) <= 50_000
    assert res.p_value > 1e-3, res
    assert min(prop.source_counts) > 5_000, prop.source_counts


def test_registry_keeps_one_cache_per_method():
    m = tiny_model("llama", vocab_size=64, init_std=0.2)
    reg = Registry(m, kind="tiny", draft_k=2)
    a, b = reg.proposer("suffix"), reg.proposer("suffix")
    assert a is not b and a.cache is b.cache and reg.proposer("suffix_tree").cache is not a.cache
    assert reg.proposer("suffix_tree").config.tree and not a.config.tree
    h = reg.proposer("hybrid_suffix")
    assert isinstance(h, HybridProposer) and h.ngram.config.min_score == h.learned.k
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    speculative_generate(m, a, ids, max_new_tokens=5, temperature=0.0)
    assert b.cache.requests == [0, 1] and "SuffixDecoding" in reg.label("hybrid_suffix")


def test_config_errors():
    for kw, msg in (({"k": 0}, "k must be"), ({"max_depth": 0}, "max_depth"), ({"max_cached_requests": -1}, "max_cached"),
                    ({"max_cached_nodes": -5}, "max_cached_nodes"), ({"min_token_prob": 1.5}, "min_token_prob"),
                    ({"max_spec_factor": -1.0}, "max_spec_factor"), ({"tree": 1}, "tree must")):
        with pytest.raises(ValueError, match=msg):
            SuffixConfig(**kw)
    with pytest.raises(ValueError, match="config must be a SuffixConfig"):
        SuffixProposer("suffix")
    with pytest.raises(ValueError, match="cache must be a SuffixCache"):
        SuffixProposer(SuffixConfig(max_depth=8), cache=SuffixConfig().cache())
    assert SuffixConfig(k=np.int64(3)).k == 3
