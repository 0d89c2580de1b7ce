"""Tests of medusa_heads.py, medusa_tree.py, typical.py and training/medusa.py: training, greedy
parity for three tree shapes, losslessness of tree sampling (chi-square against the exact joint),
typical acceptance REJECTED by the same test, the tree construction, weights, errors."""
import itertools

import numpy as np
import pytest
import torch

from _stats import power_sample_size
from _features import feature_data, feature_target
from specref import oracle
from specref.generate import autoregressive_generate, speculative_generate
from specref.eagle_head import EagleHead
from specref.medusa_heads import MedusaConfig, MedusaHeads, MedusaProposer, load_medusa, save_medusa
from specref.picker.costs import measure_heads_cost
from specref.training import deepen, hydra_from_medusa, hydra_on_eagle
from specref.medusa_tree import (DEFAULT_CHOICES, best_tree, check_choices, expected_accepted, greedy_tree,
                                 tree_arrays)
from specref.models import tiny_model
from specref.oracle.exact import hf_joint_distribution
from specref.proposer import Context
from specref.sampling import SamplingConfig
from specref.target import additive_mask
from specref.training.data import Batch
from specref.training.draft import build_token_map
from specref.training.loop import TrainConfig, fit, split_heldout
from specref.training.medusa import MedusaTask, MedusaTrainConfig, rank_accuracies
from specref.training.transfer import per_category
from specref.typical import TypicalAcceptance, verify_tree_typical

V = 16
SHAPES = {
    "chain": ((0,), (0, 0), (0, 0, 0)),
    "default": DEFAULT_CHOICES,
    "wide": ((0,), (1,), (2,), (3,), (4,), (0, 0), (1, 0), (0, 1), (2, 0), (0, 0, 0)),
}


_target, _data = feature_target, feature_data  # tests/_features.py


@pytest.fixture(scope="module")
def trained():
    """(target, heads, history): 3 heads over a 12-token draft vocabulary, 150 steps."""
    target = _target()
    train, held = split_heldout(_data(target, 160), 0.2, seed=0)
    heads = MedusaHeads(target, 3, build_token_map(train, V, 12))
    cfg = TrainConfig(steps=150, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=150, seed=0)
    res = fit(MedusaTask(heads, MedusaTrainConfig(ranks=4)), train, held, cfg, progress=False, log=lambda s: None)
    return target, heads.eval(), res.history


def test_training_lowers_every_heads_loss(trained):
    _, heads, hist = trained
    first, last = hist[0], hist[-1]
    a0, a1 = rank_accuracies(first, 3, 4), rank_accuracies(last, 3, 4)
    for k in range(1, 4):  # the soft CE falls and the argmax agreement rises for every head
        assert last[f"heldout_h{k}_ce"] < first[f"heldout_h{k}_ce"] - 0.5, (k, first, last)
    assert a1[:, 0].mean() > a0[:, 0].mean() + 0.02, (a0, a1)  # from the identity heads' start
    assert a1[0, 0] > a1[2, 0], a1  # the nearer position is the easier one
    assert np.allclose(a1.sum(1) <= 1 + 1e-9, True)  # per-rank hits of one argmax: a distribution's part


def test_transfer_measure_scores_every_head(trained):
    """training/transfer.py on Medusa heads: head k's top-1 (over its own label positions) is the
    training's held-out rank-0 accuracy a_k(0), per category and overall."""
    target, heads, hist = trained
    _, held = split_heldout(_data(target, 160), 0.2, seed=0)  # the fixture's held-out part
    cats = ["a", "b"] * (len(held) // 2)
    res = per_category(MedusaTask(heads, MedusaTrainConfig(ranks=4)), held[:len(cats)], cats, batch_size=16)
    whole = per_category(MedusaTask(heads, MedusaTrainConfig(ranks=4)), held, ["x"] * len(held), batch_size=16)
    assert whole["all"]["top1_by_depth"] == pytest.approx(rank_accuracies(hist[-1], 3, 4)[:, 0].tolist())
    assert res["all"]["top1"] == res["all"]["top1_by_depth"][0] and res["all"]["accept"] is None
    assert len(res["a"]["top1_by_depth"]) == 3 and res["a"]["top1_by_depth"] != res["b"]["top1_by_depth"]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_parity_ragged_batch(trained, shape):
    target, heads, _ = trained
    g = torch.Generator().manual_seed(len(shape))
    ids = torch.randint(0, V, (4, 9), generator=g)
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 8]).view(4, 1)).long()  # left padding; row 3: 1 token
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    prop = MedusaProposer(heads, MedusaConfig(choices=SHAPES[shape]))
    sp = speculative_generate(target, prop, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > 1.2, sp.stats  # the trained heads are accepted
    for b in range(4):  # batch 1: each row alone
        one = speculative_generate(target, MedusaProposer(heads, MedusaConfig(choices=SHAPES[shape])),
                                   ids[b:b + 1], mask[b:b + 1], max_new_tokens=20, temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


SMALL = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))  # siblings at two levels, depth 3


