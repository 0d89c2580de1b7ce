"""Tests of eagle_sampled.py (EAGLE-2's tree with siblings drawn without replacement): the draws'
law, the tree's contract (siblings distinct, a prefix of the draws, the parent's q, a shape that
never looks at a node's own token), greedy equal to eagle_tree's tree, rows independent of the
batch, and the whole loop at T > 0 under token-wise and traversal verification on a ragged batch
(chi-square against the exact joint), with a lossy control: the same trees cut by their own
tokens' q (EAGLE-2's value applied to sampled siblings) fail the same test."""
import numpy as np
import pytest
import torch

from _features import trained_eagle
from _stats import power_sample_size
from specref import oracle
from specref.eagle_sampled import Eagle2SampledProposer, draw_without_replacement
from specref.eagle_tree import Eagle2Config, Eagle2Proposer
from specref.generate import speculative_generate
from specref.oracle.exact import hf_joint_distribution
from specref.proposer import Draft
from specref.registry import verify_rules
from specref.sampling import SamplingConfig, make_generators

V = 16
PROMPTS = ([3, 1, 4, 1, 5], [3, 1, 4])  # ragged: 5 and 3 tokens
CFG = Eagle2Config(top_k=2, depth=3, total_tokens=5, min_value=0.0)  # siblings at every level


@pytest.fixture(scope="module")
def trained():
    return trained_eagle()  # (target, EAGLE-1 head, history), shared with test_eagle.py


def test_draws_without_replacement_law():
    """The pair (first, second draw) against q(a) q(b) / (1 - q(a)); the draws always distinct."""
    q = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 40_000
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(0))
    x = draw_without_replacement(q.expand(n, -1), u)  # (n, 2)
    assert bool((x[:, 0] != x[:, 1]).all())
    qn = q.double().numpy()
    exact = np.outer(qn, qn) / (1 - qn)[:, None]
    np.fill_diagonal(exact, 0.0)
    res = oracle.chi_square_gof(oracle.counts((x[:, 0] * 5 + x[:, 1]).numpy(), 25), exact.ravel())
    assert res.p_value > 1e-3, res
    short = draw_without_replacement(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.3, 0.9]]))
    assert short[0, 0] == 1  # past q's support the second draw is arbitrary (its slot has value 0)


def _draft(trained, cfg, temperature, seed, n=3):
    target, head, _ = trained
    ids = torch.tensor([PROMPTS[0]] * n)
    prop = Eagle2SampledProposer(head, cfg)
    drafts = []
    real = prop._propose

    def keep(ctx, sampling, generator):
        d = real(ctx, sampling, generator)
        drafts.append(d)
        return d
    prop._propose = keep
    speculative_generate(target, prop, ids, max_new_tokens=8, temperature=temperature,
                         generator=make_generators(seed, n))
    return drafts


def test_tree_contract(trained):
    """Siblings distinct, each node's q its parent's q (shared by its siblings) holding its token,
    the kept siblings the first draws (q^(j) of the slot >= the next kept one's), depth <= cfg.depth."""
    cfg = Eagle2Config(top_k=3, depth=3, total_tokens=7, min_value=0.0)
    for d in _draft(trained, cfg, 1.0, 0):
        assert d.siblings == "without" and d.q is not None
        for b in range(d.tokens.shape[0]):
            n = int(d.lengths[b])
            par, tok = d.parents[b, :n].tolist(), d.tokens[b, :n].tolist()
            for i in range(n):
                assert float(d.q[b, i, tok[i]]) > 0
                sib = [j for j in range(n) if par[j] == par[i]]
                assert len({tok[j] for j in sib}) == len(sib)
                assert all(torch.equal(d.q[b, j], d.q[b, i]) for j in sib)
                assert par[i] < i
                depth, j = 0, i
                while j >= 0:
                    depth, j = depth + 1, par[j]
                assert depth <= cfg.depth


def test_one_level_shape_never_depends_on_the_draws(trained):
    """depth 1: the slot values are q's sorted probabilities, so the number of nodes per row is the
    same whatever the generator draws (EAGLE-2's V would make it depend on the drawn tokens)."""
    cfg = Eagle2Config(top_k=4, depth=1, total_tokens=4, min_value=0.1)
    a, b = _draft(trained, cfg, 1.0, 0), _draft(trained, cfg, 1.0, 100)
    assert torch.equal(a[0].lengths, b[0].lengths)
    assert not torch.equal(a[0].tokens, b[0].tokens) or not torch.equal(a[1].tokens, b[1].tokens)


