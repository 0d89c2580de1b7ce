"""Tests of hybrid.py: prompt lookup first, a learned proposer (EAGLE head or draft model) elsewhere.
Greedy parity (batched, row alone), both sources used, the learned part's state across the steps it
sits out, the whole-loop chi-square with mixed q / one-hot rows in one batch, errors."""
import pytest
import torch

from _stats import power_sample_size
from specref import oracle
from specref.draft_model import DraftModelConfig, DraftModelProposer, truncated_draft
from specref.eagle_head import EagleConfig, EagleHead, EagleProposer
from specref.oracle.exact import hf_joint_distribution
from specref.generate import autoregressive_generate, speculative_generate
from specref.hybrid import HybridConfig, HybridProposer
from specref.lookahead import LookaheadProposer
from specref.models import tiny_model
from specref.ngram import NgramConfig, NgramProposer
from specref.sampling import SamplingConfig
from test_eagle import _reference_draft

V = 16


@pytest.fixture(scope="module")
def target():
    m = tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _learned(target, kind, k=3, **kw):
    if kind == "eagle":  # untrained head over 12 of the 16 tokens: rarely right, never wrong in law
        return EagleProposer(EagleHead(target, torch.arange(0, 12), seed=1), EagleConfig(k=k, **kw))
    return DraftModelProposer(truncated_draft(target, 1), DraftModelConfig(k=k, **kw))


def _hybrid(target, kind, k=3, ng=NgramConfig(min_n=1, max_n=3, k=4), mode="select", **kw):
    return HybridProposer(NgramProposer(ng), _learned(target, kind, k, **kw), HybridConfig(mode))