_RUNS = {}  # (temperature, top_k, acceptance) -> result: the lossless runs serve both tests below


def _joint_test(trained, temperature, top_k, acceptance, n=50_000, L=2, seed=5):
    key = (temperature, top_k, acceptance)
    if key not in _RUNS:
        _RUNS[key] = _joint_run(trained, temperature, top_k, acceptance, n, L, seed)
    return _RUNS[key]


def _joint_run(trained, temperature, top_k, acceptance, n, L, seed):
    target, heads, _ = trained
    prompt = torch.tensor([3, 1, 4, 1, 5])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(temperature, top_k)).numpy()
    prop = MedusaProposer(heads, MedusaConfig(choices=SMALL, acceptance=acceptance))
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L, temperature=temperature,
                               top_k=top_k, generator=torch.Generator().manual_seed(seed))
    counts = oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L)
    tv = 0.5 * float(np.abs(counts / n - exact).sum())
    return exact, oracle.chi_square_gof(counts, exact), tv, out.stats


@pytest.mark.two_threads
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_lossless_tree_sampling_whole_loop(trained, temperature, top_k):
    """Joint of the first 2 tokens vs exact (256 cells), 50,000 rows; power >= 0.99 against TV
    0.02 at 1e-3 is asserted. The siblings are distinct top-s tokens: q = None, one-hot."""
    exact, res, tv, s = _joint_test(trained, temperature, top_k, "lossless")
    assert power_sample_size(exact, 50_000) <= 50_000
    assert res.p_value > 1e-3, (res, tv)
    assert s.num_accepted_tokens > 10_000 and s.num_draft_tokens - s.num_accepted_tokens > 10_000, s


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_typical_acceptance_is_rejected_as_lossy(trained, temperature, top_k):
    """The same test, same power, REJECTS Medusa's typical acceptance; its TV from the exact joint
    is well above the lossless mode's sampling noise (measured: see the closing note)."""
    _, res_l, tv_l, s_l = _joint_test(trained, temperature, top_k, "lossless")
    _, res, tv, s = _joint_test(trained, temperature, top_k, "typical")
    print(f"T={temperature} top_k={top_k}: typical TV {tv:.4f} p {res.p_value:.3g} tokens/forward "
          f"{s.tokens_per_forward:.3f}; lossless TV {tv_l:.4f} p {res_l.p_value:.3g} {s_l.tokens_per_forward:.3f}")
    assert res.p_value < 1e-6, (res, tv)
    assert tv > tv_l + 0.02, (tv, tv_l)


def test_sampled_rows_are_batch_independent(trained):
    target, heads, _ = trained
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(3))
    gens = lambda rows: [torch.Generator().manual_seed(100 + b) for b in rows]  # noqa: E731
    for acc in ("lossless", "typical"):
        batch = speculative_generate(target, MedusaProposer(heads, MedusaConfig(acceptance=acc)), ids,
                                     max_new_tokens=16, temperature=1.0, generator=gens(range(3)))
        for b in range(3):
            one = speculative_generate(target, MedusaProposer(heads, MedusaConfig(acceptance=acc)), ids[b:b + 1],
                                       max_new_tokens=16, temperature=1.0, generator=gens([b]))
            assert one.row(0) == batch.row(b), acc


