"""The toy Markov LM (specref/oracle/toy.py) and the issue's seed exercise: the speculative loop on a toy
target and a perturbed toy draft generates 50,000 tokens distributed as direct target sampling.

Chi-square tests at significance 1e-3 (the seed exercise additionally p > 0.05 as the issue asks),
fixed seeds; power stated per test with oracle.detectable_tv / samples_for_tv.
"""
import numpy as np
import pytest
import torch
from scipy import stats

from specref.oracle import chi_square_gof, chi_square_two_sample, counts, detectable_tv, joint_index
from specref.rejection import ChainResult, verify_chain
from specref.sampling import SamplingConfig, sample
from specref.theory import acceptance_rate
from specref.oracle.toy import MarkovLM, ToyConfig, sample_direct, speculative_sample

ALPHA = 1e-3
TARGET = MarkovLM.from_config(ToyConfig(vocab=4, order=2, sharpness=1.5, seed=0))
DRAFT = TARGET.perturb(0.5, seed=1)  # half the mass from an unrelated table
PREFIX = torch.tensor([1, 2])


def test_next_probs_reads_the_table():
    m = MarkovLM.from_config(ToyConfig(vocab=5, order=2, seed=3))
    ctx = torch.tensor([[0, 1, 2, 3],  # state (2, 3) -> row 2 * 5 + 3
                        [4, 4, 0, 1]])  # state (0, 1) -> row 1
    assert torch.allclose(m.next_probs(ctx), m.table[[13, 1]].float())
    # lengths: the state is read before lengths[b]; a context shorter than `order` is padded with 0
    assert torch.allclose(m.next_probs(ctx, torch.tensor([2, 1])), m.table[[0 * 5 + 1, 0 * 5 + 4]].float())
    # order 1 uses the last token only
    m1 = MarkovLM.from_config(ToyConfig(vocab=5, order=1, seed=3))
    assert torch.allclose(m1.next_probs(ctx), m1.table[[3, 1]].float())
    # sharpness 0 gives uniform rows; larger sharpness concentrates mass
    flat = MarkovLM.from_config(ToyConfig(vocab=5, sharpness=0.0))
    assert torch.allclose(flat.table, torch.full((5, 5), 0.2, dtype=torch.float64))
    top = [MarkovLM.from_config(ToyConfig(vocab=5, sharpness=s)).table.max(-1).values.mean() for s in (0.5, 2, 8)]
    assert top[0] < top[1] < top[2]


def test_exact_joint_and_sequence_probabilities():
    joint = TARGET.joint_probs(PREFIX, 3)  # (64,)
    assert joint.shape == (64,) and abs(float(joint.sum()) - 1) < 1e-12
    for seq in ([0, 0, 0], [3, 1, 2], [2, 2, 1]):
        s = torch.tensor(seq)
        by_hand = 1.0
        ctx = PREFIX.tolist() + seq
        for i in range(3):  # chain rule with the table's state (previous two tokens)
            state = ctx[i] * 4 + ctx[i + 1]  # the two tokens before seq[i]
            by_hand *= float(TARGET.table[state, seq[i]])
        assert TARGET.sequence_prob(PREFIX, s) == pytest.approx(by_hand, rel=1e-6)
        assert float(joint[joint_index(s[None], 4)[0]]) == pytest.approx(by_hand, rel=1e-6)
    # marginalising the last token gives the joint of two
    assert torch.allclose(joint.view(16, 4).sum(1), TARGET.joint_probs(PREFIX, 2))
    # warped: top-k 2 leaves two tokens per row, so 2^3 sequences have all the mass
    warped = TARGET.joint_probs(PREFIX, 3, SamplingConfig(top_k=2))
    assert int((warped > 0).sum()) == 8 and abs(float(warped.sum()) - 1) < 1e-6


def test_perturb_knob():
    assert torch.equal(TARGET.perturb(0.0, seed=5).table, TARGET.table)
    for eps in (0.1, 0.5, 1.0):
        q = TARGET.perturb(eps, seed=5).table
        tv = 0.5 * (q - TARGET.table).abs().sum(-1)  # (states,)
        assert bool((tv <= eps + 1e-12).all())
        assert bool((acceptance_rate(TARGET.table, q) >= 1 - eps - 1e-12).all())
    with pytest.raises(ValueError):
        TARGET.perturb(1.5, seed=0)
    with pytest.raises(ValueError):
        MarkovLM.from_config(ToyConfig(order=3))


def test_direct_sampling_matches_exact_joint():
    # 20,000 sequences of 3 tokens, 64 cells: power 0.99 against TV >= 0.033
    n, L = 20_000, 3
    toks = sample_direct(TARGET, PREFIX, L, n, torch.Generator().manual_seed(0))
    r = chi_square_gof(counts(joint_index(toks, 4), 4 ** L), TARGET.joint_probs(PREFIX, L).numpy())
    assert r.p_value > ALPHA, r
    assert detectable_tv(n, 4 ** L, alpha=ALPHA, power=0.99) < 0.035