@pytest.mark.parametrize("mode", ["select", "tree"])
@pytest.mark.parametrize("kind", ["eagle", "draft"])
def test_greedy_parity_and_both_sources(target, kind, mode):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (4, 10), generator=g)  # (4, 10)
    ids[1, 5:] = ids[1, :5]  # a repeated prompt: prompt lookup matches at once
    mask = (torch.arange(10) >= torch.tensor([0, 0, 4, 2]).view(4, 1)).long()  # left padding
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=30, temperature=0, eos_token_id=7)
    prop = _hybrid(target, kind, mode=mode)
    sp = speculative_generate(target, prop, ids, mask, max_new_tokens=30, temperature=0, eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert min(prop.source_counts) >= 5, prop.source_counts  # both sources drafted, many steps each
    assert sp.stats.num_accepted_tokens > 0
    for b in range(4):  # row alone (batch 1: the learned part sits out n-gram steps entirely)
        one_prop = _hybrid(target, kind, mode=mode)
        one = speculative_generate(target, one_prop, ids[b:b + 1], mask[b:b + 1], max_new_tokens=30,
                                   temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


@pytest.mark.parametrize("mode", ["select", "tree"])
@pytest.mark.parametrize("kind", ["eagle", "draft"])
def test_sampled_row_alone_equals_row_in_batch(target, kind, mode):
    """One generator per row, temperature 1: each row emits alone exactly what it emits in the batch,
    although other rows switch between the two sources (and draft other lengths) in other steps."""
    ids = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(9))  # (4, 8)
    ids[0, 4:] = ids[0, :4]
    gens = lambda rows: [torch.Generator().manual_seed(70 + b) for b in rows]  # noqa: E731
    prop = _hybrid(target, kind, k=2, mode=mode)
    batch = speculative_generate(target, prop, ids, max_new_tokens=24, temperature=1.0, generator=gens(range(4)))
    assert min(prop.source_counts) >= 5, prop.source_counts
    for b in range(4):
        one = speculative_generate(target, _hybrid(target, kind, k=2, mode=mode), ids[b:b + 1],
                                   max_new_tokens=24, temperature=1.0, generator=gens([b]))
        assert one.row(0) == batch.row(b), b


def _scratch_draft(target, kind, module, row, k):
    """The greedy draft of `row` (committed tokens, pending last) recomputed without any cache."""
    if kind == "eagle":
        return _reference_draft(target, module, row, k)
    x, out = row[None, :], []
    with torch.no_grad():
        for _ in range(k):
            tok = module(input_ids=x).logits[0, -1].argmax()
            out.append(int(tok))
            x = torch.cat([x, tok.view(1, 1)], dim=1)
    return out


@pytest.mark.parametrize("mode", ["select", "tree"])
@pytest.mark.parametrize("kind", ["eagle", "draft"])
def test_learned_state_survives_skipped_steps(target, kind, mode):
    """The learned part drafts, sits out n-gram steps (as an inactive row, or not called at all when no
    row needs it), drafts again: every draft it makes equals a from-scratch recomputation on the
    committed context (its cache caught up, nothing stale kept or wrongly rolled back)."""
    ids = torch.tensor([[3, 9, 4, 1, 5, 9, 2, 6, 3, 9, 4, 1], [0, 12, 8, 3, 14, 6, 11, 2, 13, 10, 5, 15]])
    hy = _hybrid(target, kind, k=2, mode=mode)
    module = hy.learned.head if kind == "eagle" else hy.learned.lm.model
    checked = []
    orig = hy.learned.propose

    def spy(ctx, s, g):
        d = orig(ctx, s, g)
        for b in ctx.active.nonzero().flatten().tolist():  # rows the learned part drafts this step
            ref = _scratch_draft(target, kind, module, ctx.row(b), int(d.lengths[b]))
            checked.append((d.tokens[b, : int(d.lengths[b])].tolist() == ref, hy.source_counts[0]))
        if kind == "draft":  # its bookkeeping: the cache holds exactly the `done` tokens of every row
            assert torch.equal(hy.learned.done, hy.learned.cache.lengths), (hy.learned.done, ctx.active)
        return d

    hy.learned.propose = spy
    learned_acc, orig_update = [], hy.learned.update
    hy.learned.update = lambda ctx, n: (learned_acc.append(int(n.sum())), orig_update(ctx, n))[1]
    out = speculative_generate(target, hy, ids, max_new_tokens=40, temperature=0)
    assert torch.equal(out.tokens, autoregressive_generate(target, ids, max_new_tokens=40, temperature=0).tokens)
    assert all(ok for ok, _ in checked), checked
    assert len(checked) >= 3 and checked[-1][1] >= 3, checked  # it drafted again after >= 3 n-gram steps
    assert sum(learned_acc) > 0, learned_acc  # its own drafts were accepted in some steps


@pytest.mark.two_threads
@pytest.mark.parametrize("kind,mode", [("eagle", "select"), ("draft", "tree")])  # q mixing as in draft/select
def test_whole_loop_lossless(target, kind, mode):
    """Joint of the first 2 tokens vs the exact distribution, 62,000 rows in one batch (power >= 0.99
    against TV 0.02 asserted): rows drafting sampled learned tokens (with q) and rows drafting n-gram
    tokens (one-hot q) share every step; k = 1 keeps two steps per row in play."""
    L, n = 2, 62_000
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])  # many tokens to match
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(1.0)).numpy()
    assert power_sample_size(exact, n) <= n
    prop = _hybrid(target, kind, k=1, ng=NgramConfig(min_n=1, max_n=2, k=3), mode=mode)  # k=1: more steps
    counts = []
    orig = prop.propose

    def spy(ctx, s, g):
        d = orig(ctx, s, g)
        counts.append((d.q is not None, int((d.lengths > 0).sum())))
        return d

    prop.propose = spy
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L, temperature=1.0,
                               generator=torch.Generator().manual_seed(3))
    toks = out.tokens[:, :L].numpy()
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(toks, V), V ** L), exact)
    assert res.p_value > 1e-3, res
    assert min(prop.source_counts) > 3000, prop.source_counts  # both sources, in the same steps
    assert any(has_q for has_q, _ in counts)
    s = out.stats
    assert s.num_accepted_tokens > 2000 and s.num_draft_tokens - s.num_accepted_tokens > 2000, s


def test_errors(target):
    with pytest.raises(ValueError, match="NgramProposer"):
        HybridProposer(_learned(target, "eagle"), _learned(target, "draft"))
    with pytest.raises(ValueError, match="model-based"):
        HybridProposer(NgramProposer(), NgramProposer())
    with pytest.raises(ValueError, match="model-based"):
        HybridProposer(NgramProposer(), LookaheadProposer())
    with pytest.raises(ValueError, match="Proposer protocol"):
        HybridProposer(NgramProposer(), object())
    with pytest.raises(ValueError, match="mode"):
        HybridConfig("both")
    with pytest.raises(ValueError, match="HybridConfig"):
        HybridProposer(NgramProposer(), _learned(target, "eagle"), "tree")
    prop = _hybrid(target, "eagle", k=2, ng=NgramConfig(k=6))
    assert prop.k == 6 and prop.hidden_layers == (-1,)
    assert _hybrid(target, "eagle", k=2, ng=NgramConfig(k=6), mode="tree").k == 8  # nodes of both chains
    assert _hybrid(target, "draft").hidden_layers is None