def test_typical_rule_by_hand():
    # tree: node 0 (token 1) and node 1 (token 2) children of the root; node 2 (token 3) under node 0
    tokens, parents = torch.tensor([[1, 2, 3]]), torch.tensor([[-1, -1, 0]])
    p = torch.zeros(1, 4, 4)
    p[0, 0] = torch.tensor([0.05, 0.45, 0.5, 0.0])  # root: tokens 1 and 2 pass (thr = 0.09)
    p[0, 1] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # after node 0: token 3 passes -> path of 2
    p[0, 2] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    p[0, 3] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # after node 2: the final token is 2
    res = verify_tree_typical(tokens, parents, p, TypicalAcceptance(), generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [2] and res.path.tolist() == [[0, 2]] and res.tokens.tolist() == [[1, 3, 2]]
    # node 0's token now fails at the root (0.05 < min(0.09, 0.3 e^-H)), so the path is node 1 alone;
    # the final token after node 1 comes from its typical set: all four pass (0.25 > 0.075)
    p[0, 0] = torch.tensor([0.45, 0.05, 0.5, 0.0])
    res = verify_tree_typical(tokens, parents, p, TypicalAcceptance(), generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [1] and res.path.tolist() == [[1, -1]]
    # equally long passing paths: the more likely one wins (node 1, p 0.5 > node 0's 0.45)
    p[0, 0] = torch.tensor([0.05, 0.45, 0.5, 0.0])
    res = verify_tree_typical(torch.tensor([[1, 2]]), torch.tensor([[-1, -1]]), p[:, :3], TypicalAcceptance(),
                              generator=torch.Generator().manual_seed(0))
    assert res.path.tolist() == [[1]]
    # the final token never comes from outside the typical set: p = [0.95, 0.05 * 4 tail] at a leaf
    q = torch.full((1, 1, 6), 0.01)
    q[0, 0, 0] = 0.95
    fin = [int(verify_tree_typical(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), q,
                                   generator=torch.Generator().manual_seed(s)).tokens[0, 0]) for s in range(200)]
    assert set(fin) == {0}


def test_greedy_tree_is_the_best_tree_of_its_size():
    acc = np.array([[0.5, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.05]])
    every = [c for d in range(1, 4) for c in itertools.product(range(3), repeat=d)]
    for n in (1, 3, 5):  # brute force over every n-node tree (prefix-closed sets)
        best = max(expected_accepted(t, acc) for t in itertools.combinations(every, n)
                   if all(len(c) == 1 or c[:-1] in t for c in t))
        assert expected_accepted(greedy_tree(acc, n), acc) == pytest.approx(best)
    assert greedy_tree(acc, 3) == [(0,), (1,), (0, 0)]  # 0.5, 0.2, 0.5 * 0.4
    assert expected_accepted([(0,), (0, 0)], acc) == pytest.approx(0.5 + 0.2)
    # best_tree: a free verify block takes the largest tree; a steep one a single node
    n_free = len(best_tree(acc, [1.0] * 9)[0])
    n_steep = len(best_tree(acc, [1.0 + 2.0 * w for w in range(9)])[0])
    assert n_free == 8 and n_steep == 1
    parents, head, rank = tree_arrays(check_choices([(1,), (0, 0), (0,)], 2))
    assert parents.tolist() == [-1, -1, 0] and head.tolist() == [0, 0, 1] and rank.tolist() == [0, 1, 0]


def test_weights_round_trip_and_errors(trained, tmp_path):
    target, heads, _ = trained
    save_medusa(tmp_path / "m.safetensors", heads, __import__("specref").weights.fingerprint(target), {},
                choices=[(0,), (1,), (0, 0)])
    again = load_medusa(target, tmp_path / "m.safetensors")
    assert again.choices == [(0,), (1,), (0, 0)] and torch.equal(again.token_map, heads.token_map)
    h = torch.randn(5, heads.hidden_size)
    assert torch.allclose(again(h), heads(h), atol=2e-2)  # stored as float16
    other = tiny_model("llama", vocab_size=V, seed=99)
    with pytest.raises(ValueError, match="fingerprint"):
        load_medusa(other, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="no Medusa heads file"):
        load_medusa(target, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="depth 4 but there are only 3 heads"):
        MedusaProposer(heads, MedusaConfig(choices=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))))
    with pytest.raises(ValueError, match=r"needs its parent \(0, 1\)"):
        MedusaProposer(heads, MedusaConfig(choices=((0,), (0, 1, 0))))
    with pytest.raises(ValueError, match="rank 12 but the draft vocabulary has 12"):
        MedusaProposer(heads, MedusaConfig(choices=((12,),)))
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        MedusaHeads(target, 0)
    with pytest.raises(ValueError, match="acceptance must be"):
        MedusaConfig(acceptance="fast")
    with pytest.raises(ValueError, match="posterior_alpha"):
        MedusaConfig(posterior_alpha=0)
    with pytest.raises(ValueError, match="appears twice"):
        check_choices([(0,), (0,)], 2)
    prop = MedusaProposer(heads)
    prop.acceptance_rule = "typical"
    with pytest.raises(ValueError, match="acceptance_rule must be None or a TypicalAcceptance"):
        speculative_generate(target, prop, torch.tensor([1, 2]), max_new_tokens=2)