def test_greedy_is_eagle2s_tree(trained):
    target, head, _ = trained
    ids = torch.tensor([PROMPTS[0], [0, 0] + PROMPTS[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    a = speculative_generate(target, Eagle2SampledProposer(head, CFG), ids, mask, max_new_tokens=12, temperature=0)
    b = speculative_generate(target, Eagle2Proposer(head, CFG), ids, mask, max_new_tokens=12, temperature=0)
    assert torch.equal(a.tokens, b.tokens) and a.stats.target_forwards == b.stats.target_forwards


@pytest.mark.parametrize("verify", ["tokenwise", "traversal"])
def test_a_row_alone_equals_its_row_in_the_batch(trained, verify):
    target, head, _ = trained
    ids = torch.tensor([PROMPTS[0], [0, 0] + PROMPTS[1], PROMPTS[0]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [1] * 5])
    out = speculative_generate(target, Eagle2SampledProposer(head, CFG), ids, mask, max_new_tokens=10,
                               temperature=0.8, verify=verify, generator=make_generators(3, 3))
    for b in range(3):
        one = speculative_generate(target, Eagle2SampledProposer(head, CFG), ids[b:b + 1], mask[b:b + 1],
                                   max_new_tokens=10, temperature=0.8, verify=verify,
                                   generator=make_generators(3 + b, 1))
        assert one.row(0) == out.row(b)


class _CutByOwnToken(Eagle2SampledProposer):
    """The lossy control: one level of sampled siblings, the second and later kept only while their
    own token's q is >= 0.25 (a shape that looks at the drawn token, as EAGLE-2's value V would)."""

    def _propose(self, ctx, sampling, generator):
        d = super()._propose(ctx, sampling, generator)
        if d.q is None:
            return d
        own = d.q.gather(2, d.tokens.clamp(min=0).unsqueeze(-1))[..., 0]  # (B, N)
        ok = (own >= 0.25) | (torch.arange(d.tokens.shape[1]) == 0)
        lengths = torch.minimum(d.lengths, ok.long().cumprod(1).sum(1))  # (B,)
        tokens = torch.where(torch.arange(d.tokens.shape[1]) < lengths.view(-1, 1), d.tokens, -1)
        return Draft(tokens, lengths, q=d.q, parents=torch.where(tokens >= 0, d.parents, -1), siblings="without")


def _ragged(trained, prop, verify, temperature, n, seed):
    target = trained[0]
    T = max(map(len, PROMPTS))
    ids, mask = torch.zeros(n, T, dtype=torch.long), torch.zeros(n, T, dtype=torch.long)
    for b in range(n):
        pr = PROMPTS[b % 2]
        ids[b, T - len(pr):], mask[b, T - len(pr):] = torch.tensor(pr), 1
    L = 3
    out = speculative_generate(target, prop, ids, mask, max_new_tokens=L, temperature=temperature, verify=verify,
                               generator=torch.Generator().manual_seed(seed))
    ps = []
    for j, pr in enumerate(PROMPTS):
        exact = hf_joint_distribution(target, torch.tensor(pr), L, SamplingConfig(temperature)).numpy()
        rows = out.tokens[j::2, :L].numpy()
        ps.append((oracle.chi_square_gof(oracle.counts(oracle.joint_index(rows, V), V ** L), exact).p_value,
                   power_sample_size(exact, rows.shape[0]) <= rows.shape[0]))
    return ps, out.stats


@pytest.mark.two_threads
@pytest.mark.parametrize("verify,temperature,n", [("tokenwise", 1.0, 160_000), ("traversal", 1.0, 160_000),
                                                  ("traversal", 0.7, 100_000)])
def test_whole_loop_lossless(trained, verify, temperature, n):
    """The joint of the first 3 tokens per prompt of a ragged batch against its exact law, with the
    power against TV 0.02 at 1e-3 (tests/_stats.power_sample_size) on each prompt's rows."""
    ps, s = _ragged(trained, Eagle2SampledProposer(trained[1], CFG), verify, temperature, n, 7)
    assert all(powered for _, powered in ps), ps
    assert min(p for p, _ in ps) > 1e-3, ps
    assert s.accepted_per_position[1] > 1000 and s.tokens_per_forward < 3.0, s  # accepted and rejected nodes


@pytest.mark.two_threads
@pytest.mark.parametrize("verify", ["tokenwise", "traversal"])
def test_a_shape_cut_by_its_own_tokens_fails(trained, verify):
    cfg = Eagle2Config(top_k=3, depth=1, total_tokens=3, min_value=0.0)
    ps, _ = _ragged(trained, _CutByOwnToken(trained[1], cfg), verify, 1.0, 40_000, 8)
    assert min(p for p, _ in ps) < 1e-3, ps


def test_registry_offers_traversal_to_it():
    assert verify_rules("eagle2_sampled") == ("tokenwise", "traversal")
    assert verify_rules("eagle2") == ("tokenwise",)