def _transition_pvalue(toks: torch.Tensor, model: MarkovLM, prefix: torch.Tensor, sampling=SamplingConfig()):
    """Every generated token given its state (previous two tokens) against the model's row: one
    chi-square per state, statistics and dofs added (rows with the same state are exchangeable)."""
    full = torch.cat([prefix.expand(toks.shape[0], -1), toks], 1)  # (S, T0+L)
    T0 = prefix.shape[0]
    states = torch.stack([model.states(full, torch.full((full.shape[0],), T0 + i)) for i in range(toks.shape[1])], 1)
    V = model.vocab
    table = np.bincount((states * V + toks).reshape(-1).numpy(), minlength=model.table.shape[0] * V)
    table = table.reshape(-1, V)  # (states, V)
    rows = model.next_probs(torch.arange(model.table.shape[0])[:, None] // V ** torch.arange(model.order - 1, -1, -1)
                            % V, None, sampling).double()  # (states, V): contexts spelling each state
    stat, dof = 0.0, 0
    for s in np.flatnonzero(table.sum(1)):
        r = chi_square_gof(table[s], (rows[s] / rows[s].sum()).numpy())
        stat, dof = stat + r.statistic, dof + r.dof
    return float(stats.chi2.sf(stat, dof))


def test_seed_exercise_speculative_loop_matches_target():
    # The seed exercise: 10,000 sequences x 5 tokens = 50,000 tokens from the speculative
    # loop (k = 3, draft = target perturbed by eps 0.5), against (a) the exact joint of the 5 tokens
    # (1024 cells), (b) every token given its state (50,000 transitions), (c) direct target sampling
    # (two-sample test). The correct algorithm gives p > 0.05 on each (fixed seeds).
    # Power: 10,000 sequences over <= 1024 cells detect TV >= 0.1 with power 0.99; the transition
    # test (16 states x 4) sees a per-state TV of 0.03 with power 0.99 on its ~3,000 visits/state.
    n, L = 10_000, 5
    toks, forwards, accepted = speculative_sample(TARGET, DRAFT, PREFIX, L, n, k=3,
                                                  generator=torch.Generator().manual_seed(0))
    assert toks.shape == (n, L) and toks.numel() == 50_000
    assert L / forwards.double().mean() > 1.5  # tokens per target forward (~1.9 here)
    exact = TARGET.joint_probs(PREFIX, L).numpy()
    joint = chi_square_gof(counts(joint_index(toks, 4), 4 ** L), exact)
    trans = _transition_pvalue(toks, TARGET, PREFIX)
    direct = sample_direct(TARGET, PREFIX, L, n, torch.Generator().manual_seed(1))
    two = chi_square_two_sample(counts(joint_index(toks, 4), 4 ** L), counts(joint_index(direct, 4), 4 ** L))
    assert joint.p_value > 0.05 and trans > 0.05 and two.p_value > 0.05, (joint, trans, two)
    assert detectable_tv(n, 1024, alpha=ALPHA, power=0.99) < 0.1


@pytest.mark.parametrize("draft_greedy,sampling", [
    (True, SamplingConfig()),  # deterministic draft (its argmax, q None)
    (False, SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)),  # warped target and draft
    (True, SamplingConfig(temperature=1.5, top_k=3)),
])
def test_speculative_loop_variants_match_target(draft_greedy, sampling):
    n, L = 10_000, 5  # 50,000 tokens, power as in the seed exercise
    toks, _, _ = speculative_sample(TARGET, DRAFT, PREFIX, L, n, k=4, sampling=sampling,
                                    draft_greedy=draft_greedy, generator=torch.Generator().manual_seed(2))
    exact = TARGET.joint_probs(PREFIX, L, sampling).numpy()
    assert chi_square_gof(counts(joint_index(toks, 4), 4 ** L), exact).p_value > ALPHA
    assert _transition_pvalue(toks, TARGET, PREFIX, sampling) > ALPHA


def _no_residual(d, p, q, *, lengths=None, generator=None):
    """Mutant: after a rejection, resample from p instead of max(0, p - q)."""
    res = verify_chain(d, p, q, lengths=lengths, generator=generator)
    n = res.num_accepted
    rows = torch.arange(d.shape[0])
    redraw = sample(p[rows, n], generator)  # (B,)
    last = torch.where(n < lengths, redraw, res.tokens[rows, n])
    return ChainResult(res.tokens.scatter(1, n[:, None], last[:, None]), n)


def _accept_all(d, p, q, *, lengths=None, generator=None):
    """Mutant: no accept test at all (every draft kept), bonus from p."""
    rows = torch.arange(d.shape[0])
    bonus = sample(p[rows, lengths], generator)
    tokens = torch.cat([d, torch.full_like(d[:, :1], -1)], 1).scatter(1, lengths[:, None], bonus[:, None])
    return ChainResult(tokens, lengths.clone())


@pytest.mark.parametrize("mutant", [_no_residual, _accept_all])
def test_seed_exercise_rejects_wrong_loops(mutant):
    n, L = 10_000, 5
    toks, _, _ = speculative_sample(TARGET, DRAFT, PREFIX, L, n, k=3, verify=mutant,
                                    generator=torch.Generator().manual_seed(0))
    exact = TARGET.joint_probs(PREFIX, L).numpy()
    assert chi_square_gof(counts(joint_index(toks, 4), 4 ** L), exact).p_value < ALPHA
    assert _transition_pvalue(toks, TARGET, PREFIX) < ALPHA


def test_identical_draft_is_always_accepted():
    # eps = 0: q == p exactly, so every draft is accepted and each step emits k + 1 tokens
    toks, forwards, accepted = speculative_sample(TARGET, TARGET.perturb(0.0, seed=9), PREFIX, 8, 100, k=3,
                                                  generator=torch.Generator().manual_seed(0))
    assert forwards.tolist() == [2] * 100 and accepted.tolist() == [6] * 100  # 4 + 4 tokens; the last step drafts 3 then stops