@pytest.mark.two_threads
def test_hybrid_with_medusa_trees(trained):
    """Prompt lookup's chains and Medusa's trees in one tree draft (HybridProposer "select"):
    greedy parity on a ragged batch, and the whole-loop chi-square at T = 1 with both sources used."""
    from specref.hybrid import HybridProposer
    from specref.ngram import NgramConfig, NgramProposer

    target, heads, _ = trained
    make = lambda acc="lossless": HybridProposer(NgramProposer(NgramConfig(min_n=1, max_n=2, k=3)),  # noqa: E731
                                                 MedusaProposer(heads, MedusaConfig(choices=SMALL, acceptance=acc)))
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2], [0, 0, 5, 6, 5, 6, 5, 6], [0, 0, 0, 0, 9, 8, 7, 9]])
    mask = (torch.arange(8) >= torch.tensor([0, 2, 4]).view(3, 1)).long()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=16, temperature=0)
    prop = make()
    sp = speculative_generate(target, prop, ids, mask, max_new_tokens=16, temperature=0)
    assert torch.equal(ar.tokens, sp.tokens) and min(prop.source_counts) > 0, prop.source_counts
    n, L = 50_000, 2
    prompt = torch.tensor([1, 2, 1, 2, 1])
    exact = hf_joint_distribution(target, prompt, L, SamplingConfig(1.0)).numpy()
    prop = make()
    out = speculative_generate(target, prop, prompt.expand(n, -1), max_new_tokens=L, temperature=1.0,
                               generator=torch.Generator().manual_seed(9))
    res = oracle.chi_square_gof(oracle.counts(oracle.joint_index(out.tokens[:, :L].numpy(), V), V ** L), exact)
    assert power_sample_size(exact, n) <= n and res.p_value > 1e-3, res
    assert min(prop.source_counts) > 1000, prop.source_counts
    with pytest.raises(ValueError, match="verifies losslessly"):
        make("typical")


# ----------------------------------------------------------------------------- Hydra (sequential heads)


@pytest.fixture(scope="module")
def hydra(trained):
    """(target, Medusa heads, Hydra heads started from them and trained 150 more steps, history)."""
    target, heads, _ = trained
    train, held = split_heldout(_data(target, 160), 0.2, seed=0)
    seq = hydra_from_medusa(target, heads)
    cfg = TrainConfig(steps=150, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=150, seed=0)
    res = fit(MedusaTask(seq, MedusaTrainConfig(ranks=4)), train, held, cfg, progress=False, log=lambda s: None)
    return target, heads, seq.eval(), res.history


def test_hydra_starts_as_medusa_and_learns_from_the_tokens(trained, hydra):
    """hydra_from_medusa: the same logits as the Medusa heads whatever the tokens; training its input
    projections then raises every head's held-out agreement above where Medusa's training left it."""
    target, heads, seq, hist = hydra
    h = torch.randn(7, heads.hidden_size)
    toks = torch.randint(0, V, (7, 3))
    start = hydra_from_medusa(target, heads)
    assert torch.allclose(start(h, tokens=toks), heads(h), atol=1e-6)
    assert torch.equal(deepen(start, 3)(h, tokens=toks), start(h, tokens=toks)) and start.num_layers == 3  # identity
    assert len(start.blocks[0]) == 3 and len(dict(start.trainable())) > len(dict(seq.trainable()))
    with pytest.raises(ValueError, match="num_layers must be an int >= the heads' 3"):
        deepen(start, 2)
    a0, a1 = rank_accuracies(hist[0], 3, 4), rank_accuracies(hist[-1], 3, 4)
    assert np.allclose(a0, rank_accuracies(trained[2][-1], 3, 4))  # its first evaluation is Medusa's last
    assert (a1[:, 0] > a0[:, 0] + 0.02).all(), (a0, a1)
    assert not torch.allclose(seq.head(1, h, toks[:, :1]), seq.head(1, h, (toks[:, :1] + 1) % V))  # reads x_{t+1}
    with pytest.raises(ValueError, match="Hydra head 2 needs tokens of shape"):
        seq.head(2, h, toks[:, :1])
    with pytest.raises(ValueError, match="not already sequential"):
        hydra_from_medusa(target, seq)


