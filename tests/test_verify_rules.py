"""speculative_generate(verify=...) through the whole loop (generate.py, prepare.py): block
verification on a draft model's chains, traversal verification on Gumbel-top-k trees.

Lossless: the joint of the first L tokens from the loop against the exact distribution (V = 16), a
ragged batch (two prompts of different lengths, left-padded, alternating rows), each prompt's rows
tested against its own exact law with the power against TV 0.02 asserted (_stats.power_sample_size:
60,000 rows per prompt). The lossy controls fail with a third of the rows.
Lossy controls: the same test fails when the final token after a rejection is drawn from p instead
of the rule's residual, for either rule (the product rule, lossy at the step level in
test_block_verify.py, moves the first two tokens' joint too little to fail here). Greedy: token-exact against `ar`.
"""
import pytest
import torch

from _stats import power_sample_size
from test_traversal import _bonus_from_p
from test_tree_generate import SHAPES, BigramTreeProposer, bigram_table
from specref import oracle, rejection
from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import perturbed_copy, tiny_model
from specref.oracle.exact import hf_joint_distribution
from specref.registry import verify_rules
from specref.sampling import SamplingConfig, sample_from_probs

ALPHA = 1e-3
V = 16
PROMPTS = ([3, 1, 4, 1, 5], [2, 7, 1])  # ragged: 5 and 3 tokens


def _target():
    return tiny_model("llama", vocab_size=V, seed=11, init_std=0.2, logit_scale=4.0, num_heads=2, num_kv_heads=1)


def _batch(n: int):
    """n rows alternating the two prompts, left-padded, and the mask."""
    T = max(map(len, PROMPTS))
    ids = torch.zeros(n, T, dtype=torch.long)
    mask = torch.zeros(n, T, dtype=torch.long)
    for b in range(n):
        pr = PROMPTS[b % 2]
        ids[b, T - len(pr):], mask[b, T - len(pr):] = torch.tensor(pr), 1
    return ids, mask


def _ragged_p_values(target, make_proposer, verify, L, temperature, n, seed, powered=True):
    s = SamplingConfig(temperature)
    ids, mask = _batch(n)
    out = speculative_generate(target, make_proposer(), ids, mask, max_new_tokens=L, temperature=temperature,
                               verify=verify, generator=torch.Generator().manual_seed(seed))
    ps = []
    for j, pr in enumerate(PROMPTS):
        exact = hf_joint_distribution(target, torch.tensor(pr), L, s).numpy()
        rows = out.tokens[j::2, :L].numpy()
        assert not powered or power_sample_size(exact, rows.shape[0]) <= rows.shape[0]
        ps.append(oracle.chi_square_gof(oracle.counts(oracle.joint_index(rows, V), V ** L), exact).p_value)
    return ps, out


@pytest.mark.two_threads
def test_block_whole_loop_lossless_and_a_lossy_control_fails(monkeypatch):
    target = _target()
    draft = perturbed_copy(target, 0.3, seed=0)
    make = lambda: DraftModelProposer(draft, DraftModelConfig(k=3))
    ps, out = _ragged_p_values(target, make, "block", 2, 1.0, 120_000, 1)
    assert min(ps) > ALPHA, ps
    assert 0.3 < out.stats.acceptance_rate < 0.95
    real = rejection.verify_chain_block

    def lossy(d, p, q, *, lengths, generator, validate, draws):  # after a rejection, y from p at tau
        res = real(d, p, q, lengths=lengths, generator=generator, validate=validate, draws=draws)
        rows, tau = torch.arange(d.shape[0]), res.num_accepted
        y = sample_from_probs(p[rows, tau], torch.rand(d.shape[0], generator=torch.Generator().manual_seed(5)))
        res.tokens[rows, tau] = torch.where(tau < lengths, y, res.tokens[rows, tau])
        return res
    monkeypatch.setattr(rejection, "verify_chain_block", lossy)
    ps, _ = _ragged_p_values(target, make, "block", 2, 1.0, 40_000, 2, powered=False)  # fails with fewer
    assert min(ps) < ALPHA, ps


@pytest.mark.two_threads
def test_traversal_whole_loop_lossless_and_bonus_from_p_fails(monkeypatch):
    target = _target()
    table = bigram_table(target, V)
    make = lambda: BigramTreeProposer(table, SHAPES["mixed"], "without")  # branches below the root's children
    ps, out = _ragged_p_values(target, make, "traversal", 2, 0.9, 120_000, 3)
    assert min(ps) > ALPHA, ps
    assert out.stats.num_accepted_tokens > 0.2 * 120_000

    def lossy(tokens, parents, p, q, *, lengths, generator, validate, siblings):
        return _bonus_from_p(tokens, parents, p, q, lengths=lengths, generator=generator, siblings=siblings)
    monkeypatch.setattr(rejection, "verify_tree_traversal", lossy)
    ps, _ = _ragged_p_values(target, make, "traversal", 2, 0.9, 40_000, 4, powered=False)
    assert min(ps) < ALPHA, ps


def test_greedy_is_the_targets_output_under_every_rule():
    target = tiny_model("llama", vocab_size=32, seed=21, logit_scale=3.0)
    ids, mask = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=12, temperature=0)
    draft = tiny_model("llama", vocab_size=32, seed=22, num_layers=1, logit_scale=3.0)
    sp = speculative_generate(target, DraftModelProposer(draft, DraftModelConfig(k=3)), ids, mask, max_new_tokens=12,
                              temperature=0, verify="block")
    assert torch.equal(sp.tokens, ar.tokens)
    tree = BigramTreeProposer(bigram_table(draft, 32), SHAPES["mixed"], "without")
    sp = speculative_generate(target, tree, ids, mask, max_new_tokens=12, temperature=0, verify="traversal")
    assert torch.equal(sp.tokens, ar.tokens)


def test_a_rule_the_draft_cannot_take_names_verify():
    target = _target()
    draft = perturbed_copy(target, 0.3, seed=0)
    ids = torch.tensor([[3, 1, 4]])
    chain = DraftModelProposer(draft, DraftModelConfig(k=2))
    table = bigram_table(target, V)
    cases = [(chain, "traversal", "verify='traversal' verifies trees"),
             (BigramTreeProposer(table, SHAPES["mixed"], "without"), "block", "verify='block' verifies chains"),
             (BigramTreeProposer(table, SHAPES["mixed"], True), "traversal", "siblings drawn without replacement"),
             (chain, "optimal", "verify must be one of")]
    for prop, rule, msg in cases:
        for T in (0.0, 1.0) if rule != "traversal" or prop is chain else (1.0,):  # greedy: any kind is exact match
            with pytest.raises(ValueError, match=msg):
                speculative_generate(target, prop, ids, max_new_tokens=4, temperature=T, verify=rule, seed=0)


def test_registry_rules():
    assert verify_rules("draft") == verify_rules("eagle") == verify_rules("mtp") == ("tokenwise", "block")
    assert verify_rules("mlp_speculator") == verify_rules("eagle3") == ("tokenwise", "block")
    assert verify_rules("eagle2") == verify_rules("medusa") == verify_rules("ar") == ("tokenwise",)
    with pytest.raises(ValueError, match="unknown method"):
        verify_rules("nope")