def test_hydra_tree_is_each_heads_top_tokens_given_the_nodes_path(hydra):
    """Node (i_1, .., i_d) is the rank-i_d token of head d given x_r and the tokens of its ancestors."""
    _, _, seq, _ = hydra
    choices = check_choices(SMALL, 3)
    g = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(8):
        ids = torch.randint(0, V, (2, 6), generator=g)  # the last: the pending x_r
        feats = 3 * torch.randn(2, 5, seq.hidden_size, generator=g)  # (B, W, D) any features
        ctx = Context(tokens=ids, lengths=torch.tensor([6, 6]), active=torch.tensor([True, True]), hidden=feats,
                      hidden_len=torch.tensor([5, 5]))
        prop = MedusaProposer(seq, MedusaConfig(choices=SMALL))
        prop.begin(ctx, SamplingConfig(0.0), None)
        d = prop.propose(ctx, SamplingConfig(0.0), None)
        for b in range(2):
            got = dict(zip(choices, d.tokens[b].tolist()))
            for c in choices:
                path = [int(ids[b, 5])] + [got[c[:j]] for j in range(1, len(c))]
                z = seq.head(len(c), feats[b, -1], torch.tensor(path))  # (Vd,)
                assert got[c] == int(seq.token_map[z.topk(c[-1] + 1).indices[-1]]), (b, c)
            differ += got[(0, 0)] != got[(1, 0)]
    assert differ > 0  # depth 2 depends on its parent: Medusa's tree would repeat head 2's top token


def _greedy_parity_and_batch_independence(target, heads, min_tau: float = 1.2):
    """Greedy output equals the target's on a ragged batch (the wide tree), and each row alone equals
    its row in the batch; trained heads draft more than one token per forward (min_tau)."""
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(9) >= torch.tensor([0, 3, 5, 8]).view(4, 1)).long()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20, temperature=0, eos_token_id=7)
    sp = speculative_generate(target, MedusaProposer(heads, MedusaConfig(choices=SHAPES["wide"])), ids, mask,
                              max_new_tokens=20, temperature=0, eos_token_id=7)
    assert torch.equal(ar.tokens, sp.tokens) and torch.equal(ar.num_tokens, sp.num_tokens)
    assert sp.stats.tokens_per_forward > min_tau, sp.stats
    for b in range(4):
        one = speculative_generate(target, MedusaProposer(heads, MedusaConfig(choices=SHAPES["wide"])),
                                   ids[b:b + 1], mask[b:b + 1], max_new_tokens=20, temperature=0, eos_token_id=7)
        assert one.row(0) == sp.row(b)


def test_hydra_greedy_parity_and_batch_independence(hydra):
    target, _, seq, _ = hydra
    _greedy_parity_and_batch_independence(target, seq)


@pytest.mark.two_threads
def test_hydra_lossless_tree_sampling_whole_loop(hydra):
    """The Medusa chi-square (first 2 tokens, 256 cells, 50,000 rows, power >= 0.99 against TV 0.02)
    on Hydra's trees: siblings still a function of the history, so the acceptance stays exact."""
    target, _, seq, _ = hydra
    exact, res, tv, s = _joint_run((target, seq, None), 1.0, 0, "lossless", 50_000, 2, 6)
    assert res.p_value > 1e-3, (res, tv)
    assert s.num_accepted_tokens > 10_000 and s.num_draft_tokens - s.num_accepted_tokens > 10_000, s


def test_hydra_weights_round_trip(hydra, tmp_path):
    target, _, seq, _ = hydra
    save_medusa(tmp_path / "y.safetensors", seq, __import__("specref").weights.fingerprint(target), {},
                choices=[(0,), (0, 0)])
    again = load_medusa(target, tmp_path / "y.safetensors")
    assert again.sequential and again.choices == [(0,), (0, 0)]
    h, toks = torch.randn(5, seq.hidden_size), torch.randint(0, V, (5, 3))
    assert torch.allclose(again(h, tokens=toks), seq(h, tokens=toks), atol=3e-2)  # stored as float16


# ----------------------------------------------------------------------------- Hydra++'s prefix layer


@pytest.fixture(scope="module", params=["attention", "layer", "pairs", "eagle"])
def prefixed(request, hydra):
    """(target, Hydra heads, their history, the same heads given a prefix layer and trained 150 more
    steps, its history). "eagle": a fresh current-token EAGLE head, its x_t columns random."""
    target, _, seq, seq_hist = hydra
    train, held = split_heldout(_data(target, 160), 0.2, seed=0)
    pre = _copy(target, seq)
    if request.param == "eagle":
        e = EagleHead(target, seq.token_map, current_token=True)
        with torch.no_grad():
            e.fc.weight[:, 2 * seq.hidden_size:].normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
        pre.add_prefix(target, "eagle", e)
    else:
        pre.add_prefix(target, request.param)
    cfg = TrainConfig(steps=150, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=150, seed=0)
    res = fit(MedusaTask(pre, MedusaTrainConfig(ranks=4)), train, held, cfg, progress=False, log=lambda s: None)
    return target, seq, seq_hist, pre.eval(), res.history


def _copy(target, heads):
    """An independent copy of MedusaHeads."""
    out = MedusaHeads(target, heads.num_heads, heads.token_map, num_layers=heads.num_layers,
                      own_lm_head=heads.own_lm_head, sequential=heads.sequential, prefix=heads.prefix_kind)
    out.load_state_dict(heads.state_dict())
    return out


def _causal(B, T, dtype=torch.float32):
    return additive_mask(torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T), dtype)  # (B, 1, T, T)


def test_prefix_starts_as_the_heads_and_learns_to_read_the_prefix(prefixed):
    """add_prefix: the identity (its first held-out evaluation is the Hydra heads' last; "eagle": the
    EAGLE head given); training then moves its residual branches, and a state it hands the heads
    depends on earlier positions (never later ones), "pairs" and "eagle" on the token after each
    state, a current-token "eagle" on the token at it."""
    target, seq, seq_hist, pre, hist = prefixed
    kind = pre.prefix_kind
    h = torch.randn(2, 6, seq.hidden_size)  # (B, T, D)
    pos, nxt, cur = torch.arange(6).expand(2, 6), torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6))  # (B, T)
    ctx = lambda states, toks=nxt, c=cur: pre.contextualise(states, pos, _causal(2, 6), next_tokens=toks,  # noqa: E731
                                                          cur_tokens=c)
    if kind != "eagle":
        start = _copy(target, seq).add_prefix(target, kind)
        assert torch.equal(start.contextualise(h, pos, _causal(2, 6), next_tokens=nxt), h)
        assert np.allclose(rank_accuracies(hist[0], 3, 4), rank_accuracies(seq_hist[-1], 3, 4))
        assert float(pre.prefix.self_attn.o_proj.weight.detach().abs().max()) > 0
    assert seq.contextualise(h, pos, None) is h  # no prefix: the target's states themselves
    a = ctx(h)
    first, last = h.clone(), h.clone()
    first[:, 0] += 1.0
    last[:, 5] += 1.0
    assert not torch.allclose(ctx(first)[:, 5], a[:, 5])  # reads position 0
    assert torch.equal(ctx(last)[:, :5], a[:, :5])  # causal
    other, other_cur = nxt.clone(), cur.clone()
    other[:, 2], other_cur[:, 2] = (other[:, 2] + 1) % V, (other_cur[:, 2] + 1) % V
    if kind in ("pairs", "eagle"):  # reads the token after each state
        assert not torch.allclose(ctx(h, other)[:, 4], a[:, 4])
        with pytest.raises(ValueError, match=f"'{kind}' prefix needs next_tokens"):
            pre.contextualise(h, pos, _causal(2, 6))
    else:
        assert torch.equal(ctx(h, other), a)
    if kind == "eagle":  # and the token at it
        assert not torch.allclose(ctx(h, nxt, other_cur)[:, 4], a[:, 4])
    else:
        assert torch.equal(ctx(h, nxt, other_cur), a)
    with pytest.raises(ValueError, match="already have a prefix"):
        pre.add_prefix(target, "layer")
    with pytest.raises(ValueError, match="prefix must be one of"):
        _copy(target, seq).add_prefix(target, "mlp")
    with pytest.raises(ValueError, match="not a Llama-family causal LM"):
        _copy(target, seq).add_prefix(torch.nn.Linear(2, 2), "layer")
    with pytest.raises(ValueError, match="of kind 'eagle' only"):
        _copy(target, seq).add_prefix(target, "layer", EagleHead(target, seq.token_map))
    with pytest.raises(ValueError, match="an 'eagle' prefix is an EAGLE-1 EagleHead"):
        _copy(target, seq).add_prefix(target, "eagle", torch.nn.Linear(2, 2))


def test_prefix_cache_gives_the_training_states(prefixed):
    """The proposer feeds the prefix layer each verification's committed states on its own cache
    (ragged rows, several steps); the state it hands the heads is at every step the one training
    computes over the whole history in one causal pass."""
    _, _, _, pre, _ = prefixed
    g = torch.Generator().manual_seed(3)
    B, T, D = 3, 14, pre.hidden_size
    feats = torch.randn(B, T, D, generator=g)  # (B, T, D) the target's states at positions 0..T-1
    tokens = torch.randint(0, V, (B, T + 1), generator=g)  # (B, T + 1) the tokens x_0 .. x_T
    full = pre.contextualise(feats, torch.arange(T).expand(B, T), _causal(B, T), next_tokens=tokens[:, 1:],
                             cur_tokens=tokens[:, :T])  # (B, T, D)
    valid = torch.arange(T).view(1, T) < torch.tensor([T, 9, 11]).view(B, 1)  # (B, T) right-padded rows
    batch = Batch(tokens[:, :T] * valid, valid, valid, torch.zeros(B, T, 1, dtype=torch.long),
                  torch.zeros(B, T, 1), torch.where(valid[..., None], feats, 0.0))
    trained_on = MedusaTask(pre)._states(batch)  # (B, T, D) what training hands the heads
    last = valid & ~torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], 1)  # no token after it in the batch
    assert torch.allclose(trained_on[valid & ~last], full[valid & ~last], atol=1e-5)
    prop = MedusaProposer(pre, MedusaConfig(choices=SMALL))
    done = torch.tensor([4, 1, 6])  # (B,) states committed by the prefill (prompt length - 1)
    steps = [torch.tensor([2, 3, 1]), torch.tensor([0, 4, 3]), torch.tensor([3, 1, 0])]
    for i, n in enumerate([done] + steps):
        start = done if i else torch.zeros(B, dtype=torch.long)  # (B,) position of hidden[:, 0]
        W = max(int(n.max()), 1)
        hidden = torch.randn(B, W, D, generator=g)  # padding past each row's n: never read
        for b in range(B):
            hidden[b, :n[b]] = feats[b, start[b]:start[b] + n[b]]
        ctx = Context(tokens=tokens, lengths=start + n + 1,
                      active=torch.ones(B, dtype=torch.bool), hidden=hidden, hidden_len=n)
        if i == 0:
            prop.begin(ctx, SamplingConfig(0.0), None)
        else:
            prop.update(ctx, n)
            done = done + n
        want = full[torch.arange(B), (done - 1).clamp(min=0)]  # (B, D)
        assert torch.allclose(prop.last, want, atol=1e-5), (i, (prop.last - want).abs().max())
        assert torch.equal(prop.cache.lengths, done)


def test_prefix_greedy_parity_ragged_batch(prefixed):
    target, _, _, pre, _ = prefixed
    _greedy_parity_and_batch_independence(target, pre)


@pytest.mark.two_threads
@pytest.mark.parametrize("kind", ["layer", "eagle"])
def test_prefix_lossless_tree_sampling_whole_loop(hydra, kind):
    """The Medusa chi-square (first 2 tokens, 256 cells, 50,000 rows) on Hydra heads reading a prefix
    layer (random residual branches, so the layer matters; "eagle": Hydra heads on a random
    current-token EAGLE head, hydra_on_eagle): its states are the history's, the siblings still a
    function of the history, the acceptance exact."""
    target, _, seq, _ = hydra
    g = torch.Generator().manual_seed(8)
    if kind == "layer":
        pre = _copy(target, seq).add_prefix(target, "layer")
        with torch.no_grad():
            for w in (pre.prefix.self_attn.o_proj.weight, pre.prefix.mlp.down_proj.weight):
                w.copy_(0.1 * torch.randn(w.shape, generator=g))
    else:
        e = EagleHead(target, seq.token_map, seed=2, current_token=True)
        with torch.no_grad():
            e.fc.weight[:, 2 * seq.hidden_size:].normal_(0, 0.05, generator=g)
        pre = hydra_on_eagle(target, seq, e)
    exact, res, tv, s = _joint_run((target, pre.eval(), None), 1.0, 0, "lossless", 50_000, 2, 9)
    assert res.p_value > 1e-3, (res, tv)
    assert s.num_accepted_tokens > 10_000 and s.num_draft_tokens - s.num_accepted_tokens > 10_000, s


def test_prefix_weights_round_trip(prefixed, tmp_path):
    target, _, _, pre, _ = prefixed
    save_medusa(tmp_path / "p.safetensors", pre, __import__("specref").weights.fingerprint(target), {})
    again = load_medusa(target, tmp_path / "p.safetensors")
    assert again.prefix_kind == pre.prefix_kind and again.sequential
    assert set(dict(again.trainable())) == set(dict(pre.trainable()))
    h, nxt, cur = torch.randn(2, 5, pre.hidden_size), torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    assert torch.allclose(again.contextualise(h, pos, _causal(2, 5), next_tokens=nxt, cur_tokens=cur),
                          pre.contextualise(h, pos, _causal(2, 5), next_tokens=nxt, cur_tokens=cur),
                          atol=3e-2)  # stored as float16
    assert measure_heads_cost(target, pre, reps=3)["c"] > 0  # the heads' step with the prefix layer's


def test_hydra_on_eagle_starts_as_the_eagle_head_and_the_hydra_heads(hydra):
    """hydra_on_eagle: head 1's logits are the EAGLE head's (its first draft), head k >= 2 is the Hydra
    heads' head k - 1 one position on (the prefix's f^_{t+1} read as h_{t+1}); the draft vocabulary
    is the EAGLE head's. Greedy parity through the whole loop."""
    target, medusa, seq, _ = hydra
    D = seq.hidden_size
    e = EagleHead(target, torch.arange(V), seed=3, current_token=True)
    with torch.no_grad():
        e.fc.weight[:, 2 * D:].normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    out = hydra_on_eagle(target, seq, e, 3)
    assert out.prefix_kind == "eagle" and out.num_heads == 3 and torch.equal(out.token_map, e.token_map)
    h, pos = torch.randn(2, 6, D), torch.arange(6).expand(2, 6)
    nxt, cur, toks = (torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6)),
                      torch.randint(0, V, (2, 6, 3)))  # x_{t+1}, x_t and x_{t+1} .. x_{t+3}
    f = out.contextualise(h, pos, _causal(2, 6), next_tokens=nxt, cur_tokens=cur)  # (B, T, D) f^_{t+1}
    with torch.no_grad():
        assert torch.allclose(out.head(1, f, toks[..., :1]), e.logits(e(h, nxt, pos, _causal(2, 6), cur_tokens=cur)),
                              atol=1e-6)
        for k in (2, 3):  # the Hydra head k - 1 on (f^_{t+1}, x_{t+2} ..), at the target ids both can draft
            assert torch.allclose(out.head(k, f, toks[..., :k])[..., seq.token_map],
                                  seq.head(k - 1, f, toks[..., 1:k]), atol=1e-5)
    with pytest.raises(ValueError, match="needs sequential MedusaHeads"):
        hydra_on_eagle(target, medusa, e)
    with pytest.raises(ValueError, match=r"num_heads must be an int in \[1, 4\]"):
        hydra_on_eagle(target, seq, e, 5)
    _greedy_parity_and_batch_independence(target, out, min_tau=0.0)  # an untrained EAGLE head: rarely accepted


def test_prefix_kinds_live_in_medusa_prefix():
    from specref import medusa_prefix
    assert set(medusa_prefix.PREFIX_KINDS) == {"attention", "layer", "pairs", "eagle"}
